"""The generation request every rank receives, and the limits it is checked against.

Invariants:
- A ``GenerationRequest`` is built and validated on the leader (server or CLI) before any rank sees it; it is
  frozen and holds only plain Python values, so broadcasting it (pickle) carries nothing a client wrote
  except validated field values.
- ``check_request`` raises ``ValueError`` naming the field and the fix; callers map it to a 4xx.
- ``loras`` names adapters and their scales only (:class:`LoraWeight`): what a name resolves to (a file of the
  deployment's adapter directory) is the front end's and the model's business; the engine checks the names' form,
  the count, the scales' range and that no name is given twice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from .options import STANDARD, ModelOptions
from .shapes import LatentShape, VideoGeometry

__all__ = ["EXTEND_TAIL", "LORA_NAME", "LORA_SCALE", "MAX_CONDITIONS", "MAX_LORAS", "Condition", "GenerationRequest",
           "GenerationLimits", "LoraWeight", "check_request", "loras_from", "resolve_frame_index", "resolve_request",
           "window_images"]

@dataclass(frozen=True)
class Condition:
    """Media a generation is conditioned on: validated uint8 RGB pixels (decoded on the leader), where they apply and
    how strongly (the model's condition pipeline gives them their exact meaning)."""

    frames: np.ndarray = field(compare=False, repr=False)
    """uint8 ``[F, H, W, 3]``: one frame for an image, several for a video clip, at any size (the model resizes)."""
    frame_index: int = 0
    """The output frame the first media frame applies at; negative counts from the end (-1: the last frame)."""
    strength: float = 1.0
    """1 keeps the media as it is; lower values let the model change it more."""

    @property
    def is_image(self) -> bool:
        return self.frames.shape[0] == 1


MAX_CONDITIONS = 16
"""Conditions one request may carry."""
MAX_LORAS = 4
"""Adapters one request may name."""
LORA_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
"""An adapter's name (its file's stem in the deployment's adapter directory): never a path."""
LORA_SCALE = (-4.0, 4.0)
"""The range of an adapter's scale (diffusers' ``set_adapters`` weight; 1 is the adapter as trained)."""


@dataclass(frozen=True)
class LoraWeight:
    """One adapter a request applies: its name and the scale of its update (``set_adapters(names, weights)``)."""

    name: str
    scale: float = 1.0


def loras_from(value: object) -> tuple[LoraWeight, ...]:
    """``[{"name": "a", "scale": 0.8}, ...]`` (mappings with ``name`` and an optional ``scale``, or
    :class:`LoraWeight` items) as request values; ``ValueError`` naming ``loras[i]`` for anything else. The values are
    checked by :func:`check_request`."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"loras must be a list of {{\"name\": ..., \"scale\": ...}} objects, got "
                         f"{type(value).__name__}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, LoraWeight):
            out.append(item)
            continue
        if not isinstance(item, Mapping) or "name" not in item or set(item) - {"name", "scale"}:
            raise ValueError(f"loras[{i}] must be an object with a name and an optional scale, e.g. "
                             '{"name": "style", "scale": 0.8}')
        out.append(LoraWeight(item["name"], item.get("scale", 1.0)))
    return tuple(out)


def _check_loras(loras: object) -> None:
    if not isinstance(loras, tuple) or not all(isinstance(item, LoraWeight) for item in loras):
        raise ValueError("loras must be a list of {\"name\": ..., \"scale\": ...} objects")
    if len(loras) > MAX_LORAS:
        raise ValueError(f"loras names {len(loras)} adapters; a request applies at most {MAX_LORAS}")
    seen: set[str] = set()
    for i, lora in enumerate(loras):
        if not isinstance(lora.name, str) or not LORA_NAME.fullmatch(lora.name):
            shown = lora.name if not isinstance(lora.name, str) or len(lora.name) < 80 else lora.name[:77] + "..."
            raise ValueError(f"loras[{i}].name={shown!r} is not an adapter name: 1-64 of A-Z a-z 0-9 . _ - (the "
                             "stem of a .safetensors file in the server's adapter directory, never a path)")
        _check_number(f"loras[{i}].scale", lora.scale, *LORA_SCALE)
        if lora.name in seen:
            raise ValueError(f"loras[{i}].name={lora.name!r} is given twice; name each adapter once")
        seen.add(lora.name)


def resolve_frame_index(frame_index: int, num_frames: int) -> int:
    """``frame_index`` counted from the start (negative indices count from the end)."""
    return frame_index + num_frames if frame_index < 0 else frame_index


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: text-to-video, or conditioned on an image (``image``) or on media at frames
    (``conditions``). The standard options (``cp_infer.options.STANDARD``) are fields, every other option the
    model declares is in ``options``; ``None`` / absent means the model's declared default, which
    :func:`resolve_request` fills in."""

    prompt: str
    negative_prompt: str | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int = 0
    fps: int | None = None
    """The frame rate (the option ``frame_rate``): conditions the model and sets the output's rate."""
    image: Condition | None = None
    """Image-to-video: the first frame (frame_index 0, strength 1), as the models' image-to-video pipelines take it."""
    conditions: tuple[Condition, ...] = ()
    """Images or clips at frame indices with strengths, as the models' condition pipelines take them."""
    options: dict[str, Any] = field(default_factory=dict)
    """The model's own options by declared name (after :func:`resolve_request`: every one of them)."""
    extends: Condition | None = None
    """An extension: the last frames of the video this one continues (at least ``EXTEND_TAIL`` of them, at the
    request's size). The ``num_frames - 1`` frames made follow that video's last frame; the models that make long
    videos window by window take it (``ModelOptions.window_frames``)."""
    loras: tuple[LoraWeight, ...] = ()
    """The adapters applied, in order, with their scales (``MAX_LORAS`` at most); empty: the base weights alone."""

    @classmethod
    def of(cls, **values: Any) -> GenerationRequest:
        """A request from flat keyword values: fields by name (``frame_rate`` for ``fps``; ``loras`` as
        :func:`loras_from` takes them), any other key an option of the model's (checked when the request is
        resolved)."""
        names = {f.name for f in fields(cls)} - {"options"}
        if "frame_rate" in values:
            values["fps"] = values.pop("frame_rate")
        own = {k: values.pop(k) for k in list(values) if k in names}
        if "loras" in own:
            own["loras"] = loras_from(own["loras"])
        return cls(**own, options=values)

    def option(self, name: str) -> Any:
        """A resolved option's value, standard or the model's own."""
        return getattr(self, STANDARD[name]) if name in STANDARD else self.options[name]


@dataclass(frozen=True)
class GenerationLimits:
    """What a deployment accepts. The defaults suit a single GPU; the CLI and server expose each field."""

    max_frames: int = 1537
    """Longest video in frames (61 s at 25 fps: longer than a model window, it is made window by window)."""
    max_side: int = 1536
    """Largest height or width in pixels."""
    max_tokens: int = 65536
    """Largest latent token count (frames x height x width after compression) of one sequence, the whole video or
    one window of a long one: bounds memory and time."""
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


def _check_conditions(request: GenerationRequest, options: ModelOptions, geometry: VideoGeometry, *,
                      media_pending: bool = False) -> None:
    if request.image is None and not request.conditions:
        if options.needs_image and request.extends is None and not media_pending:
            raise ValueError(f"image: the loaded model ({options.model}) is image-to-video and needs the video's first "
                             "frame; give it (the API's input_reference, the CLI's --image), or serve a text-to-video "
                             "model")
        return
    field_name = "image" if request.image is not None else "conditions"
    if not options.takes_media:
        raise ValueError(f"{field_name}: the loaded model ({options.model}) takes no conditioning media; remove "
                         f"{field_name}, or serve a model that takes them")
    if request.image is not None and request.conditions:
        raise ValueError("image and conditions were both given; give the image as conditions[0] (frame_index 0) "
                         "instead")
    if not isinstance(request.conditions, tuple) or len(request.conditions) > MAX_CONDITIONS:
        raise ValueError(f"conditions must be a list of at most {MAX_CONDITIONS} conditions")
    if request.image is not None:
        _check_condition("image", request.image, request.num_frames, geometry.temporal_compression)
        if not request.image.is_image or request.image.frame_index != 0 or request.image.strength != 1.0:
            raise ValueError("image must be one frame at frame_index 0 with strength 1; use conditions for others")
    for i, cond in enumerate(request.conditions):
        _check_condition(f"conditions[{i}]", cond, request.num_frames, geometry.temporal_compression)
    if options.check_media is not None:
        options.check_media(request)


def _window_starts(request: GenerationRequest, options: ModelOptions) -> tuple[int, ...]:
    return tuple(options.window_images({"num_frames": request.num_frames, **request.options}))


def _check_window_images(request: GenerationRequest, options: ModelOptions) -> None:
    """A windowed request's ``conditions``: images its windows start from, one a window at most, in order, each at
    the frame its window starts from (``ModelOptions.window_images``)."""
    starts = _window_starts(request, options)
    shown = ", ".join(map(str, starts[:8])) + (", ..." if len(starts) > 8 else "")
    last = -1
    for i, cond in enumerate(request.conditions):
        where = f"conditions[{i}]"
        if not cond.is_image:
            raise ValueError(f"{where}.media has {cond.frames.shape[0]} frames: in a video longer than one window, "
                             "conditions are images the windows start from; give one frame")
        if cond.strength != 1.0:
            raise ValueError(f"{where}.strength={cond.strength}: a window starts from its image as it is; give "
                             "strength 1")
        frame = resolve_frame_index(cond.frame_index, request.num_frames)
        if frame not in starts:
            raise ValueError(f"{where}.frame_index={cond.frame_index}: in a video longer than one window, an image "
                             f"applies at the frame its window starts from: {shown}; give one of them")
        if frame <= last:
            raise ValueError(f"{where}.frame_index={cond.frame_index}: give conditions in order of frame_index, one "
                             "image a window")
        last = frame
    if options.needs_image and resolve_frame_index(request.conditions[0].frame_index, request.num_frames) != 0:
        raise ValueError(f"conditions[0].frame_index={request.conditions[0].frame_index}: the loaded model "
                         f"({options.model}) is image-to-video, so its first window starts from an image too; give "
                         "conditions[0] at frame_index 0")


def window_images(request: GenerationRequest, options: ModelOptions) -> dict[int, Condition]:
    """The image each window of a checked windowed request starts from, by window: its ``image`` (window 0's), or its
    ``conditions`` at the frames ``ModelOptions.window_images`` names; each as an image (frame 0, strength 1)."""
    images = {} if request.image is None else {0: request.image}
    if request.conditions and options.window_images is not None:
        starts = _window_starts(request, options)
        for cond in request.conditions:
            images[starts.index(resolve_frame_index(cond.frame_index, request.num_frames))] = Condition(cond.frames)
    return images


EXTEND_TAIL = 17
"""Frames of the video to extend that condition the extension (two latent frames after the first: the
overlap of a window with the one before)."""


def _check_extends(request: GenerationRequest, options: ModelOptions, geometry: VideoGeometry) -> None:
    if options.window_frames is None or "extends" not in options.window_media:
        raise ValueError(f"video: the loaded model ({options.model}) does not extend videos; serve a model that "
                         "does")
    if request.image is not None or request.conditions:
        raise ValueError("video: an extension takes no image or conditions; the video it extends conditions it")
    _check_condition("video", request.extends, EXTEND_TAIL, geometry.temporal_compression)
    if request.extends.frames.shape[0] != EXTEND_TAIL:
        raise ValueError(f"video: an extension is conditioned on the last {EXTEND_TAIL} frames of the video it "
                         f"extends, got {request.extends.frames.shape[0]}")
    if request.extends.frames.shape[1:3] != (request.height, request.width):
        raise ValueError(f"video: the frames to extend are {request.extends.frames.shape[2]}x"
                         f"{request.extends.frames.shape[1]}, the extension {request.width}x{request.height}: "
                         "an extension keeps the size of the video it extends")


def _given(request: GenerationRequest) -> dict[str, Any]:
    if not isinstance(request.options, dict):
        raise ValueError(f"options must be a mapping of option names to values, got {type(request.options).__name__}")
    values = {name: getattr(request, attr) for name, attr in STANDARD.items()}
    for key, value in request.options.items():
        if key in values and values[key] is not None:
            raise ValueError(f"{key} was given twice; give it once")
        values[key] = value
    return values


def resolve_request(request: GenerationRequest, options: ModelOptions, *, limits: GenerationLimits | None = None,
                    geometry: VideoGeometry | None = None) -> GenerationRequest:
    """``request`` with every option the model declares set: the given values checked (an undeclared option is
    refused, naming it), the declaration's defaults for the rest, each lowered to what ``limits`` allow where it is
    over one (for the model's ``geometry``: sizes and frame counts it takes). Idempotent."""
    values = options.resolve(_given(request), limits=limits, geometry=geometry)
    return replace(request, **{attr: values[name] for name, attr in STANDARD.items()},
                   options={name: value for name, value in values.items() if name not in STANDARD})


def check_request(request: GenerationRequest, *, geometry: VideoGeometry, limits: GenerationLimits,
                  options: ModelOptions, media_pending: bool = False, planned: bool = False) -> LatentShape:
    """Validate a resolved ``request`` (:func:`resolve_request`) for a model with ``geometry`` that declares
    ``options``; return its latent shape. ``media_pending``: its media are read after this check (which then runs
    again with them), so a model that needs an image does not miss it yet. ``planned``: ``request`` is a pass of the
    plan of a request checked against ``limits`` (a window, a stage); the values its plan chose (stage 2's steps and
    guidance, its recipe's) are not the client's, so its options are held to the model's ranges only, while its
    sequence is held to ``max_tokens``."""
    for name in ("prompt", "negative_prompt"):
        text = getattr(request, name)
        if not isinstance(text, str):
            raise ValueError(f"{name} must be a string, got {type(text).__name__}")
        if len(text) > limits.max_prompt_chars:
            raise ValueError(f"{name} has {len(text)} characters; the limit is {limits.max_prompt_chars}")
    if not request.prompt.strip():
        raise ValueError("prompt is empty; describe the video to generate")
    _check_int("seed", request.seed, 0, 2**63 - 1)
    _check_loras(request.loras)
    values = _given(request)
    resolved = options.resolve(values, limits=None if planned else limits, geometry=geometry)
    unset = [name for name in options.names if values.get(name) is None and resolved[name] is not None]
    assert not unset, f"check_request needs a resolved request (unset: {unset}); call resolve_request first"
    _check_conditions(request, options, geometry, media_pending=media_pending)
    shape = geometry.latent_shape(request.num_frames, request.height, request.width)
    frames = request.num_frames if options.window_frames is None else options.window_frames(values)
    if request.extends is not None:
        _check_extends(request, options, geometry)
    # The longest pass of a windowed video may be as long as the video (its window and the tail before it).
    windowed = options.window_count(values) > 1 if options.window_count is not None else frames != request.num_frames
    if request.conditions and windowed:
        if options.window_images is not None:
            _check_window_images(request, options)
        elif "conditions" not in options.window_media:
            raise ValueError("conditions: a video longer than one window takes an image (image-to-video), not "
                             "conditions; give the first frame as image, or ask for fewer frames")
    if request.image is not None and windowed and "image" not in options.window_media:
        raise ValueError(f"image: {options.model} models make a video longer than one window from text only; remove "
                         "the image, or ask for fewer frames")
    tokens = geometry.latent_shape(frames, request.height, request.width).tokens
    if tokens > limits.max_tokens:
        what = "" if frames == request.num_frames else f" per window of {frames} frames"
        raise ValueError(
            f"num_frames={request.num_frames} at {request.width}x{request.height} is {tokens} latent tokens{what}; "
            f"the limit is {limits.max_tokens}: use {'fewer frames' if not what else 'shorter windows'} "
            "or a smaller size")
    return shape
