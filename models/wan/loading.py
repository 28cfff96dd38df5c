"""Load a diffusers-format Wan folder (``WanPipeline`` or ``WanImageToVideoPipeline``: Wan 2.1, Wan 2.2 A14B and
TI2V-5B) into its components, and describe one from its configs alone.

Invariants:
- The same loading path and errors as the other families (``models.common.loading``: local files only, a
  ``ModelLoadError`` naming the subfolder and what is wrong with it; eval mode, ``device``, ``dtype``), except that
  the VAE and the image encoder stay float32, as diffusers' Wan examples keep them.
- What the folder's pipeline is (one or two experts, image-to-video, per-token timesteps, CLIP image tokens) is
  read from its ``model_index.json`` and transformer config once (:class:`models.wan.options.WanLayout`): the
  options, the adapter and the description all take it from there.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
    WanTransformer3DModel,
)
from transformers import CLIPVisionModel, T5Tokenizer, UMT5EncoderModel

from cp_infer import VideoGeometry
from models.common.folder_problems import ModelLoadError
from models.common.loading import (
    ModelFiles,
    _load,
    _load_components,
    _model_files,
    _require_dir,
    describe_wan_vae_folder,
    read_json_config,
)

from .options import WanLayout

__all__ = ["WanComponents", "describe_wan", "load_wan", "wan_layout"]

_SUBFOLDERS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
# Wan's diffusers folders ship UniPC on flow-matching sigmas; some fine-tunes ship the flow-matching Euler one.
_SCHEDULERS = {"UniPCMultistepScheduler": UniPCMultistepScheduler,
               "FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler}
_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


@dataclass(frozen=True)
class WanComponents:
    """The components of one loaded Wan folder (``WanPipeline``'s, with ``WanImageToVideoPipeline``'s image ones)."""

    transformer: WanTransformer3DModel
    """The denoiser (Wan 2.2 A14B: the high-noise expert), eval mode, in `dtype` on `device`."""
    vae: AutoencoderKLWan
    """Wan's causal video VAE (8x or 16x spatial, 4x temporal), eval mode, `dtype`, `device`."""
    scheduler: Any
    """UniPC (or flow-matching Euler); stateful, reset by every request's ``set_timesteps``."""
    text_encoder: UMT5EncoderModel
    tokenizer: T5Tokenizer
    path: Path
    dtype: torch.dtype
    device: torch.device
    layout: WanLayout = WanLayout()
    transformer_2: WanTransformer3DModel | None = None
    """Wan 2.2 A14B's low-noise expert; ``None`` for one expert."""
    image_encoder: CLIPVisionModel | None = None
    """Wan 2.1 I2V's CLIP vision tower (its second-to-last hidden states are the image tokens); else ``None``."""
    image_processor: Any = None
    """Its ``CLIPImageProcessor``; ``None`` without an image encoder."""


class _Transformer:
    """``WanTransformer3DModel.from_pretrained`` with ``low_cpu_mem_usage=True``.

    NOTE(fp32-modules): the class keeps modules in float32 (``_keep_in_fp32_modules``), for which diffusers refuses
    ``low_cpu_mem_usage=False`` (the other families' setting); the weights read are the same."""

    @staticmethod
    def from_pretrained(*args: Any, **kwargs: Any) -> WanTransformer3DModel:
        return WanTransformer3DModel.from_pretrained(*args, **{**kwargs, "low_cpu_mem_usage": True})


def wan_layout(path: str | os.PathLike) -> WanLayout:
    """The pipeline a Wan folder holds, from its ``model_index.json`` and ``transformer/config.json``."""
    root = Path(path)
    return WanLayout.from_index(read_json_config(root / "model_index.json"),
                                read_json_config(root / "transformer" / "config.json"))


def describe_wan(path: str | os.PathLike) -> tuple[VideoGeometry, int, WanLayout]:
    """``(geometry, layers, layout)`` of a Wan folder, from its configs alone (no weights)."""
    geometry, layers = describe_wan_vae_folder(path)
    return geometry, layers, wan_layout(path)


def load_wan(path: str | os.PathLike | ModelFiles, *, dtype: str | torch.dtype = torch.float32,
             device: str | torch.device = "cpu", loaders: dict[str, Any] | None = None,
             offloaded: Collection[str] = ()) -> WanComponents:
    """Load a Wan diffusers folder (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers, or ``ensure_default_wan_model()``): its
    ``WanPipeline`` components, the second expert of Wan 2.2 A14B, and the image encoder of Wan 2.1 I2V. The VAE and
    the image encoder are float32 whatever ``dtype`` is, as diffusers' Wan examples load them (``WanPipeline``'s and
    ``WanImageToVideoPipeline``'s docstrings). ``offloaded``: the components left on the CPU (``--offload``)."""
    files = _model_files(path)
    if files.checkpoint is not None:
        raise ModelLoadError("single-file checkpoints are read for LTX-Video and LTX-2; load a Wan model from its "
                             "diffusers folder")
    root = _require_dir(files.folder)
    layout = wan_layout(root)
    models: list[tuple[str, Any]] = [("transformer", _Transformer), ("vae", AutoencoderKLWan)]
    if layout.experts == 2:
        models.append(("transformer_2", _Transformer))
    components = _load_components(
        files, WanComponents, family="wan", what="Wan", subfolders=_SUBFOLDERS + tuple(n for n, _ in models[2:]),
        models=tuple(models), text_encoder=UMT5EncoderModel, tokenizer=T5Tokenizer, tokenizer_files=_TOKENIZER_FILES,
        dtype=dtype, device=device, loaders=loaders, schedulers=_SCHEDULERS, float32=("vae",), offloaded=offloaded)
    extra: dict[str, Any] = {"layout": layout}
    if layout.image_tokens:
        from transformers import CLIPImageProcessor

        for name in ("image_encoder", "image_processor"):
            if not (root / name).is_dir():
                raise ModelLoadError(f"{str(root)!r} is a Wan 2.1 image-to-video folder (its transformer takes image "
                                     f"tokens) without {name}/; restore it from the checkpoint the folder came from")
        encoder = _load(root, "image_encoder", CLIPVisionModel.from_pretrained, dtype=torch.float32)
        extra["image_encoder"] = (encoder if "image_encoder" in offloaded else encoder.to(components.device)).eval()
        extra["image_processor"] = _load(root, "image_processor", CLIPImageProcessor.from_pretrained,
                                         config="preprocessor_config.json", weights=False)
    return replace(components, **extra)

