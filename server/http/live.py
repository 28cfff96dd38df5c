"""Live videos over HTTP: ``"live": true`` at creation (:func:`live_job`) and ``POST /v1/videos/{id}/directions``.

Invariants:
- Every check runs here, before the job store or any rank sees a direction: a direction is a prompt and a whole
  number of windows (``windows``, or ``seconds`` rounded up to whole windows), with an ``image`` (a data URL) its
  first window starts from where the model's windows each start from one, or ``{"end": true}``; the video's
  length stays within ``--live-max-seconds`` (400 naming the field and the longest it may ask for); the video
  directed passes ``check_request``.
- A live video's request is the one-request video of its directions (``cp_infer.live.live_request``); the first
  direction is the create request's own prompt and windows.
- The store takes a direction in one guarded write (``JobStore.direct``): none is lost between two clients. Another
  tenant's video is answered 404 as one that does not exist.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, Request

from cp_infer.live import (
    MAX_WINDOWS,
    Direction,
    directed_windows,
    first_windows,
    live_request,
    windows_for_frames,
    windows_for_seconds,
)
from cp_infer.request import MAX_CONDITIONS, Condition, GenerationRequest, check_request
from server.group.jobs import Job, Live, LiveRefused, valid_job_id
from server.http.auth import TenantDep
from server.http.conditions import media_api_error, media_limits
from server.http.config import ConfigDep
from server.http.engine import EngineDep
from server.http.media import MediaError, MediaLimits, media_from_url
from server.http.schemas import ApiError, VideoJob, error_responses

__all__ = ["check_live", "live_job", "parse_direction", "router", "take_direction"]

router = APIRouter(prefix="/v1/videos", tags=["videos"])

_FIELDS = ("prompt", "windows", "seconds", "image", "end")


def _seconds(request: GenerationRequest, options, windows: int) -> float:
    return options.live_frames({"num_frames": request.num_frames, **request.options}, windows) / request.fps


def _check_length(request: GenerationRequest, options, windows: int, max_seconds: float, field: str) -> None:
    """A 400 naming ``field`` when ``windows`` windows are longer than the server makes a live video."""
    if windows <= MAX_WINDOWS and _seconds(request, options, windows) <= max_seconds:
        return
    k = first_windows(request, options)[0]
    while k < MAX_WINDOWS and _seconds(request, options, k + 1) <= max_seconds:
        k += 1
    length = f"over {MAX_WINDOWS} windows" if windows > MAX_WINDOWS else f"{_seconds(request, options, windows):.3g} s"
    raise ApiError(400, "invalid_value", f"{field}: the live video would be {length}; this server makes live videos "
                   f"of at most {max_seconds:g} s (--live-max-seconds): {k} windows, "
                   f"{_seconds(request, options, k):.3g} s", field)


def check_live(params, *, options) -> None:
    """What a create request with ``"live": true`` may not also ask for (checked before the request is built)."""
    if options.live_frames is None:
        raise ApiError(400, "invalid_value", f"live: {options.model} does not make live videos (they are made "
                       "window by window); leave live out", "live")
    if getattr(params, "prompt_segments", None):
        raise ApiError(400, "invalid_value", "prompt_segments: a live video's prompts are its directions (POST "
                       "/v1/videos/{video_id}/directions); leave prompt_segments out", "prompt_segments")


def live_job(params, request: GenerationRequest, *, options, max_seconds: float) -> tuple[GenerationRequest, Live]:
    """A create request with ``"live": true`` (:func:`check_live` passed): its request (the one-request video of its
    first direction) and its directions, or a 400 naming the field."""
    field = "seconds" if params.seconds is not None else "num_frames"
    try:
        windows = windows_for_frames(request, options)
    except ValueError as exc:
        # An option that rules a live video out (stages=2) is the field, not the length.
        named = str(exc).removeprefix("live: ").split("=", 1)[0]
        raise ApiError(400, "invalid_value", str(exc), named if named in options.names else field) from None
    _check_length(request, options, windows, max_seconds, field)
    live = Live((Direction(request.prompt, windows),))
    return live_request(request, live.directions, options), live


def _image(data: Any, options, limits: MediaLimits) -> Condition | None:
    """A direction's ``image`` (a data URL) decoded, before the store is asked (it takes no time under its lock)."""
    if not isinstance(data, dict) or data.get("image") is None:
        return None
    if options.window_images is None:
        raise ApiError(400, "invalid_value", f"image: {options.model} windows after the first start from no image "
                       "of their own; direct them with a prompt only", "image")
    if not isinstance(data["image"], str):
        raise ApiError(400, "invalid_value", "image must be a data URL (data:image/png;base64,...): the image the "
                       "next windows start from", "image")
    try:
        frames = media_from_url(data["image"], field="image", limits=limits).frames
    except MediaError as exc:
        raise media_api_error(exc) from None
    if frames.shape[0] != 1:
        raise ApiError(400, "invalid_value", f"image is a video of {frames.shape[0]} frames; the next windows start "
                       "from one image: send a PNG, JPEG or WebP", "image")
    return Condition(frames)


def _direction(data: Any, job: Job, live: Live, options, max_seconds: float, max_prompt_chars: int,
               image: Condition | None, check: Callable[[GenerationRequest], Any]) -> Live:
    """The job's directions with the body's (see the module docstring); ``image``: its image decoded, which
    ``check`` (``check_request``) takes in the request of the video it directs."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object: {\"prompt\": \"...\", \"windows\": 1} "
                       "or {\"end\": true}")
    for name in data:
        if name not in _FIELDS:
            raise ApiError(400, "unknown_parameter", f"{name} is not a direction's field; use prompt with windows "
                           "or seconds, or end", name)
    if "end" in data:
        if data["end"] is not True:
            raise ApiError(400, "invalid_value", "end must be true (to end the video after what is directed)", "end")
        if len(data) > 1:
            extra = next(n for n in data if n != "end")
            raise ApiError(400, "conflicting_parameters", f"{extra}: end takes no other field; send the direction "
                           "first, then {\"end\": true}", extra)
        return Live(live.directions, ended=True)
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, "invalid_value" if "prompt" in data else "missing_required_parameter",
                       "prompt is required: a non-empty string, what the next windows show", "prompt")
    if "windows" in data and "seconds" in data:
        raise ApiError(400, "conflicting_parameters", "give windows or seconds, not both", "seconds")
    now = directed_windows(live.directions)
    if "seconds" in data:
        seconds = data["seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
                or seconds <= 0:
            raise ApiError(400, "invalid_value", f"seconds={seconds!r} must be a positive number (rounded up to "
                           "whole windows)", "seconds")
        windows = windows_for_seconds(job.request, options, now, float(seconds))
        field = "seconds"
    else:
        windows = data.get("windows", 1)
        if isinstance(windows, bool) or not isinstance(windows, int) or not 1 <= windows <= MAX_WINDOWS:
            raise ApiError(400, "invalid_value", f"windows={windows!r} must be a whole number of windows in "
                           f"[1, {MAX_WINDOWS}]", "windows")
        field = "windows"
    if len(prompt) > max_prompt_chars:
        raise ApiError(400, "invalid_value", f"prompt is over {max_prompt_chars} characters; shorten it", "prompt")
    _check_length(job.request, options, now + windows, max_seconds, field)
    directed = Live((*live.directions, Direction(prompt, windows, image)))
    if image is not None:
        grown = live_request(job.request, directed.directions, options)
        if len(grown.conditions) > MAX_CONDITIONS:
            raise ApiError(400, "invalid_value", f"image: a live video takes at most {MAX_CONDITIONS} images, its "
                           "first included; direct the next windows with a prompt only", "image")
        try:
            check(grown)
        except ValueError as exc:
            raise ApiError(400, "invalid_value", f"image: {exc}", "image") from None
    return directed


_DIRECTION_BODY = {"required": True, "description": "The next windows' prompt and how many (or seconds), or the end.",
                   "content": {"application/json": {"schema": {"oneOf": [
                       {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
                           "prompt": {"type": "string", "minLength": 1, "pattern": "\\S",
                                      "description": "What the next windows show."},
                           "windows": {"type": "integer", "minimum": 1, "maximum": MAX_WINDOWS, "default": 1,
                                       "description": "How many windows it directs. Excludes seconds."},
                           "seconds": {"type": "number", "exclusiveMinimum": 0, "description": "How much longer "
                                       "the video gets, rounded up to whole windows. Excludes windows."},
                           "image": {"type": "string", "description": "A data URL of the image the next windows "
                                     "start from (data:image/png;base64,...), where the model's windows each start "
                                     "from one (LTX-Video, Wan image-to-video)."}},
                        "not": {"required": ["windows", "seconds"]}},
                       {"type": "object", "required": ["end"], "additionalProperties": False,
                        "properties": {"end": {"const": True, "description": "End the video after what is "
                                                                             "directed."}}}]}}}}


@router.post("/{video_id}/directions", response_model=VideoJob, responses=error_responses(400, 404, 409, 413, 415),
             openapi_extra={"requestBody": _DIRECTION_BODY})
async def direct_video(video_id: str, request: Request, engine: EngineDep, config: ConfigDep,
                       tenant: TenantDep) -> dict:
    """A live video's next direction: ``{"prompt": "...", "windows": k}`` (or ``"seconds"``; and an ``"image"`` they
    start from, where the model's windows each start from one) appends windows with that prompt, from the first window
    not yet started; ``{"end": true}`` ends the video after what is directed."""
    job = engine.store.get(video_id) if valid_job_id(video_id) else None
    if job is None or not tenant.sees(job.tenant):  # another tenant's video is one that does not exist
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype not in ("application/json", "text/json") and not ctype.endswith("+json"):
        raise ApiError(415, "unsupported_media_type", f"Content-Type {ctype!r} is not accepted; send a direction as "
                       "application/json")
    body = await request.body()
    if len(body) > config.max_body_bytes + 2 * config.max_upload_bytes:  # an image's data URL counts apart
        raise ApiError(413, "request_too_large", f"the body is over the limit of {config.max_body_bytes} bytes "
                       f"(and an image of {config.max_upload_bytes})")
    data = parse_direction(body)
    image = data.get("image") if isinstance(data, dict) else None
    if len(body) - (len(image) if isinstance(image, str) else 0) > config.max_body_bytes:
        raise ApiError(413, "request_too_large", f"the body is over the limit of {config.max_body_bytes} bytes "
                       "(besides its image)")
    return await to_thread.run_sync(take_direction, engine, config, video_id, data)


def parse_direction(body: bytes | str) -> Any:
    """A direction's JSON (the POST body, or a WebSocket message), or a 400."""
    try:
        text = body.decode("utf-8") if isinstance(body, bytes) else body
        return json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(
            ValueError(f"{name} is not a number")))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None


def take_direction(engine, config, video_id: str, data: Any) -> dict:
    """The direction ``data`` taken by the job's store (the job checked as its tenant's already): the job after it,
    or a 4xx ``ApiError``. Blocking (it decodes the direction's image): run it off the event loop."""
    options = engine.options
    image = _image(data, options, media_limits(config.max_upload_bytes, engine.limits))

    def check(request: GenerationRequest) -> None:
        check_request(request, geometry=engine.geometry, limits=engine.limits, options=options)

    try:
        job = engine.store.direct(video_id, lambda job, live: _direction(
            data, job, live, options, config.live_max_seconds, engine.limits.max_prompt_chars, image, check))
    except LiveRefused as exc:
        raise ApiError(409, exc.code, str(exc), "video_id") from None
    if job is None:
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    return job.public()
