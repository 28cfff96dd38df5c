"""A minute of video window by window (issue #12) at N=1 and N=2 on the tiny defaults, in one run: total time, time
to first byte over total, peak memory per rank against a one-window video, windows per minute.

    python bench/long.py [--rounds 3] [--frames 1537] [--height 128] [--width 128] [--steps 3]

The model is the embedded default (``tiny-ltx-video``: its scheduler, guidance 3.0, the window options' defaults,
``temporal_tile_size=80``, ``temporal_overlap=24``), fp32, gloo on CPU, 1 intra-op thread per rank. Two groups of
rank processes (1 and 2 ranks) load once; each job is ``sample(..., collect=False)``, the engine's streaming path,
with ``on_frames`` discarding the frames (no encoder: what is timed is the engine). Four rows, alternating round by
round (round r starts at row r), medians over the rounds:

- long: ``--frames`` frames (1537 at 25 fps: 61 s, 28 windows);
- a few windows: 193 frames, the same size, steps and prompt: what a long video's memory is compared with to see
  whether it grows with the length (the windowed path's fixed costs, the whole-video latent buffer and the tail
  state, are in both);
- one window: 73 frames (10 latent frames, the most one 80-frame tile holds), the same size, steps and prompt.

Before the timed rounds every row runs once with 2 steps (warm-up). Measured on every rank, per job:

- total: wall time of ``sample()``; the table's is the delivering rank's (rank 0);
- first byte: from the start of ``sample()`` to the first ``on_frames`` call on the delivering rank, over total;
- peak memory: ``VmHWM`` minus ``VmRSS`` just before the job, the heap first trimmed (``malloc_trim(0)``) and the peak
  reset to the current RSS with ``/proc/self/clear_refs`` (``bench/harness.py``): the most resident memory the job
  added above what the loaded process held, its model weights excluded. Without the trim the baseline was the previous
  job's leftovers: after a long video rank 0 (N=2) kept ~15 MiB in glibc's free lists, which the one-window job after
  it reused, so its peak read 5-7 MiB instead of ~24 MiB and the ratio 2.3x-5x. glibc's mmap and trim thresholds are
  set to 1 MiB in every rank so that freed blocks go back to the kernel and the RSS follows what is live
  (``bench.harness.MALLOC_MEASURE``, ``bench/generate.py``'s measuring setting); the ratio long / one window is per
  rank at the same N, the largest over ranks in the table; the peak RSS column is ``VmHWM`` itself (weights, torch
  and the interpreter included), for scale;
- windows per minute: the windows the plan ran (``on_pass`` calls) over the total time in minutes.

Targets (issue #12): first byte over total <= 0.15 at N=2; peak memory per rank <= 1.2x a one-window video's. The
verdicts give long / one window per rank (the target's), the long video's heaviest rank against the one-window
video's heaviest (what a rank must be provisioned with), and long / a few windows per rank (growth with length).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402 -- path set-up
    MALLOC_MEASURE,
    TIMEOUT_S,
    WARMUP_STEPS,
    RankGroup,
    command_line,
    free_port,
    load_average,
    print_report,
    progress,
    reset_peak_rss,
    rotated,
    set_malloc,
    status_kib,
    table_head,
    table_row,
    trim_heap,
)

__all__ = ["main"]

_MODEL = "tiny-ltx-video"
_PROMPT = "a long walk through a forest | a river in the valley | mountains at dusk"
_NEGATIVE = "blurry, low quality"
_FPS = 25
_SEED = 11
_FEW_WINDOWS_FRAMES = 193
"""Four windows of the default 80-frame tile."""
_ONE_WINDOW_FRAMES = 73
"""(73 - 1) / 8 + 1 = 10 latent frames: the most that one window of the default ``temporal_tile_size=80`` holds."""
_TTFB_TARGET, _MEMORY_TARGET = 0.15, 1.2


def _worker(rank: int, world: int, port: int, inbox, outbox) -> None:
    """One rank: load, report ready, then run one streamed job per command (request fields) until ``None``."""
    import traceback

    import torch

    try:
        malloc_ok = set_malloc(*MALLOC_MEASURE)
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.request import GenerationRequest
        from cp_infer.sampler import SampleControl, sample
        from models.registry import open_model

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S), rank=rank,
                              world_size=world, local_rank=rank)
        model = open_model(_MODEL, dtype="fp32", state=state)
        outbox.put((rank, "ok", dict(malloc_ok=malloc_ok, rss_loaded_mib=status_kib("VmRSS") / 1024)))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while (command := inbox.get()) is not None:
        try:
            request = GenerationRequest.of(prompt=_PROMPT, negative_prompt=_NEGATIVE, seed=_SEED, fps=_FPS, **command)
            first: list[float] = []
            frames, windows = [0], [0]

            def on_frames(chunk, _first, _total, frames=frames, first=first) -> None:
                if not first:
                    first.append(time.perf_counter())
                frames[0] += chunk.shape[0]  # and the chunk is dropped

            def on_pass(_index, plan, windows=windows) -> None:
                windows[0] = len(plan.passes)

            if world > 1:
                torch.distributed.barrier(group=state.cpu_group)
            # NOTE(baseline): every job starts from a trimmed heap, so that what an earlier job left in glibc's free
            # lists (rank 0 kept ~15 MiB after a long video) does not count as "loaded" for the job after it.
            trimmed = trim_heap()
            reset = reset_peak_rss()
            rss_before = status_kib("VmRSS")
            started = time.perf_counter()
            sample(model, request, state=state,
                   control=SampleControl(on_frames=on_frames, on_pass=on_pass, collect=False))
            total = time.perf_counter() - started
            outbox.put((rank, "ok", dict(
                total_s=total, first_s=first[0] - started if first else None, frames=frames[0], windows=windows[0],
                peak_mib=(status_kib("VmHWM") - rss_before) / 1024, hwm_mib=status_kib("VmHWM") / 1024,
                peak_reset=reset, trimmed=trimmed)))
        except BaseException:  # noqa: BLE001
            outbox.put((rank, "error", traceback.format_exc()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=1537, help="the long video's frames (1537: 61 s at 25 fps)")
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 2:
        raise ValueError(f"rounds={args.rounds} must be >= 1 and steps={args.steps} >= 2 (NOTE(warm-up-steps))")
    size = dict(height=args.height, width=args.width, num_inference_steps=args.steps)
    lengths = {"long": args.frames, "a few windows": _FEW_WINDOWS_FRAMES, "one window": _ONE_WINDOW_FRAMES}
    rows = [(n, kind) for kind in lengths for n in (1, 2)]
    load_start = os.getloadavg()
    started = time.perf_counter()
    groups: dict[int, RankGroup] = {}
    results: dict[tuple[int, str], list[list[dict[str, Any]]]] = {row: [] for row in rows}
    try:
        for n in (1, 2):
            port = free_port()
            groups[n] = RankGroup(f"N={n}", _worker, [(r, n, port) for r in range(n)])
        ready = {n: g.replies() for n, g in groups.items()}
        # Warm-up: every row once, 2 steps. A process's first long video leaves its RSS tens of MiB higher (at N=2
        # about 40 MiB; the runs after it add nothing), which would count as the first timed job's peak.
        for n, kind in rows:
            groups[n].call(dict(size, num_frames=lengths[kind], num_inference_steps=WARMUP_STEPS))
        for round_ in range(args.rounds):
            for n, kind in rotated(rows, round_):
                results[(n, kind)].append(groups[n].call(dict(size, num_frames=lengths[kind])))
            progress(f"round {round_ + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s, "
                     f"load {os.getloadavg()[0]:.1f}")
    finally:
        for g in groups.values():
            g.close()
    load_end = os.getloadavg()
    elapsed = time.perf_counter() - started

    def med(row, key, rank=0):
        return statistics.median(job[rank][key] for job in results[row])

    def peak(row, rank):
        return med(row, "peak_mib", rank)

    for row, jobs in results.items():
        assert all(job[0]["frames"] == lengths[row[1]] for job in jobs), f"{row}: not every frame was delivered"
    malloc_ok = all(r["malloc_ok"] for rs in ready.values() for r in rs)
    reset_ok = all(r["peak_reset"] for jobs in results.values() for job in jobs for r in job)
    trim_ok = all(r["trimmed"] is not None for jobs in results.values() for job in jobs for r in job)
    lines = [
        f"`{command_line(__file__)}`: {_MODEL}, {args.width}x{args.height}, {args.steps} steps, guidance 3.0, fp32, N "
        f"ranks x 1 thread (gloo, {os.cpu_count()} CPU cores); long {args.frames} frames ({args.frames / _FPS:.1f} s "
        f"at {_FPS} fps), one window {_ONE_WINDOW_FRAMES} frames; {args.rounds} rounds alternating, medians; "
        f"{elapsed / 60:.1f} min in all; load average {load_average(load_start)} at the start, "
        f"{load_average(load_end)} at the end; frames discarded as they come; peak reset by clear_refs: {reset_ok}; "
        f"malloc thresholds set: {malloc_ok}; heap trimmed before each job: {trim_ok}", "",
        *table_head(("N", "video", "windows", "total", "first byte", "first byte / total", "windows / min",
                     "peak memory / rank (above loaded)", "peak / one window's", "peak RSS / rank", "total vs N=1"),
                    left=2),
    ]
    for n, kind in rows:
        row = (n, kind)
        total, first = med(row, "total_s"), med(row, "first_s")
        ttfb = statistics.median(job[0]["first_s"] / job[0]["total_s"] for job in results[row])
        windows = results[row][0][0]["windows"]
        peaks = " / ".join(f"{peak(row, r):.0f}" for r in range(n))
        hwm = " / ".join(f"{med(row, 'hwm_mib', r):.0f}" for r in range(n))
        ratio = max(peak(row, r) / peak((n, "one window"), r) for r in range(n))
        lines.append(table_row([n, f"{kind}, {lengths[kind]} frames", windows, f"{total:.1f} s", f"{first:.2f} s",
                                f"{ttfb:.3f}", f"{windows / (total / 60):.0f}", f"{peaks} MiB", f"{ratio:.2f}x",
                                f"{hwm} MiB", f"{total / med((1, kind), 'total_s'):.2f}x"]))
    lines.append("")
    long2, one = (2, "long"), "one window"
    ttfb2 = statistics.median(job[0]["first_s"] / job[0]["total_s"] for job in results[long2])
    verdicts = [f"first byte / total at N=2: {ttfb2:.3f} (target <= {_TTFB_TARGET}: "
                f"{'met' if ttfb2 <= _TTFB_TARGET else 'NOT met'})"]
    for n in (1, 2):
        per_rank = [peak((n, "long"), r) / peak((n, one), r) for r in range(n)]
        ratio = max(per_rank)
        whole = max(med((n, "long"), "hwm_mib", r) / med((n, one), "hwm_mib", r) for r in range(n))
        heaviest = max(peak((n, "long"), r) for r in range(n)) / max(peak((n, one), r) for r in range(n))
        growth = " / ".join(f"{peak((n, 'long'), r) / peak((n, 'a few windows'), r):.2f}x" for r in range(n))
        verdicts.append(f"peak memory per rank above loaded, long / one window at N={n}: "
                        f"{' / '.join(f'{x:.2f}x' for x in per_rank)} (target <= {_MEMORY_TARGET}x: "
                        f"{'met' if ratio <= _MEMORY_TARGET else 'NOT met'}; peak RSS: {whole:.2f}x); against the "
                        f"one-window video's heaviest rank: {heaviest:.2f}x; long / a few windows: {growth}")
    lines.append("; ".join(verdicts) + ".")
    print_report(lines)


if __name__ == "__main__":
    main()
