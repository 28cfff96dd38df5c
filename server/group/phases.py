"""Per-process phase times of a CLI run, for ``bench/cli.py``: set ``CP_INFER_TIMINGS=DIR`` and every process of
the command (the launcher and each rank) writes ``DIR/<role>.json`` when it exits.

Invariants:
- Unset (the normal path), every function here is a dictionary lookup and a return: no clock is read, nothing is
  written, the sampler's hooks are left as they are.
- A mark is ``(name, time.time())``, wall-clock seconds since the epoch, so marks of different processes (and
  the benchmark's own launch time) are on one time line. ``start`` is the process's creation time from
  ``/proc/self/stat`` (Linux), so interpreter start-up and module imports before ``main()`` are counted.
- A mark names the end of a phase; the phase's time is the gap to the mark before it.
"""

from __future__ import annotations

import atexit
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["ENV", "enabled", "forked", "mark", "timed_control", "write"]

ENV = "CP_INFER_TIMINGS"
_WRITE_NOW = frozenset({"warm-up", "ready"})
"""Marks after which a server's processes write their marks at once: they are stopped by a signal, not ended."""
_marks: list[tuple[str, float]] = []


def enabled() -> bool:
    return bool(os.environ.get(ENV))


def _process_start() -> float:
    """This process's creation time, seconds since the epoch (``time.time()`` where ``/proc`` is missing)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def write() -> None:
    """Write this process's marks now (at exit, with ``atexit``, unless it ends without it: a forked rank)."""
    if not os.environ.get(ENV) or not _marks:
        return
    role = "launcher" if "LOCAL_RANK" not in os.environ else f"rank{os.environ.get('RANK', '0')}"
    folder = Path(os.environ[ENV])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{role}.json").write_text(json.dumps({"role": role, "pid": os.getpid(), "marks": _marks}))


def forked() -> None:
    """In a process forked from one with marks: start its own marks, at the fork."""
    if os.environ.get(ENV):
        _marks[:] = [("start", time.time())]


def mark(name: str) -> None:
    """The phase ``name`` ended now (the first mark of a process also records ``start``)."""
    if not os.environ.get(ENV):
        return
    if not _marks:
        _marks.append(("start", _process_start()))
        atexit.register(write)
    _marks.append((name, time.time()))
    if name in _WRITE_NOW:
        write()


def timed_control(control: Any) -> Any:
    """``control`` (a ``SampleControl``) with marks at the sampler's phases chained before its own hooks:
    ``text encode`` (prepare, up to the first step), ``steps``, ``decode``; ``control`` itself when timing is off."""
    if not os.environ.get(ENV):
        return control
    from cp_infer.sampler import SampleControl

    control = control or SampleControl()
    base_phase, base_step = control.on_phase, control.on_step
    first = [True]

    def on_phase(phase: str) -> None:
        mark({"denoise": "job start", "decode": "steps", "done": "decode"}.get(phase, phase))
        if base_phase:
            base_phase(phase)

    def on_step(done: int, total: int, seconds: float) -> None:
        if first[0]:
            first[0] = False
            _marks.append(("text encode", time.time() - seconds))  # prepare ends where the first step starts
        if base_step:
            base_step(done, total, seconds)

    return replace(control, on_phase=on_phase, on_step=on_step)
