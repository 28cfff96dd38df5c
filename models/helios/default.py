"""The embedded default Helios model "tiny-helios": the real classes ``HeliosPipeline`` takes at toy width, weights
from a seed, for tests and benchmarks.

Invariants:
- The classes are the real diffusers/transformers ones (``HeliosTransformer3DModel`` with its short, mid and long
  history patch embeddings, ``AutoencoderKLWan``, ``HeliosScheduler``, ``UMT5EncoderModel``, a T5 tokenizer), so
  every code path the engine exercises on them is the one a real Helios checkpoint takes.
- The VAE keeps Wan 2.1's compression (8x spatial, 4x temporal, 16 channels): a chunk of 9 latent frames decodes to
  33 video frames, as ``BestWishYsh/Helios-Base``'s does.
- The transformer has 5 heads (they divide neither 2 nor 3 ranks: the engine's padded heads) and amplifies the
  history's keys (``is_amplify_history``), so that path is exercised too.
- Weights are a pure function of ``_SEED`` and the parameter names and shapes
  (``models.common.embedded.init_deterministic``, one generator per component); two builds are bitwise identical.
- ``ensure_default_helios_model`` builds the folder in one process, never exposes a half-written one, and rebuilds
  one whose files no longer match its marker (``models.common.embedded.ensure_folder``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLWan,
    HeliosDMDScheduler,
    HeliosPipeline,
    HeliosPyramidPipeline,
    HeliosScheduler,
    HeliosTransformer3DModel,
)
from transformers import UMT5Config, UMT5EncoderModel

from models.common.embedded import cache_root, ensure_folder, init_deterministic, write_pipeline
from models.common.tokenizer import build_offline_t5_tokenizer
from models.helios import DEFAULT_NAME

__all__ = ["HELIOS_FORMAT_VERSION", "HELIOS_SCHEDULER_CONFIG", "build_helios_pipeline", "default_helios_model_dir",
           "ensure_default_helios_model", "save_helios_model"]

# Bump when a config, the vocabulary or the init rule changes: the folder name carries it, so an old cache is never
# mistaken for the new model.
HELIOS_FORMAT_VERSION = 1
_FOLDER_NAME = f"{DEFAULT_NAME}-v{HELIOS_FORMAT_VERSION}"

_SEED = 20_260_301
_COMPONENT_SEED_OFFSETS = {"text_encoder": 0, "transformer": 1, "vae": 3}
# The VAE's last conv maps to pixels in [-1, 1]: at unit gain most decoded pixels clip, at this gain a few percent do.
_GAINS = {"vae": {"decoder.head.2.weight": 0.3}}

_T5_D_MODEL = 32
_HEADS = 5
_HEAD_DIM = 12

HELIOS_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    stages=1,
    scheduler_type="unipc",
    use_dynamic_shifting=True,
    time_shift_type="exponential",
    prediction_type="flow_prediction",
    solver_order=2,
)
"""``HeliosPipeline``'s schedule: one stage, UniPC on flow sigmas, shifted by ``mu`` from the chunk's token count
(``calculate_shift``), as the pipeline calls ``set_timesteps(steps, sigmas=..., mu=...)``."""

_PYRAMID_STAGES = dict(stages=2, stage_range=[0, 0.5, 1], gamma=0.2)
"""The toy pyramids' two stages (a 32x32 chunk's coarse stage is 2x2 latents: one token a frame). The block noise's
covariance over a 2x2 patch, ``(1 + gamma) I - gamma 1``, is positive definite for gamma < 1/4 only (the schedulers'
default 1/3 fails its Cholesky factorisation in float32)."""


def _latent_stats(channels: int) -> tuple[list[float], list[float]]:
    """Per-channel latent mean and std (plain numbers, as a real VAE config holds them): fixed, varied, std > 0."""
    mean = [round(0.4 * math.sin(1.7 * i), 4) for i in range(channels)]
    std = [round(1.0 + 0.8 * abs(math.cos(0.9 * i)), 4) for i in range(channels)]
    return mean, std


def _build_text_encoder(vocab_size: int) -> UMT5EncoderModel:
    # UMT5 (per-layer relative attention biases, gated-GELU) as google/umt5-xxl, Helios's (Wan's) text encoder.
    config = UMT5Config(vocab_size=vocab_size, d_model=_T5_D_MODEL, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False)
    return UMT5EncoderModel(config)


def _build_transformer() -> HeliosTransformer3DModel:
    # rope_dim: the head's 12 channels as 4 (time) + 4 (rows) + 4 (columns), as Helios-Base's 128 are 44 + 42 + 42.
    return HeliosTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM, in_channels=16,
        out_channels=16, text_dim=_T5_D_MODEL, freq_dim=32, ffn_dim=96, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_dim=(4, 4, 4), guidance_cross_attn=True,
        zero_history_timestep=True, has_multi_term_memory_patch=True, is_amplify_history=True)


def _build_vae() -> AutoencoderKLWan:
    mean, std = _latent_stats(16)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)


def build_helios_pipeline(pyramid: str | None = None) -> HeliosPipeline | HeliosPyramidPipeline:
    """tiny-helios as its diffusers pipeline (float32, CPU, eval mode). ``pyramid``: the same components as a
    ``HeliosPyramidPipeline`` of two stages with CFG-Zero*: ``"unipc"`` (``HeliosScheduler``) or ``"dmd"`` (a
    distilled model's ``HeliosDMDScheduler``)."""
    # HeliosPipeline pads every prompt to max_sequence_length (512).
    tokenizer = build_offline_t5_tokenizer(model_max_length=512)
    vocab_size = 64 * math.ceil(len(tokenizer) / 64)
    builders = {"text_encoder": lambda: _build_text_encoder(vocab_size), "transformer": _build_transformer,
                "vae": _build_vae}
    # fork_rng: construction runs torch's own random init, which must not advance the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        models = {name: build() for name, build in builders.items()}
    for name, model in models.items():
        init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS[name], _GAINS.get(name))
        model.eval()
    if pyramid is None:
        return HeliosPipeline(**models, scheduler=HeliosScheduler(**HELIOS_SCHEDULER_CONFIG), tokenizer=tokenizer)
    if pyramid == "unipc":
        scheduler = HeliosScheduler(**{**HELIOS_SCHEDULER_CONFIG, **_PYRAMID_STAGES})
    else:
        assert pyramid == "dmd", pyramid
        scheduler = HeliosDMDScheduler(**_PYRAMID_STAGES, use_dynamic_shifting=True, time_shift_type="linear")
    return HeliosPyramidPipeline(**models, scheduler=scheduler, tokenizer=tokenizer, is_cfg_zero_star=True,
                                 is_distilled=pyramid == "dmd")


def save_helios_model(folder: str | os.PathLike, pyramid: str | None = None) -> Path:
    """Write tiny-helios (``pyramid``: as :func:`build_helios_pipeline`) as a diffusers folder at ``folder``;
    return it (not cached, not marked as the default)."""
    folder = Path(folder)
    write_pipeline(build_helios_pipeline(pyramid), folder)
    return folder


def default_helios_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where "tiny-helios" lives: ``cache_dir``, else ``$CP_INFER_CACHE``, else ``~/.cache/cp-infer``."""
    return cache_root(cache_dir) / _FOLDER_NAME


def _marker() -> dict[str, Any]:
    return {"name": DEFAULT_NAME, "format_version": HELIOS_FORMAT_VERSION}


def ensure_default_helios_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the diffusers-format folder of "tiny-helios" (``model_index.json`` ``_class_name`` "HeliosPipeline"),
    building it first if it is absent or its files no longer match its marker. Safe to call from many processes."""
    return ensure_folder(default_helios_model_dir(cache_dir), marker=_marker(),
                         write=lambda folder: write_pipeline(build_helios_pipeline(), folder))
