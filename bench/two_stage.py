"""Two-stage generation (``stages=2``) against one stage at the same output size, ours at N=2, end to end (prepare,
every step, the upsampler, the decode), in one run: the two alternate round by round on one group of 2 rank
processes (gloo, 1 thread each), medians over the rounds, with each stage's median step time and the load average.

    python bench/two_stage.py [--model tiny-ltx2|tiny-ltx-video] [--medium] [--rounds 3] [--frames 17]
                              [--height 256] [--width 384] [--steps 8]

The model is an embedded one, ``tiny-ltx2`` (LTX-2's recipe: 3 unguided refine steps) or ``tiny-ltx-video``
(LTX-Video 0.9.7's: 4 guided refine steps), its tiny latent upsampler included. On the toys a step is tens of ms,
so the full-size decode, the second prompt encoding and the upsampler weigh more than on a real checkpoint.

``--medium``: the transformer dominates, as on a real checkpoint: a folder written into a temporary folder with
``save_pretrained``, the family's benchmark transformer (``bench/_models.py``; LTX-Video: ``bench/cli.py``'s 4
layers x 16 heads x 64; LTX-2: ``bench/ltx2.py``'s 2 layers x 8 heads x 64, audio 8 x 32), the embedded model's
other components (tiny text encoder and VAE) and its tiny latent upsampler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import TIMEOUT_S, WARMUP_STEPS, RankGroup, free_port, load_average, table_head, table_row  # noqa: E402


@dataclass(frozen=True)
class _Model:
    """An embedded model's row (its family: ``models.families.by_default_name``)."""

    refine: str
    """What its stage 2 runs, for the table."""
    options: dict
    """The request options its benchmark request sets."""
    upsampler: tuple[str, str]
    """(module, function) building its tiny latent upsampler."""


_MODELS = {
    "tiny-ltx2": _Model("3 unguided steps", dict(max_sequence_length=128),
                        ("models.ltx2.default", "build_ltx2_latent_upsampler")),
    "tiny-ltx-video": _Model("4 guided steps (denoise_strength 0.4 of 10)", {},
                             ("models.ltx_video.default", "build_latent_upsampler")),
}


def _write_medium(model_name: str, folder: Path) -> None:
    """The ``--medium`` folder of ``model_name``'s family: the benchmark transformer of ``bench/cli.py`` (LTX-Video)
    or ``bench/ltx2.py`` (LTX-2), the embedded components around it, its tiny latent upsampler."""
    import importlib

    from bench._models import write_medium_folder
    from models.common.embedded import LATENT_UPSAMPLER
    from models.families import by_default_name

    write_medium_folder(folder, by_default_name(model_name).name)
    module, function = _MODELS[model_name].upsampler
    upsampler = getattr(importlib.import_module(module), function)()
    upsampler.save_pretrained(folder / LATENT_UPSAMPLER, safe_serialization=True)


def _worker(rank: int, port: int, model_name: str, model: str, inbox, outbox) -> None:
    import traceback

    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        from cp_infer import ParallelConfig, init_parallel
        from cp_infer.request import GenerationRequest
        from cp_infer.sampler import SampleControl, sample
        from models.registry import open_model

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S), rank=rank,
                              world_size=2, local_rank=rank)
        model = open_model(model, dtype="fp32", state=state)
        outbox.put((rank, "ok", "ready"))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while (command := inbox.get()) is not None:
        try:
            steps: list[float] = []
            request = GenerationRequest.of(prompt="a drummer plays on a rainy street", negative_prompt="blurry",
                                           seed=7, fps=24, **_MODELS[model_name].options, **command)
            started = time.perf_counter()
            sample(model, request, state=state, control=SampleControl(on_step=lambda i, n, s, a=steps: a.append(s)))
            outbox.put((rank, "ok", (time.perf_counter() - started, steps)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(_MODELS), default="tiny-ltx2")
    parser.add_argument("--medium", action="store_true", help="the family's medium transformer (see above)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=256)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    size = dict(num_frames=args.frames, height=args.height, width=args.width, num_inference_steps=args.steps)
    with tempfile.TemporaryDirectory(prefix="two-stage-") as tmp:
        model = args.model
        if args.medium:
            model = str(Path(tmp) / "medium")
            _write_medium(args.model, Path(model))
        port = free_port()
        group = RankGroup("ours N=2", _worker, [(r, port, args.model, model) for r in range(2)], timeout_s=TIMEOUT_S)
        try:
            group.replies()
            results: dict[int, list[tuple[float, list[float]]]] = {1: [], 2: []}
            # Warm-up at the timed size (NOTE(warm-up-steps) in bench/harness.py: 2 steps, not 1).
            group.call({**size, "num_inference_steps": WARMUP_STEPS, "stages": 1})
            group.call({**size, "num_inference_steps": WARMUP_STEPS, "stages": 2})
            for _ in range(args.rounds):
                for stages in (1, 2):
                    results[stages].append(group.call({**size, "stages": stages})[0])
        finally:
            group.close()
    load = os.getloadavg()
    total = {s: statistics.median(t for t, _ in r) for s, r in results.items()}
    one_step = statistics.median(x for _, steps in results[1] for x in steps)
    first = statistics.median(x for _, steps in results[2] for x in steps[:args.steps])
    second = statistics.median(x for _, steps in results[2] for x in steps[args.steps:])
    what = f"medium {args.model.removeprefix('tiny-')} (tiny VAE)" if args.medium else args.model
    print(f"{args.frames} frames {args.width}x{args.height}, {args.steps} steps, {what}, N=2, "
          f"{args.rounds} rounds alternating, load average {load_average(load)}")
    print("\n".join([
        *table_head(("plan", "end to end (median)", "step at full size", "step at half size (stage 1)", "ratio")),
        table_row([f"1 stage, {args.steps} steps, guided", f"{total[1]:.2f} s", f"{one_step * 1e3:.0f} ms", "",
                   "1.00x"]),
        table_row([f"2 stages, {args.steps} guided + {_MODELS[args.model].refine}", f"{total[2]:.2f} s",
                   f"{second * 1e3:.0f} ms (stage 2)", f"{first * 1e3:.0f} ms", f"{total[2] / total[1]:.2f}x"])]))


if __name__ == "__main__":
    main()
