"""Start the CLI's worker group: ``cp-infer ... --nproc N`` runs torchrun's elastic agent in this process.

Invariants:
- The group is torchrun's own (``torch.distributed.run``'s argument parsing, rendezvous and agent, ``--standalone
  --nproc_per_node N``), run in this process rather than in a second interpreter. On CPU the ranks are forked from
  this process once it has checked the command (imports done, the model's configs read), so they start with
  torch, diffusers and the model code already imported; elsewhere (CUDA cannot be used in a forked child) they
  are ``python -m server.cli``, started by the agent. Either way a rank gets a session of its own, so a
  terminal's Ctrl-C reaches the agent once and the agent stops the group.
- A rank runs the same CLI with the same arguments minus ``--nproc``, so every rank parses exactly what the user
  typed and the leader (rank 0) and the workers agree on the request.
- Launched from inside torchrun (``TORCHELASTIC_RUN_ID`` or ``LOCAL_RANK`` set) nothing is relaunched: the CLI
  is already one rank of a group.
- A leader that ends cleanly (its group stopped in step) exits 0 to torchrun and passes its own exit code (1: a
  failed job, invalid batch lines) back through a status file, so torchrun does not report such an outcome as a
  crashed rank. A rank that crashes exits non-zero, and the launcher exits 1, as torchrun does.
- The ranks see this process's environment, plus the folder this package was imported from on
  ``PYTHONPATH`` (so every rank runs this very code) and, unless the user set it, ``OMP_NUM_THREADS`` at the
  machine's cores split between the ranks (torchrun's own default is 1 thread per rank).
- With ``stdout`` (``generate --out -``), the ranks get that file as their fd 1, and torchrun is told not to touch
  the ranks' streams (``--redirects 0 --tee 0``, no rank filter; these override any ``PET_*`` settings): the ranks
  write to it directly, unprefixed and unbuffered, whereas a tee would go through log files and prefix every
  line with its rank. Bytes thus go from rank 0 to the pipe with no copy in between.
- With a restart policy (``serve``) the agent itself never restarts (torchrun's ``max_restarts`` is 0: it counts
  restarts over the agent's lifetime, with no rate): when the ranks fail,
  :func:`server.group.restarts.supervise` decides
  and each restart is a fresh agent with a fresh rendezvous. A rank reads the count so far through
  :func:`count_launcher_restarts`.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import tempfile
import traceback
import uuid
from pathlib import Path
from typing import IO

from server.group import process
from server.group.restarts import RestartPolicy, RoundResult, supervise

__all__ = ["count_launcher_restarts", "free_port", "group_size", "in_torchrun", "leader_exit_code",
           "relaunch_under_torchrun", "strip_nproc", "under_launcher"]

_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
_STATUS_ENV = "CP_INFER_LEADER_STATUS"
_RESTARTS_ENV = "CP_INFER_GROUP_RESTARTS"
PROG_LAUNCH = "torchrun"
# What every rank runs: torchrun starts it as ``python -m``; a rank forked from the launcher runs it in place.
RANK_MODULE = "server.cli"


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


def under_launcher() -> bool:
    """In a rank: whether :func:`relaunch_under_torchrun` started this group (it reports a rank's failure itself)."""
    return _STATUS_ENV in os.environ


def count_launcher_restarts() -> int:
    """In a rank: make ``TORCHELASTIC_RESTART_COUNT`` (torchrun's count, which a launcher restart, a fresh agent,
    resets to 0) count the restarts :func:`relaunch_under_torchrun` made too, and return it. Idempotent."""
    count = int(os.environ.pop(_RESTARTS_ENV, "0")) + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(count)
    return count


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


def relaunch_under_torchrun(nproc: int, argv: list[str], *, stdout: IO[bytes] | None = None,
                            device: str | None = None, restarts: RestartPolicy | None = None) -> int:
    """Run torchrun's ``--standalone --nproc_per_node N -m server.cli <argv>`` in this process and wait.

    ``argv`` is the CLI's own argument list (without the program name); ``--nproc`` is removed from it.
    Returns the leader's exit code when the group ended in step (see :func:`leader_exit_code`), else torchrun's
    (1 when any rank failed or a signal stopped the group). SIGINT/SIGTERM to this process stop every rank, as
    they do torchrun's. ``stdout``: the group's stdout, passed through to the ranks untouched (see the module
    docstring). ``device``: the ranks' ``--device``; on CPU they are forked from this process (see ``_run_agent``).
    ``restarts``: start the group again when its ranks fail, as far as the policy allows (``server.group.restarts``);
    None: one run.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    if in_torchrun():
        raise RuntimeError("already running under torchrun; the CLI must not start a group from inside one")
    env = {}
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, _cpu_count() // nproc))
    streams = [] if stdout is None else ["--redirects=0", "--tee=0", "--local-ranks-filter="]
    own_restarts = [] if restarts is None else ["--max-restarts=0"]  # overrides PET_MAX_RESTARTS: supervise decides
    torchrun_argv = ["--standalone", f"--nproc_per_node={nproc}", *streams, *own_restarts, "-m", RANK_MODULE,
                     *strip_nproc(argv)]
    logs = process.new_log_dir()
    env[process.LOG_DIR_ENV] = str(logs)
    process.set_title(argv[0] if argv else "launcher", f"launcher of {nproc} ranks")
    with tempfile.TemporaryDirectory(prefix="cp-infer-") as tmp:
        status = Path(tmp) / "leader-exit-code"
        env[_STATUS_ENV] = str(status)
        fork_argv = strip_nproc(argv) if _fork_ranks(device) else None

        def run_round(restarts_so_far: int) -> RoundResult:
            env[_RESTARTS_ENV] = str(restarts_so_far)
            status.unlink(missing_ok=True)
            result = _run_agent(torchrun_argv, env, stdout, fork_argv, logs)
            if result.code == 0 and status.is_file():
                return RoundResult(int(status.read_text()))
            return result

        if restarts is None:
            return run_round(0).code
        return supervise(run_round, restarts)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS's pick): the agent's store here; servers and groups in tests and
    benchmarks."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _fork_ranks(device: str | None) -> bool:
    """Whether the ranks may be forked from this process: on CPU, where no CUDA context can have been made here
    (a forked child cannot use one)."""
    import torch

    return device == "cpu" or (torch.version.cuda is None and torch.version.hip is None)


def _forked_rank(argv: list[str]) -> None:
    """A rank forked from the launcher (torchrun's agent has set its environment): the module a started rank runs
    (``python -m server.cli``, :data:`RANK_MODULE`) with ``argv``, the launcher's modules already imported, set up as
    a fresh rank process is."""
    import logging

    import torch

    from server.group import phases

    with contextlib.suppress(OSError):
        os.setsid()  # like torchrun's own ranks: a terminal's Ctrl-C reaches the agent, which stops the group
    sys.stdout = sys.__stdout__  # the launcher points sys.stdout at stderr while the group runs
    # NOTE(threads): OpenMP read OMP_NUM_THREADS when torch was imported in the launcher, before the agent set it.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    logging.root.handlers.clear()  # main() configures logging for this rank
    phases.forked()
    sys.argv = [RANK_MODULE, *argv]
    try:
        runpy.run_module(RANK_MODULE, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # the module's sys.exit(main())
        code = exc.code
    phases.write()
    if code:
        raise SystemExit(code)  # torchrun's agent sees the exit code, as of a rank it started itself


def _failure_cause(exc) -> str:
    """The failed ranks of a ``ChildFailedError`` in a few words, those a signal killed first (the others mostly
    exited because of them; torchrun's timestamps are whole seconds): ``rank 1 (pid 123) killed by SIGKILL; rank 0
    (pid 122) exited with code 1``. NOTE(causes): torchrun reports the ranks it saw fail when it looked, which can
    be only a leader that exited because a worker had died (the leader's log says which)."""
    def cause(rank, failure) -> str:
        if failure.exitcode < 0:
            return f"rank {rank} (pid {failure.pid}) killed by {failure.signal_name()}"
        return f"rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}"

    order = sorted(exc.failures.items(), key=lambda item: (item[1].exitcode >= 0, item[1].timestamp, item[0]))
    return "; ".join(cause(rank, failure) for rank, failure in order)


class _AgentLog:
    """While the agent runs, torchrun's own loggers (the agent's, and torch.multiprocessing's that stops ranks) write
    to ``logs/launcher.log`` instead of the terminal; ``logs`` None: nothing changes."""

    _LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")

    def __init__(self, logs: Path | None):
        import logging

        self._handler, self._saved = None, []
        if logs is None:
            return
        try:
            logs.mkdir(parents=True, exist_ok=True)
            self._handler = logging.FileHandler(logs / "launcher.log", encoding="utf-8")
        except OSError:
            return
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        for name in self._LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, logger.propagate))
            logger.addHandler(self._handler)
            logger.propagate = False

    def write(self, text: str) -> None:
        if self._handler is not None:
            self._handler.stream.write(text)
            self._handler.flush()

    def close(self) -> None:
        for logger, propagate in self._saved:
            logger.removeHandler(self._handler)
            logger.propagate = propagate
        if self._handler is not None:
            self._handler.close()


def _run_agent(torchrun_argv: list[str], env: dict[str, str], stdout: IO[bytes] | None,
               fork_argv: list[str] | None = None, logs: Path | None = None) -> RoundResult:
    """torchrun (``torch.distributed.run``) with ``torchrun_argv``, its elastic agent in this process: what the
    command line tool does, without a second interpreter importing torch again. With ``fork_argv`` the ranks are
    forked from this process (``_forked_rank(fork_argv)``) instead of started as ``python -m server.cli``, so they
    do not import torch, diffusers and the model code again either.

    The ranks are started with this process's environment plus ``env`` (torchrun copies ``os.environ`` when it
    starts them; restored afterwards) and, with ``stdout``, that file as their fd 1. Returns code 0 when the
    group ended in step, else 1, with the failed rank as the ``failure`` when the ranks failed (not a signal).
    torchrun's own log goes to ``logs/launcher.log``, and a failure is one line naming the rank's log there."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    saved_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    saved_fd1 = None
    quiet = _AgentLog(logs)
    try:
        args = torchrun.parse_args(torchrun_argv)
        if stdout is not None:
            # NOTE(stdout): the ranks inherit fd 1, so it is the video while they run; anything this process
            # prints meanwhile goes to stderr (sys.stdout is pointed there), never into the video.
            sys.stdout.flush()
            saved_fd1 = os.dup(1)
            os.dup2(stdout.fileno(), 1)
        with contextlib.redirect_stdout(sys.stderr):
            if fork_argv is None:
                torchrun.run(args)
            else:
                # One node: torchrun's static rendezvous (the agent's TCPStore on a port picked here) rather than
                # --standalone's c10d one, whose first round sleeps a random 0-0.3 s to spread the joins of many
                # nodes; and the agent looks at its ranks every 20 ms rather than 100 (it sees them end sooner).
                args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "static", "", str(uuid.uuid4())
                args.master_addr, args.master_port, args.node_rank = "127.0.0.1", free_port(), 0
                args.monitor_interval = 0.02
                config, _cmd, _cmd_args = torchrun.config_from_args(args)
                config.start_method = "fork"
                elastic_launch(config=config, entrypoint=_forked_rank)(fork_argv)
        return RoundResult(0)
    except ChildFailedError as exc:
        # One line where torchrun prints its failure report (the report itself goes to launcher.log).
        cause = _failure_cause(exc)
        quiet.write("".join(traceback.format_exception_only(exc)))
        first_rank, _failure = exc.get_first_failure()
        where = ""
        if logs is not None:
            rank_log = logs / f"rank{first_rank}.log"
            error = process.last_failure(rank_log)
            where = (f": {error}" if error else "") + f"; its log: {rank_log} (the group's: {logs})"
        print(f"{process.PROG}: {cause}{where}", file=sys.stderr, flush=True)
        return RoundResult(1, failure=cause)
    except SignalException as exc:
        # torchrun has stopped every rank; the tool itself exits 1 this way.
        print(f"{PROG_LAUNCH}: stopped by signal {exc.sigval.name}", file=sys.stderr, flush=True)
        return RoundResult(1)
    finally:
        quiet.close()
        if saved_fd1 is not None:
            os.dup2(saved_fd1, 1)
            os.close(saved_fd1)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
