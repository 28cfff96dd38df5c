"""Streamed, time-parallel VAE decode: time, peak memory and time to first MP4 byte, N = 1 and 2 ranks, one run.

    python bench/decode.py [--vae ltx-video|wan2.1|wan2.2] [--frames 257] [--height 96] [--width 128]
                           [--frames-per-rank K] [--repeats 2] [--glibc-heap] [--out FILE.md]

The VAE (``--vae``) is diffusers' ``AutoencoderKLLTXVideo()`` with its default (LTX-Video 0.9.0) configuration, or
``AutoencoderKLWan`` with Wan 2.1's (its default) or Wan 2.2 TI2V-5B's configuration: the real architecture and
channel widths, random weights drawn from a fixed seed. Each row has its own processes (spawned, gloo, one thread
per rank), so peak memory is per row; all rows load first, then their timed repeats interleave (repeat ``r`` starts
at row ``r``; idle processes wait on a queue), so that a change in the machine's speed during the run falls on every
row alike. Rows: ``N=1 whole`` is diffusers' own ``vae.decode`` of the whole video (the reference for memory; for
Wan, its own frame-at-a-time loop, the reference for time too); ``N=1`` and ``N=2`` decode in pieces of about
``--frames-per-rank`` latent frames, cut to equal work (``cp_infer.decode``), as the server does; ``2 x N=1 at
once`` is two independent one-rank decodes started together, which measures how much two busy processes slow each
other on this machine (shared cores, caches, memory bandwidth): the bound on what any two-rank decode can reach
here.

- ``decode s``: median over the repeats of the wall time of ``decode_parallel`` over the whole video (relayed frames
  included), max over ranks;
- ``cpu s/rank``: the same decode's CPU time (this process, all threads), max over ranks: on a shared machine
  where the ranks do not get a core each, it still shows how the work splits;
- ``peak MiB/rank``: peak RSS minus RSS before the first decode, over the timed repeats, max over ranks.
  NOTE(malloc): glibc's dynamic mmap threshold makes freed activations stay in the heap, fragmented, so with its
  defaults the peak RSS grows with the number of rounds until it plateaus; the workers run with
  ``MALLOC_MMAP_THRESHOLD_=1048576`` (large blocks mapped and returned on free) so the peak is the decode's.
  ``--glibc-heap`` keeps glibc's defaults;
- ``first byte s`` / ``last byte s``: a streamed decode+encode (``FragmentedMP4Writer`` on rank 0, frames written
  as they reach rank 0), from the start of the decode to the first and the last MP4 byte after the header.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script from anywhere

from bench.harness import MALLOC_MEASURE, RankGroup, command_line, free_port, print_report, rotated, status_kib  # noqa: E402
from cp_infer.decode import DEFAULT_FRAMES_PER_RANK, resolve_frames_per_rank  # noqa: E402

TWO_AT_ONCE = "2 x N=1 at once"
VAE_NAMES = {"ltx-video": "LTX-Video 0.9.0", "wan2.1": "Wan 2.1", "wan2.2": "Wan 2.2 TI2V-5B"}


def _rss_mib(field: str) -> float:
    return status_kib(field) / 1024


def _worker(index, rank, world, port, args, frames_per_rank, inbox, outbox):
    """Process ``index`` of its row (``bench.harness.RankGroup``'s protocol): rank ``rank`` of a ``world``-rank
    decode."""
    try:
        _serve(index, rank, world, port, args, frames_per_rank, inbox, outbox)
    except BaseException:
        outbox.put((index, "error", traceback.format_exc()))
        raise


def _serve(index, rank, world, port, args, frames_per_rank, inbox, outbox):
    """Load, report ready, then run ``"timed"`` and ``"stream"`` commands until ``None``."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import numpy as np
    from diffusers.video_processor import VideoProcessor

    from cp_infer import ParallelConfig, init_parallel
    from cp_infer.decode import decode_parallel
    from cp_infer.stream import FragmentedMP4Writer

    state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=600))
    split, decode = (_wan_decoder if args.vae.startswith("wan") else _ltx_decoder)(state, world, frames_per_rank, args)
    processor = VideoProcessor(vae_scale_factor=8)  # post-processing only: the scale factor plays no part

    def decode_range(a, b):
        video = decode(a, b)
        return (np.clip(processor.postprocess_video(video, output_type="np")[0], 0, 1) * 255).round().astype(np.uint8)

    def barrier():
        if world > 1:
            torch.distributed.barrier()

    frame_shape = (args.height, args.width, 3)
    base = _rss_mib("VmRSS")
    outbox.put((index, "ok", "ready"))
    while (command := inbox.get()) is not None:
        barrier()
        decode.restart()
        if command == "timed":
            t0, c0 = time.perf_counter(), time.process_time()
            for _frames in decode_parallel(split, decode_range, frame_shape=frame_shape, state=state):
                pass
            outbox.put((index, "ok", (time.perf_counter() - t0, time.process_time() - c0, _rss_mib("VmHWM") - base)))
            continue
        # Streamed: bytes leave rank 0 as soon as each round's frames are encoded.
        marks = []
        writer = FragmentedMP4Writer(lambda b, mark=marks.append: mark(time.perf_counter()), width=args.width,
                                     height=args.height, fps=24) if state.rank == 0 else None
        barrier()
        t0 = time.perf_counter()
        for frames in decode_parallel(split, decode_range, frame_shape=frame_shape, state=state):
            writer.write(frames)
        if writer:
            writer.close()
        first, last = (marks[1] - t0, marks[-1] - t0) if marks else (float("nan"),) * 2  # marks[0] is the header
        outbox.put((index, "ok", (first, last, split.rounds)))
    if world > 1:
        torch.distributed.destroy_process_group()


class _Restartable:
    """``decode(a, b)`` of one video, started afresh by :meth:`restart` (the Wan decode runs its rounds once)."""

    def __init__(self, make):
        self.make, self.decode = make, None

    def restart(self):
        self.decode = self.make()

    @torch.no_grad()
    def __call__(self, a, b):
        return self.decode(a, b)


def _ltx_decoder(state, world, frames_per_rank, args):
    from diffusers import AutoencoderKLLTXVideo

    from cp_infer.decode import TemporalSplit
    from models.common.ltx_vae_parallel import DecodeContext, decode_cost, decode_round, parallelize_ltx_decoder

    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo().eval()
    ctx = DecodeContext(state=state)
    parallelize_ltx_decoder(vae, ctx)
    latent_frames = (args.frames - 1) // 8 + 1
    latents = torch.randn(1, vae.config.latent_channels, latent_frames, args.height // 32, args.width // 32,
                          generator=torch.Generator().manual_seed(1))
    split = TemporalSplit(latent_frames=latent_frames, world=world, frames_per_rank=frames_per_rank,
                          cost=decode_cost(vae, latent_frames))  # as the models cut it
    ctx.split = split
    return split, _Restartable(lambda: lambda a, b: decode_round(vae, ctx, latents, a, b))


def _wan_decoder(state, world, frames_per_rank, args):
    from diffusers import AutoencoderKLWan

    from cp_infer.decode import TemporalSplit
    from models.common.wan_vae_parallel import WanStreamedDecode, decode_cost

    torch.manual_seed(0)
    vae = AutoencoderKLWan(**WAN_VAES[args.vae]).eval()
    spatial = vae.config.scale_factor_spatial
    latent_frames = (args.frames - 1) // 4 + 1
    latents = torch.randn(1, vae.config.z_dim, latent_frames, args.height // spatial, args.width // spatial,
                          generator=torch.Generator().manual_seed(1))
    split = TemporalSplit(latent_frames=latent_frames, world=world, temporal_compression=4,
                          frames_per_rank=frames_per_rank, cost=decode_cost(vae, latent_frames))  # as WanModel cuts it
    if split.pieces == 1 and world == 1:  # one rank, one round (N=1 whole): diffusers' own decode
        return split, _Restartable(lambda: lambda a, b: vae.decode(latents, return_dict=False)[0])
    with torch.no_grad():
        x = vae.post_quant_conv(latents)
    return split, _Restartable(lambda: WanStreamedDecode(vae, x, split, state))


WAN_VAES = {
    "wan2.1": {},  # AutoencoderKLWan's defaults are Wan 2.1's VAE
    "wan2.2": dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                   patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4),
}
TEMPORAL = {"ltx-video": 8, "wan2.1": 4, "wan2.2": 4}


def _row(name, world, frames_per_rank, args, copies):
    """The processes of one row: ``world`` ranks decoding together, or (``copies`` > 1) that many one-rank decodes
    run at once."""
    ranks = [(r, world, port) for port in (free_port() for _ in range(copies)) for r in range(world)]
    return RankGroup(name, _worker, [(i, r, n, port, args, frames_per_rank) for i, (r, n, port) in enumerate(ranks)],
                     timeout_s=3600)


def _run(rows, args):
    """Every row's processes loaded side by side (idle ones wait on a queue); the timed repeats interleaved, round
    ``r`` starting at row ``r``, so that a change in the machine's speed falls on every row alike."""
    groups = {name: _row(name, world, frames_per_rank, args, copies)
              for name, (world, frames_per_rank, copies) in rows.items()}
    try:
        for group in groups.values():
            group.replies()  # ready
        timed = {name: [] for name in rows}
        names = list(rows)
        for r in range(args.repeats):
            for name in rotated(names, r):
                replies = groups[name].call("timed")
                timed[name].append((max(t for t, _, _ in replies), max(c for _, c, _ in replies),
                                    max(m for _, _, m in replies)))
        out = {}
        for name, group in groups.items():
            # Streamed once per row of ranks that decode together (not for the copies run side by side).
            first, last, rounds = group.call("stream")[0] if rows[name][2] == 1 else (None, None, None)
            runs = timed[name]
            out[name] = (statistics.median(t for t, _, _ in runs), max(m for _, _, m in runs), first, last, rounds,
                         statistics.median(c for _, c, _ in runs))
        return out
    finally:
        for group in groups.values():
            group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vae", choices=sorted(TEMPORAL), default="ltx-video")
    ap.add_argument("--frames", type=int, default=257)
    ap.add_argument("--height", type=int, default=96)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--frames-per-rank", type=int, default=None,
                    help="latent frames per rank per round (default: the server's automatic size for the frame size)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--glibc-heap", action="store_true", help="keep glibc's default malloc (see NOTE(malloc))")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.frames_per_rank is None:
        args.frames_per_rank = resolve_frames_per_rank(DEFAULT_FRAMES_PER_RANK, height=args.height, width=args.width,
                                                       temporal_compression=TEMPORAL[args.vae])
    if not args.glibc_heap:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MALLOC_MEASURE[0])  # read by glibc in each spawned worker at start
    load = os.getloadavg()
    rows = _run({"N=1 whole": (1, None, 1), "N=1": (1, args.frames_per_rank, 1), "N=2": (2, args.frames_per_rank, 1),
                 TWO_AT_ONCE: (1, args.frames_per_rank, 2)}, args)
    base_t, base_m = rows["N=1"][0], rows["N=1 whole"][1]
    lines = [
        f"`{command_line(__file__)}` — torch {torch.__version__}, {VAE_NAMES[args.vae]} VAE (real widths, random "
        "weights), "
        f"{args.frames} frames at {args.width}x{args.height}, rounds of {args.frames_per_rank} latent frames per "
        f"rank, 1 thread per rank, gloo, {'glibc default heap' if args.glibc_heap else 'MALLOC_MMAP_THRESHOLD_=1MiB'}; "
        f"load average at start {load[0]:.2f} on {os.cpu_count()} cores",
        "",
        "| decode | rounds | decode s (median) | vs N=1 | cpu s/rank | vs N=1 | peak MiB/rank | vs whole "
        "| first byte s | last byte s | first/last |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    base_c = rows["N=1"][5]
    for name, (t, m, first, last, rounds, c) in rows.items():
        stream = "| - | - | - |" if first is None else f"| {first:.2f} | {last:.2f} | {first / last:.2f} |"
        lines.append(f"| {name} | {rounds or '-'} | {t:.2f} | {t / base_t:.2f}x | {c:.2f} | {c / base_c:.2f}x "
                     f"| {m:.0f} | {m / base_m:.2f}x {stream}")
    ratio_t = rows["N=2"][0] / base_t
    ratio_b = rows["N=2"][2] / rows["N=2"][3]
    slowdown = rows[TWO_AT_ONCE][0] / base_t
    lines += ["", f"target decode N=2 <= 0.6x N=1: {'PASS' if ratio_t <= 0.6 else 'FAIL'} ({ratio_t:.2f}x)",
              f"target first byte <= 0.5 of total (N=2): {'PASS' if ratio_b <= 0.5 else 'FAIL'} ({ratio_b:.2f})",
              f"machine: two one-rank decodes at once each take {slowdown:.2f}x the time of one alone, so two ranks "
              f"sharing this machine's cores cannot decode in less than {slowdown / 2:.2f}x of N=1 (N=2 reaches "
              f"{ratio_t:.2f}x: {slowdown / 2 / ratio_t:.0%} of that bound)",
              f"load average at end: {os.getloadavg()[0]:.2f}"]
    if args.vae.startswith("wan"):
        whole = rows["N=2"][0] / rows["N=1 whole"][0]
        lines.insert(-1, f"never slower than one rank: N=2 takes {whole:.2f}x of diffusers' vae.decode (N=1 whole): "
                         f"{'PASS' if whole <= 1 else 'FAIL'}")
    print_report(lines, args.out)


if __name__ == "__main__":
    main()
