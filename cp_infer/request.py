"""The generation request every rank receives, and the limits it is checked against.

Invariants:
- A ``GenerationRequest`` is built and validated on the leader (server or CLI) before any rank sees it; it is
  frozen and holds only plain Python values, so broadcasting it (pickle) carries nothing a client wrote
  except validated field values.
- ``check_request`` raises ``ValueError`` naming the field and the fix; callers map it to a 4xx.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .shapes import LatentShape, VideoGeometry

__all__ = ["FAMILY_OPTIONS", "Condition", "GenerationRequest", "GenerationLimits", "check_request",
           "resolve_frame_index"]

# Request fields that only some model families understand (``None`` = the family's default), by family.
# A request that sets one for another family is refused: silently ignoring it would hand back a video made
# with settings the client did not ask for.
_AUDIO_VIDEO_OPTIONS = (
    "audio_guidance_scale", "stg_scale", "audio_stg_scale", "modality_scale", "audio_modality_scale",
    "guidance_rescale", "audio_guidance_rescale", "stg_blocks",
)
_CONDITION_OPTIONS = ("image_cond_noise_scale",)
# Families whose adapters take conditioning media (``image``, ``conditions``).
_CONDITIONING_FAMILIES = frozenset({"ltx-video"})
FAMILY_OPTIONS: dict[str, frozenset[str]] = {
    "ltx-video": frozenset(_CONDITION_OPTIONS),
    "ltx2": frozenset(_AUDIO_VIDEO_OPTIONS),
}


@dataclass(frozen=True)
class Condition:
    """Media a generation is conditioned on: validated uint8 RGB pixels (decoded on the leader), where they apply and
    how strongly (the semantics of diffusers' ``LTXVideoCondition``)."""

    frames: np.ndarray = field(compare=False, repr=False)
    """uint8 ``[F, H, W, 3]``: one frame for an image, several for a video clip, at any size (the model resizes)."""
    frame_index: int = 0
    """The output frame the first media frame applies at; negative counts from the end (-1: the last frame)."""
    strength: float = 1.0
    """1 keeps the media as it is; lower values let the model change it more."""

    @property
    def is_image(self) -> bool:
        return self.frames.shape[0] == 1


def resolve_frame_index(frame_index: int, num_frames: int) -> int:
    """``frame_index`` counted from the start (negative indices count from the end)."""
    return frame_index + num_frames if frame_index < 0 else frame_index


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: text-to-video, or conditioned on an image (``image``) or on media at frames
    (``conditions``)."""

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
    max_sequence_length: int | None = None
    """Text tokens the prompt is padded or cut to; ``None``: the model's reference pipeline's default."""
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
    image: Condition | None = None
    """Image-to-video: the first frame (frame_index 0, strength 1), as the models' image-to-video pipelines take it."""
    conditions: tuple[Condition, ...] = ()
    """Images or clips at frame indices with strengths, as the models' condition pipelines take them."""
    image_cond_noise_scale: float | None = None
    """Noise added at every step to fully conditioned tokens (``conditions`` only; the pipeline's default when
    unset)."""


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
    if family == "ltx2" and request.max_sequence_length is not None and request.max_sequence_length % 128:
        # NOTE(registers): LTX-2's text connectors append 128 learnable registers per 128 text tokens.
        raise ValueError(f"max_sequence_length={request.max_sequence_length} is not a multiple of 128, which LTX-2 "
                         f"models need; try {max(128, request.max_sequence_length // 128 * 128)}")
    for name in _AUDIO_VIDEO_OPTIONS + _CONDITION_OPTIONS:
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
            hi = 1.0 if name.endswith("rescale") or name == "image_cond_noise_scale" else limits.max_guidance
            _check_number(name, value, 0.0, hi)


def _check_condition(name: str, cond: object, num_frames: int, temporal_compression: int) -> None:
    if not isinstance(cond, Condition):
        raise ValueError(f"{name} must be a Condition, got {type(cond).__name__}")
    frames = cond.frames
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 \
            or 0 in frames.shape:
        raise ValueError(f"{name}.media must be decoded RGB frames (uint8 [F, H, W, 3])")
    _check_number(f"{name}.strength", cond.strength, 0.0, 1.0)
    _check_int(f"{name}.frame_index", cond.frame_index, -num_frames, num_frames - 1)
    start = resolve_frame_index(cond.frame_index, num_frames)
    count = frames.shape[0]
    room = num_frames - start
    if count > room:
        raise ValueError(f"{name}.media has {count} frames, more than the {room} the video has from frame {start} on "
                         f"(num_frames={num_frames}): trim the clip to {room} frames, apply it earlier, or ask for "
                         "more frames")
    if count > 1 and start != 0 and count < temporal_compression + 1:
        # NOTE(prefix): a clip placed after frame 0 is encoded to at least two latent frames (the condition
        # pipelines' num_prefix_latent_frames), which takes temporal_compression + 1 frames.
        raise ValueError(f"{name}.media has {count} frames; a clip applied after frame 0 needs at least "
                         f"{temporal_compression + 1}: use a longer clip, or an image")


def _check_conditions(request: GenerationRequest, family: str, geometry: VideoGeometry) -> None:
    if request.image is None and not request.conditions:
        return
    field_name = "image" if request.image is not None else "conditions"
    if family not in _CONDITIONING_FAMILIES:
        takers = ", ".join(sorted(_CONDITIONING_FAMILIES))
        raise ValueError(f"{field_name}: the loaded model ({family}) takes no conditioning media; remove "
                         f"{field_name}, or serve a model that takes them ({takers})")
    if request.image is not None and request.conditions:
        raise ValueError("image and conditions were both given; give the image as conditions[0] (frame_index 0) "
                         "instead")
    if not isinstance(request.conditions, tuple) or len(request.conditions) > 16:
        raise ValueError("conditions must be a list of at most 16 conditions")
    if request.image is not None:
        _check_condition("image", request.image, request.num_frames, geometry.temporal_compression)
        if not request.image.is_image or request.image.frame_index != 0 or request.image.strength != 1.0:
            raise ValueError("image must be one frame at frame_index 0 with strength 1; use conditions for others")
    for i, cond in enumerate(request.conditions):
        _check_condition(f"conditions[{i}]", cond, request.num_frames, geometry.temporal_compression)


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
    if request.max_sequence_length is not None:
        _check_int("max_sequence_length", request.max_sequence_length, 1, 1024)
    for name, lo, hi in (("guidance_scale", 0.0, limits.max_guidance), ("decode_timestep", 0.0, 1.0)):
        _check_number(name, getattr(request, name), lo, hi)
    _check_family_options(request, family, limits, layers)
    _check_conditions(request, family, geometry)
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
