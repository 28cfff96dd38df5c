"""The job store: jobs in an embedded SQLite database, outputs in files named by the server-made job id.

Invariants:
- Job ids are made here (``video_`` + 32 hex digits) and are the only names of output files, so a path never
  contains client text; :func:`valid_job_id` gates every id that arrives in a URL.
- FIFO: the leader claims the oldest queued job (by insertion order); a claim and a cancel of a queued job
  are serialised by one lock, so a job is either claimed or deleted, never both.
- The database survives restarts of the worker group and the death of the whole server (``kill -9`` of every
  process at any moment; not a power loss): it is in WAL mode, where a transaction is in the log once it returns
  (``synchronous=NORMAL`` syncs only at checkpoints, which is enough while the kernel outlives the process), and each
  change of a job is one transaction (:meth:`JobStore._transaction` around those of several statements). Files are
  removed only once the change that orphans them is committed, so a crash leaves extra files, never a live job
  without its lead or checkpoint.
- Outputs are written to ``<name>.tmp`` and renamed into place whole (``server.outputs``, the leader's encoder), and
  only then is the job marked ``completed``: a job's content is never a half-written MP4.
- :meth:`JobStore.recover` (run once by each new leader, before any job runs) puts jobs that were ``in_progress``
  back at the head of the queue (they run again, a long video from its last finished window's checkpoint,
  ``<id>.resume.npz``), unless they have already been started ``MAX_ATTEMPTS`` times: a job that takes the group
  down every time it runs is failed instead of taking it down forever. It fails a ``completed`` job whose MP4 is
  missing or cut short (``output_lost``) and sweeps what interrupted writes left (``*.tmp``, files of no job).
- ``progress`` never decreases while a job can go on from a checkpoint: a requeued job keeps the progress it had
  (at least its checkpoint's) from the requeue through its resume, whose steps only raise it again once past it. A
  job that starts over (no checkpoint, or an unreadable one: :meth:`JobStore.start_over`) goes back to 0.
- Every change of a job's visible state appends a snapshot to an in-memory event log (per job, bounded), which
  the SSE endpoint tails, so no progress change is missed however slowly a client reads.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import re
import secrets
import sqlite3
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from cp_infer.request import Condition, GenerationRequest, loras_from

__all__ = ["Job", "JobStore", "QueueFull", "valid_job_id", "TERMINAL"]

log = logging.getLogger("cp_infer.jobs")

TERMINAL = ("completed", "failed", "cancelled")
MAX_ATTEMPTS = 3
"""Times a job is started before a restart of the group fails it instead of running it again."""
_ID_RE = re.compile(r"^video_[0-9a-f]{32}$")
_MAX_LOGGED_JOBS = 256

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    deleting INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status, seq);
"""
# Columns added after the first schema (an older database gets them on open).
_ADDED_COLUMNS = {"window": "INTEGER", "windows": "INTEGER", "attempts": "INTEGER NOT NULL DEFAULT 0",
                  "lead_frames": "INTEGER NOT NULL DEFAULT 0", "steps_computed": "INTEGER", "steps_skipped": "INTEGER"}


def valid_job_id(job_id: str) -> bool:
    return bool(_ID_RE.match(job_id))


def _mp4_complete(path: Path) -> bool:
    """Whether ``path`` is a whole MP4: its top-level boxes tile the file exactly, starting with ``ftyp`` and
    holding ``moov`` and ``mdat``, and a fragmented one ends with its ``mfra`` (its muxer's last box); a file cut
    anywhere fails (reads the box headers only)."""
    try:
        size = path.stat().st_size
        kinds = []
        with open(path, "rb") as f:
            pos = 0
            while pos < size:
                f.seek(pos)
                header = f.read(16)
                if len(header) < 8:
                    return False
                length, kind = struct.unpack(">I4s", header[:8])
                if length == 1:  # a 64-bit size follows the type
                    if len(header) < 16:
                        return False
                    length = struct.unpack(">Q", header[8:16])[0]
                elif length == 0:  # the box runs to the end of the file
                    length = size - pos
                if length < 8:
                    return False
                kinds.append(kind)
                pos += length
    except OSError:
        return False
    if pos != size or not kinds or kinds[0] != b"ftyp" or not {b"moov", b"mdat"} <= set(kinds):
        return False
    return b"moof" not in kinds or kinds[-1] == b"mfra"


class QueueFull(Exception):
    def __init__(self, depth: int):
        super().__init__(f"the queue holds {depth} jobs, its limit")
        self.depth = depth


@dataclass(frozen=True)
class Job:
    seq: int
    id: str
    status: str
    progress: int
    created_at: int
    completed_at: int | None
    model: str
    request: GenerationRequest
    error_code: str | None = None
    error_message: str | None = None
    deleting: bool = False
    window: int | None = None
    """A long video's window being made (from 0), ``None`` before the first or for one made at once."""
    windows: int | None = None
    attempts: int = 0
    lead_frames: int = 0
    """Frames the video starts with before the ones made (an extension's: the video it extends)."""
    steps_computed: int | None = None
    """A request with a step cache (``cache``): the steps so far that ran every transformer block; ``None``: none."""
    steps_skipped: int | None = None
    """A request with a step cache: the steps so far that used it (``cp_infer.step_cache.CacheStats``)."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def public(self) -> dict[str, Any]:
        """The API's job object (see ``schemas.VideoJob``)."""
        r = self.request
        frames = r.num_frames if not self.lead_frames else self.lead_frames + r.num_frames - 1
        error = None if self.error_code is None else {"code": self.error_code, "message": self.error_message or ""}
        return {
            "id": self.id, "object": "video", "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "model": self.model,
            "seconds": f"{frames / r.fps:.3g}", "size": f"{r.width}x{r.height}", "prompt": r.prompt,
            "error": error, "window": self.window, "windows": self.windows,
            "steps_computed": self.steps_computed, "steps_skipped": self.steps_skipped,
            "negative_prompt": r.negative_prompt, "num_frames": r.num_frames, "width": r.width,
            "height": r.height, "fps": r.fps, "num_inference_steps": r.num_inference_steps,
            "guidance_scale": r.guidance_scale, "seed": r.seed,
            # The model's own options, as resolved (every one it declares).
            **{name: list(v) if isinstance(v, tuple) else v for name, v in r.options.items()},
            "input_reference": r.image is not None, "extends": r.extends is not None,
            "conditions": [{"frame_index": c.frame_index, "strength": c.strength,
                            "num_frames": int(c.frames.shape[0])} for c in r.conditions] or None,
            "loras": [{"name": lora.name, "scale": lora.scale} for lora in r.loras],
        }


def _condition_to_json(cond: Condition) -> dict[str, Any]:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, frames=cond.frames)
    return {"frames_npz": base64.b64encode(buffer.getvalue()).decode("ascii"), "frame_index": cond.frame_index,
            "strength": cond.strength}


def _condition_from_json(data: dict[str, Any]) -> Condition:
    with np.load(io.BytesIO(base64.b64decode(data["frames_npz"])), allow_pickle=False) as archive:
        frames = archive["frames"]
    return Condition(frames, frame_index=data["frame_index"], strength=data["strength"])


def _request_to_json(request: GenerationRequest) -> str:
    """The request as stored: its fields, conditioning media as compressed arrays (the validated pixels)."""
    data = {f.name: getattr(request, f.name) for f in fields(request)}
    data["image"] = None if request.image is None else _condition_to_json(request.image)
    data["conditions"] = [_condition_to_json(c) for c in request.conditions]
    data["extends"] = None if request.extends is None else _condition_to_json(request.extends)
    data["loras"] = [{"name": lora.name, "scale": lora.scale} for lora in request.loras]
    return json.dumps(data)


_REQUEST_FIELDS = frozenset(f.name for f in fields(GenerationRequest))


def _request_from_json(text: str) -> GenerationRequest:
    data = json.loads(text)
    options = data.get("options") or {}
    # Rows written before models declared their options hold them as fields: the set ones become options.
    options.update({k: data.pop(k) for k in list(data) if k not in _REQUEST_FIELDS and data[k] is not None})
    data = {k: v for k, v in data.items() if k in _REQUEST_FIELDS}
    # JSON has only lists; a request holds tuples.
    data["options"] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    if data.get("image") is not None:
        data["image"] = _condition_from_json(data["image"])
    data["conditions"] = tuple(_condition_from_json(c) for c in data.get("conditions") or ())
    if data.get("extends") is not None:
        data["extends"] = _condition_from_json(data["extends"])
    data["loras"] = loras_from(data.get("loras"))
    return GenerationRequest(**data)


def _row_to_job(row: sqlite3.Row) -> Job:
    return Job(
        seq=row["seq"], id=row["id"], status=row["status"], progress=row["progress"], created_at=row["created_at"],
        completed_at=row["completed_at"], model=row["model"], request=_request_from_json(row["request"]),
        error_code=row["error_code"], error_message=row["error_message"], deleting=bool(row["deleting"]),
        window=row["window"], windows=row["windows"], attempts=row["attempts"], lead_frames=row["lead_frames"],
        steps_computed=row["steps_computed"], steps_skipped=row["steps_skipped"],
    )


class JobStore:
    """Thread-safe: the HTTP event loop and the leader thread share one connection behind one lock."""

    def __init__(self, data_dir: str | Path, *, max_queue: int):
        if max_queue < 1:
            raise ValueError(f"max_queue={max_queue} must be >= 1")
        self.data_dir = Path(data_dir)
        self.videos_dir = self.data_dir / "videos"
        self.videos_dir.mkdir(parents=True, exist_ok=True)
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._db = sqlite3.connect(self.data_dir / "jobs.sqlite3", check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        have = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in have:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {name} {kind}")
        self._event_seq = 0
        self._events: OrderedDict[str, list[tuple[int, dict[str, Any]]]] = OrderedDict()
        self._after_commit: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The statements inside commit together (the caller holds the lock); nested ones join the outer one. File
        removals asked for inside (:meth:`_remove`) run once it has committed."""
        if self._db.in_transaction:
            yield
            return
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            self._after_commit.clear()
            raise
        self._db.execute("COMMIT")
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

    # -- files -------------------------------------------------------------------------------------------------
    def path(self, job_id: str, suffix: str) -> Path:
        assert valid_job_id(job_id), job_id
        return self.videos_dir / f"{job_id}{suffix}"

    def lead_frames(self, job_id: str) -> np.ndarray | None:
        """The frames the job's video starts with (``submit``'s ``lead``), memory-mapped; ``None`` without."""
        try:
            return np.load(self.path(job_id, ".lead.npy"), mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            return None

    def save_checkpoint(self, job_id: str, passes_done: int, arrays: dict[str, np.ndarray]) -> None:
        """A running job's checkpoint (``SampleControl.on_checkpoint``), replacing the one before atomically."""
        path = self.path(job_id, ".resume.npz")
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, passes_done=np.array(passes_done, dtype=np.int64), **arrays)
        tmp.replace(path)

    def load_checkpoint(self, job_id: str) -> tuple[int, dict[str, np.ndarray]] | None:
        """The job's last checkpoint, ``None`` when it has none (or an unreadable one: the job starts over)."""
        path = self.path(job_id, ".resume.npz")
        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {k: archive[k] for k in archive.files}
        except (OSError, ValueError):
            return None
        return int(arrays.pop("passes_done")), arrays

    def _remove_files(self, job_id: str, *suffixes: str) -> None:
        """The job's files with these suffixes (none given: all of them), after the commit in progress."""
        def remove() -> None:
            files = [self.path(job_id, s) for s in suffixes] if suffixes else self.videos_dir.glob(f"{job_id}.*")
            for file in files:
                file.unlink(missing_ok=True)

        self._remove(remove)

    def _sweep(self) -> None:
        """Files that interrupted writes left (caller holds the lock; no job runs): temporary files, files of jobs
        that no longer exist, and the checkpoint and lead of ended jobs."""
        states = dict(self._db.execute("SELECT id, status FROM jobs").fetchall())
        for file in self.videos_dir.iterdir():
            job_id, _, suffix = file.name.partition(".")
            if not valid_job_id(job_id):
                continue  # not the store's
            status = states.get(job_id)
            if (suffix.endswith("tmp") or status is None
                    or (status in TERMINAL and suffix in ("resume.npz", "lead.npy"))):
                log.info("removing %s, left by an interrupted write", file.name)
                file.unlink(missing_ok=True)

    # -- queries -----------------------------------------------------------------------------------------------
    def _get(self, job_id: str) -> Job | None:
        row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _row_to_job(row)

    def get(self, job_id: str) -> Job | None:
        """A visible job (one being deleted is not)."""
        with self._lock:
            job = self._get(job_id)
        return None if job is None or job.deleting else job

    def snapshot_any(self, job_id: str) -> Job | None:
        """The job's row, even while it is being deleted; ``None`` once it is gone."""
        with self._lock:
            return self._get(job_id)

    def list(self, *, limit: int, after: str | None, order: str) -> tuple[list[Job], bool]:
        """A page of visible jobs in insertion order (``asc``) or newest first (``desc``), after a cursor id."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        with self._lock:
            where, args = "deleting = 0", []
            if after is not None:
                cursor = self._get(after)
                if cursor is None:
                    raise KeyError(after)
                where += f" AND seq {op} ?"
                args.append(cursor.seq)
            rows = self._db.execute(f"SELECT * FROM jobs WHERE {where} ORDER BY seq {direction} LIMIT ?",
                                    (*args, limit + 1)).fetchall()
        jobs = [_row_to_job(r) for r in rows]
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

    def _queued(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]

    # -- events ------------------------------------------------------------------------------------------------
    def _log(self, job: Job) -> None:
        self._event_seq += 1
        log = self._events.setdefault(job.id, [])
        self._events.move_to_end(job.id)
        log.append((self._event_seq, job.public()))
        while len(self._events) > _MAX_LOGGED_JOBS:
            self._events.popitem(last=False)

    def events_since(self, job_id: str, seq: int) -> list[tuple[int, dict[str, Any]]]:
        with self._lock:
            return [e for e in self._events.get(job_id, ()) if e[0] > seq]

    def snapshot(self, job_id: str) -> tuple[int, Job | None]:
        """The job now and the event sequence number it corresponds to (tail :meth:`events_since` from it)."""
        with self._lock:
            job = self._get(job_id)
            return self._event_seq, (None if job is None or job.deleting else job)

    # -- the HTTP side -----------------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, *, model: str, lead: np.ndarray | None = None) -> Job:
        """Queue a validated request; raises :class:`QueueFull` past ``max_queue`` queued jobs. ``lead``: frames
        the video starts with before the ones made (an extension's: the video it extends), kept in a file
        beside the job's outputs until it ends."""
        job_id = f"video_{secrets.token_hex(16)}"
        with self._lock:
            depth = self._queued()
            if depth >= self.max_queue:
                raise QueueFull(depth)
            if lead is not None:
                # Written before the job is visible, so that the leader never claims it without them.
                np.save(self.path(job_id, ".lead.npy"), np.ascontiguousarray(lead, dtype=np.uint8))
            self._db.execute(
                "INSERT INTO jobs (id, status, created_at, model, request, lead_frames) "
                "VALUES (?, 'queued', ?, ?, ?, ?)",
                (job_id, int(time.time()), model, _request_to_json(request), 0 if lead is None else len(lead)))
            job = self._get(job_id)
            self._log(job)
            self._work.notify_all()
        return job

    def delete(self, job_id: str) -> tuple[Job | None, bool]:
        """Delete a job. Returns ``(job, running)``: a running job is only marked (hidden, cancel requested);
        the leader removes it once every rank has stopped it. ``job`` is ``None`` if there is no such job."""
        with self._lock:
            job = self._get(job_id)
            if job is None or job.deleting:
                return None, False
            if job.status == "in_progress":
                self._db.execute("UPDATE jobs SET deleting = 1 WHERE id = ?", (job_id,))
                return job, True
            # Committed before the files go: a crash in between leaves files of no job, which recover() sweeps.
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
            final = replace(job, status="cancelled" if job.status == "queued" else job.status)
            self._log(final)
            self._remove_files(job_id)
        return job, False

    def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued job now, or ask the leader to stop a running one at the next step boundary."""
        with self._lock:
            job = self._get(job_id)
            if job is None or job.deleting:
                return None
            if job.status == "queued":
                self._finish_locked(job_id, "cancelled", "cancelled", "cancelled before it started")
            elif job.status == "in_progress":
                self._db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))
            return self._get(job_id)

    # -- the leader side ---------------------------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Run once by a new leader, before it runs any job: jobs a previous group was running go back to the head
        of the queue (failed after ``MAX_ATTEMPTS`` starts); returns their ids.

        A requeued job with a checkpoint keeps its ``progress`` (it goes on from there, so a progress bar never runs
        backwards); one without starts again at 0. Completed jobs whose MP4 is missing or cut short are failed
        (``output_lost``: their record cannot promise a video that is not there), deletes that a crash interrupted
        are finished, and the files interrupted writes left are removed."""
        with self._lock:
            with self._transaction():
                rows = self._db.execute("SELECT id, deleting, attempts, cancel_requested FROM jobs WHERE status = "
                                        "'in_progress'").fetchall()
                for row in rows:
                    if row["deleting"]:
                        continue  # removed below, with the other interrupted deletes
                    if row["cancel_requested"]:
                        self._finish_locked(row["id"], "cancelled", "cancelled",
                                            "cancelled while the group restarted")
                    elif row["attempts"] >= MAX_ATTEMPTS:
                        self._finish_locked(row["id"], "failed", "worker_group_restarted",
                                            f"the worker group failed and restarted each of the {row['attempts']} "
                                            "times this job ran; it is not run again")
                    else:
                        # Back to queued with its place in the queue (the oldest seq runs first).
                        resumes = self.path(row["id"], ".resume.npz").is_file()
                        self._db.execute("UPDATE jobs SET status = 'queued', progress = CASE WHEN ? THEN progress "
                                         "ELSE 0 END WHERE id = ?", (resumes, row["id"]))
                        self._log(self._get(row["id"]))
                for row in self._db.execute("SELECT id FROM jobs WHERE deleting = 1").fetchall():
                    self._db.execute("DELETE FROM jobs WHERE id = ?", (row["id"],))
                    self._remove_files(row["id"])
                for row in self._db.execute("SELECT id FROM jobs WHERE status = 'completed'").fetchall():
                    mp4 = self.path(row["id"], ".mp4")
                    if not _mp4_complete(mp4):
                        state = "cut short" if mp4.exists() else "missing"
                        log.warning("job %s is completed but its video is %s; failing it", row["id"], state)
                        self._finish_locked(row["id"], "failed", "output_lost",
                                            f"the server restarted and this job's video is {state} on its disk; "
                                            "submit it again")
                        self._remove_files(row["id"])
            self._sweep()
            self._work.notify_all()
        return [r["id"] for r in rows]

    def set_window(self, job_id: str, window: int, windows: int) -> None:
        """The window a long video is making now."""
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET window = ?, windows = ? WHERE id = ? AND status = 'in_progress'",
                                   (window, windows, job_id))
            if cur.rowcount:
                self._log(self._get(job_id))

    def wake(self) -> None:
        with self._lock:
            self._work.notify_all()

    def claim_next(self, timeout: float) -> Job | None:
        """The oldest queued job, marked ``in_progress``; waits up to ``timeout`` s for one."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                row = self._db.execute(
                    "SELECT * FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1").fetchone()
                if row is not None:
                    # Its progress as queued: 0, or a requeued job's, which its checkpoint goes on from.
                    self._db.execute("UPDATE jobs SET status = 'in_progress', attempts = attempts + 1 WHERE id = ?",
                                     (row["id"],))
                    job = self._get(row["id"])
                    self._log(job)
                    return job
                left = deadline - time.monotonic()
                if left <= 0 or not self._work.wait(left):
                    return None

    def cancel_requested(self, job_id: str) -> bool:
        with self._lock:
            row = self._db.execute("SELECT deleting, cancel_requested FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return row is None or bool(row["deleting"]) or bool(row["cancel_requested"])

    def start_over(self, job_id: str) -> None:
        """A claimed job runs from its start (its checkpoint could not be read): its progress goes back to 0."""
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET progress = 0 WHERE id = ? AND progress > 0 AND status = "
                                   "'in_progress'", (job_id,))
            if cur.rowcount:
                self._log(self._get(job_id))

    def set_cache_steps(self, job_id: str, computed: int, skipped: int) -> None:
        """A running job's step-cache totals so far. Logged with the job's next change (its progress, at most a
        step later, or its end), not as an event of their own."""
        with self._lock:
            self._db.execute("UPDATE jobs SET steps_computed = ?, steps_skipped = ? WHERE id = ? AND status = "
                             "'in_progress'", (computed, skipped, job_id))

    def set_progress(self, job_id: str, progress: int) -> None:
        """Raise a running job's progress (a lower value, such as a resumed job's steps before its checkpoint's
        progress, changes nothing)."""
        with self._lock:
            cur = self._db.execute("UPDATE jobs SET progress = ? WHERE id = ? AND progress < ? AND status = "
                                   "'in_progress'", (progress, job_id, progress))
            if cur.rowcount:
                self._log(self._get(job_id))

    def finish(self, job_id: str, status: str, code: str | None = None, message: str | None = None) -> Job | None:
        """End a job (``completed``/``failed``/``cancelled``); a job being deleted is removed instead."""
        with self._lock:
            return self._finish_locked(job_id, status, code, message)

    def _finish_locked(self, job_id: str, status: str, code: str | None, message: str | None) -> Job | None:
        assert status in TERMINAL, status
        with self._transaction():
            job = self._get(job_id)
            if job is None:
                return None
            progress = 100 if status == "completed" else job.progress
            self._db.execute("UPDATE jobs SET status = ?, progress = ?, completed_at = ?, error_code = ?, "
                             "error_message = ? WHERE id = ?",
                             (status, progress, int(time.time()), code, message, job_id))
            job = self._get(job_id)
            if job.deleting:
                self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
                self._remove_files(job_id)
            else:
                self._remove_files(job_id, ".resume.npz", ".lead.npy")  # an ended job goes on from nowhere
        self._log(job)
        return job

    def close(self) -> None:
        with self._lock:
            self._db.close()

