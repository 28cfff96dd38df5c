"""Helios through the front ends: a real 2-rank ``cp-infer serve --model tiny-helios --ulysses-degree 2`` lists it in
``GET /v1/models`` with its options, makes a video of two chunks (the chunk's and its history's tokens sharded over
the two ranks), continues an uploaded video (video-to-video: a clip as ``input_reference``), and refuses frames that
are not whole chunks, and a clip shorter than a chunk, with a 400 naming the fix.

That N ranks make the 1-rank video, and 1 rank ``HeliosPipeline``'s, is tests/models/helios/test_helios.py's to check
(in process, on lossless frames); here the front end is.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest

from cp_infer.video_io import read_mp4

from ..conftest import ServerProcess, mp4_bytes

FRAMES, HEIGHT, WIDTH = 17, 32, 32  # two chunks of 3 latent frames (9 video frames each, cut to 17)


@pytest.fixture(scope="module")
def helios_server(tmp_path_factory):
    from models.helios.default import ensure_default_helios_model

    cache = tmp_path_factory.mktemp("helios_cache")
    ensure_default_helios_model(cache)  # built once here, so that the ranks only load it
    server = ServerProcess(tmp_path_factory.mktemp("helios_server"), cache,
                           extra_args=["--model", "tiny-helios", "--ulysses-degree", "2", "--heartbeat-s", "0.5",
                                       "--collective-timeout", "60"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_the_server_serves_helios(helios_server, tmp_path: Path):
    s = helios_server
    listed = s.client.get("/v1/models").json()["data"]
    assert [m["family"] for m in listed] == ["helios"], listed
    assert listed[0]["id"] == "tiny-helios"
    job = s.submit({"prompt": "a red fox in fresh snow", "num_frames": FRAMES, "size": f"{WIDTH}x{HEIGHT}",
                    "num_inference_steps": 2, "seed": 5, "num_latent_frames_per_chunk": 3})
    # HeliosPipeline's defaults for what the request leaves unset.
    assert job["history_sizes"] == [16, 2, 1] and job["guidance_scale"] == 5.0, job
    final = s.wait_job(job["id"])
    assert final["status"] == "completed", f"{final}\n{s.log_tail()}"
    content = s.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    (tmp_path / "job.mp4").write_bytes(content.content)
    frames, fps = read_mp4(tmp_path / "job.mp4")
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == 24 and frames.std() > 1

    r = s.client.post("/v1/videos", json={"prompt": "a fox", "num_frames": 18, "size": f"{WIDTH}x{HEIGHT}",
                                          "num_latent_frames_per_chunk": 3})
    assert r.status_code == 400 and "num_frames=18" in r.text and "try 9 or 17" in r.text, r.text


@pytest.mark.timeout(300)
def test_the_server_continues_a_video(helios_server):
    """A clip as input_reference is HeliosPipeline's video (decoded and checked on rank 0, then encoded on every
    rank): the chunks made after it are the job's frames. A clip shorter than a chunk is a 400 naming it."""
    s = helios_server
    rng = np.random.default_rng(3)
    clip = rng.integers(0, 256, (9, HEIGHT, WIDTH, 3), dtype=np.uint8)

    def url(frames: np.ndarray) -> str:
        return f"data:video/mp4;base64,{base64.b64encode(mp4_bytes(frames)).decode()}"

    r = s.client.post("/v1/videos", json={"prompt": "a fox", "num_frames": FRAMES, "size": f"{WIDTH}x{HEIGHT}",
                                          "num_latent_frames_per_chunk": 3, "input_reference": url(clip[:5])})
    assert r.status_code == 400 and "has 5 frames" in r.text and "at least 9" in r.text, r.text
    job = s.submit({"prompt": "the fox keeps running", "num_frames": FRAMES, "size": f"{WIDTH}x{HEIGHT}",
                    "num_inference_steps": 2, "guidance_scale": 1.0, "seed": 7, "num_latent_frames_per_chunk": 3,
                    "input_reference": url(clip)})
    final = s.wait_job(job["id"])
    assert final["status"] == "completed", f"{final}\n{s.log_tail()}"
