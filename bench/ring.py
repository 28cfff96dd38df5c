"""Benchmark: the ring axis on one node, 2 ranks: Ulysses (U=2) against a ring (R=2), each against 1 rank.

Run from the repository root::

    python bench/ring.py [--quick] [--rounds N] [--steps N] [--out FILE.md]

Workload (ours, fp32, CPU/gloo, 1 thread per rank): ``bench/_models.py``'s random-weight
``LTXVideoTransformer3DModel`` (4 layers, head size 64; ``--quick``: 2) on its comm-bound video (25 frames at 256x512
-> 512 latent tokens, CFG on), once with 4 heads (they divide 2 ranks) and once with 3 (Ulysses pads a fourth, zero
head: a third more heads attended; the ring pads none). Layouts: 1 rank, ``--ulysses-degree 2``, ``--ring-degree 2``.

Procedure: every layout of a head count loads in its own processes (idle while another runs), one 2-step warm-up
each, then ``--rounds`` timed generations per layout, alternating (round r starts with layout r mod 3), so that load
from other processes falls on all alike. step: one denoising step, slowest rank, median over every timed step. The
1-minute load average at the start of each layout's timed rounds is in the table. Every 2-rank video is checked
against the 1-rank one (within 2 levels; ``tests/models/wan/test_wan.py`` holds 1 level at fp32 on tiny shapes).

Targets (issue #39): R=2 at most 1.2x U=2 where the heads divide; no slower than U=2 where Ulysses pads a third of its
heads. The two-node part of the issue (network namespaces, a veth pair with a tbf cap) is not in this script.
"""

from __future__ import annotations

import argparse
import os
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

from bench.harness import (  # noqa: E402 -- path set-up
    TIMEOUT_S,
    RankGroup,
    command_line,
    free_port,
    print_report,
    progress,
    rotated,
    slowest_steps,
    table_head,
    table_row,
)

__all__ = ["main"]

_ONE, _U2, _R2 = "1 rank", "U=2", "R=2"
_LAYOUTS = {_ONE: (1, None, None), _U2: (2, 2, None), _R2: (2, 1, 2)}  # label -> (world, ulysses, ring)


def _worker(rank: int, world: int, ulysses: int | None, ring: int | None, heads: int, quick: bool, port: int,
            inbox, outbox) -> None:
    """One rank: load, report ready, then run ``steps`` generations until ``None``."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from bench import _models as m
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.sampler import SampleControl, sample
        from models.ltx_video.adapter import LTXVideoModel

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S,
                                             ulysses_degree=ulysses, ring_degree=ring),
                              rank=rank, world_size=world, local_rank=rank)
        size = m.ModelSize(layers=2 if quick else 4, heads=heads)
        workload = m.Workload(m.COMM, frames=25, height=256, width=512, model=size)
        model = LTXVideoModel(SimpleNamespace(**m.build_components(size)), state=state)
        model.decode_frames_per_rank = None
        outbox.put((rank, "ok", None))
        while (steps := inbox.get()) is not None:
            if dist.is_initialized():
                dist.barrier()
            times: list[float] = []
            started = time.perf_counter()
            frames = sample(model, m.make_request(workload, steps), state=state,
                            control=SampleControl(on_step=lambda _d, _t, s, t=times: t.append(s)))
            outbox.put((rank, "ok", dict(e2e_s=time.perf_counter() - started, steps=times, frames=frames)))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(heads: int, quick: bool, steps: int, rounds: int) -> dict[str, dict[str, Any]]:
    groups = {}
    try:
        for label, (world, ulysses, ring) in _LAYOUTS.items():
            port = free_port()
            groups[label] = RankGroup(f"{label} H={heads}", _worker,
                                      [(r, world, ulysses, ring, heads, quick, port) for r in range(world)])
        for group in groups.values():
            group.replies()  # loaded
            group.call(2)  # warm-up
        rows: dict[str, dict[str, Any]] = {label: {"steps": [], "load": []} for label in groups}
        for r in range(rounds):
            for label in rotated(list(groups), r):
                rows[label]["load"].append(os.getloadavg()[0])
                replies = groups[label].call(steps)
                rows[label]["steps"] += slowest_steps(replies)
                rows[label]["frames"] = replies[0]["frames"]
                progress(f"H={heads} round {r} {label}: step {statistics.median(slowest_steps(replies)):.3f} s")
        return rows
    finally:
        for group in groups.values():
            group.close()


def run(args: argparse.Namespace) -> list[str]:
    lines = table_head(("heads", "layout", "load at start", "step median (s)", "step / 1 rank", "step R=2 / U=2",
                        "frames vs 1 rank (max levels)"), left=2)
    failed, verdicts = False, []
    for heads in (4, 3):
        rows = _measure(heads, args.quick, args.steps, args.rounds)
        step = {k: statistics.median(r["steps"]) for k, r in rows.items()}
        one = rows[_ONE]["frames"].astype(np.int16)
        for label, row in rows.items():
            diff = int(np.abs(row["frames"].astype(np.int16) - one).max())
            failed |= diff > 2
            lines.append(table_row([heads, label, f"{statistics.mean(row['load']):.1f}", f"{step[label]:.3f}",
                                    f"{step[label] / step[_ONE]:.2f}",
                                    f"{step[_R2] / step[_U2]:.2f}" if label == _R2 else "", diff]))
        ratio = step[_R2] / step[_U2]
        target, bound = ("at most 1.2x", 1.2) if heads % 2 == 0 else ("no slower", 1.0)
        verdicts.append(f"H={heads}: R=2 / U=2 = {ratio:.2f} (target {target}: "
                        f"{'met' if ratio <= bound else 'not met'})")
    failed |= float(one.std()) < 5
    lines += ["", *verdicts]
    if failed:
        lines.append("CHECK FAILED: a 2-rank video differs from 1 rank's by more than 2 levels, or it is degenerate")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 layers instead of 4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    lines = [f"command: `{command_line(__file__, argv)}`; {os.cpu_count()} CPUs, torch {torch.__version__}", "",
             *run(args)]
    return print_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
