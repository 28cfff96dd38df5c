"""What an operator sees of each process: its title (``ps``, ``top``) and where its full log is.

Invariants:
- Every process of a group has a title that says what it is: ``cp-infer serve: rank 1/2, replica 0`` for a rank,
  ``cp-infer generate: launcher of 2 ranks`` for the ``--nproc`` launcher (``setproctitle``).
- Every rank writes its whole log (every record at INFO and above, and the traceback of any error that ends it) to
  ``rank{R}.log`` in the group's log folder, :func:`log_dir`; the launcher writes torchrun's own log there too
  (``launcher.log``). The terminal gets one line per failure, naming the file.
- The log folder is ``$CP_INFER_LOG_DIR`` when set (the launcher sets it for its ranks, so they all agree); else
  one folder per group under the system's temporary folder, named by torchrun's run id (the same on every rank).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import setproctitle

__all__ = ["LOG_DIR_ENV", "PROG", "attach_rank_log", "last_failure", "log_dir", "log_failure", "new_log_dir",
           "rank_log", "set_rank_title", "set_title"]

LOG_DIR_ENV = "CP_INFER_LOG_DIR"
_FAILURE_LOGGER = "cp_infer.failure"
PROG = "cp-infer"


def set_title(command: str, what: str) -> None:
    """Title this process ``cp-infer COMMAND: WHAT`` (e.g. ``rank 1/2, replica 0``)."""
    setproctitle.setproctitle(f"{PROG} {command}: {what}")


def new_log_dir() -> Path:
    """A fresh log folder for one launch (``$CP_INFER_LOG_DIR`` itself when set)."""
    if os.environ.get(LOG_DIR_ENV):
        return Path(os.environ[LOG_DIR_ENV])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path(tempfile.gettempdir()) / f"{PROG}-logs" / f"{stamp}-{os.getpid()}"


def log_dir() -> Path:
    """This group's log folder (see the module docstring); not created here."""
    if os.environ.get(LOG_DIR_ENV):
        return Path(os.environ[LOG_DIR_ENV])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or f"pid-{os.getpid()}"
    return Path(tempfile.gettempdir()) / f"{PROG}-logs" / run_id


def rank_log(rank: int) -> Path:
    """Rank ``rank``'s log file in this group's folder."""
    return log_dir() / f"rank{rank}.log"


def attach_rank_log(rank: int, fmt: str) -> Path | None:
    """Send every record at INFO and above to :func:`rank_log` too, whatever the terminal shows; None where the
    folder cannot be made (the terminal still has what it shows)."""
    path = rank_log(rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError:
        return None
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s " + fmt))
    root = logging.getLogger()
    for terminal in root.handlers:  # the terminal keeps the level it had; the file gets INFO too
        if terminal.level == logging.NOTSET:
            terminal.setLevel(root.level)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return path


def log_failure(exc: BaseException) -> Path | None:
    """Write ``exc`` with its traceback to this rank's log file alone (not the terminal), its first line findable by
    :func:`last_failure`; the file, or None when this rank keeps none."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    summary = f"{type(exc).__name__}: {exc}".splitlines()[0]
    record = logging.LogRecord(_FAILURE_LOGGER, logging.ERROR, __file__, 0, summary, None,
                               (type(exc), exc, exc.__traceback__))
    with _termination_ignored():
        for handler in files:
            handler.handle(record)
            handler.flush()
    return Path(files[0].baseFilename) if files else None


@contextlib.contextmanager
def _termination_ignored():
    """SIGTERM and SIGINT ignored in this block (main thread only; elsewhere a no-op).

    NOTE(failure-log): a failing rank writes its traceback while torchrun, which saw a peer die, terminates the
    group; torchrun's SIGTERM handler raises inside the handler's formatting, and logging then prints its own
    "--- Logging error ---" traceback to the terminal and leaves the log without the failure. The rank is exiting
    anyway: the signal is dropped, not re-raised, and the handlers are put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which signal() cannot put back
                signal.signal(signum, handler)


def last_failure(path: Path) -> str | None:
    """The one-line summary of the last error :func:`log_failure` wrote to ``path`` (``RuntimeError: ...``)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    marker = f" {_FAILURE_LOGGER}: "
    found = [line.split(marker, 1)[1] for line in lines if marker in line]
    return found[-1] if found else None


def set_rank_title(rank: int, world: int, replica: int) -> None:
    """Title a rank by its place in the group, keeping the command its title already names."""
    current = setproctitle.getproctitle()
    command = current.split(":", 1)[0].removeprefix(f"{PROG} ") if current.startswith(f"{PROG} ") else "rank"
    set_title(command, f"rank {rank}/{world}, replica {replica}")
