"""The generation request every rank receives, and the limits it is checked against.

Invariants:
- A ``GenerationRequest`` is built and validated on the leader (server or CLI) before any rank sees it; it is
  frozen and holds only plain Python values, so broadcasting it (pickle) carries nothing a client wrote
  except validated field values.
- ``check_request`` raises ``ValueError`` naming the field and the fix; callers map it to a 4xx.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .shapes import LatentShape, VideoGeometry

__all__ = ["FAMILY_OPTIONS", "GenerationRequest", "GenerationLimits", "check_request"]

# Request fields that only some model families understand (``None`` = the family's default), by family.
# A request that sets one for another family is refused: silently ignoring it would hand back a video made
# with settings the client did not ask for.
_AUDIO_VIDEO_OPTIONS = (
    "audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale", "audio_modality_scale",
    "guidance_rescale", "audio_guidance_rescale", "stg_blocks",
)
FAMILY_OPTIONS: dict[str, frozenset[str]] = {
    "ltx-video": frozenset(),
    "ltx2": frozenset(_AUDIO_VIDEO_OPTIONS),
}


@dataclass(frozen=True)
class GenerationRequest:
    """One text-to-video generation."""

    prompt: str
    negative_prompt: str = ""
    num_frames: int = 49
    height: int = 256
    width: int = 384
    num_inference_steps: int = 20
    guidance_scale: float = 3.0
    seed: int = 0
    fps: int = 24
    decode_timestep: float = 0.0
    """LTX-Video 0.9.1+ VAEs are timestep-conditioned; 0.05 is what Lightricks recommends for them."""
    decode_noise_scale: float | None = None
    """Noise mixed into the latents before decode; ``None`` means equal to ``decode_timestep``."""
    max_sequence_length: int = 128
    """Text tokens (the T5 context length the model was trained with)."""
    # LTX-2 only (audio and video generated together); None = LTX2Pipeline's default.
    audio_guidance_scale: float | None = None
    """CFG scale of the soundtrack (default 7)."""
    stg_scale: float | None = None
    """Spatio-temporal guidance of the video (default 1; 0 turns it off)."""
    audio_stg_scale: float | None = None
    """Spatio-temporal guidance of the soundtrack (default 1)."""
    modality_scale: float | None = None
    """Modality-isolation guidance of the video (default 3; 1 turns it off)."""
    audio_modality_scale: float | None = None
    """Modality-isolation guidance of the soundtrack (default 3)."""
    guidance_rescale: float | None = None
    """CFG rescale of the video, in [0, 1] (default 0.7)."""
    audio_guidance_rescale: float | None = None
    """CFG rescale of the soundtrack, in [0, 1] (default 0.7)."""
    stg_blocks: tuple[int, ...] | None = None
    """Transformer blocks whose self-attention spatio-temporal guidance perturbs (default (28,))."""


@dataclass(frozen=True)
class GenerationLimits:
    """What a deployment accepts. The defaults suit a single GPU; the CLI and server expose each field."""

    max_frames: int = 257
    """Longest video in frames (must itself be 8k+1 for LTX)."""
    max_side: int = 1536
    """Largest height or width in pixels."""
    max_tokens: int = 65536
    """Largest latent token count (frames x height x width after compression): bounds memory and time."""
    max_steps: int = 200
    max_guidance: float = 30.0
    max_prompt_chars: int = 4000
    max_fps: int = 120

    def __post_init__(self) -> None:
        for name in ("max_frames", "max_side", "max_tokens", "max_steps", "max_prompt_chars", "max_fps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range; use a value in [{lo}, {hi}]")


def _check_number(name: str, value: object, lo: float, hi: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range; use a value in [{lo}, {hi}]")


def _check_family_options(request: GenerationRequest, family: str, limits: GenerationLimits,
                          layers: int | None) -> None:
    if family not in FAMILY_OPTIONS:
        raise ValueError(f"model family {family!r} is unknown; known: {', '.join(FAMILY_OPTIONS)}")
    accepted = FAMILY_OPTIONS[family]
    if family == "ltx2" and request.max_sequence_length % 128:
        # NOTE(registers): LTX-2's text connectors append 128 learnable registers per 128 text tokens.
        raise ValueError(f"max_sequence_length={request.max_sequence_length} is not a multiple of 128, which LTX-2 "
                         f"models need; try {max(128, request.max_sequence_length // 128 * 128)}")
    for name in _AUDIO_VIDEO_OPTIONS:
        value = getattr(request, name)
        if value is None:
            continue
        if name not in accepted:
            users = ", ".join(f for f, options in FAMILY_OPTIONS.items() if name in options)
            raise ValueError(f"{name} applies to {users} models only; the loaded model is {family}: remove {name}")
        if name == "stg_blocks":
            if not isinstance(value, (tuple, list)) or not value or len(value) > 256:
                raise ValueError(f"stg_blocks={value!r} must be a non-empty list of block indices")
            top = 1023 if layers is None else layers - 1
            for block in value:
                if layers is not None and isinstance(block, int) and block >= layers:
                    raise ValueError(f"stg_blocks={list(value)} names block {block}, but the model has {layers} "
                                     f"transformer blocks; use indices in [0, {layers - 1}]")
                _check_int("stg_blocks[]", block, 0, top)
        else:
            hi = 1.0 if name.endswith("rescale") else limits.max_guidance
            _check_number(name, value, 0.0, hi)


def check_request(request: GenerationRequest, *, geometry: VideoGeometry, limits: GenerationLimits,
                  family: str = "ltx-video", layers: int | None = None) -> LatentShape:
    """Validate ``request`` for a model of ``family`` with ``geometry`` and ``layers`` transformer blocks (when
    known; block indices are then checked); return its latent shape."""
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
        if len(text) > limits.max_prompt_chars:
            raise ValueError(f"{name} has {len(text)} characters; the limit is {limits.max_prompt_chars}")
    if not request.prompt.strip():
        raise ValueError("prompt is empty; describe the video to generate")
    _check_int("num_frames", request.num_frames, 1, limits.max_frames)
    _check_int("height", request.height, 1, limits.max_side)
    _check_int("width", request.width, 1, limits.max_side)
    # NOTE(steps): at least 2: flow-matching schedules with a terminal shift (LTX-Video 0.9.x) divide by zero
    # when stretching a single sigma, and one step is no video anyway.
    _check_int("num_inference_steps", request.num_inference_steps, 2, limits.max_steps)
    _check_int("seed", request.seed, 0, 2**63 - 1)
    _check_int("fps", request.fps, 1, limits.max_fps)
    _check_int("max_sequence_length", request.max_sequence_length, 1, 1024)
    for name, lo, hi in (("guidance_scale", 0.0, limits.max_guidance), ("decode_timestep", 0.0, 1.0)):
        _check_number(name, getattr(request, name), lo, hi)
    _check_family_options(request, family, limits, layers)
    scale = request.decode_noise_scale
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or not 0.0 <= scale <= 1.0):
        raise ValueError(f"decode_noise_scale={scale!r} must be a number in [0, 1] or null")
    shape = geometry.latent_shape(request.num_frames, request.height, request.width)
    if shape.tokens > limits.max_tokens:
        raise ValueError(
            f"num_frames={request.num_frames} at {request.width}x{request.height} is {shape.tokens} latent tokens; "
            f"the limit is {limits.max_tokens}: use fewer frames or a smaller size")
    return shape
