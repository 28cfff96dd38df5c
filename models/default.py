"""The embedded default model "tiny-ltx-video": real LTX-Video classes at toy width, weights from a seed.

Invariants:
- The classes are the real diffusers/transformers ones (`LTXVideoTransformer3DModel`,
  `AutoencoderKLLTXVideo`, `FlowMatchEulerDiscreteScheduler`, `T5EncoderModel`, `T5Tokenizer`), so every code
  path the engine exercises on it is the one a real LTX-Video checkpoint takes.
- The VAE keeps the real compression: 32x spatial, 8x temporal (8k+1 frames -> k+1 latent frames).
- Weights are a pure function of `_SEED` and the parameter names and shapes: every parameter is overwritten
  in sorted-name order from one seeded generator per component, so torch's init code (and the caller's
  global RNG) play no part, and two builds are bitwise identical.
- `ensure_default_model` never exposes a half-written folder: it builds in a private sibling folder and
  renames it into place, which is atomic; the marker file is written last, before the rename.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from transformers import T5Config, T5EncoderModel

from models.tokenizer import build_offline_t5_tokenizer

__all__ = [
    "DEFAULT_MODEL_NAME",
    "FORMAT_VERSION",
    "MARKER_FILE",
    "build_default_components",
    "default_model_dir",
    "ensure_default_model",
]

DEFAULT_MODEL_NAME = "tiny-ltx-video"
# Bump when the config, the vocabulary or the init rule changes: the folder name carries it, so an old
# cache is never mistaken for the new model.
FORMAT_VERSION = 1
MARKER_FILE = "cp_infer_default_model.json"
_FOLDER_NAME = f"{DEFAULT_MODEL_NAME}-v{FORMAT_VERSION}"
_CACHE_ENV = "CP_INFER_CACHE"

_SEED = 20_250_601
# One generator per component, so resizing one component leaves the others' weights unchanged.
_COMPONENT_SEED_OFFSETS = {"text_encoder": 0, "transformer": 1, "vae": 2}
# Extra factors on top of the generic init. The VAE's last conv maps to pixels in [-1, 1]; at unit gain
# about a third of the decoded pixels clip, at 0.4 the frames have std ~0.4 and a few percent clip.
_GAINS = {"vae": {"decoder.conv_out.conv.weight": 0.4}}

_LATENT_CHANNELS = 16
_T5_D_MODEL = 32
_HEADS = 4
_HEAD_DIM = 8

# The scheduler config LTX-Video 0.9.x ships: resolution-dependent ("dynamic") shift between base_shift at
# 1024 latent tokens and max_shift at 4096, with the schedule stretched to end at sigma 0.1.
_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.95,
    max_shift=2.05,
    base_image_seq_len=1024,
    max_image_seq_len=4096,
    shift_terminal=0.1,
)


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


@torch.no_grad()
def _init_deterministic(module: torch.nn.Module, seed: int, gains: dict[str, float]) -> None:
    """Overwrite every parameter from one generator, in sorted-name order.

    Scales keep activations O(1) so that outputs are neither vanishing nor saturated: matrices and conv
    kernels N(0, 1/fan_in); AdaLN `scale_shift_table`s N(0, 1/dim) as diffusers initialises them; 1-D
    weights (norm gains) 1 + N(0, 0.1^2); biases N(0, 0.05^2); then `gains[name]` multiplies.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in sorted(module.named_parameters(), key=lambda item: item[0]):
        shape = tuple(param.shape)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("timestep_scale_multiplier"):
            # Maps the decode timestep in [0, 1] to the 0..1000 range the sinusoidal embedding expects.
            value = torch.full(shape, 1000.0)
        elif name.endswith("scale_shift_table"):
            value = noise / math.sqrt(shape[-1])
        elif len(shape) >= 2:
            value = noise / math.sqrt(math.prod(shape[1:]))
        elif name.endswith("bias"):
            value = 0.05 * noise
        elif len(shape) == 1:
            value = 1.0 + 0.1 * noise
        else:
            raise AssertionError(f"no init rule for parameter {name} of shape {shape}")
        param.copy_((gains.get(name, 1.0) * value).to(param.dtype))


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
        _init_deterministic(model, _SEED + _COMPONENT_SEED_OFFSETS[name], _GAINS.get(name, {}))
        model.eval()
    scheduler = FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG)
    return {**models, "scheduler": scheduler, "tokenizer": tokenizer}


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the default model lives: `cache_dir`, else `$CP_INFER_CACHE`, else `~/.cache/cp-infer`."""
    if cache_dir is None:
        cache_dir = os.environ.get(_CACHE_ENV) or Path.home() / ".cache" / "cp-infer"
    return Path(cache_dir).expanduser().resolve() / _FOLDER_NAME


def _marker() -> dict[str, Any]:
    return {"name": DEFAULT_MODEL_NAME, "format_version": FORMAT_VERSION}


def _is_complete(folder: Path) -> bool:
    try:
        return json.loads((folder / MARKER_FILE).read_text()) == _marker()
    except (OSError, ValueError):
        return False


def _write_model(folder: Path) -> None:
    # Saving through the pipeline writes model_index.json and one subfolder per component, the same layout
    # as a real LTX-Video checkpoint on the hub.
    LTXPipeline(**build_default_components()).save_pretrained(folder, safe_serialization=True)
    marker = folder / MARKER_FILE
    marker.write_text(json.dumps(_marker(), indent=2) + "\n")
    # The weight files come out 0600 (written via temporary files); give every file the mode a plain
    # write gets under the caller's umask, so a shared cache folder is readable by whoever may read it.
    mode = marker.stat().st_mode & 0o777
    for file in folder.rglob("*"):
        if file.is_file():
            file.chmod(mode)


def ensure_default_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the diffusers-format folder of the default model, building it first if it is absent.

    Safe to call from many processes at once (e.g. every torchrun rank): each builds into its own
    temporary sibling folder and renames it into place; a process that loses the race drops its copy and
    returns the winner's.
    """
    target = default_model_dir(cache_dir)
    if _is_complete(target):
        return target
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(
            f"{target} exists but is not a complete {DEFAULT_MODEL_NAME} v{FORMAT_VERSION} build (missing or "
            f"stale {MARKER_FILE}); delete it and retry, or set ${_CACHE_ENV} to another folder"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        _write_model(tmp)
        try:
            # Atomic on POSIX; replaces an empty target folder, fails if another process got there first.
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
