"""Load a diffusers-format Helios folder (``HeliosPipeline``: ``BestWishYsh/Helios-Base``, ``-Mid``, ``-Distilled``)
into its components, and describe one from its configs alone.

Invariants:
- The same loading path and errors as the other families (``models.common.loading``: local files only, a
  ``ModelLoadError`` naming the subfolder and what is wrong with it; eval mode, ``device``, ``dtype``), except that
  the VAE stays float32, as ``HeliosPipeline``'s example loads it.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, HeliosDMDScheduler, HeliosScheduler, HeliosTransformer3DModel
from transformers import T5Tokenizer, UMT5EncoderModel

from cp_infer import VideoGeometry
from models.common.folder_problems import ModelLoadError
from models.common.loading import (
    ModelFiles,
    _load_components,
    _model_files,
    _require_dir,
    describe_wan_vae_folder,
    read_json_config,
)

from .options import Pyramid

__all__ = ["HeliosComponents", "describe_helios", "load_helios", "read_pyramid"]

_SUBFOLDERS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
_SCHEDULERS = {"HeliosScheduler": HeliosScheduler, "HeliosDMDScheduler": HeliosDMDScheduler}
_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


@dataclass(frozen=True)
class HeliosComponents:
    """The components of one loaded Helios folder (``HeliosPipeline``'s)."""

    transformer: HeliosTransformer3DModel
    """The denoiser, eval mode, in `dtype` on `device`."""
    vae: AutoencoderKLWan
    """Wan's causal video VAE (8x spatial, 4x temporal), eval mode, float32, `device`."""
    scheduler: HeliosScheduler
    """Stateful; a request runs a fresh one of its config."""
    text_encoder: UMT5EncoderModel
    tokenizer: T5Tokenizer
    path: Path
    dtype: torch.dtype
    device: torch.device
    pyramid: Pyramid | None = None
    """A ``HeliosPyramidPipeline`` folder's stages and settings (:func:`read_pyramid`); ``None``: ``HeliosPipeline``."""


class _Transformer:
    """``HeliosTransformer3DModel.from_pretrained`` with ``low_cpu_mem_usage=True``: the class keeps modules in
    float32 (``_keep_in_fp32_modules``), for which diffusers refuses ``low_cpu_mem_usage=False``."""

    @staticmethod
    def from_pretrained(*args: Any, **kwargs: Any) -> HeliosTransformer3DModel:
        return HeliosTransformer3DModel.from_pretrained(*args, **{**kwargs, "low_cpu_mem_usage": True})


def describe_helios(path: str | os.PathLike) -> tuple[VideoGeometry, int]:
    """``(geometry, layers)`` of a Helios folder, from its configs alone (no weights). ``HeliosPipeline.check_inputs``
    takes sizes that are multiples of 16: the 8x VAE's and the 2x2 patches' step."""
    return describe_wan_vae_folder(path)


def read_pyramid(path: str | os.PathLike) -> Pyramid | None:
    """What a ``HeliosPyramidPipeline`` folder runs, from its ``model_index.json`` (``is_cfg_zero_star``,
    ``is_distilled``) and scheduler config (``stages``, the class); ``None`` for a ``HeliosPipeline`` folder."""
    root = _require_dir(path)
    index = read_json_config(root / "model_index.json")
    if index.get("_class_name") != "HeliosPyramidPipeline":
        return None
    scheduler = read_json_config(root / "scheduler" / "scheduler_config.json")
    dmd = scheduler.get("_class_name") == "HeliosDMDScheduler" or scheduler.get("scheduler_type") == "dmd"
    return Pyramid(stages=int(scheduler.get("stages", 3)), cfg_zero_star=bool(index.get("is_cfg_zero_star", False)),
                   distilled=bool(index.get("is_distilled", False)), dmd=dmd)


def load_helios(path: str | os.PathLike | ModelFiles, *, dtype: str | torch.dtype = torch.float32,
                device: str | torch.device = "cpu", loaders: dict[str, Any] | None = None,
                offloaded: Collection[str] = ()) -> HeliosComponents:
    """Load a Helios diffusers folder (e.g. BestWishYsh/Helios-Base, or ``ensure_default_helios_model()``). The VAE
    is float32 whatever ``dtype`` is, as ``HeliosPipeline``'s example loads it. ``offloaded``: the components left on
    the CPU (``--offload``)."""
    files = _model_files(path)
    if files.checkpoint is not None:
        raise ModelLoadError("single-file checkpoints are read for LTX-Video and LTX-2; load a Helios model from its "
                             "diffusers folder")
    components = _load_components(
        files, HeliosComponents, family="helios", what="Helios", subfolders=_SUBFOLDERS,
        models=(("transformer", _Transformer), ("vae", AutoencoderKLWan)), text_encoder=UMT5EncoderModel,
        tokenizer=T5Tokenizer, tokenizer_files=_TOKENIZER_FILES, dtype=dtype, device=device, loaders=loaders,
        schedulers=_SCHEDULERS, float32=("vae",), offloaded=offloaded)
    return replace(components, pyramid=read_pyramid(files.folder))
