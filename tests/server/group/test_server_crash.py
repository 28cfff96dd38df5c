"""The whole server SIGKILLed at once (the front end, the launcher and every rank), mid-queue and mid-write, then
started again on the same data directory: the job store carries everything over.

A long video (three windows, 0.3 s per step on rank 0) is killed once it has a checkpoint, while its streamed MP4 is
half written; two jobs wait behind it and one finished before. After the restart the queued jobs are still queued
and complete after it, the long video goes on from its checkpoint and completes, no job's content is served before
its job completes, and a client polling the long video's ``progress`` throughout (across the restart) never sees it
decrease. ``test_jobs.py`` covers the store's part without processes.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sqlite3
import threading
import time

import httpx
import pytest

from ..conftest import API_KEY, ServerProcess, alive, descendants, tiny

pytestmark = pytest.mark.timeout(300)

_FAULTS = "rank=0,kind=sleep,seconds=0.3,prompt=[slow]"
_ARGS = ["--heartbeat-s", "0.5", "--collective-timeout", "30", "--keep-frames"]


class _Poller(threading.Thread):
    """Reads every job's content and record in turn, as long as it runs, from whichever server is up."""

    def __init__(self, long_id: str, job_ids: list[str]):
        super().__init__(daemon=True)
        self.url: str | None = None
        self.long_id, self.job_ids = long_id, job_ids
        self.seen: list[tuple[str, str, str, int]] = []  # (server url, job id, status, progress)
        self.early_content: list[str] = []
        self.served: dict[str, bytes] = {}
        self.errors: list[str] = []
        self._done = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.Client(headers=headers, timeout=5) as client:
            while not self._done.is_set():
                url = self.url
                try:
                    for job_id in self.job_ids:
                        # The content first: a 200 is only allowed for a job that had completed by then, so the
                        # record read after it must say completed.
                        content = client.get(f"{url}/v1/videos/{job_id}/content")
                        job = client.get(f"{url}/v1/videos/{job_id}").json()
                        if content.status_code == 200:
                            self.served.setdefault(job_id, content.content)
                            if job["status"] != "completed":
                                self.early_content.append(f"{job_id} served while {job['status']}")
                        elif content.status_code != 409:
                            self.errors.append(f"{job_id}: content {content.status_code} {content.text}")
                        self.seen.append((url, job_id, job["status"], job["progress"]))
                    time.sleep(0.03)  # leaves the two cores to the ranks; a 0 lasting one step (0.3 s) is still seen
                except httpx.HTTPError:
                    time.sleep(0.05)  # the server is down or not up yet

    def stop(self) -> None:
        self._done.set()
        self.join(10)

    def of(self, job_id: str, url: str) -> list[tuple[str, int]]:
        """``(status, progress)`` of a job as the server at ``url`` gave it, in order."""
        return [(st, p) for u, j, st, p in self.seen if u == url and j == job_id]


def _frames(mp4: bytes) -> int:
    import av

    with av.open(io.BytesIO(mp4)) as container:
        return sum(1 for _ in container.decode(video=0))


def _sigkill_everything(s: ServerProcess) -> list[int]:
    """SIGKILL the CLI (the launcher), every process below it and every rank, all in one sweep."""
    pids = sorted({s.proc.pid, *descendants(s.proc.pid), *s.group()["pids"]})
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in pids), [pid for pid in pids if alive(pid)]
    return pids


def _size(path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _wait_mid_write(s: ServerProcess, job_id: str, timeout: float = 60) -> dict:
    """The long video once it has a checkpoint and the first of its frames are in its MP4, still being written."""
    videos = s.data_dir / "videos"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = s.client.get(f"/v1/videos/{job_id}").json()
        assert job["status"] in ("queued", "in_progress"), job
        # A window after the first means the checkpoint after it is saved (on_checkpoint comes before on_pass).
        if ((job["window"] or 0) >= 1 and (videos / f"{job_id}.resume.npz").exists()
                and _size(videos / f"{job_id}.mp4.tmp") > 0):
            return job
        time.sleep(0.02)
    pytest.fail(f"{job_id} reached no checkpoint in {timeout} s: {job}\n{s.log_tail()}")


def test_the_whole_server_killed_at_once_comes_back_with_every_job(tmp_path, cache_dir):
    first = ServerProcess(tmp_path, cache_dir, faults=_FAULTS, extra_args=_ARGS)
    second = None
    poller = None
    try:
        first.wait_ready()
        before = first.submit(tiny("a lighthouse at dusk", seed=7))
        assert first.wait_job(before["id"])["status"] == "completed"
        before_mp4 = first.client.get(f"/v1/videos/{before['id']}/content").content
        long = first.submit(tiny("[slow] a river through a canyon", num_frames=161, seed=21))
        queued = [first.submit(tiny(f"queued clip {i}", seed=40 + i)) for i in range(2)]
        ids = [long["id"], *(q["id"] for q in queued)]
        poller = _Poller(long["id"], ids)
        poller.url = first.url
        poller.start()
        at_kill = _wait_mid_write(first, long["id"])
        pids = _sigkill_everything(first)
        first.stop()

        # What the crash left: the SQLite records as they were, the long video's MP4 half written under its
        # temporary name and no job's content in place.
        videos = first.data_dir / "videos"
        with contextlib.closing(sqlite3.connect(first.data_dir / "jobs.sqlite3")) as db:
            status = dict(db.execute("SELECT id, status FROM jobs").fetchall())
            progress = db.execute("SELECT progress FROM jobs WHERE id = ?", (long["id"],)).fetchone()[0]
        assert status == {before["id"]: "completed", long["id"]: "in_progress",
                          **{q["id"]: "queued" for q in queued}}, status
        assert progress >= at_kill["progress"] > 0
        assert _size(videos / f"{long['id']}.mp4.tmp") > 0 and (videos / f"{long['id']}.resume.npz").exists()
        assert not [p.name for p in videos.glob("*.mp4") if not p.name.startswith(before["id"])]

        first.log_path.rename(tmp_path / "server-killed.log")
        second = ServerProcess(tmp_path, cache_dir, faults=_FAULTS, extra_args=_ARGS)
        poller.url = second.url
        second.wait_ready()
        assert set(second.group()["pids"]).isdisjoint(pids)
        done = second.wait_job(long["id"], timeout=120)
        assert done["status"] == "completed" and done["windows"] == 3, done
        finals = [second.wait_job(q["id"]) for q in queued]
        assert all(f["status"] == "completed" for f in finals), finals
        assert done["completed_at"] <= finals[0]["completed_at"] <= finals[1]["completed_at"]
        assert "goes on from its checkpoint after pass" in second.log_tail(400)
        time.sleep(0.3)  # a last round of the poller, with every job completed
        poller.stop()

        assert not poller.errors and not poller.early_content, (poller.errors, poller.early_content)
        for q in queued:  # still queued when the new server came up (the long video runs first, 0.3 s a step)
            assert poller.of(q["id"], second.url)[0][0] == "queued", poller.of(q["id"], second.url)
        resumed = poller.of(long["id"], second.url)
        seen = poller.of(long["id"], first.url) + resumed
        progress = [p for _, p in seen]
        assert progress == sorted(progress), f"progress ran backwards: {seen}"
        assert min(p for _, p in resumed) >= at_kill["progress"], f"below its {at_kill['progress']} at the kill: {seen}"
        assert any(st == "in_progress" for st, _ in resumed) and seen[-1] == ("completed", 100), seen
        # Every job's video is whole: the one made before the crash is unchanged, the others have every frame.
        assert second.client.get(f"/v1/videos/{before['id']}/content").content == before_mp4
        for job_id, frames in [(long["id"], 161), *((q["id"], 9) for q in queued)]:
            mp4 = second.client.get(f"/v1/videos/{job_id}/content").content
            assert _frames(mp4) == frames and poller.served.get(job_id, mp4) == mp4
        assert not list(videos.glob("*.tmp")) and not list(videos.glob("*.resume.npz"))
    finally:
        if poller is not None:
            poller.stop()
        first.stop()
        if second is not None:
            second.stop()
