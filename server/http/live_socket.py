"""``WS /v1/videos/{id}/live``: one connection that follows a video and directs it, for clients (the playground,
scripts) that would otherwise hold an SSE stream, a streamed response and POSTs at once.

Messages, all JSON text but the MP4:
- server -> client ``{"type": "video", "id": seq, "event": "video.<status>", "video": {...}}``: the job's history, then
  each change, as ``GET .../events`` sends them (the job object in ``video``), the last one its final state.
- client -> server a direction, as ``POST .../directions`` takes it (``{"prompt": "...", "windows": k}``, ``"seconds"``,
  or ``{"end": true}``); answered ``{"type": "directed", "video": {...}}`` or ``{"type": "error", "error": {...}}``
  (the route's 4xx body: code, message, param), the connection kept.
- server -> client binary: the MP4 from its first byte, as it is written (a video made on this server: its fragmented
  MP4 grows in the output store's spool, read through a descriptor of this connection's own), or once completed (a
  video made elsewhere in the fleet); the bytes together are the file ``GET .../content`` serves. When the video is
  made again after its group restarted, ``{"type": "mp4_reset"}`` comes first and the MP4 starts again.
- The server closes with 1000 once the final state and every byte are sent, 4404 for a video that does not exist
  (another tenant's included, as every route answers) or that was deleted, 1001 when it shuts down.

Authentication is the guard's (``server.http.auth``): ``Authorization: Bearer``, or, from a browser (which cannot send
that header on a WebSocket), the subprotocols ``cp-infer.live`` and ``bearer.<key>``; the server answers with
``cp-infer.live`` alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from anyio import to_thread
from fastapi import APIRouter, WebSocket, WebSocketDisconnect

from server.group.jobs import TERMINAL, valid_job_id
from server.group.tenants import OPEN
from server.http.live import parse_direction, take_direction
from server.http.schemas import ApiError
from server.outputs.streaming import SpoolReader

__all__ = ["PROTOCOL", "router"]

router = APIRouter(prefix="/v1/videos", tags=["videos"])

PROTOCOL = "cp-infer.live"
_POLL_S = 0.05
_NOT_FOUND = 4404


@router.websocket("/{video_id}/live")
async def live_socket(websocket: WebSocket, video_id: str) -> None:
    engine, config = websocket.app.state.engine, websocket.app.state.config
    tenant = websocket.scope.get("state", {}).get("tenant", OPEN)
    await websocket.accept(subprotocol=PROTOCOL if PROTOCOL in websocket.scope.get("subprotocols", ()) else None)
    store = engine.store
    seq, job = (await to_thread.run_sync(store.snapshot, video_id)) if valid_job_id(video_id) else (0, None)
    if job is None or not tenant.sees(job.tenant):
        await _refuse(websocket, video_id)
        return
    lock = asyncio.Lock()

    async def send(message: dict[str, Any] | bytes) -> None:
        async with lock:
            if isinstance(message, bytes):
                await websocket.send_bytes(message)
            else:
                await websocket.send_json(message)

    follower = asyncio.create_task(_follow(websocket, store, video_id, seq, job, send))
    try:
        while not follower.done():
            receiving = asyncio.create_task(websocket.receive())
            done, _ = await asyncio.wait({receiving, follower}, return_when=asyncio.FIRST_COMPLETED)
            if receiving not in done:
                receiving.cancel()
                break
            message = receiving.result()
            if message["type"] == "websocket.disconnect":
                break
            await send(await _direct(engine, config, video_id, message))
    except WebSocketDisconnect:
        pass
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError, WebSocketDisconnect, RuntimeError):
            await follower


async def _direct(engine, config, video_id: str, message: dict[str, Any]) -> dict[str, Any]:
    """A client's message taken as a direction: the answer to send back."""
    try:
        if message.get("text") is None:
            raise ApiError(400, "invalid_json", "send a direction as a JSON text message: {\"prompt\": \"...\", "
                           "\"windows\": 1} or {\"end\": true}")
        data = parse_direction(message["text"])
        job = await to_thread.run_sync(take_direction, engine, config, video_id, data)
    except ApiError as exc:
        return {"type": "error", "error": exc.body()["error"]}
    return {"type": "directed", "video": job}


async def _follow(websocket: WebSocket, store, video_id: str, seq: int, job, send) -> None:
    """The job's events and its MP4 until its final state and last byte are sent; then the close."""
    mp4 = SpoolReader(store, video_id)
    try:
        history = await to_thread.run_sync(store.events_since, video_id, 0)
        cursor, final = seq, None
        for event_seq, payload in history or [(seq, job.public())]:
            cursor = max(cursor, event_seq)
            await send(_event(event_seq, payload))
            final = payload if payload["status"] in TERMINAL else final
        polls = 0
        while final is None:
            if websocket.app.state.shutting_down:
                await websocket.close(1001)
                return
            reset, data = await to_thread.run_sync(mp4.follow)
            if reset:
                await send({"type": "mp4_reset"})
            if data:
                await send(data)
                continue  # more may be there already
            for event_seq, payload in await to_thread.run_sync(store.events_since, video_id, cursor):
                cursor = event_seq
                await send(_event(event_seq, payload))
                final = payload if payload["status"] in TERMINAL else final
            polls += 1
            if final is None and polls % 20 == 0 and await to_thread.run_sync(store.snapshot_any, video_id) is None:
                await _refuse(websocket, video_id, deleted=True)
                return
            if final is None:
                await asyncio.sleep(_POLL_S)
        if final["status"] == "completed":
            # The record is final once every byte is in the file (server.outputs.streaming): read to its end, then
            # what a connection that never saw the spool (a video made elsewhere) gets from the store.
            while data := (await to_thread.run_sync(mp4.follow))[1]:
                await send(data)
            done = await to_thread.run_sync(store.get, video_id)
            for chunk in (await to_thread.run_sync(mp4.stored, done)) if done is not None else []:
                await send(chunk)
        await websocket.close(1000)
    finally:
        mp4.close()


def _event(seq: int, payload: dict[str, Any]) -> dict[str, Any]:
    return {"type": "video", "id": seq, "event": f"video.{payload['status']}", "video": payload}


async def _refuse(websocket: WebSocket, video_id: str, *, deleted: bool = False) -> None:
    error = ApiError(404, "video_not_found", f"no video with id {video_id!r}" + (" (deleted)" if deleted else ""),
                     "video_id")
    await websocket.send_json({"type": "error", "error": error.body()["error"]})
    await websocket.close(_NOT_FOUND)
