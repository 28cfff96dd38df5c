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

__all__ = ["GenerationRequest", "GenerationLimits", "check_request"]


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


def check_request(request: GenerationRequest, *, geometry: VideoGeometry, limits: GenerationLimits) -> LatentShape:
    """Validate ``request`` for a model with ``geometry``; return its latent shape."""
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
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number in [{lo}, {hi}]")
        if not lo <= value <= hi:
            raise ValueError(f"{name}={value} is out of range; use a value in [{lo}, {hi}]")
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
