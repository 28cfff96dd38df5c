"""Two real servers (one rank each) sharing one PostgreSQL job store and one S3 output store (``tests/services.py``):
the one running a long video is SIGKILLed, its whole process tree at once, after the video's first window; the other
takes the job over once its lease (3 s) runs out, goes on from the checkpoint in S3, and its frames equal those of an
uninterrupted run of the same request. ``test_fleet_stores.py`` covers the stores' part without processes.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time

import numpy as np
import pytest

from ..conftest import ServerProcess, alive, descendants, tiny

pytestmark = pytest.mark.timeout(240)

_FAULTS = "rank=0,kind=sleep,seconds=0.3,prompt=[slow]"


def _running(server: ServerProcess, job_id: str) -> bool:
    with contextlib.suppress(Exception):
        return any(r["job"] == job_id for r in server.client.get("/ready", timeout=5).json()["replicas"])
    return False


def _kill_tree(server: ServerProcess) -> None:
    pids = sorted({server.proc.pid, *descendants(server.proc.pid), *server.group()["pids"]})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids)


def _frames(server: ServerProcess, job_id: str) -> np.ndarray:
    r = server.client.get(f"/v1/videos/{job_id}/content", params={"variant": "frames"})
    assert r.status_code == 200, r.text
    return np.load(io.BytesIO(r.content))


def test_a_killed_servers_long_video_completes_on_the_other_from_its_checkpoint(tmp_path, cache_dir, pg_url,
                                                                                  s3_url):
    args = ["--job-store", pg_url, "--output-store", s3_url, "--lease-s", "3", "--heartbeat-s", "0.5",
            "--collective-timeout", "30", "--keep-frames"]
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    servers = [ServerProcess(tmp_path / name, cache_dir, extra_args=args, faults=_FAULTS, nproc=1)
               for name in ("a", "b")]
    try:
        for s in servers:
            s.wait_ready()
        body = tiny("[slow] a river through a canyon", num_frames=161, seed=21)
        job_id = servers[0].submit(body)["id"]
        deadline = time.monotonic() + 90
        while True:  # past its first window (its checkpoint saved), on whichever server claimed it
            job = servers[1].client.get(f"/v1/videos/{job_id}").json()
            assert job["status"] in ("queued", "in_progress") and time.monotonic() < deadline, job
            runner = next((s for s in servers if _running(s, job_id)), None)
            if runner is not None and (job["window"] or 0) >= 1:
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
    finally:
        for s in servers:
            s.stop()
