"""The FastAPI app in process, over a stub engine (no worker group): the engine protocol both the stub and the
group leader implement, authentication of every route, CORS, and the pure request arithmetic. The real server is
exercised by the other test_server_* modules."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIWebSocketRoute
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect
from typing_extensions import get_protocol_members

from cp_infer.request import GenerationLimits
from cp_infer.shapes import VideoGeometry
from models.ltx_video.options import ltx_video_options
from server.group.jobs import JobStore
from server.group.leader import GroupLeader, Histogram, LeaderConfig
from server.group.tenants import OPEN
from server.http.app import AppConfig, create_app
from server.http.engine import Engine
from server.http.schemas import frames_for_seconds
from server.outputs.streaming import VideoStream

KEY = "unit-test-key-0123456789"


class StubEngine:
    """An :class:`Engine` that never runs a job."""

    def __init__(self, data_dir):
        self.store = JobStore(data_dir, max_queue=4)
        self.limits = GenerationLimits()
        self.geometry = VideoGeometry()
        self.options = ltx_video_options()
        self.served_model = "tiny-ltx-video"
        self.family = "ltx-video"
        self.keep_frames = False
        self.world_size, self.last_ping_rtt_s, self.broadcasts, self.restart_count = 2, 0.001, 0, 0
        self.jobs_done = {"completed": 0, "failed": 0, "cancelled": 0}
        self.step_seconds = Histogram((0.1, 1.0))
        self.generation_seconds = Histogram((1.0, 10.0))
        self.blocks_saved = 0
        self.memory = [{"rank": 0, "weights": "sharded", "offload": [], "components": {"transformer": {"cpu": 1024}}}]

    def ready(self):
        return True, "idle"

    def replica_status(self):
        return [{"replica": 0, "ranks": [0, 1], "layout": {"guidance": 1, "ring": 2, "ulysses": 1}, "ready": True,
                 "reason": "idle", "job": None,
                 "heartbeat_rtt_ms": 1.0, "jobs_finished": dict(self.jobs_done)}]

    def retry_after_s(self) -> int:
        return 1

    def adapters(self):
        return []

    def check_loras(self, loras, *, stages: int = 1) -> None:
        if loras:
            raise ValueError("loras: this deployment has no adapters (it was started without --lora-dir DIR)")

    def submit_streamed(self, request, *, model: str, tenant=OPEN, live=None):
        job = self.store.submit(request, model=model, tenant=tenant, live=live)
        return job, VideoStream(job.id)

    def release_stream(self, job_id: str) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def _stub(data_dir) -> Engine:
    engine: Engine = StubEngine(data_dir)  # a type checker holds the stub to the protocol here
    return engine


def test_the_stub_and_the_group_leader_implement_the_engine_protocol(tmp_path):
    from server.group.runtime import RuntimeConfig

    members = get_protocol_members(Engine)
    # What the app reads (server/health.py, server/videos.py): a protocol that lost one would let the app use
    # the leader's other attributes unchecked.
    assert {"store", "ready", "submit_streamed", "keep_frames", "geometry", "broadcasts", "start", "stop"} <= members
    leader = GroupLeader(LeaderConfig(runtime=RuntimeConfig(), data_dir=tmp_path / "leader"),
                         JobStore(tmp_path / "leader", max_queue=2), exit_on_fatal=False)  # not started
    for engine in (_stub(tmp_path / "stub"), leader):
        missing = sorted(m for m in members if not hasattr(engine, m))
        assert not missing, f"{type(engine).__name__} lacks {missing}"
        assert isinstance(engine, Engine)
        for name in members:
            declared = getattr(Engine, name)
            # A property of the protocol is data on the implementation too, a method a method.
            assert callable(getattr(engine, name)) != isinstance(declared, property), (type(engine).__name__, name)
    assert leader.broadcasts == 0 and leader.keep_frames is False
    leader.store.close()


def _flatten(routes):
    """Every route with a path; FastAPI >= 0.16x keeps an included router as one entry of ``app.routes``."""
    for route in routes:
        if hasattr(route, "effective_candidates"):
            yield from _flatten(route.effective_candidates())
        elif hasattr(route, "path"):
            yield route
        else:
            raise AssertionError(f"cannot enumerate {route!r}: the test must learn this kind of route")


def _requests(app):
    """One request per (route, method) of the app, path parameters filled with a well-formed id; a WebSocket route's
    method is ``WEBSOCKET`` (its path is its own route's: an included one shows none)."""
    for route in _flatten(app.routes):
        original = getattr(route, "original_route", None) or route
        if isinstance(original, APIWebSocketRoute):
            yield original.path, "WEBSOCKET", re.sub(r"\{[^}]+\}", "video_" + "0" * 32, original.path)
            continue
        path = re.sub(r"\{[^}]+\}", "video_" + "0" * 32, route.path)
        for method in sorted(getattr(route, "methods", None) or {"GET"}):
            yield route.path, method, path


def _ask(client, method: str, path: str) -> int:
    """The status of a request, a WebSocket's as HTTP would say it: 401 refused by the guard (closed before it is
    accepted), 404 closed for a video that does not exist, 200 accepted otherwise."""
    if method != "WEBSOCKET":
        return client.request(method, path).status_code
    try:
        with client.websocket_connect(path) as ws:
            ws.receive_json()
            ws.receive_json()
    except WebSocketDisconnect as closed:
        return {1008: 401, 4404: 404}.get(closed.code, 200)
    return 200


def test_every_route_but_health_and_ready_needs_the_api_key(tmp_path):
    """``/ready`` answers a probe without a key (``test_tenants.py``: what it tells whom)."""
    app = create_app(AppConfig(api_key=KEY), _stub(tmp_path))
    paths = {route.path for route in _flatten(app.routes)}
    # FastAPI's own routes are there too: the guard must cover them as well.
    assert {"/docs", "/openapi.json", "/v1/videos", "/v1/videos/{video_id}/content", "/metrics"} <= paths
    with TestClient(app) as anonymous, TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as keyed:
        checked = 0
        for route_path, method, path in _requests(app):
            if method == "WEBSOCKET":  # refused before it opens without the key; past the guard with it
                assert _ask(anonymous, method, path) == 401 and _ask(keyed, method, path) == 404, path
                checked += 1
                continue
            r = anonymous.request(method, path)
            if route_path in ("/health", "/ready"):
                assert r.status_code == 200, (method, path)
            else:
                assert r.status_code == 401, (method, path, r.status_code)
                assert method == "HEAD" or r.json()["error"]["code"] == "invalid_api_key"
                # With the key the same request gets past the guard (to a 2xx, 4xx of its own, never 401).
                assert keyed.request(method, path).status_code != 401, (method, path)
            checked += 1
        assert checked >= 12


def test_without_a_key_nothing_asks_for_one(tmp_path):
    app = create_app(AppConfig(), _stub(tmp_path))
    with TestClient(app) as client:
        for _, method, path in _requests(app):
            assert _ask(client, method, path) != 401, (method, path)


def test_ready_and_the_playground_show_the_layout(tmp_path):
    with TestClient(create_app(AppConfig(), _stub(tmp_path))) as client:
        ready = client.get("/ready").json()
        assert ready["replicas"][0]["layout"] == {"guidance": 1, "ring": 2, "ulysses": 1}
        options = client.get("/playground/options").json()
        assert options["layout"] == {"replicas": 1, "guidance": 1, "ring": 2, "ulysses": 1}


def test_no_cors_unless_configured(tmp_path):
    origin = {"Origin": "https://example.com"}
    with TestClient(create_app(AppConfig(), _stub(tmp_path / "a"))) as client:
        assert "access-control-allow-origin" not in client.get("/health", headers=origin).headers
    app = create_app(AppConfig(api_key=KEY, cors_origins=("https://example.com",)), _stub(tmp_path / "b"))
    with TestClient(app) as client:
        preflight = client.options("/v1/videos", headers={**origin, "Access-Control-Request-Method": "POST"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://example.com"
        assert client.get("/v1/videos", headers=origin).status_code == 401  # CORS is not authentication


def test_jobs_survive_a_new_store_and_running_ones_run_again(tmp_path):
    """A new leader puts the job that was running back at the head of the queue, with its checkpoint, until it has
    been started MAX_ATTEMPTS times; then it fails it. Queued jobs stay queued, in order; a job that ends keeps no
    checkpoint."""
    import numpy as np

    from cp_infer.request import GenerationRequest, resolve_request
    from server.group.jobs import MAX_ATTEMPTS

    store = JobStore(tmp_path, max_queue=4)
    a, b = (store.submit(resolve_request(GenerationRequest(prompt=p), ltx_video_options()), model="m")
            for p in ("first", "second"))
    assert store.claim_next(timeout=0).id == a.id
    store.save_checkpoint(a.id, 2, {"latents": np.ones((1, 2, 3), dtype=np.float32)})
    store.set_window(a.id, 2, 5)
    for attempt in range(1, MAX_ATTEMPTS):
        store.close()
        store = JobStore(tmp_path, max_queue=4)
        assert store.recover() == [a.id]
        job = store.get(a.id)
        assert job.status == "queued" and job.attempts == attempt and (job.window, job.windows) == (2, 5)
        assert store.claim_next(timeout=0).id == a.id, "the interrupted job runs before the ones queued after it"
        passes, arrays = store.load_checkpoint(a.id)
        assert passes == 2 and arrays["latents"].shape == (1, 2, 3)
    store.close()
    store = JobStore(tmp_path, max_queue=4)
    assert store.recover() == [a.id]
    job = store.get(a.id)
    assert job.status == "failed" and job.error_code == "worker_group_restarted", job
    assert store.load_checkpoint(a.id) is None
    assert store.claim_next(timeout=0).id == b.id
    assert store.get(b.id).public()["window"] is None


@pytest.mark.parametrize("seconds,fps,frames", [(4, 24, 97), (0.7, 24, 17), (0.01, 24, 1), (5, 8, 41), (1, 12, 9)])
def test_seconds_become_the_nearest_valid_frame_count(seconds, fps, frames):
    assert frames_for_seconds(seconds, fps, 8) == frames


@pytest.mark.parametrize("seconds,fps,added", [(4, 24, 96), (8, 25, 200), (2, 25, 48), (1, 25, 24), (0.68, 25, 16),
                                               (0.01, 24, 8), (4, 25, 96)])
def test_an_extensions_seconds_are_the_frames_it_adds(seconds, fps, added):
    # num_frames - 1 frames follow the extended video's last: those are the ones nearest to seconds * fps (4 s at
    # 25 fps, 100 frames, is 96 or 104: the nearest 8k either way; at least 8).
    frames = frames_for_seconds(seconds, fps, 8, extension=True)
    assert frames - 1 == added and (frames - 1) % 8 == 0
    assert abs(added - seconds * fps) <= 4 or added == 8
