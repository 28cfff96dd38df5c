"""Two servers' job stores over one real PostgreSQL and one real S3 (SeaweedFS), both on loopback
(``tests/services.py``): what one server makes, the other serves; each job is claimed by one server at a time and
completed once; a stale attempt (its server frozen past its lease) changes nothing; a dead server's job goes on from
its checkpoint on the other once its lease runs out; an unreachable database is a 503 naming it.

The HTTP side runs the real app in process over a stub engine per server (no worker group: the stores are what is
tested); the claims are made on the stores as a group leader makes them.
"""

from __future__ import annotations

import io
import json
import threading
import time

import numpy as np
import psycopg
import pytest
from fastapi.testclient import TestClient

from cp_infer.request import GenerationRequest, resolve_request
from models.ltx_video.options import ltx_video_options
from server.group.database import SCHEMA_VERSION, open_database
from server.group.jobs import _FRESH_S, JobStore
from server.group.leader import GroupLeader, LeaderConfig
from server.group.runtime import RuntimeConfig
from server.http.app import AppConfig, create_app
from tests.server.group.test_protocol import _Runtime, group  # noqa: F401 -- a stand-in group, its fixture
from tests.server.http.test_server_app import StubEngine

pytestmark = pytest.mark.timeout(120)

_BODY = {"prompt": "a red fox runs through fresh snow", "num_frames": 9, "size": "96x64",
         "num_inference_steps": 2, "seed": 1234}


def _request(prompt: str) -> GenerationRequest:
    return resolve_request(GenerationRequest(prompt=prompt, num_frames=9, width=96, height=64), ltx_video_options())


def _store(tmp_path, name: str, pg: str, s3: str, *, lease_s: float = 30.0, max_queue: int = 64) -> JobStore:
    return JobStore(tmp_path / name, max_queue=max_queue, job_store=pg, output_store=s3, lease_s=lease_s, node=name)


def _publish(store: JobStore, job_id: str, data: bytes, attempt: int) -> None:
    made = store.path(job_id, ".mp4.tmp")
    made.write_bytes(data)
    store.publish(job_id, [(made, ".mp4")], attempt=attempt)


class _Server(StubEngine):
    def __init__(self, store: JobStore):
        super().__init__(store.data_dir / "stub")
        self.store.close()
        self.store = store


def test_a_job_made_on_one_server_is_served_by_the_other(tmp_path, pg_url, s3_url):
    a, b = _store(tmp_path, "a", pg_url, s3_url), _store(tmp_path, "b", pg_url, s3_url)
    with TestClient(create_app(AppConfig(), _Server(a))) as ca, TestClient(create_app(AppConfig(), _Server(b))) as cb:
        made = ca.post("/v1/videos", json=_BODY)
        assert made.status_code == 200, made.text
        job_id = made.json()["id"]
        assert cb.get(f"/v1/videos/{job_id}").json()["status"] == "queued"
        assert job_id in [j["id"] for j in cb.get("/v1/videos").json()["data"]]
        time.sleep(1.1)  # the fleet's queue, as b's /metrics sees it: one job, queued a second ago or more
        metrics = dict(line.rsplit(" ", 1) for line in cb.get("/metrics").text.splitlines() if line[0] != "#")
        assert float(metrics["cp_infer_queue_depth"]) == 1 and float(metrics["cp_infer_queue_oldest_age_seconds"]) >= 1
        # b's group runs it; a serves its progress, events and content.
        job = b.claim_next(timeout=5)
        assert job.id == job_id and job.attempts == 1
        b.set_progress(job_id, 40, attempt=1)
        assert ca.get(f"/v1/videos/{job_id}").json()["progress"] == 40
        video = np.random.default_rng().integers(0, 256, 3000, dtype=np.uint8).tobytes()
        _publish(b, job_id, video, 1)
        assert b.finish(job_id, "completed", attempt=1).status == "completed"
        with ca.stream("GET", f"/v1/videos/{job_id}/events") as events:
            lines = [json.loads(line[len("data: "):]) for line in events.iter_lines() if line.startswith("data: ")]
        assert [e["status"] for e in lines][-1] == "completed" and lines[-1]["progress"] == 100, lines
        full = ca.get(f"/v1/videos/{job_id}/content")
        assert full.status_code == 200 and full.content == video
        part = ca.get(f"/v1/videos/{job_id}/content", headers={"Range": "bytes=100-1099"})
        assert part.status_code == 206 and part.content == video[100:1100], part.status_code
        assert part.headers["content-range"] == f"bytes 100-1099/{len(video)}"
        tail = ca.get(f"/v1/videos/{job_id}/content", headers={"Range": "bytes=-10"})
        assert tail.status_code == 206 and tail.content == video[-10:]
        assert ca.get(f"/v1/videos/{job_id}/content", headers={"Range": f"bytes={len(video)}-"}).status_code == 416
        # Cancel reaches the server running a job; a queued one made on a is cancelled from b.
        running = ca.post("/v1/videos", json=_BODY).json()["id"]
        queued = ca.post("/v1/videos", json=_BODY).json()["id"]
        claimed = b.claim_next(timeout=5)
        assert claimed.id == running and not b.cancel_requested(running, attempt=claimed.attempts)
        assert ca.post(f"/v1/videos/{running}/cancel").status_code == 200
        assert b.cancel_requested(running, attempt=claimed.attempts)
        assert b.finish(running, "cancelled", "cancelled", "stopped", attempt=claimed.attempts).status == "cancelled"
        assert cb.post(f"/v1/videos/{queued}/cancel").json()["status"] == "cancelled"
        assert ca.get(f"/v1/videos/{queued}").json()["status"] == "cancelled"
        # Deleted from b: gone from a, and its objects from the bucket.
        assert cb.delete(f"/v1/videos/{job_id}").status_code == 200
        assert ca.get(f"/v1/videos/{job_id}").status_code == 404
    b.close()  # its removals done
    assert a.outputs.size(job_id, ".mp4", attempt=1) is None
    a.close()


def test_a_stale_attempt_cannot_progress_checkpoint_complete_or_overwrite(tmp_path, pg_url, s3_url):
    """a claims the job, then is frozen past its lease (its lease made to run out); b takes the job over. Every
    write a makes when it wakes, carrying its attempt, changes nothing, and its poll tells it to stop."""
    a, b = _store(tmp_path, "a", pg_url, s3_url), _store(tmp_path, "b", pg_url, s3_url)
    job = a.submit(_request("a fenced video"), model="m")
    first = a.claim_next(timeout=0)
    a.set_progress(job.id, 30, attempt=first.attempts)
    ckpt = {"latents": np.random.default_rng().standard_normal((1, 4, 3)).astype(np.float32)}
    a.save_checkpoint(job.id, 1, ckpt, attempt=first.attempts)
    a.wait_checkpoint(job.id)  # uploaded in the background
    with psycopg.connect(pg_url, autocommit=True) as conn:  # a's lease runs out (a froze)
        conn.execute("UPDATE jobs SET lease_until = 0 WHERE id = %s", (job.id,))
    time.sleep(_FRESH_S)  # a froze for a while: the row its last write returned no longer answers its polls
    second = b.claim_next(timeout=5)
    assert second.id == job.id and second.attempts == first.attempts + 1 and second.progress == 30
    got = b.load_checkpoint(job.id)
    assert got[0] == 1 and np.array_equal(got[1]["latents"], ckpt["latents"])
    winner = np.random.default_rng().integers(0, 256, 500, dtype=np.uint8).tobytes()
    _publish(b, job.id, winner, second.attempts)
    # a wakes up.
    assert a.cancel_requested(job.id, attempt=first.attempts)
    a.set_progress(job.id, 95, attempt=first.attempts)
    a.set_window(job.id, 2, 3, attempt=first.attempts)
    a.save_checkpoint(job.id, 2, {"latents": np.zeros((1, 4, 3), np.float32) + 7}, attempt=first.attempts)
    a.wait_checkpoint(job.id)
    _publish(a, job.id, b"stale bytes", first.attempts)
    assert a.finish(job.id, "completed", attempt=first.attempts) is None
    now = b.get(job.id)
    assert now.status == "in_progress" and now.progress == 30 and now.window is None, now
    assert b.load_checkpoint(job.id)[0] == 1
    # a passed its check just before it froze: its checkpoint lands on its own key, which the record still names
    # as the job's (b has saved none yet). It stays: a later pass of the same job, which a third attempt resumes.
    a._current = lambda *_: True
    a.save_checkpoint(job.id, 2, {"latents": ckpt["latents"] + 1}, attempt=first.attempts)
    a.wait_checkpoint(job.id)
    assert b.load_checkpoint(job.id)[0] == 2
    assert b.finish(job.id, "completed", attempt=second.attempts).output_attempt == second.attempts
    assert a.finish(job.id, "failed", "late", "late", attempt=first.attempts) is None
    final = a.get(job.id)
    assert final.status == "completed" and a.output_bytes(final, ".mp4") == winner
    a.close()
    b.close()


def test_a_dead_servers_job_goes_on_from_its_checkpoint_on_the_other(tmp_path, pg_url, s3_url):
    """a dies (its lease renewer and connection stop with it) holding a job with a checkpoint: b claims it once
    the 1 s lease has run out, with a's checkpoint; until then b does not."""
    a, b = _store(tmp_path, "a", pg_url, s3_url, lease_s=1.0), _store(tmp_path, "b", pg_url, s3_url, lease_s=1.0)
    job = a.submit(_request("a long video"), model="m")
    claimed = a.claim_next(timeout=0)
    ckpt = {"latents": np.random.default_rng().standard_normal((2, 3)).astype(np.float32)}
    a.save_checkpoint(job.id, 2, ckpt, attempt=claimed.attempts)
    time.sleep(1.2)  # a lives past its lease: its renewer kept it
    assert b.claim_next(timeout=0) is None
    a.close()
    started = time.monotonic()
    taken = b.claim_next(timeout=5)
    assert taken is not None and taken.id == job.id and taken.attempts == 2
    assert time.monotonic() - started < 2.5
    resumed = b.load_checkpoint(job.id)
    assert resumed[0] == 2 and np.array_equal(resumed[1]["latents"], ckpt["latents"])
    b.close()


def test_200_jobs_over_three_servers_are_each_completed_exactly_once_and_a_pinned_one_by_its_server(tmp_path, pg_url,
                                                                                                   s3_url):
    """Three servers' stores (two claimers each, as replicas) on one PostgreSQL and one S3: 200 jobs submitted round
    robin, each run and completed once, none lost, each server running its share."""
    stores = [_store(tmp_path, name, pg_url, s3_url, max_queue=256) for name in ("a", "b", "c")]
    ids = [stores[i % 3].submit(_request(f"job {i}"), model="m").id for i in range(200)]
    runs: list[tuple[str, str, int]] = []
    lock = threading.Lock()

    def serve(store: JobStore) -> None:
        while (job := store.claim_next(timeout=0.5)) is not None:
            _publish(store, job.id, job.id.encode(), job.attempts)
            assert store.finish(job.id, "completed", attempt=job.attempts) is not None
            with lock:
                runs.append((store.node, job.id, job.attempts))

    pinned = stores[0].submit(_request("streamed from a"), model="m", pinned=True)  # its client reads it from a
    ids.append(pinned.id)
    threads = [threading.Thread(target=serve, args=(s,)) for s in stores for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert sorted(r[1] for r in runs) == sorted(ids), "every job run once"
    assert {r[2] for r in runs} == {1}
    assert {r[0] for r in runs} == {"a", "b", "c"}, "every server claimed some"
    assert [r[0] for r in runs if r[1] == pinned.id] == ["a"]
    for job_id in ids:
        job = stores[0].get(job_id)
        assert job.status == "completed" and stores[1].output_bytes(job, ".mp4") == job_id.encode()
    for store in stores:
        store.close()


def test_an_unreachable_database_is_a_503_naming_it(tmp_path, pg_url, s3_url, postgres_server):
    store = _store(tmp_path, "a", pg_url, s3_url)
    with TestClient(create_app(AppConfig(), _Server(store))) as client:
        assert client.get("/ready").status_code == 200
        with psycopg.connect(postgres_server, autocommit=True) as conn:  # its connections cut, and no new ones
            conn.execute(f"DROP DATABASE {pg_url.rsplit('/', 1)[1]} WITH (FORCE)")
        r = client.get("/v1/videos")
        assert r.status_code == 503 and r.headers["retry-after"].isdigit(), r.text
        assert r.json()["error"]["code"] == "store_unavailable" and "PostgreSQL" in r.json()["error"]["message"]
        ready = client.get("/ready")
        assert ready.status_code == 503 and "job store (PostgreSQL" in ready.json()["reason"], ready.text
    store._closed.set()


def test_a_postgresql_restart_mid_run_loses_nothing(tmp_path, pg_url, s3_url, postgres_server):
    """The database goes away while a job runs and another waits: the running job's progress is dropped, its poll
    says go on, its end waits for the database, and once it is back every job is there and the end is recorded."""
    store = _store(tmp_path, "a", pg_url, s3_url)
    running = store.submit(_request("running"), model="m")
    waiting = store.submit(_request("waiting"), model="m")
    job = store.claim_next(timeout=0)
    store.set_progress(job.id, 20, attempt=job.attempts)
    ended: list = []
    down = threading.Event()

    def run_on() -> None:  # the group, stepping on while the database is away
        down.wait()
        store.set_progress(job.id, 60, attempt=job.attempts)
        assert not store.cancel_requested(job.id, attempt=job.attempts)
        _publish(store, job.id, b"the video", job.attempts)
        ended.append(store.finish(job.id, "completed", attempt=job.attempts))

    thread = threading.Thread(target=run_on)
    thread.start()
    stopper = threading.Thread(target=postgres_server.restart, kwargs={"down_s": 2.0})
    stopper.start()
    time.sleep(0.5)
    down.set()  # the group's writes come while it is down (a fast shutdown takes well under 0.5 s)
    stopper.join(60)
    thread.join(60)
    assert ended and ended[0] is not None and ended[0].status == "completed", ended
    assert store.get(running.id).status == "completed" and store.get(waiting.id).status == "queued"
    assert store.output_bytes(store.get(running.id), ".mp4") == b"the video"
    store.close()


def test_an_unreachable_s3_fails_the_job_with_a_clear_code(group, tmp_path, pg_url, s3_url,  # noqa: F811
                                                            monkeypatch):
    """The group made the video but S3 does not answer (every attempt refused): the job fails with
    ``output_store_unavailable``, never completed without its video."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    store = _store(tmp_path, "a", pg_url, s3_url)
    config = LeaderConfig(runtime=RuntimeConfig(), data_dir=tmp_path, heartbeat_s=0.05, job_store=pg_url,
                          output_store=s3_url)
    leader = GroupLeader(config, store, runtime_factory=lambda _config: _Runtime(group.events), exit_on_fatal=False)
    leader.start()
    try:
        job = store.submit(_request("a fox"), model="m")
        deadline = time.monotonic() + 30
        while not store.get(job.id).terminal and leader.fatal is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        leader.stop()
    final = store.get(job.id)
    assert final.status == "failed" and final.error_code == "output_store_unavailable", final
    assert "s3://" in final.error_message and final.output_attempt is None
    store.close()


def test_the_schema_is_versioned_and_an_old_sqlite_file_migrates(tmp_path, pg_url):
    import sqlite3

    old = sqlite3.connect(tmp_path / "jobs.sqlite3")  # as a release before the versions left it
    old.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT NOT "
                "NULL, progress INTEGER NOT NULL DEFAULT 0, created_at INTEGER NOT NULL, completed_at INTEGER, model "
                "TEXT NOT NULL, request TEXT NOT NULL, error_code TEXT, error_message TEXT, cancel_requested INTEGER "
                "NOT NULL DEFAULT 0, deleting INTEGER NOT NULL DEFAULT 0)")
    from server.group.job_record import request_to_json

    earlier = "video_" + "e" * 32  # a job of that release: no tenant's (the server was open or had one key)
    old.execute("INSERT INTO jobs (id, status, created_at, model, request) VALUES (?, 'completed', 1, 'm', ?)",
                (earlier, request_to_json(_request("earlier"))))
    old.commit()
    old.close()
    store = JobStore(tmp_path, max_queue=4)
    assert store.get(earlier).tenant == "" and store.list(limit=5, after=None, order="asc")[0][0].id == earlier
    assert store.list(limit=5, after=None, order="asc", tenant="someone")[0] == []
    store._db.execute("DELETE FROM jobs WHERE id = ?", (earlier,))
    job = store.submit(_request("kept"), model="m")
    assert store.claim_next(timeout=0).attempts == 1 and store.get(job.id).output_attempt is None
    store.close()
    for url in (None, pg_url):
        db = open_database(url, tmp_path)
        assert db.execute("SELECT version FROM schema_version").fetchone()["version"] == SCHEMA_VERSION
        db.close()


def test_s3_refuses_a_wrong_secret(tmp_path, s3_url, monkeypatch):
    """The S3 server checks signatures: the store's writes are the real wire's."""
    from server.outputs.store import S3Outputs, StoreUnavailable

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(StoreUnavailable, match="s3://"):
        S3Outputs(s3_url, tmp_path).put_bytes("video_" + "1" * 32, ".mp4", io.BytesIO(b"x").getvalue(), attempt=1)


def test_a_sweep_removes_the_files_no_record_names_and_nothing_else(tmp_path, pg_url, s3_url):
    """What a fleet leaves in S3 beside the jobs' content: a stale attempt's MP4 and a checkpoint of a completed job,
    a failed job's upload, the files of a job whose delete's requests failed. A sweep removes those (the last only
    once an hour old, unless told otherwise) and keeps a completed job's content and a running job's checkpoint; a
    server's start sweeps in the background."""
    a = _store(tmp_path, "a", pg_url, s3_url)
    ckpt = {"latents": np.zeros((1, 4, 3), np.float32)}
    done = a.submit(_request("a completed video"), model="m")
    attempt = a.claim_next(timeout=0).attempts
    a.save_checkpoint(done.id, 1, ckpt, attempt=attempt)
    a.wait_checkpoint(done.id)
    _publish(a, done.id, b"the video", attempt)
    a.outputs.put_bytes(done.id, ".mp4", b"a stale attempt's", attempt=attempt + 5)
    assert a.finish(done.id, "completed", attempt=attempt).output_attempt == attempt
    a._cleaner.submit(lambda: None).result()  # the completed job's checkpoint removed; one whose removal failed:
    a.outputs.put_bytes(done.id, ".resume.npz", b"a checkpoint left behind", attempt=attempt)
    running = a.submit(_request("a running video"), model="m")
    running_attempt = a.claim_next(timeout=0).attempts
    a.save_checkpoint(running.id, 1, ckpt, attempt=running_attempt)
    a.wait_checkpoint(running.id)
    failed = a.submit(_request("a failed video"), model="m")
    failed_attempt = a.claim_next(timeout=0).attempts
    _publish(a, failed.id, b"uploaded, then the job failed", failed_attempt)
    a.finish(failed.id, "failed", "encode_failed", "failed after its upload", attempt=failed_attempt)
    orphan = "video_" + "e" * 32
    a.outputs.put_bytes(orphan, ".mp4", b"a deleted job's", attempt=1)

    def held() -> set[tuple[str, int, str]]:
        return {(job, n, suffix) for job, n, suffix, _ in a.outputs.objects()}

    assert set(a.sweep_outputs()) == {(done.id, attempt, ".resume.npz"), (done.id, attempt + 5, ".mp4"),
                                      (failed.id, failed_attempt, ".mp4")}
    assert (orphan, 1, ".mp4") in held()  # younger than an hour: perhaps a job's whose record is not committed yet
    b = _store(tmp_path, "b", pg_url, s3_url)
    b.outputs.put_bytes(done.id, ".mp4", b"another stale attempt's", attempt=attempt + 6)
    b.recover()  # a server starting: it sweeps in the background
    b._cleaner.submit(lambda: None).result()
    assert (done.id, attempt + 6, ".mp4") not in held()
    assert a.sweep_outputs(min_age_s=0) == [(orphan, 1, ".mp4")]
    assert held() == {(done.id, attempt, ".mp4"), (running.id, running_attempt, ".resume.npz")}
    assert a.output_bytes(a.get(done.id), ".mp4") == b"the video" and a.load_checkpoint(running.id)[0] == 1
    a.close()
    b.close()


def test_every_route_under_every_key_on_a_fleet_of_two(tmp_path, pg_url, s3_url):
    """``tests/server/http/test_tenants.py``'s route matrix (every route of /v1/videos under owner, other tenant,
    admin, the server's key, a revoked key and none) through the server that did not make alice's videos: their
    records in PostgreSQL, their files in S3."""
    from tests.server.http.test_openapi import _mp4
    from tests.server.http.test_tenants import _BODY as TENANT_BODY
    from tests.server.http.test_tenants import API_KEY, route_matrix

    a, b = _store(tmp_path, "a", pg_url, s3_url), _store(tmp_path, "b", pg_url, s3_url)
    keys = {name: a.tenants.add(name, role="admin" if name == "root" else "user")
            for name in ("alice", "bob", "root", "eve")}
    a.tenants.revoke("eve")
    made_on, served_by = (create_app(AppConfig(api_key=API_KEY), _Server(store)) for store in (a, b))
    with TestClient(made_on, headers={"Authorization": f"Bearer {keys['alice']}"}) as alice:
        done = alice.post("/v1/videos", json={**TENANT_BODY, "num_frames": 33}).json()["id"]
        attempt = a.claim_next(timeout=0).attempts
        frames = np.random.default_rng().integers(0, 256, (33, 64, 96, 3), dtype=np.uint8)
        files = {".npy": io.BytesIO(), ".mp4": _mp4(frames), ".jpg": b"\xff\xd8\xff\xd9"}
        np.save(files[".npy"], frames)
        made = []
        for suffix, data in files.items():
            path = a.path(done, suffix + ".tmp")
            path.write_bytes(data.getvalue() if isinstance(data, io.BytesIO) else data)
            made.append((path, suffix))
        a.publish(done, made, attempt=attempt)
        assert a.finish(done, "completed", attempt=attempt).output_attempt == attempt
        queued = alice.post("/v1/videos", json=TENANT_BODY).json()["id"]
    route_matrix(served_by, keys, done, queued)
    a.close()
    b.close()
