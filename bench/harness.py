"""What the benchmark scripts share: rank processes that load once and then serve commands, memory readings and
malloc settings, the configurations compared, timing helpers, whole-process runs with their phases, and the report
(command line, environment, load average, markdown tables).

Invariants:
- A worker is ``target(*args, inbox, outbox)``, started with the spawn method. It answers every command it takes
  from ``inbox`` (and, once loaded, a first "ready" reply) with ``(index, "ok", payload)`` or, on any failure,
  ``(index, "error", traceback)``, where ``index`` is its position in the group; ``None`` on ``inbox`` ends it.
- Memory readings come from ``/proc/self/status`` (Linux); the peak is reset by ``clear_refs``.
- Timed rounds are interleaved: round ``r`` runs the configurations in an order rotated by ``r`` (:func:`rotated`),
  so that load from other processes on the machine falls on every configuration alike.
- Nothing heavy is imported here at import time (torch only inside the functions that need it), so a script that
  times whole processes pays for nothing it does not use.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from server.cli.launch import free_port

__all__ = [
    "DIFF_1", "DIFF_2", "MALLOC_MEASURE", "MALLOC_TIMED", "OURS_1", "OURS_2", "REPO", "TIMEOUT_S", "WARMUP_STEPS",
    "CollectiveClock", "RankGroup", "ServeProcess", "Setup", "barrier", "code_version", "command_line",
    "cp_infer_command", "environment", "free_port", "job_end", "load_average", "median_round", "phase_table",
    "print_report", "progress", "queue_round", "read_phases", "reset_peak_rss", "rotated", "run_command", "run_header",
    "set_malloc", "slowest_steps", "status_kib", "subprocess_env", "table_head", "table_row", "torchrun_command",
    "trim_heap",
]

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900.0
"""How long a rank group waits for a reply, and the process groups' timeout."""
WARMUP_STEPS = 2
"""NOTE(warm-up-steps): 2, not 1: with ``shift_terminal`` set (the default model's scheduler, as LTX-Video
0.9.x), a 1-step schedule divides by zero and the scheduler then raises IndexError."""
MALLOC_MEASURE = (1 << 20, 1 << 20)
"""glibc's (mmap, trim) thresholds while memory is measured. NOTE(malloc): at 1 MiB, tensors of 1 MiB and more are
mmapped and unmapped when freed, so RSS follows the live tensors (with glibc's default dynamic threshold, freed
blocks stay in the heap and the peak depends on allocation order)."""
MALLOC_TIMED = (32 << 20, 64 << 20)
"""glibc's (mmap, trim) thresholds for timed rounds: the values its dynamic threshold settles at."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------------
# Rank processes.
# ---------------------------------------------------------------------------------------------------------


class RankGroup:
    """Worker processes, one per entry of ``worker_args``; ``call`` sends a command to each and returns the replies
    in order."""

    def __init__(self, label: str, target: Callable[..., None], worker_args: list[tuple[Any, ...]], *,
                 timeout_s: float = TIMEOUT_S) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.label, self.timeout_s = label, timeout_s
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in worker_args]
        self.procs = [ctx.Process(target=target, args=(*args, inbox, self.outbox), daemon=True)
                      for args, inbox in zip(worker_args, self.inboxes, strict=True)]
        for p in self.procs:
            p.start()

    def replies(self) -> list[Any]:
        got: dict[int, Any] = {}
        errors = []
        while len(got) + len(errors) < len(self.procs):
            try:
                index, status, payload = self.outbox.get(timeout=self.timeout_s)
            except queue.Empty:
                raise RuntimeError(f"{self.label}: no reply within {self.timeout_s:.0f} s") from None
            if status == "error":
                errors.append(f"--- {self.label} rank {index} ---\n{payload}")
            else:
                got[index] = payload
        if errors:
            raise RuntimeError("rank failure:\n" + "\n".join(errors))
        return [got[i] for i in range(len(self.procs))]

    def call(self, command: Any) -> list[Any]:
        for inbox in self.inboxes:
            inbox.put(command)
        return self.replies()

    def close(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def barrier() -> None:
    """``dist.barrier()`` where a default process group exists (a one-process configuration has none)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` starting at ``by`` (mod its length) and going round: the order of round ``by``."""
    by %= len(items)
    return [*items[by:], *items[:by]]


@dataclass(frozen=True)
class Setup:
    """One configuration: whose code, how many ranks, how many intra-op threads per rank."""

    impl: str
    """``"ours"`` or ``"diffusers"``."""
    ranks: int
    threads: int

    @property
    def label(self) -> str:
        return f"{self.impl}{' CP' if self.impl == 'diffusers' and self.ranks > 1 else ''} N={self.ranks}"


# On 2 cores: N=2 at 1 intra-op thread per rank, N=1 at 2.
OURS_1, OURS_2 = Setup("ours", 1, 2), Setup("ours", 2, 1)
DIFF_2, DIFF_1 = Setup("diffusers", 2, 1), Setup("diffusers", 1, 2)


# ---------------------------------------------------------------------------------------------------------
# Memory and malloc.
# ---------------------------------------------------------------------------------------------------------


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """Set glibc's mmap and trim thresholds for this process; False where malloc is not glibc's."""
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):  # not glibc
        return False


def trim_heap() -> bool:
    """glibc's ``malloc_trim(0)``: the free memory of every arena back to the kernel; False where not glibc."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


# ---------------------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------------------


class CollectiveClock:
    """Counts the tensor collectives a rank issues and the wall time spent inside them.

    Wraps ``torch.distributed``'s and the functional collectives' all-to-all and all-gather (looked up by attribute
    at every call by both our engine and diffusers). Ours are synchronous on gloo, so their time is the exchange's
    (transfer plus waiting for the peer); diffusers' functional collectives return at once and are waited for
    later, so for them only the count means something.
    """

    def __init__(self) -> None:
        self.calls, self.seconds = 0, 0.0

    @classmethod
    def install(cls) -> CollectiveClock:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        clock = cls()
        for module, name in ((dist, "all_to_all_single"), (dist, "all_gather_into_tensor"),
                             (funcol, "all_to_all_single"), (funcol, "all_gather_tensor")):
            setattr(module, name, clock._wrap(getattr(module, name)))
        return clock

    def reading(self) -> tuple[int, float]:
        return self.calls, self.seconds

    def _wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls += 1
                self.seconds += time.perf_counter() - started

        return timed


def slowest_steps(replies: Iterable[dict[str, Any]]) -> list[float]:
    """Per denoising step, the slowest rank's time (each reply's ``steps``, one per rank)."""
    return [max(step) for step in zip(*(r["steps"] for r in replies), strict=True)]


def median_round(rounds: Iterable[dict[str, Any]], key: str = "e2e_s") -> dict[str, Any]:
    """The round whose ``key`` is the median (the lower of the two middle ones for an even count)."""
    ordered = sorted(rounds, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


# ---------------------------------------------------------------------------------------------------------
# Whole processes: commands as a user runs them from the shell, and the phases they mark.
# ---------------------------------------------------------------------------------------------------------


def cp_infer_command() -> list[str]:
    """``cp-infer`` where it is installed, else ``python -m server.cli``."""
    found = shutil.which("cp-infer")
    return [found] if found else [sys.executable, "-m", "server.cli"]


def torchrun_command(nproc: int, script: Path) -> list[str]:
    """``torchrun --nproc_per_node=NPROC SCRIPT`` (``python -m torch.distributed.run`` where not on the path)."""
    found = shutil.which("torchrun")
    return [*([found] if found else [sys.executable, "-m", "torch.distributed.run"]), f"--nproc_per_node={nproc}",
            str(script)]


def subprocess_env(extra: dict[str, str] | None = None, *, own_threads: bool = False) -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH``, plus ``extra``; ``own_threads``: without
    ``OMP_NUM_THREADS``, so that each side picks its own default."""
    env = {k: v for k, v in os.environ.items() if not (own_threads and k == "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return {**env, **(extra or {})}


def run_command(command: list[str], env: dict[str, str], timings: Path) -> dict[str, Any]:
    """Run ``command`` to its exit with ``CP_INFER_TIMINGS=timings``: wall time from ``Popen`` to exit, the 1-minute
    load average at its start, the phases its processes marked."""
    import shlex

    load = os.getloadavg()[0]
    started = time.time()
    proc = subprocess.run(command, env={**env, "CP_INFER_TIMINGS": str(timings)}, cwd=REPO,
                          capture_output=True, text=True)
    ended = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return {"wall": ended - started, "load": load, "phases": read_phases(timings, started, ended)}


def read_phases(timings: Path, started: float, ended: float, *, last: str = "to exit") -> dict[str, Any]:
    """Each process's phases from its marks under ``timings`` (``server.group.phases``): role -> [(phase,
    seconds)], from ``started`` (the launch) to its last mark, then ``last`` up to ``ended``."""
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


def phase_table(side: str, runs: list[dict[str, Any]]) -> list[str]:
    """Rows ``| SIDE ROLE | phase seconds, ... | total |`` of one side's runs: per process (the launcher first), the
    median over the runs of each phase's time."""
    import statistics

    lines = []
    for role in sorted({r for run in runs for r in run["phases"]}, key=lambda r: (r != "launcher", r)):
        per_run = [_merged(run["phases"][role]) for run in runs if role in run["phases"]]
        names = [name for name, _ in per_run[0]]
        medians = [statistics.median(dict(p).get(n, 0.0) for p in per_run) for n in names]
        lines.append(table_row([f"{side} {role}", ", ".join(f"{n} {m:.2f}" for n, m in zip(names, medians,
                                                                                        strict=True)),
                                f"**{sum(medians):.2f}**"]))
    return lines


class ServeProcess:
    """``cp-infer serve ARGS --port P`` on a free port, in a session of its own (its launcher and ranks only are
    stopped), its output in ``log``."""

    def __init__(self, args: list[str], *, env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log.open("wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", *args, "--port", str(self.port)],
                                     cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self, client: Any, timeout_s: float = 300) -> None:
        """Until ``GET /ready`` answers 200 (``client``: an ``httpx.Client``)."""
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {self._log.name}")
            try:
                if client.get(f"{self.url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the server was not ready in {timeout_s:.0f} s; see {self._log.name}")

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def job_end(client: Any, job_id: str, url: str = "") -> str | None:
    """The state a job ends in (``completed``, ``failed``, ``cancelled``), read from its server-sent events rather
    than by polling: no busy requests competing with the job. ``url``: the server's, unless the client has it."""
    with client.stream("GET", f"{url}/v1/videos/{job_id}/events") as events:
        for line in events.iter_lines():
            if line.startswith("event: video.") and line.split(".", 1)[1] in ("completed", "failed", "cancelled"):
                return line.split(".", 1)[1]
    return None


def queue_round(client: Any, urls: Sequence[str], bodies: Sequence[dict]) -> tuple[float, list[float]]:
    """Submit every body at once, round robin over the servers at ``urls``: the seconds from the first submit to the
    last job's end, and each job's from its submit to its end. Each end is read from the job's server-sent events
    (:func:`job_end`), one waiting thread per job: no polling competing with the jobs for the CPU. Raises unless every
    job completed."""
    import threading

    started = time.perf_counter()
    jobs = []
    for k, body in enumerate(bodies):
        url = urls[k % len(urls)]
        jobs.append((url, client.post(f"{url}/v1/videos", json=body).raise_for_status().json()["id"],
                     time.perf_counter()))
    ends: dict[str, tuple[str | None, float]] = {}

    def wait(url: str, job_id: str, submitted: float) -> None:
        end = job_end(client, job_id, url)
        ends[job_id] = (end, time.perf_counter() - submitted)

    threads = [threading.Thread(target=wait, args=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    failed = {job_id: end for job_id, (end, _) in ends.items() if end != "completed"}
    if failed or len(ends) != len(jobs):
        raise RuntimeError(f"jobs did not complete: {failed or {job_id for _, job_id, _ in jobs} - set(ends)}")
    return wall, [seconds for _, seconds in ends.values()]


# ---------------------------------------------------------------------------------------------------------
# The report.
# ---------------------------------------------------------------------------------------------------------


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def command_line(script: str, argv: list[str] | None = None) -> str:
    """``python bench/SCRIPT.py ARGS`` as run from the repository root; ``argv``: the arguments ``main`` was given
    (None: this process's command line)."""
    import shlex

    path = Path(script).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def load_average(values: tuple[float, float, float] | None = None) -> str:
    """The 1, 5 and 15-minute load averages, ``"1.0 / 0.8 / 0.5"`` (now, unless ``values`` are given)."""
    return " / ".join(f"{x:.1f}" for x in (values or os.getloadavg()))


def _cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")), platform.processor())


def code_version() -> str:
    """The commit of the engine and model code measured, and whether it had local changes."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "cp_infer", "models"], cwd=REPO,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "code version unknown (no git)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"cp_infer/ and models/ at commit {commit}" + (f" plus local changes in {', '.join(changed)}" if changed
                                                           else " (no local changes)")


def environment(setups: Iterable[Setup]) -> str:
    """The line above an in-process table: versions, the CPU, the configurations' ranks x threads, the load average
    at the start and the code measured."""
    import diffusers
    import torch

    threads = "; ".join(f"{s.label}: {s.ranks} x {s.threads}" for s in setups)
    return (f"python {platform.python_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}; "
            f"{os.cpu_count()} CPU cores ({_cpu_name()}); gloo on 127.0.0.1; fp32; ranks x intra-op threads: "
            f"{threads}; load average at the start (1/5/15 min): {load_average()}; {code_version()}.")


def run_header(script: str, *, nproc: int, model: str, rounds: int) -> str:
    """The line above a whole-process table: the command, the machine, the versions, the model, the rounds, the
    load average at the start."""
    import diffusers
    import torch

    return (f"`{command_line(script)}`: {platform.node()}, {os.cpu_count()} CPU(s), torch {torch.__version__}, "
            f"diffusers {diffusers.__version__}, {nproc} ranks, model: {model}; median of {rounds} alternating "
            f"rounds (wall time of the whole command); load average at the start (1/5/15 min): {load_average()}")


def table_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table_head(columns: Sequence[str], *, left: int | None = None) -> list[str]:
    """A markdown table's header and rule; the first ``left`` columns align left, the others right (None: all
    left)."""
    left = len(columns) if left is None else left
    return [table_row(columns), "|" + "|".join("---" if i < left else "---:" for i in range(len(columns))) + "|"]


def print_report(lines: list[str], out: Path | str | None = None) -> int:
    """Print the report (and write it to ``out``); the exit status: 1 where a line starts with ``CHECK FAILED``."""
    report = "\n".join(lines) + "\n"
    print(report, end="", flush=True)
    if out is not None:
        Path(out).write_text(report)
    return 1 if any(line.startswith("CHECK FAILED") for line in lines) else 0
