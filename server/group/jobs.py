"""The job store: the queue and every job's record in a database (``server.group.database``: the embedded SQLite file,
or PostgreSQL shared by a fleet of servers), its files in an output store (``server.outputs.store``: the local
folder, or S3), both named by the server-made job id.

Invariants:
- Job ids are made here (``video_`` + 32 hex digits) and are the only names of output files, so a path never
  contains client text; :func:`valid_job_id` gates every id that arrives in a URL.
- Fair turns, FIFO within a tenant: a claim takes the oldest queued job (by insertion order) of the tenant whose
  last claim is the longest ago (``server.group.tenants``: round-robin across the tenants with queued jobs), in one
  statement whose row lock skips rows another server is claiming, and re-checks that the job is still queued, so a
  job is claimed once, and either claimed or cancelled/deleted, never both. With one tenant this is plain FIFO.
- A claim is an attempt (``attempts`` + 1) with a lease (``lease_s``, on the database's clock) that a thread of
  this store renews while the job runs. A shared store takes back jobs whose lease ran out (their server died or
  froze) before its claims, at most every ``_POLL_S``; the embedded one takes back all its jobs in progress at
  :meth:`JobStore.recover` (one server: they are its dead group's). Every write of a running job carries its
  attempt and changes nothing unless that attempt is still the job's (progress, window, step-cache counts,
  checkpoint, the end); a lost claim's :meth:`JobStore.cancel_requested` is true, so its group stops within a step
  (a poll may answer from the row the job's write returned an instant before, :data:`_FRESH_S`, as a read then
  would).
- The embedded database survives restarts of the worker group and the death of the whole server (``kill -9`` of
  every process at any moment; not a power loss): it is in WAL mode, where a transaction is in the log once it
  returns (``synchronous=NORMAL`` syncs only at checkpoints, which is enough while the kernel outlives the process),
  and each change of a job is one transaction (:meth:`JobStore._transaction` around those of several statements).
  Files are removed only once the change that orphans them is committed, so a crash leaves extra files, never a
  live job without its lead or checkpoint.
- Outputs are made whole first and handed to the output store (:meth:`JobStore.publish`: a rename, or one PUT of
  the attempt's own key), and only then is the job marked ``completed``, in the guarded update that records the
  attempt whose files they are (``output_attempt``): a job's content is never a half-written MP4, nor a stale
  attempt's.
- A job that runs again (requeued at :meth:`JobStore.recover` or when its lease ran out) goes on from its last
  finished window's checkpoint (``.resume.npz``, the current attempt's: ``checkpoint_attempt``), unless it has
  already been started ``MAX_ATTEMPTS`` times (across the fleet): a job that takes its group down every time it runs
  is failed instead of taking it down forever. :meth:`JobStore.recover` also fails a ``completed`` job whose local
  MP4 is missing or cut short (``output_lost``) and sweeps what interrupted writes left (``*.tmp``, files of no job).
- ``progress`` never decreases while a job can go on from a checkpoint: a requeued job keeps the progress it had
  (at least its checkpoint's) from the requeue through its resume, whose steps only raise it again once past it. A
  job that starts over (no checkpoint, or an unreadable one: :meth:`JobStore.start_over`) goes back to 0.
- Every change of a job's visible state this server makes appends a snapshot to an in-memory event log (per job,
  bounded), which the SSE endpoint tails, so no such change is missed however slowly a client reads; with a shared
  store, a change made by another server's group is logged when a reader looks (the state then, at the rate it
  reads).
"""

from __future__ import annotations

import contextlib
import io
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from cp_infer.request import GenerationRequest
from server.group.database import open_database
from server.group.job_files import JobFiles
from server.group.job_record import TERMINAL, Job, Live, mp4_complete, request_to_json, row_to_job, valid_job_id
from server.group.job_record import mp4_complete as _mp4_complete  # noqa: F401 -- the tests' name for it
from server.group.job_record import request_from_json as _request_from_json  # noqa: F401 -- as above
from server.group.tenants import OPEN, Tenant, TenantLimit, Tenants
from server.outputs.store import StoreUnavailable, open_outputs

__all__ = ["Job", "JobStore", "Live", "LiveRefused", "QueueFull", "valid_job_id", "TERMINAL"]

log = logging.getLogger("cp_infer.jobs")

MAX_ATTEMPTS = 3
"""Times a job is started before a restart of the group fails it instead of running it again."""
_MAX_LOGGED_JOBS = 256

_POLL_S = 0.2
"""How often a shared store's idle claimer looks at the queue again."""
_FRESH_S = 0.1
"""How old a running job's row, returned by its last write, may be to answer its next cancel poll instead of a read."""


class QueueFull(Exception):
    def __init__(self, depth: int):
        super().__init__(f"the queue holds {depth} jobs, its limit")
        self.depth = depth


class LiveRefused(Exception):
    """A direction a job does not take (not live, ended, or over a limit): ``code`` and a message naming the fix."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


def _fence(attempt: int | None) -> tuple[str, tuple]:
    """The clause that makes a running job's write a no-op unless ``attempt`` is the job's current one."""
    return ("", ()) if attempt is None else (" AND attempts = ?", (attempt,))


class JobStore(JobFiles):
    """Thread-safe: the HTTP event loop, the leader's threads and the lease renewer share one connection behind one
    lock. ``job_store`` / ``output_store``: URLs (``server.group.database.open_database``,
    ``server.outputs.store.open_outputs``); ``None``: the embedded SQLite file and the folder in ``data_dir``.
    ``lease_s``: how long a claim holds without renewal; ``node``: this server's name in the fleet (pins the
    streamed jobs it accepts, whose client reads them from it)."""

    def __init__(self, data_dir: str | Path, *, max_queue: int, job_store: str | None = None,
                 output_store: str | None = None, lease_s: float = 30.0, node: str | None = None):
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        if not lease_s > 0:
            raise ValueError(f"lease_s={lease_s} must be > 0")
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.outputs = open_outputs(output_store, self.data_dir)
        self.videos_dir = self.outputs.folder
        self.max_queue = max_queue
        self.lease_s = lease_s
        self.node = node or f"node-{secrets.token_hex(6)}"
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._db = open_database(job_store, self.data_dir)
        self.shared = self._db.shared
        self.tenants = Tenants(self._db, self._lock)
        """The API keys, their limits and usage, in the same database."""
        self._event_seq = 0
        self._events: OrderedDict[str, list[tuple[int, dict[str, Any]]]] = OrderedDict()
        self._after_commit: list[Callable[[], None]] = []
        self._held: dict[str, int] = {}  # the jobs this server runs: id -> attempt (their leases are renewed)
        self._lost: set[tuple[str, int]] = set()  # claims whose lease another server took over
        self._written: dict[str, tuple[float, int, Any]] = {}  # job -> (when, attempt, row) of its last fenced write
        self._renewer: threading.Thread | None = None
        self._reaped_at = -float("inf")
        self._closed = threading.Event()
        self._cleaner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cp-infer-cleanup")
        self._uploads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="cp-infer-checkpoint")
        self._uploading: dict[str, Future] = {}  # job -> its checkpoint being uploaded

    @property
    def stores(self) -> tuple[str, str]:
        """The names of the job store and the output store (``/ready``)."""
        return self._db.name, self.outputs.name

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The statements inside commit together (the caller holds the lock); nested ones join the outer one. File
        removals asked for inside (:meth:`_remove`) run once it has committed."""
        if self._db.in_transaction:
            yield
            return
        try:
            with self._db.transaction():
                yield
        except BaseException:
            self._after_commit.clear()
            raise
        pending, self._after_commit = self._after_commit, []
        for remove in pending:
            remove()

    def _remove(self, remove: Callable[[], None]) -> None:
        """Remove files now, or once the transaction in progress has committed (so that a crash before its commit
        cannot leave the job it keeps without its files)."""
        if self._db.in_transaction:
            self._after_commit.append(remove)
        else:
            remove()

    # -- queries -----------------------------------------------------------------------------------------------
    def _get(self, job_id: str) -> Job | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else row_to_job(row)

    def get(self, job_id: str) -> Job | None:
        """A visible job (one being deleted is not)."""
        with self._lock:
            job = self._get(job_id)
        return None if job is None or job.deleting else job

    def snapshot_any(self, job_id: str) -> Job | None:
        """The job's row, even while it is being deleted; ``None`` once it is gone."""
        with self._lock:
            return self._get(job_id)

    def list(self, *, limit: int, after: str | None, order: str,
             tenant: str | None = None) -> tuple[list[Job], bool]:
        """A page of visible jobs (``tenant``'s only, when given) in insertion order (``asc``) or newest first
        (``desc``), after a cursor id."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        with self._lock:
            where, args = "deleting = 0", []
            if tenant is not None:
                where += " AND tenant = ?"
                args.append(tenant)
            if after is not None:
                cursor = self._get(after)
                if cursor is None:
                    raise KeyError(after)
                where += f" AND seq {op} ?"
                args.append(cursor.seq)
            rows = self._db.execute(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {direction} LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        jobs = [row_to_job(r) for r in rows]
        return jobs[:limit], len(jobs) > limit

    def counts(self) -> dict[str, int]:
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) AS n FROM jobs WHERE deleting = 0 GROUP BY status")
            counts = {status: 0 for status in ("queued", "in_progress", *TERMINAL)}
            counts.update({r["status"]: r["n"] for r in rows})
        return counts

    def queue_depth(self) -> int:
        with self._lock:
            return self._queued()

    def oldest_queued_age(self) -> float:
        """Seconds the oldest queued job has waited (0 with none): with the depth, what an autoscaler scales on."""
        with self._lock:
            row = self._db.execute(f"SELECT {self._db.now} - MIN(created_at) AS age FROM jobs WHERE status = "
                                   "'queued'").fetchone()
        return max(0.0, float(row["age"])) if row["age"] is not None else 0.0

    def _queued(self) -> int:
        return self._db.execute("SELECT COUNT(*) AS n FROM jobs WHERE status = 'queued'").fetchone()["n"]

    # -- events ------------------------------------------------------------------------------------------------
    def _log(self, job: Job) -> None:
        self._event_seq += 1
        log = self._events.setdefault(job.id, [])
        self._events.move_to_end(job.id)
        log.append((self._event_seq, job.public()))
        while len(self._events) > _MAX_LOGGED_JOBS:
            self._events.popitem(last=False)

    def _sync(self, job_id: str) -> Job | None:
        """A shared store: log the job's state as the database has it now when it differs from the last logged (its
        changes made by another server's group, seen at the rate clients read them)."""
        job = self._get(job_id)
        if self.shared and job is not None and not job.deleting:
            logged = self._events.get(job_id)
            if not logged or logged[-1][1] != job.public():
                self._log(job)
        return job

    def events_since(self, job_id: str, seq: int) -> list[tuple[int, dict[str, Any]]]:
        with self._lock:
            if self.shared:
                self._sync(job_id)
            return [e for e in self._events.get(job_id, ()) if e[0] > seq]

    def snapshot(self, job_id: str) -> tuple[int, Job | None]:
        """The job now and the event sequence number it corresponds to (tail :meth:`events_since` from it)."""
        with self._lock:
            job = self._sync(job_id)
            return self._event_seq, (None if job is None or job.deleting else job)

    # -- the HTTP side -----------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, *, model: str, lead: np.ndarray | None = None,
               pinned: bool = False, tenant: Tenant = OPEN, live: Live | None = None) -> Job:
        """Queue a validated request as ``tenant``'s; raises :class:`QueueFull` past ``max_queue`` queued jobs,
        ``server.group.tenants.TenantLimit`` past one of the tenant's limits. ``lead``: frames the video starts with
        before the ones made (an extension's: the video it extends), kept beside the job's outputs until it ends.
        ``pinned``: only this server may run it (a streamed job, whose client reads it here). ``live``: a live
        video's first direction(s)."""
        job_id = f"video_{secrets.token_hex(16)}"
        with self._lock:
            if lead is not None:
                # Written before the job is visible, so that no leader claims it without them (and outside the
                # transaction below: an upload holds no database lock).
                depth = self._queued()
                if depth >= self.max_queue:
                    raise QueueFull(depth)
                buffer = io.BytesIO()
                np.save(buffer, np.ascontiguousarray(lead, dtype=np.uint8))
                self.outputs.put_bytes(job_id, ".lead.npy", buffer.getvalue(), attempt=0)
            try:
                with self._transaction():  # the checks, the tenant's charge and the job: all or nothing
                    depth = self._queued()
                    if depth >= self.max_queue:
                        raise QueueFull(depth)
                    self.tenants.admit_locked(tenant, request.num_frames / request.fps)
                    job = row_to_job(self._db.execute(
                        "INSERT INTO jobs (id, status, created_at, model, request, lead_frames, pinned_node, tenant, "
                        "live) "
                        "VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?) RETURNING *",
                        (job_id, int(time.time()), model, request_to_json(request),
                         0 if lead is None else len(lead), self.node if pinned else None, tenant.name,
                         None if live is None else live.to_json())).fetchall()[0])
            except (QueueFull, TenantLimit):
                if lead is not None:
                    self._remove_files(job_id)
                raise
            self._log(job)
            self._work.notify_all()
        return job

    def direct(self, job_id: str, change: Callable[[Job, Live], Live]) -> Job | None:
        """Change a live job's directions: ``change(job, live)`` gives the new ones (or raises ``LiveRefused``),
        written only over the directions it read (another server's direction in between: read again), so
        concurrent directions never interleave, and stored with the job, so a job resumed after a crash has every
        direction it took. ``None``: no such job."""
        while True:
            with self._lock:
                job = self._get(job_id)
                if job is None or job.deleting:
                    return None
                if job.live is None:
                    raise LiveRefused("not_live", f"video {job_id} is not live; create it with \"live\": true to "
                                      "direct it")
                if job.terminal or job.live.ended:
                    raise LiveRefused("video_ended", f"video {job_id} has ended ({job.status}"
                                      f"{', its end directed' if job.live.ended else ''}); create another to go on")
                live = change(job, job.live)
                cur = self._db.execute("UPDATE jobs SET live = ? WHERE id = ? AND live = ? AND status IN ('queued', "
                                       "'in_progress')", (live.to_json(), job_id, job.live.to_json()))
                if cur.rowcount:
                    job = self._get(job_id)
                    self._log(job)
                    return job

    def set_live_request(self, job_id: str, request: GenerationRequest, *, attempt: int | None = None) -> None:
        """A live job's request as it has grown (its frames and prompt_segments: the one-request video so far)."""
        self._running_update(job_id, attempt, "request = ?", (request_to_json(request),))

    def delete(self, job_id: str) -> tuple[Job | None, bool]:
        """Delete a job. Returns ``(job, running)``: a running job is only marked (hidden, cancel requested);
        the group running it removes it once every rank has stopped it. ``job`` is ``None`` if there is no such
        job."""
        with self._lock:
            job = self._get(job_id)
            if job is None or job.deleting:
                return None, False
            # Committed before the files go: a crash in between leaves files of no job, which recover() sweeps.
            if job.status == "in_progress" or not self._db.execute(
                    "DELETE FROM jobs WHERE id = ? AND status <> 'in_progress'", (job_id,)).rowcount:
                # Running (or claimed by another server just now).
                self._db.execute("UPDATE jobs SET deleting = 1 WHERE id = ?", (job_id,))
                return job, True
            final = replace(job, status="cancelled" if job.status == "queued" else job.status)
            self._log(final)
            self._remove_files(job_id)
        return job, False

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job now, or ask the group running it (on any server) to stop at the next step."""
        with self._lock:
            job = self._get(job_id)
            if job is None or job.deleting:
                return None
            if job.status == "queued":
                job = self._finish_locked(job_id, "cancelled", "cancelled", "cancelled before it started",
                                          expect="queued")
            if job is not None and job.status == "in_progress":  # running, or claimed by another server just now
                self._db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            return self._get(job_id)

    # -- the leader side ---------------------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Run once by a new leader, before it runs any job: jobs a previous group was running go back to the head
        of the queue (failed after ``MAX_ATTEMPTS`` starts); returns their ids. An embedded store's jobs in progress
        are all its own dead group's; a shared store's are taken back only once their lease has run out (other
        servers run the others), which :meth:`claim_next` also does while serving.

        A requeued job with a checkpoint keeps its ``progress`` (it goes on from there, so a progress bar never runs
        backwards); one without starts again at 0. Completed jobs whose MP4 is missing or cut short are failed
        (``output_lost``: their record cannot promise a video that is not there), deletes that a crash interrupted
        are finished, and the files interrupted writes left are removed."""
        with self._lock:
            requeued = self._reap(expired_only=self.shared)
            with self._transaction():
                if not self.shared:
                    for row in self._db.execute("SELECT id FROM jobs WHERE deleting = 1").fetchall():
                        self._db.execute("DELETE FROM jobs WHERE id = ?", (row["id"],))
                        self._remove_files(row["id"])
                for row in self._db.execute("SELECT id FROM jobs WHERE status = 'completed'").fetchall():
                    mp4 = self.outputs.local_path(row["id"], ".mp4")
                    if mp4 is not None and not mp4_complete(mp4):  # an object store's PUTs are whole
                        state = "cut short" if mp4.exists() else "missing"
                        log.warning("job %s is completed but its video is %s; failing it", row["id"], state)
                        self._finish_locked(row["id"], "failed", "output_lost",
                                            f"the server restarted and this job's video is {state} on its disk; "
                                            "submit it again")
                        self._remove_files(row["id"])
            self._sweep()
            self._work.notify_all()
        if not self.outputs.local:
            self._cleaner.submit(self._sweep_remote)  # requests to a remote store, off the lock
        return requeued

    def _reap(self, *, expired_only: bool) -> list[str]:
        """Jobs in progress whose group is gone (all, or those whose lease ran out) back to the queue, or ended:
        cancelled when asked to, failed past ``MAX_ATTEMPTS``, removed when being deleted. Caller holds the lock."""
        expired = f" AND lease_until < {self._db.now}" if expired_only else ""
        with self._transaction():
            rows = self._db.execute("SELECT id, deleting, attempts, cancel_requested FROM jobs WHERE status = "
                                    f"'in_progress'{expired}{self._db.skip_locked}").fetchall()
            for row in rows:
                if row["deleting"]:
                    self._db.execute("DELETE FROM jobs WHERE id = ?", (row["id"],))
                    self._remove_files(row["id"])
                elif row["cancel_requested"]:
                    self._finish_locked(row["id"], "cancelled", "cancelled", "cancelled while the group restarted")
                elif row["attempts"] >= MAX_ATTEMPTS:
                    self._finish_locked(row["id"], "failed", "worker_group_restarted",
                                        f"the worker group failed and restarted each of the {row['attempts']} "
                                        "times this job ran; it is not run again")
                else:
                    # Back to queued with its place in the queue (the oldest seq runs first).
                    attempt = self._checkpoint_attempt(row["id"])
                    resumes = attempt is not None and self.outputs.size(row["id"], ".resume.npz",
                                                                        attempt=attempt) is not None
                    # Unpinned: a streamed job's client was connected to the server that lost it.
                    self._db.execute("UPDATE jobs SET status = 'queued', pinned_node = NULL, progress = CASE WHEN ? "
                                     "THEN progress ELSE 0 END WHERE id = ?", (resumes, row["id"]))
                    self._log(self._get(row["id"]))
        return [r["id"] for r in rows if not r["deleting"]]

    def wake(self) -> None:
        with self._lock:
            self._work.notify_all()

    def claim_next(self, timeout: float) -> Job | None:
        """The oldest queued job this server may run, marked ``in_progress`` with a lease this store renews until
        the job ends; waits up to ``timeout`` s for one. A shared store first takes back the jobs whose lease ran
        out, and looks again every ``_POLL_S`` (other servers' submissions wake nobody here)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                if self.shared and time.monotonic() - self._reaped_at >= _POLL_S:
                    # At most every _POLL_S: a lease runs out seconds after its last renewal, so looking more often
                    # (a busy server claims once per job) would find nothing sooner.
                    self._reaped_at = time.monotonic()
                    self._reap(expired_only=True)
                with self._transaction():
                    # NOTE(turns): round-robin rather than weighted fair share: every tenant is equal here, and the
                    # turn order needs one timestamp per tenant (no per-job costs to estimate or carry).
                    row = self._db.execute(
                        f"UPDATE jobs SET status = 'in_progress', attempts = attempts + 1, started_at = "
                        f"{self._db.now}, lease_until = {self._db.now} + ? WHERE id = (SELECT id FROM jobs q WHERE "
                        "status = 'queued' AND (pinned_node IS NULL OR pinned_node = ?) ORDER BY COALESCE((SELECT "
                        "last_turn FROM tenant_turns t WHERE t.tenant = q.tenant), 0), seq LIMIT 1"
                        f"{self._db.skip_locked}) AND status = 'queued' RETURNING *",
                        (self.lease_s, self.node)).fetchone()
                    if row is not None:
                        self.tenants.take_turn_locked(row["tenant"])
                if row is not None:
                    # Its progress as queued: 0, or a requeued job's, which its checkpoint goes on from.
                    job = row_to_job(row)
                    self._log(job)
                    self._held[job.id] = job.attempts
                    self._start_renewer()
                    return job
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                woken = self._work.wait(min(left, _POLL_S) if self.shared else left)
                if not woken and not self.shared:
                    return None

    def _start_renewer(self) -> None:
        if self._renewer is None:
            self._renewer = threading.Thread(target=self._renew_leases, name="cp-infer-leases", daemon=True)
            self._renewer.start()

    def _renew_leases(self) -> None:
        """Every third of a lease, renew the lease of each job this server runs; a claim whose row now has another
        attempt (this server was frozen past its lease and another took the job) is lost: :meth:`cancel_requested`
        then stops it, and its writes change nothing (they carry its attempt)."""
        wait = self.lease_s / 3
        while not self._closed.wait(wait):
            wait = self.lease_s / 3
            with self._lock:
                for job_id, attempt in list(self._held.items()):
                    try:
                        cur = self._db.execute(f"UPDATE jobs SET lease_until = {self._db.now} + ? WHERE id = ? AND "
                                               "attempts = ? AND status = 'in_progress'",
                                               (self.lease_s, job_id, attempt))
                    except StoreUnavailable as exc:
                        # Tried again soon: the lease must be renewed as soon as the database is back, before
                        # another server finds it run out.
                        log.warning("renewing the lease of %s failed (%s); retrying", job_id, exc)
                        wait = min(wait, _POLL_S)
                        break
                    if not cur.rowcount:
                        log.warning("job %s attempt %d lost its claim (its lease ran out)", job_id, attempt)
                        self._held.pop(job_id, None)
                        self._lost.add((job_id, attempt))

    def _current(self, job_id: str, attempt: int) -> bool:
        with self._lock:
            row = self._db.execute("SELECT attempts, status FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return row is not None and row["attempts"] == attempt and row["status"] == "in_progress"

    def cancel_requested(self, job_id: str, *, attempt: int | None = None) -> bool:
        """Whether a running job should stop: cancelled, deleted, or (given its ``attempt``) no longer that
        attempt's (its claim was lost). Given its attempt, an unreachable database says go on (see
        :meth:`_riding_out`)."""
        try:
            with self._lock:
                written = self._written.pop(job_id, None)
                if written is not None and written[1] == attempt and time.monotonic() - written[0] < _FRESH_S:
                    # NOTE(round trips): the row its step's progress write just returned, as fresh as a read now
                    # (that write matched only while the attempt held the job): one round trip a step, not two.
                    row = written[2]
                else:
                    row = self._db.execute("SELECT deleting, cancel_requested, attempts, status FROM jobs WHERE "
                                           "id = ?", (job_id,)).fetchone()
        except StoreUnavailable:
            if attempt is None:
                raise
            self._riding_out(job_id)
            return False
        if row is None or bool(row["deleting"]) or bool(row["cancel_requested"]):
            return True
        return attempt is not None and (row["attempts"] != attempt or row["status"] != "in_progress")

    def _running_update(self, job_id: str, attempt: int | None, sets: str, args: tuple, where: str = "",
                        where_args: tuple = (), *, logged: bool = True) -> None:
        """``UPDATE jobs SET <sets>`` of a running job (its ``attempt``'s, when given), logged as an event when it
        changed a row; given the attempt, an unreachable database is ridden out (:meth:`_riding_out`)."""
        fence, fence_args = _fence(attempt)
        try:
            with self._lock:
                rows = self._db.execute_lazy(f"UPDATE jobs SET {sets} WHERE id = ?{where} AND status = "
                                             f"'in_progress'{fence} RETURNING *",
                                             (*args, job_id, *where_args, *fence_args)).fetchall()
                if rows and attempt is not None:
                    self._written[job_id] = (time.monotonic(), attempt, rows[0])
                if rows and logged:
                    self._log(row_to_job(rows[0]))
        except StoreUnavailable:
            if attempt is None:
                raise
            self._riding_out(job_id)

    def set_window(self, job_id: str, window: int, windows: int, *, attempt: int | None = None) -> None:
        """The window a long video is making now."""
        self._running_update(job_id, attempt, '"window" = ?, windows = ?', (window, windows))

    def start_over(self, job_id: str, *, attempt: int | None = None) -> None:
        """A claimed job runs from its start (its checkpoint could not be read): its progress goes back to 0."""
        self._running_update(job_id, attempt, "progress = 0", (), " AND progress > 0")

    def set_cache_steps(self, job_id: str, computed: int, skipped: int, *, attempt: int | None = None) -> None:
        """A running job's step-cache totals so far. Logged with the job's next change (its progress, at most a
        step later, or its end), not as an event of their own."""
        self._running_update(job_id, attempt, "steps_computed = ?, steps_skipped = ?", (computed, skipped),
                             logged=False)

    def set_progress(self, job_id: str, progress: int, *, attempt: int | None = None) -> None:
        """Raise a running job's progress (a lower value, such as a resumed job's steps before its checkpoint's
        progress, changes nothing)."""
        self._running_update(job_id, attempt, "progress = ?", (progress,), " AND progress < ?", (progress,))

    def finish(self, job_id: str, status: str, code: str | None = None, message: str | None = None, *,
               attempt: int | None = None, ranks: int = 1) -> Job | None:
        """End a job (``completed``/``failed``/``cancelled``); a job being deleted is removed instead. With
        ``attempt`` (the group that ran it), only while that attempt is the job's: a stale one changes nothing
        (returns ``None``), and a completed job's files are that attempt's; an unreachable database is waited for
        (retried with backoff until it answers or the store closes), so the end is reported once it is back.
        ``ranks``: the ranks that ran it (a completed job's rank-seconds in its tenant's usage)."""
        if attempt is not None:
            self.wait_checkpoint(job_id)  # saved (or given up on) before the end removes the job's checkpoints
        delay = 0.1
        while True:
            try:
                with self._lock:
                    job = self._finish_locked(job_id, status, code, message, attempt=attempt, ranks=ranks)
                    if attempt is not None:
                        self._held.pop(job_id, None)
                        self._written.pop(job_id, None)
                if job is None and attempt is not None:
                    log.warning("job %s attempt %d ended %s, but the job is no longer that attempt's (another server "
                                "took it over, or it is gone): its end changes nothing", job_id, attempt, status)
                return job
            except StoreUnavailable as exc:
                if attempt is None or self._closed.is_set():
                    raise
                log.warning("job %s ended %s; reporting it when the job store is back (%s)", job_id, status, exc)
                time.sleep(delay)
                delay = min(2 * delay, 5.0)

    def _riding_out(self, job_id: str) -> None:
        """A running job's write (one carrying its attempt) found the database unreachable: the job goes on. Its
        progress, window and counts are dropped (the next write carries them), its poll says go on, and its end is
        waited for (:meth:`finish`); its lease is renewed once the database is back, or lost if it stays away past
        it (then another server runs the job and this attempt's end changes nothing)."""
        log.warning("job %s: the job store is unreachable; the job goes on", job_id)

    def _finish_locked(self, job_id: str, status: str, code: str | None, message: str | None, *,
                       attempt: int | None = None, expect: str | None = None, ranks: int = 1) -> Job | None:
        """One guarded update: ``attempt`` (that attempt, in progress) or ``expect`` (that status) or nothing."""
        assert status in TERMINAL, status
        guard, args = _fence(attempt)
        if attempt is not None:
            guard += " AND status = 'in_progress'"
        if expect is not None:
            guard, args = guard + " AND status = ?", (*args, expect)
        with self._transaction():
            rows = self._db.execute(
                f"UPDATE jobs SET status = ?, progress = CASE WHEN ? THEN 100 ELSE progress END, completed_at = ?, "
                f"error_code = ?, error_message = ?, output_attempt = CASE WHEN ? THEN attempts ELSE NULL END "
                f"WHERE id = ?{guard} RETURNING *",
                (status, status == "completed", int(time.time()), code, message, status == "completed", job_id,
                 *args)).fetchall()
            if not rows:  # the guard held it back: the job as it is (none for a fenced write)
                return None if attempt is not None else self._get(job_id)
            job = row_to_job(rows[0])
            ran = self._db.execute(f"SELECT {self._db.now} - started_at AS s FROM jobs WHERE id = ?",
                                   (job_id,)).fetchone()["s"]
            r = job.request
            self.tenants.record_end_locked(job.tenant, status, video_seconds=r.num_frames / r.fps,
                                           rank_seconds=max(0.0, float(ran or 0.0)) * ranks)
            if job.deleting:
                self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                self._remove_files(job_id)
            else:
                self._remove_files(job_id, ".resume.npz", ".lead.npy")  # an ended job goes on from nowhere
        self._log(job)
        return job

    def probe(self) -> None:
        """Raise ``StoreUnavailable`` naming the store that does not answer one cheap question."""
        with self._lock:
            self._db.execute("SELECT 1 AS ok").fetchone()
        self.outputs.probe()

    def close(self) -> None:
        self._closed.set()
        self._uploads.shutdown(wait=True)
        self._cleaner.shutdown(wait=True)
        with self._lock:
            self._db.close()
