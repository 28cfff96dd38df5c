"""Per-request LoRA adapters (``models.common.lora``) on the medium LTX-Video: an adapter's first use (read, converted,
injected), a cached switch (``set_adapters`` alone), and the denoising step with an unfused rank-16 adapter against
none (the target: at most 1.1x), in one run; then the adapter slots of ``--compile`` (``models.common.lora_slots``: 4
slots
of rank ``--slot-rank``): a switch (the copy into the slots) and the step with them, uncompiled, and with
``--compile`` also compiled (against the compiled model without adapters; the compiled model's graph count after
every setting ran is reported: the slots keep it at the first request's).

    python bench/lora.py [--rounds 3] [--steps 8] [--frames 17] [--height 192] [--width 256] [--rank 16]
                         [--slot-rank 64] [--compile] [--threads 2] [--out FILE.md]

Model (``bench/_models.py``, written into a temporary folder with ``save_pretrained``): the medium LTX-Video (4
layers x 16 heads x 64, tiny T5 and VAE) with CFG, in one process (the adapters' cost is per token and layer, the
same share of a step at any rank count). Adapters: random (peft, ``init_lora_weights=False``) of every linear layer
of every block (attention q, k, v, out of both attentions, the feed-forward's two), saved as diffusers'
``save_lora_weights`` writes them. Step times are the process's CPU time of a step (1 intra-op thread by default: the
wall time on a shared machine is others' load), the median of a job's steps after its first two (warm-up), the
settings alternating round by round (``bench.harness.rotated``), each the median over the rounds; the first use and
the switches are the wall time of the model's own ``LoadedLoras.activate``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import command_line, load_average, print_report, rotated, table_head, table_row  # noqa: E402

_TARGETS = r"transformer_blocks\.\d+\.((attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
"""Every linear layer of every block (peft takes a string as a regular expression of whole module names)."""
_TARGET = 1.1
"""The step with one unfused adapter against none, at most."""


def _write_adapter(folder: Path, path: Path, *, rank: int, seed: int) -> int:
    """A random rank-``rank`` adapter of the medium transformer's block linears at ``path``; its tensors' bytes."""
    import torch
    from diffusers import LTXVideoTransformer3DModel
    from diffusers.loaders import LTXVideoLoraLoaderMixin
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = LTXVideoTransformer3DModel.from_pretrained(folder, subfolder="transformer")
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=_TARGETS, init_lora_weights=False)
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name="made")
    layers = get_peft_model_state_dict(transformer, adapter_name="made")
    layers = {k: v * 0.1 if "lora_B" in k else v for k, v in layers.items()}
    LTXVideoLoraLoaderMixin.save_lora_weights(path.parent, transformer_lora_layers=layers, weight_name=path.name,
                                              transformer_lora_adapter_metadata=config.to_dict())
    return sum(v.numel() * v.element_size() for v in layers.values())


def _median_step(model, request, state) -> float:
    """The median CPU time of the job's steps after its first two (this process's, every thread's: on a shared
    machine other processes' load stretches the wall time but not this)."""
    from cp_infer.sampler import SampleControl, sample

    marks: list[float] = []
    sample(model, request, state=state, control=SampleControl(on_step=lambda *_: marks.append(time.process_time())))
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return statistics.median(steps[1:] or steps)


def _slotted(folder: Path, adapters: Path, state, *, rank: int, compiled: bool):
    """The model with the adapter slots ``--compile`` makes (``models.common.lora_slots``); ``compiled``: compiled too,
    else the slots alone."""
    from models.common.lora import LoadedLoras, LoraDirectory, adapted_modules
    from models.common.lora_slots import make_slots
    from models.registry import open_model

    if compiled:
        return open_model(folder, dtype="fp32", state=state, compile_blocks=True, lora_dir=adapters,
                          max_lora_rank=rank)
    model = open_model(folder, dtype="fp32", state=state)
    directory = LoraDirectory(adapters)
    slots = make_slots(model.lora_parts(), adapted_modules(directory, model.lora_spec), rank=rank)
    model.loras = LoadedLoras(directory, spec=model.lora_spec, parts=model.lora_parts(), slots=slots)
    return model


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--height", type=int, default=192)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slot-rank", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="also the compiled model with the slots")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)

    import torch

    from bench._models import MEDIUM_LABEL, NEGATIVE, PROMPT, write_medium_folder
    from cp_infer import single_process_state
    from cp_infer.request import GenerationRequest, LoraWeight
    from models.registry import open_model

    torch.set_num_threads(args.threads)
    lines = [f"`{command_line(__file__, argv)}`: {os.cpu_count()} CPU(s), {args.threads} thread(s), load average at "
             f"the start {load_average()}", ""]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        folder, adapters = Path(tmp) / "model", Path(tmp) / "loras"
        write_medium_folder(folder)
        adapters.mkdir()
        size = _write_adapter(folder, adapters / "a.safetensors", rank=args.rank, seed=1)
        _write_adapter(folder, adapters / "b.safetensors", rank=args.rank, seed=2)
        state = single_process_state()
        model = open_model(folder, dtype="fp32", state=state, lora_dir=adapters)
        plain = open_model(folder, dtype="fp32", state=state)  # never had an adapter
        loras = model.loras
        first = _timed(lambda: loras.activate((LoraWeight("a"),)))
        second = _timed(lambda: loras.activate((LoraWeight("b"),)))
        switch = statistics.median(_timed(lambda n=n: loras.activate((LoraWeight(n),))) for n in "ab" * 5)
        both = statistics.median(_timed(lambda: loras.activate((LoraWeight("a"), LoraWeight("b", 0.5))))
                                 for _ in range(5))
        off = statistics.median(_timed(lambda: loras.activate(())) for _ in range(5))

        slotted = _slotted(folder, adapters, state, rank=args.slot_rank, compiled=False)
        slot_loras = slotted.loras
        slot_loras.activate((LoraWeight("a"),))
        slot_loras.activate((LoraWeight("b"),))  # both read: the switches below copy only
        slot_switch = statistics.median(_timed(lambda n=n: slot_loras.activate((LoraWeight(n),))) for n in "ab" * 5)
        slot_both = statistics.median(_timed(lambda s=s: slot_loras.activate((LoraWeight("a"), LoraWeight("b", s))))
                                      for s in (0.5, 0.25) * 3)
        slot_off = statistics.median(_timed(lambda n=n: (slot_loras.activate((LoraWeight(n),)),
                                                         slot_loras.activate(()))) for n in "ab" * 3)

        def request(adapters_used):
            return GenerationRequest.of(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=args.frames,
                                        height=args.height, width=args.width, num_inference_steps=args.steps,
                                        guidance_scale=3.0, seed=7, fps=24, max_sequence_length=128,
                                        loras=adapters_used)

        settings = [("no adapter (a model that never loaded one)", plain, ()),
                    ("no adapter (two loaded, disabled)", model, ()),
                    (f"one rank-{args.rank} adapter, unfused", model, (LoraWeight("a"),)),
                    (f"two rank-{args.rank} adapters, unfused", model, (LoraWeight("a"), LoraWeight("b", 0.5))),
                    (f"slots (4 x rank {args.slot_rank}), uncompiled: no adapter", slotted, ()),
                    (f"slots (4 x rank {args.slot_rank}), uncompiled: one adapter", slotted, (LoraWeight("a"),))]
        if args.compile:
            import torch._dynamo.utils

            compiled_plain = open_model(folder, dtype="fp32", state=state, compile_blocks=True)
            compiled = _slotted(folder, adapters, state, rank=args.slot_rank, compiled=True)
            settings += [("compiled, no adapter (a model without --lora-dir)", compiled_plain, ()),
                         ("compiled, slots: no adapter", compiled, ()),
                         ("compiled, slots: one adapter", compiled, (LoraWeight("a"),)),
                         ("compiled, slots: two adapters", compiled, (LoraWeight("a"), LoraWeight("b", 0.5)))]
            for which in (compiled_plain, compiled):  # the compiles, outside the timed rounds
                _median_step(which, request(()), state)
        runs: dict[str, list[float]] = {label: [] for label, *_ in settings}
        _median_step(plain, request(()), state)  # warm-up
        for r in range(args.rounds):
            for label, which, used in rotated(settings, r):
                runs[label].append(_median_step(which, request(used), state))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] if args.compile else None
    steps = {label: statistics.median(values) for label, values in runs.items()}
    base = steps[settings[0][0]]
    lines += [f"{MEDIUM_LABEL}, CFG 3: {args.frames} frames {args.width}x{args.height}, {args.steps} steps, 1 rank; "
              f"rank-{args.rank} adapters of every block linear ({size / 2**20:.1f} MiB each, fp32); median of "
              f"{args.rounds} alternating round(s); load average after: {load_average()}", "",
              *table_head(("what", "time", "against none"), left=1)]
    lines.append(table_row(["first use of an adapter (read, convert, inject, activate)", f"{first * 1e3:.0f} ms", ""]))
    lines.append(table_row(["first use of a second adapter", f"{second * 1e3:.0f} ms", ""]))
    lines.append(table_row(["cached switch to another loaded adapter (set_adapters)", f"{switch * 1e3:.1f} ms", ""]))
    lines.append(table_row(["cached switch to two loaded adapters", f"{both * 1e3:.1f} ms", ""]))
    lines.append(table_row(["cached switch to none (disable_lora)", f"{off * 1e3:.1f} ms", ""]))
    lines.append(table_row(["slots: switch to another read adapter (copied into slot 0)", f"{slot_switch * 1e3:.1f} ms",
                            ""]))
    lines.append(table_row(["slots: two read adapters, the second's scale changed", f"{slot_both * 1e3:.1f} ms", ""]))
    lines.append(table_row(["slots: an adapter, then none (the slot zeroed)", f"{slot_off * 1e3:.1f} ms", ""]))
    for label, *_ in settings:
        lines.append(table_row([f"denoising step (CPU time): {label}", f"{steps[label] * 1e3:.0f} ms",
                                f"{steps[label] / base:.3f}x"]))
    if graphs is not None:
        lines += ["", f"compiled: {graphs} dynamo graph(s) in all after every compiled setting ran {args.rounds + 1} "
                  "time(s): the blocks of the model without adapters and of the slotted one, whatever its adapters, "
                  "one each (2 means no recompile)"]
    one = steps[settings[2][0]] / base
    verdict = "within" if one <= _TARGET else "CHECK FAILED: over"
    lines += ["", f"{verdict} the target: one unfused adapter's step is {one:.3f}x the step without (target <= "
              f"{_TARGET}x)"]
    return print_report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
