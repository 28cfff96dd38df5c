"""Benchmark: ``--compile`` (each transformer block ``torch.compile``d, ``models.registry.compile_transformer_blocks``)
against the same engine uncompiled, on the medium LTX-Video transformer, at 1 and 2 ranks.

    python bench/compile.py [--quick] [--rounds N] [--steps N] [--out FILE.md]

- Model: diffusers' ``LTXVideoTransformer3DModel`` at 4 layers x 16 heads x 64 (``bench/_models.py``'s ``MEDIUM``,
  random weights under a fixed seed, the embedded default's tiny T5 and VAE): the model of ``bench/cli.py``.
  Workloads: 25 frames at 256x512 (512 latent tokens) and, unless ``--quick``, 57 frames at 512x512 (2048 tokens);
  CFG on (guidance 3.0), ``--steps`` steps (default 4; ``--quick`` 3).
- Configurations, each in its own fresh processes (spawn, gloo on 127.0.0.1): eager and compiled at N=1 (1 process
  x 2 intra-op threads) and N=2 (2 ranks x 1 thread). Every process has the same ``TORCHINDUCTOR_CACHE_DIR``, a fresh
  folder made for this run, so the first compiled configuration of each N compiles from an empty cache.
- Procedure, per workload: the configurations start one after another, each running its first generation before
  the next starts (so one compile does not share the CPU with another): "1st gen" is that generation's wall time,
  and compile cost = compiled 1st gen - eager 1st gen. Then ``--rounds`` timed generations per configuration,
  interleaved (round r starts at configuration r and goes round); step = median over all timed steps of the slowest
  rank. Then a fresh compiled group per N starts with the cache the first one filled ("1st gen, warm cache": what
  the inductor FX-graph cache saves the next process).
- Exactness: the last round's final latents (packed ``[1, S, C]``, before decode) of compiled against eager at the
  same N (max abs difference).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench._models import MEDIUM, OursRunner, Workload, build_components, make_request  # noqa: E402
from bench.harness import (  # noqa: E402
    RankGroup,
    barrier,
    command_line,
    free_port,
    load_average,
    print_report,
    progress,
    rotated,
    slowest_steps,
)

__all__ = ["main"]

_TIMEOUT_S = 1800.0
"""A rank's first compiled generation compiles every block on 1 or 2 cores."""


@dataclass(frozen=True)
class Config:
    ranks: int
    compiled: bool

    @property
    def label(self) -> str:
        return f"{'compiled' if self.compiled else 'eager'} N={self.ranks}"


def _worker(rank: int, config: Config, workload: Workload, steps: int, port: int, inbox, outbox) -> None:
    """One rank: load (and compile the blocks), report, then run a generation per command until ``None``."""
    try:
        torch.set_num_threads(2 // config.ranks)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from cp_infer import ParallelConfig, init_parallel
        from models.registry import compile_transformer_blocks

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=_TIMEOUT_S), rank=rank,
                              world_size=config.ranks, local_rank=rank)
        run = OursRunner(build_components(workload.model), state=state)
        if config.compiled:
            compile_transformer_blocks(run.model.transformer)
        outbox.put((rank, "ok", None))
        while inbox.get() is not None:
            barrier()
            started = time.perf_counter()
            record = run(make_request(workload, steps), lambda: None)
            reply = dict(e2e_s=time.perf_counter() - started, steps=record["steps"], load=os.getloadavg()[0])
            if rank == 0:
                reply["latents"] = record["latents"]
            outbox.put((rank, "ok", reply))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))


def _start(config: Config, workload: Workload, steps: int) -> tuple[RankGroup, dict]:
    """A group for ``config``, loaded and through its first generation."""
    port = free_port()
    group = RankGroup(config.label, _worker, [(r, config, workload, steps, port) for r in range(config.ranks)],
                      timeout_s=_TIMEOUT_S)
    group.replies()
    return group, _gen(group)


def _gen(group: RankGroup) -> dict:
    replies = group.call("generate")
    return dict(e2e_s=max(r["e2e_s"] for r in replies), steps=slowest_steps(replies), load=replies[0]["load"],
                latents=replies[0]["latents"])


def _measure(workload: Workload, steps: int, rounds: int) -> dict[str, dict]:
    configs = [Config(n, c) for n in (1, 2) for c in (False, True)]
    rows: dict[str, dict] = {}
    groups: dict[str, RankGroup] = {}
    try:
        for config in configs:
            groups[config.label], first = _start(config, workload, steps)
            rows[config.label] = dict(config=config, first_s=first["e2e_s"], rounds=[])
            progress(f"  {workload.name} {config.label}: 1st gen {first['e2e_s']:.2f} s")
        for r in range(rounds):
            for config in rotated(configs, r):
                rows[config.label]["rounds"].append(_gen(groups[config.label]))
        for config in configs:  # the compiled groups again, from the cache the first ones filled
            if config.compiled:
                group, first = _start(config, workload, steps)
                group.close()
                rows[config.label]["warm_first_s"] = first["e2e_s"]
                progress(f"  {workload.name} {config.label}: 1st gen, warm cache {first['e2e_s']:.2f} s")
    finally:
        for group in groups.values():
            group.close()
    return rows


def _report(workload: Workload, rows: dict[str, dict]) -> list[str]:
    lines = [f"| {workload.name} | config | 1st gen s | 1st gen, warm cache s | compile cost s (cold / warm) | step "
             "median s | compiled / eager step | e2e median s | max abs Δ latents vs eager | load avg |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, row in rows.items():
        config = row["config"]
        eager = rows[Config(config.ranks, False).label]
        step = statistics.median(s for x in row["rounds"] for s in x["steps"])
        eager_step = statistics.median(s for x in eager["rounds"] for s in x["steps"])
        e2e = statistics.median(x["e2e_s"] for x in row["rounds"])
        loads = [x["load"] for x in row["rounds"]]
        if config.compiled:
            delta = float(np.abs(row["rounds"][-1]["latents"] - eager["rounds"][-1]["latents"]).max())
            warm = row["warm_first_s"]
            cells = [f"{warm:.2f}", f"{row['first_s'] - eager['first_s']:.1f} / {warm - eager['first_s']:.1f}",
                     f"{step:.3f}", f"{step / eager_step:.2f}x", f"{e2e:.2f}", f"{delta:.1e}"]
        else:
            cells = ["", "", f"{step:.3f}", "", f"{e2e:.2f}", ""]
        lines.append(f"| | {label} | {row['first_s']:.2f} | " + " | ".join(cells)
                     + f" | {min(loads):.1f}-{max(loads):.1f} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 512-token workload only, 3 steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 4)
    workloads = [Workload("512 tokens (25 frames 256x512)", 25, 256, 512, MEDIUM)]
    if not args.quick:
        workloads.append(Workload("2048 tokens (57 frames 512x512)", 57, 512, 512, MEDIUM))
    cache = Path(tempfile.mkdtemp(prefix="cp-infer-bench-inductor-"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache)  # inherited by every rank process
    try:
        lines = [f"`{command_line(__file__)}`: {platform.node()}, {os.cpu_count()} CPU(s), torch {torch.__version__}; "
                 f"LTX-Video {MEDIUM.layers} layers x {MEDIUM.heads} heads x {MEDIUM.head_dim}, {steps} steps, CFG on; "
                 f"load average at the start {load_average()}; medians of {args.rounds} rounds", ""]
        for workload in workloads:
            lines += [*_report(workload, _measure(workload, steps, args.rounds)), ""]
        print_report(lines, args.out)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
