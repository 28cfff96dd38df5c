"""Extensions over HTTP against the real ``cp-infer serve --nproc 2`` (conftest ``api_server``):
``POST /v1/videos/extensions`` (the ``openai`` SDK's ``videos.extend``) by ``{"id": ...}`` of a completed job and by
an uploaded MP4. The result is the video extended, frame for frame (the lossless frames: ``variant=frames``),
followed by ``seconds`` more made from its tail (its job's ``seconds``: the whole video's); a remix of an extension
extends the same video again; bad inputs are 4xx naming the field, before any rank sees them.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ..conftest import API_KEY, tiny
from ..conftest import lossless_frames as _frames
from ..conftest import mp4_bytes as _mp4


def _mp4_frames(server, job_id: str) -> int:
    """Frames in a completed job's MP4 (``variant=video``), decoded."""
    import io

    import av

    r = server.client.get(f"/v1/videos/{job_id}/content")
    assert r.status_code == 200, r.text
    with av.open(io.BytesIO(r.content)) as container:
        return sum(1 for _ in container.decode(video=0))


@pytest.fixture(scope="module")
def source(api_server):
    """A completed 33-frame video to extend."""
    job = api_server.submit(tiny("a river in a canyon", num_frames=33, num_inference_steps=3))
    return api_server.wait_job(job["id"])


def test_openai_sdk_extends_a_completed_video_by_id_and_an_upload(api_server, source, tmp_path):
    import openai

    s = api_server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=API_KEY, max_retries=0)
    before = _frames(s, source["id"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        # By id as JSON: this SDK version sends extensions as multipart and refuses a {"id": ...} there itself.
        r = s.client.post("/v1/videos/extensions", json={"video": {"id": source["id"]}, "seconds": "2",
                                                         "prompt": "the river reaches the sea"})
        assert r.status_code == 200, r.text
        by_id = openai.types.Video.model_construct(**r.json())
        path = tmp_path / "clip.mp4"
        path.write_bytes(_mp4(before))
        with open(path, "rb") as f:
            uploaded = client.videos.extend(video=f, prompt="the river reaches the sea", seconds="1",
                                            extra_body={"num_inference_steps": 3})
    job = s.wait_job(by_id.id, timeout=240)
    assert job["status"] == "completed", job
    assert job["extends"] is True and job["size"] == source["size"] and job["fps"] == source["fps"]
    fps = job["fps"]
    assert job["num_frames"] == 49 and job["windows"] == 1, job  # 2 s at 25 fps: the nearest 8k, 48 new frames
    after = _frames(s, by_id.id)
    assert after.shape == (33 + 48, *before.shape[1:])
    np.testing.assert_array_equal(after[:33], before)  # the video extended, frame for frame
    assert after[33:].std() > 5
    # The video is its source's length and the seconds asked for (to within one latent frame step), the MP4 too,
    # and the job says so: seconds is the whole video's, not the part made.
    assert float(job["seconds"]) == pytest.approx(float(source["seconds"]) + 2, abs=8 / fps), job
    assert job["seconds"] == f"{(33 + 48) / fps:.3g}" and _mp4_frames(s, by_id.id) == 33 + 48
    up = s.wait_job(uploaded.id, timeout=240)
    assert up["status"] == "completed" and _frames(s, uploaded.id).shape == (33 + 24, *before.shape[1:]), up
    assert float(up["seconds"]) == pytest.approx(33 / 24 + 1, abs=8 / up["fps"]), up  # the upload is at 24 fps
    assert not list((s.data_dir / "videos").glob("*.lead.npy")), "an ended job keeps no lead frames"


def test_a_remix_of_an_extension_extends_the_same_video_again(api_server, source):
    s = api_server
    r = s.client.post("/v1/videos/extensions", json={"video": {"id": source["id"]}, "seconds": "1",
                                                     "prompt": "the river freezes", "num_inference_steps": 3})
    assert r.status_code == 200, r.text
    extension = s.wait_job(r.json()["id"], timeout=240)
    assert extension["status"] == "completed", extension
    r = s.client.post(f"/v1/videos/{extension['id']}/remix", json={"prompt": "the river floods"})
    assert r.status_code == 200, r.text
    remix = s.wait_job(r.json()["id"], timeout=240)
    assert remix["status"] == "completed", remix
    assert remix["extends"] is True and remix["prompt"] == "the river floods"
    assert remix["seconds"] == extension["seconds"], (remix, extension)
    made, remade = _frames(s, extension["id"]), _frames(s, remix["id"])
    assert remade.shape == made.shape == (33 + 24, 64, 96, 3)
    np.testing.assert_array_equal(remade[:33], _frames(s, source["id"]))  # the same video, extended again
    assert np.abs(remade[33:].astype(int) - made[33:]).mean() > 1  # by other frames: the new prompt's


def test_bad_extensions_are_refused_naming_the_field(api_server, source):
    s = api_server
    baseline = s.metric("cp_infer_requests_broadcast_total")
    cases = [
        ({"prompt": "x", "seconds": 1}, 400, "video"),
        ({"prompt": "x", "video": {"id": source["id"]}}, 400, "seconds"),
        ({"prompt": "x", "seconds": 1, "video": {"id": f"video_{'0' * 32}"}}, 404, "video"),
        ({"prompt": "x", "seconds": 1, "video": {"id": source["id"]}, "conditions": [
            {"media": {"id": source["id"]}}]}, 400, "video"),
        ({"prompt": "x", "seconds": 60, "video": {"id": source["id"]}}, 400, "seconds"),
        ({"prompt": "x", "seconds": 1, "video": {"id": source["id"]}, "temporal_overlap": 8}, 400,
         "temporal_overlap"),
        ({"prompt": "x", "seconds": None, "video": {"id": source["id"]}}, 400, "seconds"),
        ({"prompt": "x", "seconds": 1, "video": {"id": source["id"]}, "stream": True}, 400, "stream"),
    ]
    short = s.wait_job(s.submit(tiny("a short clip"))["id"])  # 9 frames: fewer than an extension continues from
    cases.append(({"prompt": "x", "seconds": 1, "video": {"id": short["id"]}}, 400, "video"))
    queued = s.submit(tiny("[slow] a job cancelled at once"))
    s.client.post(f"/v1/videos/{queued['id']}/cancel")
    s.wait_job(queued["id"])
    cases.append(({"prompt": "x", "seconds": 1, "video": {"id": queued["id"]}}, 409, "video"))
    for body, status, param in cases:
        r = s.client.post("/v1/videos/extensions", json=body)
        assert r.status_code == status and r.json()["error"]["param"] == param, (body, r.text)
        assert len(r.json()["error"]["message"]) > 20
    # Only the short job and the cancelled one may have reached the group.
    assert s.metric("cp_infer_requests_broadcast_total") <= baseline + 2
