"""Ranks that die, with the default restart flags: the launcher starts the group again (``server.restarts``) and
the new leader finds the jobs in SQLite; SIGTERM then ends the command and leaves no rank behind. (The budget
running out is ``tests/server/test_restart_policy.py``'s.)

The tests run in order on one server.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import ServerProcess, alive, descendants, tiny

FAULTS = "rank=1,step=1,kind=kill,prompt=[fault:kill-rank1]"


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    s = ServerProcess(tmp_path_factory.mktemp("restart_server"), cache_dir, faults=FAULTS,
                      extra_args=["--heartbeat-s", "0.5", "--collective-timeout", "30"])
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
    failed = s.wait_job(doomed["id"])
    assert failed["status"] == "failed", failed
    assert failed["error"]["code"] in ("worker_group_failed", "worker_group_restarted"), failed
    assert s.wait_job(queued["id"])["status"] == "completed"
    assert s.metric("cp_infer_group_restarts") == 1
    # torchrun reports the ranks it saw fail: the killed worker, or the leader that exited because of it.
    assert "the worker group failed (rank " in s.log_tail(400) and "restarting it: restart 1," in s.log_tail(400)
    # The restarted group serves new work too.
    assert s.wait_job(s.submit(tiny("a boat at anchor", seed=3))["id"])["status"] == "completed"


def test_rank0_killed_restarts_the_group_again(server):
    s = server
    before = s.group()
    os.kill(before["pids"][0], signal.SIGKILL)
    s.wait_ready(timeout=180, restart_count=2)
    assert set(s.group()["pids"]).isdisjoint(before["pids"])
    assert s.metric("cp_infer_group_restarts") == 2
    assert s.wait_job(s.submit(tiny("a kite over a beach", seed=5))["id"])["status"] == "completed"
    assert "restarting it: restart 2" in s.log_tail(400)


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
