"""Conditioned generation over HTTP against the real ``cp-infer serve --nproc 2`` (conftest ``api_server``):
the ``openai`` SDK's ``videos.create(input_reference=file)``, ``videos.edit`` and ``videos.remix``; JSON data URLs
and job ids; multipart conditions; and every bad media input refused as a 4xx JSON error naming the field, before
any rank sees it (the broadcast counter does not move, ``/ready`` stays 200).

The engine's exactness (1 rank = diffusers, N ranks = 1 rank) is tested in ``tests/models``; here the frames
(``variant=frames``, lossless) show that the media reached the model unchanged: the same image sent as a file and
as a data URL gives the same video, and a video other than the unconditioned one (the tiny model's random VAE does
not reproduce an image, so the frames are not compared with the media itself).
"""

from __future__ import annotations

import base64
import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from ..conftest import API_KEY, tiny
from ..conftest import lossless_frames as _frames
from ..conftest import mp4_bytes as _mp4


def _image(seed: int, height: int = 64, width: int = 96) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // width, y * 255 // height, (x + y) * 127 // (width + height)], axis=-1)
    return np.clip(base + rng.integers(-20, 20, base.shape), 0, 255).astype(np.uint8)


def _png(frame: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(frame).save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _levels(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


@pytest.fixture(scope="module")
def plain(api_server):
    """An unconditioned video of the shape the tests use, and the broadcast count before the bad inputs."""
    job = api_server.submit(tiny("a plain video", num_inference_steps=3))
    return api_server.wait_job(job["id"])


def test_openai_sdk_create_with_input_reference_file(api_server, plain, tmp_path):
    import openai

    s = api_server
    image = _image(1)
    path = tmp_path / "cat.png"
    path.write_bytes(_png(image))
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with open(path, "rb") as f:
            video = client.videos.create(prompt="a plain video", input_reference=f, size="96x64",
                                         extra_body={"num_frames": 9, "num_inference_steps": 3, "seed": 1234})
    job = s.wait_job(video.id)
    assert job["status"] == "completed", job
    assert job["input_reference"] is True
    by_url = s.submit(tiny("a plain video", num_inference_steps=3,
                           input_reference={"image_url": _data_url(_png(image))}))
    assert s.wait_job(by_url["id"])["status"] == "completed"
    np.testing.assert_array_equal(_frames(s, video.id), _frames(s, by_url["id"]))
    assert _levels(_frames(s, video.id), _frames(s, plain["id"])) > 1


def test_json_data_url_and_job_id_conditions(api_server, plain):
    s = api_server
    image = _image(2)
    # conditions: the image at frame 0 and the plain job's video (by id) from frame 0 at a low strength
    body = tiny("a plain video", num_inference_steps=3, conditions=[
        {"media": _data_url(_png(image)), "frame_index": 0, "strength": 1.0},
        {"media": {"id": plain["id"]}, "frame_index": 0, "strength": 0.3}])
    job = s.wait_job(s.submit(body)["id"])
    assert job["status"] == "completed", job
    assert job["conditions"] == [{"frame_index": 0, "strength": 1.0, "num_frames": 1},
                                 {"frame_index": 0, "strength": 0.3, "num_frames": 9}]


def test_multipart_conditions_with_files(api_server):
    s = api_server
    image, last = _image(3), _image(4)
    files = [("conditions[0][media]", ("a.png", _png(image), "image/png")),
             ("conditions[1][media]", ("b.png", _png(last), "image/png"))]
    data = {"prompt": "a plain video", "num_frames": "9", "size": "96x64", "num_inference_steps": "3",
            "conditions[0][frame_index]": "0", "conditions[1][frame_index]": "-1", "conditions[1][strength]": "0.8"}
    r = s.client.post("/v1/videos", data=data, files=files)
    assert r.status_code == 200, r.text
    job = s.wait_job(r.json()["id"])
    assert job["status"] == "completed", job
    assert job["conditions"] == [{"frame_index": 0, "strength": 1.0, "num_frames": 1},
                                 {"frame_index": -1, "strength": 0.8, "num_frames": 1}]


def test_openai_sdk_edit_and_remix(api_server, plain, tmp_path):
    import openai

    s = api_server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # By id as JSON: this SDK version sends edits as multipart and refuses a {"id": ...} there itself.
        r = s.client.post("/v1/videos/edits", json={"prompt": "the same scene at night", "video": {"id": plain["id"]}})
        assert r.status_code == 200, r.text
        edited = openai.types.Video.model_construct(**r.json())
        source = _frames(s, plain["id"])
        path = tmp_path / "clip.mp4"
        path.write_bytes(_mp4(source))
        with open(path, "rb") as f:
            uploaded = client.videos.edit(prompt="the same scene at night", video=f,
                                          extra_body={"num_inference_steps": 3})
        remixed = client.videos.remix(plain["id"], prompt="a remixed video")
    for video in (edited, uploaded, remixed):
        assert s.wait_job(video.id)["status"] == "completed"
    edit_job = s.client.get(f"/v1/videos/{edited.id}").json()
    # An edit keeps the source's length and size, and conditions on all of it from frame 0.
    assert (edit_job["num_frames"], edit_job["size"]) == (plain["num_frames"], plain["size"])
    assert edit_job["conditions"] == [{"frame_index": 0, "strength": 0.6, "num_frames": plain["num_frames"]}]
    assert s.client.get(f"/v1/videos/{uploaded.id}").json()["size"] == plain["size"]
    remix_job = s.client.get(f"/v1/videos/{remixed.id}").json()
    assert remix_job["prompt"] == "a remixed video"
    for key in ("num_frames", "size", "seed", "num_inference_steps", "guidance_scale"):
        assert remix_job[key] == plain[key], key
    # The source conditions the edit: another source (the uploaded MP4 is the same video, lossy) gives another.
    assert _levels(_frames(s, edited.id), _frames(s, remixed.id)) > 1


def _bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + \
        chunk(b"IEND", b"")


PNG = _png(_image(5))
BAD = [
    ("not-media", {"input_reference": _data_url(b"hello, world")}, 400, "invalid_media", "input_reference"),
    ("truncated-png", {"input_reference": _data_url(PNG[: len(PNG) // 2])}, 400, "invalid_media",
     "input_reference"),
    ("bomb", {"input_reference": _data_url(_bomb_png())}, 400, None, "input_reference"),
    ("https-url", {"input_reference": {"image_url": "https://example.com/cat.png"}}, 400, "unsupported_url",
     "input_reference.image_url"),
    ("bad-base64", {"input_reference": "data:image/png;base64,@@@@"}, 400, "invalid_media", "input_reference"),
    ("too-big", {"input_reference": _data_url(b"\x89PNG" + bytes(300_000))}, 413, "media_too_large",
     "input_reference"),
    ("index-outside", {"conditions": [{"media": _data_url(PNG), "frame_index": 9}]}, 400, "invalid_value",
     "conditions[0].frame_index"),
    ("strength-over-1", {"conditions": [{"media": _data_url(PNG), "strength": 1.5}]}, 400, "invalid_value",
     "conditions[0].strength"),
    ("strength-as-string", {"conditions": [{"media": _data_url(PNG), "strength": "1"}]}, 400, "invalid_type",
     "conditions[0].strength"),
    ("unknown-job", {"conditions": [{"media": {"id": "video_" + "0" * 32}}]}, 404, "video_not_found",
     "conditions[0].media"),
    ("both", {"input_reference": _data_url(PNG), "conditions": [{"media": _data_url(PNG)}]}, 400,
     "conflicting_parameters", "input_reference"),
]


@pytest.fixture(scope="module")
def baseline(api_server, plain):
    return api_server.metric("cp_infer_requests_broadcast_total")


@pytest.mark.parametrize("extra,status,code,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_media_is_refused(api_server, baseline, extra, status, code, param):
    r = api_server.client.post("/v1/videos", json=tiny(**extra))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    assert len(error["message"]) > 20


def test_clip_longer_than_the_request_and_unfinished_job(api_server, baseline, plain):
    s = api_server
    clip = _mp4(np.stack([_image(i) for i in range(17)]))
    r = s.client.post("/v1/videos", json=tiny(conditions=[{"media": _data_url(clip, "video/mp4")}]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "conditions[0].media", r.text
    assert "17 frames" in r.json()["error"]["message"]
    queued = s.submit(tiny("[slow] a job cancelled at once"))
    s.client.post(f"/v1/videos/{queued['id']}/cancel")
    s.wait_job(queued["id"])
    r = s.client.post("/v1/videos/edits", json={"prompt": "x", "video": {"id": queued["id"]}})
    assert r.status_code == 409 and r.json()["error"]["param"] == "video", r.text
    r = s.client.post("/v1/videos/edits", json={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "video", r.text
    r = s.client.post(f"/v1/videos/video_{'0' * 32}/remix", json={"prompt": "x"})
    assert r.status_code == 404, r.text
    r = s.client.post(f"/v1/videos/{plain['id']}/remix", json={"prompt": "x", "seed": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    broadcasts = s.metric("cp_infer_requests_broadcast_total")
    assert broadcasts <= baseline + 1  # only the cancelled job may have reached the group


def test_no_bad_media_reached_a_worker(api_server, baseline):
    s = api_server
    assert s.metric("cp_infer_requests_broadcast_total") <= baseline + 1
    assert s.client.get("/ready").status_code == 200
