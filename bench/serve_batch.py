"""Benchmark: ``cp-infer serve --nproc 2`` to its first 200 on ``/ready``, and ``cp-infer batch --nproc 2`` over a
10-prompt file, each against the ``torchrun --nproc_per_node 2`` diffusers script a user would write for the same
job, timed from the shell as whole processes.

    python bench/serve_batch.py [--quick] [--rounds N] [--out FILE.md]

- Model: ``bench/cli.py``'s medium LTX-Video folder (``bench/_models.py``'s ``MEDIUM``: 4 layers x 16 heads x 64,
  the embedded default's tiny T5 and VAE), written once with ``save_pretrained``.
- serve: ours ``cp-infer serve --model DIR --nproc 2 --port P --data-dir D`` (a fresh data folder per run) against
  ``bench/peers/serve.py`` (``LTXPipeline.from_pretrained``, diffusers' own context parallelism, then rank 0
  answers ``/ready`` from ``http.server``). The time is from ``Popen`` to the first 200 on ``GET /ready`` (polled
  every 20 ms); each run is then stopped with SIGTERM and waited for before the next starts.
- batch: ours ``cp-infer batch PROMPTS.jsonl --out-dir D --nproc 2`` (a fresh output folder per run, so nothing is
  skipped) against ``bench/peers/batch.py`` (``pipe(...)`` and ``export_to_video`` per line): 10 prompts, 9 frames at
  128x128, 8 steps (``--quick``: 4 steps), CFG on (guidance 3.0), one seed per line. Wall time from ``Popen`` to
  exit.
- Procedure, as ``bench/cli.py``: one untimed run of each side, then ``--rounds`` rounds, round r running ours
  first when r is even and the peer first when odd; medians; ratio = ours / peer; the 1-minute load average when
  each run starts. The phase tables come from ``CP_INFER_TIMINGS`` (``server.group.phases``), as in ``bench/cli.py``, a
  batch's jobs summed per phase; serve's up to the 200 (our ranks write their marks at warm-up and at ready; the
  peer's, stopped by SIGTERM, write none, so its row is missing).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench import peers  # noqa: E402 -- path set-up
from bench._models import MEDIUM_LABEL, write_medium_folder  # noqa: E402
from bench.harness import (  # noqa: E402
    REPO,
    cp_infer_command,
    free_port,
    phase_table,
    print_report,
    progress,
    read_phases,
    rotated,
    run_command,
    run_header,
    subprocess_env,
    table_head,
    table_row,
    torchrun_command,
)

__all__ = ["main"]

_NPROC = 2
_PROMPTS = ("a red fox runs through fresh snow at dawn", "waves break on a black sand beach", "a city street at night "
            "in the rain, neon signs", "a hot air balloon over green hills", "a cat sleeps on a sunny windowsill",
            "a paper boat drifts down a gutter stream", "fireworks over a harbour", "a hummingbird at a red flower",
            "a steam train crosses a stone bridge", "autumn leaves fall in a quiet park")


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # not listening yet, or 503 while the group starts
        return False


def _serve_run(command: list[str], port: int, env: dict[str, str], timings: Path, timeout_s: float = 300) -> dict:
    """Start ``command``, time it to the first 200 on ``/ready``, stop it with SIGTERM and wait for it; with the
    phases its processes marked up to then (under ``timings``)."""
    load = os.getloadavg()[0]
    started = time.time()
    proc = subprocess.Popen(command, env={**env, "CP_INFER_TIMINGS": str(timings)}, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        while not _ready(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(command)} exited {proc.returncode}:\n{proc.stderr.read()[-4000:]}")
            if time.time() - started > timeout_s:
                raise RuntimeError(f"{shlex.join(command)}: no 200 on /ready within {timeout_s:.0f} s")
            time.sleep(0.02)
        ready = time.time()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the run's own session: its launcher and ranks only
                proc.wait()
        proc.stderr.close()
    phases = read_phases(timings, started, ready, last="to the 200") if timings.is_dir() else {}
    return {"wall": ready - started, "load": load, "phases": phases}


def _prompts_file(path: Path, steps: int) -> None:
    lines = [dict(prompt=p, name=f"v{i:02d}", seed=i, num_frames=9, height=128, width=128, num_inference_steps=steps,
                  frame_rate=25) for i, p in enumerate(_PROMPTS)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _alternate(label: str, run_side, rounds: int) -> dict[str, list[dict]]:
    for side in ("ours", "diffusers"):
        run_side(side, "warm")
    runs: dict[str, list[dict]] = {"ours": [], "diffusers": []}
    for r in range(rounds):
        for side in rotated(("ours", "diffusers"), r):
            run = run_side(side, r)
            runs[side].append(run)
            progress(f"  {label} round {r} {side}: {run['wall']:.2f} s (load {run['load']:.2f})")
    return runs


def _row(label: str, runs: dict[str, list[dict]]) -> str:
    ours, peer = (statistics.median(x["wall"] for x in runs[k]) for k in ("ours", "diffusers"))
    loads = [x["load"] for k in runs for x in runs[k]]
    return table_row([label, f"{ours:.2f}", f"{peer:.2f}", f"{ours / peer:.2f}x", f"{min(loads):.2f}-{max(loads):.2f}",
                      *(", ".join(f"{x['wall']:.1f}" for x in runs[side]) for side in ("ours", "diffusers"))])


def _phases(label: str, runs: dict[str, list[dict]]) -> list[str]:
    lines = ["", f"Phases, {label} (s, median over the rounds; a process's phases in order):", "",
             *table_head(("process", "phases", "total"))]
    for side in ("ours", "diffusers"):
        lines += phase_table(side, runs[side])
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="batch of 4-step videos instead of 8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = ap.parse_args()
    steps = 4 if args.quick else 8
    env = subprocess_env(own_threads=True)  # both sides pick their own default thread count
    tmp = Path(tempfile.mkdtemp(prefix="cp-infer-bench-serve-batch-"))
    try:
        model = tmp / "ltx-video-medium"
        write_medium_folder(model)
        prompts = tmp / "prompts.jsonl"
        _prompts_file(prompts, steps)

        def serve(side: str, r) -> dict:
            port = free_port()
            command = ([*cp_infer_command(), "serve", "--model", str(model), "--nproc", str(_NPROC), "--port",
                        str(port), "--data-dir", str(tmp / f"data-{r}")] if side == "ours" else
                       [*torchrun_command(_NPROC, peers.SERVE), "--model", str(model), "--port", str(port)])
            if r == "warm":
                progress(f"serve: {side}: {shlex.join(command)}")
            return _serve_run(command, port, env, tmp / "timings" / f"serve-{side}-{r}")

        def batch(side: str, r) -> dict:
            out = tmp / f"videos-{side}-{r}"
            command = ([*cp_infer_command(), "batch", str(prompts), "--model", str(model), "--out-dir", str(out),
                        "--nproc", str(_NPROC)] if side == "ours" else
                       [*torchrun_command(_NPROC, peers.BATCH), "--model", str(model), str(prompts), "--out-dir",
                        str(out)])
            if r == "warm":
                progress(f"batch: {side}: {shlex.join(command)}")
            run = run_command(command, env, tmp / "timings" / f"batch-{side}-{r}")
            made = sorted(out.glob("*.mp4"))
            if len(made) != len(_PROMPTS):
                raise RuntimeError(f"batch {side}: {len(made)} videos in {out}, expected {len(_PROMPTS)}")
            shutil.rmtree(out)
            return run

        serve_label = "serve: start to the first 200 on /ready"
        batch_label = f"batch: {len(_PROMPTS)} prompts, 9 frames 128x128, {steps} steps"
        serve_runs = _alternate("serve", serve, args.rounds)
        batch_runs = _alternate("batch", batch, args.rounds)
        head = [run_header(__file__, nproc=_NPROC, model=MEDIUM_LABEL, rounds=args.rounds), "",
                *table_head(("command", "ours s", "diffusers s", "ours / diffusers", "load avg (1 min)", "ours runs",
                             "diffusers runs"))]
        print_report([*head, _row(serve_label, serve_runs), _row(batch_label, batch_runs),
                      *_phases(serve_label, serve_runs), *_phases(batch_label, batch_runs)], args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
