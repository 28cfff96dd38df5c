"""Process plumbing the benchmark scripts share: rank processes that load once and then serve commands, and the
memory readings they report.

Invariants:
- A worker is ``target(*args, inbox, outbox)``, started with the spawn method. It answers every command it takes
  from ``inbox`` (and, once loaded, a first "ready" reply) with ``(index, "ok", payload)`` or, on any failure,
  ``(index, "error", traceback)``, where ``index`` is its position in the group; ``None`` on ``inbox`` ends it.
- Memory readings come from ``/proc/self/status`` (Linux); the peak is reset by ``clear_refs``.
"""

from __future__ import annotations

import ctypes
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from server.cli.launch import free_port

__all__ = ["RankGroup", "free_port", "reset_peak_rss", "set_malloc", "status_kib"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters


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


class RankGroup:
    """Worker processes, one per entry of ``worker_args``; ``call`` sends a command to each and returns the replies
    in order."""

    def __init__(self, label: str, target: Callable[..., None], worker_args: list[tuple[Any, ...]], *,
                 timeout_s: float) -> None:
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
