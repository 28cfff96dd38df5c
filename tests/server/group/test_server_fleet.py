"""Two real servers (one rank each) sharing one PostgreSQL job store and one S3 output store (``tests/services.py``),
started once for this module and put through, in order (each test leaves the queue empty and both servers up, but
the last): every route answering for a job that runs on the other server (its SSE progress, a cancel that stops it
within a step, an extension of the other's video); S3 cut off (the upload retried, then the job failed
with a clear code; ``/ready`` naming the store); a PostgreSQL restart while a job runs (503 with Retry-After
meanwhile, the job goes on, nothing lost, no group restarted); a server frozen (``SIGSTOP``) past its lease, whose
job the other runs, and which wakes to find that its attempt can neither complete nor overwrite; and the one running
a long video SIGKILLed, its whole process tree at once, after the video's first window: the other takes the job over
once its lease (3 s) runs out, goes on from the checkpoint in S3, and its frames equal those of an uninterrupted run
of the same request. ``test_fleet_stores.py`` covers the stores' part without processes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np
import psycopg
import pytest

from tests.services import S3_ENV, PostgresURL, TcpProxy, fresh_database

from ..conftest import ServerProcess, alive, descendants, tiny

pytestmark = pytest.mark.timeout(240)

_FAULTS = ";".join([
    "rank=0,kind=sleep,seconds=0.3,prompt=[slow]",
    "rank=0,step=decode,kind=sleep,seconds=2,prompt=[stall]",  # a stall once the frames are made, before the end
])
_BUCKET = "cp-infer-test"


@dataclass
class _Fleet:
    servers: list[ServerProcess]
    s3: TcpProxy  # the servers' way to S3
    s3_endpoint: str
    prefix: str
    pg: str
    postgres: PostgresURL
    start: object  # start(name) -> ServerProcess: one more server of the fleet, started (not yet ready)

    def row(self, job_id: str) -> dict:
        with psycopg.connect(self.pg) as conn:
            cur = conn.execute("SELECT status, attempts, output_attempt, checkpoint_attempt, completed_at FROM jobs "
                               "WHERE id = %s", (job_id,))
            return dict(zip([c.name for c in cur.description], cur.fetchone(), strict=True))

    def object(self, job_id: str, name: str) -> bytes | None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.s3_endpoint, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name=S3_ENV["AWS_REGION"])
        with contextlib.suppress(client.exceptions.NoSuchKey):
            return client.get_object(Bucket=_BUCKET, Key=f"{self.prefix}/{job_id}/{name}")["Body"].read()
        return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, cache_dir, postgres_server, s3_server):
    pg, prefix = fresh_database(postgres_server), f"t-{secrets.token_hex(6)}"
    proxy = TcpProxy(s3_server.removeprefix("http://"))
    args = ["--job-store", pg, "--output-store", f"s3://{_BUCKET}/{prefix}", "--lease-s", "3", "--heartbeat-s", "0.5",
            "--collective-timeout", "30", "--keep-frames"]
    root = tmp_path_factory.mktemp("fleet")

    def start(name: str) -> ServerProcess:
        with pytest.MonkeyPatch.context() as env:  # what a server inherits: S3's identity, its way through the proxy
            for key, value in {**S3_ENV, "AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "2"}.items():
                env.setenv(key, value)
            (root / name).mkdir()
            return ServerProcess(root / name, cache_dir, extra_args=args, faults=_FAULTS, nproc=1)

    servers = [start(name) for name in ("a", "b")]
    try:
        for s in servers:
            s.wait_ready()
        yield _Fleet(servers, proxy, s3_server, prefix, pg, postgres_server, start)
    finally:
        for s in servers:
            s.stop()
        proxy.close()


def _running(server: ServerProcess, job_id: str) -> bool:
    with contextlib.suppress(Exception):
        return any(r["job"] == job_id for r in server.client.get("/ready", timeout=5).json()["replicas"])
    return False


def _placed(fleet: _Fleet, job_id: str) -> tuple[ServerProcess, ServerProcess]:
    """(the server running the job, the other)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for i, s in enumerate(fleet.servers):
            if _running(s, job_id):
                return s, fleet.servers[1 - i]
        time.sleep(0.05)
    pytest.fail(f"no server runs {job_id}")


def _job(server: ServerProcess, job_id: str) -> dict:
    r = server.client.get(f"/v1/videos/{job_id}")
    assert r.status_code == 200, r.text
    return r.json()


def _group_pids(server: ServerProcess) -> list[int]:
    return sorted({server.proc.pid, *descendants(server.proc.pid), *server.group()["pids"]})


def _frames(server: ServerProcess, job_id: str) -> np.ndarray:
    r = server.client.get(f"/v1/videos/{job_id}/content", params={"variant": "frames"})
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def test_every_route_answers_for_a_job_that_runs_on_the_other_server(fleet):
    a, _ = fleet.servers
    source = a.submit(tiny("[slow] a river through a canyon", num_frames=17, num_inference_steps=4, seed=3))["id"]
    runner, other = _placed(fleet, source)
    with other.client.stream("GET", f"/v1/videos/{source}/events") as events:  # ends with the job
        seen = [json.loads(line[len("data: "):]) for line in events.iter_lines() if line.startswith("data: ")]
    # The other server's group's steps, one by one as they happen, then its end.
    assert seen[-1]["status"] == "completed" and seen[-1]["progress"] == 100, seen
    assert len({e["progress"] for e in seen if e["status"] == "in_progress" and 0 < e["progress"] < 90}) >= 2, seen
    assert [e["progress"] for e in seen] == sorted(e["progress"] for e in seen)

    # A cancel sent to one server stops the job the other runs at its next step.
    job = other.submit(tiny("[slow] a lighthouse in a storm", num_inference_steps=30, seed=4))["id"]
    runner2, far = _placed(fleet, job)
    deadline = time.monotonic() + 60
    while (before := _job(far, job)["progress"]) < 6:  # two of its 30 steps (3 points each) done
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert far.client.post(f"/v1/videos/{job}/cancel").status_code == 200
    done = far.wait_job(job, timeout=30)
    assert done["status"] == "cancelled" and done["error"]["message"] == "cancelled while running", done
    assert done["progress"] <= before + 2 * 3, (before, done)  # a step may end between the read and the cancel

    # An extension asked of the server that did not make the source: its frames come from S3, and its lead frames
    # (the source's) go to whichever server runs it through S3 too.
    r = other.client.post("/v1/videos/extensions", json={"video": {"id": source}, "num_frames": 9, "seed": 5,
                                                         "prompt": "the river reaches the sea",
                                                         "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    extension = runner.wait_job(r.json()["id"])
    assert extension["status"] == "completed", extension
    first, frames = _frames(runner, source), _frames(other, extension["id"])
    assert frames.shape == (17 + 8, *first.shape[1:])
    np.testing.assert_array_equal(frames[:17], first)


def test_an_unreachable_s3_fails_the_upload_after_retries_and_names_the_store(fleet):
    a, b = fleet.servers
    fleet.s3.down()
    try:
        job = a.submit(tiny("a kite over a beach", seed=6))["id"]
        done = a.wait_job(job, timeout=60)
        assert done["status"] == "failed" and done["error"]["code"] == "output_store_unavailable", done
        assert f"s3://{_BUCKET}/" in done["error"]["message"], done
        # Tried again after a backoff (AWS_MAX_ATTEMPTS=2: boto3's standard mode), then failed.
        assert fleet.s3.refused >= 2, fleet.s3.refused
        ready = b.client.get("/ready")
        assert ready.status_code == 503 and "output store (s3://" in ready.json()["reason"], ready.text
        assert fleet.row(job)["output_attempt"] is None
    finally:
        fleet.s3.up()
    assert a.client.get("/ready").status_code == 200  # the next tests' jobs upload again


def _poll(server: ServerProcess, job_id: str, timeout: float = 60) -> dict:
    """The job once it has ended, through the 503s of a job store coming back."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = server.client.get(f"/v1/videos/{job_id}")
        if r.status_code == 200 and r.json()["status"] in ("completed", "failed", "cancelled"):
            return r.json()
        assert r.status_code in (200, 503), r.text
        time.sleep(0.1)
    pytest.fail(f"{job_id} did not end")


def test_a_postgresql_restart_while_a_job_runs_loses_nothing(fleet):
    """The running job goes on and reports once the database is back (its lease renewed in time: one attempt); the
    idle server keeps its group; requests meanwhile answer 503 with Retry-After."""
    a, _ = fleet.servers
    job = a.submit(tiny("[slow] a train in the mountains", num_inference_steps=12, seed=7))["id"]
    runner, idle = _placed(fleet, job)
    while _job(runner, job)["progress"] == 0:
        time.sleep(0.05)
    restart = threading.Thread(target=fleet.postgres.restart, kwargs={"down_s": 0.5})
    restart.start()
    refused = None
    while restart.is_alive() and refused is None:
        r = idle.client.get("/v1/videos")
        refused = r if r.status_code == 503 else None
        time.sleep(0.02)
    restart.join(60)
    assert refused is not None, "no request answered 503 while the database was down"
    assert refused.headers["retry-after"].isdigit() and refused.json()["error"]["code"] == "store_unavailable"
    done = _poll(idle, job)
    assert done["status"] == "completed", done
    assert fleet.row(job)["attempts"] == 1
    # The idle server's claims met the outage and it kept its group (the next tests' jobs run on both).
    assert "claiming the next job: the job store (PostgreSQL" in idle.log_tail(400)
    for s in fleet.servers:
        assert s.group()["restart_count"] == 0, s.log_tail()


def test_200_jobs_over_three_servers_are_each_completed_once(fleet):
    """A third server joins the two; 200 short jobs are submitted round robin to the three (a client that waits out a
    429 as it is told: the fleet's queue holds 16), and every one is completed exactly once: one attempt each, the
    servers' finished counts adding up to 200, each server running some, every MP4 in S3."""
    c = fleet.start("c")
    try:
        c.wait_ready()
        servers = [*fleet.servers, c]
        before = [_finished(s) for s in servers]
        jobs: list[str] = []
        for i in range(200):
            server = servers[i % 3]
            while (r := server.client.post("/v1/videos", json=tiny(f"a kite, take {i}", num_frames=1, seed=i))
                   ).status_code == 429:
                time.sleep(min(float(r.headers["retry-after"]), 0.2))
            assert r.status_code == 200, r.text
            jobs.append(r.json()["id"])
        ends = {job: _poll(servers[i % 3], job)["status"] for i, job in enumerate(jobs)}
        assert set(ends.values()) == {"completed"}, {j: e for j, e in ends.items() if e != "completed"}
        with psycopg.connect(fleet.pg) as conn:
            rows = conn.execute("SELECT attempts, output_attempt FROM jobs WHERE id = ANY(%s)", (jobs,)).fetchall()
        assert len(rows) == 200 and all(row == (1, 1) for row in rows), rows
        ran = [_finished(s) - b for s, b in zip(servers, before, strict=True)]
        assert sum(ran) == 200 and min(ran) > 0, ran
        assert all(fleet.object(job, "1.mp4") for job in jobs[::20])
    finally:
        c.stop()


def _finished(server: ServerProcess) -> int:
    return sum(sum(r["jobs_finished"].values()) for r in server.client.get("/ready").json()["replicas"])


def test_a_frozen_servers_job_runs_on_the_other_and_its_stale_attempt_changes_nothing(fleet):
    """Frozen once its frames are made (SIGSTOP of its whole tree), past its 3 s lease: the other server runs the
    job to the end. Woken after that (SIGCONT), the frozen one's attempt uploads under its own keys and tries to
    complete the job: the record, the winner's objects and the content served stay the winner's."""
    a, _ = fleet.servers
    job = a.submit(tiny("[stall] a windmill at dusk", seed=9))["id"]
    frozen, other = _placed(fleet, job)
    while _job(other, job)["progress"] < 90:  # its frames made: it stalls before the upload and the end
        time.sleep(0.02)
    pids = _group_pids(frozen)
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        done = other.wait_job(job, timeout=60)
        assert done["status"] == "completed", done
        won = fleet.row(job)
        assert won["attempts"] == 2 and won["output_attempt"] == 2, won
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    content = other.client.get(f"/v1/videos/{job}/content").content
    deadline = time.monotonic() + 30
    while "attempt 1 ended completed, but the job is no longer that attempt's" not in frozen.log_tail(200):
        assert time.monotonic() < deadline, frozen.log_tail()
        time.sleep(0.1)
    assert fleet.row(job) == won
    assert fleet.object(job, "2.mp4") == content
    for s in fleet.servers:
        assert s.client.get(f"/v1/videos/{job}/content").content == content
    frozen.wait_ready(60)


def _kill_tree(server: ServerProcess) -> None:
    pids = _group_pids(server)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)


def test_a_killed_servers_long_video_completes_on_the_other_from_its_checkpoint(fleet):
    """Last: it kills one of the servers."""
    servers = fleet.servers
    body = tiny("[slow] a river through a canyon", num_frames=161, seed=21)
    job_id = servers[0].submit(body)["id"]
    deadline = time.monotonic() + 90
    while True:  # past its first window, its checkpoint uploaded, on whichever server claimed it
        job = _job(servers[1], job_id)
        assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
        runner = next((s for s in servers if _running(s, job_id)), None)
        if runner is not None and (job["window"] or 0) >= 1 and fleet.row(job_id)["checkpoint_attempt"]:
            break
        time.sleep(0.05)
    other = servers[1] if runner is servers[0] else servers[0]
    _kill_tree(runner)
    done = other.wait_job(job_id, timeout=120)
    assert done["status"] == "completed" and done["windows"] == 3, done
    assert "goes on from its checkpoint after pass" in other.log_tail(400)
    again = other.submit(body)["id"]
    assert other.wait_job(again, timeout=120)["status"] == "completed"
    resumed, whole = _frames(other, job_id), _frames(other, again)
    assert resumed.shape == (161, 64, 96, 3)
    # The same request, seed and model: the resumed run is the uninterrupted one, frame for frame.
    np.testing.assert_array_equal(resumed, whole)
