"""Benchmark: end-to-end LTX-Video generation, ours (Ulysses engine) against diffusers' own context parallelism.

Run from the repository root::

    python bench/generate.py [--quick] [--out FILE.md] [--rounds N] [--steps N] [--layers N] [--heads N]
                             [--family all|ltx-video|ltx2] [--only t2v|i2v]

After the text-to-video tables below comes the image-to-video table (``bench/_conditioning.py``, ``--only i2v``
alone: text-to-video, an image at frame 0 and an image at the last frame, ours N=2 against diffusers'
``LTXConditionPipeline`` under its own context parallelism), then LTX-2 (``bench/_ltx2.py``).

Every number comes from the same run and is printed as one markdown table, with the command line and the
environment above it and one PASS/FAIL line per target below it.

Models: diffusers' real ``LTXVideoTransformer3DModel`` at two benchmark sizes, random weights from torch's own init
under a fixed seed, so every process builds the same weights (a float64 checksum of the parameters is compared
across the processes of a workload). Text encoder, tokenizer, VAE and scheduler are the embedded default model's
(``models.default.build_default_components``): a tiny T5 and a tiny VAE with LTX-Video's real compression (8x time,
32x space). The transformer does the denoising work.

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
- compute-bound (the long video): 121 frames at 512x512 -> 16 x 16 x 16 = 4096 latent tokens, wide model.

Configurations, each in its own fresh processes (``torch.multiprocessing`` spawn, gloo on 127.0.0.1, free port):

- ours N=1: ``cp_infer.sampler.sample`` over ``models.ltx_video.LTXVideoModel``, 1 process x 2 intra-op threads;
- ours N=2: the same on 2 ranks (``init_parallel``), 1 thread per rank;
- diffusers CP N=2: diffusers' own ``LTXPipeline.__call__`` on 2 ranks x 1 thread after
  ``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))``. Two patches make it run on
  CPU/gloo, both explained in ``bench/_diffusers_cp.py``: (1) ``torch.accelerator.device_count`` returns 1
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
  configuration against ours N=1. Ours N=2 must match (``_LATENT_TOL``, 1 frame level) or the run exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench._procs import RankGroup, free_port, reset_peak_rss, set_malloc, status_kib  # noqa: E402 -- path set-up

__all__ = ["BenchConfig", "ModelSize", "Setup", "Workload", "main"]

_SEED = 1234
_PROMPT = "a red fox runs through fresh snow at dawn, cinematic tracking shot"
_NEGATIVE = "blurry, low quality"
_GUIDANCE = 3.0
_FPS = 24
_TIMEOUT_S = 900.0
_WARMUP_STEPS = 2
"""NOTE(warm-up-steps): 2, not 1: with ``shift_terminal`` set (the default model's scheduler, as LTX-Video
0.9.x), a 1-step schedule divides by zero and the scheduler then raises IndexError."""
_LATENT_TOL = 1e-3
"""fp32 throughout. N ranks run the same maths as 1 rank, but matmuls over fewer rows with another thread count
and SDPA over another head grouping may sum in another order (~1e-6 relative per op); over a few steps of a
random transformer that stays far below 1e-3 absolute on latents of unit scale."""
_MALLOC_MEASURE = (1 << 20, 1 << 20)
_MALLOC_TIMED = (32 << 20, 64 << 20)


@dataclass(frozen=True)
class ModelSize:
    """The benchmark transformer's shape."""

    layers: int
    heads: int
    head_dim: int = 64
    channels: int = 16
    """Latent channels: must match the default model's VAE."""

    def __post_init__(self) -> None:
        if self.layers < 1 or self.heads < 2 or self.heads % 2:
            raise ValueError(f"layers={self.layers} must be >= 1 and heads={self.heads} even (Ulysses over 2 ranks)")

    def describe(self, params: int) -> str:
        return (f"`LTXVideoTransformer3DModel`, {self.layers} layers, {self.heads} heads x {self.head_dim} dim "
                f"(inner {self.heads * self.head_dim}), {self.channels} latent channels, {params / 1e6:.1f} M params")


@dataclass(frozen=True)
class Workload:
    name: str
    frames: int
    height: int
    width: int
    model: ModelSize
    target: bool = True
    """Whether the issue's targets are read off this workload (``False``: reported for context only)."""

    def tokens(self) -> int:
        from cp_infer import VideoGeometry

        return VideoGeometry().latent_shape(self.frames, self.height, self.width).tokens


@dataclass(frozen=True)
class Setup:
    """One configuration: whose code, how many ranks, how many intra-op threads per rank."""

    impl: str
    """``"ours"`` or ``"diffusers"``."""
    ranks: int
    threads: int

    @property
    def label(self) -> str:
        return f"{self.impl}{' CP' if self.impl == 'diffusers' and self.ranks > 1 else ''} N={self.ranks}"


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


def _workloads(wide: ModelSize, narrow: ModelSize) -> tuple[Workload, ...]:
    """comm-bound (narrow model), short sequence on the wide model (context, no target), compute-bound (wide)."""
    return (Workload(COMM, frames=25, height=256, width=512, model=narrow),
            Workload(SHORT_WIDE, frames=25, height=256, width=512, model=wide, target=False),
            Workload(COMPUTE, frames=121, height=512, width=512, model=wide))


COMM, SHORT_WIDE, COMPUTE = "comm-bound", "short, wide model", "compute-bound"
OURS_1, OURS_2 = Setup("ours", 1, 2), Setup("ours", 2, 1)
DIFF_2, DIFF_1 = Setup("diffusers", 2, 1), Setup("diffusers", 1, 2)


# ---------------------------------------------------------------------------------------------------------
# Inside a rank process.
# ---------------------------------------------------------------------------------------------------------


def _build_components(size: ModelSize) -> dict[str, Any]:
    from diffusers import LTXVideoTransformer3DModel

    from models.default import build_default_components

    components = build_default_components()
    inner = size.heads * size.head_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        transformer = LTXVideoTransformer3DModel(
            in_channels=size.channels, out_channels=size.channels, patch_size=1, patch_size_t=1,
            num_attention_heads=size.heads, attention_head_dim=size.head_dim, cross_attention_dim=inner,
            num_layers=size.layers, caption_channels=components["text_encoder"].config.d_model,
        )
    components["transformer"] = transformer.eval()
    return components


def _request(workload: Workload, steps: int, **values: Any):
    """The workload's request, resolved against LTX-Video's declared options (diffusers' runner reads them all)."""
    from cp_infer.request import GenerationRequest, resolve_request
    from models.ltx_video_options import ltx_video_options

    request = GenerationRequest.of(prompt=_PROMPT, negative_prompt=_NEGATIVE, num_frames=workload.frames,
                                   height=workload.height, width=workload.width, num_inference_steps=steps,
                                   guidance_scale=_GUIDANCE, seed=_SEED, fps=_FPS, max_sequence_length=128, **values)
    return resolve_request(request, ltx_video_options())


class _Recording:
    """Our model adapter, unchanged, except that it keeps the full latents the sampler hands to the decode."""

    def __init__(self, model: Any) -> None:
        self._model, self.latents = model, None

    def __getattr__(self, name: str) -> Any:  # geometry, prepare, predict, step: the adapter's own
        return getattr(self._model, name)

    def decoder(self, latents, prepared):
        self.latents = latents["video"].clone()
        return self._model.decoder(latents, prepared)


class _OursRunner:
    def __init__(self, components: dict[str, Any], *, state: Any) -> None:
        from models.ltx_video import LTXVideoModel

        self.state = state
        self.model = _Recording(LTXVideoModel(SimpleNamespace(**components), state=state))

    def __call__(self, request: Any, on_last_step: Any) -> dict[str, Any]:
        from cp_infer.sampler import SampleControl, sample

        record: dict[str, Any] = {"steps": []}
        called = time.perf_counter()

        def on_step(done: int, total: int, seconds: float) -> None:
            if done == 1:  # from the call to the first step's start: checks, prepare (text and media encode), shard
                record["before_first_step_s"] = time.perf_counter() - seconds - called
            record["steps"].append(seconds)
            if done == total:
                on_last_step()

        self.model.latents = None
        record["frames"] = sample(self.model, request, state=self.state, control=SampleControl(on_step=on_step))
        record["latents"] = None if self.model.latents is None else self.model.latents.numpy()
        return record


class _CollectiveClock:
    """Counts the tensor collectives a rank issues and the wall time spent inside them.

    Wraps ``torch.distributed``'s and the functional collectives' all-to-all and all-gather (looked up by attribute
    at every call by both our engine and diffusers). Ours are synchronous on gloo, so their time is the exchange's
    (transfer plus waiting for the peer); diffusers' functional collectives return at once and are waited for
    later, so for them only the count means something.
    """

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0

    @classmethod
    def install(cls) -> _CollectiveClock:
        import torch.distributed._functional_collectives as funcol

        clock = cls()
        for module, name in ((dist, "all_to_all_single"), (dist, "all_gather_into_tensor"),
                             (funcol, "all_to_all_single"), (funcol, "all_gather_tensor")):
            setattr(module, name, clock._wrap(getattr(module, name)))
        return clock

    def reading(self) -> tuple[int, float]:
        return self.calls, self.seconds

    def _wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - started

        return timed


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _peaks(run: Any, workload: Workload, base_kib: int) -> tuple[bool, float, float]:
    """One 2-step generation: (peak reset worked, peak - base after the last step, peak - base at the end) in MiB."""
    hwm: dict[str, int] = {}
    reset = reset_peak_rss()
    run(_request(workload, _WARMUP_STEPS), lambda: hwm.setdefault("denoise", status_kib("VmHWM")))
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
        malloc_ok = set_malloc(*_MALLOC_MEASURE)
        torch.set_num_threads(setup.threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        state = None
        if setup.impl == "ours":
            from cp_infer import ParallelConfig, init_parallel

            state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=_TIMEOUT_S),
                                  rank=rank, world_size=setup.ranks, local_rank=rank)
        elif setup.ranks > 1:
            import datetime

            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=setup.ranks,
                                    timeout=datetime.timedelta(seconds=_TIMEOUT_S))
        started = time.perf_counter()
        components = _build_components(workload.model)
        clock = _CollectiveClock.install()
        weights = list(components["transformer"].parameters())
        if state is not None:
            run = _OursRunner(components, state=state)
        else:
            from bench._diffusers_cp import DiffusersRunner

            run = DiffusersRunner(components, ranks=setup.ranks)
        _barrier()
        rss_loaded = status_kib("VmRSS")
        outbox.put((rank, "ok", dict(load_s=time.perf_counter() - started, malloc_ok=malloc_ok,
                                     checksum=sum(p.double().sum().item() for p in weights),
                                     params=sum(p.numel() for p in weights), rss_loaded_mib=rss_loaded / 1024)))
        while (command := inbox.get()) is not None:
            kind, _round = command
            _barrier()
            if kind == "warmup":
                reply = _warmup(run, workload, rss_loaded)
                set_malloc(*_MALLOC_TIMED)
            else:
                started, at_start, at_last_step = time.perf_counter(), clock.reading(), []
                record = run(_request(workload, config.steps), lambda mark=at_last_step.append: mark(clock.reading()))
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
                              timeout_s=_TIMEOUT_S)
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
            _progress(f"[{workload.name}] {group.label}: loaded in {row['load_s']:.0f} s, warm-up "
                      f"{time.perf_counter() - started:.0f} s")
        n = len(groups)
        for round_ in range(config.rounds):
            for group in groups[round_ % n:] + groups[: round_ % n]:
                row = rows[group.label]
                row.setdefault("load", os.getloadavg()[0])
                timed = group.call(("timed", round_))
                steps = [max(r["steps"][i] for r in timed) for i in range(config.steps)]
                row["rounds"].append(dict(e2e_s=max(r["e2e_s"] for r in timed), steps=steps,
                                          collectives=timed[0]["collectives"],
                                          exchange_s=max(r["exchange_s"] for r in timed)))
                row.update(latents=timed[0]["latents"], frames=timed[0]["frames"])
                _progress(f"[{workload.name}] {group.label}: round {round_ + 1}/{config.rounds} "
                          f"e2e {row['rounds'][-1]['e2e_s']:.1f} s (load {os.getloadavg()[0]:.1f})")
    for row in rows.values():
        rounds = sorted(row["rounds"], key=lambda r: r["e2e_s"])
        median_round = rounds[(len(rounds) - 1) // 2]
        row.update(e2e_s=statistics.median(r["e2e_s"] for r in rounds), denoise_s=sum(median_round["steps"]),
                   step_s=statistics.median(s for r in rounds for s in r["steps"]),
                   collectives=median_round["collectives"],
                   exchange_s=statistics.median(r["exchange_s"] for r in rounds))
    return rows


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "|".join("---" if i < 6 else "---:"
                                                                for i in range(len(_COLUMNS))) + "|"]
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
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _ratios(config: BenchConfig, rows: dict[tuple[str, str], dict[str, Any]]) -> tuple[list[str], int, int]:
    lines: list[str] = []
    met: list[bool] = []

    def add(label: str, value: float, target: float | None = None, counted: bool = True) -> None:
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
        add("peak act. mem / rank, denoise, steady, ours N=2 / ours N=1", o2["act_steady_mib"] / o1["act_steady_mib"])
        add("peak act. mem / rank, e2e with decode, 1st gen, ours N=2 / ours N=1",
            o2["act_e2e_mib"] / o1["act_e2e_mib"])
        if DIFF_1.label in r:
            add("step ours N=1 / diffusers N=1 (same modules; a noise check)", o1["step_s"] / r[DIFF_1.label]["step_s"])
    c = {s.label: rows[(COMPUTE, s.label)] for s in config.setups}
    o1, o2, d2 = c[OURS_1.label], c[OURS_2.label], c[DIFF_2.label]
    comm = rows[(COMM, OURS_2.label)]["e2e_s"] / rows[(COMM, DIFF_2.label)]["e2e_s"]
    lines.append("targets:")
    add("comm-bound: e2e ours N=2 / diffusers CP N=2", comm, 0.8)
    add("compute-bound: e2e ours N=2 / diffusers CP N=2", o2["e2e_s"] / d2["e2e_s"], 1.0)
    add("compute-bound: step ours N=2 / diffusers CP N=2", o2["step_s"] / d2["step_s"], 1.0)
    add("compute-bound: e2e ours N=2 (1 thread/rank) / ours N=1 (2 threads)", o2["e2e_s"] / o1["e2e_s"], 0.97)
    add("compute-bound: step ours N=2 (1 thread/rank) / ours N=1 (2 threads)", o2["step_s"] / o1["step_s"], 0.97)
    add("long video (compute-bound): peak act. mem / rank, denoise, 1st generation after loading, ours N=2 / ours N=1",
        o2["act_denoise_mib"] / o1["act_denoise_mib"], 0.6)
    add("(not counted: steady state, which leaves out buffers kept from the 1st generation) the same ratio",
        o2["act_steady_mib"] / o1["act_steady_mib"], 0.6, counted=False)
    return lines, sum(met), len(met)


def _code_version() -> str:
    """The commit of the engine and model code measured, and whether it had local changes."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cp_infer", "models"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "code version unknown (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"cp_infer/ and models/ at commit {commit}" + (f" plus local changes in {', '.join(changed)}" if changed
                                                           else " (no local changes)")


def _environment(config: BenchConfig) -> str:
    import diffusers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    threads = "; ".join(f"{s.label}: {s.ranks} x {s.threads}" for s in config.setups)
    return (f"python {platform.python_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}; "
            f"{os.cpu_count()} CPU cores ({cpu}); gloo on 127.0.0.1; fp32; ranks x intra-op threads: {threads}; "
            f"load average at the start (1/5/15 min): {load}; {_code_version()}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a ~2-minute smoke version: 1 layer x 8 heads, 1 round of 2 steps, no diffusers N=1")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed generations per configuration (default 3; image-to-video 5; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per generation (default 3, --quick 2)")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default 2, --quick 1)")
    parser.add_argument("--heads", type=int, default=None, help="attention heads of 64 dims (default 16, --quick 8)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    parser.add_argument("--family", choices=("all", "ltx-video", "ltx2"), default="all",
                        help="LTX-Video (the tables above), LTX-2 (bench/_ltx2.py: audio and video), or both")
    parser.add_argument("--only", choices=("t2v", "i2v"), default=None,
                        help="only LTX-Video's text-to-video tables, or only its image-to-video one "
                             "(bench/_conditioning.py); default: all that --family selects")
    args = parser.parse_args(argv)
    if args.family == "ltx2":
        if args.only is not None:
            parser.error("--only selects LTX-Video tables; drop it with --family ltx2")
        return _ltx2_main(args)
    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv])
    if args.only == "i2v":
        return _print_report([f"command: `{command}`", "", *_conditioning_lines(args)], args.out)
    wide = ModelSize(layers=args.layers or (1 if args.quick else 2), heads=args.heads or (8 if args.quick else 16))
    narrow = ModelSize(layers=4 if args.quick else 8, heads=2)
    config = BenchConfig(
        workloads=_workloads(wide, narrow),
        setups=(OURS_1, OURS_2, DIFF_2) if args.quick else (OURS_1, OURS_2, DIFF_2, DIFF_1),
        steps=args.steps or (2 if args.quick else 3), rounds=args.rounds or (1 if args.quick else 3),
    )
    env = _environment(config)
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
        if ours2["d_latents"] > _LATENT_TOL or ours2["d_frames"] > 1:
            failures.append(f"{w.name}: ours N=2 differs from ours N=1 (latents {ours2['d_latents']:.1e} vs "
                            f"tolerance {_LATENT_TOL}, frames {ours2['d_frames']} levels vs 1)")
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
    models = {w.model: rows[(w.name, OURS_1.label)]["params"] for w in config.workloads}
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        f"command: `{command}`", "", env, "",
        f"models: {'; '.join(m.describe(params) for m, params in models.items())}; text: tiny T5, 128 tokens; "
        f"VAE: tiny, 8x time / 32x space; "
        f"{config.rounds} timed round(s) of {config.steps} denoising steps per configuration, after two "
        f"{_WARMUP_STEPS}-step warm-ups; CFG on (guidance {_GUIDANCE}), same seed and weights everywhere.", "",
        *_table(config, rows), "", *ratio_lines, "", f"{met}/{total} targets met.", "",
        f"wall time {time.perf_counter() - started:.0f} s; load average at the end (1/5/15 min): {load}; peak reset "
        f"by clear_refs: {all(r['peak_reset'] for r in rows.values())}; malloc thresholds set: "
        f"{all(r['malloc_ok'] for r in rows.values())}; weights identical in every process of a workload: "
        f"{same_weights}; "
        f"ours N=2 matches ours N=1 (latents within {_LATENT_TOL}, frames within 1 level): {not failures}.",
        *(f"CHECK FAILED: {failure}" for failure in failures),
    ]
    if args.only is None:
        i2v_lines = _conditioning_lines(args)
        lines += ["", "LTX-Video, image-to-video:", "", *i2v_lines]
        failures += [line for line in i2v_lines if line.startswith("CHECK FAILED")]
    if args.family == "all" and args.only is None:
        ltx2_lines = _ltx2_lines(args)
        lines += ["", "LTX-2 (audio + video):", "", *ltx2_lines]
        failures += [line for line in ltx2_lines if line.startswith("CHECK FAILED")]
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out is not None:
        args.out.write_text(report)
    return 1 if failures else 0


def _ltx2_lines(args: argparse.Namespace) -> list[str]:
    # Imported here: bench/_ltx2.py is a sibling script, loaded by path so this works from any directory.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _ltx2

    return _ltx2.run(argparse.Namespace(quick=args.quick, steps=None, rounds=None, n1_threads=None))


def _conditioning_lines(args: argparse.Namespace) -> list[str]:
    from bench import _conditioning  # imported here: it imports this module

    return _conditioning.run(args)


def _ltx2_main(args: argparse.Namespace) -> int:
    return _print_report(_ltx2_lines(args), args.out)


def _print_report(lines: list[str], out: Path | None) -> int:
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if out is not None:
        out.write_text(report)
    return 1 if any(line.startswith("CHECK FAILED") for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
