"""``server.outputs.streaming`` without a worker group: pieces in, the reader
sees each piece's bytes before the next one is
written, and what it read is byte for byte the file that is renamed into place."""

from __future__ import annotations

import numpy as np
import pytest

from cp_infer.request import GenerationRequest
from cp_infer.video_io import read_mp4
from server.group.jobs import JobStore
from server.outputs.streaming import StreamedOutputs, VideoStream


@pytest.fixture
def store(tmp_path):
    store = JobStore(tmp_path, max_queue=4)
    yield store
    store.close()


def _job(store, num_frames=17):
    request = GenerationRequest(prompt="a fox", num_frames=num_frames, height=64, width=96, fps=12)
    return store.submit(request, model="m"), request


def test_reader_follows_the_pieces_and_gets_the_committed_bytes(store, tmp_path):
    job, request = _job(store)
    rng = np.random.default_rng()
    video = rng.integers(0, 256, size=(17, 64, 96, 3), dtype=np.uint8)
    stream = VideoStream(job.id)
    outputs = StreamedOutputs(store, job.id, request, keep_frames=True, stream=stream)
    received, sizes = [], []
    for first, last in ((0, 9), (9, 17)):
        outputs.write(video[first:last], first)
        received.append(stream.read(1 << 20))
        sizes.append(len(received[-1]))
    assert all(sizes), sizes  # each piece's bytes were readable before the next piece was written
    outputs.commit()
    stream.end("completed")
    received.append(stream.read(1 << 20))
    stream.close()
    assert outputs.error is None
    mp4 = store.path(job.id, ".mp4")
    assert b"".join(received) == mp4.read_bytes()
    assert read_mp4(mp4)[0].shape == (17, 64, 96, 3)
    np.testing.assert_array_equal(np.load(store.path(job.id, ".npy")), video)  # the raw frames are exact
    assert store.path(job.id, ".jpg").is_file()
    assert sorted(p.name for p in store.videos_dir.iterdir()) == sorted(f"{job.id}{s}" for s in (".mp4", ".npy",
                                                                                                   ".jpg"))
    outputs.discard()  # after commit: nothing to remove
    assert mp4.is_file()


def test_out_of_order_piece_fails_at_commit_and_discard_leaves_nothing(store):
    job, request = _job(store)
    frames = np.random.default_rng().integers(0, 256, size=(8, 64, 96, 3), dtype=np.uint8)
    stream = VideoStream(job.id)
    outputs = StreamedOutputs(store, job.id, request, keep_frames=False, stream=stream)
    outputs.write(frames, 0)
    outputs.write(frames, 9)  # frame 8 never came: kept, not raised (this runs inside the decode)
    assert "expected the next ones in order" in outputs.error
    with pytest.raises(RuntimeError, match="in order"):
        outputs.commit()
    outputs.discard()
    stream.close()
    assert list(store.videos_dir.iterdir()) == []


def test_missing_frames_fail_the_commit(store):
    job, request = _job(store, num_frames=9)
    outputs = StreamedOutputs(store, job.id, request, keep_frames=False, stream=VideoStream(job.id))
    outputs.write(np.random.default_rng().integers(0, 256, size=(4, 64, 96, 3), dtype=np.uint8), 0)
    with pytest.raises(RuntimeError, match="delivered 4 frames, expected 9"):
        outputs.commit()
    outputs.discard()
    assert list(store.videos_dir.iterdir()) == []


def test_a_closed_reader_is_never_attached(tmp_path):
    path = tmp_path / "x.mp4"
    path.write_bytes(b"abc")
    stream = VideoStream("video_" + "0" * 32)
    stream.close()
    stream.attach(path)  # the client left before the job started: no descriptor is opened (or leaked)
    assert stream.read(10) == b""
