"""``/v1/videos``: create (or create and stream), list, get, delete, cancel, download and follow (SSE) video jobs.

Invariants:
- A body is read at most ``max_body_bytes`` (413 past it), parsed strictly (no NaN/Infinity, an object, no
  unknown fields) and turned into a request only by :func:`server.http.schemas.build_request`; the route then only
  queues it. Nothing here talks to the worker group.
- Ids in URLs are checked against the server's own id format before any lookup or file access.
- Every job is its tenant's (``server.http.auth``): another tenant's job is answered 404 exactly as one that does
  not exist (in a URL, or named as a source or as media), a list holds the tenant's own jobs only, and a new job is
  the requesting tenant's, within its limits (429 naming the limit). An admin sees and manages every job.
- ``stream=true``: every check above runs (and fails as JSON) before the job is queued; then the ``200`` and its
  headers (``X-Video-Id``) go out at once, and the body is the job's MP4 as the leader writes it (see
  ``server.outputs.streaming``), from the first decoded piece on. A job that ends other than completed ends the body
  without its last chunk (the client sees a truncated transfer, never a short video that looks whole); a client
  that leaves cancels the job.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Literal, get_args
from urllib.parse import parse_qsl

import anyio
import numpy as np
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, StreamingResponse

from cp_infer.request import EXTEND_TAIL, Condition, check_request
from server.group.jobs import TERMINAL, Job, QueueFull, valid_job_id
from server.group.tenants import Tenant, TenantLimit
from server.http.auth import TenantDep, limit_error
from server.http.conditions import (
    UPLOAD_PREFIX,
    Resolved,
    completed_job,
    job_frames,
    load_media,
    media_limits,
    resolve_media,
)
from server.http.config import AppConfig, ConfigDep
from server.http.engine import EngineDep
from server.http.live import check_live, live_job
from server.http.ranges import ranged_response
from server.http.schemas import (
    ApiError,
    JobStatus,
    VideoCreateParams,
    VideoDeleted,
    VideoJob,
    VideoList,
    build_request,
    error_responses,
    params_from_form,
    params_from_json,
)
from server.outputs.streaming import SpoolReader

__all__ = ["router", "multipart_available"]

log = logging.getLogger("cp_infer.videos")

_CONTENT = {"video": (".mp4", "video/mp4"), "thumbnail": (".jpg", "image/jpeg"),
            "frames": (".npy", "application/octet-stream")}
_SSE_POLL_S = 0.05
_SSE_KEEPALIVE_S = 15.0
_DELETE_WAIT_S = 30.0
_STREAM_CHUNK = 64 * 1024


def multipart_available() -> bool:
    """Whether python-multipart (which Starlette's form parser needs) is installed (``python_multipart`` since 0.0.13,
    ``multipart`` before)."""
    from importlib.util import find_spec

    return find_spec("python_multipart") is not None or find_spec("multipart") is not None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON; numbers must be finite")


async def _read_body(request: Request, cap: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ApiError(413, "request_too_large", f"the body is over the limit of {cap} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class _Body:
    """A parsed body: its fields (``form``: all strings, nested by their ``a[0][b]`` keys) and uploaded files."""

    data: dict
    form: bool
    uploads: dict[str, bytes] = field(default_factory=dict)


# ``conditions[0][media]`` -> ("conditions", "0", "media"); ``video[id]`` -> ("video", "id")
_KEY_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[[A-Za-z0-9_]+\])*)$")  # guidance_scale_2 too


def _nest(pairs: list[tuple[str, object]]) -> dict:
    """Form fields with bracketed keys as nested objects and lists (``conditions[1][strength]``)."""
    data: dict = {}
    for key, value in pairs:
        match = _KEY_RE.match(key)
        if not match:
            raise ApiError(400, "invalid_value", f"form field {key[:80]!r} is not a parameter name", key[:80])
        path = [match.group(1), *re.findall(r"\[([A-Za-z0-9_]+)\]", match.group(2))]
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ApiError(400, "invalid_value", f"{key} conflicts with another field", key)
        if path[-1] in node:
            raise ApiError(400, "invalid_value", f"{key} is given more than once", key)
        node[path[-1]] = value

    def lists(node):
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            if sorted(int(k) for k in node) != list(range(len(node))):
                raise ApiError(400, "invalid_value", "list items in a form must be numbered 0, 1, 2, ...")
            return [lists(node[str(i)]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}

    return lists(data)


async def _body(request: Request, body: bytes) -> _Body:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if ctype in ("application/json", "text/json") or ctype.endswith("+json"):
        try:
            data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ApiError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_json", f"the body must be a JSON object, got {type(data).__name__}")
        return _Body(data, form=False)
    if ctype == "application/x-www-form-urlencoded":
        try:
            pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, "invalid_form", f"the form body is malformed: {exc}") from None
        return _Body(_nest(pairs), form=True)
    if ctype == "multipart/form-data":
        if not multipart_available():
            raise ApiError(415, "unsupported_media_type", "multipart/form-data needs python-multipart on the "
                           "server; send application/json instead")

        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        # NOTE(uploads): no per-part size limit of Starlette's; the whole body is already capped.
        form = await Request(request.scope, receive=replay).form(max_part_size=len(body) + 1)
        pairs, uploads = [], {}
        for key, value in form.multi_items():
            if isinstance(value, str):
                pairs.append((key, value))
            else:  # an uploaded file: the parameters refer to it by its field name
                uploads[key] = await value.read()
                pairs.append((key, UPLOAD_PREFIX + key))
        return _Body(_nest(pairs), form=True, uploads=uploads)
    raise ApiError(415, "unsupported_media_type", f"Content-Type {ctype!r} is not accepted; send application/json"
                   + (" or multipart/form-data" if multipart_available() else ""))


def _media_bytes(node) -> int:
    """Bytes of the data URLs in a parsed body."""
    if isinstance(node, str):
        return len(node) if node[:5].lower() == "data:" else 0
    if isinstance(node, dict):
        return sum(_media_bytes(v) for v in node.values())
    if isinstance(node, list):
        return sum(_media_bytes(v) for v in node)
    return 0


async def _read_media_body(request: Request, *, max_body_bytes: int, max_upload_bytes: int) -> _Body:
    """A body that may carry media: the media (uploads, data URLs) may take up to twice ``max_upload_bytes``
    (each item is checked against ``max_upload_bytes`` when decoded), everything else ``max_body_bytes``."""
    raw = await _read_body(request, max_body_bytes + 2 * max_upload_bytes)
    try:
        body = await _body(request, raw)
    except ApiError:
        if len(raw) > max_body_bytes:  # no media could be told apart: the whole body counts
            raise ApiError(413, "request_too_large", f"the body is over the limit of {max_body_bytes} bytes") \
                from None
        raise
    rest = len(raw) - sum(len(v) for v in body.uploads.values()) - _media_bytes(body.data)
    if rest > max_body_bytes:
        raise ApiError(413, "request_too_large", f"the body is over the limit of {max_body_bytes} bytes "
                       "(besides its media)")
    return body


def _create_params(body: _Body, engine) -> VideoCreateParams:
    kw = dict(options=engine.options, limits=engine.limits, geometry=engine.geometry)
    return params_from_form(body.data, **kw) if body.form else params_from_json(body.data, **kw)


def _job_or_404(engine, video_id: str, tenant: Tenant) -> Job:
    job = engine.store.get(video_id) if valid_job_id(video_id) else None
    if job is None or not tenant.sees(job.tenant):
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    return job


def _sse(seq: int, payload: dict) -> str:
    return f"id: {seq}\nevent: video.{payload['status']}\ndata: {json.dumps(payload)}\n\n"


class _MP4StreamResponse(StreamingResponse):
    """A streamed job's MP4, sent as the leader writes it (see the module docstring)."""

    def __init__(self, stream, *, engine, headers: dict[str, str]):
        super().__init__(iter(()), media_type="video/mp4", headers=headers)
        self._stream, self._engine = stream, engine

    async def __call__(self, scope, receive, send) -> None:
        delivered = False
        try:
            async with anyio.create_task_group() as tasks:

                async def body() -> None:
                    nonlocal delivered
                    delivered = await self._send_body(send)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(body)
                while (await receive())["type"] != "http.disconnect":
                    pass
                tasks.cancel_scope.cancel()  # the client left
        finally:
            self._stream.close()
            if not delivered:
                job_id = self._stream.job_id
                self._engine.release_stream(job_id)
                # A job still queued or running stops (at its next step; after the decode if it is decoding); one
                # that already ended is left as it is.
                self._engine.store.cancel(job_id)

    async def _send_body(self, send) -> bool:
        """Send the headers, then the MP4's bytes as they come; True if the whole video went out."""
        stream = self._stream
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while True:
                outcome = stream.outcome  # read before the file: every byte written before it is then in the file
                data = stream.read(_STREAM_CHUNK)
                if data:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
                elif outcome is not None:
                    break
                else:
                    await asyncio.sleep(_SSE_POLL_S)
            if outcome != "completed":
                log.warning("video %s %s (%s): ending its stream without the last chunk", stream.job_id, outcome,
                            stream.message)
                return False
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True
        except OSError:  # ASGI 2.4 servers report a client that left this way
            return False


def _submit(engine, generation, *, tenant: Tenant, streamed: bool = False, lead: np.ndarray | None = None,
            live=None):
    try:
        if streamed:
            return engine.submit_streamed(generation, model=engine.served_model, tenant=tenant, live=live)
        return engine.store.submit(generation, model=engine.served_model, lead=lead, tenant=tenant, live=live), None
    except TenantLimit as exc:
        raise limit_error(exc) from None
    except QueueFull as exc:
        raise ApiError(429, "queue_full", f"{exc}; retry later", headers={
            "Retry-After": str(engine.retry_after_s())}) from None


def _require_ready(engine) -> None:
    if engine.geometry is None:
        raise ApiError(503, "not_ready", "the worker group is still starting; retry shortly",
                       headers={"Retry-After": "5"})


def _build(engine, params: VideoCreateParams, resolved: Resolved, *, extension: bool = False):
    return build_request(params, options=engine.options, geometry=engine.geometry,
                         limits=engine.limits, served_model=engine.served_model, seed=secrets.randbelow(2**31),
                         image=resolved.image, conditions=resolved.conditions, extension=extension,
                         check_loras=engine.check_loras)


def _edit_defaults(body: _Body, frames, source: Job | None, engine) -> _Body:
    """An edit keeps the source's length and size unless the client gives them: a job's own settings, or an
    upload's frame count (down to ``t*k + 1``) and size (down to the model's size step)."""
    defaults = {}
    data = body.data
    if "seconds" not in data and "num_frames" not in data:
        t = engine.geometry.temporal_compression
        count = min(len(frames), engine.limits.max_frames)
        defaults["num_frames"] = source.request.num_frames if source else (count - 1) // t * t + 1
    if "size" not in data and "width" not in data and "height" not in data:
        step = engine.geometry.spatial_step
        if source:
            defaults["width"], defaults["height"] = source.request.width, source.request.height
        else:
            defaults["width"] = max(step, frames.shape[2] // step * step)
            defaults["height"] = max(step, frames.shape[1] // step * step)
    if source and not {"fps", "frame_rate"} & set(data):
        defaults["frame_rate"] = source.request.fps
    if body.form:  # form fields are strings, converted with the rest
        defaults = {k: str(v) for k, v in defaults.items()}
    return dataclasses.replace(body, data={**data, **defaults})


router = APIRouter(prefix="/v1/videos", tags=["videos"])


def _body_caps(config: AppConfig) -> dict[str, int]:
    return dict(max_body_bytes=config.max_body_bytes, max_upload_bytes=config.max_upload_bytes)


# The request bodies' schemas are the served model's: ``server.http.openapi`` adds them to the document.
_BODY_ERRORS = error_responses(400, 404, 409, 413, 415, 429, 503)
_MP4 = {"schema": {"type": "string", "format": "binary"}}
_CREATED = {200: {"description": "The job; with stream=true, the MP4 itself (fragmented, chunked) as it is made, "
                                "with the job id in X-Video-Id",
                  "content": {"video/mp4": _MP4},
                  "headers": {"X-Video-Id": {"description": "The job's id (with stream=true)",
                                             "schema": {"type": "string"}}}}}


@router.post("", response_model=VideoJob, responses={**_CREATED, **_BODY_ERRORS})
async def create_video(request: Request, engine: EngineDep, config: ConfigDep, tenant: TenantDep,
                       stream: bool | None = Query(
                           None, description="respond with the MP4 itself, sent while it is made (or give stream in "
                                             "the body)")):
    """Queue a text-to-video job (JSON, urlencoded, or multipart when python-multipart is installed)."""
    body = await _read_media_body(request, **_body_caps(config))
    params = _create_params(body, engine)
    if stream is not None and params.stream is not None and stream != params.stream:
        raise ApiError(400, "conflicting_parameters", f"stream={str(stream).lower()} in the query but "
                       f"stream={str(params.stream).lower()} in the body; give it once", "stream")
    streamed = bool(stream or params.stream)
    _require_ready(engine)
    resolved = await anyio.to_thread.run_sync(lambda: resolve_media(
        params, uploads=body.uploads, store=engine.store, limits=media_limits(config.max_upload_bytes, engine.limits),
        viewer=tenant))
    if params.live:
        check_live(params, options=engine.options)
    generation, live = _build(engine, params, resolved), None
    if params.live:
        generation, live = live_job(params, generation, options=engine.options, max_seconds=config.live_max_seconds)
    job, handle = _submit(engine, generation, streamed=streamed, tenant=tenant, live=live)
    if streamed:
        return _MP4StreamResponse(handle, engine=engine, headers={
            "X-Video-Id": job.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return job.public()


async def _source_video(data: dict, body: _Body, engine, config: AppConfig,
                        tenant: Tenant) -> tuple[np.ndarray, Job | None]:
    """The ``video`` an edit or an extension starts from (taken out of ``data``): its frames, and the completed job
    it names (``None`` for an upload or a data URL)."""
    if "video" not in data:
        raise ApiError(400, "missing_required_parameter", "video is required: an uploaded file, a data URL or "
                       "{\"id\": video id} of a completed job", "video")
    ref = data.pop("video")
    store, limits = engine.store, media_limits(config.max_upload_bytes, engine.limits)
    if isinstance(ref, dict) and set(ref) == {"id"} and isinstance(ref["id"], str):
        source = completed_job(store, ref["id"], field="video", viewer=tenant)  # its frames and its settings
        return await anyio.to_thread.run_sync(lambda: job_frames(store, source, field="video", limits=limits)), source
    if isinstance(ref, str):
        return await anyio.to_thread.run_sync(lambda: load_media(
            ref, field="video", uploads=body.uploads, store=store, limits=limits, viewer=tenant)), None
    raise ApiError(400, "invalid_value", "video must be an uploaded file, a data URL or {\"id\": video id}",
                   "video")


def _not_streamed(data: dict, what: str) -> None:
    if "stream" in data:
        raise ApiError(400, "unknown_parameter", f"stream: {what} is not streamed; remove stream and follow "
                       "GET /v1/videos/{video_id}/events", "stream")
    if "live" in data:
        raise ApiError(400, "unknown_parameter", f"live: {what} is not live; remove live (POST /v1/videos makes a "
                       "live video)", "live")


@router.post("/edits", response_model=VideoJob, responses=_BODY_ERRORS)
async def edit_video(request: Request, engine: EngineDep, config: ConfigDep, tenant: TenantDep) -> dict:
    """A new job that redoes a video with a new prompt: ``video`` (an upload, a data URL, or ``{"id": ...}`` of
    a completed job) conditions every frame from frame 0 at ``strength`` (default 0.6: how much of the source
    is kept; 1 returns it unchanged), as LTXConditionPipeline(video=..., strength=...). Other fields as for
    ``POST /v1/videos``; length and size default to the source's."""
    _require_ready(engine)
    body = await _read_media_body(request, **_body_caps(config))
    data = dict(body.data)
    frames, source = await _source_video(data, body, engine, config, tenant)
    _not_streamed(data, "an edit")
    strength = data.pop("strength", 0.6)
    if body.form:
        try:
            strength = float(strength)
        except ValueError:
            raise ApiError(400, "invalid_value", f"strength={strength!r} is not a number in [0, 1]",
                           "strength") from None
    params = _create_params(_edit_defaults(dataclasses.replace(body, data=data), frames, source, engine), engine)
    if params.input_reference is not None or params.conditions:
        raise ApiError(400, "conflicting_parameters", "an edit is conditioned on its video alone; remove "
                       "input_reference and conditions", "video")
    try:
        generation = _build(engine, params, Resolved(conditions=(Condition(frames, strength=strength),)))
    except ApiError as exc:
        if exc.param and exc.param.startswith("conditions[0]"):
            exc.param = "video" if ".media" in exc.param else "strength"
            exc.message = exc.message.replace("conditions[0].media", "video").replace(
                "conditions[0].strength", "strength")
        raise
    job, _ = _submit(engine, generation, tenant=tenant)
    return job.public()


@router.post("/extensions", response_model=VideoJob, responses=_BODY_ERRORS)
async def extend_video(request: Request, engine: EngineDep, config: ConfigDep, tenant: TenantDep) -> dict:
    """A new job: ``video`` (an upload, a data URL, or ``{"id": ...}`` of a completed job) followed by ``seconds``
    more (the nearest multiple of the model's frame step; or ``num_frames - 1`` frames), made window by window from
    its last frames (the ``openai`` SDK's ``videos.extend``). Size and frame rate are the source's (an upload's size
    down to the model's size step); other fields as for ``POST /v1/videos``."""
    _require_ready(engine)
    body = await _read_media_body(request, **_body_caps(config))
    data = dict(body.data)
    frames, source = await _source_video(data, body, engine, config, tenant)
    if len(frames) < EXTEND_TAIL:
        raise ApiError(400, "invalid_value", f"video has {len(frames)} frames; an extension continues from the "
                       f"last {EXTEND_TAIL}: extend a longer video", "video")
    _not_streamed(data, "an extension")
    if data.get("seconds") is None and data.get("num_frames") is None:
        raise ApiError(400, "missing_required_parameter", "seconds is required: how long the extension is", "seconds")
    params = _create_params(_edit_defaults(dataclasses.replace(body, data=data), frames, source, engine), engine)
    if params.input_reference is not None or params.conditions:
        raise ApiError(400, "conflicting_parameters", "an extension is conditioned on its video alone; remove "
                       "input_reference and conditions", "video")
    generation = _build(engine, params, Resolved(), extension=True)
    lead = await anyio.to_thread.run_sync(lambda: _fit(frames, generation.width, generation.height))
    generation = dataclasses.replace(generation, extends=Condition(np.ascontiguousarray(lead[-EXTEND_TAIL:])))
    try:
        check_request(generation, geometry=engine.geometry, limits=engine.limits, options=engine.options)
    except ValueError as exc:
        raise ApiError(400, "invalid_value", str(exc), "video") from None
    job, _ = _submit(engine, generation, lead=lead, tenant=tenant)
    return job.public()


def _fit(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    """The frames at ``width`` x ``height`` (an upload whose size is not the model's step is resized)."""
    if frames.shape[1:3] == (height, width):
        return frames
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(f).resize((width, height), Image.BICUBIC)) for f in frames])


@router.post("/{video_id}/remix", response_model=VideoJob, responses=_BODY_ERRORS)
async def remix_video(video_id: str, request: Request, engine: EngineDep, config: ConfigDep,
                      tenant: TenantDep) -> dict:
    """A new job with the settings and media of ``video_id`` and a new ``prompt``; an extension's is the video it
    extended, extended again (so ``video_id`` must then have completed)."""
    source = _job_or_404(engine, video_id, tenant)
    body = await _body(request, await _read_body(request, config.max_body_bytes))
    if set(body.data) - {"prompt"}:
        extra = sorted(set(body.data) - {"prompt"})[0]
        raise ApiError(400, "unknown_parameter", f"unknown parameter {extra!r}; a remix takes prompt only",
                       extra)
    prompt = body.data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ApiError(400, "missing_required_parameter", "prompt is required: the new prompt", "prompt")
    _require_ready(engine)
    generation = dataclasses.replace(source.request, prompt=prompt)
    try:
        check_request(generation, geometry=engine.geometry, limits=engine.limits, options=engine.options)
    except ValueError as exc:
        raise ApiError(400, "invalid_value", str(exc), "prompt") from None
    try:
        # The source's adapters must still be the server's.
        engine.check_loras(generation.loras, stages=generation.options.get("stages", 1))
    except ValueError as exc:
        raise ApiError(400, "invalid_value", str(exc), "loras") from None
    lead = None
    if source.lead_frames:  # the video it extended: the start of its own
        store = engine.store
        completed_job(store, video_id, field="video_id", viewer=tenant)
        limits = media_limits(config.max_upload_bytes, engine.limits)
        frames = await anyio.to_thread.run_sync(lambda: job_frames(store, source, field="video_id", limits=limits))
        lead = np.ascontiguousarray(frames[:source.lead_frames])
    job, _ = _submit(engine, generation, lead=lead, tenant=tenant)
    return job.public()


@router.get("", response_model=VideoList, responses=error_responses(400))
async def list_videos(engine: EngineDep, tenant: TenantDep, limit: int = Query(20, ge=1, le=100),
                      after: str | None = None, order: Literal["asc", "desc"] = "desc",
                      tenant_filter: str | None = Query(None, alias="tenant", description=(
                          "an admin key: only this tenant's videos (another key lists its own videos only)"))) -> dict:
    """Jobs, newest first by default; ``after`` is the last id of the previous page. A tenant's own jobs; an
    admin's: every tenant's, or ``tenant``'s."""
    if after is not None and not valid_job_id(after):
        raise ApiError(400, "invalid_value", f"after={after!r} is not a video id", "after")
    if tenant_filter is not None and not tenant.admin and tenant_filter != tenant.name:
        raise ApiError(400, "invalid_value", "tenant: only an admin key lists another tenant's videos; remove it",
                       "tenant")
    owner = tenant_filter if tenant.admin else tenant.name
    if after is not None and (job := engine.store.get(after)) is not None and not tenant.sees(job.tenant):
        raise ApiError(400, "invalid_value", f"after={after!r}: no such video", "after")
    try:
        jobs, has_more = engine.store.list(limit=limit, after=after, order=order, tenant=owner)
    except KeyError:
        raise ApiError(400, "invalid_value", f"after={after!r}: no such video", "after") from None
    data = [j.public() for j in jobs]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.get("/{video_id}", response_model=VideoJob, responses=error_responses(404))
async def get_video(video_id: str, engine: EngineDep, tenant: TenantDep) -> dict:
    return _job_or_404(engine, video_id, tenant).public()


@router.delete("/{video_id}", response_model=VideoDeleted, responses=error_responses(404))
async def delete_video(video_id: str, engine: EngineDep, tenant: TenantDep) -> dict:
    """Delete a job; a running one is first cancelled on every rank at the next step boundary."""
    _job_or_404(engine, video_id, tenant)
    store = engine.store
    job, running = store.delete(video_id)
    if job is None:
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    deadline = time.monotonic() + _DELETE_WAIT_S
    # The leader removes a running job once the group has stopped it; wait for that (bounded).
    while running and time.monotonic() < deadline and store.snapshot_any(video_id) is not None:
        await asyncio.sleep(_SSE_POLL_S)
    return {"id": video_id, "object": "video.deleted", "deleted": True}


@router.post("/{video_id}/cancel", response_model=VideoJob, responses=error_responses(404))
async def cancel_video(video_id: str, engine: EngineDep, tenant: TenantDep) -> dict:
    """Extension: stop a job but keep its record (status ``cancelled``); a finished job is unchanged."""
    _job_or_404(engine, video_id, tenant)
    job = engine.store.cancel(video_id)
    if job is None:
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    return job.public()


@router.get("/{video_id}/content", response_class=FileResponse, responses={
    200: {"description": "The file of the variant", "content": {
        "video/mp4": _MP4, "image/jpeg": _MP4, "application/octet-stream": _MP4}},
    **error_responses(400, 404, 409)})
async def download_video(video_id: str, request: Request, engine: EngineDep, tenant: TenantDep,
                         variant: str = "video", stream: bool = Query(
                             False, description="the MP4 of a video not yet completed, sent as it is made (a live "
                             "video's as it grows), its body ending short if the video does not complete")
                         ) -> FileResponse:
    """The MP4 (``variant=video``), a JPEG of the middle frame (``thumbnail``), or, when the server keeps
    them, the raw uint8 frames as ``.npy`` (``frames``, lossless). ``stream=true``: the MP4 of a queued or running
    video as it is made, from its first byte."""
    job = _job_or_404(engine, video_id, tenant)
    allowed = [v for v in _CONTENT if v != "frames" or engine.keep_frames]
    if variant not in allowed:
        raise ApiError(400, "invalid_value", f"variant={variant!r} is not available; use one of {allowed}",
                       "variant")
    if stream and variant != "video":
        raise ApiError(400, "invalid_value", f"stream=true sends the MP4 as it is made; variant={variant!r} exists "
                       "once the video is completed: leave stream out", "stream")
    if stream and not job.terminal:
        return StreamingResponse(_follow_mp4(engine.store, job.id, request), media_type="video/mp4",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    if job.status != "completed":
        raise ApiError(409, "video_not_ready", f"video {video_id} is {job.status} (progress {job.progress}%); "
                       "content exists once its status is completed", "video_id")
    suffix, media_type = _CONTENT[variant]
    store = engine.store
    path = store.output_path(job, suffix)
    if path is not None:
        return FileResponse(path, media_type=media_type, filename=f"{video_id}{suffix}")
    size = await anyio.to_thread.run_sync(store.output_size, job, suffix)
    if size is None:
        raise ApiError(404, "content_not_found", f"the {variant} of {video_id} is missing on the server")
    return ranged_response(lambda start, end: store.read_output(job, suffix, start, end), size,
                           request.headers.get("range"), media_type=media_type, filename=f"{video_id}{suffix}")


async def _follow_mp4(store, video_id: str, request: Request):
    """A video's MP4 from its first byte as it is made (``SpoolReader``), to its last once it is completed; a video
    that ends otherwise (or is deleted) ends the body without its last chunk, never as a short file that looks
    whole."""
    mp4 = SpoolReader(store, video_id)
    try:
        polls = 0
        while not request.app.state.shutting_down:
            reset, data = await anyio.to_thread.run_sync(mp4.follow)
            if reset:
                raise RuntimeError(f"video {video_id} is made again (its group restarted); ask for it again")
            if data:
                yield data
                continue
            polls += 1
            if polls % 4 == 0:  # the record, every 0.2 s: its final state once every byte is in the file
                job = await anyio.to_thread.run_sync(store.snapshot_any, video_id)
                if job is None or job.terminal:
                    break
            await asyncio.sleep(_SSE_POLL_S)
        else:
            raise RuntimeError("the server is shutting down")
        if job is None or job.status != "completed":
            raise RuntimeError(f"video {video_id} ended {'deleted' if job is None else job.status}")
        while data := (await anyio.to_thread.run_sync(mp4.follow))[1]:
            yield data
        for chunk in await anyio.to_thread.run_sync(mp4.stored, job):
            yield chunk
    finally:
        mp4.close()


@router.get("/{video_id}/events", response_class=StreamingResponse, responses={
    200: {"description": "Server-sent events, each of the job's changes (``event: video.<status>``, ``data``: the job "
                         "object), the last one its final state",
          "content": {"text/event-stream": {"schema": {  # each event (OpenAPI 3.1 has no itemSchema)
              "type": "object", "required": ["id", "event", "data"],
              "properties": {"id": {"type": "string", "pattern": "^[0-9]+$"},
                             "event": {"enum": [f"video.{status}" for status in get_args(JobStatus)]},
                             "data": {"type": "string", "contentMediaType": "application/json",
                                      "contentSchema": {"$ref": "#/components/schemas/VideoJob"}}}}}}},
    **error_responses(404)})
async def video_events(video_id: str, request: Request, engine: EngineDep, tenant: TenantDep) -> StreamingResponse:
    """Server-sent events: the job's history so far (or what follows ``Last-Event-ID``), then every change of
    status or progress, ending with the final state (``event: video.<status>``, ``data``: the job object)."""
    if not valid_job_id(video_id):
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    store = engine.store
    seq, job = store.snapshot(video_id)
    if job is None or not tenant.sees(job.tenant):
        raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
    last_id = request.headers.get("last-event-id", "0")
    last_id = int(last_id) if last_id.isdigit() else 0
    # The job's logged history (all of it, or what follows Last-Event-ID when a client resumes).
    history = store.events_since(video_id, last_id)

    async def stream():
        if history:
            cursor = last_id
            for event_seq, payload in history:
                cursor = event_seq
                yield _sse(event_seq, payload)
                if payload["status"] in TERMINAL:
                    return
        else:
            cursor = seq
            yield _sse(seq, job.public())
            if job.terminal:
                return
        last_sent, checks = time.monotonic(), 0
        while not request.app.state.shutting_down:
            for event_seq, payload in store.events_since(video_id, cursor):
                cursor = event_seq
                last_sent = time.monotonic()
                yield _sse(event_seq, payload)
                if payload["status"] in TERMINAL:
                    return
            checks += 1
            if checks % 20 == 0 and store.snapshot_any(video_id) is None:
                return  # deleted, and its log already pruned
            if time.monotonic() - last_sent > _SSE_KEEPALIVE_S:
                last_sent = time.monotonic()
                yield ": keepalive\n\n"
            await asyncio.sleep(_SSE_POLL_S)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
