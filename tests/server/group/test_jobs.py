"""The job store on its own (no worker group): what a restart finds after the server died at any moment.

A requeued job's progress never runs backwards when it has a checkpoint; a completed job whose video is missing or
cut short is not served as complete; leftovers of interrupted writes are swept; and a store SIGKILLed in the middle of
its writes opens intact with every acknowledged change in it. ``test_server_crash.py`` kills a whole real server.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import sqlite3

import numpy as np
import pytest

from cp_infer.request import Condition, GenerationRequest, resolve_request
from models.ltx_video.options import ltx_video_options
from server.group.jobs import JobStore, _mp4_complete

_ORDER = {"queued": 0, "in_progress": 1, "completed": 2, "failed": 2, "cancelled": 2}


def _request(prompt: str) -> GenerationRequest:
    return resolve_request(GenerationRequest(prompt=prompt, num_frames=9, width=96, height=64), ltx_video_options())


def _reopen(store: JobStore, tmp_path) -> JobStore:
    store.close()
    return JobStore(tmp_path, max_queue=8)


def _progress_events(store: JobStore, job_id: str) -> list[int]:
    return [e["progress"] for _, e in store.events_since(job_id, 0)]


def _checkpoint() -> dict[str, np.ndarray]:
    return {"latents": np.random.default_rng().standard_normal((1, 4, 3)).astype(np.float32)}


def test_a_requeued_job_with_a_checkpoint_keeps_its_progress_through_its_resume(tmp_path):
    """The group died at 60% with a checkpoint: from the requeue to the resumed job's next steps, ``progress``
    reads 60 or more (never 0), in the record and in every event a client can see."""
    store = JobStore(tmp_path, max_queue=8)
    job = store.submit(_request("a windowed video"), model="m")
    store.claim_next(timeout=0)
    store.save_checkpoint(job.id, 2, _checkpoint())
    for p in (30, 60, 62):  # 62: a step of the pass after the checkpoint, lost with the group
        store.set_progress(job.id, p)
    store = _reopen(store, tmp_path)
    assert store.recover() == [job.id]
    requeued = store.get(job.id)
    assert requeued.status == "queued" and requeued.progress == 62, requeued
    claimed = store.claim_next(timeout=0)
    assert claimed.id == job.id and claimed.status == "in_progress" and claimed.progress == 62, claimed
    assert store.load_checkpoint(job.id)[0] == 2
    # The resumed pass reports its steps again from the checkpoint's (60) on: below 62 nothing moves.
    for p in (60, 61, 75):
        store.set_progress(job.id, p)
    assert store.get(job.id).progress == 75
    store.finish(job.id, "completed")
    progress = _progress_events(store, job.id)
    assert progress == sorted(progress) and progress[0] == 62 and progress[-1] == 100, progress


def test_a_requeued_job_without_a_checkpoint_starts_again_at_zero(tmp_path):
    store = JobStore(tmp_path, max_queue=8)
    job = store.submit(_request("a short video"), model="m")
    store.claim_next(timeout=0)
    store.set_progress(job.id, 45)
    store = _reopen(store, tmp_path)
    assert store.recover() == [job.id]
    assert store.get(job.id).progress == 0
    assert store.claim_next(timeout=0).progress == 0


def test_a_claimed_job_whose_checkpoint_cannot_be_read_starts_over_at_zero(tmp_path):
    store = JobStore(tmp_path, max_queue=8)
    job = store.submit(_request("a windowed video"), model="m")
    store.claim_next(timeout=0)
    store.save_checkpoint(job.id, 1, _checkpoint())
    store.set_progress(job.id, 40)
    store = _reopen(store, tmp_path)
    store.recover()
    store.path(job.id, ".resume.npz").write_bytes(b"not an npz")
    assert store.claim_next(timeout=0).progress == 40
    assert store.load_checkpoint(job.id) is None
    store.start_over(job.id)  # what the leader does then
    assert store.get(job.id).progress == 0


def _mp4(tmp_path, name: str, *, fragmented: bool) -> bytes:
    from cp_infer.stream import FragmentedMP4Writer
    from cp_infer.video_io import write_mp4

    frames = np.random.default_rng().integers(0, 256, (9, 64, 96, 3), dtype=np.uint8)
    if fragmented:
        out = bytearray()
        writer = FragmentedMP4Writer(out.extend, width=96, height=64, fps=24)
        writer.write(frames)
        writer.close()
        return bytes(out)
    path = tmp_path / name
    write_mp4(frames, path, 24)
    return path.read_bytes()


@pytest.mark.parametrize("fragmented", [False, True], ids=["whole", "fragmented"])
def test_mp4_complete_accepts_whole_files_and_refuses_cut_ones(tmp_path, fragmented):
    data = _mp4(tmp_path, "source.mp4", fragmented=fragmented)
    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    assert _mp4_complete(path)
    rng = random.Random()
    for cut in [0, 7, 8, len(data) // 2, len(data) - 1, *rng.sample(range(1, len(data)), 5)]:
        path.write_bytes(data[:cut])
        assert not _mp4_complete(path), cut
    assert not _mp4_complete(tmp_path / "missing.mp4")


def test_a_completed_job_whose_video_is_missing_or_cut_is_failed_at_recovery(tmp_path):
    store = JobStore(tmp_path, max_queue=8)
    jobs = [store.submit(_request(f"clip {i}"), model="m") for i in range(3)]
    data = _mp4(tmp_path, "source.mp4", fragmented=False)
    for job in jobs:
        store.claim_next(timeout=0)
        store.path(job.id, ".mp4").write_bytes(data)
        store.path(job.id, ".jpg").write_bytes(b"jpeg")
        store.finish(job.id, "completed")
    intact, missing, cut = jobs
    store.path(missing.id, ".mp4").unlink()
    store.path(cut.id, ".mp4").write_bytes(data[: len(data) // 2])
    store = _reopen(store, tmp_path)
    assert store.recover() == []
    assert store.get(intact.id).status == "completed"
    assert store.path(intact.id, ".mp4").read_bytes() == data
    for job in (missing, cut):
        lost = store.get(job.id)
        assert lost.status == "failed" and lost.error_code == "output_lost", lost
        assert "submit it again" in lost.error_message
        assert not list(store.videos_dir.glob(f"{job.id}.*")), "a failed job keeps no half of its outputs"


def test_recovery_sweeps_what_interrupted_writes_left(tmp_path):
    """Temporary files (a half-written MP4, checkpoint or thumbnail), files of jobs that no longer exist, the
    checkpoint and lead of ended jobs, and a record whose delete was cut short; the files of live jobs stay."""
    store = JobStore(tmp_path, max_queue=8)
    queued = store.submit(_request("queued"), model="m", lead=np.zeros((9, 64, 96, 3), dtype=np.uint8) + 7)
    running = store.submit(_request("running"), model="m")
    ended = store.submit(_request("ended"), model="m")
    gone = "video_" + "ab" * 16
    assert store.claim_next(timeout=0).id == queued.id
    store._db.execute("UPDATE jobs SET status = 'queued' WHERE id = ?", (queued.id,))  # back to queued, by hand
    store._db.execute("UPDATE jobs SET status = 'in_progress' WHERE id = ?", (running.id,))
    store.save_checkpoint(running.id, 1, _checkpoint())
    store._db.execute("UPDATE jobs SET status = 'cancelled', deleting = 1 WHERE id = ?", (ended.id,))
    for name in (f"{running.id}.mp4.tmp", f"{running.id}.resume.tmp", f"{queued.id}.jpg.tmp", f"{gone}.mp4",
                 f"{gone}.lead.npy", f"{ended.id}.resume.npz", f"{ended.id}.lead.npy", "notes.txt"):
        (store.videos_dir / name).write_bytes(b"x")
    store = _reopen(store, tmp_path)
    assert store.recover() == [running.id]
    left = sorted(p.name for p in store.videos_dir.iterdir())
    assert left == sorted([f"{queued.id}.lead.npy", f"{running.id}.resume.npz", "notes.txt"]), left
    assert store.snapshot_any(ended.id) is None
    assert store.lead_frames(queued.id)[0, 0, 0, 0] == 7


def test_database_is_in_wal_mode_with_synchronous_normal(tmp_path):
    """Durable against a killed process (not a power loss): every committed transaction is in the WAL, which the
    next open replays."""
    store = JobStore(tmp_path, max_queue=8)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL


def _churn(data_dir: str, acks, seed: int, mp4: bytes) -> None:
    """Run jobs through the store as fast as it goes, acknowledging each change once it returned (committed):
    ``(id, status, progress, may_vanish)``, the last true when the next change deletes the job."""
    rng = random.Random(seed)
    store = JobStore(data_dir, max_queue=10_000)
    while True:
        job = store.submit(_request(f"churn {rng.random()}"), model="m")
        acks.send((job.id, "queued", 0, False))
        claimed = store.claim_next(timeout=0)
        if claimed is None:
            continue
        acks.send((claimed.id, "in_progress", 0, False))
        end = rng.choice(["completed", "failed", "delete", "leave"])
        store.save_checkpoint(claimed.id, 1, _checkpoint())
        store.set_progress(claimed.id, 50)
        acks.send((claimed.id, "in_progress", 50, end == "delete"))
        if end == "completed":
            tmp = store.path(claimed.id, ".mp4.tmp")
            with open(tmp, "wb") as f:  # as the leader writes an MP4: to a temporary name, renamed once whole
                for i in range(0, len(mp4), 1024):
                    f.write(mp4[i:i + 1024])
            os.replace(tmp, store.path(claimed.id, ".mp4"))
            store.finish(claimed.id, "completed")
        elif end == "failed":
            store.finish(claimed.id, "failed", "generation_failed", "boom")
        elif end == "delete":
            store.delete(claimed.id)
            store.finish(claimed.id, "cancelled")
        if end != "leave":
            acks.send((claimed.id, "deleted" if end == "delete" else end, 100 if end == "completed" else 50,
                       end == "delete"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("round_", range(3))
def test_a_store_killed_mid_write_opens_intact_with_every_acknowledged_change(tmp_path, round_):
    mp4 = _mp4(tmp_path, "source.mp4", fragmented=False)
    ctx = multiprocessing.get_context("fork")  # the store is imported already: no interpreter start per round
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_churn, args=(str(tmp_path / "store"), theirs, round_, mp4), daemon=True)
    child.start()
    theirs.close()
    acked: dict[str, tuple[str, int, bool]] = {}

    def receive() -> None:
        job_id, status, progress, may_vanish = ours.recv()
        acked[job_id] = (status, progress, may_vanish)

    want = random.randint(40, 160)
    while len(acked) < want:
        assert ours.poll(30), "the store made no progress"
        receive()
    os.kill(child.pid, signal.SIGKILL)  # somewhere in the middle of a write
    child.join(10)
    with contextlib.suppress(EOFError):  # acknowledged before the kill landed (then the pipe's end)
        while ours.poll():
            receive()
    with sqlite3.connect(tmp_path / "store" / "jobs.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = JobStore(tmp_path / "store", max_queue=10_000)
    for job_id, (status, progress, may_vanish) in acked.items():
        job = store.snapshot_any(job_id)
        if job is None:
            assert may_vanish, f"{job_id} was acknowledged {status} and is lost"
            continue
        assert status != "deleted", job
        assert _ORDER[job.status] >= _ORDER[status] and job.progress >= progress, (job, status, progress)
    store.recover()
    counts = store.counts()
    assert counts["in_progress"] == 0 and counts["completed"] > 0, counts
    assert not list(store.videos_dir.glob("*.tmp"))
    for job_id in acked:
        job = store.get(job_id)
        if job is not None and job.status == "completed":
            assert store.path(job_id, ".mp4").read_bytes() == mp4
        if job is not None and job.terminal:
            assert not store.path(job_id, ".resume.npz").exists()


@pytest.mark.parametrize("shared", [False, True], ids=["sqlite", "postgresql"])
def test_a_live_jobs_directions_are_stored_with_it_and_seen_after_a_restart(tmp_path, shared, request):
    """Directions are written with the job (one guarded write each: two stores directing the same job both land), shown
    with where each stands, and read back by a store opened after a crash; an ended or non-live job refuses one."""
    from cp_infer.live import Direction
    from server.group.jobs import Live, LiveRefused

    urls = dict(job_store=request.getfixturevalue("pg_url"),
                output_store=request.getfixturevalue("s3_url")) if shared else {}
    store = JobStore(tmp_path / "a", max_queue=8, **urls)
    other = JobStore(tmp_path / "b", max_queue=8, **urls) if shared else store
    job = store.submit(_request("a fox"), model="m", live=Live((Direction("a fox", 2),)))
    plain = store.submit(_request("not live"), model="m")

    def add(prompt: str, windows: int, image=None):
        return lambda job, live: Live((*live.directions, Direction(prompt, windows, image)))

    pixels = np.random.default_rng(0).integers(0, 256, (1, 12, 20, 3), dtype=np.uint8)
    store.direct(job.id, add("it jumps", 1, Condition(pixels)))  # an image: stored with it, byte for byte
    seen = other.direct(job.id, add("night falls", 3))
    assert [d["prompt"] for d in seen.public()["live"]["directions"]] == ["a fox", "it jumps", "night falls"]
    claimed = store.claim_next(timeout=1)
    assert claimed.id == job.id and claimed.live.directions[1] == Direction("it jumps", 1, Condition(pixels))
    store.set_window(job.id, 2, 3, attempt=claimed.attempts)  # making window 2: "it jumps"
    shown = store.get(job.id).public()["live"]
    assert [d["state"] for d in shown["directions"]] == ["made", "in_progress", "queued"], shown
    assert [d["image"] for d in shown["directions"]] == [False, True, False], shown
    assert shown["windows_directed"] == 6 and shown["windows_made"] == 2 and not shown["waiting"], shown
    if not shared:  # the group dies; the embedded store's next server requeues the job with every direction
        store = _reopen(store, tmp_path / "a")
        assert store.recover() == [job.id]
    resumed = store.get(job.id)
    assert resumed.live.directions == (Direction("a fox", 2), Direction("it jumps", 1, Condition(pixels)),
                                       Direction("night falls", 3))
    np.testing.assert_array_equal(resumed.live.directions[1].image.frames, pixels)
    ended = store.direct(job.id, lambda job, live: Live(live.directions, ended=True))
    assert ended.public()["live"]["ended"] is True
    with pytest.raises(LiveRefused, match="has ended") as refused:
        store.direct(job.id, add("more", 1))
    assert refused.value.code == "video_ended"
    with pytest.raises(LiveRefused, match="not live") as refused:
        store.direct(plain.id, add("more", 1))
    assert refused.value.code == "not_live" and store.direct("video_" + "0" * 32, add("x", 1)) is None
    for s in {store, other}:
        s.close()
