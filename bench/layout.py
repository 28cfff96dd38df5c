"""Benchmark: the mesh layouts of 2 ranks against each other, guidance parallelism (G=2) against Ulysses (U=2).

Run from the repository root::

    python bench/layout.py [--quick] [--rounds N] [--steps N] [--out FILE.md]

Workloads (ours, fp32, CPU/gloo, 2 ranks x 1 thread):

- comm-bound LTX-Video: ``bench/generate.py``'s comm-bound workload (``bench/_models.py``: the narrow random-weight
  ``LTXVideoTransformer3DModel``, 25 frames at 256x512 -> 512 latent tokens, CFG on: 2 passes a step). At G=2 each
  rank runs one of CFG's passes over the whole sequence and the ranks exchange their predictions once per step; at
  U=2 each rank runs both passes (a batch of 2) over half the tokens, with two all-to-alls per attention layer.
- LTX-2 default guidance: ``bench/ltx2.py``'s random-weight ``LTX2VideoTransformer3DModel`` with LTX2Pipeline's
  default guidance (CFG's pair, STG, modality isolation: 4 passes, 3 transformer calls a step); at G=2 rank 0 runs
  CFG's pair (one batch of 2), rank 1 the STG and the modality pass.

- requests per minute (``--only throughput``, or in a full run): a queue of short jobs on a real
  ``cp-infer serve --nproc 2`` with the embedded default model, 2 replica groups of 1 rank
  (``--ulysses-degree 1``) against 1 group of 2 ranks (U=2). Both servers start before the first round and idle
  (heartbeats) while the other runs; each round submits ``--jobs`` jobs at once over HTTP and times from the first
  submit to the last job's completion (read from each job's server-sent events); requests/min = 60 x jobs / that
  time; rounds
  alternate as below; medians.

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
    ServeProcess,
    command_line,
    free_port,
    print_report,
    progress,
    queue_round,
    rotated,
    slowest_steps,
    subprocess_env,
    table_head,
    table_row,
)

__all__ = ["main"]

_LAYOUTS = ((2, 1), (1, 2))  # (guidance, ulysses) on 2 ranks
_COMM, _LTX2 = "comm-bound LTX-Video", "LTX-2 default guidance"


def _label(guidance: int, ulysses: int) -> str:
    return f"G={guidance} x U={ulysses}"


def _model(workload: str, quick: bool, state: Any) -> tuple[Any, Any]:
    """The model adapter and a function ``steps -> request`` of the workload."""
    from bench import _models as m

    if workload == _COMM:
        from models.ltx_video.adapter import LTXVideoModel

        w = m.workloads(*m.model_sizes(quick=quick))[0]  # comm-bound: the narrow model, 512 tokens
        model = LTXVideoModel(SimpleNamespace(**m.build_components(w.model)), state=state)
        return model, lambda steps: m.make_request(w, steps)
    from cp_infer.request import GenerationRequest
    from models.ltx2.adapter import LTX2Model

    model = LTX2Model(SimpleNamespace(**m.build_ltx2_components()), state=state)
    size = dict(num_frames=25 if quick else 41, height=256, width=384 if quick else 512)
    # One stage: the benchmark transformer comes without a latent upsampler.
    return model, lambda steps: GenerationRequest.of(
        prompt=m.LTX2_PROMPT, negative_prompt=m.LTX2_NEGATIVE, num_inference_steps=steps, seed=m.SEED, fps=m.FPS,
        spatio_temporal_guidance_blocks=(m.LTX2_LAYERS - 1,), max_sequence_length=128, stages=1, **size,
        **m.LTX2_GUIDANCE)


def _worker(rank: int, guidance: int, workload: str, quick: bool, port: int, inbox, outbox) -> None:
    """One rank: load, report ready, then run ``steps`` generations until ``None``."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.sampler import SampleControl, sample

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S,
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
            groups[_label(g, u)] = RankGroup(_label(g, u), _worker, [(r, g, workload, quick, port) for r in range(2)])
        for group in groups.values():
            group.replies()  # loaded
            group.call(2)  # warm-up
        rows: dict[str, dict[str, Any]] = {label: {"steps": [], "e2e": [], "load": []} for label in groups}
        for r in range(rounds):
            for label in rotated(list(groups), r):
                rows[label]["load"].append(os.getloadavg()[0])
                replies = groups[label].call(steps)
                rows[label]["e2e"].append(max(x["e2e_s"] for x in replies))
                rows[label]["steps"] += slowest_steps(replies)
                rows[label]["frames"] = replies[0]["frames"]
                progress(f"{workload} round {r} {label}: e2e {rows[label]['e2e'][-1]:.2f} s")
        return rows
    finally:
        for group in groups.values():
            group.close()


_REPLICAS, _ONE_GROUP = "2 replicas x 1 rank", "1 group x 2 ranks (U=2)"
_SERVER_LAYOUTS = {_REPLICAS: ["--ulysses-degree", "1"], _ONE_GROUP: []}


def _server(flags: list[str], workdir: Path, jobs: int) -> ServeProcess:
    """``cp-infer serve --nproc 2`` on the embedded default model, its data in ``workdir``."""
    env = subprocess_env({"CP_INFER_CACHE": str(workdir.parent / "cache")})
    return ServeProcess(["--nproc", "2", "--data-dir", str(workdir), "--max-queue", str(jobs + 1), *flags], env=env,
                        log=workdir.with_suffix(".log"))


def _throughput(args: argparse.Namespace) -> list[str]:
    import tempfile

    import httpx

    frames, size, steps = (9, "96x64", 4) if args.quick else (25, "192x128", 8)
    bodies = [{"prompt": f"a paper boat on a stream, take {i}", "num_frames": frames, "size": size,
               "num_inference_steps": steps, "seed": 10 + i} for i in range(args.jobs)]
    root = Path(tempfile.mkdtemp(prefix="cp-infer-layout-"))
    servers = {label: _server(flags, root / label.split()[0], args.jobs) for label, flags in _SERVER_LAYOUTS.items()}
    rows: dict[str, dict[str, list[float]]] = {label: {"wall": [], "load": []} for label in servers}
    limits = httpx.Limits(max_connections=args.jobs + 4)
    try:
        with httpx.Client(timeout=120, limits=limits) as client:
            for server in servers.values():
                server.wait_ready(client)
            for server in servers.values():  # warm-up: one job each
                queue_round(client, [server.url], bodies[:1])
            for r in range(args.rounds):
                for label in rotated(list(servers), r):
                    rows[label]["load"].append(os.getloadavg()[0])
                    rows[label]["wall"].append(queue_round(client, [servers[label].url], bodies)[0])
                    progress(f"throughput round {r} {label}: {rows[label]['wall'][-1]:.2f} s")
    finally:
        for server in servers.values():
            server.close()
    rpm = {label: 60 * args.jobs / statistics.median(row["wall"]) for label, row in rows.items()}
    ratio = rpm[_REPLICAS] / rpm[_ONE_GROUP]
    lines = ["", f"Requests per minute: a queue of {args.jobs} jobs ({frames} frames at {size}, {steps} steps, "
             f"embedded default model) on `cp-infer serve --nproc 2`, median of {args.rounds} alternating rounds", "",
             *table_head(("layout", "load at start", "queue wall median (s)", "requests/min",
                          "replicas / one group"), left=1)]
    for label, row in rows.items():
        cells = [label, f"{statistics.mean(row['load']):.1f}", f"{statistics.median(row['wall']):.2f}",
                 f"{rpm[label]:.1f}", f"{ratio:.2f}" if label == _REPLICAS else ""]
        lines.append(table_row(cells))
    lines.append(f"\nrequests/min 2 replicas / 1 group: {ratio:.2f}x (target >= 1.3x: "
                 f"{'PASS' if ratio >= 1.3 else 'not met'})")
    return lines


def run(args: argparse.Namespace) -> list[str]:
    if args.only == "throughput":
        return _throughput(args)
    lines = table_head(("workload", "layout", "load at start", "step median (s)", "e2e median (s)", "step G=2 / U=2",
                        "e2e G=2 / U=2", "frames G=2 vs U=2 (max levels)"), left=2)
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
            lines.append(table_row(cells))
    if failed:
        lines.append("CHECK FAILED: G=2 and U=2 frames differ by more than 2 levels, or the video is degenerate")
    if args.only is None:
        lines += _throughput(args)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models and videos")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=10, help="jobs in each round's queue (requests per minute)")
    parser.add_argument("--only", choices=("steps", "throughput"), default=None,
                        help="only the step/e2e comparison, or only requests per minute (default: both)")
    parser.add_argument("--out", default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    lines = [f"command: `{command_line(__file__, argv)}`; {os.cpu_count()} CPUs, torch {torch.__version__}", "",
             *run(args)]
    return print_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
