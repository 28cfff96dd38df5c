"""Helios through the front ends: a real 2-rank ``cp-infer serve --model tiny-helios --ulysses-degree 2`` lists it in
``GET /v1/models`` with its options, makes a video of two chunks (the chunk's and its history's tokens sharded over
the two ranks), continues an uploaded video (video-to-video: a clip as ``input_reference``), and refuses frames that
are not whole chunks, and a clip shorter than a chunk, with a 400 naming the fix; a live video directed early, during
a chunk and late (while the group waits) is the one-request video with the same prompt_segments, frame for frame, and
one left alone ends after --live-idle-s, completed.

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
IDLE_S = 3.0


@pytest.fixture(scope="module")
def helios_server(tmp_path_factory):
    from models.helios.default import ensure_default_helios_model

    cache = tmp_path_factory.mktemp("helios_cache")
    ensure_default_helios_model(cache)  # built once here, so that the ranks only load it
    server = ServerProcess(tmp_path_factory.mktemp("helios_server"), cache,
                           extra_args=["--model", "tiny-helios", "--ulysses-degree", "2", "--heartbeat-s", "0.5",
                                       "--collective-timeout", "60", "--live-idle-s", str(IDLE_S),
                                       "--live-max-seconds", "2"],
                           # The live test's second chunk (steps 3..5) lasts a second: a direction lands inside it.
                           faults="rank=*,step=4,kind=sleep,seconds=1,prompt=a slow red fox")
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
_LIVE = {"size": f"{WIDTH}x{HEIGHT}", "num_inference_steps": 3, "seed": 11, "num_latent_frames_per_chunk": 3,
         "guidance_scale": 1.0}


def _until(s, job_id: str, ready, timeout: float = 60.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = s.client.get(f"/v1/videos/{job_id}").json()
        if ready(job):
            return job
        assert job["status"] in ("queued", "in_progress"), f"{job}\n{s.log_tail()}"
        time.sleep(0.02)
    pytest.fail(f"job {job_id} did not get there in {timeout} s: {job}\n{s.log_tail()}")


def _frames(s, job_id: str, path: Path):
    content = s.client.get(f"/v1/videos/{job_id}/content")
    assert content.status_code == 200, content.text
    path.write_bytes(content.content)
    return read_mp4(path)[0]


@pytest.mark.timeout(300)
def test_a_live_video_equals_the_one_request_video(helios_server, tmp_path: Path):
    """Directions sent early (before the first chunk is made), during a chunk (applied from the next, not yet
    started) and late (once the group waits with everything made), then the end: the live video is the one request
    with the same prompt_segments, frame for frame; its directions are shown with where each stands, and its MP4
    streams in the create request's response as it grows (stream=true), the bytes of its file."""
    import queue
    import threading

    s = helios_server
    started, streamed = queue.Queue(), []

    def watch() -> None:  # the MP4 as it grows, in the create request's response (stream=true)
        with s.client.stream("POST", "/v1/videos", json={"prompt": "a slow red fox in fresh snow", "num_frames": 9,
                                                         "live": True, "stream": True, **_LIVE}) as r:
            started.put((r.status_code, r.headers.get("x-video-id")))
            streamed.extend(r.iter_bytes())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    status, job_id = started.get(timeout=30)
    assert status == 200, status
    job = s.client.get(f"/v1/videos/{job_id}").json()
    assert job["live"]["windows_directed"] == 1 and job["live"]["directions"][0]["state"] != "made", job
    direct = f"/v1/videos/{job['id']}/directions"
    early = s.client.post(direct, json={"prompt": "the fox jumps", "windows": 1})
    assert early.status_code == 200 and early.json()["live"]["windows_directed"] == 2, early.text
    during = _until(s, job["id"], lambda j: j["window"] == 1 and not j["live"]["waiting"])
    r = s.client.post(direct, json={"prompt": "a city at night", "windows": 1})
    assert r.status_code == 200, r.text
    states = [d["state"] for d in r.json()["live"]["directions"]]
    assert r.json()["window"] == 1 and states == ["made", "in_progress", "queued"], (during, r.json())
    waiting = _until(s, job["id"], lambda j: j["live"]["waiting"])
    assert waiting["live"]["windows_made"] == 3 and waiting["window"] == 3, waiting
    r = s.client.post(direct, json={"prompt": "dawn breaks", "seconds": 0.1})  # rounded up to one chunk
    assert r.status_code == 200 and r.json()["live"]["windows_directed"] == 4, r.text
    assert s.client.post(direct, json={"end": True}).json()["live"]["ended"] is True
    final = s.wait_job(job["id"])
    assert final["status"] == "completed" and final["num_frames"] == 33, f"{final}\n{s.log_tail()}"
    assert [d["state"] for d in final["live"]["directions"]] == ["made"] * 4, final
    r = s.client.post(direct, json={"prompt": "more"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_ended", r.text

    segments = [{"start_window": k, "end_window": k, "text": text} for k, text in enumerate(
        ["a slow red fox in fresh snow", "the fox jumps", "a city at night", "dawn breaks"])]
    whole = s.submit({"prompt": "a slow red fox in fresh snow", "num_frames": 33, "prompt_segments": segments, **_LIVE})
    assert s.wait_job(whole["id"])["status"] == "completed"
    live, expected = _frames(s, job["id"], tmp_path / "live.mp4"), _frames(s, whole["id"], tmp_path / "whole.mp4")
    assert live.shape == (33, HEIGHT, WIDTH, 3) and live.std() > 1
    np.testing.assert_array_equal(live, expected)
    watcher.join(30)
    assert b"".join(streamed) == (tmp_path / "live.mp4").read_bytes()  # the stream is the video's file


@pytest.mark.timeout(120)
def test_a_live_video_left_alone_ends_after_the_idle_time(helios_server):
    import time

    s = helios_server
    job = s.submit({"prompt": "waves on a beach", "num_frames": 9, "live": True, **_LIVE})
    waiting = _until(s, job["id"], lambda j: j["live"]["waiting"])
    started = time.monotonic()
    final = s.wait_job(job["id"])
    assert final["status"] == "completed" and final["num_frames"] == 9, final
    assert time.monotonic() - started > IDLE_S - 1, (waiting, final)
    assert final["live"]["ended"] is True and final["live"]["windows_made"] == 1, final
    r = s.client.post(f"/v1/videos/{job['id']}/directions", json={"prompt": "too late"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "video_ended", r.text


@pytest.mark.parametrize("body, param, words", [
    ({"live": "yes"}, "live", "true or false"),
    ({"num_frames": 61}, "num_frames", "at most 2 s (--live-max-seconds): 5 windows"),
    ({"prompt_segments": [{"text": "x"}]}, "prompt_segments", "directions"),
])
def test_a_live_request_is_checked_at_the_front_end(helios_server, body, param, words):
    r = helios_server.client.post("/v1/videos", json={"prompt": "a fox", "live": True, "num_frames": 9, **_LIVE,
                                                      **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.text, r.text


def test_a_direction_is_checked_at_the_front_end(helios_server):
    s = helios_server
    plain = s.client.post("/v1/videos/video_" + "0" * 32 + "/directions", json={"prompt": "x"})
    assert plain.status_code == 404, plain.text
    job = s.submit({"prompt": "a fox", "num_frames": 9, "live": True, **_LIVE})
    direct = f"/v1/videos/{job['id']}/directions"
    try:
        for body, status, param, words in [
            ({"prompt": "x", "windows": 0}, 400, "windows", "whole number of windows"),
            ({"prompt": "x", "windows": 1, "seconds": 1}, 400, "seconds", "not both"),
            ({"windows": 1}, 400, "prompt", "prompt is required"),
            ({"prompt": "x", "speed": 2}, 400, "speed", "not a direction's field"),
            ({"end": True, "prompt": "x"}, 400, "prompt", "end takes no other field"),
            ({"prompt": "x", "windows": 5}, 400, "windows", "at most 2 s (--live-max-seconds): 5 windows"),
            ({"prompt": "x", "seconds": 5}, 400, "seconds", "--live-max-seconds"),
            ({"prompt": "x", "image": "data:image/png;base64,AAAA"}, 400, "image", "start from no image"),
        ]:
            r = s.client.post(direct, json=body)
            assert r.status_code == status and r.json()["error"]["param"] == param and words in r.text, (body, r.text)
        whole = s.submit({"prompt": "a fox", "num_frames": 9, **_LIVE})
        r = s.client.post(f"/v1/videos/{whole['id']}/directions", json={"prompt": "x"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_live", r.text
    finally:
        cancelled = s.client.post(f"/v1/videos/{job['id']}/cancel").json()
        assert cancelled["status"] in ("cancelled", "in_progress"), cancelled
        assert s.wait_job(job["id"])["status"] == "cancelled"
    # A live video waiting for directions is deleted as any running job is: stopped on every rank, then gone.
    waiting = s.submit({"prompt": "a fox", "num_frames": 9, "live": True, **_LIVE})
    _until(s, waiting["id"], lambda j: j["live"]["waiting"])
    assert s.client.delete(f"/v1/videos/{waiting['id']}").json()["deleted"] is True
    assert s.client.get(f"/v1/videos/{waiting['id']}").status_code == 404
    assert s.client.get("/ready").status_code == 200  # the group goes on serving
