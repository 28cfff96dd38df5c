"""Jobs per minute of real ``cp-infer serve`` processes on one job store and one output store: one server against
two (``bench/fleet.py`` prints this table after its store tables).

Each setup starts its servers (one rank each, the embedded default model, ``--data-dir`` of its own, the same
``--job-store`` and ``--output-store``), waits until every one is ready, then submits all its jobs at once, round
robin over the servers (a client may send a job to any of them; whichever server is idle claims the oldest), and
waits for each job's end on the server it was sent to (``bench.harness.queue_round``: its server-sent events, no
polling). Jobs per minute: the jobs over the seconds from the first submit to the last job's end. Each server's share
is its ``cp_infer_replica_jobs_finished_total``.
Servers start and stop outside the timed span; rounds rotate the setups' order.

Setups: one server, two servers as they start by themselves (each rank takes ``OMP_NUM_THREADS`` = the machine's
cores, ``server/cli/launch.py``, not knowing of the other server), and two servers each given half the cores
(``OMP_NUM_THREADS`` set by the user, as docs/deployment.md says for servers that share a machine).
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
from pathlib import Path

from bench.harness import (
    ServeProcess,
    load_average,
    progress,
    queue_round,
    rotated,
    subprocess_env,
    table_head,
    table_row,
)

__all__ = ["servers_table"]

_PROMPT = "a red fox runs through fresh snow"
_FRAMES, _SIZE = 25, "192x128"


def _finished(client, url: str) -> int:
    text = client.get(f"{url}/metrics", timeout=10).text
    return int(sum(float(m) for m in re.findall(r"^cp_infer_replica_jobs_finished_total\{[^}]*\} (\S+)", text,
                                                re.MULTILINE)))


def _setup(servers: int, threads: int | None, *, jobs: int, steps: int, job_store: str, output_store: str,
           root: Path) -> dict:
    """One timed setup of ``servers`` servers (``threads``: their ``OMP_NUM_THREADS``, ``None``: their own): jobs per
    minute, each job's seconds from submit to end, each server's share of the jobs."""
    import httpx

    env = subprocess_env(None if threads is None else {"OMP_NUM_THREADS": str(threads)}, own_threads=True)
    procs = []
    with httpx.Client(timeout=60.0) as client:
        try:
            for i in range(servers):
                data = root / f"server-{i}"
                data.mkdir(parents=True)
                procs.append(ServeProcess(["--nproc", "1", "--data-dir", str(data), "--job-store", job_store,
                                           "--output-store", output_store], env=env, log=data / "server.log"))
            for proc in procs:
                proc.wait_ready(client)
            body = dict(prompt=_PROMPT, num_frames=_FRAMES, size=_SIZE, num_inference_steps=steps)
            span, seconds = queue_round(client, [proc.url for proc in procs],
                                        [dict(body, seed=k) for k in range(jobs)])
            shares = [_finished(client, proc.url) for proc in procs]
        finally:
            for proc in procs:
                proc.close()
    return dict(per_minute=jobs / span * 60, job_s=statistics.median(seconds), shares=shares)


def servers_table(*, job_store: str, output_store: str, jobs: int, steps: int, rounds: int) -> list[str]:
    """The report's lines: one server against two on the same stores and the same load, medians over ``rounds``."""
    half = max(1, (os.cpu_count() or 2) // 2)
    setups = {"1 server": (1, None), "2 servers": (2, None), f"2 servers, OMP_NUM_THREADS={half} each": (2, half)}
    runs: dict[str, list[dict]] = {name: [] for name in setups}
    loads = []
    with tempfile.TemporaryDirectory(prefix="cp-infer-bench-servers-") as tmp:
        for r in range(rounds):
            for k, name in enumerate(rotated(list(setups), r)):
                servers, threads = setups[name]
                run = _setup(servers, threads, jobs=jobs, steps=steps, job_store=job_store, output_store=output_store,
                             root=Path(tmp) / f"{r}-{k}")
                runs[name].append(run)
                loads.append(load_average())
                progress(f"round {r} {name}: {run['per_minute']:.1f} jobs/min")
    one = statistics.median(run["per_minute"] for run in runs["1 server"])
    rows = []
    for name, done in runs.items():
        per_minute = statistics.median(run["per_minute"] for run in done)
        rows.append(table_row([name, f"{per_minute:.1f}", " / ".join(f"{run['per_minute']:.1f}" for run in done),
                               f"{per_minute / one:.2f}x", f"{statistics.median(run['job_s'] for run in done):.2f}",
                               " / ".join("+".join(str(s) for s in run["shares"]) for run in done)]))
    return [f"Real servers (one rank each, the embedded default; {jobs} jobs of {_FRAMES} frames at {_SIZE}, {steps} "
            f"steps, submitted at once, round robin; {os.cpu_count()} cores); load average after each setup: "
            f"{', '.join(loads)}", "",
            *table_head(["setup", "jobs per minute (median)", "rounds", "vs 1 server",
                         "seconds per job, submit to end (median)", "jobs each server ran, by round"]), *rows]
