"""Replica groups behind one front end: global rank 0 drives every other replica group through its leader.

A world laid out as ``R`` replicas (``cp_infer.mesh``: ``world = R x guidance x Ulysses``) runs ``R`` jobs at once.
Rank 0 leads the first replica itself (``server.group.runtime.GroupDriver``); for each other replica it holds a
:class:`RemoteDriver`, which has the same ``generate`` / ``ping`` / ``stop`` as ``GroupDriver``, so the server's
leader runs a job on either the same way. The replica's leader runs :func:`replica_loop`: it takes each command over
its link and drives its own group with it, exactly as rank 0 drives the first (its other ranks run
``worker_loop``).

Invariants:
- A link (``ParallelState.links``) is a gloo group of rank 0 and one replica's leader; on each side one thread uses
  it (rank 0: that replica's lane thread in ``server.group.leader``; the replica's leader: its main thread), and the two
  strictly take turns: rank 0 sends a command, then only answers what the replica sends until the job's end
  message (``done``, ``cancelled``, ``failed`` or ``fatal``) or the heartbeat's ``pong``.
- The replica's sampler hooks run on rank 0: every hook rank 0's control sets is forwarded (its name and arguments);
  ``poll`` and a live video's ``extend`` are round trips, so cancel, progress, checkpoints, streamed frames and the
  soundtrack reach the front end as they do from the first replica. Rank 0's hooks never raise into the protocol: an
  exception in one is kept and fails that job (``JobFailed``) once the replica has left it, and the replica goes on.
- A job's agreed failure or cancel (``JobFailed`` / ``JobCancelled`` on every rank of its replica) ends that job
  only; no other replica is involved. Anything else escaping a replica's leader (its group may be out of step) is
  reported as ``fatal`` and the process exits, as rank 0 does for its own replica: torchrun then restarts the
  whole world (its agent restarts every rank when one fails), and the queue, in SQLite, runs again, long videos
  from their last checkpoint.
- Fault rules (``$CP_INFER_TEST_FAULT``) of a replica's ranks act in those ranks' processes; rank 0 applies its
  own only to the jobs its own replica runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from cp_infer.sampler import JobCancelled, JobFailed, SampleControl, StepStatus, job_failure

if TYPE_CHECKING:
    from cp_infer.request import GenerationRequest
    from server.group.runtime import Runtime

__all__ = ["Link", "RemoteDriver", "replica_loop"]

log = logging.getLogger("cp_infer.replicas")


class Link:
    """Picklable objects between global rank 0 and one replica's leader, over their two-rank gloo group."""

    def __init__(self, group: dist.ProcessGroup, peer: int):
        self.group, self.peer = group, peer

    def send(self, obj: Any) -> None:
        dist.send_object_list([obj], dst=self.peer, group=self.group)

    def recv(self) -> Any:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=self.peer, group=self.group)
        return box[0]


def _hooks(control: SampleControl) -> tuple[str, ...]:
    """The names of the ``on_*`` hooks ``control`` sets (what the replica forwards)."""
    return tuple(f.name for f in fields(SampleControl) if f.name.startswith("on_") and getattr(control, f.name))


class RemoteDriver:
    """Rank 0's driver of another replica group (``GroupDriver``'s methods, over the replica's link).

    ``runtime`` is rank 0's own: the model there answers what a request is checked and planned against (every
    replica loads the same model); its groups are never used for this replica's jobs.
    """

    local = False
    """Rank 0's own fault rules do not apply to the jobs of this replica."""

    def __init__(self, runtime: Runtime, replica: int):
        state = runtime.state
        self.runtime, self.replica = runtime, replica
        self.leader_rank = replica * len(state.replica_ranks)
        self.link = Link(state.link(replica), self.leader_rank)
        self.jobs_sent = 0

    def generate(self, request: GenerationRequest, job_id: str, control: SampleControl | None = None) -> Any:
        """Run ``request`` on the replica; raises ``JobCancelled`` / ``JobFailed`` as ``GroupDriver.generate``."""
        from server.group.runtime import Command

        control = control or SampleControl()
        self.link.send(("generate", Command("generate", request=request, job_id=job_id, resume=control.resume,
                                            live=control.live), _hooks(control), control.collect))
        self.jobs_sent += 1
        hook_error: str | None = None
        while True:
            kind, *args = self.link.recv()
            if kind == "poll":
                try:
                    status = control.poll(args[0]) if control.poll else StepStatus.OK
                    self.link.send(("status", int(status)))
                except Exception as exc:  # noqa: BLE001 -- the replica's sampler agrees on it as an error
                    self.link.send(("raise", f"{type(exc).__name__}: {exc}"))
            elif kind == "extend":  # a live video's directions: a round trip, as poll
                try:
                    self.link.send(("answer", control.extend(*args) if control.extend else None))
                except Exception as exc:  # noqa: BLE001 -- the replica's sampler agrees on it as an error
                    self.link.send(("raise", f"{type(exc).__name__}: {exc}"))
            elif kind == "hook":
                name, hook_args = args
                try:
                    getattr(control, name)(*hook_args)
                except Exception as exc:  # noqa: BLE001 -- kept for the job's end: the protocol goes on
                    log.exception("job %s: rank 0's %s hook failed (replica %d)", job_id, name, self.replica)
                    hook_error = hook_error or f"rank 0 ({name}): {type(exc).__name__}: {exc}"
            elif kind == "done":
                if hook_error:
                    raise JobFailed(hook_error)
                return args[0]
            elif kind == "cancelled":
                raise JobCancelled(args[0])
            elif kind == "failed":
                raise job_failure(*args)
            elif kind == "fatal":
                raise RuntimeError(f"replica {self.replica} failed: {args[0]}")
            else:
                raise RuntimeError(f"replica {self.replica} sent an unknown message {kind!r}")

    def ping(self) -> None:
        """A heartbeat round trip over the replica's whole group."""
        self.link.send(("ping",))
        answer = self.link.recv()
        if answer != ("pong",):
            raise RuntimeError(f"replica {self.replica} answered a heartbeat with {answer!r}")

    def stop(self) -> None:
        self.link.send(("stop",))


def replica_loop(runtime: Runtime) -> None:
    """A replica's leader: run rank 0's commands on this replica group until ``stop``."""
    from server.group.runtime import FAULT_ENV, GroupDriver, parse_faults, with_faults

    state = runtime.state
    link = Link(state.link(state.replica), 0)
    group = GroupDriver(runtime)
    faults = parse_faults(os.environ.get(FAULT_ENV))

    def poll(i: int) -> StepStatus:
        link.send(("poll", i))
        kind, value = link.recv()
        if kind == "raise":
            raise RuntimeError(value)
        return StepStatus(value)

    def extend(passes_done: int, request: GenerationRequest):
        link.send(("extend", passes_done, request))
        kind, value = link.recv()
        if kind == "raise":
            raise RuntimeError(value)
        return value

    def forward(name: str):
        return lambda *args: link.send(("hook", name, args))

    while True:
        kind, *args = link.recv()
        if kind == "stop":
            group.stop()
            return
        if kind == "ping":
            group.ping()
            link.send(("pong",))
            continue
        command, hooks, collect = args
        control = SampleControl(poll=poll, resume=command.resume, collect=collect, live=command.live,
                                extend=extend if command.live else None)
        control = replace(control, **{name: forward(name) for name in hooks})
        control = with_faults(control, command.request, rank=state.rank, rules=faults, model=group.runtime.model)
        try:
            frames = group.generate(command.request, command.job_id, control)
        except JobCancelled as exc:
            link.send(("cancelled", str(exc)))
            continue
        except JobFailed as exc:
            log.info("job %s failed on replica %d: %s", command.job_id, state.replica, exc)
            link.send(("failed", str(exc), exc.code))
            continue
        except BaseException as exc:
            log.error("replica %d: job %s left the group out of step (%s: %s)", state.replica, command.job_id,
                      type(exc).__name__, exc)
            try:
                link.send(("fatal", f"rank {state.rank}: {type(exc).__name__}: {exc}"))
            finally:
                raise
        link.send(("done", frames))
