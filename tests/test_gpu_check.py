"""``bench/gpu_check.py``, the prepared device check (#42), in its CPU smoke mode: run as a user runs it, every row
made, every path compared with its reference agreeing (fp32 at one rank: within 1e-3 of the reference's range), so that
the script cannot rot between the tasks that are lent a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_the_smoke_mode_runs_every_case_and_agrees(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), CP_INFER_CACHE=str(tmp_path))
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--quick"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert "cpu, 1 rank, float32, TF32 off" in lines[0], lines[0]
    cells = [line.split(" | ") for line in lines if line.startswith(("| LTX", "| Wan"))]
    rows = {cell[0][2:].split(" ", 1)[0] + ": " + cell[0].split(": ", 1)[1]: cell for cell in cells}
    compared = {"LTX-Video: text-to-video": "LTXPipeline", "LTX-Video: image-to-video": "LTXImageToVideoPipeline",
                "LTX-2: text-to-video, audio": "LTX2Pipeline", "Wan: text-to-video": "WanPipeline",
                "LTX-Video: --offload transformer_blocks,text_encoder,vae": "ours without offload"}
    for case, reference in compared.items():
        assert rows[case][1] == reference and rows[case][5] == "yes", rows[case]
        assert float(rows[case][4]) <= 1e-3 and float(rows[case][2]) > 0, rows[case]
    assert "LTX-Video: 65 frames in 3 windows" in rows, list(rows)
    assert float(rows["LTX-Video: 65 frames in 3 windows"][2]) > 0
    assert float(rows["LTX-Video: two stages (half size, upsampler, refine)"][2]) > 0
    assert "needs a replica group of >= 2 ranks" in rows["LTX-Video: --weights sharded"][-1]


def test_a_disagreement_is_marked_and_fails_the_run():
    from bench.gpu_check import TOLERANCE, table

    rows = [dict(case="a", reference="r", ours_step_s=1.0, theirs_step_s=2.0, difference=2 * TOLERANCE[torch.float32]),
            dict(case="b", reference="r", ours_step_s=1.0, difference=TOLERANCE[torch.float32] / 2)]
    lines = table(rows, dtype=torch.float32)
    assert "| NO |" in lines[2] and "| yes |" in lines[3]
    assert "| yes |" in table(rows[:1], dtype=torch.bfloat16)[2]  # bf16's bound is wider
