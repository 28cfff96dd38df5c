"""Ranks that die, with the default restart flags: the launcher starts the group again (``server.group.restarts``) and
the new leader finds the jobs in SQLite; SIGTERM then ends the command and leaves no rank behind. (The budget
running out is ``tests/server/group/test_restart_policy.py``'s.)

The tests run in order on one server.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ..conftest import ServerProcess, alive, descendants, tiny


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    workdir = tmp_path_factory.mktemp("restart_server")
    # Each kill fires once (a marker file), so the job it interrupts runs to its end when the group is back.
    faults = (f"rank=1,step=1,kind=kill,prompt=[fault:kill-rank1],once={workdir}/killed-1;"
              f"rank=1,step=2,kind=kill,prompt=[fault:kill-window],once={workdir}/killed-2")
    s = ServerProcess(workdir, cache_dir, faults=faults,
                      extra_args=["--heartbeat-s", "0.5", "--collective-timeout", "30", "--keep-frames"])
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_worker_killed_mid_job_restarts_the_group_and_the_queue_survives(server):
    s = server
    before = s.group()
    assert before["restart_count"] == 0 and len(before["pids"]) == 2
    # Rank 1 SIGKILLs itself before step 1 of the first job; the second job waits in the queue meanwhile.
    doomed = s.submit(tiny("[fault:kill-rank1] a glass falls", num_inference_steps=3))
    queued = s.submit(tiny("a cat sleeping in the sun"))
    s.wait_ready(timeout=180, restart_count=1)
    after = s.group()
    assert set(after["pids"]).isdisjoint(before["pids"])
    assert not any(alive(pid) for pid in before["pids"]), "a rank of the old group survived the restart"
    # The job that was running goes back to the head of the queue and runs again; the queued one after it.
    assert s.wait_job(doomed["id"])["status"] == "completed"
    assert s.wait_job(queued["id"])["status"] == "completed"
    assert s.metric("cp_infer_group_restarts") == 1
    # torchrun reports the ranks it saw fail: the killed worker, or the leader that exited because of it.
    assert "the worker group failed (rank " in s.log_tail(400) and "restarting it: restart 1," in s.log_tail(400)
    # The restarted group serves new work too.
    assert s.wait_job(s.submit(tiny("a boat at anchor", seed=3))["id"])["status"] == "completed"


def test_a_long_video_goes_on_from_its_last_window(server):
    """Rank 1 dies in the third of three windows: the restarted group goes on from the checkpoint after the second
    (its windows are not made again), and the video is frame for frame the one an uninterrupted run makes."""
    s = server
    long = tiny("[fault:kill-window] a river through a canyon", num_frames=161, seed=21)
    interrupted = s.submit(long)
    s.wait_ready(timeout=180, restart_count=2)
    done = s.wait_job(interrupted["id"], timeout=240)
    assert done["status"] == "completed" and done["windows"] == 3 and done["window"] == 2, done
    assert "goes on from its checkpoint after pass 2" in s.log_tail(400)
    again = s.wait_job(s.submit(long)["id"], timeout=240)  # the kill has fired: this one runs through
    assert again["status"] == "completed"
    frames = [np.load(s.data_dir / "videos" / f"{job['id']}.npy") for job in (done, again)]
    assert frames[0].shape == (161, 64, 96, 3)
    np.testing.assert_array_equal(frames[0], frames[1])
    assert not list((s.data_dir / "videos").glob("*.resume.npz")), "an ended job keeps no checkpoint"


def test_rank0_killed_restarts_the_group_again(server):
    s = server
    before = s.group()
    os.kill(before["pids"][0], signal.SIGKILL)
    s.wait_ready(timeout=180, restart_count=3)
    assert set(s.group()["pids"]).isdisjoint(before["pids"])
    assert s.metric("cp_infer_group_restarts") == 3
    assert s.wait_job(s.submit(tiny("a kite over a beach", seed=5))["id"])["status"] == "completed"
    assert "restarting it: restart 3" in s.log_tail(400)


def test_sigterm_ends_everything(server):
    s = server
    group = s.group()
    tree = descendants(s.proc.pid)
    assert set(group["pids"]) <= set(tree)
    s.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while s.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert s.proc.returncode is not None, f"the server outlived SIGTERM\n{s.log_tail()}"
    # No orphan: neither the worker rank nor torchrun outlives the command.
    time.sleep(0.5)
    survivors = [pid for pid in tree if alive(pid)]
    assert not survivors, f"processes left behind: {survivors}\n{s.log_tail()}"
