"""Load a diffusers-format LTX-2 folder (``LTX2Pipeline``, ``LTX2ImageToVideoPipeline``) into its components, on the
shared loading path (``models.common.loading``: local files only, a ``ModelLoadError`` naming the subfolder and what is
wrong with it; eval mode, ``device``, ``dtype``)."""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from transformers import Gemma3ForConditionalGeneration, GemmaTokenizer

from models.common.loading import ModelFiles, _load_components, _model_files, _with_latent_upsampler

__all__ = ["LTX2Components", "load_ltx2"]

_LTX2_SUBFOLDERS = (
    "transformer",
    "vae",
    "audio_vae",
    "vocoder",
    "connectors",
    "scheduler",
    "text_encoder",
    "tokenizer",
)
# Either one carries Gemma's vocabulary: tokenizer.json (tokenizers) or tokenizer.model (SentencePiece).
_GEMMA_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# vocoder/config.json `_class_name` -> class: LTX-2.0 ships the plain vocoder, LTX-2.3 the one with bandwidth
# extension (48 kHz); LTX2Pipeline takes either.
_VOCODERS = {"LTX2Vocoder": LTX2Vocoder, "LTX2VocoderWithBWE": LTX2VocoderWithBWE}


@dataclass(frozen=True)
class LTX2Components:
    """The eight LTX2Pipeline components of one loaded LTX-2 folder."""

    transformer: LTX2VideoTransformer3DModel
    """Audio-video denoiser, eval mode, in `dtype` on `device`."""
    vae: AutoencoderKLLTX2Video
    """Video VAE (32x spatial, 8x temporal compression), eval mode, in `dtype` on `device`."""
    audio_vae: AutoencoderKLLTX2Audio
    """Audio VAE (mel spectrogram <-> latents, 4x in time), eval mode, in `dtype` on `device`."""
    vocoder: LTX2Vocoder | LTX2VocoderWithBWE
    """Mel spectrogram -> waveform at `vocoder.config.output_sampling_rate`, eval mode, `dtype`, `device`."""
    connectors: LTX2TextConnectors
    """Text connectors (Gemma hidden states -> video and audio prompt embeddings), eval, `dtype`, `device`."""
    scheduler: FlowMatchEulerDiscreteScheduler
    """Stateful sampler schedule; copy it per request rather than sharing one across requests."""
    text_encoder: Gemma3ForConditionalGeneration
    """Gemma 3 (the pipeline reads its per-layer hidden states), eval mode, in `dtype` on `device`."""
    tokenizer: GemmaTokenizer
    """Tokenizers-backed Gemma tokenizer (in transformers 5 `GemmaTokenizerFast` is the same class)."""
    path: Path
    """The folder the components were loaded from."""
    dtype: torch.dtype
    """Parameter dtype of the six models."""
    device: torch.device
    """Device of the six models."""
    latent_upsampler: LTX2LatentUpsamplerModel | None = None
    """The 2x latent upsampler of two-stage generation (``latent_upsampler/``, diffusers' layout), eval mode,
    `dtype`, `device`; ``None`` when the folder has none."""
    checkpoint: Path | None = None
    """The single-file checkpoint the transformer and VAEs came from (``--model file --config``); ``None``: the
    folder's own."""


def load_ltx2(
    path: str | os.PathLike | ModelFiles, *, dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu", loaders: dict[str, Any] | None = None, offloaded: Collection[str] = ()
) -> LTX2Components:
    """Load an LTX-2 diffusers folder (e.g. Lightricks/LTX-2, or `ensure_default_ltx2_model()`), with its latent
    upsampler where it has ``latent_upsampler/``; or the model of ``resolve_files`` (a single-file checkpoint with its
    config folder, a paired upsampler). `offloaded`: the components left on the CPU (``_load_components``)."""
    files = _model_files(path)
    components = _load_components(
        files,
        LTX2Components,
        family="ltx2",
        what="LTX-2",
        subfolders=_LTX2_SUBFOLDERS,
        models=(
            ("transformer", LTX2VideoTransformer3DModel),
            ("vae", AutoencoderKLLTX2Video),
            ("audio_vae", AutoencoderKLLTX2Audio),
            ("vocoder", _VOCODERS),
            ("connectors", LTX2TextConnectors),
        ),
        text_encoder=Gemma3ForConditionalGeneration,
        tokenizer=GemmaTokenizer,
        tokenizer_files=_GEMMA_TOKENIZER_FILES,
        dtype=dtype,
        device=device,
        loaders=loaders,
        offloaded=offloaded,
    )
    return _with_latent_upsampler(components, LTX2LatentUpsamplerModel, files.upsampler)
