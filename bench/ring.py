"""Benchmark: the ring axis on one node, 2 ranks: Ulysses (U=2) against a ring (R=2), each against 1 rank.

Run from the repository root::

    python bench/ring.py [--quick] [--rounds N] [--steps N] [--baseline REF] [--out FILE.md]

Workload (ours, fp32, CPU/gloo, 1 thread per rank): ``bench/_models.py``'s random-weight
``LTXVideoTransformer3DModel`` (4 layers, head size 64; ``--quick``: 2) on its comm-bound video (25 frames at 256x512
-> 512 latent tokens, CFG on), once with 4 heads (they divide 2 ranks) and once with 3 (Ulysses pads a fourth, zero
head: a third more heads attended; the ring pads none). Layouts: 1 rank, ``--ulysses-degree 2``, ``--ring-degree 2``.

Procedure: every layout of a head count loads in its own processes (idle while another runs), one 2-step warm-up
each, then ``--rounds`` timed generations per layout, alternating (round r starts with layout r mod 3), so that load
from other processes falls on all alike. step: one denoising step, slowest rank, median over every timed step. The
1-minute load average at the start of each layout's timed rounds is in the table. Every 2-rank video is checked
against the 1-rank one (within 2 levels; ``tests/models/wan/test_wan.py`` holds 1 level at fp32 on tiny shapes).

``--baseline REF``: a fourth row with 4 heads, U=2 on the code of git commit REF (checked out in a temporary
worktree; its engine, models and ``bench/_models.py`` imported by that row's ranks), e.g. ``1cec535^``, the commit
before the ring: the U-only path against the code it had before the ring.

Targets (issue #39): R=2 at most 1.2x U=2 where the heads divide; no slower than U=2 where Ulysses pads a third of its
heads; U=2 within 2% of U=2 before the ring. The two-node part of the issue is ``bench/two_nodes.py``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402 -- path set-up
    REPO,
    TIMEOUT_S,
    RankGroup,
    code_version,
    command_line,
    free_port,
    load_average,
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


def _use_tree(tree: str) -> None:
    """Import the engine, the models and ``bench/_models.py`` from the checkout at ``tree`` from now on."""
    for name in list(sys.modules):
        if name.split(".")[0] in ("cp_infer", "models", "server") or name in ("bench", "bench._models"):
            del sys.modules[name]  # bench is a namespace package: found again, REF's folder first
    sys.path.insert(0, tree)


def _worker(rank: int, world: int, ulysses: int | None, ring: int | None, heads: int, quick: bool, port: int,
            tree: str | None, inbox, outbox) -> None:
    """One rank: load, report ready, then run ``steps`` generations until ``None``; ``tree``: the checkout whose
    code runs (None: this one)."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if tree is not None:
            _use_tree(tree)
        import cp_infer
        from bench import _models as m
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.sampler import SampleControl, sample
        from models.ltx_video.adapter import LTXVideoModel

        assert tree is None or cp_infer.__file__.startswith(tree), f"{cp_infer.__file__} is not under {tree}"

        axes = dict(ulysses_degree=ulysses) | ({} if ring is None else dict(ring_degree=ring))  # REF may have no ring
        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S, **axes),
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


def _measure(heads: int, quick: bool, steps: int, rounds: int,
             baseline: tuple[str, str] | None) -> dict[str, dict[str, Any]]:
    layouts = {label: (*layout, None) for label, layout in _LAYOUTS.items()}
    if baseline is not None:
        ref, tree = baseline
        layouts[f"U=2 at {ref}"] = (2, 2, None, tree)
    groups = {}
    try:
        for label, (world, ulysses, ring, tree) in layouts.items():
            port = free_port()
            groups[label] = RankGroup(f"{label} H={heads}", _worker,
                                      [(r, world, ulysses, ring, heads, quick, port, tree) for r in range(world)])
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


def run(args: argparse.Namespace, baseline: tuple[str, str] | None = None) -> list[str]:
    lines = table_head(("heads", "layout", "load at start", "step median (s)", "step / 1 rank", "step R=2 / U=2",
                        "frames vs 1 rank (max levels)"), left=2)
    failed, verdicts = False, []
    for heads in (4, 3):
        # REF's benchmark models before the ring have an even number of heads (Ulysses over 2 ranks)
        rows = _measure(heads, args.quick, args.steps, args.rounds, baseline if heads % 2 == 0 else None)
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
        for label in rows.keys() - _LAYOUTS.keys():
            ratio = step[_U2] / step[label]
            verdicts.append(f"H={heads}: U=2 / {label} = {ratio:.3f} (target within 2%: "
                            f"{'met' if abs(ratio - 1) <= 0.02 else 'not met'})")
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
    parser.add_argument("--baseline", metavar="REF", default=None,
                        help="also time U=2 on the code of this git commit (4 heads), e.g. the one before the ring")
    args = parser.parse_args(argv)
    head = [f"command: `{command_line(__file__, argv)}`; {os.cpu_count()} CPUs, torch {torch.__version__}; "
            f"load average at the start (1/5/15 min): {load_average()}; {code_version()}", ""]
    if args.baseline is None:
        return print_report([*head, *run(args)], args.out)
    with tempfile.TemporaryDirectory(prefix="cp-infer-baseline-") as tmp:
        tree = str(Path(tmp) / "tree")
        subprocess.run(["git", "worktree", "add", "--detach", tree, args.baseline], cwd=REPO, check=True,
                       capture_output=True)
        try:
            return print_report([*head, *run(args, (args.baseline, tree))], args.out)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO, capture_output=True)


if __name__ == "__main__":
    raise SystemExit(main())
