"""A harness for multi-rank tests: N real processes on a free port, gloo on CPU.

A ``WorkerGroup`` is started once (per test module) and then runs any number of picklable top-level
functions ``fn(state, *args)`` on every rank. Every rank's traceback comes back to the test on failure,
and no call can hang: past its timeout the whole group is killed and the test fails.

The ranks are forked from a ``multiprocessing`` fork server that has imported torch, diffusers and the engine once
(``PRELOAD``), so a group starts in a fraction of a second instead of each rank importing them again (seconds of
CPU per rank; the suite starts about a hundred groups). The fork server only imports: it runs no torch op, so no
thread pool is forked. A rank takes the test process's environment as it is when the group starts (a fork server's
child would otherwise see the environment the server was started with).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from server.cli.launch import free_port

__all__ = ["WorkerGroup", "fork_context", "fork_process", "free_port", "one_thread", "RankError"]


class RankError(AssertionError):
    """One or more ranks raised; the message holds every rank's traceback."""


def one_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with torch on one intra-op thread, as every worker rank runs (a 1-rank reference then
    sums in the same order as the ranks it is compared with); the thread count is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


PRELOAD = ["torch", "torch.distributed", "cp_infer.sampler", "models.registry", "models.common.loading",
           "models.common.lora", "models.common.placement",
           *(f"models.{family}.{part}" for family in ("ltx_video", "ltx2", "wan", "helios")
             for part in ("adapter", "default", "loading", "parallel"))]
"""What the fork server imports before it forks any rank (a name that fails to import is skipped)."""

_context = None


def fork_context():
    """The ``forkserver`` context, its preload set before its server starts (once per test process): its queues are
    the ones :func:`fork_process`'s processes take."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _in_env(env: dict[str, str], target: Callable[..., Any], *args: Any) -> Any:
    os.environ.clear()
    os.environ.update(env)
    return target(*args)


def fork_process(target: Callable[..., Any], *args: Any):
    """A daemon process of the fork server (:func:`fork_context`) that runs ``target(*args)`` in this process's
    environment as it is now (a fork server's child would otherwise start with the server's); not started."""
    return fork_context().Process(target=_in_env, args=(dict(os.environ), target, *args), daemon=True)


def _worker(rank: int, world: int, port: int, inbox, outbox, threads: int, layout: dict) -> None:
    import torch

    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        from cp_infer import ParallelConfig, init_parallel

        state = init_parallel(ParallelConfig(backend="gloo", device="cpu", timeout_s=60, **layout),
                              rank=rank, world_size=world, local_rank=rank)
        outbox.put((rank, "ready", None))
    except BaseException:
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args = job
        try:
            outbox.put((rank, "ok", fn(state, *args)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))


class WorkerGroup:
    def __init__(self, world: int, *, threads: int = 1, start_timeout: float = 120.0,
                 guidance_degree: int | None = None, ulysses_degree: int | None = None,
                 ring_degree: int | None = None):
        """``guidance_degree``/``ulysses_degree``/``ring_degree``: the mesh layout (``ParallelConfig``; default:
        Ulysses only)."""
        self.world = world
        self.closed = False
        layout = dict(guidance_degree=guidance_degree, ulysses_degree=ulysses_degree, ring_degree=ring_degree)
        ctx = fork_context()
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self._procs = [fork_process(_worker, r, world, port, self._inboxes[r], self._outbox, threads, layout)
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self._collect("startup", start_timeout)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 300.0) -> list[Any]:
        """Run ``fn(state, *args)`` on every rank; return the results in rank order."""
        for box in self._inboxes:
            box.put((fn, args))
        return self._collect(getattr(fn, "__name__", str(fn)), timeout)

    def _collect(self, what: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.world:
            try:
                rank, kind, payload = self._outbox.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if time.monotonic() > deadline or (dead and not errors):
                    self.close()
                    detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                    raise RankError(f"{what}: no answer within the time limit or ranks {dead} died; "
                                    f"finished ranks {sorted(results)}\n{detail}") from None
                continue
            if kind == "error":
                errors[rank] = payload
                # The other ranks may now wait forever in a collective: give them a short grace period.
                deadline = min(deadline, time.monotonic() + 10)
            else:
                results[rank] = payload
        if errors:
            self.close()
            detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{what} failed on ranks {sorted(errors)}:\n{detail}")
        return [results[r] for r in range(self.world)]

    @property
    def usable(self) -> bool:
        """Not closed and every rank alive: a group a later test can run on."""
        return not self.closed and all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        self.closed = True
        for box in self._inboxes:
            with contextlib.suppress(ValueError, OSError):
                box.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
