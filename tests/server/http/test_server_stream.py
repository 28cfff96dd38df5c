"""``POST /v1/videos`` with ``stream=true`` against the real 2-rank server: the MP4 arrives while it is decoded.

Order, not timing: ``[slow-decode]`` (conftest's faults) makes rank 0 pause for 1 s after each decoded piece has
been encoded, and a 65-frame video (9 latent frames) is decoded in 2 rounds of at most 4 latent frames per rank (the
automatic round size at 64x96): 4 pieces on two ranks. The first bytes must then come while the job is still in
progress with its progress below 97, the mark that only the last piece's arrival sets. A server that sent the file
only once written would give its first byte after progress 100. The pause only widens the window in which the job
record can be read; it decides nothing.
"""

from __future__ import annotations

import io

import av
import httpx
import numpy as np
import pytest

from cp_infer.video_io import read_mp4

from ..conftest import tiny
from ..group.test_server_faults import _next_job_completes, _wait_running
from .test_server_e2e import luma


def _post_streamed(s, body: dict, *, query: bool = True):
    if query:
        return s.client.stream("POST", "/v1/videos", params={"stream": "true"}, json=body, timeout=120)
    return s.client.stream("POST", "/v1/videos", json={**body, "stream": True}, timeout=120)


def test_streamed_mp4_arrives_before_the_last_piece_and_matches_the_stored_video(api_server, tmp_path):
    s = api_server
    seed = int(np.random.default_rng().integers(0, 2**16))
    body = tiny("[slow-decode] a kite over a windy beach", num_frames=65, seed=seed)
    with _post_streamed(s, body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.read()
        job_id = r.headers["x-video-id"]
        chunks = r.iter_raw()
        first = next(chunks)
        at_first_byte = s.client.get(f"/v1/videos/{job_id}").json()
        data = first + b"".join(chunks)
    assert at_first_byte["status"] == "in_progress" and 90 <= at_first_byte["progress"] < 97, at_first_byte
    assert len(first) < len(data)

    (tmp_path / "streamed.mp4").write_bytes(data)
    frames, fps = read_mp4(tmp_path / "streamed.mp4")
    assert frames.shape == (65, 64, 96, 3) and fps == 25 and frames.std() > 5
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.video[0].codec_context.name == "h264"

    final = s.client.get(f"/v1/videos/{job_id}").json()
    assert final["status"] == "completed" and final["progress"] == 100 and final["completed_at"] >= final["created_at"]
    stored = s.client.get(f"/v1/videos/{job_id}/content")
    assert stored.status_code == 200 and stored.content == data  # the same bytes, not just the same video
    raw = np.load(io.BytesIO(s.client.get(f"/v1/videos/{job_id}/content?variant=frames").content))
    assert raw.shape == (65, 64, 96, 3) and raw.dtype == np.uint8
    # Pixel-noise content loses its chroma in yuv420p; the luma stays within a few levels (see test_server_e2e).
    assert np.abs(luma(frames) - luma(raw)).mean() < 8
    assert s.client.get(f"/v1/videos/{job_id}/content", params={"variant": "thumbnail"}).status_code == 200


def test_bad_streamed_requests_are_json_errors_before_anything_streams(api_server):
    s = api_server
    r = s.client.post("/v1/videos", params={"stream": "true"}, json=tiny(num_frames=40))
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_frames"
    r = s.client.post("/v1/videos", json={**tiny(), "stream": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = s.client.post("/v1/videos", params={"stream": "false"}, json={**tiny(), "stream": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "conflicting_parameters"


def test_client_leaving_while_denoising_cancels_the_job(api_server):
    s = api_server
    with _post_streamed(s, tiny("[slow] a bell tower at noon", num_inference_steps=40), query=False) as r:
        assert r.status_code == 200
        job_id = r.headers["x-video-id"]
        _wait_running(s, job_id, min_progress=3)
    final = s.wait_job(job_id, timeout=15)  # one step boundary (0.25 s), not the ~9 s of steps left
    assert final["status"] == "cancelled" and final["progress"] < 90, final
    assert not list((s.data_dir / "videos").glob(f"{job_id}.*"))
    _next_job_completes(s)


def test_client_leaving_during_the_decode_ends_the_job_cancelled(api_server):
    s = api_server
    with _post_streamed(s, tiny("[slow-decode] a lantern in the fog", num_frames=65)) as r:
        job_id = r.headers["x-video-id"]
        next(r.iter_raw())  # the first piece is out: the group is decoding, which cannot be interrupted
    final = s.wait_job(job_id, timeout=60)
    assert final["status"] == "cancelled" and final["error"]["message"] == "cancelled during the decode", final
    assert s.client.get(f"/v1/videos/{job_id}/content").status_code == 409
    assert not list((s.data_dir / "videos").glob(f"{job_id}.*"))
    _next_job_completes(s)


def test_a_streamed_job_that_fails_ends_the_body_without_its_last_chunk(api_server):
    s = api_server
    with _post_streamed(s, tiny("[fault:rank1-raise] a storm over a harbour", num_inference_steps=3)) as r:
        assert r.status_code == 200
        job_id = r.headers["x-video-id"]
        # A truncated transfer, never a complete-looking (empty or short) video.
        with pytest.raises(httpx.RemoteProtocolError, match="incomplete chunked read"):
            r.read()
    final = s.wait_job(job_id)
    assert final["status"] == "failed" and final["error"]["code"] == "generation_failed", final
    _next_job_completes(s)
