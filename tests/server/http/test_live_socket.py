"""``WS /v1/videos/{id}/live`` (``server.http.live_socket``): in process over a stub engine, who may open it and what a
bad message gets; against the real 2-rank server, a live LTX-Video followed and directed over one connection, its
binary messages the MP4 ``GET .../content`` serves, byte for byte."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from server.group.database import open_database
from server.group.tenants import Tenants
from server.http.app import AppConfig, create_app

from ..conftest import API_KEY
from .test_openapi import FuzzEngine

_BODY = {"prompt": "a red fox runs through fresh snow", "num_frames": 9, "size": "96x64", "num_inference_steps": 2}


def test_the_socket_is_its_tenants_and_answers_a_bad_message_in_kind(tmp_path):
    engine = FuzzEngine(tmp_path)
    tenants = Tenants(open_database(None, tmp_path))
    keys = {name: tenants.add(name) for name in ("alice", "bob")}
    app = create_app(AppConfig(api_key="server-admin-key-0123456789"), engine)
    try:
        with TestClient(app) as client:
            video = client.post("/v1/videos", json=_BODY, headers={"Authorization": f"Bearer {keys['alice']}"}).json()[
                "id"]
            path = f"/v1/videos/{video}/live"
            # Not completed: its content is a 409 unless it is followed (stream=true, the last test below).
            r = client.get(f"/v1/videos/{video}/content", headers={"Authorization": f"Bearer {keys['alice']}"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready", r.text
            with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect(path):
                pass
            assert refused.value.code == 1008  # no key: closed before it is accepted
            # Another tenant's video is one that does not exist (the key given as a browser gives it).
            for key, target in ((keys["bob"], path), (keys["alice"], "/v1/videos/video_" + "f" * 32 + "/live")):
                with client.websocket_connect(target, subprotocols=["cp-infer.live", f"bearer.{key}"]) as ws:
                    assert ws.accepted_subprotocol == "cp-infer.live"
                    assert ws.receive_json()["error"]["code"] == "video_not_found"
                    with pytest.raises(WebSocketDisconnect) as closed:
                        ws.receive_json()
                    assert closed.value.code == 4404
            with client.websocket_connect(path, headers={"Authorization": f"Bearer {keys['alice']}"}) as ws:
                first = ws.receive_json()
                assert first["type"] == "video" and first["video"]["id"] == video and first["event"] == "video.queued"
                # Each bad message is answered as the POST route answers it; the connection stays.
                # A direction's image is decoded before the job is asked.
                for message, code in (("not json", "invalid_json"), (b"\x00", "invalid_json"),
                                      ({"prompt": "and then", "image": "data:image/png;base64,AAAA"},
                                       "invalid_media"), ({"prompt": "and then"}, "not_live")):
                    if isinstance(message, dict):
                        ws.send_json(message)
                    elif isinstance(message, bytes):
                        ws.send_bytes(message)
                    else:
                        ws.send_text(message)
                    answer = ws.receive_json()
                    assert answer["type"] == "error" and answer["error"]["code"] == code, (message, answer)
    finally:
        engine.store.close()


def test_a_live_video_followed_and_directed_over_one_connection(api_server):
    """Two windows from the create request, a third directed over the socket once they are made (and a bad one,
    answered with the route's error), then the end; the events arrive as GET .../events sends them, the binary
    messages are the MP4 from its first byte, and the connection closes normally after the final state."""
    from websockets.exceptions import ConnectionClosedOK
    from websockets.sync.client import connect

    body = {**_BODY, "num_frames": 33, "live": True, "temporal_tile_size": 32, "temporal_overlap": 24}
    video = api_server.submit(body)["id"]
    url = api_server.url.replace("http://", "ws://") + f"/v1/videos/{video}/live"
    events, answers, mp4 = [], [], bytearray()
    directed = ended = False
    deadline = time.monotonic() + 120
    with connect(url, additional_headers={"Authorization": f"Bearer {API_KEY}"}, open_timeout=30) as ws:
        try:
            while time.monotonic() < deadline:
                message = ws.recv(timeout=max(deadline - time.monotonic(), 0.1))
                if isinstance(message, bytes):
                    mp4 += message
                    continue
                message = json.loads(message)
                if message["type"] != "video":
                    answers.append(message)
                    continue
                events.append(message)
                live = message["video"]["live"]
                if live["waiting"] and live["windows_made"] == 2 and not directed:
                    ws.send(json.dumps({"prompt": "the fox jumps", "windows": 0}))
                    ws.send(json.dumps({"prompt": "the fox jumps", "windows": 1}))
                    directed = True
                elif live["waiting"] and live["windows_made"] == 3 and not ended:
                    ws.send(json.dumps({"end": True}))
                    ended = True
        except ConnectionClosedOK:
            pass
        assert ws.close_code == 1000, ws.close_code
    assert directed and ended, events[-1]
    assert [a["type"] for a in answers] == ["error", "directed", "directed"], answers
    assert answers[0]["error"]["param"] == "windows" and answers[1]["video"]["live"]["windows_directed"] == 3
    assert events[0]["event"] == "video.queued" and events[-1]["event"] == "video.completed"
    assert [e["id"] for e in events] == sorted({e["id"] for e in events})
    final = events[-1]["video"]
    assert final["num_frames"] == 41 and final["live"]["ended"] and final["live"]["windows_made"] == 3, final
    assert bytes(mp4) == api_server.client.get(f"/v1/videos/{video}/content").content and mp4[4:8] == b"ftyp"


def test_a_live_video_created_without_stream_is_watched_as_it_grows(api_server):
    """GET .../content?stream=true of a live video created without stream, asked while it waits for directions: the
    MP4 from its first byte to its last once the video is ended; byte for byte the stored file. (Two windows of 5
    latent frames decode nothing before the end: the decode's first piece reads them all.)"""
    import threading

    import httpx

    body = {**_BODY, "num_frames": 33, "live": True, "temporal_tile_size": 32, "temporal_overlap": 24}
    video = api_server.submit(body)["id"]
    r = api_server.client.get(f"/v1/videos/{video}/content", params={"stream": "true", "variant": "thumbnail"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    wait_for_waiting(api_server, video)
    got, opened = bytearray(), threading.Event()

    def watch() -> None:
        with httpx.stream("GET", f"{api_server.url}/v1/videos/{video}/content?stream=true", timeout=120,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
            opened.set()
            for chunk in response.iter_bytes():
                got.extend(chunk)

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert opened.wait(30), "no answer while the video waits for directions"
    job = api_server.client.get(f"/v1/videos/{video}").json()
    assert job["status"] == "in_progress" and job["live"]["waiting"] and not got, job
    assert api_server.client.post(f"/v1/videos/{video}/directions", json={"end": True}).status_code == 200
    watcher.join(120)
    assert not watcher.is_alive()
    assert api_server.wait_job(video)["status"] == "completed"
    assert bytes(got) == api_server.client.get(f"/v1/videos/{video}/content").content


def wait_for_waiting(server, video: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = server.client.get(f"/v1/videos/{video}").json()["live"]
        if live["waiting"]:
            return
        time.sleep(0.1)
    pytest.fail(f"video {video} never waited for directions")
