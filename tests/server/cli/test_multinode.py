"""Multi-node launch: two torchrun agents (``--nnodes 2``) meeting through c10d rendezvous on loopback, one rank
each, generate the same frames as one process. This is the multi-node command of docs/deployment.md with both
"nodes" on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cp_infer.video_io import read_frames_dir
from models.ltx_video.default import ensure_default_model

from ...harness import free_port

REPO = Path(__file__).resolve().parents[3]
ARGS = ["generate", "--prompt", "a lighthouse at dusk", "--frames", "17", "--height", "64", "--width", "96",
        "--steps", "2", "--seed", "11"]


@pytest.mark.timeout(300)
def test_two_torchrun_agents_equal_one_process(tmp_path):
    cache = tmp_path / "cache"
    ensure_default_model(cache)
    env = {**os.environ, "CP_INFER_CACHE": str(cache), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    single = subprocess.run([sys.executable, "-m", "server.cli", *ARGS, "--out", f"{tmp_path}/one/"], env=env,
                            cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert single.returncode == 0, single.stderr[-3000:]

    port = free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "cp-infer-test",
             "--max-restarts", "0", "-m", "server.cli", *ARGS, "--out", f"{tmp_path}/two/"],
            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for _ in range(2)
    ]
    try:
        outputs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
    for a, (_, err) in zip(agents, outputs, strict=True):
        assert a.returncode == 0, err[-3000:]
    one, _ = read_frames_dir(tmp_path / "one")
    two, _ = read_frames_dir(tmp_path / "two")
    assert one.shape == two.shape == (17, 64, 96, 3)
    assert np.abs(one.astype(np.int16) - two.astype(np.int16)).max() <= 1
