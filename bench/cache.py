"""Step caches (``cache=first_block`` at a few thresholds, ``cache=taylorseer``) against the uncached run, ours at
N=2, end to end (prepare, every step, the decode): whole-generation time, PSNR of the frames against the uncached
ones, and the share of transformer block evaluations saved, in one run.

    python bench/cache.py [--family ltx-video ltx2] [--rounds 1] [--frames 17] [--height 192] [--width 256]
                          [--thresholds T ...] [--out FILE.md]

Models (``bench/_models.py``, written into a temporary folder with ``save_pretrained``): the medium LTX-Video (4
layers x 16 heads x 64, tiny T5 and VAE) at 50 steps with CFG, and the medium LTX-2 (2 layers x 8 heads x 64, audio
8 x 32, tiny Gemma and VAEs) at 30 steps with LTX2Pipeline's default guidance (CFG, STG, modality isolation: three
cache contexts). Ranks: 2 processes, Ulysses over both (gloo, 1 thread each); the settings alternate round by round
(``bench.harness.rotated``) and every time is the median over the rounds.

Random weights: the transformers are untrained, so what this measures is the cost side (what a skipped step saves
end to end, what the decision and the cached tails cost) and that the caches run sharded; the quality side does not
transfer. A trained model's first-block residual changes slowly from step to step (``FirstBlockCacheConfig``'s
default threshold is 0.05, diffusers' example's 0.2); these random ones' change by 0.1-0.2 (the medium LTX-Video)
and 0.4-0.7 (the medium LTX-2's video stream) from the step that last ran every block, so the default thresholds
are set around those (some steps skip, some do not), and the PSNR says how far a skipped step moves these random
models' frames, not how a trained model's would look. A threshold that skips nothing is bit-identical to the
uncached run (its time the cost of the decision alone).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402
    TIMEOUT_S,
    WARMUP_STEPS,
    RankGroup,
    command_line,
    free_port,
    load_average,
    print_report,
    rotated,
    table_head,
    table_row,
)


@dataclass(frozen=True)
class _Model:
    """A family's row: its medium model (``bench._models.write_medium_folder``) at its steps and thresholds; its
    request is ``bench._models.GUIDED``'s."""

    label: str
    steps: int
    thresholds: list[float]
    """The default ``first_block`` thresholds (see above)."""


_MODELS = {
    "ltx-video": _Model("medium LTX-Video (4 layers x 16 heads x 64, tiny T5 and VAE), CFG 3", 50,
                        [0.02, 0.05, 0.1, 0.2]),
    "ltx2": _Model("medium LTX-2 (2 layers x 8 heads x 64, audio 8 x 32, tiny Gemma and VAEs), LTX2Pipeline's guidance",
                   30, [0.3, 0.4, 0.5, 0.7]),
}
_TAYLORSEER = (dict(cache="taylorseer", cache_interval=3, disable_cache_before_step=3, max_order=1),
               dict(cache="taylorseer", cache_interval=5, disable_cache_before_step=3, max_order=1))


def _request(family: str, values: dict):
    from bench._models import GUIDED
    from cp_infer.request import GenerationRequest

    return GenerationRequest.of(seed=7, fps=24, max_sequence_length=128, **GUIDED[family], **values)


def _worker(rank: int, port: int, family: str, folder: str, inbox, outbox) -> None:
    import traceback

    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.request import resolve_request
        from cp_infer.sampler import SampleControl, sample
        from models.registry import describe_model, open_model

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S), rank=rank,
                              world_size=2, local_rank=rank)
        model = open_model(folder, dtype="fp32", state=state)
        info = describe_model(folder)
        outbox.put((rank, "ok", "ready"))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while (command := inbox.get()) is not None:
        try:
            request = resolve_request(_request(family, command), model.options)
            totals = []
            started = time.perf_counter()
            frames = sample(model, request, state=state, control=SampleControl(on_cache=totals.append))
            seconds = time.perf_counter() - started
            # Block evaluations of the uncached run: every step's passes through every block.
            (passes,) = info.step_passes(request)
            evaluations = request.num_inference_steps * passes * model.layers
            outbox.put((rank, "ok", (seconds, frames, totals[-1] if totals else None, evaluations)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))


def _psnr(frames, reference) -> float:
    import numpy as np

    mse = float(np.mean((frames.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def _settings(thresholds: list[float]) -> list[tuple[str, dict]]:
    out = [("none", {})]
    out += [(f"first_block, threshold {t:g}", dict(cache="first_block", cache_threshold=t)) for t in thresholds]
    out += [(f"taylorseer, interval {s['cache_interval']}, warm-up {s['disable_cache_before_step']}, order "
             f"{s['max_order']}", s) for s in _TAYLORSEER]
    return out


def _bench(family: str, args, tmp: Path) -> list[str]:
    from bench._models import write_medium_folder

    row = _MODELS[family]
    folder = tmp / family
    write_medium_folder(folder, family)
    size = dict(num_frames=args.frames, height=args.height, width=args.width, num_inference_steps=row.steps)
    settings = _settings(args.thresholds or row.thresholds)
    port = free_port()
    group = RankGroup(f"{family} N=2", _worker, [(r, port, family, str(folder)) for r in range(2)],
                      timeout_s=TIMEOUT_S)
    runs: dict[str, list] = {label: [] for label, _ in settings}
    try:
        group.replies()
        # Warm-up at the timed size (NOTE(warm-up-steps) in bench/harness.py: 2 steps, not 1).
        group.call({**size, "num_inference_steps": WARMUP_STEPS})
        for r in range(args.rounds):
            for label, values in rotated(settings, r):
                runs[label].append(group.call({**size, **values})[0])  # rank 0 delivers the frames
    finally:
        group.close()
    base_s = statistics.median(s for s, *_ in runs["none"])
    base_frames = runs["none"][0][1]
    lines = [f"{row.label}: {args.frames} frames {args.width}x{args.height}, {row.steps} steps, N=2 "
             f"(Ulysses), {args.rounds} round(s) alternating, load average after: {load_average()}", "",
             *table_head(("cache", "whole generation", "speed-up", "PSNR vs uncached", "steps computed / skipped",
                          "block evaluations saved"), left=1)]
    for label, _ in settings:
        seconds = statistics.median(s for s, *_ in runs[label])
        _, frames, totals, evaluations = runs[label][0]
        psnr = _psnr(frames, base_frames)
        steps = "" if totals is None else f"{totals.steps_computed} / {totals.steps_skipped}"
        saved = 0 if totals is None else totals.blocks_saved
        lines.append(table_row([label, f"{seconds:.2f} s", f"{base_s / seconds:.2f}x",
                                "identical" if math.isinf(psnr) else f"{psnr:.1f} dB", steps,
                                f"{saved} of {evaluations} ({saved / evaluations:.0%})"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=tuple(_MODELS), default=list(_MODELS))
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--thresholds", type=float, nargs="+",
                        help="first_block thresholds, for every family (default: per family, see above)")
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    lines = [f"`{command_line(__file__, argv)}`: {os.cpu_count()} CPU(s), load average at the start "
             f"{load_average()}", ""]
    with tempfile.TemporaryDirectory(prefix="cache-bench-") as tmp:
        for family in args.family:
            lines += [*_bench(family, args, Path(tmp)), ""]
    return print_report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
