"""What a fleet's stores cost per job: PostgreSQL + S3 against the embedded SQLite file + the local folder.

    python bench/fleet.py --job-store postgresql://... --output-store s3://BUCKET/PREFIX [--jobs 40] [--rounds 3]

(S3's credentials and endpoint from ``AWS_*``, ``AWS_ENDPOINT_URL``.) Each job goes through the store calls a group
leader makes for it, with no model: submit, claim, ``--steps`` steps (each a cancel poll and a progress write), one
window checkpoint (64 KiB), the MP4 (256 KiB) and thumbnail published, the end; then one read of the job and its
content's size, as a client's poll. Rounds alternate the two setups. The first table: each setup's median seconds
per job, what the shared stores add per job (the issue's target: under 25 ms), and what each job sends: database
round trips and S3 requests (the cleanup's included), which the machine's load does not change (a job's time is
the sum of its store calls'). The second: where a job's time goes, part by part. The third: claim latency (p50,
p99) with one and with two servers' stores claiming from one queue at once (two claimer threads each).

The fourth (``bench/fleet_servers.py``; ``--server-jobs 0`` leaves it out): jobs per minute of real ``cp-infer
serve`` processes on the two stores given, one server against two, the same jobs submitted at once.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.fleet_servers import servers_table  # noqa: E402
from bench.harness import command_line, load_average, print_report, progress, table_head, table_row  # noqa: E402
from cp_infer.request import GenerationRequest, resolve_request  # noqa: E402
from models.ltx_video.options import ltx_video_options  # noqa: E402
from server.group.jobs import JobStore  # noqa: E402

_MP4, _JPG, _CKPT = 256 << 10, 16 << 10, 64 << 10


_PARTS = ("submit", "claim", "cancel polls", "progress writes", "checkpoint", "publish", "finish", "read")


def _job_cycle(store: JobStore, request: GenerationRequest, steps: int, rng: np.random.Generator,
               parts: dict[str, list[float]]) -> float:
    """One job's store calls; returns its seconds and appends each part's (summed over its calls) to ``parts``."""
    spent = dict.fromkeys(_PARTS, 0.0)

    def timed(part: str, call, *args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - started

    job = timed("submit", store.submit, request, model="bench")
    claimed = timed("claim", store.claim_next, timeout=5)
    assert claimed is not None and claimed.id == job.id, claimed
    attempt = claimed.attempts
    for i in range(steps):
        timed("cancel polls", store.cancel_requested, job.id, attempt=attempt)
        timed("progress writes", store.set_progress, job.id, 90 * (i + 1) // steps, attempt=attempt)
        if i == steps // 2:
            latents = rng.standard_normal(_CKPT // 4).astype(np.float32)
            timed("checkpoint", store.save_checkpoint, job.id, 1, {"latents": latents}, attempt=attempt)
    made = []
    for suffix, size in ((".mp4", _MP4), (".jpg", _JPG)):
        path = store.path(job.id, suffix + ".tmp")
        path.write_bytes(rng.bytes(size))
        made.append((path, suffix))
    timed("publish", store.publish, job.id, made, attempt=attempt)
    done = timed("finish", store.finish, job.id, "completed", attempt=attempt)
    assert timed("read", store.get, job.id).status == "completed"
    assert done is not None and store.output_size(done, ".mp4") == _MP4  # a check, not a leader's cost
    for part, seconds in spent.items():
        parts[part].append(seconds)
    return sum(spent.values())


class _Wire:
    """Counts what a store sends: database round trips (a statement, or a pipeline of them) and HTTP requests to the
    output store (retries and the cleanup thread's included). Load on the machine changes times, not these."""

    def __init__(self, store: JobStore):
        self.db = self.http = 0
        db = store._db
        execute, lazy = db.execute, db.execute_lazy

        def counted(sql, params=()):
            self.db += 1
            return execute(sql, params)

        def counted_lazy(sql, params=()):
            before = self.db
            result = lazy(sql, params)
            if self.db == before:  # one pipeline, not statements one by one
                self.db += 1
            return result

        db.execute, db.execute_lazy = counted, counted_lazy  # the instance's own: its methods call these too
        client = getattr(store.outputs, "_client", None)
        if client is not None:
            client.meta.events.register("before-send.s3", self._request)

    def _request(self, **_: object) -> None:
        self.http += 1


def _claims(stores: list[JobStore], jobs: int, request: GenerationRequest) -> list[float]:
    for i in range(jobs):
        stores[i % len(stores)].submit(request, model="bench")
    latencies: list[float] = []
    lock = threading.Lock()

    def claimer(store: JobStore) -> None:
        while True:
            started = time.perf_counter()
            job = store.claim_next(timeout=0)
            if job is None:
                return
            took = time.perf_counter() - started
            store.finish(job.id, "completed", attempt=job.attempts)
            with lock:
                latencies.append(took)

    threads = [threading.Thread(target=claimer, args=(s,)) for s in stores for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(latencies) == jobs, (len(latencies), jobs)
    return latencies


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job-store", required=True, help="postgresql://... (a database this may fill)")
    parser.add_argument("--output-store", required=True, help="s3://BUCKET/PREFIX")
    parser.add_argument("--jobs", type=int, default=40, help="jobs per setup per round (default 40)")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps per job (default 20)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server-jobs", type=int, default=12,
                        help="jobs per setup per round for real servers, one against two (default 12; 0: none)")
    parser.add_argument("--out", default=None, help="also write the report here")
    args = parser.parse_args(argv)
    request = resolve_request(GenerationRequest(prompt="a red fox runs through fresh snow", num_frames=9, width=96,
                                                height=64), ltx_video_options())
    rng = np.random.default_rng(0)
    setups = {"SQLite + local folder": (None, None), "PostgreSQL + S3": (args.job_store, args.output_store)}
    per_job: dict[str, list[float]] = {name: [] for name in setups}
    wire: dict[str, tuple[float, float]] = {}
    parts: dict[str, dict[str, list[float]]] = {name: {part: [] for part in _PARTS} for name in setups}
    loads = []
    with tempfile.TemporaryDirectory(prefix="cp-infer-bench-fleet-") as tmp:
        for r in range(args.rounds):
            for name in (list(setups) if r % 2 == 0 else list(setups)[::-1]):
                job_store, output_store = setups[name]
                store = JobStore(Path(tmp) / f"{r}-{len(per_job[name])}", max_queue=10_000, job_store=job_store,
                                 output_store=output_store)
                counter = _Wire(store)
                times = [_job_cycle(store, request, args.steps, rng, parts[name]) for _ in range(args.jobs)]
                store.close()
                wire[name] = (counter.db / args.jobs, counter.http / args.jobs)
                per_job[name].append(statistics.median(times))
                loads.append(load_average())
                progress(f"round {r} {name}: {per_job[name][-1] * 1e3:.1f} ms per job")
        claims = {}
        for servers in (1, 2):
            stores = [JobStore(Path(tmp) / f"claims-{servers}-{i}", max_queue=10_000, job_store=args.job_store,
                               output_store=args.output_store, node=f"bench-{i}") for i in range(servers)]
            claims[servers] = _claims(stores, args.jobs * 2, request)
            for store in stores:
                store.close()
    base, shared = (statistics.median(per_job[name]) for name in setups)
    lines = [f"`{command_line('bench/fleet.py', argv)}`", "",
             f"load average during the rounds: {', '.join(loads)}", "",
             *table_head(["setup", "ms per job (median of rounds)", "rounds", "database round trips per job",
                          "S3 requests per job"]),
             *[table_row([name, f"{statistics.median(v) * 1e3:.1f}", " / ".join(f"{x * 1e3:.1f}" for x in v),
                          f"{wire[name][0]:.1f}", f"{wire[name][1]:.1f}" if setups[name][1] else "-"])
               for name, v in per_job.items()],
             "", f"PostgreSQL + S3 adds {(shared - base) * 1e3:.1f} ms per job ({shared / base:.2f}x); target < 25 ms",
             "", *table_head(["part of a job (median ms over all jobs)", *setups]),
             *[table_row([part, *(f"{statistics.median(parts[name][part]) * 1e3:.2f}" for name in setups)])
               for part in _PARTS],
             "", *table_head(["servers claiming", "claims", "claim p50 ms", "claim p99 ms"]),
             *[table_row([n, len(v), f"{_p(v, 0.5) * 1e3:.2f}", f"{_p(v, 0.99) * 1e3:.2f}"])
               for n, v in claims.items()]]
    if args.server_jobs:
        lines += ["", *servers_table(job_store=args.job_store, output_store=args.output_store, jobs=args.server_jobs,
                                     steps=args.steps, rounds=args.rounds)]
    return print_report(lines, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
