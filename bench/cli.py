"""Benchmark: the whole process, ``cp-infer generate --nproc 2 --out x.mp4`` against a ``torchrun --nproc_per_node 2``
script that runs diffusers' ``LTXPipeline`` with its own context parallelism and writes its MP4 with
``diffusers.utils.export_to_video`` (``bench/peers/generate.py``), as a new user would time them from the shell.

    python bench/cli.py [--quick] [--rounds N] [--out FILE.md]

- Model: a medium LTX-Video folder written with ``LTXPipeline.save_pretrained`` into a temporary folder: diffusers'
  ``LTXVideoTransformer3DModel`` at 4 layers x 16 heads x 64 (``bench/_models.py``'s ``MEDIUM``, random weights
  under a fixed seed) with the embedded default model's tiny T5, tiny VAE and scheduler.
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
import shlex
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench import peers  # noqa: E402 -- path set-up
from bench._models import MEDIUM_LABEL, PROMPT, write_medium_folder  # noqa: E402
from bench.harness import (  # noqa: E402
    cp_infer_command,
    phase_table,
    print_report,
    progress,
    rotated,
    run_command,
    run_header,
    subprocess_env,
    table_head,
    table_row,
    torchrun_command,
)

__all__ = ["Shape", "main"]

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
        return ["--prompt", PROMPT, "--frames", str(self.frames), "--height", str(self.height), "--width",
                str(self.width), "--steps", str(self.steps)]


def _commands(model: Path, shape: Shape, out: Path) -> dict[str, list[str]]:
    ours = [*cp_infer_command(), "generate", "--model", str(model), *shape.flags(), "--nproc", str(_NPROC)]
    return {
        "ours": [*ours, "--out", str(out / "ours.mp4")],
        # The layout the peer's context parallelism has: every pass's tokens sharded over both ranks.
        "ours-ulysses": [*ours, "--guidance-degree", "1", "--out", str(out / "ours-ulysses.mp4")],
        "diffusers": [*torchrun_command(_NPROC, peers.GENERATE), "--model", str(model), *shape.flags(), "--out",
                      str(out / "diffusers.mp4")],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 and 2 steps instead of 40 and 4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the tables to this markdown file")
    args = ap.parse_args()
    shapes = (Shape(25, 256, 256, 8 if args.quick else 40, 0.8), Shape(57, 512, 512, 2 if args.quick else 4, 0.9))
    env = subprocess_env(own_threads=True)  # both sides pick their own default thread count
    tmp = Path(tempfile.mkdtemp(prefix="cp-infer-bench-cli-"))
    try:
        model = tmp / "ltx-video-medium"
        write_medium_folder(model)
        head = [run_header(__file__, nproc=_NPROC, model=MEDIUM_LABEL, rounds=args.rounds), ""]
        table = table_head(("shape", "ours s", "diffusers s", "ours / diffusers", "target", "ours, Ulysses over both s",
                            "its / diffusers", "load avg (1 min)", "ours runs", "Ulysses runs", "diffusers runs"))
        phase_lines: list[str] = []
        verdicts = []
        for shape in shapes:
            commands = _commands(model, shape, tmp)
            for impl, command in commands.items():
                run_command(command, env, tmp / "timings" / f"warm-{impl}-{shape.frames}")
                progress(f"{shape.label}: {impl}: {shlex.join(command)}")
            runs: dict[str, list[dict]] = {impl: [] for impl in commands}
            for r in range(args.rounds):
                for impl in rotated(tuple(commands), r):
                    run = run_command(commands[impl], env, tmp / "timings" / f"{impl}-{shape.frames}-{r}")
                    runs[impl].append(run)
                    progress(f"  round {r} {impl}: {run['wall']:.2f} s (load {run['load']:.2f})")
            ours, ulysses, peer = (statistics.median(x["wall"] for x in runs[k])
                                   for k in ("ours", "ours-ulysses", "diffusers"))
            loads = [x["load"] for k in runs for x in runs[k]]
            ratio = ours / peer
            verdicts.append(f"{shape.label}: {ratio:.3f}x, target <= {shape.target}x: "
                            f"{'PASS' if ratio <= shape.target else 'FAIL'} (Ulysses over both: {ulysses / peer:.3f}x)")
            table.append(table_row([shape.label, f"{ours:.2f}", f"{peer:.2f}", f"{ratio:.2f}x", f"<= {shape.target}x",
                                    f"{ulysses:.2f}", f"{ulysses / peer:.2f}x", f"{min(loads):.2f}-{max(loads):.2f}",
                                    *(", ".join(f"{x['wall']:.1f}" for x in runs[k])
                                      for k in ("ours", "ours-ulysses", "diffusers"))]))
            phase_lines += ["", f"Phases, {shape.label} (s, median over the rounds; a process's phases in order):",
                            "", *table_head(("process", "phases", "total"))]
            for impl in ("ours", "ours-ulysses", "diffusers"):
                phase_lines += phase_table(impl, runs[impl])
        print_report([*head, *table, "", *verdicts, *phase_lines], args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
