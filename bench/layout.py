"""Benchmark: the mesh layouts of 2 ranks against each other, guidance parallelism (G=2) against Ulysses (U=2).

Run from the repository root::

    python bench/layout.py [--quick] [--rounds N] [--steps N] [--out FILE.md]

Workloads (ours, fp32, CPU/gloo, 2 ranks x 1 thread):

- comm-bound LTX-Video: ``bench/generate.py``'s comm-bound workload (its narrow random-weight
  ``LTXVideoTransformer3DModel``, 25 frames at 256x512 -> 512 latent tokens, CFG on: 2 passes a step). At G=2 each
  rank runs one of CFG's passes over the whole sequence and the ranks exchange their predictions once per step; at
  U=2 each rank runs both passes (a batch of 2) over half the tokens, with two all-to-alls per attention layer.
- LTX-2 default guidance: ``bench/_ltx2.py``'s random-weight ``LTX2VideoTransformer3DModel`` with LTX2Pipeline's
  default guidance (CFG's pair, STG, modality isolation: 4 passes, 3 transformer calls a step); at G=2 rank 0 runs
  CFG's pair (one batch of 2), rank 1 the STG and the modality pass.

Procedure: both layouts load in their own processes (idle while the other runs), one 2-step warm-up each, then
``--rounds`` timed generations per layout, alternating (round r starts with layout r mod 2), so that load from
other processes falls on both alike. step: one denoising step, slowest rank, median over every timed step; e2e:
one generation after a barrier (text encode, denoise, decode), median over rounds. The 1-minute load average at
the start of each layout's timed rounds is in the table. Every frame of G=2 is checked against U=2 (both equal one
rank within 1 level, ``tests/models/test_guidance_parallel.py``; here within 2 of each other).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench._procs import RankGroup, free_port  # noqa: E402 -- path set-up

__all__ = ["main"]

_TIMEOUT_S = 900.0
_LAYOUTS = ((2, 1), (1, 2))  # (guidance, ulysses) on 2 ranks
_COMM, _LTX2 = "comm-bound LTX-Video", "LTX-2 default guidance"


def _label(guidance: int, ulysses: int) -> str:
    return f"G={guidance} x U={ulysses}"


def _model(workload: str, quick: bool, state: Any) -> tuple[Any, Any]:
    """The model adapter and a function ``steps -> request`` of the workload."""
    if workload == _COMM:
        from bench.generate import COMM, ModelSize, Workload, _build_components, _request
        from models.ltx_video import LTXVideoModel

        w = Workload(COMM, frames=25, height=256, width=512, model=ModelSize(layers=4 if quick else 8, heads=2))
        model = LTXVideoModel(SimpleNamespace(**_build_components(w.model)), state=state)
        return model, lambda steps: _request(w, steps)
    from bench import _ltx2
    from cp_infer.request import GenerationRequest
    from models.ltx2 import LTX2Model

    model = LTX2Model(SimpleNamespace(**_ltx2._build_components()), state=state)
    size = dict(num_frames=25 if quick else 41, height=256, width=384 if quick else 512)
    # One stage: the benchmark transformer comes without a latent upsampler.
    return model, lambda steps: GenerationRequest.of(
        prompt=_ltx2._PROMPT, negative_prompt=_ltx2._NEGATIVE, num_inference_steps=steps, seed=_ltx2._SEED,
        fps=_ltx2._FPS, spatio_temporal_guidance_blocks=(_ltx2._LAYERS - 1,), max_sequence_length=128, stages=1,
        **size, **_ltx2._GUIDANCE)


def _worker(rank: int, guidance: int, workload: str, quick: bool, port: int, inbox, outbox) -> None:
    """One rank: load, report ready, then run ``steps`` generations until ``None``."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.sampler import SampleControl, sample

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=_TIMEOUT_S,
                                             guidance_degree=guidance), rank=rank, world_size=2, local_rank=rank)
        model, request = _model(workload, quick, state)
        model.decode_frames_per_rank = None
        outbox.put((rank, "ok", None))
        while (steps := inbox.get()) is not None:
            dist.barrier()
            times: list[float] = []
            started = time.perf_counter()
            frames = sample(model, request(steps), state=state,
                            control=SampleControl(on_step=lambda _d, _t, s, t=times: t.append(s)))
            outbox.put((rank, "ok", dict(e2e_s=time.perf_counter() - started, steps=times, frames=frames)))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(workload: str, quick: bool, steps: int, rounds: int) -> dict[str, dict[str, Any]]:
    groups = {}
    try:
        for g, u in _LAYOUTS:
            port = free_port()
            groups[_label(g, u)] = RankGroup(_label(g, u), _worker, [(r, g, workload, quick, port) for r in range(2)],
                                             timeout_s=_TIMEOUT_S)
        for group in groups.values():
            group.replies()  # loaded
            group.call(2)  # warm-up
        rows: dict[str, dict[str, Any]] = {label: {"steps": [], "e2e": [], "load": []} for label in groups}
        labels = list(groups)
        for r in range(rounds):
            for label in labels[r % 2:] + labels[:r % 2]:
                rows[label]["load"].append(os.getloadavg()[0])
                replies = groups[label].call(steps)
                rows[label]["e2e"].append(max(x["e2e_s"] for x in replies))
                rows[label]["steps"] += [max(s) for s in zip(*(x["steps"] for x in replies), strict=True)]
                rows[label]["frames"] = replies[0]["frames"]
                print(f"{workload} round {r} {label}: e2e {rows[label]['e2e'][-1]:.2f} s", file=sys.stderr)
        return rows
    finally:
        for group in groups.values():
            group.close()


def run(args: argparse.Namespace) -> list[str]:
    lines = ["| workload | layout | load at start | step median (s) | e2e median (s) | step G=2 / U=2 | e2e G=2 / U=2 "
             "| frames G=2 vs U=2 (max levels) |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    failed = False
    for workload in (_COMM, _LTX2):
        rows = _measure(workload, args.quick, args.steps, args.rounds)
        g2, u2 = rows[_label(2, 1)], rows[_label(1, 2)]
        step = {k: statistics.median(r["steps"]) for k, r in rows.items()}
        e2e = {k: statistics.median(r["e2e"]) for k, r in rows.items()}
        diff = int(np.abs(g2["frames"].astype(np.int16) - u2["frames"].astype(np.int16)).max())
        failed |= diff > 2 or float(u2["frames"].std()) < 5
        for label in rows:
            cells = [workload, label, f"{statistics.mean(rows[label]['load']):.1f}", f"{step[label]:.3f}",
                     f"{e2e[label]:.2f}"]
            if label == _label(2, 1):
                cells += [f"{step[label] / step[_label(1, 2)]:.2f}", f"{e2e[label] / e2e[_label(1, 2)]:.2f}", str(diff)]
            else:
                cells += ["", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
    if failed:
        lines.append("CHECK FAILED: G=2 and U=2 frames differ by more than 2 levels, or the video is degenerate")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and videos")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv])
    lines = [f"command: `{command}`; {os.cpu_count()} CPUs, torch {torch.__version__}", "", *run(args)]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    return 1 if any(line.startswith("CHECK FAILED") for line in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
