"""The embedded default Wan model "tiny-wan": the real Wan 2.1 text-to-video classes at toy width, weights from a
seed; and the tiny variants of the other Wan layouts, for tests and benchmarks.

Invariants:
- The classes are the real diffusers/transformers ones `WanPipeline` and `WanImageToVideoPipeline` take
  (`WanTransformer3DModel`, `AutoencoderKLWan`, `UniPCMultistepScheduler` with Wan's flow-matching config,
  `UMT5EncoderModel`, a T5 tokenizer; `CLIPVisionModel` and `CLIPImageProcessor` for Wan 2.1 image-to-video), so every
  code path the engine exercises on them is the one a real Wan checkpoint takes.
- The VAEs keep the real compression: Wan 2.1's 8x spatial, 4x temporal (4k+1 frames -> k+1 latent frames, 16
  channels); Wan 2.2 TI2V-5B's 16x spatial (2x2 patchified pixels, 48 channels), 4x temporal.
- The variants (:data:`WAN_VARIANTS`) are Wan's diffusers layouts: ``t2v`` (Wan 2.1 T2V: ``WanPipeline``), ``i2v``
  (Wan 2.1 I2V: ``WanImageToVideoPipeline``, CLIP image tokens, a 36-channel transformer input), ``a14b`` (Wan 2.2
  A14B T2V: two experts, ``boundary_ratio``), ``a14b-i2v`` (Wan 2.2 A14B I2V: two 36-channel experts, no image
  encoder), ``ti2v`` (Wan 2.2 TI2V-5B: the 48-channel VAE, ``expand_timesteps``).
- The transformer has 5 heads (they divide neither 2 nor 3 ranks: the engine's padded heads).
- Weights are a pure function of `_SEED`, the variant and the parameter names and shapes
  (`models.common.embedded.init_deterministic`, one generator per component); two builds are bitwise identical.
- `ensure_default_wan_model` builds the folder in one process, never exposes a half-written one, and rebuilds one
  whose files no longer match its marker (`models.common.embedded.ensure_folder`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from transformers import CLIPVisionConfig, CLIPVisionModel, UMT5Config, UMT5EncoderModel

from models.common.embedded import cache_root, ensure_folder, init_deterministic, write_pipeline
from models.common.tokenizer import build_offline_t5_tokenizer
from models.wan import DEFAULT_NAME

__all__ = [
    "DEFAULT_WAN_NAME",
    "WAN_FORMAT_VERSION",
    "WAN_SCHEDULER_CONFIG",
    "WAN_VARIANTS",
    "build_wan_pipeline",
    "default_wan_model_dir",
    "ensure_default_wan_model",
    "save_wan_model",
]

DEFAULT_WAN_NAME = DEFAULT_NAME
# Bump when a config, the vocabulary or the init rule changes: the folder name carries it, so an old cache is never
# mistaken for the new model.
WAN_FORMAT_VERSION = 1
_FOLDER_NAME = f"{DEFAULT_WAN_NAME}-v{WAN_FORMAT_VERSION}"

WAN_VARIANTS = ("t2v", "i2v", "a14b", "a14b-i2v", "ti2v")

_SEED = 20_250_828
_COMPONENT_SEED_OFFSETS = {"text_encoder": 0, "transformer": 1, "transformer_2": 2, "vae": 3, "image_encoder": 4}
# The VAE's last conv maps to pixels in [-1, 1]: at unit gain most decoded pixels clip, at this gain a few percent do.
_GAINS = {"vae": {"decoder.head.2.weight": 0.3}}

_T5_D_MODEL = 32
_HEADS = 5
_HEAD_DIM = 12
_CLIP_HIDDEN = 32
_CLIP_IMAGE_SIZE = 32

# Wan 2.1's own scheduler config (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): UniPC on flow-matching sigmas, shift 3.0 (480p).
WAN_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    flow_shift=3.0,
    solver_order=2,
)
# Wan 2.2 A14B's switch from the high-noise to the low-noise expert (its T2V model_index.json: 0.875; I2V: 0.9).
_BOUNDARY_RATIO = {"a14b": 0.875, "a14b-i2v": 0.9}


def _latent_stats(channels: int) -> tuple[list[float], list[float]]:
    """Per-channel latent mean and std (plain numbers, as a real VAE config holds them): fixed, varied, std > 0."""
    mean = [round(0.4 * math.sin(1.7 * i), 4) for i in range(channels)]
    std = [round(1.0 + 0.8 * abs(math.cos(0.9 * i)), 4) for i in range(channels)]
    return mean, std


def _build_text_encoder(vocab_size: int) -> UMT5EncoderModel:
    # UMT5 (per-layer relative attention biases, gated-GELU) as google/umt5-xxl, Wan's text encoder.
    config = UMT5Config(vocab_size=vocab_size, d_model=_T5_D_MODEL, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                        relative_attention_num_buckets=8, relative_attention_max_distance=32,
                        feed_forward_proj="gated-gelu", dropout_rate=0.0, is_encoder_decoder=False)
    return UMT5EncoderModel(config)


def _build_transformer(variant: str) -> WanTransformer3DModel:
    inner = _HEADS * _HEAD_DIM
    image = variant == "i2v"
    channels = {"ti2v": (48, 48), "i2v": (36, 16), "a14b-i2v": (36, 16)}.get(variant, (16, 16))
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=_HEADS, attention_head_dim=_HEAD_DIM, in_channels=channels[0],
        out_channels=channels[1], text_dim=_T5_D_MODEL, freq_dim=32, ffn_dim=96, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=_CLIP_HIDDEN if image else None,
        added_kv_proj_dim=inner if image else None, rope_max_seq_len=1024)


def _build_vae(variant: str) -> AutoencoderKLWan:
    if variant == "ti2v":
        # Wan 2.2's VAE: residual blocks, 2x2 pixel patches in and out (12 channels), 48 latent channels, 16x spatial.
        mean, std = _latent_stats(48)
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                attn_scales=[], temperal_downsample=[False, True, True], is_residual=True,
                                in_channels=12, out_channels=12, patch_size=2, scale_factor_temporal=4,
                                scale_factor_spatial=16, latents_mean=mean, latents_std=std)
    mean, std = _latent_stats(16)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                            temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std)


def _build_image_encoder() -> CLIPVisionModel:
    # ViT as open-clip-xlm-roberta-large-vit-huge-14's (Wan 2.1 I2V reads its second-to-last hidden states), at 32 px
    # in 8 px patches: 16 + 1 image tokens (257 real).
    config = CLIPVisionConfig(hidden_size=_CLIP_HIDDEN, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, image_size=_CLIP_IMAGE_SIZE, patch_size=8, hidden_act="gelu")
    return CLIPVisionModel(config)


def _image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": _CLIP_IMAGE_SIZE},
                              crop_size={"height": _CLIP_IMAGE_SIZE, "width": _CLIP_IMAGE_SIZE})


def build_wan_pipeline(variant: str = "t2v"):
    """The tiny ``variant`` (:data:`WAN_VARIANTS`) as its diffusers pipeline (float32, CPU, eval mode)."""
    if variant not in WAN_VARIANTS:
        raise ValueError(f"variant={variant!r} is not a tiny Wan variant; use one of {', '.join(WAN_VARIANTS)}")
    # Wan pads every prompt to max_sequence_length (512) and Wan 2.1 I2V splits its cross-attention at 512 text tokens.
    tokenizer = build_offline_t5_tokenizer(model_max_length=512)
    vocab_size = 64 * math.ceil(len(tokenizer) / 64)
    builders = {"text_encoder": lambda: _build_text_encoder(vocab_size),
                "transformer": lambda: _build_transformer(variant), "vae": lambda: _build_vae(variant)}
    if variant in _BOUNDARY_RATIO:
        builders["transformer_2"] = lambda: _build_transformer(variant)
    if variant == "i2v":
        builders["image_encoder"] = _build_image_encoder
    # fork_rng: construction runs torch's own random init, which must not advance the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        models = {name: build() for name, build in builders.items()}
    for name, model in models.items():
        init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS[name], _GAINS.get(name))
        model.eval()
    parts = dict(models, scheduler=UniPCMultistepScheduler(**WAN_SCHEDULER_CONFIG), tokenizer=tokenizer,
                 boundary_ratio=_BOUNDARY_RATIO.get(variant), expand_timesteps=variant == "ti2v")
    if variant in ("i2v", "a14b-i2v"):
        # Imported here: the image-to-video pipeline's module imports transformers' CLIP image processor, which warns
        # (once per process) where torchvision is missing; text-to-video never needs it.
        from diffusers import WanImageToVideoPipeline

        if variant == "i2v":
            parts["image_processor"] = _image_processor()
        return WanImageToVideoPipeline(**parts)
    return WanPipeline(**parts)


def save_wan_model(folder: str | os.PathLike, *, variant: str = "t2v") -> Path:
    """Write the tiny ``variant`` as a diffusers folder at ``folder``; return it. Not cached and not marked as the
    default model: for tests and benchmarks that need a specific layout."""
    folder = Path(folder)
    write_pipeline(build_wan_pipeline(variant), folder)
    return folder


def default_wan_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where "tiny-wan" lives: `cache_dir`, else `$CP_INFER_CACHE`, else `~/.cache/cp-infer`."""
    return cache_root(cache_dir) / _FOLDER_NAME


def _marker() -> dict[str, Any]:
    return {"name": DEFAULT_WAN_NAME, "format_version": WAN_FORMAT_VERSION}


def ensure_default_wan_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the diffusers-format folder of "tiny-wan" (model_index.json `_class_name` "WanPipeline"), building it
    first if it is absent or its files no longer match its marker. Safe to call from many processes at once."""
    return ensure_folder(default_wan_model_dir(cache_dir), marker=_marker(),
                         write=lambda folder: write_pipeline(build_wan_pipeline("t2v"), folder))
