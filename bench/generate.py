"""Benchmark: end-to-end LTX-Video and Wan generation, ours (Ulysses engine) against diffusers' own context
parallelism.

Run from the repository root::

    python bench/generate.py [--quick] [--families ltx-video,wan] [--out FILE.md] [--rounds N] [--steps N]
                             [--layers N] [--heads N]

Text-to-video. Image-to-video on the same models is ``bench/conditioning.py``, LTX-2 ``bench/ltx2.py``.

Every number comes from the same run and is printed as one markdown table, with the command line and the
environment above it and one PASS/FAIL line per target below it.

Models (``bench/_models.py``): diffusers' real ``LTXVideoTransformer3DModel`` at two benchmark sizes, random
weights from torch's own init under a fixed seed, so every process builds the same weights (a float64 checksum of
the parameters is compared across the processes of a workload). Text encoder, tokenizer, VAE and scheduler are the
embedded default model's (``models.ltx_video.default.build_default_components``): a tiny T5 and a tiny VAE with
LTX-Video's
real compression (8x time, 32x space). The transformer does the denoising work.

- wide: 2 layers, 16 heads x 64 head dim (inner 1024), 42 M parameters: a step at 4096 tokens is seconds of GEMM
  and SDPA on 2 cores (``--layers``/``--heads``; ``--quick``: 1 layer x 8 heads);
- narrow: 8 layers, 2 heads x 64 (inner 128; ``--quick``: 4 layers). NOTE(comm-bound): what makes a step
  communication-bound is the work per exchanged byte. A layer's GEMMs grow with the square of its width, its
  exchange (q, k, v out, the output back) linearly, so a wide layer on a slow CPU is compute-bound at any sequence
  length: on the wide model at 512 tokens ours spends ~9% of a step in its exchanges here, ~6% at 4096. The real
  LTX-Video layer (inner 2048, bf16) on GPUs with NVLink does ~7,000 FLOP per exchanged byte against a machine
  balance of ~2,000; this machine does ~140 GFLOP/s per core against a few GB/s over loopback (~50 FLOP/B), and the
  narrow layer's ~220 FLOP per exchanged byte puts it in the same regime (~28% of ours' step in its exchanges;
  diffusers' issues 4x as many collectives). The table shows the measured share.

Workloads (latent token counts are even, as diffusers' context parallelism requires; text is 128 tokens):

- comm-bound: 25 frames at 256x512 -> 4 x 8 x 16 = 512 latent tokens, narrow model;
- short, wide model: the same 512 tokens on the wide model (context only: no target is read off it);
- compute-bound (the long video): 121 frames at 512x512 -> 16 x 16 x 16 = 4096 latent tokens, wide model, one
  sequence on both sides (NOTE(one-window) in ``bench/_models.py``: ours is not made window by window).
- Wan (``--families``, default both): the same three on Wan 2.1 text-to-video (``WanTransformer3DModel`` at the same
  sizes, ``tiny-wan``'s UMT5, VAE and UniPC scheduler) with the same token grids: 13 frames at 128x256 and 61 frames
  at 256x256 (Wan's VAE compresses 4x in time and 8x in space, its transformer patches 2x2). diffusers' side is
  ``WanPipeline.__call__`` with ``WanTransformer3DModel``'s shipped ``_cp_plan`` (``DiffusersWanRunner``: only the
  device-count patch; ``ulysses_anything`` would be set for an uneven count, which these workloads do not have).
  WanPipeline runs its two guidance passes one after the other (batch 1 each), as ours does for Wan.

Configurations, each in its own fresh processes (``torch.multiprocessing`` spawn, gloo on 127.0.0.1, free port):

- ours N=1: ``cp_infer.sampler.sample`` over ``models.ltx_video.adapter.LTXVideoModel``, 1 process x 2 intra-op threads;
- ours N=2: the same on 2 ranks (``init_parallel``), 1 thread per rank;
- diffusers CP N=2: diffusers' own ``LTXPipeline.__call__`` on 2 ranks x 1 thread after
  ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))``. Two patches make it run on
  CPU/gloo, both explained in ``bench/peers/diffusers_cp.py``: (1) ``torch.accelerator.device_count`` returns 1
  during ``enable_parallelism`` (it is 0 on CPU and diffusers computes ``rank % count``); (2) diffusers' native
  SDPA op narrows LTX's per-head cross-attention mask ``[B, H, 1, S_text]`` to the rank's ``H / N`` heads after
  the Ulysses all-to-all (it passes all ``H``, and SDPA cannot broadcast them). Nothing else is changed: as
  shipped, every rank runs the whole pipeline (text encode, scheduler on the gathered latents, VAE decode);
- diffusers N=1: plain ``LTXPipeline.__call__``, 1 process x 2 threads (left out by ``--quick``).

Every configuration gets the same weights, prompt, negative prompt, seed, steps, guidance 3.0 (CFG on: batch 2
through the transformer), frame rate and decode settings.

Procedure, per workload: all configurations load (their processes then wait, idle); each runs two 2-step
warm-up generations that also measure memory; then ``--rounds`` timed generations per configuration,
interleaved (round r starts at configuration r and goes round), so that load from other processes on the
machine falls on every configuration alike; the 1-minute load average when each configuration's first timed
round starts is in the table.

- e2e: wall time of one generation (text encode + denoise + gather + decode), slowest rank, after a barrier;
  median over the rounds.
- step: one denoising step (transformer with CFG + scheduler step), slowest rank per step; median over all
  timed steps. denoise = the median round's sum over its steps; other = e2e - denoise.
- collectives / step: tensor all-to-alls and all-gathers issued per denoising step (rank 0); in ours' exchange /
  step: the wall time ours N=2 spends inside them per step (synchronous on gloo: transfer plus waiting for the
  peer; median over rounds, slowest rank). diffusers' functional collectives are asynchronous, so only their
  count is shown.
- peak activation memory per rank, from ``VmHWM`` and ``VmRSS`` in ``/proc/self/status``, the peak reset with
  ``echo 5 > /proc/self/clear_refs``; max over ranks. "1st gen": the first generation after loading, peak minus
  RSS after loading, read after the last denoising step ("denoise") and at its end ("e2e", adding the VAE
  decode). "steady": the second generation, peak after its last step minus RSS just before it, i.e. without
  what the first generation allocates once and keeps, such as MKL/oneDNN workspaces (~20-30 MiB at any N; our
  LTX-Video adapter keeps no exchange buffers between layers). "1st gen" is the per-rank activation memory a
  request really needs; "steady" shows the part that is allocated and freed within each generation.
  NOTE(malloc): during loading and the warm-ups glibc's ``M_MMAP_THRESHOLD``/``M_TRIM_THRESHOLD`` are set to
  1 MiB, so tensors of 1 MiB and more are mmapped and unmapped when freed and RSS follows the live tensors
  (with glibc's default dynamic threshold, freed blocks stay in the heap and the peak depends on allocation
  order); the timed rounds run with 32 MiB / 64 MiB, the values glibc's dynamic threshold settles at.
- correctness: the last round's final latents (packed ``[1, S, C]``, before decode) and uint8 frames of every
  configuration against ours N=1. Ours N=2 must match (``LATENT_TOL``, 1 frame level) or the run exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench._models import (  # noqa: E402 -- path set-up
    BENCH_FAMILIES,
    COMM,
    COMPUTE,
    GUIDANCE,
    LATENT_TOL,
    OursRunner,
    Workload,
    build_components,
    make_request,
    model_sizes,
    workloads,
)
from bench.harness import (  # noqa: E402
    DIFF_1,
    DIFF_2,
    MALLOC_MEASURE,
    MALLOC_TIMED,
    OURS_1,
    OURS_2,
    TIMEOUT_S,
    WARMUP_STEPS,
    CollectiveClock,
    RankGroup,
    Setup,
    barrier,
    command_line,
    environment,
    free_port,
    load_average,
    median_round,
    print_report,
    progress,
    reset_peak_rss,
    rotated,
    set_malloc,
    slowest_steps,
    status_kib,
    table_head,
    table_row,
)

__all__ = ["BenchConfig", "main"]


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[Workload, ...]
    setups: tuple[Setup, ...]
    steps: int
    """Denoising steps of each timed generation."""
    rounds: int
    """Timed generations per configuration (interleaved across configurations)."""

    def __post_init__(self) -> None:
        if self.steps < 2 or self.rounds < 1:
            raise ValueError(f"steps={self.steps} must be >= 2 and rounds={self.rounds} >= 1")
        for w in self.workloads:
            if w.tokens() % 2:
                raise ValueError(f"workload {w.name} has {w.tokens()} latent tokens; diffusers' CP needs an even count")


# ---------------------------------------------------------------------------------------------------------
# Inside a rank process.
# ---------------------------------------------------------------------------------------------------------


def _peaks(run: Any, workload: Workload, base_kib: int) -> tuple[bool, float, float]:
    """One 2-step generation: (peak reset worked, peak - base after the last step, peak - base at the end) in MiB."""
    hwm: dict[str, int] = {}
    reset = reset_peak_rss()
    run(make_request(workload, WARMUP_STEPS), lambda: hwm.setdefault("denoise", status_kib("VmHWM")))
    return reset, (hwm["denoise"] - base_kib) / 1024, (status_kib("VmHWM") - base_kib) / 1024


def _warmup(run: Any, workload: Workload, rss_loaded_kib: int) -> dict[str, Any]:
    """Two warm-up generations: the first measured from RSS after loading, the second from RSS just before it."""
    reset_1, denoise_1, e2e_1 = _peaks(run, workload, rss_loaded_kib)
    reset_2, denoise_2, _ = _peaks(run, workload, status_kib("VmRSS"))
    return dict(peak_reset=reset_1 and reset_2, act_denoise_mib=denoise_1, act_e2e_mib=e2e_1,
                act_steady_mib=denoise_2)


def _worker(rank: int, setup: Setup, config: BenchConfig, workload: Workload, port: int, inbox, outbox) -> None:
    """One rank: load, report ready, then serve ``("warmup"|"timed", round)`` commands until ``None``."""
    try:
        malloc_ok = set_malloc(*MALLOC_MEASURE)
        torch.set_num_threads(setup.threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        state = None
        if setup.impl == "ours":
            from cp_infer import ParallelConfig, init_parallel

            state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S),
                                  rank=rank, world_size=setup.ranks, local_rank=rank)
        elif setup.ranks > 1:
            import datetime

            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=setup.ranks,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        started = time.perf_counter()
        bench = BENCH_FAMILIES[workload.family]
        components = build_components(workload.model, workload.family)
        clock = CollectiveClock.install()
        weights = list(bench.transformer(components).parameters())
        if state is not None:
            run = OursRunner(components, state=state, family=workload.family)
        else:
            run = bench.diffusers(components, ranks=setup.ranks, tokens=workload.tokens())
        barrier()
        rss_loaded = status_kib("VmRSS")
        outbox.put((rank, "ok", dict(load_s=time.perf_counter() - started, malloc_ok=malloc_ok,
                                     checksum=sum(p.double().sum().item() for p in weights),
                                     params=sum(p.numel() for p in weights), rss_loaded_mib=rss_loaded / 1024)))
        while (command := inbox.get()) is not None:
            kind, _round = command
            barrier()
            if kind == "warmup":
                reply = _warmup(run, workload, rss_loaded)
                set_malloc(*MALLOC_TIMED)
            else:
                started, at_start, at_last_step = time.perf_counter(), clock.reading(), []
                record = run(make_request(workload, config.steps),
                             lambda mark=at_last_step.append: mark(clock.reading()))
                (calls, seconds), (calls_0, seconds_0) = at_last_step[0], at_start
                reply = dict(e2e_s=time.perf_counter() - started, steps=record["steps"],
                             collectives=(calls - calls_0) / config.steps,
                             exchange_s=(seconds - seconds_0) / config.steps)
                if rank == 0:
                    reply.update(latents=record["latents"], frames=record["frames"])
            outbox.put((rank, "ok", reply))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Main process: one group of rank processes per configuration.
# ---------------------------------------------------------------------------------------------------------


def _measure(config: BenchConfig, workload: Workload) -> dict[str, dict[str, Any]]:
    """All configurations of one workload: load, warm up (memory), then interleaved timed rounds."""
    rows: dict[str, dict[str, Any]] = {s.label: {"rounds": []} for s in config.setups}
    with contextlib.ExitStack() as stack:
        groups = []
        for setup in config.setups:
            port = free_port()
            group = RankGroup(setup.label, _worker, [(r, setup, config, workload, port) for r in range(setup.ranks)],
                              timeout_s=TIMEOUT_S)
            stack.callback(group.close)
            groups.append(group)
        for group in groups:
            ready = group.replies()
            row = rows[group.label]
            row.update(load_s=max(r["load_s"] for r in ready), params=ready[0]["params"],
                       checksums={r["checksum"] for r in ready}, malloc_ok=all(r["malloc_ok"] for r in ready))
            started = time.perf_counter()
            warm = group.call(("warmup", 0))
            row.update({key: max(r[key] for r in warm) for key in ("act_denoise_mib", "act_e2e_mib", "act_steady_mib")})
            row["peak_reset"] = all(r["peak_reset"] for r in warm)
            progress(f"[{workload.name}] {group.label}: loaded in {row['load_s']:.0f} s, warm-up "
                      f"{time.perf_counter() - started:.0f} s")
        for round_ in range(config.rounds):
            for group in rotated(groups, round_):
                row = rows[group.label]
                row.setdefault("load", os.getloadavg()[0])
                timed = group.call(("timed", round_))
                row["rounds"].append(dict(e2e_s=max(r["e2e_s"] for r in timed), steps=slowest_steps(timed),
                                          collectives=timed[0]["collectives"],
                                          exchange_s=max(r["exchange_s"] for r in timed)))
                row.update(latents=timed[0]["latents"], frames=timed[0]["frames"])
                progress(f"[{workload.name}] {group.label}: round {round_ + 1}/{config.rounds} "
                          f"e2e {row['rounds'][-1]['e2e_s']:.1f} s (load {os.getloadavg()[0]:.1f})")
    for row in rows.values():
        rounds, middle = row["rounds"], median_round(row["rounds"])
        row.update(e2e_s=statistics.median(r["e2e_s"] for r in rounds), denoise_s=sum(middle["steps"]),
                   step_s=statistics.median(s for r in rounds for s in r["steps"]),
                   collectives=middle["collectives"],
                   exchange_s=statistics.median(r["exchange_s"] for r in rounds))
    return rows


# ---------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------

_COLUMNS = ("workload", "latent tokens", "transformer: layers x heads x dim", "config", "ranks x threads",
            "load at start", "e2e (s)", "denoise (s)", "step median (s)", "other (s)", "collectives / step",
            "in ours' exchange / step (s)", "peak act. mem / rank: denoise, 1st gen (MiB)", "denoise, steady (MiB)",
            "e2e with decode, 1st gen (MiB)",
            "max abs Δ latents vs ours N=1", "max Δ frames vs ours N=1 (levels)")


def _compare(row: dict[str, Any], ref: dict[str, Any]) -> None:
    row["d_latents"] = float(np.abs(row["latents"] - ref["latents"]).max())
    row["d_frames"] = int(np.abs(row["frames"].astype(np.int16) - ref["frames"].astype(np.int16)).max())


def _table(config: BenchConfig, rows: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    lines = table_head(_COLUMNS, left=6)
    for w in config.workloads:
        for s in config.setups:
            row, first = rows[(w.name, s.label)], s == config.setups[0]
            m = w.model
            cells = [w.name if first else "", str(w.tokens()) if first else "",
                     f"{m.layers} x {m.heads} x {m.head_dim}" if first else "", s.label, f"{s.ranks} x {s.threads}",
                     f"{row['load']:.1f}", f"{row['e2e_s']:.2f}", f"{row['denoise_s']:.2f}", f"{row['step_s']:.3f}",
                     f"{row['e2e_s'] - row['denoise_s']:.2f}", f"{row['collectives']:.0f}",
                     f"{row['exchange_s']:.3f}" if s.impl == "ours" and s.ranks > 1 else "",
                     f"{row['act_denoise_mib']:.0f}",
                     f"{row['act_steady_mib']:.0f}", f"{row['act_e2e_mib']:.0f}", f"{row['d_latents']:.1e}",
                     str(row["d_frames"])]
            lines.append(table_row(cells))
    return lines


def _ratios(config: BenchConfig, rows: dict[tuple[str, str], dict[str, Any]]) -> tuple[list[str], int, int]:
    lines: list[str] = []
    met: list[bool] = []

    def add(label: str, value: float | None, target: float | None = None, counted: bool = True) -> None:
        if value is None:  # no ratio (_steady_ratio); never a counted target
            assert not counted or target is None, label
            lines.append(f"- {label}: n/a (ours N=1's steady denoise grew by under 1 MiB)")
            return
        if target is None:
            lines.append(f"- {label}: {value:.3f}")
            return
        if counted:
            met.append(value <= target)
        lines.append(f"- {'PASS' if value <= target else 'FAIL'}: {label} = {value:.3f} (target <= {target})")

    for w in config.workloads:
        r = {s.label: rows[(w.name, s.label)] for s in config.setups}
        o1, o2, d2 = r[OURS_1.label], r[OURS_2.label], r[DIFF_2.label]
        lines.append(f"{w.name} ({w.tokens()} tokens, {w.model.layers} x {w.model.heads} x {w.model.head_dim}), "
                     f"ratios{'' if w.target else ' (context only: no target is read off this workload)'}:")
        add("share of ours' N=2 step spent in its exchanges (all-to-all: transfer + waiting for the peer)",
            o2["exchange_s"] / o2["step_s"])
        add("collectives per step, diffusers CP N=2 / ours N=2", d2["collectives"] / max(o2["collectives"], 1))
        add("e2e ours N=2 / diffusers CP N=2", o2["e2e_s"] / d2["e2e_s"])
        add("step ours N=2 / diffusers CP N=2", o2["step_s"] / d2["step_s"])
        add("e2e ours N=2 (1 thread/rank) / ours N=1 (2 threads)", o2["e2e_s"] / o1["e2e_s"])
        add("step ours N=2 (1 thread/rank) / ours N=1 (2 threads)", o2["step_s"] / o1["step_s"])
        add("peak act. mem / rank, denoise, 1st gen, ours N=2 / ours N=1",
            o2["act_denoise_mib"] / o1["act_denoise_mib"])
        add("peak act. mem / rank, denoise, steady, ours N=2 / ours N=1", _steady_ratio(o1, o2))
        add("peak act. mem / rank, e2e with decode, 1st gen, ours N=2 / ours N=1",
            o2["act_e2e_mib"] / o1["act_e2e_mib"])
        if DIFF_1.label in r:
            add("step ours N=1 / diffusers N=1 (same modules; a noise check)", o1["step_s"] / r[DIFF_1.label]["step_s"])
    for family in dict.fromkeys(w.family for w in config.workloads):
        bench = BENCH_FAMILIES[family]
        c = {s.label: rows[(bench.prefix + COMPUTE, s.label)] for s in config.setups}
        o1, o2, d2 = c[OURS_1.label], c[OURS_2.label], c[DIFF_2.label]
        comm = rows[(bench.prefix + COMM, OURS_2.label)]["e2e_s"] / rows[(bench.prefix + COMM, DIFF_2.label)]["e2e_s"]
        lines.append(f"targets ({bench.title}):")
        add("comm-bound: e2e ours N=2 / diffusers CP N=2", comm, 0.8)
        add("compute-bound: e2e ours N=2 / diffusers CP N=2", o2["e2e_s"] / d2["e2e_s"], 1.0)
        add("compute-bound: step ours N=2 / diffusers CP N=2", o2["step_s"] / d2["step_s"], 1.0)
        add("compute-bound: e2e ours N=2 (1 thread/rank) / ours N=1 (2 threads)", o2["e2e_s"] / o1["e2e_s"], 0.97)
        add("compute-bound: step ours N=2 (1 thread/rank) / ours N=1 (2 threads)", o2["step_s"] / o1["step_s"], 0.97)
        add("long video (compute-bound): peak act. mem / rank, denoise, 1st generation after loading, ours N=2 / "
            "ours N=1", o2["act_denoise_mib"] / o1["act_denoise_mib"], 0.6)
        add("(not counted: steady state, which leaves out buffers kept from the 1st generation) the same ratio",
            _steady_ratio(o1, o2), 0.6, counted=False)
    return lines, sum(met), len(met)


def _steady_ratio(o1: dict[str, Any], o2: dict[str, Any]) -> float | None:
    """Steady denoise activations, ours N=2 / ours N=1; ``None`` where N=1 grew by under 1 MiB (a small model's
    steady denoise can stay inside the buffers of the first generation)."""
    return o2["act_steady_mib"] / o1["act_steady_mib"] if o1["act_steady_mib"] >= 1 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a ~2-minute smoke version: 1 layer x 8 heads, 1 round of 2 steps, no diffusers N=1")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed generations per configuration (default 3, --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per generation (default 3, --quick 2)")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default 2, --quick 1)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads of 64 dims (default 16, --quick 8)")
    parser.add_argument("--families", default=",".join(BENCH_FAMILIES),
                        help=f"comma-separated model families to run: {', '.join(BENCH_FAMILIES)} (default all)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if not families or set(families) - set(BENCH_FAMILIES):
        parser.error(f"--families {args.families!r}: expected a comma-separated list of "
                     f"{' and '.join(BENCH_FAMILIES)}")
    command = command_line(__file__, argv)
    sizes = model_sizes(quick=args.quick, layers=args.layers, heads=args.heads)
    config = BenchConfig(
        workloads=tuple(w for family in BENCH_FAMILIES if family in families for w in workloads(*sizes, family)),
        setups=(OURS_1, OURS_2, DIFF_2) if args.quick else (OURS_1, OURS_2, DIFF_2, DIFF_1),
        steps=args.steps or (2 if args.quick else 3), rounds=args.rounds or (1 if args.quick else 3),
    )
    env = environment(config.setups)
    started = time.perf_counter()
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for workload in config.workloads:
        for label, row in _measure(config, workload).items():
            rows[(workload.name, label)] = row

    failures = []
    for w in config.workloads:
        for s in config.setups:
            _compare(rows[(w.name, s.label)], rows[(w.name, OURS_1.label)])
        ours2 = rows[(w.name, OURS_2.label)]
        if ours2["d_latents"] > LATENT_TOL or ours2["d_frames"] > 1:
            failures.append(f"{w.name}: ours N=2 differs from ours N=1 (latents {ours2['d_latents']:.1e} vs "
                            f"tolerance {LATENT_TOL}, frames {ours2['d_frames']} levels vs 1)")
        ref = rows[(w.name, OURS_1.label)]
        if float(ref["latents"].std()) < 0.1 or float(ref["frames"].std()) < 5:
            failures.append(f"{w.name}: degenerate output (latents std {float(ref['latents'].std()):.3f}, frames std "
                            f"{float(ref['frames'].std()):.1f}): the comparisons would prove nothing")
    checksums = {w.name: set().union(*(rows[(w.name, s.label)]["checksums"] for s in config.setups))
                 for w in config.workloads}
    same_weights = all(len(c) == 1 for c in checksums.values())
    if not same_weights:
        failures.append(f"transformer weights differ between the processes of one workload: checksums {checksums}")
    ratio_lines, met, total = _ratios(config, rows)
    models = {(w.model, w.family): rows[(w.name, OURS_1.label)]["params"] for w in config.workloads}
    lines = [
        f"command: `{command}`", "", env, "",
        f"models: {'; '.join(m.describe(params, family) for (m, family), params in models.items())}; text: tiny "
        f"T5 (Wan: UMT5), 128 tokens; VAE: tiny, 8x time / 32x space (Wan: 4x / 8x); "
        f"{config.rounds} timed round(s) of {config.steps} denoising steps per configuration, after two "
        f"{WARMUP_STEPS}-step warm-ups; CFG on (guidance {GUIDANCE}), same seed and weights everywhere.", "",
        *_table(config, rows), "", *ratio_lines, "", f"{met}/{total} targets met.", "",
        f"wall time {time.perf_counter() - started:.0f} s; load average at the end (1/5/15 min): {load_average()}; "
        f"peak reset by clear_refs: {all(r['peak_reset'] for r in rows.values())}; malloc thresholds set: "
        f"{all(r['malloc_ok'] for r in rows.values())}; weights identical in every process of a workload: "
        f"{same_weights}; "
        f"ours N=2 matches ours N=1 (latents within {LATENT_TOL}, frames within 1 level): {not failures}.",
        *(f"CHECK FAILED: {failure}" for failure in failures),
    ]
    return print_report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
