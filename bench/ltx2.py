"""Benchmark: LTX-2 (video + audio), ours (Ulysses engine) against diffusers' own context parallelism, in one run.

Run from the repository root::

    python bench/ltx2.py [--quick] [--steps N] [--rounds N] [--n1-threads N] [--out FILE.md]

A line starting with ``CHECK FAILED`` (and exit status 1) means ours N=2 does not match ours N=1 or the run proves
nothing. NOTE(threads): on a loaded 2-core machine a 2-thread process stalls in OpenMP barriers (steps 2-20x slower,
erratic); ``--n1-threads 1`` then gives a steadier, 1-core N=1 reference.

Model (``bench/_models.py``): diffusers' ``LTX2VideoTransformer3DModel``, 2 layers, 8 heads x 64 (audio 8 x 32),
weights from ``models.common.embedded.init_deterministic``, with the other seven components of ``tiny-ltx2``. RoPE
"interleaved" everywhere: diffusers' plan splits the RoPE tables on dim 1, which for "split" (``[B, H, S, D/2]``) is
the head dim.
Workload: 41 frames at 320x512 = 960 video + 43 audio + 128 text tokens (``--quick``: 25 at 256x384 = 384 + 26),
``LTX2Pipeline``'s default guidance (CFG, STG on the last block, modality isolation, rescale): 3 transformer passes
(batch 2 + 1 + 1) per step. Configurations, each in its own spawned processes (gloo on 127.0.0.1), all loaded at
once, timed rounds interleaved: ours N=1 and diffusers N=1 (1 process x 2 threads, or ``--n1-threads``), ours N=2
and diffusers CP N=2 (2 processes x 1 thread). Ours: ``cp_infer.sampler.sample`` over ``models.ltx2.adapter.LTX2Model``;
diffusers: ``LTX2Pipeline.__call__`` as shipped (every rank runs the whole pipeline, decode included).

diffusers' CP on LTX-2 (``bench/peers/diffusers_cp.py``'s ``DiffusersLTX2Runner``) needs the two CPU/gloo patches
of that module (device count; the per-head text mask narrowed to the local heads, else SDPA cannot broadcast it)
and one plan entry: the shipped ``_cp_plan`` splits the video tokens and the self-attention RoPE (``rope``) but not
the cross-modal one (``cross_attn_rope``), so audio-to-video attention fails ("The size of tensor a (S/N) must match
the size of tensor b (S)"); we add ``cross_attn_rope``, split like ``rope``, on the transformer instance.
Audio is not in the plan: every rank holds the whole audio stream and Ulysses all-to-alls it anyway, so each audio
attention runs over N copies of every audio key (exact, as duplicated keys leave softmax unchanged; N x the work).

Measured: step (3 passes + guidance + scheduler step, slowest rank, median over all timed steps), denoise (the
median round's steps summed), e2e (text encoding to decoded frames and waveform); peak RSS minus RSS after loading,
per rank (max over ranks), after the last step ("denoise") and at the end ("e2e") of the first generation after
loading (``VmHWM`` reset by ``clear_refs``; glibc mmap threshold 1 MiB, as in ``bench/generate.py``); the final
packed latents (video, audio), uint8 frames and waveform against ours N=1.
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
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench._models import (  # noqa: E402 -- path set-up
    FPS,
    LATENT_TOL,
    LTX2_GUIDANCE,
    LTX2_HEAD_DIM,
    LTX2_HEADS,
    LTX2_LAYERS,
    LTX2_NEGATIVE,
    LTX2_PROMPT,
    SEED,
    build_ltx2_components,
)
from bench.harness import (  # noqa: E402
    MALLOC_MEASURE,
    MALLOC_TIMED,
    TIMEOUT_S,
    WARMUP_STEPS,
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

__all__ = ["main"]

_WAVE_TOL = 1e-4  # as tests/models/ltx2/test_parallel.py


@dataclass(frozen=True)
class _Bench:
    frames: int
    height: int
    width: int
    steps: int
    rounds: int

    def tokens(self) -> tuple[int, int]:
        video = ((self.frames - 1) // 8 + 1) * (self.height // 32) * (self.width // 32)
        return video, round(self.frames / FPS * 16_000 / 160 / 4)  # LTX2Pipeline's audio latent rate


def _setups(n1_threads: int) -> tuple[Setup, ...]:
    """ours N=1, ours N=2, diffusers CP N=2, diffusers N=1: N=2 at 1 thread per rank, N=1 at ``n1_threads``."""
    return (Setup("ours", 1, n1_threads), Setup("ours", 2, 1), Setup("diffusers", 2, 1),
            Setup("diffusers", 1, n1_threads))


# Inside a rank process.


def _request(b: _Bench, steps: int):
    """Resolved against LTX-2's declared options (diffusers' runner reads them). One stage, as ``LTX2Pipeline``: the
    benchmark model has no latent upsampler (a folder with one defaults to ``stages=2``)."""
    from cp_infer.request import GenerationRequest, resolve_request
    from models.ltx2.options import ltx2_options

    request = GenerationRequest.of(prompt=LTX2_PROMPT, negative_prompt=LTX2_NEGATIVE, num_frames=b.frames,
                                   height=b.height, width=b.width, num_inference_steps=steps, seed=SEED, fps=FPS,
                                   spatio_temporal_guidance_blocks=(LTX2_LAYERS - 1,), max_sequence_length=128,
                                   stages=1, **LTX2_GUIDANCE)
    return resolve_request(request, ltx2_options(layers=LTX2_LAYERS))


class _Ours:
    def __init__(self, components: dict[str, Any], *, state: Any) -> None:
        from models.ltx2.adapter import LTX2Model

        self.state, self.model = state, LTX2Model(SimpleNamespace(**components), state=state)
        decoder, self.record = self.model.decoder, {}

        def recording_decoder(latents, prepared):  # the full packed latents the sampler hands to the decode
            self.record.update(latents={k: v.numpy().copy() for k, v in latents.items()})
            return decoder(latents, prepared)

        self.model.decoder = recording_decoder

    def __call__(self, request: Any, on_last_step: Any) -> dict[str, Any]:
        from cp_infer.sampler import SampleControl, sample

        self.record = record = {"steps": []}

        def on_step(done: int, total: int, seconds: float) -> None:
            record["steps"].append(seconds)
            if done == total:
                on_last_step()

        control = SampleControl(on_step=on_step, on_audio=lambda w, _sr: record.update(waveform=w))
        record["frames"] = sample(self.model, request, state=self.state, control=control)
        return record


def _worker(rank: int, setup: Setup, b: _Bench, port: int, inbox, outbox) -> None:
    """One rank: load, report, then serve ``"warmup"`` / ``"timed"`` commands until ``None``."""
    try:
        malloc_ok = set_malloc(*MALLOC_MEASURE)
        torch.set_num_threads(setup.threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if setup.ranks > 1:
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=setup.ranks,
                                    timeout=datetime.timedelta(seconds=TIMEOUT_S))
        components = build_ltx2_components()
        weights = list(components["transformer"].parameters())
        if setup.impl == "ours":
            from cp_infer import ParallelConfig, init_parallel  # builds its groups on the default one above

            state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=TIMEOUT_S), rank=rank,
                                  world_size=setup.ranks, local_rank=rank)
            run = _Ours(components, state=state)
        else:
            from bench.peers.diffusers_cp import DiffusersLTX2Runner

            run = DiffusersLTX2Runner(components, ranks=setup.ranks, guidance=LTX2_GUIDANCE)
        barrier()
        rss_loaded = status_kib("VmRSS")
        outbox.put((rank, "ok", dict(checksum=sum(p.double().sum().item() for p in weights), malloc_ok=malloc_ok,
                                     params=sum(p.numel() for p in weights))))
        while (command := inbox.get()) is not None:
            barrier()
            if command == "warmup":
                hwm = []
                reset = reset_peak_rss()
                run(_request(b, WARMUP_STEPS), lambda hwm=hwm: hwm.append(status_kib("VmHWM")))
                reply = dict(peak_reset=reset, act_denoise_mib=(hwm[0] - rss_loaded) / 1024,
                             act_e2e_mib=(status_kib("VmHWM") - rss_loaded) / 1024)
                set_malloc(*MALLOC_TIMED)
            else:
                started = time.perf_counter()
                record = run(_request(b, b.steps), lambda: None)
                reply = dict(e2e_s=time.perf_counter() - started, steps=record["steps"])
                if rank == 0:
                    reply.update({k: record[k] for k in ("latents", "frames", "waveform")})
            outbox.put((rank, "ok", reply))
    except BaseException:  # noqa: BLE001 -- every failure goes back to the main process with its traceback
        outbox.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# The main process.


def _measure(b: _Bench, setups: tuple[Setup, ...]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {s.label: {"rounds": []} for s in setups}
    with contextlib.ExitStack() as stack:
        groups = []
        for setup in setups:
            port = free_port()
            groups.append(RankGroup(setup.label, _worker, [(r, setup, b, port) for r in range(setup.ranks)],
                                    timeout_s=TIMEOUT_S))
            stack.callback(groups[-1].close)
        for g in groups:
            ready, row = g.replies(), rows[g.label]
            row.update(checksums={r["checksum"] for r in ready}, params=ready[0]["params"],
                       malloc_ok=all(r["malloc_ok"] for r in ready))
            warm = g.call("warmup")
            row.update({k: max(r[k] for r in warm) for k in ("act_denoise_mib", "act_e2e_mib")},
                       peak_reset=all(r["peak_reset"] for r in warm))
            progress(f"[ltx2] {g.label}: loaded and warmed up")
        for round_ in range(b.rounds):  # round r starts at configuration r: load falls on every one alike
            for g in rotated(groups, round_):
                row = rows[g.label]
                row.setdefault("load", os.getloadavg()[0])
                timed = g.call("timed")
                row["rounds"].append(dict(e2e_s=max(r["e2e_s"] for r in timed),
                                          steps=slowest_steps(timed)))
                row.update({k: timed[0][k] for k in ("latents", "frames", "waveform")})
                progress(f"[ltx2] {g.label}: round {round_ + 1}/{b.rounds} e2e {row['rounds'][-1]['e2e_s']:.1f} s")
    for row in rows.values():
        rounds = row["rounds"]
        row.update(e2e_s=statistics.median(r["e2e_s"] for r in rounds), denoise_s=sum(median_round(rounds)["steps"]),
                   step_s=statistics.median(s for r in rounds for s in r["steps"]),
                   step_min_s=min(s for r in rounds for s in r["steps"]))
    return rows


def _diff(row: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    n = min(row["waveform"].shape[1], ref["waveform"].shape[1])  # ours pads the soundtrack to the video's length
    return dict(video=float(np.abs(row["latents"]["video"] - ref["latents"]["video"]).max()),
                audio=float(np.abs(row["latents"]["audio"] - ref["latents"]["audio"]).max()),
                frames=int(np.abs(row["frames"].astype(np.int16) - ref["frames"].astype(np.int16)).max()),
                wave=float(np.abs(row["waveform"][:, :n] - ref["waveform"][:, :n]).max()))


_COLUMNS = ("config", "ranks x threads", "load at start", "step median (s)", "step min (s)", "denoise (s)", "e2e (s)",
            "peak - loaded RSS / rank: denoise (MiB)", "e2e (MiB)", "max abs Δ vs ours N=1: video latents",
            "audio latents", "frames (levels)", "waveform")


def _report(b: _Bench, setups: tuple[Setup, ...]) -> list[str]:
    """Measure every configuration; the report (model line, table, ratios, checks) as markdown lines."""
    rows = _measure(b, setups)
    o1, o2, c2, d1 = (rows[s.label] for s in setups)
    video_tokens, audio_tokens = b.tokens()
    lines = [f"LTX-2: `LTX2VideoTransformer3DModel`, {LTX2_LAYERS} layers, {LTX2_HEADS} heads x {LTX2_HEAD_DIM} "
             f"(audio {LTX2_HEADS} x {LTX2_HEAD_DIM // 2}), rope interleaved, {o1['params'] / 1e6:.1f} M params; "
             f"{b.frames} frames at {b.height}x{b.width}: {video_tokens} video + {audio_tokens} audio + 128 text "
             f"tokens; {b.rounds} timed round(s) of {b.steps} steps after one {WARMUP_STEPS}-step warm-up; "
             "LTX2Pipeline's default guidance (3 transformer passes per step).", "", *table_head(_COLUMNS, left=3)]
    for s in setups:
        r = rows[s.label]
        d = r["d"] = _diff(r, o1)
        cells = [s.label, f"{s.ranks} x {s.threads}", f"{r['load']:.1f}", f"{r['step_s']:.3f}",
                 f"{r['step_min_s']:.3f}", f"{r['denoise_s']:.2f}", f"{r['e2e_s']:.2f}", f"{r['act_denoise_mib']:.0f}",
                 f"{r['act_e2e_mib']:.0f}", f"{d['video']:.1e}", f"{d['audio']:.1e}", str(d["frames"]),
                 f"{d['wave']:.1e}"]
        lines.append(table_row(cells))
    lines += ["", "ratios (< 1: the first is faster / smaller):"]
    pairs = (("ours N=2 / ours N=1", o2, o1), ("ours N=2 / diffusers CP N=2", o2, c2),
             ("diffusers CP N=2 / diffusers N=1", c2, d1),
             ("ours N=1 / diffusers N=1 (same maths: a noise check)", o1, d1))
    for label, x, y in pairs:
        q = {k: x[k] / y[k] for k in ("step_s", "step_min_s", "denoise_s", "e2e_s", "act_denoise_mib", "act_e2e_mib")}
        lines.append(f"- {label}: step {q['step_s']:.3f} (min {q['step_min_s']:.3f}), denoise {q['denoise_s']:.3f}, "
                     f"e2e {q['e2e_s']:.3f}; peak act. mem / rank: denoise {q['act_denoise_mib']:.3f}, "
                     f"e2e {q['act_e2e_mib']:.3f}")
    dd = _diff(c2, d1)
    lines += ["", f"diffusers CP N=2 vs its own N=1: max abs Δ video latents {dd['video']:.1e}, audio latents "
              f"{dd['audio']:.1e}, frames {dd['frames']} levels, waveform {dd['wave']:.1e}."]
    checksums = set().union(*(r["checksums"] for r in rows.values()))
    if len(checksums) != 1:
        lines.append(f"CHECK FAILED: transformer weights differ between processes: {sorted(checksums)}")
    d = o2["d"]
    if d["video"] > LATENT_TOL or d["audio"] > LATENT_TOL or d["frames"] > 1 or d["wave"] > _WAVE_TOL:
        lines.append(f"CHECK FAILED: ours N=2 differs from ours N=1 beyond latents {LATENT_TOL}, frames 1 level, "
                     f"waveform {_WAVE_TOL}: {d}")
    if float(o1["latents"]["video"].std()) < 0.1 or float(o1["frames"].std()) < 5:
        lines.append("CHECK FAILED: degenerate reference output: the comparisons would prove nothing")
    lines.append(f"weights identical in every process: {len(checksums) == 1}; peak reset by clear_refs: "
                 f"{all(r['peak_reset'] for r in rows.values())}; malloc thresholds set: "
                 f"{all(r['malloc_ok'] for r in rows.values())}.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="25 frames at 256x384, 1 round of 2 steps")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps per timed generation (default 4)")
    parser.add_argument("--rounds", type=int, default=None, help="timed generations per configuration (default 3)")
    parser.add_argument("--n1-threads", type=int, default=None, help="intra-op threads of the N=1 runs (default 2)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report to this markdown file")
    args = parser.parse_args(argv)
    if (args.steps is not None and args.steps < 2) or (args.rounds is not None and args.rounds < 1):
        raise ValueError(f"steps={args.steps} must be >= 2 and rounds={args.rounds} >= 1")
    b = _Bench(frames=25 if args.quick else 41, height=256 if args.quick else 320, width=384 if args.quick else 512,
               steps=args.steps or (2 if args.quick else 4), rounds=args.rounds or (1 if args.quick else 3))
    setups = _setups(args.n1_threads or 2)
    started = time.perf_counter()
    lines = [f"command: `{command_line(__file__, argv)}`", "", environment(setups), "", *_report(b, setups),
             f"wall time {time.perf_counter() - started:.0f} s; load average at the end (1/5/15 min): "
             f"{load_average()}."]
    return print_report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
