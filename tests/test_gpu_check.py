"""``bench/gpu_check.py``, the prepared device check (#42), in its CPU smoke mode: run as a user runs it, every row
made, every path compared with its reference agreeing, so that the script cannot rot between the tasks that are lent a
GPU. In bf16, the CUDA default (within the script's 0.08 of the reference's range): a path that mixes dtypes fails on
the CPU as it would on a GPU, and a wrong comparison (another guidance, another schedule) is off by O(1). fp32 parity
at one rank, bit for bit, is each family's own test's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", ["bf16"])
def test_the_smoke_mode_runs_every_case_and_agrees(tmp_path, dtype):
    env = dict(os.environ, PYTHONPATH=str(REPO), CP_INFER_CACHE=str(tmp_path))
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--device", "cpu", "--quick",
                          "--dtype", dtype], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    lines = run.stdout.splitlines()
    name = {"fp32": "float32", "bf16": "bfloat16"}[dtype]
    assert f"cpu, 1 rank, {name}, TF32 off" in lines[0], lines[0]
    cells = [line.split(" | ") for line in lines if line.startswith(("| LTX", "| Wan", "| Helios", "| ring"))]
    rows = {cell[0][2:].split(" ", 1)[0] + ": " + cell[0].split(": ", 1)[1]: cell for cell in cells}
    compared = {"LTX-Video: text-to-video": "LTXPipeline", "LTX-Video: image-to-video": "LTXImageToVideoPipeline",
                "LTX-2: text-to-video, audio": "LTX2Pipeline", "Wan: text-to-video": "WanPipeline",
                "Helios: text-to-video, 65 frames in 2 chunks": "HeliosPipeline",
                "LTX-Video: --offload transformer_blocks,text_encoder,vae": "ours without offload"}
    rings = [cell for cell in cells if cell[0].startswith("| ring: 4 blocks")]
    assert [ring[0].rsplit(", ", 1)[1] for ring in rings] == ["a key mask", "no mask"], rings
    assert all(ring[1] == "SDPA over every key" and ring[5] == "yes" for ring in rings), rings
    for case, reference in compared.items():
        assert rows[case][1] == reference and rows[case][5] == "yes", rows[case]
        assert float(rows[case][4]) <= (1e-3 if dtype == "fp32" else 0.08) and float(rows[case][2]) > 0, rows[case]
    assert "LTX-Video: 65 frames in 3 windows" in rows, list(rows)
    assert float(rows["LTX-Video: 65 frames in 3 windows"][2]) > 0
    assert float(rows["LTX-Video: two stages (half size, upsampler, refine)"][2]) > 0
    assert "needs a replica group of >= 2 ranks" in rows["LTX-Video: --weights sharded"][-1]
    for case in ("Helios: 33 frames in 1 chunk, streamed", "Helios: 65 frames in 2 chunks, streamed"):
        assert rows[case][-1].startswith("chunk 1 "), rows[case]


def test_a_disagreement_is_marked_and_fails_the_run():
    from bench.gpu_check import TOLERANCE, table

    rows = [dict(case="a", reference="r", ours_step_s=1.0, theirs_step_s=2.0, difference=2 * TOLERANCE[torch.float32]),
            dict(case="b", reference="r", ours_step_s=1.0, difference=TOLERANCE[torch.float32] / 2)]
    lines = table(rows, dtype=torch.float32)
    assert "| NO |" in lines[2] and "| yes |" in lines[3]
    assert "| yes |" in table(rows[:1], dtype=torch.bfloat16)[2]  # bf16's bound is wider


def test_a_family_that_raises_is_a_failed_row_and_the_others_still_run(monkeypatch, capsys):
    import bench.gpu_check as check

    def broken(sizes, dev):
        raise RuntimeError("Expected query, key, and value to have the same dtype")

    monkeypatch.setattr(check, "_wan_rows", broken)
    assert check.main(["--device", "cpu", "--quick", "--families", "wan,helios"]) == 1
    out = capsys.readouterr().out
    assert "| wan: FAILED | - |" in out and "| NO |" in out and "RuntimeError: Expected query" in out
    assert "| Helios " in out and "HeliosPipeline" in out
