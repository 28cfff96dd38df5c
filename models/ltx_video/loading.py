"""Load a diffusers-format LTX-Video folder (``LTXPipeline``, ``LTXImageToVideoPipeline``, ``LTXConditionPipeline``:
the same five components) into its components, on the shared loading path (``models.common.loading``: local files
only, a ``ModelLoadError`` naming the subfolder and what is wrong with it; eval mode, ``device``, ``dtype``)."""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel
from transformers import T5EncoderModel, T5Tokenizer

from models.common.loading import ModelFiles, _load_components, _model_files, _with_latent_upsampler

__all__ = ["LTXVideoComponents", "load_ltx_video"]

_LTX_VIDEO_SUBFOLDERS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
# Either one carries the vocabulary: tokenizer.json (tokenizers) or spiece.model (SentencePiece).
_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")


@dataclass(frozen=True)
class LTXVideoComponents:
    """The five LTXPipeline components of one loaded LTX-Video folder."""

    transformer: LTXVideoTransformer3DModel
    """Denoiser, eval mode, in `dtype` on `device`."""
    vae: AutoencoderKLLTXVideo
    """Video VAE (32x spatial, 8x temporal compression), eval mode, `dtype` (see NOTE(vae-dtype))."""
    scheduler: FlowMatchEulerDiscreteScheduler
    """Stateful sampler schedule; copy it per request rather than sharing one across requests."""
    text_encoder: T5EncoderModel
    """T5 encoder, eval mode, in `dtype` on `device`."""
    tokenizer: T5Tokenizer
    """Tokenizers-backed T5 tokenizer (in transformers 5 `T5TokenizerFast` is the same class)."""
    path: Path
    """The folder the components were loaded from."""
    dtype: torch.dtype
    """Parameter dtype of the three models."""
    device: torch.device
    """Device of the three models."""
    latent_upsampler: LTXLatentUpsamplerModel | None = None
    """The 2x latent upsampler of two-stage generation (``latent_upsampler/``), eval mode, `dtype`, `device`;
    ``None`` when the folder has none."""
    checkpoint: Path | None = None
    """The single-file checkpoint the transformer and VAE came from (``--model file --config``); ``None``: the
    folder's own."""


def load_ltx_video(
    path: str | os.PathLike | ModelFiles, *, dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu", loaders: dict[str, Any] | None = None, offloaded: Collection[str] = ()
) -> LTXVideoComponents:
    """Load an LTX-Video diffusers folder (e.g. Lightricks/LTX-Video, or `ensure_default_model()`), with its latent
    upsampler where it has ``latent_upsampler/``; or the model of ``resolve_files`` (a single-file checkpoint with
    its config folder, a paired upsampler). `offloaded`: the components left on the CPU (``_load_components``)."""
    files = _model_files(path)
    components = _load_components(
        files,
        LTXVideoComponents,
        family="ltx-video",
        what="LTX-Video",
        subfolders=_LTX_VIDEO_SUBFOLDERS,
        models=(("transformer", LTXVideoTransformer3DModel), ("vae", AutoencoderKLLTXVideo)),
        text_encoder=T5EncoderModel,
        tokenizer=T5Tokenizer,
        tokenizer_files=_TOKENIZER_FILES,
        dtype=dtype,
        device=device,
        loaders=loaders,
        offloaded=offloaded,
    )
    return _with_latent_upsampler(components, LTXLatentUpsamplerModel, files.upsampler)
