"""Front-end overhead: the same generation through HTTP and through ``cp-infer generate``, in one run.

    python bench/server.py [--nproc 2] [--frames 97] [--size 384x256] [--steps 8] [--repeats 3] [--clients 4]

- ``http s``: client-side time from ``POST /v1/videos`` to the last byte of ``GET .../content`` (waiting on
  the job's server-sent events), for one request at a time on an idle server, median of ``--repeats``.
- ``cli s``: what ``cp-infer generate`` reports as ``generate`` + ``write`` for the same request (the model
  load and the group start-up are excluded on both sides: a server pays them once), median of ``--repeats``.
- overhead = http / cli - 1 (target < 3%).
- requests per minute: ``--clients`` threads each submit one request at once and wait for it; jobs queue FIFO.
Both sides use the embedded default model, the same request, seed and rank count.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402 -- path set-up
    REPO,
    ServeProcess,
    command_line,
    job_end,
    print_report,
    subprocess_env,
    table_head,
    table_row,
)

__all__ = ["main"]


def _http_one(client: httpx.Client, body: dict) -> float:
    t0 = time.perf_counter()
    job = client.post("/v1/videos", json=body).raise_for_status().json()
    final = job_end(client, job["id"])
    if final != "completed":
        raise RuntimeError(f"job {job['id']} ended {final}")
    client.get(f"/v1/videos/{job['id']}/content").raise_for_status()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--frames", type=int, default=97)
    ap.add_argument("--size", default="384x256")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    tmp = Path(tempfile.mkdtemp(prefix="cp-infer-bench-"))
    env = subprocess_env({"CP_INFER_CACHE": str(tmp / "cache")})
    body = {"prompt": "a red fox running through fresh snow", "num_frames": args.frames, "width": width,
            "height": height, "num_inference_steps": args.steps, "seed": 3}
    flags = ["--prompt", body["prompt"], "--frames", str(args.frames), "--width", str(width), "--height",
             str(height), "--steps", str(args.steps), "--seed", "3", "--nproc", str(args.nproc)]

    cli_times = []
    for i in range(args.repeats + 1):  # the first run also builds the default model into the cache
        out = subprocess.run([sys.executable, "-m", "server.cli", "generate", *flags, "--out", str(tmp / f"{i}.mp4")],
                             env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
        m = re.search(r"generate ([\d.]+) s, write ([\d.]+) s", out)
        if i:
            cli_times.append(float(m.group(1)) + float(m.group(2)))

    server = ServeProcess(["--nproc", str(args.nproc), "--data-dir", str(tmp / "data"), "--max-queue",
                           str(args.clients + 1)], env=env, log=tmp / "serve.log")
    try:
        with httpx.Client(base_url=server.url, timeout=600) as client:
            server.wait_ready(client)
            _http_one(client, body)  # warm-up
            http_times = [_http_one(client, body) for _ in range(args.repeats)]
            done: list[float] = []
            t0 = time.perf_counter()
            threads = [threading.Thread(target=lambda: done.append(_http_one(client, body)))
                       for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
    finally:
        server.close()
    http, cli = statistics.median(http_times), statistics.median(cli_times)
    overhead = http / cli - 1
    print_report([
        f"`{command_line(__file__)}`: {args.nproc} rank(s), embedded default model, {args.frames} frames at "
        f"{args.size}, {args.steps} steps, median of {args.repeats}", "",
        *table_head(("path", "median s", "runs (s)")),
        table_row(["HTTP (submit -> events -> download)", f"{http:.2f}", ", ".join(f"{t:.2f}" for t in http_times)]),
        table_row(["`cp-infer generate` (generate + write)", f"{cli:.2f}", ", ".join(f"{t:.2f}" for t in cli_times)]),
        "", f"front-end overhead: {overhead * 100:+.1f}% (target < 3%: {'PASS' if overhead < 0.03 else 'FAIL'})",
        f"{args.clients} clients queued at once: {len(done)} videos in {wall:.1f} s = "
        f"{60 * len(done) / wall:.1f} requests/minute ({wall / len(done):.2f} s each)"])


if __name__ == "__main__":
    main()
