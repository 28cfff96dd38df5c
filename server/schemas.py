"""The HTTP API's shapes (OpenAI video API conventions) and the one place a client body becomes a request.

Invariants:
- A client body becomes a :class:`GenerationRequest` only through :func:`build_request`: pydantic first (unknown
  fields, wrong types, NaN/inf refused), then the OpenAI-style ``seconds``/``size`` are resolved and
  :func:`check_request` runs with the same limits and geometry every rank uses. Anything that fails is an
  :class:`ApiError` (a 4xx with ``{"error": {"code", "message", "param"}}``) naming the field and the fix.
- The request a worker sees holds only values this module produced; the client's bytes never leave rank 0.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from cp_infer.request import FAMILY_OPTIONS, Condition, GenerationLimits, GenerationRequest, check_request
from cp_infer.shapes import VideoGeometry

__all__ = [
    "ApiError",
    "ErrorBody",
    "ErrorResponse",
    "JobStatus",
    "VideoCreateParams",
    "VideoDeleted",
    "VideoError",
    "VideoJob",
    "VideoList",
    "build_request",
    "frames_for_seconds",
    "params_from_form",
    "params_from_json",
]

JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")
_LTX2_FIELDS = tuple(sorted(FAMILY_OPTIONS["ltx2"]))


class ApiError(Exception):
    """A client error: rendered as ``status`` with ``{"error": {"code", "message", "param"}}``."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"code": self.code, "message": self.message, "param": self.param, "type": kind}}


class ErrorBody(BaseModel):
    code: str
    message: str
    param: str | None = None
    type: str = "invalid_request_error"


class ErrorResponse(BaseModel):
    error: ErrorBody


class MediaRef(BaseModel):
    """A completed job's video, by id."""

    model_config = ConfigDict(extra="forbid", strict=True)
    id: str


class ImageReference(BaseModel):
    """The OpenAI API's reference object: an image as a data URL (this server fetches nothing from the network)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    image_url: str


class ConditionParams(BaseModel):
    """One conditioning item: an image or a clip (a data URL, an uploaded file's form field, or a completed job's
    id), the output frame its first frame applies at (negative counts from the end) and its strength in [0, 1]."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    media: str | MediaRef
    frame_index: int = 0
    strength: float = 1.0


class _LTX2Options(BaseModel):
    """The LTX-2 (audio-video) controls, declared once for requests and job objects: the names of
    ``FAMILY_OPTIONS["ltx2"]``. LTX-2 models only; other families refuse them. Unset: LTX2Pipeline's defaults."""

    audio_guidance_scale: float | None = None
    stg_scale: float | None = None
    audio_stg_scale: float | None = None
    modality_scale: float | None = None
    audio_modality_scale: float | None = None
    guidance_rescale: float | None = None
    audio_guidance_rescale: float | None = None
    stg_blocks: list[int] | None = None


# NOTE(field-order): pydantic orders a model's fields base classes first (reversed MRO), and that order is part of
# the API (OpenAPI properties, JSON keys, the "valid parameters" list). So each public model takes its own fields
# from a private base listed after _LTX2Options, which keeps the LTX-2 fields last.
class _VideoCreateFields(BaseModel):
    prompt: str
    model: str | None = None
    seconds: str | int | float | None = None
    """Duration; becomes the nearest valid frame count (8k+1 for LTX) at ``fps``. Excludes ``num_frames``."""
    size: str | None = None
    """``"WxH"``, e.g. ``"384x256"``. Excludes ``width``/``height``."""
    negative_prompt: str | None = None
    num_frames: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    fps: int | None = None
    stream: bool | None = None
    """Extension: respond with the MP4 itself, sent while it is made (also a query parameter)."""
    input_reference: str | ImageReference | None = None
    """The first frame (image-to-video): an uploaded file (multipart), a data URL or ``{"image_url": data URL}``. A
    video clip here conditions from frame 0 on."""
    conditions: list[ConditionParams] | None = None
    """Images or clips at frame indices with strengths (LTX-Video models)."""
    image_cond_noise_scale: float | None = None
    """Noise re-added at every step to fully conditioned tokens (with ``conditions``; default 0.15)."""


class VideoCreateParams(_LTX2Options, _VideoCreateFields):
    """``POST /v1/videos``: the OpenAI fields plus explicit generation controls. Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class VideoError(BaseModel):
    code: str
    message: str


class _VideoJobFields(BaseModel):
    id: str
    object: Literal["video"] = "video"
    status: JobStatus
    progress: int
    created_at: int
    completed_at: int | None = None
    model: str
    seconds: str
    size: str
    prompt: str
    error: VideoError | None = None
    negative_prompt: str
    num_frames: int
    width: int
    height: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    input_reference: bool = False
    """Whether the video was made from a reference image."""
    image_cond_noise_scale: float | None = None
    conditions: list[dict] | None = None
    """The conditioning items (``frame_index``, ``strength``, ``num_frames`` of the media), without their pixels."""


class VideoJob(_LTX2Options, _VideoJobFields):
    """The job object (OpenAI's ``video``) plus the generation parameters this server resolved."""


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


def _field_hint(name: str, limits: GenerationLimits, geometry: VideoGeometry | None) -> str:
    """What a field accepts, for error messages."""
    t = geometry.temporal_compression if geometry else 8
    step = geometry.spatial_step if geometry else 32
    smallest = step * (geometry.min_latent_side if geometry else 1)
    hints = {
        "prompt": f"a non-empty string of at most {limits.max_prompt_chars} characters",
        "negative_prompt": f"a string of at most {limits.max_prompt_chars} characters",
        "model": "a string naming the served model",
        "seconds": "a positive number of seconds, e.g. \"4\"",
        "size": f"a string \"WxH\" with W and H multiples of {step} in [{smallest}, {limits.max_side}], "
                "e.g. \"384x256\"",
        "num_frames": f"an integer {t}k+1 in [1, {limits.max_frames}]",
        "width": f"an integer multiple of {step} in [{smallest}, {limits.max_side}]",
        "height": f"an integer multiple of {step} in [{smallest}, {limits.max_side}]",
        "num_inference_steps": f"an integer in [2, {limits.max_steps}]",
        "guidance_scale": f"a finite number in [0, {limits.max_guidance}]",
        "seed": f"an integer in [0, {2**63 - 1}]",
        "fps": f"an integer in [1, {limits.max_fps}]",
        "stream": "true or false",
        "input_reference": "an uploaded image (multipart), a data URL, or {\"image_url\": data URL}",
        "conditions": "a list of {\"media\": data URL or {\"id\": video id}, \"frame_index\": int, "
                      "\"strength\": number in [0, 1]}",
        "image_cond_noise_scale": "a number in [0, 1]",
        "stg_blocks": "a list of transformer block indices, e.g. [28] (a form: \"20,28\"; LTX-2 models only)",
        "guidance_rescale": "a number in [0, 1] (LTX-2 models only)",
        "audio_guidance_rescale": "a number in [0, 1] (LTX-2 models only)",
    }
    if name in _LTX2_FIELDS:
        return hints.get(name, f"a finite number in [0, {limits.max_guidance}] (LTX-2 models only)")
    return hints.get(name, "a valid value")


def _loc_name(loc: tuple) -> str | None:
    """``("conditions", 0, "strength")`` -> ``conditions[0].strength`` (pydantic's union branches dropped)."""
    if not loc:
        return None
    name = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ConditionParams.model_fields or part in ("id", "image_url"):
            name += f".{part}"
    return name


def _from_validation_error(exc: ValidationError, limits: GenerationLimits,
                           geometry: VideoGeometry | None, prefix: tuple = ()) -> ApiError:
    err = exc.errors()[0]
    param = _loc_name(prefix + tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        valid = ", ".join(VideoCreateParams.model_fields)
        return ApiError(400, "unknown_parameter", f"unknown parameter {param!r}; valid parameters: {valid}", param)
    if kind == "missing":
        return ApiError(400, "missing_required_parameter",
                        f"{param} is required: {_field_hint(param or '', limits, geometry)}", param)
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (str, bytes)) or len(value) < 80 else f"{str(value)[:77]!r}..."
    base = re.match(r"[a-z_]*", param or "").group(0)
    return ApiError(400, "invalid_type" if kind.endswith("_type") else "invalid_value",
                    f"{param}={shown} is invalid ({err['msg']}); expected {_field_hint(base, limits, geometry)}",
                    param)


def params_from_json(data: Any, *, limits: GenerationLimits, geometry: VideoGeometry | None) -> VideoCreateParams:
    """A decoded JSON body -> params; JSON types must match exactly (``"17"`` is not an integer)."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return VideoCreateParams.model_validate(data)
    except ValidationError as exc:
        raise _from_validation_error(exc, limits, geometry) from None


def params_from_form(data: dict[str, str], *, limits: GenerationLimits,
                     geometry: VideoGeometry | None) -> VideoCreateParams:
    """Form fields (all strings) -> params, converting each string to its field's type; the one list,
    ``stg_blocks``, is written as on the command line: ``"20,28"``."""
    blocks = data.get("stg_blocks")
    nested = {k: data[k] for k in ("conditions", "input_reference") if not isinstance(data.get(k, ""), str)}
    try:
        params = VideoCreateParams.model_validate_strings(
            {k: v for k, v in data.items() if k != "stg_blocks" and k not in nested}, strict=False)
    except ValidationError as exc:
        raise _from_validation_error(exc, limits, geometry) from None
    # NOTE(forms): pydantic's string validation takes no nested lists: each item is validated on its own.
    update: dict[str, Any] = {}
    if isinstance(nested.get("input_reference"), dict):
        try:
            update["input_reference"] = ImageReference.model_validate_strings(nested["input_reference"])
        except ValidationError as exc:
            raise _from_validation_error(exc, limits, geometry, prefix=("input_reference",)) from None
    if "conditions" in nested:
        items = nested["conditions"]
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise ApiError(400, "invalid_value", "conditions in a form are fields conditions[0][media], "
                           "conditions[0][frame_index], conditions[0][strength], ...", "conditions")
        conditions = []
        for i, item in enumerate(items):
            try:
                conditions.append(ConditionParams.model_validate_strings(item, strict=False))
            except ValidationError as exc:
                raise _from_validation_error(exc, limits, geometry, prefix=("conditions", i)) from None
        update["conditions"] = conditions
    elif "input_reference" in nested and not isinstance(nested["input_reference"], dict):
        raise ApiError(400, "invalid_value", "input_reference is invalid; expected "
                       f"{_field_hint('input_reference', limits, geometry)}", "input_reference")
    if update:
        params = params.model_copy(update=update)
    if blocks is None:
        return params
    if not isinstance(blocks, str):
        raise ApiError(400, "invalid_value", "stg_blocks is invalid; expected "
                       f"{_field_hint('stg_blocks', limits, geometry)}", "stg_blocks")
    # NOTE(forms): pydantic's string validation has no list syntax, so the list is parsed here.
    if not re.fullmatch(r"\s*\d{1,6}\s*(,\s*\d{1,6}\s*)*", blocks):
        raise ApiError(400, "invalid_value", f"stg_blocks={blocks[:80]!r} is invalid; expected "
                       f"{_field_hint('stg_blocks', limits, geometry)}", "stg_blocks")
    return params.model_copy(update={"stg_blocks": [int(b) for b in blocks.split(",")]})


def _parse_seconds(value: str | int | float) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ApiError(400, "invalid_value", f"seconds={value!r} is not a number; use e.g. \"4\"", "seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ApiError(400, "invalid_value", f"seconds={value!r} must be a finite number > 0", "seconds")
    return seconds


def frames_for_seconds(seconds: float, fps: int, temporal_compression: int) -> int:
    """The valid frame count (``t*k + 1``) nearest to ``seconds * fps``."""
    k = max(0, round((seconds * fps - 1) / temporal_compression))
    return temporal_compression * k + 1


def _param_of(message: str) -> str | None:
    match = re.match(r"^([a-z_]+)(\[\d+\](\.[a-z_]+)?)?", message)
    if match and match.group(1) in VideoCreateParams.model_fields:
        return match.group(0)
    return None


def build_request(params: VideoCreateParams, *, geometry: VideoGeometry, limits: GenerationLimits,
                  served_model: str, seed: int, family: str = "ltx-video", layers: int | None = None,
                  image: Condition | None = None, conditions: tuple[Condition, ...] = ()) -> GenerationRequest:
    """Resolve the OpenAI-style fields and validate; ``seed`` is used when the client gave none. ``image`` and
    ``conditions``: the request's media, already decoded (``server.conditions``)."""
    if params.model is not None and params.model != served_model:
        raise ApiError(400, "model_not_found", f"model={params.model!r} is not served here; use {served_model!r} "
                       "or leave model out", "model")
    defaults = GenerationRequest(prompt="")
    fps = defaults.fps if params.fps is None else params.fps
    if params.seconds is not None and params.num_frames is not None:
        raise ApiError(400, "conflicting_parameters", "give seconds or num_frames, not both", "seconds")
    if params.size is not None and (params.width is not None or params.height is not None):
        raise ApiError(400, "conflicting_parameters", "give size or width/height, not both", "size")
    num_frames = defaults.num_frames if params.num_frames is None else params.num_frames
    if params.seconds is not None:
        seconds = _parse_seconds(params.seconds)
        if not isinstance(fps, int) or not 1 <= fps <= limits.max_fps:
            raise ApiError(400, "invalid_value", f"fps={fps} is out of range; use a value in [1, {limits.max_fps}]",
                           "fps")
        t = geometry.temporal_compression
        num_frames = frames_for_seconds(seconds, fps, t)
        if num_frames > limits.max_frames:
            longest = (limits.max_frames - 1) // t * t + 1
            raise ApiError(400, "invalid_value",
                           f"seconds={params.seconds} is {num_frames} frames at {fps} fps; the limit is "
                           f"{limits.max_frames} frames: use seconds <= {longest / fps:.3g}", "seconds")
    width = defaults.width if params.width is None else params.width
    height = defaults.height if params.height is None else params.height
    if params.size is not None:
        match = _SIZE_RE.match(params.size)
        if not match:
            raise ApiError(400, "invalid_value", f"size={params.size!r} is not \"WxH\"; "
                           f"expected {_field_hint('size', limits, geometry)}", "size")
        width, height = int(match.group(1)), int(match.group(2))
    ltx2 = {name: getattr(params, name) for name in _LTX2_FIELDS}
    if ltx2["stg_blocks"] is not None:
        ltx2["stg_blocks"] = tuple(ltx2["stg_blocks"])  # the request's own (immutable) type
    request = GenerationRequest(
        prompt=params.prompt,
        negative_prompt=defaults.negative_prompt if params.negative_prompt is None else params.negative_prompt,
        num_frames=num_frames, height=height, width=width,
        num_inference_steps=(defaults.num_inference_steps if params.num_inference_steps is None
                             else params.num_inference_steps),
        guidance_scale=defaults.guidance_scale if params.guidance_scale is None else params.guidance_scale,
        seed=seed if params.seed is None else params.seed,
        fps=fps, image=image, conditions=conditions, image_cond_noise_scale=params.image_cond_noise_scale,
        **ltx2,
    )
    try:
        check_request(request, geometry=geometry, limits=limits, family=family, layers=layers)
    except ValueError as exc:
        message = str(exc)
        param = _param_of(message)
        if param is None and message.startswith("image"):
            param = "input_reference"
        if params.size is not None and param in ("width", "height"):
            message, param = f"size={params.size!r}: {message}", "size"
        elif params.seconds is not None and param == "num_frames":
            param = "seconds"
        raise ApiError(400, "invalid_value", message, param) from None
    return request

