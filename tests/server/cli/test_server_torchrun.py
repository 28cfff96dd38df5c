"""The server started by torchrun directly, and what its worker does when rank 0 dies with nobody to clean up.

Killing torchrun first (SIGKILL: it cannot stop its ranks) and then rank 0 leaves rank 1 alone; it must notice
in its next collective (a heartbeat broadcast) and exit by itself rather than linger as an orphan.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from ..conftest import ServerProcess, alive, tiny


@pytest.fixture(scope="module")
def server(tmp_path_factory, cache_dir):
    s = ServerProcess(tmp_path_factory.mktemp("torchrun_server"), cache_dir, under_torchrun=True, api_key=None,
                      extra_args=["--heartbeat-s", "0.5", "--collective-timeout", "20"])
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_serves_under_torchrun_directly(server):
    group = server.group()
    assert group["world_size"] == 2 and group["pids"][0] != server.proc.pid  # torchrun is not a rank
    job = server.submit(tiny("a lantern in the fog"))
    assert server.wait_job(job["id"])["status"] == "completed"


def test_worker_exits_by_itself_when_rank0_dies(server):
    rank0, rank1 = server.group()["pids"]
    os.kill(server.proc.pid, signal.SIGKILL)  # torchrun: now nobody will stop the ranks
    server.proc.wait(10)
    assert alive(rank0) and alive(rank1)
    os.kill(rank0, signal.SIGKILL)
    deadline = time.monotonic() + 30  # well within the collective timeout's 20 s plus a heartbeat
    while alive(rank1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(rank1), f"rank 1 (pid {rank1}) outlived rank 0\n{server.log_tail()}"
