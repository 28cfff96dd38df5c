"""What an operator sees of a group's processes: a rank's failure is one line on the terminal naming the rank's log
(where the whole story is), not torchrun's report; every process's title says what it is."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import descendants

REPO = Path(__file__).resolve().parents[3]


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()


@pytest.mark.timeout(200)
def test_a_dead_rank_is_one_line_naming_its_log(tmp_path, cache_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(CP_INFER_CACHE=str(cache_dir), PYTHONPATH=str(REPO), CP_INFER_LOG_DIR=str(tmp_path / "logs"),
               CP_INFER_TEST_FAULT="rank=1,step=1,kind=exit")
    proc = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--prompt", "a red fox", "--frames", "9",
                           "--width", "96", "--height", "64", "--steps", "3", "--nproc", "2", "--out",
                           str(tmp_path / "x.mp4")], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    # The launcher's line may follow rank 0's progress bar on the bar's line: the bar had drawn its step and not yet
    # ended its line when rank 1 died. Such a line is the launcher's from its "cp-infer: ".
    stderr = re.sub(r"(?<=\S)(?=cp-infer: rank )", "\n", proc.stderr)
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith(("steps:", "INFO "))]
    rank_log = tmp_path / "logs" / "rank1.log"
    assert any(line.startswith("cp-infer: rank 1 (pid ") and "exited with code 3" in line and str(rank_log) in line
               for line in lines), proc.stderr[-3000:]
    for noise in ("ChildFailedError", "Traceback", "Root Cause", "elastic/multiprocessing"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert len([line for line in lines if "rank" in line and ("error" in line or "exited" in line)]) <= 2, lines
    assert "injecting fault" in rank_log.read_text()  # the rank's own log has what it said
    assert "ChildFailedError" in (tmp_path / "logs" / "launcher.log").read_text()  # torchrun's report, kept there
    assert not (tmp_path / "x.mp4").exists()


def test_every_process_of_a_server_says_what_it_is(api_server):
    titles = sorted(_title(pid) for pid in descendants(api_server.proc.pid) + [api_server.proc.pid])
    assert "cp-infer serve: launcher of 2 ranks" in titles, titles
    assert "cp-infer serve: rank 0/2, replica 0" in titles, titles
    assert "cp-infer serve: rank 1/2, replica 0" in titles, titles


def test_a_server_keeps_its_rank_logs_with_its_jobs(api_server):
    logs = api_server.data_dir / "logs"
    assert (logs / "rank0.log").is_file() and (logs / "rank1.log").is_file()
    assert "ready" in (logs / "rank0.log").read_text()
