"""The server under load: many clients against a short queue, for a fixed time, on loopback.

    python bench/load.py [--clients 24] [--seconds 60] [--max-queue 8] [--nproc 2]

``--clients`` threads each loop until ``--seconds`` have passed: submit a tiny job (``POST /v1/videos``); when it is
accepted, read it back once (``GET /v1/videos/{id}``, the read whose latency is reported); when it is refused with
429, wait what its ``Retry-After`` says (at most 1 s) and submit again. Then every accepted job is waited for. The
table: accepted, completed (every accepted job must complete), refused with 429 (and whether each carried
``Retry-After``), 5xx and any other status, and the job read's median and p99. ``CHECK FAILED`` lines (exit 1) when an
accepted job did not complete, a 429 came without ``Retry-After`` or any 5xx came back. Only 127.0.0.1 is contacted;
the loops are bounded in time, and the run stops the server it started.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.harness import (  # noqa: E402 -- path set-up
    ServeProcess,
    command_line,
    load_average,
    print_report,
    progress,
    subprocess_env,
    table_head,
    table_row,
)

__all__ = ["main"]

_BODY = {"prompt": "a red fox runs through fresh snow", "num_frames": 9, "size": "64x64", "num_inference_steps": 2,
         "seed": 7}


class _Tally:
    """What the clients saw, under one lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.statuses: Counter[int] = Counter()
        self.accepted: list[str] = []
        self.reads_ms: list[float] = []
        self.refused_without_retry_after = 0


def _client(url: str, deadline: float, tally: _Tally) -> None:
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while time.monotonic() < deadline:
            response = client.post("/v1/videos", json=_BODY)
            with tally.lock:
                tally.statuses[response.status_code] += 1
            if response.status_code in (200, 201):
                job_id = response.json()["id"]
                t0 = time.perf_counter()
                read = client.get(f"/v1/videos/{job_id}")
                read_ms = (time.perf_counter() - t0) * 1000
                with tally.lock:
                    tally.accepted.append(job_id)
                    tally.reads_ms.append(read_ms)
                    if read.status_code != 200:
                        tally.statuses[read.status_code] += 1
            elif response.status_code == 429:
                retry_after = response.headers.get("Retry-After")
                if retry_after is None:
                    with tally.lock:
                        tally.refused_without_retry_after += 1
                time.sleep(min(float(retry_after or 1), 1.0))
            else:
                time.sleep(0.1)


def _wait_all(url: str, job_ids: list[str], timeout_s: float) -> Counter[str]:
    """The final status of every job, polling the list a page at a time until none is queued or running."""
    deadline = time.monotonic() + timeout_s
    pending, finals = set(job_ids), Counter()
    with httpx.Client(base_url=url, timeout=30.0) as client:
        while pending and time.monotonic() < deadline:
            for job_id in sorted(pending):
                status = client.get(f"/v1/videos/{job_id}").json()["status"]
                if status in ("completed", "failed", "cancelled"):
                    finals[status] += 1
                    pending.discard(job_id)
            if pending:
                time.sleep(0.5)
    finals["unfinished"] = len(pending)
    return finals


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-queue", type=int, default=8)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="cp-infer-load-") as tmp:
        server = ServeProcess(["--nproc", str(args.nproc), "--max-queue", str(args.max_queue), "--data-dir",
                               f"{tmp}/data"], env=subprocess_env({"CP_INFER_CACHE": os.environ.get(
                                   "CP_INFER_CACHE", f"{tmp}/cache")}), log=Path(tmp) / "server.log")
        try:
            with httpx.Client() as probe:
                server.wait_ready(probe)
            load_start = load_average()
            progress(f"{args.clients} clients for {args.seconds:.0f} s against a queue of {args.max_queue}")
            tally = _Tally()
            deadline = time.monotonic() + args.seconds
            threads = [threading.Thread(target=_client, args=(server.url, deadline, tally), daemon=True)
                       for _ in range(args.clients)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(args.seconds + 120)
            progress(f"{len(tally.accepted)} accepted; waiting for them to finish")
            finals = _wait_all(server.url, tally.accepted, timeout_s=600)
        finally:
            server.close()

    server_errors = sum(n for status, n in tally.statuses.items() if status >= 500)
    refused = tally.statuses[429]
    other = {s: n for s, n in tally.statuses.items() if s not in (200, 201, 429) and s < 500}
    lines = [f"command: `{command_line(__file__, argv)}`", "",
             f"embedded default model, {args.nproc} ranks, jobs of 9 frames 64x64 2 steps; load average at the start "
             f"(1/5/15 min): {load_start}, at the end: {load_average()}", "",
             *table_head(["clients x seconds", "queue", "accepted", "completed", "refused 429 (with Retry-After)",
                          "5xx", "other", "job read p50 ms", "job read p99 ms"], left=1),
             table_row([f"{args.clients} x {args.seconds:.0f}", args.max_queue, len(tally.accepted),
                        finals["completed"], f"{refused} ({refused - tally.refused_without_retry_after})",
                        server_errors, ", ".join(f"{s}: {n}" for s, n in sorted(other.items())) or "none",
                        f"{statistics.median(tally.reads_ms) if tally.reads_ms else float('nan'):.1f}",
                        f"{_percentile(tally.reads_ms, 0.99):.1f}"])]
    if finals["completed"] != len(tally.accepted):
        lines.append(f"CHECK FAILED: {len(tally.accepted)} accepted, {finals['completed']} completed ({dict(finals)})")
    if tally.refused_without_retry_after:
        lines.append(f"CHECK FAILED: {tally.refused_without_retry_after} refusals with 429 had no Retry-After")
    if server_errors:
        lines.append(f"CHECK FAILED: {server_errors} responses with a 5xx status")
    return print_report(lines, args.out)


if __name__ == "__main__":
    sys.exit(main())
