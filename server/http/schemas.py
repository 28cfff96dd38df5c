"""The HTTP API's shapes (OpenAI video API conventions) and the one place a client body becomes a request.

Invariants:
- A client body becomes a :class:`GenerationRequest` only through :func:`build_request`: pydantic first (unknown
  fields, wrong types, NaN/inf refused), then the OpenAI-style ``seconds``/``size`` are resolved and
  :func:`check_request` runs with the same limits and geometry every rank uses. Anything that fails is an
  :class:`ApiError` (a 4xx with ``{"error": {"code", "message", "param"}}``) naming the field and the fix.
- The request a worker sees holds only values this module produced; the client's bytes never leave rank 0.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model

from cp_infer.options import ModelOptions, Option, UnknownOption
from cp_infer.request import (
    LORA_SCALE,
    MAX_LORAS,
    Condition,
    GenerationLimits,
    GenerationRequest,
    check_request,
    resolve_request,
)
from cp_infer.shapes import VideoGeometry

__all__ = [
    "ApiError",
    "ErrorBody",
    "ErrorResponse",
    "JobStatus",
    "LoraParams",
    "VideoCreateParams",
    "VideoDeleted",
    "VideoError",
    "VideoJob",
    "VideoList",
    "build_request",
    "error_responses",
    "frames_for_seconds",
    "params_from_form",
    "params_from_json",
    "params_model",
]

JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]

_SIZE_RE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


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
    """A short snake_case reason to switch on (``invalid_value``, ``video_not_found``, ``queue_full``)."""
    message: str
    """What is wrong and what to do instead."""
    param: str | None
    """The request field at fault, if one is."""
    type: Literal["invalid_request_error", "server_error"]


class ErrorResponse(BaseModel):
    """Every error's body (:meth:`ApiError.body`)."""

    error: ErrorBody


_STATUS_TEXT = {
    400: "A parameter is missing, malformed, out of range or conflicts with another (``param`` names it)",
    401: "The API key is missing, wrong or revoked (send ``Authorization: Bearer <key>``)",
    404: "No such video (or its file is missing on the server)",
    409: "The video exists but has not completed",
    413: "The body (or one of its media) is over the server's limit",
    415: "The body's Content-Type is not accepted",
    429: "The queue is full; retry after ``Retry-After`` seconds",
    503: "The worker group is still starting; retry after ``Retry-After`` seconds",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}


def error_responses(*statuses: int) -> dict[int, dict[str, Any]]:
    """The ``responses=`` of a route that answers ``statuses`` (each an :class:`ApiError`), for its OpenAPI entry."""
    return {status: {"model": ErrorResponse, "description": _STATUS_TEXT[status],
                     **({"headers": _RETRY_AFTER} if status in (429, 503) else {})} for status in statuses}


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


class LoraParams(BaseModel):
    """One adapter to apply: the name of one of the server's adapters (``GET /v1/models`` lists them) and the scale
    of its update (1: as trained)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    name: str
    scale: float = 1.0


class VideoCreateParams(BaseModel):
    """``POST /v1/videos``: the OpenAI fields and the media; :func:`params_model` adds the served model's declared
    options (``cp_infer.options``). Unknown fields are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    prompt: str
    model: str | None = None
    seconds: str | int | float | None = None
    """Duration; becomes the nearest valid frame count (8k+1 for LTX) at the frame rate. Excludes ``num_frames``."""
    size: str | None = None
    """``"WxH"``, e.g. ``"384x256"``. Excludes ``width``/``height``."""
    seed: int | None = None
    """Noise seed (unset: a random one, reported in the job)."""
    stream: bool | None = None
    """Extension: respond with the MP4 itself, sent while it is made (also a query parameter)."""
    live: bool | None = None
    """Extension: a live video, made window by window as it is directed (``POST /v1/videos/{id}/directions``)."""
    input_reference: str | ImageReference | None = None
    """The first frame (image-to-video): an uploaded file (multipart), a data URL or ``{"image_url": data URL}``. A
    video clip here conditions from frame 0 on."""
    conditions: list[ConditionParams] | None = None
    """Images or clips at frame indices with strengths."""
    loras: list[LoraParams] | None = None
    """LoRA adapters of the server's ``--lora-dir`` applied, in order, with their scales (at most 4)."""
    _aliases: dict[str, str] = PrivateAttr(default_factory=dict)
    """Declared option name -> the alias the client wrote it as (``frame_rate`` -> ``fps``), for error messages."""


_PY_TYPES = {int: int, float: float, str: str, bool: bool, tuple: list[int], list: list[dict[str, Any]]}


def _option_field(option: Option) -> tuple[Any, Any]:
    default = list(option.default) if isinstance(option.default, tuple) else option.default
    # A list of objects: pydantic takes the shape, the option's own check the content (so errors name the item).
    shown = "unset" if default is None else repr(default)
    kind = list[float] if option.kind is tuple and option.item is float else _PY_TYPES[option.kind]
    return (kind | None,
            Field(None, description=f"{option.help} (default {shown}: the reference pipeline's; {option.describe()}"
                                    f"{'; ' + option.limit_note() if option.limit else ''})",
                  json_schema_extra={"x-default": default}))


@functools.cache
def params_model(options: ModelOptions) -> type[VideoCreateParams]:
    """The create body of a server whose model declares ``options``: the OpenAI fields plus one field per option
    (unset: the declared default)."""
    return create_model("VideoCreateParams", __base__=VideoCreateParams,
                        **{o.name: _option_field(o) for o in options})


class VideoError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    """The job object (OpenAI's ``video``) plus the generation parameters this server resolved; besides the fields
    here, every option the served model declares, with the value used."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: Literal["video"] = "video"
    status: JobStatus
    progress: int
    created_at: int
    completed_at: int | None = None
    model: str
    seconds: str
    """The video's duration (an extension's: the video it extends and the frames made after it)."""
    size: str
    prompt: str
    error: VideoError | None = None
    window: int | None = None
    """A long video (made window by window): the window being made, from 0; ``None`` before it starts or for a
    video made at once."""
    windows: int | None = None
    """A long video: how many windows it is made in."""
    steps_computed: int | None = None
    """With a step cache (``cache``): the denoising steps so far that ran every transformer block; ``None`` without
    one."""
    steps_skipped: int | None = None
    """With a step cache: the steps so far whose every pass reused the cache (ran the first block only, or none)."""
    negative_prompt: str
    num_frames: int
    width: int
    height: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    tenant: str | None = None
    """The tenant whose key made it (``cp-infer keys``); ``None``: made while the server needed no key."""
    input_reference: bool = False
    """Whether the video was made from a reference image."""
    extends: bool = False
    """Whether the video is an extension (``POST /v1/videos/extensions``): the video it extends, then
    ``num_frames - 1`` new frames."""
    conditions: list[dict] | None = None
    """The conditioning items (``frame_index``, ``strength``, ``num_frames`` of the media), without their pixels."""
    loras: list[LoraParams] = []
    """The adapters applied, in order, with their scales (empty: the base weights)."""
    live: dict | None = None
    """A live video: its ``directions`` (each its ``prompt``, ``windows``, ``start_window``, ``end_window`` and
    ``state``: ``made``, ``in_progress`` or ``queued``), ``ended`` (its end directed), ``windows_directed``,
    ``windows_made`` and ``waiting`` (every directed window made, waiting for more); ``None`` for any other video."""


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


def _field_hint(name: str, limits: GenerationLimits, geometry: VideoGeometry | None,
                options: ModelOptions | None = None) -> str:
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
        "seed": f"an integer in [0, {2**63 - 1}]",
        "stream": "true or false",
        "live": "true or false",
        "input_reference": "an uploaded image (multipart), a data URL, or {\"image_url\": data URL}",
        "loras": f"a list of at most {MAX_LORAS} {{\"name\": an adapter of GET /v1/models, \"scale\": a number in "
                 f"[{LORA_SCALE[0]:g}, {LORA_SCALE[1]:g}]}}",
        "conditions": "a list of {\"media\": data URL or {\"id\": video id}, \"frame_index\": int, "
                      "\"strength\": number in [0, 1]}",
    }
    if name in hints:
        return hints[name]
    canonical = options.canonical_name(name) if options is not None else None
    if canonical is not None:
        option = options[canonical]
        hint = option.describe(limits)
        form = {tuple: " (a form: \"20,28\")", list: " (a form: the JSON list)"}.get(option.kind, "")
        return hint + form
    return "a valid value"


def _loc_name(loc: tuple) -> str | None:
    """``("conditions", 0, "strength")`` -> ``conditions[0].strength`` (pydantic's union branches dropped)."""
    if not loc:
        return None
    name = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ConditionParams.model_fields or part in LoraParams.model_fields or part in ("id", "image_url"):
            name += f".{part}"
    return name


def _unknown(name: str, options: ModelOptions) -> ApiError:
    valid = ", ".join([*VideoCreateParams.model_fields, *options.names])
    return ApiError(400, "unknown_parameter", f"unknown parameter {name!r}: the served model ({options.model}) "
                    f"declares no such option; valid parameters: {valid}", name)


def _from_validation_error(exc: ValidationError, limits: GenerationLimits, geometry: VideoGeometry | None,
                           options: ModelOptions, prefix: tuple = ()) -> ApiError:
    err = exc.errors()[0]
    param = _loc_name(prefix + tuple(err["loc"]))
    kind = err["type"]
    if kind == "extra_forbidden":
        return _unknown(param or "", options)
    if kind == "missing":
        return ApiError(400, "missing_required_parameter",
                        f"{param} is required: {_field_hint(param or '', limits, geometry, options)}", param)
    value = err.get("input")
    shown = repr(value) if not isinstance(value, (str, bytes)) or len(value) < 80 else f"{str(value)[:77]!r}..."
    base = re.match(r"[a-z_]*", param or "").group(0)
    return ApiError(400, "invalid_type" if kind.endswith("_type") else "invalid_value",
                    f"{param}={shown} is invalid ({err['msg']}); expected "
                    f"{_field_hint(base, limits, geometry, options)}", param)


def _canonical(data: dict, options: ModelOptions) -> tuple[dict, dict[str, str]]:
    """Option aliases (``fps``, ``stg_blocks``) renamed to the declared names, and which were renamed; an unknown
    name refused."""
    try:
        renamed = options.canonical(data, known=VideoCreateParams.model_fields)
    except UnknownOption as exc:
        raise _unknown(exc.name, options) from None
    except ValueError as exc:
        raise ApiError(400, "conflicting_parameters", str(exc), str(exc).split(" ", 1)[0]) from None
    aliases = {options.canonical_name(k): k for k in data if k not in VideoCreateParams.model_fields
               and options.canonical_name(k) != k}
    return renamed, aliases


def _as_typed(exc: ApiError, aliases: dict[str, str]) -> ApiError:
    """``exc`` naming an option as the client wrote it (its alias) rather than by its declared name."""
    base = (exc.param or "").split("[", 1)[0]
    if base in aliases:
        exc.param = exc.param.replace(base, aliases[base], 1)
        exc.message = exc.message.replace(base, aliases[base])
    return exc


def params_from_json(data: Any, *, options: ModelOptions, limits: GenerationLimits,
                     geometry: VideoGeometry | None) -> VideoCreateParams:
    """A decoded JSON body -> params; JSON types must match exactly (``"17"`` is not an integer)."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", f"the body must be a JSON object, got {type(data).__name__}")
    data, aliases = _canonical(data, options)
    try:
        params = params_model(options).model_validate(data)
    except ValidationError as exc:
        raise _as_typed(_from_validation_error(exc, limits, geometry, options), aliases) from None
    params._aliases = aliases
    return params


_FORM_ITEMS = {int: r"\d{1,6}", float: r"\d{1,6}(\.\d{1,12})?"}
"""A form list's items: integers, or decimal numbers (``1.0,0.725``)."""


def _number_list(name: str, text: object, limits, geometry, options) -> list[int] | list[float]:
    # NOTE(forms): pydantic's string validation has no list syntax, so a list is written as on the command line.
    item = options[name].item
    pattern = rf"\s*{_FORM_ITEMS[item]}\s*(,\s*{_FORM_ITEMS[item]}\s*)*"
    if not isinstance(text, str) or not re.fullmatch(pattern, text):
        shown = repr(text[:80]) if isinstance(text, str) else "not a string"
        raise ApiError(400, "invalid_value", f"{name}={shown} is invalid; expected "
                       f"{_field_hint(name, limits, geometry, options)}", name)
    return [item(b) for b in text.split(",")]


def params_from_form(data: dict[str, Any], *, options: ModelOptions, limits: GenerationLimits,
                     geometry: VideoGeometry | None) -> VideoCreateParams:
    """Form fields (all strings) -> params, converting each string to its field's type; a list option is written
    as on the command line: ``"20,28"``."""
    data, aliases = _canonical(data, options)
    try:
        params = _form_params(data, options=options, limits=limits, geometry=geometry)
    except ApiError as exc:
        raise _as_typed(exc, aliases) from None
    params._aliases = aliases
    return params


def _json_list(name: str, text: Any, **kw: Any) -> list[Any]:
    """A form field holding a JSON list of objects (``prompt_segments``)."""
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        value = None
    if not isinstance(value, list):
        raise ApiError(400, "invalid_value", f"{name} must be a JSON list of objects, e.g. "
                       "[{\"start_window\": 0, \"end_window\": 1, \"text\": \"...\"}]", param=name)
    return value


def _form_params(data: dict[str, Any], *, options: ModelOptions, limits: GenerationLimits,
                 geometry: VideoGeometry | None) -> VideoCreateParams:
    lists = {o.name for o in options if o.kind is tuple and o.name in data}
    objects = {o.name for o in options if o.kind is list and o.name in data}
    nested = {k: data[k] for k in ("conditions", "input_reference", "loras") if k in data}
    nested = {k: v for k, v in nested.items() if k == "loras" or not isinstance(v, str)}
    kw = dict(limits=limits, geometry=geometry, options=options)
    model = params_model(options)
    try:
        params = model.model_validate_strings(
            {k: v for k, v in data.items() if k not in lists | objects and k not in nested}, strict=False)
    except ValidationError as exc:
        raise _from_validation_error(exc, **kw) from None
    # NOTE(forms): pydantic's string validation takes no nested lists: each item is validated on its own.
    update: dict[str, Any] = {name: _number_list(name, data[name], **kw) for name in lists}
    update.update({name: _json_list(name, data[name], **kw) for name in objects})
    if isinstance(nested.get("input_reference"), dict):
        try:
            update["input_reference"] = ImageReference.model_validate_strings(nested["input_reference"])
        except ValidationError as exc:
            raise _from_validation_error(exc, **kw, prefix=("input_reference",)) from None
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
                raise _from_validation_error(exc, **kw, prefix=("conditions", i)) from None
        update["conditions"] = conditions
    elif "input_reference" in nested and not isinstance(nested["input_reference"], dict):
        raise ApiError(400, "invalid_value", "input_reference is invalid; expected "
                       f"{_field_hint('input_reference', limits, geometry)}", "input_reference")
    if "loras" in nested:
        update["loras"] = _form_loras(nested["loras"], kw)
    return params.model_copy(update=update) if update else params


def _form_loras(value: Any, kw: dict[str, Any]) -> list[LoraParams]:
    """A form's loras: fields ``loras[0][name]``, ``loras[0][scale]``, ..., or one field holding the JSON list."""
    strings = not isinstance(value, str)
    if not strings:
        try:
            value = json.loads(value)
        except ValueError:
            value = None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ApiError(400, "invalid_value", "loras in a form are fields loras[0][name], loras[0][scale], ... or one "
                       "loras field holding the JSON list, e.g. [{\"name\": \"style\", \"scale\": 0.8}]", "loras")
    loras = []
    for i, item in enumerate(value):
        try:
            loras.append(LoraParams.model_validate_strings(item, strict=False) if strings
                         else LoraParams.model_validate(item))
        except ValidationError as exc:
            raise _from_validation_error(exc, **kw, prefix=("loras", i)) from None
    return loras


def _parse_seconds(value: str | int | float) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise ApiError(400, "invalid_value", f"seconds={value!r} is not a number; use e.g. \"4\"", "seconds") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ApiError(400, "invalid_value", f"seconds={value!r} must be a finite number > 0", "seconds")
    return seconds


def frames_for_seconds(seconds: float, fps: int, temporal_compression: int, *, extension: bool = False) -> int:
    """The valid frame count (``t*k + 1``) nearest to ``seconds * fps``; for an ``extension``, whose ``t*k`` frames
    after the first (the ones an extension adds to the video it extends) are nearest to it."""
    t = temporal_compression
    k = max(1, round(seconds * fps / t)) if extension else max(0, round((seconds * fps - 1) / t))
    return t * k + 1


def _param_of(message: str, options: ModelOptions) -> str | None:
    match = re.match(r"^([a-z_]+)(\[\d*\](\.[a-z_]+)?)?", message)
    if match and (match.group(1) in VideoCreateParams.model_fields or match.group(1) in options):
        return match.group(0).replace("[]", "")
    return None


def build_request(params: VideoCreateParams, *, options: ModelOptions, geometry: VideoGeometry,
                  limits: GenerationLimits, served_model: str, seed: int, image: Condition | None = None,
                  conditions: tuple[Condition, ...] = (), extension: bool = False,
                  check_loras: Callable[..., None] | None = None) -> GenerationRequest:
    """Resolve the OpenAI-style fields and the model's options (unset: its declared defaults) and validate;
    ``seed`` is used when the client gave none. ``image`` and ``conditions``: the request's media, already decoded
    (``server.http.conditions``). ``extension``: ``seconds`` is the length added to a video (``num_frames - 1``
    frames), not the length of one. ``check_loras``: the server's check of the adapters named (``Engine.check_loras``:
    its adapter directory and the model's modules); unset, any adapter is refused."""
    if params.model is not None and params.model != served_model:
        raise ApiError(400, "model_not_found", f"model={params.model!r} is not served here; use {served_model!r} "
                       "or leave model out", "model")
    values = {name: getattr(params, name) for name in options.names}
    fps = values["frame_rate"]
    if fps is None:  # the default, as resolving the request lowers it to the deployment's limit
        fps = options["frame_rate"].within_limit(options["frame_rate"].default, {}, limits)
    if params.seconds is not None and values["num_frames"] is not None:
        raise ApiError(400, "conflicting_parameters", "give seconds or num_frames, not both", "seconds")
    if params.size is not None and (values["width"] is not None or values["height"] is not None):
        raise ApiError(400, "conflicting_parameters", "give size or width/height, not both", "size")
    if params.seconds is not None:
        seconds = _parse_seconds(params.seconds)
        if not isinstance(fps, int) or not 1 <= fps <= limits.max_fps:
            raise _as_typed(ApiError(400, "invalid_value", f"frame_rate={fps} is out of range; use a value in "
                                     f"[1, {limits.max_fps}]", "frame_rate"), params._aliases)
        t = geometry.temporal_compression
        # NOTE(overflow): a duration far past the limit is refused before it is rounded (1e308 s would overflow).
        frames = frames_for_seconds(seconds, fps, t, extension=extension) \
            if seconds * fps <= limits.max_frames + t else None
        if frames is None or frames > limits.max_frames:
            longest = (limits.max_frames - 1) // t * t + (0 if extension else 1)  # an extension's: after the first
            raise ApiError(400, "invalid_value",
                           f"seconds={params.seconds} is {frames or 'over ' + str(limits.max_frames)} frames at {fps} "
                           f"fps; the limit is {limits.max_frames} frames: use seconds <= {longest / fps:.3g}",
                           "seconds")
        values["num_frames"] = frames
    if params.size is not None:
        match = _SIZE_RE.match(params.size)
        if not match:
            raise ApiError(400, "invalid_value", f"size={params.size!r} is not \"WxH\"; "
                           f"expected {_field_hint('size', limits, geometry)}", "size")
        values["width"], values["height"] = int(match.group(1)), int(match.group(2))
    try:
        request = resolve_request(GenerationRequest.of(prompt=params.prompt, seed=seed if params.seed is None
                                                       else params.seed, image=image, conditions=conditions,
                                                       loras=[lora.model_dump() for lora in params.loras or ()],
                                                       **values), options, limits=limits, geometry=geometry)
        check_request(request, geometry=geometry, limits=limits, options=options)
        if request.loras:
            if check_loras is None:
                raise ValueError("loras: this deployment has no adapters (it was started "
                                 "without --lora-dir DIR, a folder of .safetensors adapters); leave loras out")
            check_loras(request.loras, stages=request.options.get("stages", 1))
    except ValueError as exc:
        message = str(exc)
        param = _param_of(message, options)
        if param is None and message.startswith("image"):
            param = "input_reference"
        if params.size is not None and param in ("width", "height"):
            message, param = f"size={params.size!r}: {message}", "size"
        elif params.seconds is not None and param == "num_frames":
            param = "seconds"
        raise _as_typed(ApiError(400, "invalid_value", message, param), params._aliases) from None
    return request
