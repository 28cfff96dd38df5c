"""The embedded default LTX-2 model "tiny-ltx2": the real LTX-2 classes at toy width, weights from a seed.

Invariants:
- The classes are the real diffusers/transformers ones `LTX2Pipeline` takes (`LTX2VideoTransformer3DModel`,
  `AutoencoderKLLTX2Video`, `AutoencoderKLLTX2Audio`, `LTX2Vocoder`, `LTX2TextConnectors`,
  `Gemma3ForConditionalGeneration`, `GemmaTokenizer`, `FlowMatchEulerDiscreteScheduler`), wired as LTX-2.0
  wires them, so every code path the engine exercises on it is the one a real LTX-2 checkpoint takes.
- The video VAE keeps the real compression: 32x spatial, 8x temporal (8k+1 frames -> k+1 latent frames).
- A latent upsampler (`LTX2LatentUpsamplerModel`, 2x spatial, as LTX-2 ships it for two-stage generation) is saved
  beside the pipeline in `latent_upsampler/`, the subfolder diffusers' LTX-2 repositories keep it in.
- The audio path keeps the real structure and rates: 16 kHz mel spectrograms (64 bins, hop 160, stereo) ->
  audio VAE latents (4x in time and in mel) -> vocoder -> 24 kHz stereo waveform (upsampling 240x).
- Weights are a pure function of `_SEED`, the rope type and the parameter names and shapes
  (`models.common.embedded.init_deterministic`, one generator per component); two builds are bitwise identical.
- `ensure_default_ltx2_model` builds the folder in one process, never exposes a half-written one, and rebuilds
  one whose files no longer match its marker (`models.common.embedded.ensure_folder`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

from models.common.embedded import (
    LATENT_UPSAMPLER,
    LTX_SCHEDULER_CONFIG,
    cache_root,
    ensure_folder,
    init_deterministic,
    write_pipeline,
)
from models.common.tokenizer import build_offline_gemma_tokenizer
from models.ltx2 import DEFAULT_NAME

__all__ = [
    "DEFAULT_LTX2_NAME",
    "LTX2_FORMAT_VERSION",
    "ROPE_TYPES",
    "LATENT_UPSAMPLER",
    "build_ltx2_components",
    "build_ltx2_latent_upsampler",
    "default_ltx2_model_dir",
    "ensure_default_ltx2_model",
    "save_ltx2_model",
]

DEFAULT_LTX2_NAME = DEFAULT_NAME
# Bump when a config, the vocabulary or the init rule changes: the folder name carries it, so an old cache is
# never mistaken for the new model.
LTX2_FORMAT_VERSION = 2
_FOLDER_NAME = f"{DEFAULT_LTX2_NAME}-v{LTX2_FORMAT_VERSION}"

# "interleaved" is the diffusers default of LTX2VideoTransformer3DModel and LTX2TextConnectors; the LTX-2.0
# checkpoint itself ships "split". Both are supported so tests can cover either.
ROPE_TYPES = ("interleaved", "split")
_DEFAULT_ROPE_TYPE = "interleaved"

_SEED = 20_260_101
_COMPONENT_SEED_OFFSETS = {
    "text_encoder": 0,
    "connectors": 1,
    "transformer": 2,
    "vae": 3,
    "audio_vae": 4,
    "vocoder": 5,
    "latent_upsampler": 6,
}
# Extra factors on top of the generic init. The video VAE's last conv maps to pixels in [-1, 1]; at 0.4 the
# decoded frames have std ~0.25 and well under 1% clip (as in models.ltx_video.default). The vocoder needs none: its
# tanh output comes out at std ~0.07, far from saturation.
_GAINS = {"vae": {"decoder.conv_out.conv.weight": 0.4}}

# Gemma 3 text tower: hidden size = the connectors' caption_channels; hidden_states = layers + 1 (embeddings),
# which the pipeline stacks and the connectors read as text_proj_in_factor (49 for Gemma-3-12B).
_TEXT_HIDDEN = 32
_TEXT_LAYERS = 2
# Video stream: latent channels (128 real) and 2 heads x 16; audio stream: 2 heads x 8. The audio and video
# head counts must match: the a2v/v2a cross-attention rope is built with the video head count.
_LATENT_CHANNELS = 16
_HEADS = 2
_HEAD_DIM = 16
_AUDIO_HEAD_DIM = 8
# Audio VAE: 64 mel bins -> 16 latent mel bins x 2 latent channels = 32 features per audio token.
# NOTE(audio-stats): AutoencoderKLLTX2Audio sizes its latents_mean/std buffers by base_channels, yet the
# pipeline applies them to packed latents of latent_channels * mel_bins // 4 features; the two must be equal
# (128 = 8 * 16 in LTX-2.0), so base_channels is 32 here rather than an arbitrary width.
_MEL_BINS = 64
_AUDIO_LATENT_CHANNELS = 2
_AUDIO_FEATURES = _AUDIO_LATENT_CHANNELS * _MEL_BINS // 4
_AUDIO_CHANNELS = 2  # stereo


def _build_text_encoder(vocab_size: int) -> Gemma3ForConditionalGeneration:
    # LTX2Pipeline reads `hidden_states` of the full multimodal model (as for google/gemma-3-12b-it), so the
    # class is the ConditionalGeneration one, vision tower included; the vision tower is never run for text.
    # One sliding and one full-attention layer, as Gemma 3 interleaves them (5:1 in the real model).
    text_config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        num_hidden_layers=_TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=2048,
    )
    # 28 px images of 14 px patches: 2x2 patches pooled to mm_tokens_per_image = 4 soft tokens.
    vision_config = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    config = Gemma3Config(
        text_config=text_config.to_dict(), vision_config=vision_config.to_dict(), mm_tokens_per_image=4
    )
    return Gemma3ForConditionalGeneration(config)


def _build_connectors(rope_type: str) -> LTX2TextConnectors:
    # LTX-2.0 connectors (one shared projection of all Gemma layers, then a video and an audio 1-D
    # transformer) at 2 heads x 16 = caption_channels. 128 learnable registers as in LTX-2.0, so the prompt
    # length (max_sequence_length) must be a multiple of 128.
    return LTX2TextConnectors(
        caption_channels=_TEXT_HIDDEN,
        text_proj_in_factor=_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=_TEXT_HIDDEN // 2,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=128,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=_TEXT_HIDDEN // 2,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=128,
        rope_type=rope_type,
    )


def _build_transformer(rope_type: str, **overrides: Any) -> LTX2VideoTransformer3DModel:
    # As the LTX-2.0 config: cross_attention_dim = inner dim of each stream (the captions are projected to
    # it), timestep multipliers 1000, rope over (8, 32, 32) VAE scale factors, audio at 16 kHz / hop 160 / 4x.
    inner_dim = _HEADS * _HEAD_DIM
    audio_inner_dim = _HEADS * _AUDIO_HEAD_DIM
    return LTX2VideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM,
        cross_attention_dim=inner_dim,
        audio_in_channels=_AUDIO_FEATURES,
        audio_out_channels=_AUDIO_FEATURES,
        audio_num_attention_heads=_HEADS,
        audio_attention_head_dim=_AUDIO_HEAD_DIM,
        audio_cross_attention_dim=audio_inner_dim,
        num_layers=2,
        caption_channels=_TEXT_HIDDEN,
        rope_type=rope_type,
        **overrides,
    )


def _build_vae() -> AutoencoderKLLTX2Video:
    # The LTX-2.0 layout at 2-32 channels and one layer per block: patch 4, then spatial, temporal and two
    # spatiotemporal 2x stages = 32x spatial, 8x temporal. The ratios are explicit, as in the LTX-2.0 config:
    # diffusers' fallback (patch_size * 2**stages = 64) miscounts the single-axis stages.
    # NOTE(decoder-widths): decoder_block_out_channels must double stage by stage, as in models.ltx_video.default.
    # No timestep conditioning and no noise injection, as in the LTX-2.0 VAE.
    return AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(16, 32, 32, 32),
        decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(True, True, True),
        upsample_factor=(2, 2, 2),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )


def _build_audio_vae() -> AutoencoderKLLTX2Audio:
    # The LTX-2.0 audio VAE (pixel norm, causal along time, three levels = 4x down in time and mel) at 32-64
    # channels (128-512 real) and one residual block per level; see NOTE(audio-stats) for base_channels.
    return AutoencoderKLLTX2Audio(
        base_channels=_AUDIO_FEATURES,
        output_channels=_AUDIO_CHANNELS,
        ch_mult=(1, 1, 2),
        num_res_blocks=1,
        in_channels=_AUDIO_CHANNELS,
        latent_channels=_AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        sample_rate=16_000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=_MEL_BINS,
    )


def _build_vocoder() -> LTX2Vocoder:
    # The LTX-2.0 HiFi-GAN-style vocoder: stereo mel (2 x 64 channels) -> 24 kHz stereo; five transposed-conv
    # stages upsample 6*5*2*2*2 = 240x (100 mel frames/s -> 24 000 samples/s), halving the width each time
    # (64 -> 2 here, 1024 -> 32 in LTX-2.0).
    return LTX2Vocoder(
        in_channels=_AUDIO_CHANNELS * _MEL_BINS,
        hidden_channels=64,
        out_channels=_AUDIO_CHANNELS,
        upsample_kernel_sizes=[16, 15, 8, 4, 4],
        upsample_factors=[6, 5, 2, 2, 2],
        resnet_kernel_sizes=[3, 7, 11],
        resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=24_000,
    )


def build_ltx2_latent_upsampler() -> LTX2LatentUpsamplerModel:
    """The 2x spatial latent upsampler of two-stage generation (float32, CPU, eval mode), at 32 channels (1024
    real) and one residual block per stage (4 real); a pixel-shuffle upsampler, not the rational one, as LTX-2's
    ``ltx-2-spatial-upscaler-x2`` is."""
    with torch.random.fork_rng(devices=[]):
        model = LTX2LatentUpsamplerModel(in_channels=_LATENT_CHANNELS, mid_channels=32, num_blocks_per_stage=1,
                                         dims=3, spatial_upsample=True, temporal_upsample=False,
                                         use_rational_resampler=False)
    init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS["latent_upsampler"])
    return model.eval()


def build_ltx2_components(*, rope_type: str = _DEFAULT_ROPE_TYPE, **transformer_overrides: Any) -> dict[str, Any]:
    """Build the eight LTX2Pipeline components in memory (float32, CPU, eval mode), keyed by pipeline name.

    `rope_type` ("interleaved" or "split") applies to the transformer and the text connectors alike;
    `transformer_overrides` are further `LTX2VideoTransformer3DModel` config values (e.g. the LTX-2.3 features
    `perturbed_attn=True, gated_attn=True`) for variants.
    """
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported; use one of {', '.join(map(repr, ROPE_TYPES))}")
    tokenizer = build_offline_gemma_tokenizer()
    # Round the embedding table up to a multiple of 64 as Gemma checkpoints do; ids stay below len(tokenizer).
    vocab_size = 64 * math.ceil(len(tokenizer) / 64)
    # fork_rng: construction runs torch's own random init, which must not advance the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        models = {
            "text_encoder": _build_text_encoder(vocab_size),
            "connectors": _build_connectors(rope_type),
            "transformer": _build_transformer(rope_type, **transformer_overrides),
            "vae": _build_vae(),
            "audio_vae": _build_audio_vae(),
            "vocoder": _build_vocoder(),
        }
    for name, model in models.items():
        init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS[name], _GAINS.get(name))
        model.eval()
    # The scheduler LTX-2.0 ships is LTX-Video's (dynamic shift 0.95..2.05, shift_terminal 0.1); deterministic
    # Euler steps (stochastic_sampling off).
    scheduler = FlowMatchEulerDiscreteScheduler(**LTX_SCHEDULER_CONFIG, stochastic_sampling=False)
    return {**models, "scheduler": scheduler, "tokenizer": tokenizer}


def default_ltx2_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where "tiny-ltx2" lives: `cache_dir`, else `$CP_INFER_CACHE`, else `~/.cache/cp-infer`."""
    return cache_root(cache_dir) / _FOLDER_NAME


def _marker() -> dict[str, Any]:
    return {"name": DEFAULT_LTX2_NAME, "format_version": LTX2_FORMAT_VERSION}


def _write_model(folder: Path) -> None:
    build_ltx2_latent_upsampler().save_pretrained(folder / LATENT_UPSAMPLER, safe_serialization=True)
    write_pipeline(LTX2Pipeline(**build_ltx2_components()), folder)


def save_ltx2_model(folder: str | os.PathLike, *, rope_type: str = _DEFAULT_ROPE_TYPE, latent_upsampler: bool = False,
                    **transformer_overrides: Any) -> Path:
    """Write a tiny-ltx2 variant (e.g. the other `rope_type`; with `latent_upsampler/` if asked) as a diffusers
    folder at `folder`; return it.

    Not cached and not marked as the default model: for tests and benchmarks that need a specific variant.
    """
    folder = Path(folder)
    components = build_ltx2_components(rope_type=rope_type, **transformer_overrides)
    write_pipeline(LTX2Pipeline(**components), folder)
    if latent_upsampler:
        build_ltx2_latent_upsampler().save_pretrained(folder / LATENT_UPSAMPLER, safe_serialization=True)
    return folder


def ensure_default_ltx2_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the diffusers-format folder of "tiny-ltx2" (model_index.json `_class_name` "LTX2Pipeline"),
    building it first if it is absent or its files no longer match its marker. Safe to call from many processes at
    once: one builds, the others wait for it."""
    return ensure_folder(default_ltx2_model_dir(cache_dir), marker=_marker(), write=_write_model)
