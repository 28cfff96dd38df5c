"""``python -m server.cli ...`` as real processes, each command once per test module, two at a time.

A command of the tiny models spends most of its few seconds importing torch and diffusers on one core, so a module
that runs its commands one after the other leaves half of a two-core machine idle. :class:`Commands` starts every
command of its table when the module's fixture makes it, two at a time, and ``result(key)`` waits for that one: a
test finds its command done or running. The commands write to folders of their own and share only the model cache,
which the fixture builds before (``ensure_default_model`` and friends), so running them side by side changes none of
their outputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

__all__ = ["AT_ONCE", "Commands", "cli_env"]

AT_ONCE = 2
"""Commands run side by side (the CI machine's cores)."""

REPO = Path(__file__).resolve().parents[3]


def cli_env(cache: str | os.PathLike) -> dict[str, str]:
    """This process's environment for a command: no torchrun variables, ``cache`` as the model cache, this checkout
    first on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env.update(CP_INFER_CACHE=os.fspath(cache), PYTHONPATH=str(REPO))
    return env


class Commands:
    """``table``: key -> the CLI's arguments, where ``{name}`` is replaced by ``fields[name]``; all started at once
    (:data:`AT_ONCE` at a time). ``result(key)`` waits for it; ``result(key, args)`` runs a command that is not in the
    table (its inputs made by the test) once. ``check``: a command that exits non-zero fails the test that asks for
    it, with its stderr (``context`` added to the message). ``text``: decode the output (else bytes)."""

    def __init__(self, table: Mapping[str, Sequence[str]], *, env: dict[str, str], cwd: Path,
                 fields: Mapping[str, object] = (), text: bool = True, check: bool = False, context: str = "",
                 timeout: float = 200):
        self.env, self.cwd, self.fields = env, cwd, dict(fields)
        self._text, self._check, self._context, self._timeout = text, check, context, timeout
        self._pool = ThreadPoolExecutor(max_workers=AT_ONCE, thread_name_prefix="cli-command")
        self._runs: dict[str, Future] = {}
        for key, args in table.items():
            self._start(key, args)

    @property
    def out(self) -> Path:
        """``fields["out"]``: the folder the commands write to, where a module's table has one."""
        return Path(self.fields["out"])

    def _start(self, key: str, args: Sequence[str]) -> None:
        argv = [sys.executable, "-m", "server.cli", *(str(a).format(**self.fields) for a in args)]
        self._runs[key] = self._pool.submit(subprocess.run, argv, env=self.env, cwd=self.cwd, capture_output=True,
                                            text=self._text, timeout=self._timeout)

    def result(self, key: str, args: Sequence[str] | None = None) -> subprocess.CompletedProcess:
        if key not in self._runs:
            assert args is not None, f"{key}: not in the table, and no arguments given"
            self._start(key, args)
        proc = self._runs[key].result()
        if self._check and proc.returncode != 0:
            err = proc.stderr if self._text else proc.stderr.decode(errors="replace")
            raise AssertionError(f"{key}: exit {proc.returncode}{self._context}\nstderr:\n{err[-4000:]}")
        return proc

    def close(self) -> None:
        """Waits for the commands still running (a module whose tests did not ask for them all)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Commands:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
