"""End to end against the real server (a 2-rank torchrun group on CPU): submit, follow, download, list, delete.

Frames: the server keeps the raw uint8 frames (``--keep-frames``), so 2 ranks are compared with 1 rank
losslessly, with the tolerance of tests/models/ltx_video/test_parallel.py (fp32 summation order may flip a
rounding: within 1 level, mean under 0.01); the MP4s of both are compared after h264 too.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from cp_infer.video_io import read_mp4, write_mp4

from ..conftest import API_KEY, tiny


def luma(frames: np.ndarray) -> np.ndarray:
    return frames.astype(np.float64) @ np.array([0.2126, 0.7152, 0.0722])


def read_events(server, job_id: str, timeout: float = 120.0, *, ids: list[str] | None = None,
                headers: dict | None = None) -> list[tuple[str, dict]]:
    events, name = [], None
    with server.client.stream("GET", f"/v1/videos/{job_id}/events", timeout=timeout, headers=headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("id: ") and ids is not None:
                ids.append(line[len("id: "):])
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


def test_submit_follow_download_list_delete(api_server, tmp_path):
    s = api_server
    steps_before = s.metric("cp_infer_step_seconds_count")
    videos_before = s.metric("cp_infer_generation_seconds_count")
    job = s.submit(tiny("[slow] a lighthouse at dusk, waves", num_frames=17, num_inference_steps=3, seed=11))
    assert job["object"] == "video" and job["id"].startswith("video_") and job["status"] in ("queued", "in_progress")
    assert (job["size"], job["num_frames"], job["model"], job["error"]) == ("96x64", 17, "tiny-ltx-video", None)

    ids: list[str] = []
    events = read_events(s, job["id"], ids=ids)
    assert all(name == f"video.{e['status']}" for name, e in events)
    # A client that reconnects with Last-Event-ID gets only what it missed.
    assert read_events(s, job["id"], headers={"Last-Event-ID": ids[-2]}) == events[-1:]
    progress = [e["progress"] for _, e in events]
    assert events[-1][1]["status"] == "completed" and progress[-1] == 100
    assert progress == sorted(progress), progress
    # Three steps fill 0..90 in thirds, the decode ends at 97: progress follows the real work.
    assert {30, 60, 90, 97} <= set(progress), progress

    final = s.client.get(f"/v1/videos/{job['id']}").json()
    assert final["status"] == "completed" and final["completed_at"] >= final["created_at"]
    assert s.metric("cp_infer_step_seconds_count") == steps_before + 3
    assert s.metric("cp_infer_generation_seconds_count") == videos_before + 1
    assert s.metric('cp_infer_jobs{state="completed"}') >= 1 and s.metric("cp_infer_group_world_size") == 2

    r = s.client.get(f"/v1/videos/{job['id']}/content")
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    (tmp_path / "out.mp4").write_bytes(r.content)
    frames, fps = read_mp4(tmp_path / "out.mp4")
    assert frames.shape == (17, 64, 96, 3) and fps == 25  # LTXPipeline's frame_rate

    raw = np.load(io.BytesIO(s.client.get(f"/v1/videos/{job['id']}/content?variant=frames").content))
    assert raw.shape == (17, 64, 96, 3) and raw.dtype == np.uint8 and raw.std() > 5  # not a blank video
    # The default model's frames are pixel noise, which yuv420p's chroma subsampling cannot keep; the luma stays
    # within a few levels at crf 17 (another video's would be ~40 levels away).
    assert np.abs(luma(frames) - luma(raw)).mean() < 8

    r = s.client.get(f"/v1/videos/{job['id']}/content", params={"variant": "thumbnail"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/jpeg"
    thumb = np.asarray(Image.open(io.BytesIO(r.content)).convert("RGB"))
    assert thumb.shape == (64, 96, 3)
    assert np.abs(luma(thumb) - luma(raw[8])).mean() < 8  # the middle frame, through JPEG

    second = s.submit(tiny("a paper boat on a stream", seed=12))
    s.wait_job(second["id"])
    newest = s.client.get("/v1/videos", params={"limit": 1}).json()
    assert newest["object"] == "list" and newest["has_more"] is True
    assert [v["id"] for v in newest["data"]] == [second["id"]]
    page2 = s.client.get("/v1/videos", params={"limit": 1, "after": second["id"]}).json()
    assert page2["data"][0]["id"] == job["id"]
    ascending = [v["id"] for v in s.client.get("/v1/videos", params={"order": "asc", "limit": 100}).json()["data"]]
    assert ascending.index(job["id"]) < ascending.index(second["id"])

    r = s.client.delete(f"/v1/videos/{job['id']}")
    assert r.status_code == 200 and r.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    for path in (f"/v1/videos/{job['id']}", f"/v1/videos/{job['id']}/content"):
        r = s.client.get(path)
        assert r.status_code == 404 and r.json()["error"]["code"] == "video_not_found"
    assert not list((s.data_dir / "videos").glob(f"{job['id']}.*"))
    assert s.client.delete(f"/v1/videos/{job['id']}").status_code == 404


def test_a_cached_request_reports_its_steps(api_server):
    """``cache=first_block`` at threshold 1 (the tiny model's residual changes by less between steps): the first step
    runs every block, the other three only the first; the job object and its events report it, ``/metrics`` counts
    the block evaluations saved (CFG's two passes x the tiny model's second block, three times)."""
    s = api_server
    saved_before = s.metric("cp_infer_cache_blocks_saved_total")
    job = s.submit(tiny(num_inference_steps=4, cache="first_block", cache_threshold=1.0, seed=5))
    assert (job["cache"], job["cache_threshold"], job["steps_computed"], job["steps_skipped"]) == (
        "first_block", 1.0, None, None)
    events = read_events(s, job["id"])
    final = events[-1][1]
    assert final["status"] == "completed" and (final["steps_computed"], final["steps_skipped"]) == (1, 3)
    running = [(e["steps_computed"], e["steps_skipped"]) for _, e in events if e["steps_computed"] is not None]
    assert running == sorted(running) and running[-1] == (1, 3), running
    assert s.metric("cp_infer_cache_blocks_saved_total") == saved_before + 6
    plain = s.submit(tiny(num_inference_steps=2))
    read_events(s, plain["id"])
    assert s.client.get(f"/v1/videos/{plain['id']}").json()["steps_skipped"] is None


def test_ready_and_metrics_say_where_the_weights_are(api_server):
    """Start-up measures what every rank holds of each component and where: ``/ready`` lists it per rank, ``/metrics``
    has the same bytes. On the CPU ``--weights auto`` replicates, so both ranks hold the same whole components."""
    from models.common.placement import model_components
    from models.ltx_video.default import ensure_default_model

    s = api_server
    memory = s.client.get("/ready").json()["memory"]
    assert [m["rank"] for m in memory] == [0, 1] and {m["weights"] for m in memory} == {"replicated"}
    whole = {c.name: c.nbytes for c in model_components(ensure_default_model(), dtype="fp32")}
    for m in memory:
        assert m["offload"] == [] and {name: sum(places.values()) for name, places in m["components"].items()} == whole
        for name, places in m["components"].items():
            for where, n in places.items():
                assert s.metric(f'cp_infer_weight_bytes{{rank="{m["rank"]}",component="{name}",where="{where}"}}') == n


def test_seconds_and_size_as_openai_sends_them_in_a_form(api_server):
    s = api_server
    r = s.client.post("/v1/videos", data={"prompt": "a kite over a beach", "seconds": "0.7", "size": "96x64",
                                          "num_inference_steps": "2", "model": "tiny-ltx-video"})
    assert r.status_code == 200, r.text
    job = r.json()
    # 0.7 s at 25 fps (LTXPipeline's frame_rate) is 17.5 frames; the nearest 8k+1 is 17.
    assert (job["num_frames"], job["seconds"], job["size"], job["fps"]) == (17, "0.68", "96x64", 25)
    assert s.wait_job(job["id"])["status"] == "completed"


def test_multipart_form_if_available(api_server):
    from server.http.videos import multipart_available

    r = api_server.client.post("/v1/videos", files={"prompt": (None, "a red kite"), "seconds": (None, "0.4"),
                                                    "size": (None, "96x64"), "num_inference_steps": (None, "2")})
    if multipart_available():
        assert r.status_code == 200, r.text
        assert api_server.wait_job(r.json()["id"])["status"] == "completed"
    else:
        assert r.status_code == 415 and "python-multipart" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def one_rank(cache_dir):
    """The same engine in this process, alone: the 1-rank reference (the server has built the model)."""
    from models.ltx_video.default import ensure_default_model
    from server.group.runtime import RuntimeConfig, start_runtime

    return start_runtime(RuntimeConfig(model=str(ensure_default_model(cache_dir)), device="cpu"))


def test_two_ranks_equal_one_rank(api_server, one_rank, tmp_path):
    from cp_infer.request import GenerationRequest

    s = api_server
    job = s.submit(tiny("a red fox runs through fresh snow", num_frames=17, num_inference_steps=3, seed=4242,
                        negative_prompt="blurry", guidance_scale=4.0))
    assert s.wait_job(job["id"])["status"] == "completed"
    got = np.load(io.BytesIO(s.client.get(f"/v1/videos/{job['id']}/content?variant=frames").content))
    fields = ("prompt", "negative_prompt", "num_frames", "height", "width", "num_inference_steps",
              "guidance_scale", "seed", "fps")
    expected = one_rank.generate(GenerationRequest.of(**{k: job[k] for k in fields}, max_sequence_length=128))
    diff = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert got.shape == expected.shape and diff.max() <= 1 and diff.mean() < 0.01, (diff.max(), diff.mean())

    # And after h264: the server's MP4 against the reference frames encoded the same way. Frames one level apart
    # can steer x264 into other decisions (and in this process, after torch ran here, the RGB -> YUV conversion
    # rounds chroma differently), so the two agree to within the codec's own error on this noise-like content
    # (luma ~4 levels from the source, see above), not bit for bit; another video would be ~40 levels away.
    (tmp_path / "server.mp4").write_bytes(s.client.get(f"/v1/videos/{job['id']}/content").content)
    write_mp4(expected, tmp_path / "reference.mp4", fps=job["fps"])
    a, _ = read_mp4(tmp_path / "server.mp4")
    b, _ = read_mp4(tmp_path / "reference.mp4")
    assert a.shape == b.shape and np.abs(luma(a) - luma(b)).mean() < 8


def test_openai_sdk(api_server, tmp_path):
    """The official client against this server (the SDK posts ``multipart/form-data``)."""
    import openai

    client = openai.OpenAI(base_url=api_server.url + "/v1", api_key=API_KEY, max_retries=0)
    video = client.videos.create(prompt="a red kite over dunes", model="tiny-ltx-video", seconds="0.4",
                                 size="96x64", extra_body={"num_inference_steps": 2})
    assert video.status in ("queued", "in_progress")
    assert api_server.wait_job(video.id)["status"] == "completed"
    assert client.videos.retrieve(video.id).status == "completed"
    client.videos.download_content(video.id).write_to_file(tmp_path / "sdk.mp4")
    frames, _ = read_mp4(tmp_path / "sdk.mp4")
    assert frames.shape == (9, 64, 96, 3)  # 0.4 s at 25 fps is 10 frames: the nearest 8k+1 is 9
    assert video.id in [v.id for v in client.videos.list(limit=100).data]
    client.videos.delete(video.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    # Discovery: the model list names what `model` takes, with the family and its options.
    (card,) = client.models.list().data
    assert card.id == "tiny-ltx-video" and card.object == "model"
    assert card.model_extra["family"] == "ltx-video" and "num_inference_steps" in card.model_extra["options"]
    assert client.models.retrieve("tiny-ltx-video").id == "tiny-ltx-video"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("someone/else")
