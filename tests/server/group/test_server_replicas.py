"""Two replica groups behind one front end: ``cp-infer serve --nproc 2 --ulysses-degree 1`` (2 replicas of 1 rank).

The front end dispatches each queued job to an idle replica; a job runs on rank 1's replica exactly as on rank 0's
(progress, cancel, streaming, the same frames for the same seed), and one replica's failed or cancelled job leaves
the other's running. Which replica takes a job is decided by which is idle: with one busy on a ``[slow]`` job
(0.2 s per step on every rank, from ``$CP_INFER_TEST_FAULT``), the next job goes to the other. Order, not timing.
A rank that dies takes the world down (torchrun restarts every rank): the jobs of both replicas run again.
"""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from ..conftest import API_ARGS, ServerProcess, lossless_frames, tiny
from .test_server_faults import _wait_running


@pytest.fixture(scope="module")
def replicas_server(tmp_path_factory, cache_dir):
    workdir = tmp_path_factory.mktemp("replicas")
    faults = ";".join(["kind=sleep,seconds=0.2,prompt=[slow]", "step=1,kind=raise,prompt=[boom]",
                       f"step=2,kind=kill,prompt=[kill],once={workdir}/killed"])  # last test: restarts the world
    server = ServerProcess(workdir, cache_dir, faults=faults,
                           extra_args=[*API_ARGS, "--max-frames", "161", "--ulysses-degree", "1"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _replicas(s) -> list[dict]:
    r = s.client.get("/ready")
    assert r.status_code == 200, r.text
    return r.json()["replicas"]


def _running_on(s, job_id: str) -> int:
    """The replica running ``job_id`` (it must be running)."""
    running = [r["replica"] for r in _replicas(s) if r["job"] == job_id]
    assert running, _replicas(s)
    return running[0]


def _busy_with_slow_job(s, prompt: str) -> tuple[str, int]:
    job = s.submit(tiny(f"[slow] {prompt}", num_inference_steps=20))  # ~4 s unless stopped
    _wait_running(s, job["id"], min_progress=3)
    return job["id"], _running_on(s, job["id"])


def test_ready_and_metrics_report_each_replica(replicas_server):
    s = replicas_server
    body = s.client.get("/ready").json()
    assert body["world_size"] == 2
    assert [(r["replica"], r["ranks"], r["ready"]) for r in body["replicas"]] == [(0, [0], True), (1, [1], True)]
    assert all(r["heartbeat_rtt_ms"] is not None for r in body["replicas"])
    assert all(r["layout"] == {"guidance": 1, "ring": 1, "ulysses": 1} for r in body["replicas"])
    assert s.metric("cp_infer_replicas") == 2
    for replica in (0, 1):
        assert s.metric(f'cp_infer_replica_ready{{replica="{replica}"}}') == 1
        assert s.metric(f'cp_infer_replica_ranks{{replica="{replica}"}}') == 1
    assert s.group()["replicas"] == [[0], [1]]


def test_two_jobs_run_at_once_one_per_replica_and_give_the_same_frames(replicas_server):
    s = replicas_server
    seed = int(np.random.default_rng().integers(0, 2**16))
    a = s.submit(tiny("[slow] a lighthouse at dusk", num_inference_steps=8, seed=seed))
    b = s.submit(tiny("[slow] a lighthouse at dusk", num_inference_steps=8, seed=seed))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        jobs = sorted(r["job"] or "" for r in _replicas(s))
        if jobs == sorted([a["id"], b["id"]]):
            assert s.metric('cp_infer_replica_busy{replica="0"}') + s.metric('cp_infer_replica_busy{replica="1"}') >= 1
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the two jobs never ran at the same time: {_replicas(s)}")
    assert s.wait_job(a["id"])["status"] == "completed" and s.wait_job(b["id"])["status"] == "completed"
    fa, fb = lossless_frames(s, a["id"]), lossless_frames(s, b["id"])
    assert fa.std() > 5 and np.array_equal(fa, fb)  # one ran on rank 0's replica, the other on rank 1's


def test_long_videos_on_both_replicas_at_once_are_the_same_video(replicas_server):
    """Windows, their checkpoints and the frames encoded as they come, from rank 1's replica as from rank 0's."""
    s = replicas_server
    body = tiny("[slow] a river through a canyon", num_frames=161, num_inference_steps=2, seed=21)
    jobs = [s.submit(body)["id"] for _ in range(2)]
    deadline = time.monotonic() + 60
    while sorted(r["job"] or "" for r in _replicas(s)) != sorted(jobs):
        assert time.monotonic() < deadline, f"the two long videos never ran at the same time: {_replicas(s)}"
        time.sleep(0.05)
    finals = [s.wait_job(job, timeout=180) for job in jobs]
    assert all(f["status"] == "completed" and f["windows"] == 3 and f["window"] == 2 for f in finals), finals
    a, b = (lossless_frames(s, job) for job in jobs)
    assert a.shape == (161, 64, 96, 3) and a.std() > 5 and np.array_equal(a, b)
    assert not list((s.data_dir / "videos").glob("*.resume.npz")), "an ended job keeps no checkpoint"


def test_a_failure_on_one_replica_fails_only_its_job(replicas_server):
    s = replicas_server
    slow, replica = _busy_with_slow_job(s, "a slow river")
    failed = s.metric(f'cp_infer_replica_jobs_finished_total{{replica="{1 - replica}",state="failed"}}')
    boom = s.submit(tiny("[boom] a storm at sea", num_inference_steps=3))
    final = s.wait_job(boom["id"])
    assert final["status"] == "failed" and final["error"]["code"] == "generation_failed", final
    assert "injected fault at step 1" in final["error"]["message"]
    assert s.metric(f'cp_infer_replica_jobs_finished_total{{replica="{1 - replica}",state="failed"}}') == failed + 1
    assert s.client.get(f"/v1/videos/{slow}").json()["status"] == "in_progress"
    assert s.wait_job(slow)["status"] == "completed"


def test_cancel_on_one_replica_leaves_the_other_running(replicas_server):
    s = replicas_server
    first, replica = _busy_with_slow_job(s, "a windmill turning")
    second, other = _busy_with_slow_job(s, "a clock ticking")
    assert {replica, other} == {0, 1}
    r = s.client.post(f"/v1/videos/{second}/cancel")
    assert r.status_code == 200, r.text
    assert s.wait_job(second)["status"] == "cancelled"
    assert s.client.get(f"/v1/videos/{first}").json()["status"] == "in_progress"
    assert s.wait_job(first)["status"] == "completed"


def test_a_streamed_job_on_the_other_replica_streams_and_matches_its_stored_video(replicas_server, tmp_path):
    from cp_infer.video_io import read_mp4

    s = replicas_server
    slow, replica = _busy_with_slow_job(s, "a field of wheat")
    done_there = f'cp_infer_replica_jobs_finished_total{{replica="{1 - replica}",state="completed"}}'
    before = s.metric(done_there)
    with s.client.stream("POST", "/v1/videos", params={"stream": "true"}, timeout=120,
                         json=tiny("[slow] a kite over a windy beach", num_frames=33, num_inference_steps=3)) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers["x-video-id"]
        data = r.read()
    assert s.client.get(f"/v1/videos/{slow}").json()["status"] in ("in_progress", "completed")
    (tmp_path / "streamed.mp4").write_bytes(data)
    frames, _ = read_mp4(tmp_path / "streamed.mp4")
    assert frames.shape == (33, 64, 96, 3) and frames.std() > 5
    stored = s.client.get(f"/v1/videos/{job_id}/content")
    assert stored.status_code == 200 and stored.content == data
    raw = np.load(io.BytesIO(s.client.get(f"/v1/videos/{job_id}/content?variant=frames").content))
    assert raw.shape == (33, 64, 96, 3)
    assert s.metric(done_there) == before + 1  # made by the other replica while this one was busy
    assert s.wait_job(slow)["status"] == "completed"


def test_a_rank_killed_on_one_replica_restarts_the_world_and_both_jobs_complete(replicas_server):
    s = replicas_server
    before = s.group()
    slow, replica = _busy_with_slow_job(s, "a hot air balloon")
    doomed = s.submit(tiny("[kill] a glass falls", num_inference_steps=4))  # on the other replica: its rank dies
    s.wait_ready(timeout=180, restart_count=1)
    assert set(s.group()["pids"]).isdisjoint(before["pids"]) and s.group()["replicas"] == [[0], [1]]
    # Both were in flight: both go back to the queue and run to the end on the restarted replicas.
    assert s.wait_job(doomed["id"])["status"] == "completed"
    assert s.wait_job(slow)["status"] == "completed"
    assert [r["ready"] for r in _replicas(s)] == [True, True]
