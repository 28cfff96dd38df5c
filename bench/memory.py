"""One model across the group: peak RSS per rank with the weights replicated, sharded (``--weights sharded``:
FSDP2 per block, each rank reading only its shard) and sharded with everything offloaded, the load time, the step
time and the text encoder's time, at N = 1 and 2, for a weight-heavy LTX-Video and a medium LTX-2, in one run.

    python bench/memory.py [--family ltx-video ltx2] [--steps 3] [--rounds 2] [--frames 49] [--height 384]
                           [--width 512] [--out FILE.md]

Models (written into a temporary folder with ``save_pretrained``, fp32): LTX-Video's transformer at 12 layers x 16
heads x 64 (0.8 GiB) with a T5 encoder of 8 layers x 1024 (d_ff 2816, 0.4 GiB; the tiny tokenizer) and the tiny VAE;
LTX-2's at 48 layers x 8 heads x 64 (audio 8 x 32; 1.1 GiB: as deep as the released one) with ``tiny-ltx2``'s other
components. Ranks: 1 process at 2 intra-op threads, or 2 at 1 each, Ulysses over both (gloo on loopback); every
configuration is a fresh group.

Per rank (the largest over the ranks), each configuration in fresh processes, the allocator as the product leaves it
(no malloc setting of the benchmark's; a sharded rank on the CPU sets its own, NOTE(malloc) in ``cp_infer/weights.py``):
the transformer's bytes it holds; the memory plan's bytes per rank (``cp-infer memory``: at rest, and at the peak with
the root and two blocks gathered); during the load (every weight read once after it: NOTE(mmap) in ``_touch``) and
during a whole 2-step generation at the timed size (prepare and its text encoder, the steps, the decode), the peaks
of private memory (anonymous pages plus private file pages: a page of a file only this rank has read so far counts)
and of anonymous memory (the files left out: a replicated rank's weights are pages of its files) above the rank's
before the load, sampled every 5 ms, and the peak RSS (``VmHWM``, reset between them: the mapped files' pages
included); the load (``open_model``). Then the
times, every configuration of one N loaded in the same processes and the rounds interleaved (``rotated``, so that the
machine's other load falls on each alike), malloc from the heap only (NOTE(page-faults) in ``_heap_only``): the
median step of a ``--steps`` generation and the text encoder (``encode_prompt`` of the request's prompts, median of
3), the median over the rounds.

Targets at N=2 (the issues'): the sharded peak RSS per rank lower than the replicated one by at least 0.4x the
transformer's bytes; what a sharded rank holds privately beyond a replicated rank's anonymous memory (its weights:
the activations are the same) within 10% of the plan's bytes, at rest after the load and at the peak while
generating; and the sharded step at most 1.25x the replicated one (prefetch on: each unit's pre-forward issues the
next one's all-gather, asynchronous on gloo). The ideal saving is a half of the transformer and of the text
encoder; while the steps run a rank also holds the root and two blocks whole (the one computing, the one
prefetched), 2/L of the transformer, which is why LTX-2's model here is as deep as the released one. On the CPU
the offload device is the device: "offloaded" runs the same code and holds the same memory (what it saves on a GPU,
the device's memory, cannot be seen here). A target not met prints CHECK FAILED (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402
    MALLOC_TIMED,
    TIMEOUT_S,
    WARMUP_STEPS,
    RankGroup,
    command_line,
    free_port,
    load_average,
    print_report,
    reset_peak_rss,
    rotated,
    set_malloc,
    status_kib,
    table_head,
    table_row,
)

_OFFLOAD = ("text_encoder", "vae", "transformer_blocks")
_CONFIGS = ((1, "replicated", ()), (2, "replicated", ()), (2, "sharded", ()), (2, "sharded", _OFFLOAD))
_PEAK_TARGET, _STEP_TARGET, _PLAN_TOLERANCE = 0.4, 1.25, 0.1


def _ltx_video_components() -> dict:
    """LTX-Video's weight-heavy model: a 12-layer transformer and an 8-layer T5 around the tiny VAE."""
    from diffusers import LTXVideoTransformer3DModel
    from transformers import T5Config, T5EncoderModel

    from bench._models import SEED
    from models.common.embedded import init_deterministic
    from models.ltx_video.default import build_default_components

    c = build_default_components()
    text = T5EncoderModel(T5Config(vocab_size=c["text_encoder"].config.vocab_size, d_model=1024, d_kv=64,
                                   d_ff=2816, num_layers=8, num_heads=16, feed_forward_proj="gated-gelu"))
    transformer = LTXVideoTransformer3DModel(
        in_channels=16, out_channels=16, patch_size=1, patch_size_t=1, num_attention_heads=16,
        attention_head_dim=64, cross_attention_dim=1024, num_layers=12, caption_channels=1024)
    for i, model in enumerate((text, transformer)):
        init_deterministic(model, SEED + i)
    c.update(text_encoder=text.eval(), transformer=transformer.eval())
    return c


def _ltx2_components() -> dict:
    """LTX-2's medium model as deep as the released one (48 layers) around ``tiny-ltx2``'s other components."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    from bench._models import SEED
    from models.common.embedded import init_deterministic
    from models.ltx2.default import build_ltx2_components

    c = build_ltx2_components(rope_type="interleaved")
    tiny = c["transformer"].config
    with torch.random.fork_rng(devices=[]):
        transformer = LTX2VideoTransformer3DModel(
            in_channels=tiny.in_channels, out_channels=tiny.out_channels, num_attention_heads=8,
            attention_head_dim=64, cross_attention_dim=512, audio_in_channels=tiny.audio_in_channels,
            audio_out_channels=tiny.audio_out_channels, audio_num_attention_heads=8, audio_attention_head_dim=32,
            audio_cross_attention_dim=256, num_layers=48, caption_channels=tiny.caption_channels,
            rope_type="interleaved")
    init_deterministic(transformer, SEED)
    c["transformer"] = transformer.eval()
    return c


@dataclass(frozen=True)
class _Model:
    """A family's row: its model here; its request is ``bench._models.GUIDED``'s."""

    label: str
    components: Callable[[], dict]


_MODELS = {"ltx-video": _Model("LTX-Video, transformer 12 layers x 16 heads x 64, T5 8 layers x 1024, tiny VAE",
                               _ltx_video_components),
           "ltx2": _Model("LTX-2, transformer 48 layers x 8 heads x 64 (audio 8 x 32), tiny Gemma, connectors, VAEs",
                          _ltx2_components)}


def _write(family: str, folder: Path) -> None:
    from bench._models import save_folder

    save_folder(family, _MODELS[family].components(), folder)


def _request(family: str, args, steps: int):
    from bench._models import GUIDED
    from cp_infer.request import GenerationRequest

    return GenerationRequest.of(num_frames=args.frames, height=args.height, width=args.width,
                                num_inference_steps=steps, seed=7, fps=24, max_sequence_length=128, **GUIDED[family])


def _open(state, folder: str, weights: str, offload: tuple):
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, weights=weights, offload=offload)
    model.decode_frames_per_rank = 1
    return model


def _init(rank: int, world: int, port: int):
    import torch

    from cp_infer import ParallelConfig, init_parallel

    torch.set_num_threads(2 // world)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S), rank=rank,
                         world_size=world, local_rank=rank)


def _memory_worker(rank: int, world: int, port: int, family: str, folder: str, weights: str, offload: tuple, args,
                   inbox, outbox) -> None:
    """One configuration in fresh processes: the load's time and peak, then a whole 2-step generation's peak."""
    import traceback

    try:
        from cp_infer.request import resolve_request
        from cp_infer.sampler import sample
        from models.common.placement import measure_components

        # NOTE(allocator): no malloc setting here: the allocator as the product leaves it (cp_infer.weights sets what
        # a sharded rank on the CPU needs, NOTE(malloc) there).
        state = _init(rank, world, port)
        private = _PrivatePeak()
        reset_peak_rss()
        started = time.perf_counter()
        model = _open(state, folder, weights, offload)
        load_s = time.perf_counter() - started
        _touch(model.components)
        load_peak, (load_private, load_anon) = status_kib("VmHWM") * 1024, private.take()
        held = measure_components(model.components, model.placement)
        # A generation at the timed size (NOTE(warm-up-steps) in bench/harness.py: 2 steps, not 1): prepare (the text
        # encoder), the steps, the decode.
        reset_peak_rss()
        sample(model, resolve_request(_request(family, args, WARMUP_STEPS), model.options), state=state)
        run_private, run_anon = private.take()
        private.stop()
        outbox.put((rank, "ok", dict(load_s=load_s, load_peak=load_peak, run_peak=status_kib("VmHWM") * 1024,
                                     load_private=load_private, run_private=run_private, load_anon=load_anon,
                                     run_anon=run_anon,
                                     transformer=sum(n for name, _, n in held.entries if name == "transformer"),
                                     weights=model.placement.weights)))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    inbox.get()


def _private_bytes() -> tuple[int, int]:
    """This process's ``(private, anonymous)`` bytes (``smaps_rollup``): private is its anonymous pages plus its
    private file pages (a page of a file that two ranks have both read is shared, not private); anonymous leaves the
    files out (a replicated rank's weights are pages of its files)."""
    private = anonymous = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1]) * 1024
            elif line.startswith("Anonymous:"):
                anonymous = int(line.split()[1]) * 1024
    return private, anonymous


class _PrivatePeak:
    """The peaks of :func:`_private_bytes` above their values at the start, sampled every 5 ms on a thread of its
    own; ``take()`` returns the peaks since the last ``take()`` (no kernel counter keeps a peak of either)."""

    def __init__(self):
        import threading

        self.base = _private_bytes()
        self._peak = (0, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _above(self) -> tuple[int, int]:
        return tuple(now - base for now, base in zip(_private_bytes(), self.base, strict=True))

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            now = self._above()
            with self._lock:
                self._peak = tuple(map(max, self._peak, now))

    def take(self) -> tuple[int, int]:
        now = self._above()
        with self._lock:
            peak, self._peak = tuple(map(max, self._peak, now)), (0, 0)
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _timing_worker(rank: int, world: int, port: int, family: str, folder: str, configs: list, args,
                   inbox, outbox) -> None:
    """Every configuration of ``world`` ranks loaded in the same processes, each warmed up; a command names one:
    its ``--steps`` generation's median step and its text encoder's time."""
    import traceback

    import torch

    try:
        from cp_infer.request import resolve_request
        from cp_infer.sampler import SampleControl, sample

        set_malloc(*MALLOC_TIMED)
        _heap_only()
        state = _init(rank, world, port)
        models = {label: _open(state, folder, weights, offload) for label, weights, offload in configs}
        for model in models.values():  # NOTE(warm-up-steps) in bench/harness.py: 2 steps, not 1
            sample(model, resolve_request(_request(family, args, WARMUP_STEPS), model.options), state=state)
        outbox.put((rank, "ok", "ready"))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while (label := inbox.get()) is not None:
        try:
            model = models[label]
            request = resolve_request(_request(family, args, args.steps), model.options)
            steps: list[float] = []
            control = SampleControl(on_step=lambda _done, _total, seconds, steps=steps: steps.append(seconds))
            sample(model, request, state=state, control=control)
            encode = []
            for _ in range(3):
                t0 = time.perf_counter()
                with torch.inference_mode():  # as the sampler runs it (NOTE(inference-mode) in cp_infer/weights.py)
                    model.pipe.encode_prompt(prompt=request.prompt, negative_prompt=request.negative_prompt,
                                             do_classifier_free_guidance=True, max_sequence_length=128,
                                             device=state.device)
                encode.append(time.perf_counter() - t0)
            outbox.put((rank, "ok", dict(step_s=statistics.median(steps), encode_s=statistics.median(encode))))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))


def _heap_only() -> bool:
    """glibc's ``M_MMAP_MAX`` at 0: every allocation from the heap, so a freed buffer is reused by the next of its
    size. NOTE(page-faults): FSDP2 allocates each block's all-gather buffer afresh at every forward; above glibc's
    largest mmap threshold (32 MiB) that is an mmap whose pages fault in, zeroed, every time, which on a GPU the
    caching allocator spares. For the replicated and the sharded configurations alike."""
    import ctypes

    try:
        return bool(ctypes.CDLL(None).mallopt(-4, 0))  # M_MMAP_MAX
    except (OSError, AttributeError):  # not glibc
        return False


def _touch(components) -> None:
    """Read every weight once. NOTE(mmap): a replicated load leaves the weights as views into the memory-mapped
    files, whose pages count in RSS once read (the first step reads them all): read here, the load's peak is what the
    rank holds, as it would be on a device. A shard is the rank's own memory already."""
    import dataclasses

    import torch

    with torch.inference_mode():
        for field in dataclasses.fields(components):
            module = getattr(components, field.name)
            if isinstance(module, torch.nn.Module):
                for t in (*module.parameters(), *module.buffers()):
                    (t.to_local() if hasattr(t, "to_local") else t).sum()


def _label(weights: str, offload: tuple) -> str:
    return weights + (" + offload " + ",".join(offload) if offload else "")


def _memory(family: str, folder: Path, args, world: int, weights: str, offload: tuple) -> dict:
    port = free_port()
    group = RankGroup(f"{family} N={world} {weights}", _memory_worker,
                      [(r, world, port, family, str(folder), weights, offload, args) for r in range(world)],
                      timeout_s=TIMEOUT_S)
    try:
        ranks = group.replies()
    finally:
        group.close()
    worst = {key: max(r[key] for r in ranks)
             for key in ("load_s", "load_peak", "run_peak", "load_private", "run_private", "load_anon", "run_anon",
                         "transformer")}
    return {**worst, "weights": ranks[0]["weights"]}


def _timing(family: str, folder: Path, args, world: int) -> dict[str, dict]:
    """Each configuration of ``world`` ranks, the rounds interleaved (``bench.harness.rotated``): per configuration
    the median over the rounds of the slowest rank's median step and text-encoder time."""
    configs = [(_label(w, o), w, o) for n, w, o in _CONFIGS if n == world]
    port = free_port()
    group = RankGroup(f"{family} N={world} timing", _timing_worker,
                      [(r, world, port, family, str(folder), configs, args) for r in range(world)],
                      timeout_s=TIMEOUT_S)
    rounds: dict[str, list[dict]] = {label: [] for label, *_ in configs}
    try:
        group.replies()
        for r in range(args.rounds):
            for label in rotated([c[0] for c in configs], r):
                replies = group.call(label)
                rounds[label].append({k: max(x[k] for x in replies) for k in ("step_s", "encode_s")})
    finally:
        group.close()
    return {label: {k: statistics.median(x[k] for x in runs) for k in ("step_s", "encode_s")}
            for label, runs in rounds.items()}


def _bench(family: str, args, tmp: Path) -> list[str]:
    from cp_infer.placement import format_bytes, plan_memory
    from models.common.placement import model_components

    folder = tmp / family
    _write(family, folder)
    components = model_components(folder, dtype="fp32")
    whole = {c.name: c.nbytes for c in components}["transformer"]
    plans = {(world, weights, offload): plan_memory(components, ranks=world, sharded=weights == "sharded",
                                                    offload=offload) for world, weights, offload in _CONFIGS}
    memory = [((world, weights, offload), _memory(family, folder, args, world, weights, offload))
              for world, weights, offload in _CONFIGS]
    timing = {world: _timing(family, folder, args, world) for world in sorted({c[0] for c in _CONFIGS})}
    lines = [f"{_MODELS[family].label} (transformer {format_bytes(whole)}): {args.frames} frames "
             f"{args.width}x{args.height}, {args.steps} steps, {args.rounds} interleaved round(s); load average "
             f"after: {load_average()}", "",
             *table_head(("N", "weights", "transformer held per rank", "plan: at rest / peak",
                          "private (anonymous) at load", "private (anonymous) generating", "peak RSS at load",
                          "peak RSS generating", "load", "step (median)",
                          "text encoder"), left=2)]
    for config, m in memory:
        world, weights, offload = config
        t = timing[world][_label(weights, offload)]
        plan = plans[config]
        lines.append(table_row([world, _label(weights, offload), format_bytes(m["transformer"]),
                                f"{format_bytes(plan.device_bytes + plan.host_bytes)} / "
                                f"{format_bytes(plan.peak_device_bytes + plan.host_bytes)}",
                                f"{format_bytes(m['load_private'])} ({format_bytes(m['load_anon'])})",
                                f"{format_bytes(m['run_private'])} ({format_bytes(m['run_anon'])})",
                                format_bytes(m["load_peak"]), format_bytes(m["run_peak"]), f"{m['load_s']:.2f} s",
                                f"{t['step_s']:.3f} s", f"{t['encode_s'] * 1e3:.1f} ms"]))
    replicated, sharded = memory[1][1], memory[2][1]
    rep_t, sh_t = timing[2][_label("replicated", ())], timing[2][_label("sharded", ())]
    saved = {k: replicated[k] - sharded[k] for k in ("load_peak", "run_peak")}
    ratio = sh_t["step_s"] / rep_t["step_s"]
    lines += ["", f"N=2, sharded against replicated: peak RSS lower by {format_bytes(saved['load_peak'])} at load "
                  f"({saved['load_peak'] / whole:.2f}x the transformer) and {format_bytes(saved['run_peak'])} "
                  f"generating ({saved['run_peak'] / whole:.2f}x); step time {ratio:.2f}x; text encoder "
                  f"{sh_t['encode_s'] / rep_t['encode_s']:.2f}x."]
    # The plan against the measure: a replicated rank's weights are pages of its files, so its anonymous memory is
    # what it holds beside them (the activations, the interpreter's); a sharded rank's private memory beyond that is
    # its weights: at rest after the load, at the peak (the root and two blocks gathered) while generating.
    plan = plans[(2, "sharded", ())]
    for what, measured, planned in (
            ("at load", sharded["load_private"] - replicated["load_anon"], plan.device_bytes),
            ("generating", sharded["run_private"] - replicated["run_anon"], plan.peak_device_bytes)):
        lines.append(f"N=2 sharded {what}: private memory beyond a replicated rank's anonymous memory "
                     f"{format_bytes(measured)}, the plan's {format_bytes(planned)} ({measured / planned:.2f}x)")
        if abs(measured / planned - 1) > _PLAN_TOLERANCE:
            lines.append(f"CHECK FAILED: {family}: the plan is off by more than {_PLAN_TOLERANCE:.0%} {what}")
    for what, value in (("at load", saved["load_peak"]), ("generating", saved["run_peak"])):
        if value < _PEAK_TARGET * whole:
            lines.append(f"CHECK FAILED: {family}: sharded peak RSS {what} is lower by {value / whole:.2f}x the "
                         f"transformer, the target is {_PEAK_TARGET}x")
    if ratio > _STEP_TARGET:
        lines.append(f"CHECK FAILED: {family}: sharded step time is {ratio:.2f}x replicated, the target is "
                     f"{_STEP_TARGET}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", nargs="+", choices=tuple(_MODELS), default=list(_MODELS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--frames", type=int, default=49)
    parser.add_argument("--height", type=int, default=384)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    lines = [f"`{command_line(__file__, argv)}`: {os.cpu_count()} CPU(s), load average at the start "
             f"{load_average()}", ""]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="memory-bench-") as tmp:
        for family in args.family:
            block = [*_bench(family, args, Path(tmp)), ""]
            print("\n".join(block), flush=True)  # each family's table as soon as it is measured
            lines += block
    return print_report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
