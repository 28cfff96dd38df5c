"""The embedded default model "tiny-ltx-video": real LTX-Video classes at toy width, weights from a seed.

Invariants:
- The classes are the real diffusers/transformers ones (`LTXVideoTransformer3DModel`,
  `AutoencoderKLLTXVideo`, `FlowMatchEulerDiscreteScheduler`, `T5EncoderModel`, `T5Tokenizer`), so every code
  path the engine exercises on it is the one a real LTX-Video checkpoint takes.
- The VAE keeps the real compression: 32x spatial, 8x temporal (8k+1 frames -> k+1 latent frames).
- A latent upsampler (`LTXLatentUpsamplerModel`, 2x spatial, as LTX-Video 0.9.7+ ships it for two-stage
  generation) is saved beside the pipeline in `latent_upsampler/`.
- Weights are a pure function of `_SEED` and the parameter names and shapes: every parameter is overwritten
  in sorted-name order from one seeded generator per component (`models.common.embedded.init_deterministic`), so
  torch's init code (and the caller's global RNG) play no part, and two builds are bitwise identical.
- `ensure_default_model` builds the folder in one process, never exposes a half-written one, and rebuilds one
  whose files no longer match the size and sha256 its marker lists (`models.common.embedded.ensure_folder`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel
from transformers import T5Config, T5EncoderModel

from models.common.embedded import (
    LATENT_UPSAMPLER,
    LTX_SCHEDULER_CONFIG,
    MARKER_FILE,
    cache_root,
    ensure_folder,
    init_deterministic,
    write_pipeline,
)
from models.common.tokenizer import build_offline_t5_tokenizer
from models.ltx_video import DEFAULT_NAME

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FORMAT_VERSION",
    "LTX_SCHEDULER_CONFIG",
    "MARKER_FILE",
    "build_default_components",
    "build_latent_upsampler",
    "default_model_dir",
    "ensure_default_model",
]

DEFAULT_MODEL_NAME = DEFAULT_NAME
# Bump when the config, the vocabulary or the init rule changes: the folder name carries it, so an old
# cache is never mistaken for the new model.
FORMAT_VERSION = 2
_FOLDER_NAME = f"{DEFAULT_MODEL_NAME}-v{FORMAT_VERSION}"

_SEED = 20_250_601
# One generator per component, so resizing one component leaves the others' weights unchanged.
_COMPONENT_SEED_OFFSETS = {"text_encoder": 0, "transformer": 1, "vae": 2, "latent_upsampler": 3}
# Extra factors on top of the generic init. The VAE's last conv maps to pixels in [-1, 1]; at unit gain
# about a third of the decoded pixels clip, at 0.4 the frames have std ~0.4 and a few percent clip.
_GAINS = {"vae": {"decoder.conv_out.conv.weight": 0.4}}

_LATENT_CHANNELS = 16
_T5_D_MODEL = 32
_HEADS = 4
_HEAD_DIM = 8

def _build_text_encoder(vocab_size: int) -> T5EncoderModel:
    # T5 v1.1 shape (gated-GELU feed-forward, untied head) as in the t5-v1_1-xxl encoder LTX-Video uses.
    config = T5Config(
        vocab_size=vocab_size,
        d_model=_T5_D_MODEL,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        feed_forward_proj="gated-gelu",
        dropout_rate=0.0,
        tie_word_embeddings=False,
    )
    return T5EncoderModel(config)


def _build_transformer() -> LTXVideoTransformer3DModel:
    inner_dim = _HEADS * _HEAD_DIM
    return LTXVideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM,
        cross_attention_dim=inner_dim,
        num_layers=2,
        caption_channels=_T5_D_MODEL,
    )


def _build_vae() -> AutoencoderKLLTXVideo:
    # Shaped like the LTX-Video 0.9.1 VAE (timestep-conditioned decoder with residual depth-to-space
    # upsamplers), at 4-32 channels and one layer per block. Spatial ratio = patch_size 4 * 2**3 = 32,
    # temporal = 2**3 = 8, from the three scaling stages on each side.
    # NOTE(decoder-widths): decoder_block_out_channels must double stage by stage, (8, 16, 32) here, which
    # runs at 32 (mid) then 16, 8, 4 channels: the depth-to-space upsampler with upsample_factor 2 halves
    # the width, and a stage whose input and output widths differ gets a timestep-conditioned conv_in that
    # crashes on the raw timestep (diffusers 0.42). The real 0.9.1 VAE, (256, 512, 1024), obeys the same.
    # NOTE(decode-noise): decoder_inject_noise is off although 0.9.1 turns it on: the pipeline calls
    # vae.decode without a generator, so injected noise would come from the global RNG and make the
    # default model's frames differ between runs and between ranks of a sharded decode.
    return AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 16, 16, 16),
        down_block_types=("LTXVideoDownBlock3D",) * 4,
        layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_block_out_channels=(8, 16, 32),
        decoder_layers_per_block=(1, 1, 1, 1),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        timestep_conditioning=True,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )


def build_default_components() -> dict[str, Any]:
    """Build the five LTXPipeline components in memory (float32, CPU, eval mode), keyed by pipeline name."""
    tokenizer = build_offline_t5_tokenizer()
    # Round the embedding table up as T5 does (32100 tokens, 32128 rows); ids stay below len(tokenizer).
    vocab_size = 64 * math.ceil(len(tokenizer) / 64)
    # fork_rng: construction runs torch's own random init, which must not advance the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        models = {
            "text_encoder": _build_text_encoder(vocab_size),
            "transformer": _build_transformer(),
            "vae": _build_vae(),
        }
    for name, model in models.items():
        init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS[name], _GAINS.get(name))
        model.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER_CONFIG)
    return {**models, "scheduler": scheduler, "tokenizer": tokenizer}


def build_latent_upsampler() -> LTXLatentUpsamplerModel:
    """The 2x spatial latent upsampler of two-stage generation (float32, CPU, eval mode), at 32 channels (512 real)
    and one residual block per stage (4 real), 3-D convolutions as ``ltxv-spatial-upscaler-0.9.7``."""
    with torch.random.fork_rng(devices=[]):
        model = LTXLatentUpsamplerModel(in_channels=_LATENT_CHANNELS, mid_channels=32, num_blocks_per_stage=1,
                                        dims=3, spatial_upsample=True, temporal_upsample=False)
    init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS["latent_upsampler"])
    return model.eval()


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default model lives: `cache_dir`, else `$CP_INFER_CACHE`, else `~/.cache/cp-infer`."""
    return cache_root(cache_dir) / _FOLDER_NAME


def _marker() -> dict[str, Any]:
    return {"name": DEFAULT_MODEL_NAME, "format_version": FORMAT_VERSION}


def _write_model(folder: Path) -> None:
    build_latent_upsampler().save_pretrained(folder / LATENT_UPSAMPLER, safe_serialization=True)
    write_pipeline(LTXPipeline(**build_default_components()), folder)


def ensure_default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the diffusers-format folder of the default model, building it first if it is absent.

    Safe to call from many processes at once (e.g. every torchrun rank): one builds, the others wait for it. A
    folder whose files no longer match its marker is rebuilt.
    """
    return ensure_folder(default_model_dir(cache_dir), marker=_marker(), write=_write_model)
