"""Benchmark: image-to-video on LTX-Video beside text-to-video, ours N=2 against diffusers' ``LTXConditionPipeline``
under diffusers' own context parallelism (N=2), in one run.

Run from the repository root::

    python bench/conditioning.py [--quick] [--rounds N] [--steps N] [--layers N] [--heads N] [--out FILE.md]

A line starting with ``CHECK FAILED`` (and exit status 1) means ours and diffusers disagree or the run proves nothing.

Cases, three requests served by the same loaded processes (the same prompt, seed, steps and CFG as
``bench/generate.py``), the conditioned ones with ``LTXConditionPipeline``'s semantics on both sides:

- text-to-video: ``LTXPipeline``, the request of ``bench/generate.py``'s rows;
- image at frame 0: one image (strength 1) at frame 0. Its latent frame replaces the video's first one: no extra
  tokens, the same sequence as text-to-video plus per-token timesteps and the per-step re-noise of the conditioned
  tokens;
- image at the last frame: the same image at frame 24 of 25. The pipeline encodes it to one latent frame and places
  its tokens before the video's, with their own coordinates: one latent frame of extra tokens (512 -> 640), denoised
  with the video's on every step.

The image is a fixed pseudo-random blocky RGB picture at the output size (256x512), so the encode sees the same
pixels on both sides and no resize.

Configurations, each in its own fresh processes (spawn, gloo on 127.0.0.1, 1 intra-op thread per rank):

- ours N=2: ``cp_infer.sampler.sample`` over ``models.ltx_video.adapter.LTXVideoModel`` on 2 ranks (``init_parallel``);
- diffusers CP N=2: ``LTXPipeline.__call__`` / ``LTXConditionPipeline.__call__`` on 2 ranks after
  ``enable_parallelism(ContextParallelConfig(ulysses_degree=2))``, with ``bench/peers/diffusers_cp.py``'s patches: the
  two the text-to-video rows need (device count; per-head text mask narrowed to the local heads) and a third for
  the condition pipeline only: its per-token timestep ``[B, S]`` added to the transformer's ``_cp_plan`` (split on
  dim 1 like the tokens; as shipped it is not split and the first block fails to broadcast a ``[B, S, D]``
  modulation against ``[B, S/N, D]`` tokens).

Workloads: ``bench/generate.py``'s two 512-token ones (25 frames at 256x512): comm-bound (narrow model, 8 x 2 x 64)
and short, wide model (2 x 16 x 64). NOTE(scheduler): the default model's scheduler shifts dynamically, and
``LTXConditionPipeline`` passes no shift, so as shipped it refuses that schedule (``models/ltx_video/adapter.py``,
NOTE(shift)); every case here, text-to-video included, runs the same scheduler with dynamic shifting off, as
``tests/models/ltx_video/test_conditions.py`` does. The schedule's values do not change a step's cost.

Measured, per generation the slowest rank, then the median over the timed rounds:

- before 1st step: from the call to the first denoising step's start. Ours: the request's checks and
  ``model.prepare`` (text encode, media preprocessing and VAE encode, noise, schedule), then the shard; diffusers:
  ``__call__`` up to its first step (the same work).
- of which VAE encode: wall time inside ``vae.encode``, the conditioning encode (one image), wrapped on the instance
  in both (the same ``AutoencoderKLLTXVideo``; both encode on every rank, ours as diffusers does; neither tiles).
- step: one denoising step, the conditioned cases' re-noise included on both sides (transformer with CFG, scheduler
  step); median over all timed steps. "/ t2v" divides by the same configuration's text-to-video step.
- collectives / step: tensor all-to-alls and all-gathers per step (rank 0), counted as in ``bench/generate.py``.
- correctness: the last round's final packed latents (conditioning tokens included) and uint8 frames, diffusers CP
  N=2 against ours N=2 per case (both must be the reference pipeline's: ``LATENT_TOL``, 1 frame level).

Procedure, per workload: both configurations load; one 2-step warm-up generation of every case; then ``--rounds``
rounds, round ``r`` running the cases in an order rotated by ``r``, each case on both configurations back to back
(the first alternating), so that load from elsewhere falls on every row alike. The 1-minute load average when a
row's first timed round starts is in the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
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
    COMPUTE,
    GUIDANCE,
    LATENT_TOL,
    SEED,
    ModelSize,
    OursRunner,
    Workload,
    build_components,
    make_request,
    model_sizes,
    workloads,
)
from bench.harness import (  # noqa: E402
    DIFF_2,
    MALLOC_TIMED,
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
    print_report,
    progress,
    rotated,
    set_malloc,
    slowest_steps,
    table_head,
    table_row,
)

__all__ = ["main"]

_SETUPS = (OURS_2, DIFF_2)


@dataclass(frozen=True)
class _Case:
    name: str
    frame_index: int | None
    """Where the image applies (negative: from the end); ``None``: text-to-video."""


T2V = _Case("text-to-video", None)
FIRST = _Case("image at frame 0", 0)
LAST = _Case("image at the last frame", -1)
_CASES = (T2V, FIRST, LAST)


def _workloads(args: argparse.Namespace) -> tuple[Workload, ...]:
    """``bench/generate.py``'s 512-token workloads (``--layers``/``--heads`` set the wide model's, as there)."""
    every = workloads(*model_sizes(quick=args.quick, layers=args.layers, heads=args.heads))
    return tuple(w for w in every if w.name != COMPUTE)


# ---------------------------------------------------------------------------------------------------------
# Inside a rank process.
# ---------------------------------------------------------------------------------------------------------


def _image(workload: Workload) -> np.ndarray:
    """uint8 ``[1, H, W, 3]``: 16 x 16-pixel blocks of seeded random colours, at the output size."""
    rng = np.random.default_rng(SEED)
    blocks = rng.integers(0, 256, size=(workload.height // 16, workload.width // 16, 3), dtype=np.uint8)
    return np.repeat(np.repeat(blocks, 16, axis=0), 16, axis=1)[None]


def _case_request(workload: Workload, case: _Case, steps: int):
    from cp_infer.request import Condition

    if case.frame_index is None:
        return make_request(workload, steps)
    condition = Condition(frames=_image(workload), frame_index=case.frame_index)
    return make_request(workload, steps, conditions=(condition,))


def _components(size: ModelSize) -> dict[str, Any]:
    """``bench/generate.py``'s components with dynamic shifting off (NOTE(scheduler) in the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    components = build_components(size)
    config = dict(components["scheduler"].config, use_dynamic_shifting=False)
    components["scheduler"] = FlowMatchEulerDiscreteScheduler.from_config(config)
    return components


class _CallClock:
    """Wall time spent inside one method of one object, wrapped on the instance (the method runs unchanged)."""

    def __init__(self, obj: Any, name: str) -> None:
        self.seconds = 0.0
        method = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(obj, name, timed)


def _worker(rank: int, setup: Setup, workload: Workload, steps: int, port: int, inbox, outbox) -> None:
    """One rank: load, report ready, then serve ``("warmup"|"timed", case)`` commands until ``None``."""
    try:
        from diffusers.utils import logging as diffusers_logging

        # The scheduler warns at every call that is given timesteps without sigmas, which both sides' condition
        # path does (LTXConditionPipeline's linear-quadratic schedule): one line per generation and rank.
        diffusers_logging.set_verbosity_error()
        set_malloc(*MALLOC_TIMED)
        torch.set_num_threads(setup.threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        components = _components(workload.model)
        if setup.impl == "ours":
            from cp_infer import ParallelConfig, init_parallel

            state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S),
                                  rank=rank, world_size=setup.ranks, local_rank=rank)
            run = OursRunner(components, state=state)
        else:
            from bench.peers.diffusers_cp import DiffusersRunner

            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=setup.ranks,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
            run = DiffusersRunner(components, ranks=setup.ranks, conditioned=True)
        encode = _CallClock(components["vae"], "encode")
        clock = CollectiveClock.install()
        weights = list(components["transformer"].parameters())
        barrier()
        outbox.put((rank, "ok", dict(checksum=sum(p.double().sum().item() for p in weights),
                                     params=sum(p.numel() for p in weights))))
        while (command := inbox.get()) is not None:
            kind, case = command
            n_steps = steps if kind == "timed" else WARMUP_STEPS
            request = _case_request(workload, case, n_steps)
            barrier()
            at_start, encode_0, at_last_step = clock.reading(), encode.seconds, []
            started = time.perf_counter()
            record = run(request, lambda mark=at_last_step.append: mark(clock.reading()))
            reply = dict(e2e_s=time.perf_counter() - started, steps=record["steps"],
                         before_s=record["before_first_step_s"], encode_s=encode.seconds - encode_0,
                         collectives=(at_last_step[0][0] - at_start[0]) / n_steps)
            if rank == 0:
                reply.update(latents=record["latents"], frames=record["frames"])
            outbox.put((rank, "ok", reply))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------------------
# Main process.
# ---------------------------------------------------------------------------------------------------------


def _measure(workload: Workload, *, steps: int, rounds: int) -> dict[tuple[str, str], dict[str, Any]]:
    """Both configurations of one workload: load, warm up every case, then the alternated timed rounds."""
    rows: dict[tuple[str, str], dict[str, Any]] = {(c.name, s.label): {"rounds": []} for c in _CASES for s in _SETUPS}
    checksums: set[float] = set()
    with contextlib.ExitStack() as stack:
        groups = []
        for setup in _SETUPS:
            port = free_port()
            group = RankGroup(setup.label, _worker, [(r, setup, workload, steps, port) for r in range(setup.ranks)],
                              timeout_s=TIMEOUT_S)
            stack.callback(group.close)
            groups.append(group)
        params = 0
        for group in groups:
            ready = group.replies()
            checksums |= {r["checksum"] for r in ready}
            params = ready[0]["params"]
        started = time.perf_counter()
        for case in _CASES:
            for group in groups:
                group.call(("warmup", case))
        progress(f"[i2v, {workload.name}] loaded; warm-up {time.perf_counter() - started:.0f} s")
        for round_ in range(rounds):
            for case in rotated(_CASES, round_):
                for group in rotated(groups, round_):
                    row = rows[(case.name, group.label)]
                    row.setdefault("load", os.getloadavg()[0])
                    timed = group.call(("timed", case))
                    row["rounds"].append(dict(
                        e2e_s=max(r["e2e_s"] for r in timed), before_s=max(r["before_s"] for r in timed),
                        encode_s=max(r["encode_s"] for r in timed), collectives=timed[0]["collectives"],
                        steps=slowest_steps(timed)))
                    row.update(latents=timed[0]["latents"], frames=timed[0]["frames"])
            progress(f"[i2v, {workload.name}] round {round_ + 1}/{rounds} (load {os.getloadavg()[0]:.1f})")
    for row in rows.values():
        rs = row["rounds"]
        row.update({key: statistics.median(r[key] for r in rs) for key in ("e2e_s", "before_s", "encode_s",
                                                                            "collectives")})
        row["step_s"] = statistics.median(s for r in rs for s in r["steps"])
        row["checksums"], row["params"] = checksums, params
    return rows


# ---------------------------------------------------------------------------------------------------------
# Report.
# ---------------------------------------------------------------------------------------------------------

_COLUMNS = ("workload", "transformer: layers x heads x dim", "case", "latent tokens (video + conditioning)", "config",
            "load at start", "before 1st step (s)", "of which VAE encode (s)", "step median (s)", "step / its t2v step",
            "collectives / step", "e2e (s)", "max abs Δ latents vs ours N=2", "max Δ frames vs ours N=2 (levels)")


def _table(workloads: tuple[Workload, ...], rows: dict[tuple[str, str, str], dict[str, Any]]) -> list[str]:
    lines = table_head(_COLUMNS, left=6)
    for w in workloads:
        video = w.tokens()
        for c in _CASES:
            for s in _SETUPS:
                row = rows[(w.name, c.name, s.label)]
                t2v = rows[(w.name, T2V.name, s.label)]
                extra = row["latents"].shape[1] - video
                first_of_w, first_of_c = c == _CASES[0] and s == _SETUPS[0], s == _SETUPS[0]
                m = w.model
                cells = [w.name if first_of_w else "", f"{m.layers} x {m.heads} x {m.head_dim}" if first_of_w else "",
                         c.name if first_of_c else "", f"{video} + {extra}" if first_of_c else "", s.label,
                         f"{row['load']:.1f}", f"{row['before_s']:.3f}",
                         f"{row['encode_s']:.3f}" if c.frame_index is not None else "-", f"{row['step_s']:.3f}",
                         f"{row['step_s'] / t2v['step_s']:.3f}", f"{row['collectives']:.0f}", f"{row['e2e_s']:.2f}",
                         f"{row['d_latents']:.1e}" if s != OURS_2 else "",
                         str(row["d_frames"]) if s != OURS_2 else ""]
                lines.append(table_row(cells))
    return lines


def _ratios(w: Workload, rows: dict[tuple[str, str, str], dict[str, Any]]) -> list[str]:
    def r(case: _Case, setup: Setup) -> dict[str, Any]:
        return rows[(w.name, case.name, setup.label)]

    def ours_over_diffusers(key: str, case: _Case) -> float:
        return r(case, OURS_2)[key] / r(case, DIFF_2)[key]

    extra = r(LAST, OURS_2)["latents"].shape[1] - w.tokens()
    lines = [f"{w.name} ({w.tokens()} video tokens, {w.model.layers} x {w.model.heads} x {w.model.head_dim}), "
             "ours N=2 / diffusers CP N=2 (< 1: ours is faster):"]
    lines.append("- conditioning encode (VAE encode of the image): "
                 + ", ".join(f"{c.name} {ours_over_diffusers('encode_s', c):.3f}" for c in (FIRST, LAST)))
    lines.append("- before the 1st step: " + ", ".join(f"{c.name} {ours_over_diffusers('before_s', c):.3f}"
                                                        for c in _CASES))
    lines.append("- step: " + ", ".join(f"{c.name} {ours_over_diffusers('step_s', c):.3f}" for c in _CASES))
    lines.append("- e2e: " + ", ".join(f"{c.name} {ours_over_diffusers('e2e_s', c):.3f}" for c in _CASES))
    for base in (T2V, FIRST):
        cost = {s: r(LAST, s)["step_s"] - r(base, s)["step_s"] for s in _SETUPS}
        rel = {s: r(LAST, s)["step_s"] / r(base, s)["step_s"] for s in _SETUPS}
        ratio = f"{cost[OURS_2] / cost[DIFF_2]:.3f}" if cost[DIFF_2] > 0 else "n/a (diffusers' difference <= 0)"
        lines.append(f"- per-step cost of the {extra} extra tokens (image at the last frame) over {base.name}: "
                     f"ours {cost[OURS_2] * 1e3:+.1f} ms (x{rel[OURS_2]:.3f}), diffusers CP "
                     f"{cost[DIFF_2] * 1e3:+.1f} ms (x{rel[DIFF_2]:.3f}); ours / diffusers: {ratio}")
    return lines


def _compare(rows: dict[tuple[str, str, str], dict[str, Any]], workloads: tuple[Workload, ...]) -> list[str]:
    failures = []
    for w in workloads:
        for c in _CASES:
            ours, diff = rows[(w.name, c.name, OURS_2.label)], rows[(w.name, c.name, DIFF_2.label)]
            if diff["latents"].shape != ours["latents"].shape or diff["frames"].shape != ours["frames"].shape:
                failures.append(f"{w.name}, {c.name}: latents {ours['latents'].shape}, frames {ours['frames'].shape} "
                                f"(ours) vs {diff['latents'].shape}, {diff['frames'].shape} (diffusers)")
                ours.update(d_latents=float("nan"), d_frames=-1)
                diff.update(d_latents=float("nan"), d_frames=-1)
                continue
            for row in (ours, diff):
                row["d_latents"] = float(np.abs(row["latents"] - ours["latents"]).max())
                row["d_frames"] = int(np.abs(row["frames"].astype(np.int16) - ours["frames"].astype(np.int16)).max())
            if diff["d_latents"] > LATENT_TOL or diff["d_frames"] > 1:
                failures.append(f"{w.name}, {c.name}: diffusers CP N=2 differs from ours N=2 (latents "
                                f"{diff['d_latents']:.1e} vs tolerance {LATENT_TOL}, frames {diff['d_frames']} "
                                "levels vs 1)")
            if float(ours["frames"].std()) < 5:
                failures.append(f"{w.name}, {c.name}: degenerate frames (std {float(ours['frames'].std()):.1f})")
        checksums = rows[(w.name, T2V.name, OURS_2.label)]["checksums"]
        if len(checksums) != 1:
            failures.append(f"{w.name}: transformer weights differ between processes: checksums {checksums}")
        # The conditioning must reach the output, or the conditioned rows measure nothing but text-to-video.
        t2v, first = (rows[(w.name, c.name, OURS_2.label)]["frames"] for c in (T2V, FIRST))
        if np.array_equal(t2v, first):
            failures.append(f"{w.name}: the image at frame 0 left the frames unchanged")
    return failures


def _report(args: argparse.Namespace) -> list[str]:
    """The report as markdown lines: the environment, the table, the ratios, the checks."""
    workloads_ = _workloads(args)
    steps = args.steps or (2 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 5)
    if steps < 2 or rounds < 1:
        raise ValueError(f"steps={steps} must be >= 2 and rounds={rounds} >= 1")
    env = environment(_SETUPS)
    started = time.perf_counter()
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for w in workloads_:
        for (case, label), row in _measure(w, steps=steps, rounds=rounds).items():
            rows[(w.name, case, label)] = row
    failures = _compare(rows, workloads_)
    return [
        env, "",
        f"{rounds} timed round(s) of {steps} denoising steps per row, after one {WARMUP_STEPS}-step warm-up per case; "
        f"CFG on (guidance {GUIDANCE}), text 128 tokens, same seed, weights and image everywhere; scheduler without "
        "dynamic shifting (LTXConditionPipeline passes no shift). Image: 256x512 RGB, strength 1; at the last frame it "
        "adds one latent frame of tokens before the video's.", "",
        *_table(workloads_, rows), "",
        *(line for w in workloads_ for line in _ratios(w, rows)), "",
        f"wall time {time.perf_counter() - started:.0f} s; load average at the end (1/5/15 min): {load_average()}; "
        f"diffusers CP N=2 matches ours N=2 in every case (latents within {LATENT_TOL}, frames within 1 level): "
        f"{not failures}.",
        *(f"CHECK FAILED: {failure}" for failure in failures),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 layer x 8 heads (wide), 4 layers (narrow), 1 round "
                        "of 2 steps")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per generation (default 3, --quick 2)")
    parser.add_argument("--layers", type=int, default=None, help="wide transformer's layers (default 2, --quick 1)")
    parser.add_argument("--heads", type=int, default=None, help="wide transformer's heads of 64 dims (default 16, "
                        "--quick 8)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    return print_report([f"command: `{command_line(__file__, argv)}`", "", *_report(args)], args.out)


if __name__ == "__main__":
    sys.exit(main())
