"""Tenants over HTTP, in process over a stub engine (no worker group; the store is the real one, SQLite): every
route of ``/v1/videos`` under owner / other tenant / admin key / ``--api-key`` / revoked key / no key, list and
usage by tenant, the limits as 429 with Retry-After naming the limit, a revoke held within a second, and a key in
no log line, no answer and not in the store."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
from fastapi.testclient import TestClient

from server.group.database import open_database
from server.group.tenants import KEY_TTL_S, Tenants
from server.http.app import AppConfig, create_app

from .test_openapi import FuzzEngine, _mp4

API_KEY = "server-admin-key-0123456789"
_BODY = {"prompt": "a red fox runs through fresh snow", "num_frames": 9, "size": "96x64", "num_inference_steps": 2}
_OTHER = "video_" + "f" * 32


def _client(app, key: str | None) -> TestClient:
    return TestClient(app, headers={"Authorization": f"Bearer {key}"} if key else {})


@pytest.fixture
def fleet(tmp_path):
    """A server with keys ``alice`` and ``bob`` (users), ``root`` (an admin) and ``eve`` (revoked), its
    ``--api-key``, and one completed and one queued video of alice's."""
    engine = FuzzEngine(tmp_path)
    tenants = Tenants(open_database(None, tmp_path))  # as ``cp-infer keys`` would: a connection of its own
    keys = {name: tenants.add(name, role="admin" if name == "root" else "user") for name in ("alice", "bob", "root",
                                                                                          "eve")}
    tenants.revoke("eve")
    app = create_app(AppConfig(api_key=API_KEY), engine)
    yield engine, tenants, keys, app
    engine.store.close()  # its lease renewer stops


def _alice_videos(engine, keys, app) -> tuple[str, str]:
    """One completed video of alice's (made through the API, completed on the store) and one queued."""
    with _client(app, keys["alice"]) as alice:
        done = alice.post("/v1/videos", json={**_BODY, "num_frames": 33}).json()["id"]
        assert engine.store.claim_next(timeout=0).id == done
        frames = np.random.default_rng().integers(0, 256, (33, 64, 96, 3), dtype=np.uint8)
        np.save(engine.store.path(done, ".npy"), frames)
        engine.store.path(done, ".mp4").write_bytes(_mp4(frames))
        engine.store.path(done, ".jpg").write_bytes(b"\xff\xd8\xff\xd9")
        engine.store.finish(done, "completed")
        queued = alice.post("/v1/videos", json=_BODY).json()["id"]
    return done, queued


def _routes(done: str, queued: str) -> list[tuple[str, str, dict]]:
    """(method, path, request kwargs) of every ``/v1/videos`` route that names a video of alice's."""
    return [
        ("GET", f"/v1/videos/{done}", {}),
        ("GET", f"/v1/videos/{done}/content", {}),
        ("GET", f"/v1/videos/{done}/content?variant=thumbnail", {}),
        ("GET", f"/v1/videos/{done}/events", {}),
        ("POST", f"/v1/videos/{done}/remix", {"json": {"prompt": "the same, at night"}}),
        ("POST", "/v1/videos/edits", {"json": {"prompt": "at night", "video": {"id": done}}}),
        ("POST", "/v1/videos/extensions", {"json": {"prompt": "and on", "video": {"id": done}, "seconds": 1}}),
        ("POST", "/v1/videos", {"json": {**_BODY, "num_frames": 33, "conditions": [{"media": {"id": done}}]}}),
        ("POST", f"/v1/videos/{queued}/cancel", {}),
        ("DELETE", f"/v1/videos/{queued}", {}),
        ("POST", f"/v1/videos/{queued}/directions", {"json": {"prompt": "and then it snows"}}),
    ]


def test_each_route_under_each_key(fleet):
    engine, _, keys, app = fleet
    done, queued = _alice_videos(engine, keys, app)
    route_matrix(app, keys, done, queued)


def route_matrix(app, keys: dict[str, str], done: str, queued: str) -> None:
    """Every route naming alice's completed video ``done`` and queued one ``queued``, through ``app``, under each key
    (``keys``: alice, bob, root an admin, eve revoked; and the server's ``--api-key``, :data:`API_KEY`): 401 without
    a good key, 404 for another tenant (as for a video that does not exist), the owner's and the admins' answered."""
    with (_client(app, keys["alice"]) as owner, _client(app, keys["bob"]) as other,
          _client(app, keys["root"]) as admin, _client(app, API_KEY) as server_admin,
          _client(app, keys["eve"]) as revoked, _client(app, None) as anonymous):
        for method, path, kw in _routes(done, queued):
            for client in (revoked, anonymous):
                r = client.request(method, path, **kw)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
                assert r.headers["www-authenticate"] == "Bearer"
            r = other.request(method, path, **kw)
            # Not 403: a video of another tenant is answered as one that does not exist.
            assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found", (method, path, r.text)
            # The same answer, but for the id, as for a video that does not exist.
            alike = other.request(method, path.replace(done, _OTHER).replace(queued, _OTHER),
                                  **({"json": _swap(kw["json"], done)} if "json" in kw else {}))
            assert r.text.replace(done, _OTHER).replace(queued, _OTHER) == alike.text, (method, path)
        # The owner's and the admins' requests get past ownership; the state-changing ones last.
        for client in (owner, admin, server_admin):
            for method, path, kw in _routes(done, queued)[:8]:
                r = client.request(method, path, **kw)
                assert r.status_code == 200, (method, path, r.text)
        assert owner.post(f"/v1/videos/{queued}/cancel").json()["status"] == "cancelled"
        assert admin.delete(f"/v1/videos/{queued}").status_code == 200
        assert owner.get(f"/v1/videos/{queued}").status_code == 404
        # A new job is its maker's: another tenant's remix of its own video is its own, not alice's.
        made = admin.post(f"/v1/videos/{done}/remix", json={"prompt": "an admin's remix"}).json()
        assert made["tenant"] == "root" and owner.get(f"/v1/videos/{made['id']}").status_code == 404


def _swap(body: dict, done: str) -> dict:
    text = repr(body).replace(done, _OTHER)
    return eval(text)  # noqa: S307 -- a literal this test wrote


def test_lists_and_usage_are_the_tenants_own(fleet):
    engine, _, keys, app = fleet
    with _client(app, keys["alice"]) as alice, _client(app, keys["bob"]) as bob, _client(app, keys["root"]) as root:
        mine = {alice.post("/v1/videos", json=_BODY).json()["id"] for _ in range(2)}
        theirs = bob.post("/v1/videos", json=_BODY).json()["id"]
        assert {j["id"] for j in alice.get("/v1/videos").json()["data"]} == mine
        assert [j["id"] for j in bob.get("/v1/videos").json()["data"]] == [theirs]
        assert {j["id"] for j in root.get("/v1/videos").json()["data"]} == mine | {theirs}
        assert {j["id"] for j in root.get("/v1/videos", params={"tenant": "alice"}).json()["data"]} == mine
        r = bob.get("/v1/videos", params={"tenant": "alice"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
        assert bob.get("/v1/videos", params={"after": sorted(mine)[0]}).status_code == 400  # not a cursor of bob's
        job = alice.get(f"/v1/videos/{sorted(mine)[0]}").json()
        usage = alice.get("/v1/usage").json()["data"]
        assert [u["tenant"] for u in usage] == ["alice"] and usage[0]["jobs_submitted"] == 2
        assert usage[0]["requested_seconds_today"] == pytest.approx(2 * 9 / job["fps"], abs=1e-3)
        every = {u["tenant"]: u for u in root.get("/v1/usage").json()["data"]}
        assert set(every) == {"alice", "bob"} and every["bob"]["jobs"]["queued"] == 1
        assert bob.get("/v1/usage", params={"tenant": "alice"}).status_code == 400
        metrics = root.get("/metrics").text
        assert 'cp_infer_tenant_jobs_submitted_total{tenant="alice"} 2' in metrics
        assert 'cp_infer_tenant_jobs_submitted_total{tenant="bob"} 1' in metrics
        assert 'tenant="alice"' not in bob.get("/metrics").text


def test_limits_are_429_with_retry_after_naming_the_limit(fleet):
    engine, tenants, keys, app = fleet
    tenants.set("alice", max_jobs=2)
    tenants.set("bob", rpm=3)
    carol = tenants.add("carol", seconds_per_day=1.0)
    time.sleep(KEY_TTL_S + 0.05)  # past the server's cached answers for alice and bob
    with _client(app, keys["alice"]) as alice, _client(app, keys["bob"]) as bob, _client(app, carol) as c:
        assert [alice.post("/v1/videos", json=_BODY).status_code for _ in range(2)] == [200, 200]
        r = alice.post("/v1/videos", json=_BODY)
        assert r.status_code == 429 and r.json()["error"]["param"] == "max_jobs", r.text
        assert "max_jobs=2" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
        first = alice.get("/v1/videos").json()["data"][-1]["id"]
        alice.post(f"/v1/videos/{first}/cancel")
        assert alice.post("/v1/videos", json=_BODY).status_code == 200  # one ended: room again
        assert [bob.get("/v1/videos").status_code for _ in range(3)] == [200, 200, 200]
        r = bob.get("/v1/videos")
        assert r.status_code == 429 and r.json()["error"]["param"] == "rpm" and "rpm=3" in r.json()["error"]["message"]
        assert 1 <= int(r.headers["retry-after"]) <= 20  # a token comes back every 20 s
        assert alice.get("/v1/videos").status_code == 200  # another tenant's bucket is its own
        assert c.post("/v1/videos", json={**_BODY, "num_frames": 9}).status_code == 200  # 9 frames at 24 fps: 0.375 s
        assert c.post("/v1/videos", json={**_BODY, "num_frames": 9}).status_code == 200
        r = c.post("/v1/videos", json={**_BODY, "num_frames": 9})
        assert r.status_code == 429 and r.json()["error"]["param"] == "seconds_per_day"
        assert 0 < int(r.headers["retry-after"]) <= 86400
    assert engine.store.tenants.usage("carol")[0]["jobs_submitted"] == 2


def test_a_revoke_holds_within_a_second_and_no_key_is_kept_or_told(fleet, caplog, tmp_path):
    engine, tenants, keys, app = fleet
    caplog.set_level(logging.DEBUG)
    with _client(app, keys["alice"]) as alice:
        answers = [alice.post("/v1/videos", json=_BODY), alice.get("/v1/videos"), alice.get("/v1/usage"),
                   alice.get("/metrics"), alice.get("/v1/videos/" + _OTHER)]
        assert [r.status_code for r in answers] == [200, 200, 200, 200, 404]
        tenants.revoke("alice")  # another connection, as the CLI on another machine
        revoked_at = time.monotonic()
        while alice.get("/v1/videos").status_code == 200:
            assert time.monotonic() - revoked_at < 1.0, "the revoke was not seen within a second"
            time.sleep(0.05)
        answers.append(alice.get("/v1/videos"))
    engine.store.close()
    stored = b"".join(p.read_bytes() for p in engine.store.data_dir.rglob("*") if p.is_file())
    for name, key in keys.items():
        assert key.encode() not in stored, name
        assert all(key not in r.text and key not in str(r.headers) for r in answers), name
        assert key not in caplog.text, name
    assert API_KEY.encode() not in stored


def test_ready_answers_a_probe_and_names_a_running_job_only_to_whom_sees_it(fleet):
    """A kubelet's probe sends no key: ``/ready`` answers it, and says a replica runs a job without saying whose or
    which, as it does to another tenant and to a wrong or revoked key; the owner and admins see the id."""
    engine, _, keys, app = fleet
    _, running = _alice_videos(engine, keys, app)
    engine.ready = lambda: (True, f"running {running}")
    engine.replica_status = lambda: [{"replica": 0, "ranks": [0, 1], "layout": {"guidance": 1, "ring": 1, "ulysses": 2},
                                      "ready": True, "reason": f"running {running}", "job": running,
                                      "heartbeat_rtt_ms": 1.0, "jobs_finished": {}}]
    for key, sees in ((None, False), ("not-a-key", False), (keys["eve"], False), (keys["bob"], False),
                      (keys["alice"], True), (keys["root"], True), (API_KEY, True)):
        with _client(app, key) as client:
            r = client.get("/ready")
        assert r.status_code == 200, (key, r.text)
        replica = r.json()["replicas"][0]
        assert replica["running"] is True
        assert replica["job"] == (running if sees else None), key
        assert (running in r.text) == sees, (key, r.text)
