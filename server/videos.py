"""``/v1/videos``: create (or create and stream), list, get, delete, cancel, download and follow (SSE) video jobs.

Invariants:
- A body is read at most ``max_body_bytes`` (413 past it), parsed strictly (no NaN/Infinity, an object, no
  unknown fields) and turned into a request only by :func:`server.schemas.build_request`; the route then only
  queues it. Nothing here talks to the worker group.
- Ids in URLs are checked against the server's own id format before any lookup or file access.
- ``stream=true``: every check above runs (and fails as JSON) before the job is queued; then the ``200`` and its
  headers (``X-Video-Id``) go out at once, and the body is the job's MP4 as the leader writes it (see
  ``server.streaming``), from the first decoded piece on. A job that ends other than completed ends the body
  without its last chunk (the client sees a truncated transfer, never a short video that looks whole); a client
  that leaves cancels the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from typing import Literal
from urllib.parse import parse_qsl

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, StreamingResponse

from server.jobs import TERMINAL, Job, QueueFull, valid_job_id
from server.schemas import (
    ApiError,
    ErrorResponse,
    VideoCreateParams,
    VideoDeleted,
    VideoJob,
    VideoList,
    build_request,
    params_from_form,
    params_from_json,
)

__all__ = ["videos_router", "multipart_available"]

log = logging.getLogger("cp_infer.videos")

_CONTENT = {"video": (".mp4", "video/mp4"), "thumbnail": (".jpg", "image/jpeg"),
            "frames": (".npy", "application/octet-stream")}
_SSE_POLL_S = 0.05
_SSE_KEEPALIVE_S = 15.0
_DELETE_WAIT_S = 30.0
_STREAM_CHUNK = 64 * 1024


def multipart_available() -> bool:
    try:
        import multipart  # noqa: F401  (python-multipart, which Starlette's form parser needs)
    except ImportError:
        return False
    return True


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


async def _params(request: Request, body: bytes, engine) -> VideoCreateParams:
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    kw = dict(limits=engine.limits, geometry=engine.geometry)
    if ctype in ("application/json", "text/json") or ctype.endswith("+json"):
        try:
            data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ApiError(400, "invalid_json", f"the body is not valid JSON: {exc}") from None
        return params_from_json(data, **kw)
    if ctype == "application/x-www-form-urlencoded":
        try:
            pairs = parse_qsl(body.decode("utf-8"), keep_blank_values=True, strict_parsing=bool(body))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ApiError(400, "invalid_form", f"the form body is malformed: {exc}") from None
        return _form_params(pairs, kw)
    if ctype == "multipart/form-data":
        if not multipart_available():
            raise ApiError(415, "unsupported_media_type", "multipart/form-data needs python-multipart on the "
                           "server; send application/json instead")

        async def replay():
            return {"type": "http.request", "body": body, "more_body": False}

        form = await Request(request.scope, receive=replay).form()
        pairs = []
        for key, value in form.multi_items():
            if not isinstance(value, str):
                raise ApiError(400, "unsupported_parameter", f"{key}: file uploads (e.g. input_reference) are not "
                               "supported by this server", key)
            pairs.append((key, value))
        return _form_params(pairs, kw)
    raise ApiError(415, "unsupported_media_type", f"Content-Type {ctype!r} is not accepted; send application/json"
                   + (" or multipart/form-data" if multipart_available() else ""))


def _form_params(pairs: list[tuple[str, str]], kw: dict) -> VideoCreateParams:
    data: dict[str, str] = {}
    for key, value in pairs:
        if key in data:
            raise ApiError(400, "invalid_value", f"{key} is given more than once", key)
        data[key] = value
    return params_from_form(data, **kw)


def _job_or_404(engine, video_id: str) -> Job:
    job = engine.store.get(video_id) if valid_job_id(video_id) else None
    if job is None:
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


def videos_router(engine, *, max_body_bytes: int) -> APIRouter:
    router = APIRouter(prefix="/v1/videos", tags=["videos"])
    store = engine.store

    errors = {code: {"model": ErrorResponse} for code in (400, 401, 413, 415, 429, 503)}
    body_schema = {"requestBody": {"required": True, "content": {
        "application/json": {"schema": VideoCreateParams.model_json_schema()}}}}

    created = {200: {"description": "The job; with stream=true, the MP4 itself (fragmented, chunked) as it is made, "
                                    "with the job id in X-Video-Id",
                     "content": {"video/mp4": {"schema": {"type": "string", "format": "binary"}}}}}

    @router.post("", response_model=VideoJob, responses={**created, **errors}, openapi_extra=body_schema)
    async def create_video(request: Request, stream: bool | None = Query(
            None, description="respond with the MP4 itself, sent while it is made (or give stream in the body)")):
        """Queue a text-to-video job (JSON, urlencoded, or multipart when python-multipart is installed)."""
        body = await _read_body(request, max_body_bytes)
        params = await _params(request, body, engine)
        if stream is not None and params.stream is not None and stream != params.stream:
            raise ApiError(400, "conflicting_parameters", f"stream={str(stream).lower()} in the query but "
                           f"stream={str(params.stream).lower()} in the body; give it once", "stream")
        streamed = bool(stream or params.stream)
        if engine.geometry is None:
            raise ApiError(503, "not_ready", "the worker group is still starting; retry shortly",
                           headers={"Retry-After": "5"})
        generation = build_request(params, geometry=engine.geometry, family=engine.family, layers=engine.layers,
                                   limits=engine.limits,
                                   served_model=engine.served_model, seed=secrets.randbelow(2**31))
        try:
            if streamed:
                job, handle = engine.submit_streamed(generation, model=engine.served_model)
            else:
                job = store.submit(generation, model=engine.served_model)
        except QueueFull as exc:
            raise ApiError(429, "queue_full", f"{exc}; retry later", headers={
                "Retry-After": str(engine.retry_after_s())}) from None
        if streamed:
            return _MP4StreamResponse(handle, engine=engine, headers={
                "X-Video-Id": job.id, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return job.public()

    @router.get("", response_model=VideoList)
    async def list_videos(limit: int = Query(20, ge=1, le=100), after: str | None = None,
                          order: Literal["asc", "desc"] = "desc") -> dict:
        """Jobs, newest first by default; ``after`` is the last id of the previous page."""
        if after is not None and not valid_job_id(after):
            raise ApiError(400, "invalid_value", f"after={after!r} is not a video id", "after")
        try:
            jobs, has_more = store.list(limit=limit, after=after, order=order)
        except KeyError:
            raise ApiError(400, "invalid_value", f"after={after!r}: no such video", "after") from None
        data = [j.public() for j in jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": has_more}

    @router.get("/{video_id}", response_model=VideoJob)
    async def get_video(video_id: str) -> dict:
        return _job_or_404(engine, video_id).public()

    @router.delete("/{video_id}", response_model=VideoDeleted)
    async def delete_video(video_id: str) -> dict:
        """Delete a job; a running one is first cancelled on every rank at the next step boundary."""
        _job_or_404(engine, video_id)
        job, running = store.delete(video_id)
        if job is None:
            raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
        deadline = time.monotonic() + _DELETE_WAIT_S
        # The leader removes a running job once the group has stopped it; wait for that (bounded).
        while running and time.monotonic() < deadline and store.snapshot_any(video_id) is not None:
            await asyncio.sleep(_SSE_POLL_S)
        return {"id": video_id, "object": "video.deleted", "deleted": True}

    @router.post("/{video_id}/cancel", response_model=VideoJob)
    async def cancel_video(video_id: str) -> dict:
        """Extension: stop a job but keep its record (status ``cancelled``); a finished job is unchanged."""
        _job_or_404(engine, video_id)
        job = store.cancel(video_id)
        if job is None:
            raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
        return job.public()

    @router.get("/{video_id}/content")
    async def download_video(video_id: str, variant: str = "video") -> FileResponse:
        """The MP4 (``variant=video``), a JPEG of the middle frame (``thumbnail``), or, when the server keeps
        them, the raw uint8 frames as ``.npy`` (``frames``, lossless)."""
        job = _job_or_404(engine, video_id)
        allowed = [v for v in _CONTENT if v != "frames" or engine.config.keep_frames]
        if variant not in allowed:
            raise ApiError(400, "invalid_value", f"variant={variant!r} is not available; use one of {allowed}",
                           "variant")
        if job.status != "completed":
            raise ApiError(409, "video_not_ready", f"video {video_id} is {job.status} (progress {job.progress}%); "
                           "content exists once its status is completed", "video_id")
        suffix, media_type = _CONTENT[variant]
        path = store.path(video_id, suffix)
        if not path.is_file():
            raise ApiError(404, "content_not_found", f"the {variant} of {video_id} is missing on the server")
        return FileResponse(path, media_type=media_type, filename=f"{video_id}{suffix}")

    @router.get("/{video_id}/events")
    async def video_events(video_id: str, request: Request) -> StreamingResponse:
        """Server-sent events: the job's history so far (or what follows ``Last-Event-ID``), then every change of
        status or progress, ending with the final state (``event: video.<status>``, ``data``: the job object)."""
        if not valid_job_id(video_id):
            raise ApiError(404, "video_not_found", f"no video with id {video_id!r}", "video_id")
        seq, job = store.snapshot(video_id)
        if job is None:
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

    return router
