"""Helios chunk by chunk (issue #40) at N=1 and N=2 against ``HeliosPipeline`` in one process, in one run: seconds per
chunk (the first and the last) and peak memory per rank for videos of 1, 4 and 16 chunks.

    python bench/helios.py [--model medium|tiny] [--rounds 2] [--height 64] [--width 64] [--chunk 3] [--steps 3]

The model (``--model``): ``medium`` (the default) is a Helios transformer of Helios-Base's head size (128, its rotary
split 44/42/42) with 8 heads and 4 layers (1024 wide, 4096 in the feed-forward: 81M parameters, random weights from
a fixed seed) over tiny-helios's text encoder, VAE and scheduler, built once into the model cache; ``tiny`` is the
embedded default (``tiny-helios``), where the exchanges' fixed cost dominates. fp32, gloo on CPU, 1 intra-op thread
per rank (a core each, as each rank has a GPU of its own), guidance 5.0 (the pipeline's), chunks of ``--chunk``
latent frames, the history sizes' defaults (16, 2, 1). Three groups of processes load once: ours at N=1 and N=2
(``sample(..., collect=False)``, the engine's streaming path, frames discarded as they come) and the reference
(``HeliosPipeline`` over the same weights, loaded apart from the engine's, ``output_type="np"``, one process). Rows
alternate round by round; medians over the rounds. Measured per job:

- seconds per chunk: ours from one ``on_pass`` to the next (the chunk's steps, its history update and its streamed
  decode), the last chunk to the end of ``sample()``; the reference's total over its chunks;
- peak memory: ``VmHWM`` minus ``VmRSS`` just before the job, the heap trimmed and the peak reset first
  (``bench/harness.py``, as ``bench/long.py`` measures it): what the job added above the loaded process.

Targets (issue #40): seconds per chunk within 10% from the 1st to the 16th chunk; peak memory at 16 chunks at most
1.1x that at 1 chunk; N=2 end to end at most 0.8x ``HeliosPipeline`` (a medium model's target).
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

_TINY = "tiny-helios"
_MEDIUM = dict(num_attention_heads=8, attention_head_dim=128, rope_dim=(44, 42, 42), ffn_dim=4096, num_layers=4)
"""The medium transformer's config over tiny-helios's (Helios-Base: 40 heads of 128, 13824, 40 layers)."""
_MEDIUM_VERSION = 1
_PROMPT = "a fox runs through a snowy forest, then across a frozen lake"
_SEED = 11
_MEDIUM_SEED = 20_261_205
_CHUNKS = (1, 4, 16)
_FLAT_TIME, _FLAT_MEMORY, _SPEEDUP = 1.10, 1.1, 0.8


def _medium_folder() -> str:
    """The medium model's diffusers folder (``_MEDIUM``), built once into the model cache."""
    from diffusers import HeliosPipeline, HeliosTransformer3DModel

    from models.common.embedded import cache_root, ensure_folder, init_deterministic, write_pipeline
    from models.helios.default import build_helios_pipeline

    def write(folder):
        tiny = build_helios_pipeline()
        transformer = HeliosTransformer3DModel.from_config({**tiny.transformer.config, **_MEDIUM})
        init_deterministic(transformer, _MEDIUM_SEED)
        pipe = HeliosPipeline(tokenizer=tiny.tokenizer, text_encoder=tiny.text_encoder, vae=tiny.vae,
                              scheduler=tiny.scheduler, transformer=transformer.eval())
        write_pipeline(pipe, folder)

    target = cache_root() / f"bench-helios-medium-v{_MEDIUM_VERSION}"
    marker = {"name": "bench-helios-medium", "format_version": _MEDIUM_VERSION}
    return str(ensure_folder(target, marker=marker, write=write))


def _worker(rank: int, world: int, port: int, reference: bool, model_name: str, inbox, outbox) -> None:
    """One rank (or the reference's process): load, report ready, then run one job per command until ``None``."""
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
        pipe = None
        if reference:
            # diffusers' own pipeline on components loaded apart: none of the engine's processors or kept values.
            from diffusers import HeliosPipeline

            from models.helios.default import ensure_default_helios_model
            from models.helios.loading import load_helios

            c = load_helios(ensure_default_helios_model() if model_name == _TINY else model_name)
            pipe = HeliosPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                  scheduler=c.scheduler, transformer=c.transformer)
            pipe.set_progress_bar_config(disable=True)
        else:
            model = open_model(model_name, dtype="fp32", state=state)
        outbox.put((rank, "ok", dict(malloc_ok=malloc_ok)))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while (command := inbox.get()) is not None:
        try:
            request = GenerationRequest.of(prompt=_PROMPT, seed=_SEED, **command)
            marks: list[float] = []
            if world > 1:
                torch.distributed.barrier(group=state.cpu_group)
            trimmed, reset = trim_heap(), reset_peak_rss()
            rss_before = status_kib("VmRSS")
            started = time.perf_counter()
            if pipe is None:
                sample(model, request, state=state, control=SampleControl(
                    on_pass=lambda _i, _plan, marks=marks: marks.append(time.perf_counter()), collect=False))
            else:
                pipe(prompt=_PROMPT, num_frames=request.num_frames, height=request.height, width=request.width,
                     num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
                     num_latent_frames_per_chunk=command["num_latent_frames_per_chunk"],
                     generator=torch.Generator("cpu").manual_seed(_SEED), output_type="np")
            ended = time.perf_counter()
            chunks = [b - a for a, b in zip(marks, [*marks[1:], ended], strict=True)] if marks else []
            outbox.put((rank, "ok", dict(total_s=ended - started, chunks_s=chunks,
                                         peak_mib=(status_kib("VmHWM") - rss_before) / 1024,
                                         peak_reset=reset, trimmed=trimmed)))
        except BaseException:  # noqa: BLE001
            outbox.put((rank, "error", traceback.format_exc()))


def _frames(chunks: int, latent: int) -> int:
    from models.helios.options import Chunks

    return Chunks(chunks, latent).video_frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("medium", "tiny"), default="medium")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=3, help="latent frames per chunk")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    model_name, title = _TINY, _TINY
    if args.model == "medium":
        model_name = _medium_folder()
        title = "a medium Helios (" + ", ".join(f"{k}={v}" for k, v in _MEDIUM.items()) + ")"
    size = dict(height=args.height, width=args.width, num_inference_steps=args.steps, guidance_scale=5.0,
                num_latent_frames_per_chunk=args.chunk)
    sides = ("N=1", "N=2", "HeliosPipeline")
    rows = [(side, k) for k in _CHUNKS for side in sides]
    load_start = os.getloadavg()
    started = time.perf_counter()
    groups: dict[str, RankGroup] = {}
    results: dict[tuple[str, int], list[list[dict[str, Any]]]] = {row: [] for row in rows}
    try:
        for side, n, reference in (("N=1", 1, False), ("N=2", 2, False), ("HeliosPipeline", 1, True)):
            port = free_port()
            groups[side] = RankGroup(side, _worker, [(r, n, port, reference, model_name) for r in range(n)])
        ready = {side: g.replies() for side, g in groups.items()}
        for side in sides:  # warm-up: 2 chunks, 2 steps
            groups[side].call(dict(size, num_frames=_frames(2, args.chunk), num_inference_steps=WARMUP_STEPS))
        for round_ in range(args.rounds):
            for side, k in rotated(rows, round_):
                results[(side, k)].append(groups[side].call(dict(size, num_frames=_frames(k, args.chunk))))
            progress(f"round {round_ + 1}/{args.rounds} done, {time.perf_counter() - started:.0f} s, "
                     f"load {os.getloadavg()[0]:.1f}")
    finally:
        for g in groups.values():
            g.close()
    load_end = os.getloadavg()

    def med(row, key, rank=0):
        return statistics.median(job[rank][key] for job in results[row])

    def per_chunk(row, which):
        return statistics.median(job[0]["chunks_s"][which] for job in results[row])

    malloc_ok = all(r["malloc_ok"] for rs in ready.values() for r in rs)
    reset_ok = all(r["peak_reset"] for jobs in results.values() for job in jobs for r in job)
    lines = [
        f"`{command_line(__file__)}`: {title}, {args.width}x{args.height}, chunks of {args.chunk} latent frames "
        f"({(args.chunk - 1) * 4 + 1} video frames), {args.steps} steps, guidance 5.0, fp32, 1 thread per rank (gloo, "
        f"{os.cpu_count()} CPU cores); {args.rounds} rounds alternating, medians; "
        f"{(time.perf_counter() - started) / 60:.1f} min in all; load average {load_average(load_start)} at the start, "
        f"{load_average(load_end)} at the end; peak reset by clear_refs: {reset_ok}; malloc thresholds set: "
        f"{malloc_ok}", "",
        *table_head(("side", "chunks", "total", "s / chunk", "1st chunk", "last chunk", "last / 1st",
                     "peak memory / rank (above loaded)", "total vs HeliosPipeline"), left=2),
    ]
    for side, k in rows:
        row = (side, k)
        total = med(row, "total_s")
        first = last = ratio = "-"
        if side != "HeliosPipeline":
            a, b = per_chunk(row, 0), per_chunk(row, -1)
            first, last, ratio = f"{a:.2f} s", f"{b:.2f} s", f"{b / a:.2f}"
        peaks = " / ".join(f"{med(row, 'peak_mib', r):.1f}" for r in range(len(results[row][0])))
        lines.append(table_row([side, k, f"{total:.1f} s", f"{total / k:.2f} s", first, last, ratio,
                                f"{peaks} MiB", f"{total / med(('HeliosPipeline', k), 'total_s'):.2f}x"]))
    lines.append("")
    verdicts = []
    for side in ("N=1", "N=2"):
        many = (side, _CHUNKS[-1])
        flat = per_chunk(many, -1) / per_chunk(many, 0)
        n = len(results[many][0])
        memory = max(med(many, "peak_mib", r) / med((side, 1), "peak_mib", r) for r in range(n))
        verdicts.append(f"{side}: last / 1st chunk of {_CHUNKS[-1]} {flat:.2f} (target <= {_FLAT_TIME}: "
                        f"{'met' if flat <= _FLAT_TIME else 'NOT met'}), peak memory {_CHUNKS[-1]} / 1 chunk "
                        f"{memory:.2f}x (target <= {_FLAT_MEMORY}x: {'met' if memory <= _FLAT_MEMORY else 'NOT met'})")
    speed = med(("N=2", _CHUNKS[-1]), "total_s") / med(("HeliosPipeline", _CHUNKS[-1]), "total_s")
    verdicts.append(f"N=2 / HeliosPipeline at {_CHUNKS[-1]} chunks {speed:.2f}x (target <= {_SPEEDUP}x: "
                    f"{'met' if speed <= _SPEEDUP else 'NOT met'})")
    lines.append("; ".join(verdicts) + ".")
    print_report(lines)


if __name__ == "__main__":
    main()
