"""Start the CLI's worker group: ``cp-infer ... --nproc N`` re-executes itself under torchrun.

Invariants:
- The relaunched command is the same CLI with the same arguments minus ``--nproc``, so every rank parses
  exactly what the user typed and the leader (rank 0) and the workers agree on the request.
- Launched from inside torchrun (``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK`` set) nothing is relaunched: the CLI
  is already one rank of a group.
- A leader that ends cleanly (its group stopped in step) exits 0 to torchrun and passes its own exit code (1: a
  failed job, invalid batch lines) back through a status file, so torchrun does not report such an outcome as a
  crashed rank. A rank that crashes exits non-zero, and torchrun's code is returned.
- The child sees this process's environment, plus the folder this package was imported from on
  ``PYTHONPATH`` (so every rank runs this very code) and, unless the user set it, ``OMP_NUM_THREADS`` at the
  machine's cores split between the ranks (torchrun's own default is 1 thread per rank).
- With ``stdout`` (``generate --out -``), torchrun and its ranks get that file as their stdout, and torchrun is
  told not to touch the ranks' streams (``--redirects 0 --tee 0``, no rank filter; these override any ``PET_*``
  settings): by default torchrun's ranks inherit its stdout and write to it directly, unprefixed and unbuffered,
  whereas a tee would go through log files and prefix every line with its rank. Bytes thus go from rank 0 to the
  pipe with no copy in between.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

__all__ = ["group_size", "in_torchrun", "leader_exit_code", "relaunch_under_torchrun", "strip_nproc"]

_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
_STATUS_ENV = "CP_INFER_LEADER_STATUS"


def in_torchrun() -> bool:
    """True when this process is a rank started by torchrun (or anything that sets its variables)."""
    return any(name in os.environ for name in _TORCHRUN_ENV)


def strip_nproc(argv: list[str]) -> list[str]:
    """``argv`` without ``--nproc N`` / ``--nproc=N``."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def leader_exit_code(code: int) -> int:
    """The exit code for a leader whose group ended in step: ``code`` itself, unless ``relaunch_under_torchrun``
    started this group, in which case ``code`` goes to the status file and torchrun sees 0."""
    path = os.environ.get(_STATUS_ENV)
    if not path or code == 0:
        return code
    Path(path).write_text(str(code))
    return 0


def group_size(nproc: int | None) -> int:
    """Ranks of the group: ``--nproc`` outside torchrun, torchrun's world inside it (they must agree)."""
    if not in_torchrun():
        nproc = 1 if nproc is None else nproc
        if nproc < 1:
            raise ValueError(f"--nproc {nproc}: use 1 or more ranks")
        return nproc
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if nproc is not None and nproc != world:
        raise ValueError(f"--nproc {nproc} but torchrun started {world} rank(s); drop --nproc under torchrun")
    return world


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def relaunch_under_torchrun(nproc: int, argv: list[str], *, stdout: IO[bytes] | None = None) -> int:
    """Run ``python -m torch.distributed.run --standalone --nproc_per_node N -m server.cli <argv>`` and wait.

    ``argv`` is the CLI's own argument list (without the program name); ``--nproc`` is removed from it.
    Returns the leader's exit code when the group ended in step (see :func:`leader_exit_code`), else torchrun's
    (non-zero when any rank failed). SIGINT/SIGTERM to this process reach the group: torchrun stops every rank.
    ``stdout``: the group's stdout, passed through to the ranks untouched (see the module docstring).
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    if in_torchrun():
        raise RuntimeError("already running under torchrun; the CLI must not start a group from inside one")
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", str(max(1, _cpu_count() // nproc)))
    streams = [] if stdout is None else ["--redirects=0", "--tee=0", "--local-ranks-filter="]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *streams,
               "-m", "server.cli", *strip_nproc(argv)]
    with tempfile.TemporaryDirectory(prefix="cp-infer-") as tmp:
        status = Path(tmp) / "leader-exit-code"
        env[_STATUS_ENV] = str(status)
        code = _run(command, env, stdout)
        if code == 0 and status.is_file():
            return int(status.read_text())
        return code


def _run(command: list[str], env: dict[str, str], stdout: IO[bytes] | None = None) -> int:
    # NOTE(signals): a session of its own, so a terminal's Ctrl-C reaches torchrun once (forwarded from here),
    # not twice (a second SIGINT would interrupt torchrun while it is stopping the ranks).
    child = subprocess.Popen(command, env=env, start_new_session=True, stdout=stdout)

    def forward(signum, _frame):
        # torchrun turns SIGTERM/SIGINT into stopping every rank; we only pass it on.
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
