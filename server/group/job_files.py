"""A job's files in the output store, as the job store (``server.group.jobs.JobStore``) keeps them: the finished
outputs it publishes, the lead frames a job starts from, the checkpoints it goes on from, and the sweeps of what no
record names. ``JobFiles`` is the store's half that speaks to ``server.outputs.store``; the records, the queue and
the leases are ``jobs.py``'s (the invariants there hold for both halves).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from server.group.job_record import TERMINAL, Job, valid_job_id
from server.outputs.store import StoreUnavailable

__all__ = ["JobFiles", "SWEEP_MIN_AGE_S"]

log = logging.getLogger("cp_infer.jobs")

SWEEP_MIN_AGE_S = 3600.0
"""How old a shared output store's file of no job must be before a sweep removes it (:meth:`JobFiles.sweep_outputs`):
a job's lead frames are uploaded just before its record is committed."""


class JobFiles:
    """The file half of :class:`server.group.jobs.JobStore`, which sets what it uses: ``outputs`` (the output
    store), ``videos_dir``, ``_db`` and ``_lock``, the ``_uploads`` and ``_cleaner`` executors, ``_uploading``, and
    the methods ``_current`` (is an attempt still the job's) and ``_remove`` (removals after the commit)."""

    def path(self, job_id: str, suffix: str) -> Path:
        """The job's file on this machine: the file itself (the local folder) or where it is made (S3's spool)."""
        assert valid_job_id(job_id), job_id
        return self.videos_dir / f"{job_id}{suffix}"

    def publish(self, job_id: str, files: list[tuple[Path, str]], *, attempt: int) -> None:
        """Hand finished files (``(made, suffix)``) to the output store as ``attempt``'s (``server.outputs.store``)."""
        if len(files) < 2 or self.outputs.local:
            for made, suffix in files:
                self.outputs.put(job_id, suffix, made, attempt=attempt)
            return
        with ThreadPoolExecutor(max_workers=len(files), thread_name_prefix="cp-infer-upload") as uploads:
            for done in [uploads.submit(self.outputs.put, job_id, suffix, made, attempt=attempt)
                         for made, suffix in files]:
                done.result()  # the first failure raises (the job fails; its record is not completed)

    def output_path(self, job: Job, suffix: str) -> Path | None:
        """A completed job's file when it is on this machine's disk (served as it is); ``None`` when it is not."""
        path = self.outputs.local_path(job.id, suffix)
        return path if path is None or path.is_file() else None

    def output_size(self, job: Job, suffix: str) -> int | None:
        return self.outputs.size(job.id, suffix, attempt=job.output_attempt or job.attempts)

    def read_output(self, job: Job, suffix: str, start: int, end: int) -> Iterator[bytes]:
        return self.outputs.read(job.id, suffix, attempt=job.output_attempt or job.attempts, start=start, end=end)

    def output_bytes(self, job: Job, suffix: str) -> bytes | None:
        return self.outputs.get_bytes(job.id, suffix, attempt=job.output_attempt or job.attempts)

    def lead_frames(self, job_id: str) -> np.ndarray | None:
        """The frames the job's video starts with (``submit``'s ``lead``), memory-mapped; ``None`` without."""
        path = self.path(job_id, ".lead.npy")
        if not self.outputs.local and not path.is_file():
            data = self.outputs.get_bytes(job_id, ".lead.npy", attempt=0)
            if data is None:
                return None
            tmp = self.path(job_id, ".lead.npy.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)  # this node's copy, removed with the job's files
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            return None

    def save_checkpoint(self, job_id: str, passes_done: int, arrays: dict[str, np.ndarray], *,
                        attempt: int | None = None) -> None:
        """A running job's checkpoint (``SampleControl.on_checkpoint``), replacing the one before atomically; with
        ``attempt``, only while that attempt is the job's (it then records which attempt's checkpoint is current).

        To a shared output store (with ``attempt``) it is uploaded in the background: the arrays are copied into
        the archive here, the group goes on, and the job's next checkpoint, its :meth:`finish` and this server's
        :meth:`load_checkpoint` of it wait for the upload (one at a time per job). Until its record is updated,
        the job's checkpoint is the one before."""
        buffer = io.BytesIO()
        np.savez(buffer, passes_done=np.array(passes_done, dtype=np.int64), **arrays)
        data = buffer.getvalue()
        if attempt is None:
            self._save_checkpoint(job_id, passes_done, data, None)
            return
        if self.outputs.local:
            self._save_checkpoint_quietly(job_id, passes_done, data, attempt)
            return
        self.wait_checkpoint(job_id)  # the one before, first
        upload = self._uploads.submit(self._save_checkpoint_quietly, job_id, passes_done, data, attempt)
        with self._lock:
            self._uploading[job_id] = upload

    def wait_checkpoint(self, job_id: str) -> None:
        """Until the job's checkpoint being uploaded (if any) is saved, or given up on."""
        with self._lock:
            upload = self._uploading.pop(job_id, None)
        if upload is not None:
            upload.result()

    def _save_checkpoint_quietly(self, job_id: str, passes_done: int, data: bytes, attempt: int) -> None:
        try:
            self._save_checkpoint(job_id, passes_done, data, attempt)
        except StoreUnavailable as exc:  # no checkpoint costs a resume from the one before, not the job
            log.warning("job %s: checkpoint after pass %d not saved (%s)", job_id, passes_done, exc)
        except Exception:  # noqa: BLE001 -- as above: the job goes on (off its thread, nobody else would see it)
            log.exception("job %s: checkpoint after pass %d not saved", job_id, passes_done)

    def _save_checkpoint(self, job_id: str, passes_done: int, data: bytes, attempt: int | None) -> None:
        if attempt is not None and not self._current(job_id, attempt):
            return
        self.outputs.put_bytes(job_id, ".resume.npz", data, attempt=attempt or 0)
        if attempt is not None:
            with self._lock:
                cur = self._db.execute("UPDATE jobs SET checkpoint_attempt = ? WHERE id = ? AND attempts = ? AND "
                                       "status = 'in_progress'", (attempt, job_id, attempt))
                # A stale attempt's checkpoint is nobody's, unless the record still names this attempt's: then it is
                # the one the job goes on from (this attempt lost its claim after its check above), now at a later
                # pass of the same job, and stays. No later attempt names this one again.
                stale = not cur.rowcount and not self.outputs.local and self._checkpoint_attempt(job_id) != attempt
            if stale:
                self.outputs.delete(job_id, f"/{attempt}.resume.npz")

    def _checkpoint_attempt(self, job_id: str) -> int | None:
        if self.outputs.local:
            return 0  # the folder's one file
        row = self._db.execute("SELECT checkpoint_attempt FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else row["checkpoint_attempt"]

    def load_checkpoint(self, job_id: str) -> tuple[int, dict[str, np.ndarray]] | None:
        """The job's last checkpoint, ``None`` when it has none (or an unreadable one: the job starts over)."""
        self.wait_checkpoint(job_id)
        with self._lock:
            attempt = self._checkpoint_attempt(job_id)
        data = None if attempt is None else self.outputs.get_bytes(job_id, ".resume.npz", attempt=attempt)
        if data is None:
            return None
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                arrays = {k: archive[k] for k in archive.files}
        except (OSError, ValueError, EOFError):
            return None
        return int(arrays.pop("passes_done")), arrays

    def _remove_files(self, job_id: str, *suffixes: str) -> None:
        """The job's files with these suffixes (none given: all of them), after the commit in progress."""
        def remove() -> None:
            if self.outputs.local:
                self.outputs.delete(job_id, *suffixes)
                return
            for file in self.videos_dir.glob(f"{job_id}.*"):  # this node's spool copies
                if not suffixes or file.name.endswith(suffixes):
                    file.unlink(missing_ok=True)
            # NOTE(cleanup): requests to a remote store, off the store's lock and the job's lane; one that fails
            # leaves objects no record points at (logged), never a record without its objects.
            self._cleaner.submit(self._delete_remote, job_id, suffixes)

        self._remove(remove)

    def _delete_remote(self, job_id: str, suffixes: tuple[str, ...]) -> None:
        try:
            self.outputs.delete(job_id, *suffixes)
        except StoreUnavailable as exc:
            log.warning("job %s: its files %s were not removed from the %s", job_id, suffixes or "(all)", exc)

    def sweep_outputs(self, *, min_age_s: float = SWEEP_MIN_AGE_S) -> list[tuple[str, int, str]]:
        """Files of a shared output store that no record points at, removed; returns them (job id, attempt, suffix).
        Those of a job that ended, but its content (a completed job's own attempt's MP4, thumbnail and frames): a
        stale attempt's, checkpoints, lead frames, a failed or cancelled job's; and, once ``min_age_s`` old, those of
        no job (a delete whose requests failed; younger ones may be a job's whose record is not committed yet). A
        running or queued job's files are left to it. Safe beside every server of the fleet: what it removes no
        record will ever name."""
        objects = list(self.outputs.objects())  # off the lock: requests to a remote store
        if not objects:
            return []
        with self._lock:
            # The attempt whose files are the content, as the reads take it (output_attempt, else attempts).
            rows = {r["id"]: (r["status"], r["output_attempt"] or r["attempts"]) for r in self._db.execute(
                "SELECT id, status, output_attempt, attempts FROM jobs").fetchall()}
        removed = []
        for job_id, attempt, suffix, age in objects:
            status, output = rows.get(job_id, (None, None))
            if status is None:
                gone = age >= min_age_s
            elif status not in TERMINAL:
                gone = False
            else:
                gone = status != "completed" or attempt != output or suffix not in (".mp4", ".jpg", ".npy")
            if gone:
                self.outputs.remove(job_id, suffix, attempt=attempt)
                removed.append((job_id, attempt, suffix))
        if removed:
            log.info("removed %d files of the %s that no job's record names", len(removed), self.outputs.name)
        return removed

    def _sweep_remote(self) -> None:
        try:
            self.sweep_outputs()
        except StoreUnavailable as exc:
            log.warning("the %s was not swept: %s", self.outputs.name, exc)

    def _sweep(self) -> None:
        """Files that interrupted writes left (caller holds the lock; no job of this server runs): temporary
        files, files of jobs that no longer exist, and the checkpoint and lead of ended jobs; an S3 store's spool is
        emptied."""
        spool = not self.outputs.local
        states = {r["id"]: r["status"] for r in self._db.execute("SELECT id, status FROM jobs").fetchall()}
        for file in self.videos_dir.iterdir():
            job_id, _, suffix = file.name.partition(".")
            if not valid_job_id(job_id):
                continue  # not the store's
            status = states.get(job_id)
            if (spool or suffix.endswith("tmp") or status is None
                    or (status in TERMINAL and suffix in ("resume.npz", "lead.npy"))):
                log.info("removing %s, left by an interrupted write", file.name)
                file.unlink(missing_ok=True)
