"""Benchmark: the whole process, ``cp-infer generate --nproc 2 --out x.mp4`` against a ``torchrun --nproc_per_node 2``
script that runs diffusers' ``LTXPipeline`` with its own context parallelism and writes its MP4 with
``diffusers.utils.export_to_video`` (``bench/_peer_cli.py``), as a new user would time them from the shell.

    python bench/cli.py [--quick] [--rounds N] [--out FILE.md]

- Model: a medium LTX-Video folder written with ``LTXPipeline.save_pretrained`` into a temporary folder: diffusers'
  ``LTXVideoTransformer3DModel`` at 4 layers x 16 heads x 64 (``bench/generate.py``'s ``_build_components``, random
  weights under a fixed seed) with the embedded default model's tiny T5, tiny VAE and scheduler.
- Shapes: 25 frames at 256x256, 40 steps; 57 frames at 512x512, 4 steps (``--quick``: 8 and 2 steps). Both sides
  get the same prompt, seed, frame rate and the pipeline's defaults for everything else (guidance 3.0, CFG on).
- Ours twice: as a user runs it (no layout flag: with CFG on 2 ranks the command spreads the guidance pair, G=2 x
  U=1, ``cp_infer.mesh.MeshLayout.guidance_first``), and with ``--guidance-degree 1`` (Ulysses over both ranks, the
  layout the peer's context parallelism has), so the table also reads like for like.
- Procedure: one untimed run of each command (page cache, the folder read once), then ``--rounds`` rounds; round r
  runs the three commands in an order rotated by r, so that load from other processes on the machine falls on all
  alike. Wall time from ``Popen`` to exit; medians over the rounds; ratio = ours / peer; the 1-minute load average
  when each run starts.
- Phases: every run sets ``CP_INFER_TIMINGS`` (``server.group.phases``): each process (our launcher, each rank, the
  peer's ranks) marks the end of its phases on one wall-clock time line. The phase table shows, per process, the
  median over the timed rounds of each phase's time; "to start" is from the benchmark's ``Popen`` to the process's
  creation, "to exit" from its last mark to the benchmark seeing the command exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

__all__ = ["Shape", "main", "read_phases", "run_header"]

_PROMPT = "a red fox runs through fresh snow at dawn, cinematic tracking shot"
_NPROC = 2


@dataclass(frozen=True)
class Shape:
    frames: int
    height: int
    width: int
    steps: int
    target: float
    """The issue's target for ours / peer on this shape."""

    @property
    def label(self) -> str:
        return f"{self.frames} frames {self.width}x{self.height}, {self.steps} steps"

    def flags(self) -> list[str]:
        return ["--prompt", _PROMPT, "--frames", str(self.frames), "--height", str(self.height), "--width",
                str(self.width), "--steps", str(self.steps)]


def _write_model(folder: Path) -> None:
    from diffusers import LTXPipeline

    from bench.generate import ModelSize, _build_components

    LTXPipeline(**_build_components(ModelSize(layers=4, heads=16))).save_pretrained(folder)


def _commands(model: Path, shape: Shape, out: Path) -> dict[str, list[str]]:
    cp_infer = shutil.which("cp-infer")
    ours = [cp_infer] if cp_infer else [sys.executable, "-m", "server.cli"]
    torchrun = shutil.which("torchrun")
    peer = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    return {
        "ours": [*ours, "generate", "--model", str(model), *shape.flags(), "--nproc", str(_NPROC),
                 "--out", str(out / "ours.mp4")],
        # The layout the peer's context parallelism has: every pass's tokens sharded over both ranks.
        "ours-ulysses": [*ours, "generate", "--model", str(model), *shape.flags(), "--nproc", str(_NPROC),
                         "--guidance-degree", "1", "--out", str(out / "ours-ulysses.mp4")],
        "diffusers": [*peer, f"--nproc_per_node={_NPROC}", str(REPO / "bench" / "_peer_cli.py"), "--model",
                      str(model), *shape.flags(), "--out", str(out / "diffusers.mp4")],
    }


def _run(command: list[str], env: dict[str, str], timings: Path) -> dict:
    load = os.getloadavg()[0]
    started = time.time()
    proc = subprocess.run(command, env={**env, "CP_INFER_TIMINGS": str(timings)}, cwd=REPO,
                          capture_output=True, text=True)
    ended = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return {"wall": ended - started, "load": load, "phases": read_phases(timings, started, ended)}


def run_header(script: str, rounds: int) -> str:
    """The line above a whole-process table: the command, the machine, the versions, the model, the rounds."""
    return (f"`python {script} {' '.join(sys.argv[1:])}`: {platform.node()}, {os.cpu_count()} CPU(s), "
            f"torch {__import__('torch').__version__}, diffusers {__import__('diffusers').__version__}, "
            f"{_NPROC} ranks, model: LTX-Video 4 layers x 16 heads x 64, tiny T5 and VAE; median of "
            f"{rounds} alternating rounds (wall time of the whole command)")


def read_phases(timings: Path, started: float, ended: float, *, last: str = "to exit") -> dict:
    """Each process's phases from its marks under ``timings`` (``server.group.phases``):
    role -> [(phase, seconds)], from
    ``started`` (the launch) to its last mark, then ``last`` up to ``ended``."""
    roles = {}
    for path in sorted(timings.glob("*.json")):
        record = json.loads(path.read_text())
        marks = record["marks"]
        durations = [("to start", marks[0][1] - started)]
        durations += [(name, t - marks[i][1]) for i, (name, t) in enumerate(marks[1:])]
        durations.append((last, ended - marks[-1][1]))
        roles[record["role"]] = durations
    return roles


def _merged(durations: list[tuple[str, float]]) -> list[tuple[str, float]]:
    """A process's phases with repeated ones (a batch's jobs) summed, in order of first appearance, with their
    count."""
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, seconds in durations:
        totals[name] = totals.get(name, 0.0) + seconds
        counts[name] = counts.get(name, 0) + 1
    return [(name if counts[name] == 1 else f"{name} ({counts[name]}x)", t) for name, t in totals.items()]


def _phase_table(runs: list[dict]) -> list[str]:
    lines = []
    for role in sorted({r for run in runs for r in run["phases"]}, key=lambda r: (r != "launcher", r)):
        per_run = [_merged(run["phases"][role]) for run in runs if role in run["phases"]]
        names = [name for name, _ in per_run[0]]
        medians = [statistics.median(dict(p).get(n, 0.0) for p in per_run) for n in names]
        lines.append(f"| {role} | " + ", ".join(f"{n} {m:.2f}" for n, m in zip(names, medians, strict=True))
                     + f" | **{sum(medians):.2f}** |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 2 steps instead of 40 and 4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = ap.parse_args()
    shapes = (Shape(25, 256, 256, 8 if args.quick else 40, 0.8), Shape(57, 512, 512, 2 if args.quick else 4, 0.9))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # both sides pick their own default
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    tmp = Path(tempfile.mkdtemp(prefix="cp-infer-bench-cli-"))
    try:
        model = tmp / "ltx-video-medium"
        _write_model(model)
        head = [run_header("bench/cli.py", args.rounds), ""]
        table = ["| shape | ours s | diffusers s | ours / diffusers | target | ours, Ulysses over both s | its / "
                 "diffusers | load avg (1 min) | ours runs | Ulysses runs | diffusers runs |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        phase_lines: list[str] = []
        verdicts = []
        for shape in shapes:
            commands = _commands(model, shape, tmp)
            for impl, command in commands.items():
                _run(command, env, tmp / "timings" / f"warm-{impl}-{shape.frames}")
                print(f"{shape.label}: {impl}: {shlex.join(command)}", file=sys.stderr, flush=True)
            runs: dict[str, list[dict]] = {impl: [] for impl in commands}
            impls = tuple(commands)
            for r in range(args.rounds):
                for impl in impls[r % len(impls):] + impls[:r % len(impls)]:
                    run = _run(commands[impl], env, tmp / "timings" / f"{impl}-{shape.frames}-{r}")
                    runs[impl].append(run)
                    print(f"  round {r} {impl}: {run['wall']:.2f} s (load {run['load']:.2f})", file=sys.stderr,
                          flush=True)
            ours, ulysses, peer = (statistics.median(x["wall"] for x in runs[k])
                                   for k in ("ours", "ours-ulysses", "diffusers"))
            loads = [x["load"] for k in runs for x in runs[k]]
            ratio = ours / peer
            verdicts.append(f"{shape.label}: {ratio:.3f}x, target <= {shape.target}x: "
                            f"{'PASS' if ratio <= shape.target else 'FAIL'} (Ulysses over both: {ulysses / peer:.3f}x)")
            table.append(f"| {shape.label} | {ours:.2f} | {peer:.2f} | {ratio:.2f}x | <= {shape.target}x | "
                         f"{ulysses:.2f} | {ulysses / peer:.2f}x | {min(loads):.2f}-{max(loads):.2f} | "
                         + " | ".join(", ".join(f"{x['wall']:.1f}" for x in runs[k])
                                      for k in ("ours", "ours-ulysses", "diffusers")) + " |")
            phase_lines += ["", f"Phases, {shape.label} (s, median over the rounds; a process's phases in order):",
                            "", "| process | phases | total |", "| --- | --- | --- |"]
            for impl in ("ours", "ours-ulysses", "diffusers"):
                phase_lines += [line.replace("| ", f"| {impl} ", 1) for line in _phase_table(runs[impl])]
        report = "\n".join([*head, *table, "", *verdicts, *phase_lines, ""])
        print(report)
        if args.out:
            args.out.write_text(report)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
