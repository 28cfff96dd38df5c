"""Time-parallel VAE decode: time, peak memory and time to first MP4 byte at N = 1 and 2 ranks.

    python bench/decode.py [--frames 121] [--height 128] [--width 192] [--repeats 3] [--out FILE.md]

The VAE is diffusers' ``AutoencoderKLLTXVideo()`` with its default (LTX-Video 0.9.0) configuration: the real
architecture and channel widths, random weights drawn from a fixed seed. Each configuration runs in fresh
processes (spawned, gloo, one thread per rank), so peak memory is clean:

- ``decode s``: median wall time of ``decode_parallel`` (the whole video, halo exchange included), max over ranks;
- ``peak MiB/rank``: peak RSS minus RSS before the first decode, max over ranks;
- ``first byte s`` / ``last byte s``: a streamed decode+encode (``FragmentedMP4Writer`` on rank 0, frames
  written as they reach rank 0), from the start of the decode to the first and the last MP4 byte.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rss_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    return float("nan")


def _worker(rank, world, port, args, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import numpy as np
    from diffusers import AutoencoderKLLTXVideo
    from diffusers.video_processor import VideoProcessor

    from cp_infer import ParallelConfig, init_parallel
    from cp_infer.decode import TemporalSplit, decode_parallel
    from cp_infer.stream import FragmentedMP4Writer
    from models.ltx_vae_parallel import DecodeContext, parallelize_ltx_decoder

    state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=600))
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo().eval()
    ctx = DecodeContext(state=state)
    parallelize_ltx_decoder(vae, ctx)
    processor = VideoProcessor(vae_scale_factor=32)
    latent_frames = (args.frames - 1) // 8 + 1
    latents = torch.randn(1, vae.config.latent_channels, latent_frames, args.height // 32, args.width // 32,
                          generator=torch.Generator().manual_seed(1))
    split = TemporalSplit(latent_frames=latent_frames, world=world)
    ctx.split = split

    def decode_range(a, b):
        with torch.no_grad():
            video = vae.decode(latents[:, :, a:b], return_dict=False)[0]
        return (np.clip(processor.postprocess_video(video, output_type="np")[0], 0, 1) * 255).round().astype(np.uint8)

    frame_shape = (args.height, args.width, 3)
    base = _rss_mib("VmRSS")
    times = []
    for _ in range(args.repeats):
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        for _frames in decode_parallel(split, decode_range, frame_shape=frame_shape, state=state):
            pass
        times.append(time.perf_counter() - t0)
    peak = _rss_mib("VmHWM") - base
    # Streamed: bytes leave rank 0 as soon as its frames are encoded.
    marks = []
    writer = FragmentedMP4Writer(lambda b: marks.append(time.perf_counter()), width=args.width, height=args.height,
                                 fps=24) if state.rank == 0 else None
    if world > 1:
        torch.distributed.barrier()
    t0 = time.perf_counter()
    for frames in decode_parallel(split, decode_range, frame_shape=frame_shape, state=state):
        writer.write(frames)
    if writer:
        writer.close()
    first, last = (marks[1] - t0, marks[-1] - t0) if marks else (float("nan"),) * 2  # marks[0] is the header
    queue.put((rank, statistics.median(times), peak, first, last))
    if world > 1:
        torch.distributed.destroy_process_group()


def _run(world, args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return (max(r[1] for r in results), max(r[2] for r in results), results[0][3], results[0][4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=121)
    ap.add_argument("--height", type=int, default=128)
    ap.add_argument("--width", type=int, default=192)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {n: _run(n, args) for n in (1, 2)}
    base_t, base_m = rows[1][0], rows[1][1]
    lines = [
        f"`{' '.join(sys.argv)}` — torch {torch.__version__}, LTX-Video 0.9.0 VAE (real widths, random weights), "
        f"{args.frames} frames at {args.width}x{args.height}, 1 thread per rank, gloo",
        "",
        "| ranks | decode s (median) | vs N=1 | peak MiB/rank | vs N=1 | first byte s | last byte s | first/last |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n, (t, m, first, last) in rows.items():
        lines.append(f"| {n} | {t:.2f} | {t / base_t:.2f}x | {m:.0f} | {m / base_m:.2f}x | {first:.2f} | {last:.2f} "
                     f"| {first / last:.2f} |")
    ratio_t = rows[2][0] / base_t
    lines += ["", f"target decode N=2 <= 0.6x N=1: {'PASS' if ratio_t <= 0.6 else 'FAIL'} ({ratio_t:.2f}x)",
              f"target first byte <= 0.5 of total (N=2): "
              f"{'PASS' if rows[2][2] / rows[2][3] <= 0.5 else 'FAIL'} ({rows[2][2] / rows[2][3]:.2f})"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
