"""Wan through the front ends: ``cp-infer generate --model tiny-wan`` on 2 ranks through torchrun (CFG's two passes
on two guidance ranks, the layout the command picks), ``--image`` on a Wan 2.1 image-to-video folder, a refused
image, and a real 2-rank ``cp-infer serve --model tiny-wan``.

The videos come out at WanPipeline's 16 fps. That N ranks make the 1-rank video is tests/models/wan/test_wan.py's to
check (in process, on lossless frames); here the front ends are. Process start-up dominates, so every command and the
server start once per module.
"""

from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cp_infer.video_io import read_mp4

from ..conftest import ServerProcess
from .commands import Commands, cli_env

FRAMES, HEIGHT, WIDTH = 9, 48, 80
GENERATE = ["generate", "--model", "tiny-wan", "--prompt", "a red fox in fresh snow", "--frames", str(FRAMES),
            "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", "2", "--seed", "11"]
COMMANDS = {
    "mp4-2": [*GENERATE, "--nproc", "2", "--out", "{out}/two.mp4"],
    "i2v": ["generate", "--model", "{i2v}", "--image", "{out}/start.png", "--prompt", "the fox walks away",
            "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", "2",
            "--out", "{out}/i2v.mp4"],
}


def _picture() -> np.ndarray:
    rng = np.random.default_rng(3)
    y, x = np.mgrid[0:36, 0:60]
    pixels = np.stack([(x * 4) % 256, (y * 6) % 256, (x + y) % 256], axis=-1) + rng.integers(-20, 20, (36, 60, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def wan_cache(tmp_path_factory) -> Path:
    """tiny-wan, built once here so that the ranks of every process only load it."""
    from models.wan.default import ensure_default_wan_model

    path = tmp_path_factory.mktemp("wan_cache")
    ensure_default_wan_model(path)
    return path


@pytest.fixture(scope="module")
def commands(tmp_path_factory, wan_cache) -> Commands:
    from models.wan.default import save_wan_model

    out = tmp_path_factory.mktemp("out")
    Image.fromarray(_picture()).save(out / "start.png")
    i2v = save_wan_model(tmp_path_factory.mktemp("wan_i2v") / "i2v", variant="i2v")
    commands = Commands(COMMANDS, env=cli_env(wan_cache), cwd=tmp_path_factory.mktemp("cwd"),
                        fields=dict(out=out, i2v=i2v), check=True)
    yield commands
    commands.close()


@pytest.mark.timeout(300)
def test_generate_writes_a_16_fps_mp4_on_two_guidance_ranks(commands):
    proc = commands.result("mp4-2")
    frames, fps = read_mp4(commands.out / "two.mp4")
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == 16 and frames.std() > 1
    assert "guidance 2 x Ulysses 1" in proc.stderr, proc.stderr[-2000:]
    assert f"({FRAMES} frames, {WIDTH}x{HEIGHT} @ 16 fps; 2 rank(s)" in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_image_to_video_from_a_wan_i2v_folder(commands):
    commands.result("i2v")
    frames, fps = read_mp4(commands.out / "i2v.mp4")
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == 16 and frames.std() > 1


@pytest.mark.timeout(120)
def test_an_image_for_a_text_to_video_folder_exits_2_before_starting(commands, monkeypatch, capsys):
    import server.group.runtime
    from server.cli import command as cli

    def forbidden(*_args, **_kwargs):
        raise AssertionError("a bad request must be refused before anything starts")

    monkeypatch.setenv("CP_INFER_CACHE", commands.env["CP_INFER_CACHE"])
    monkeypatch.setattr(cli, "relaunch_under_torchrun", forbidden)
    monkeypatch.setattr(server.group.runtime, "start_runtime", forbidden)
    for name in ("RANK", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "error")  # main() sets them; monkeypatch puts the old values back
    out = commands.out / "refused.mp4"
    code = cli.main([*GENERATE, "--image", str(commands.out / "start.png"), "--nproc", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "takes no conditioning media" in err and "Traceback" not in err, err
    assert not out.exists()


# --------------------------------------------------------------------------------------------------- server


def _serving(workdir: Path, cache: Path, model: str):
    """A real 2-rank ``cp-infer serve --model MODEL``, ready; stopped when the fixture ends."""
    server = ServerProcess(workdir, cache,
                           extra_args=["--model", model, "--heartbeat-s", "0.5", "--collective-timeout", "60"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory, wan_cache):
    yield from _serving(tmp_path_factory.mktemp("wan_server"), wan_cache, "tiny-wan")


@pytest.mark.timeout(300)
def test_the_server_serves_wan(wan_server, tmp_path):
    s = wan_server
    listed = s.client.get("/v1/models").json()["data"]
    assert [m["family"] for m in listed] == ["wan"], listed
    job = s.submit({"prompt": "a red fox in fresh snow", "num_frames": FRAMES, "size": f"{WIDTH}x{HEIGHT}",
                    "num_inference_steps": 2, "seed": 5})
    assert job["max_sequence_length"] == 512 and job["guidance_scale"] == 5.0, job  # WanPipeline's defaults
    final = s.wait_job(job["id"])
    assert final["status"] == "completed", f"{final}\n{s.log_tail()}"
    content = s.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    (tmp_path / "job.mp4").write_bytes(content.content)
    frames, fps = read_mp4(tmp_path / "job.mp4")
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == 16 and frames.std() > 1


@pytest.mark.timeout(120)
def test_the_server_refuses_an_image_for_text_to_video_wan(wan_server):
    png = io.BytesIO()
    Image.fromarray(_picture()).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    r = wan_server.client.post("/v1/videos", json={"prompt": "a fox", "num_frames": FRAMES,
                                                    "size": f"{WIDTH}x{HEIGHT}", "input_reference": url})
    assert r.status_code == 400 and "takes no conditioning media" in r.text, r.text


@pytest.fixture(scope="module")
def i2v_server(tmp_path_factory, wan_cache, commands):
    yield from _serving(tmp_path_factory.mktemp("wan_i2v_server"), wan_cache, str(commands.fields["i2v"]))


@pytest.mark.timeout(300)
def test_the_openai_sdk_makes_a_wan_image_to_video(i2v_server, commands, tmp_path):
    """Wan 2.1 I2V served: the official client's ``videos.create(input_reference=file)`` (multipart) completes, and the
    same image as a JSON data URL makes the same video; a request without the image is a 400 naming it."""
    import warnings

    import openai

    from ..conftest import API_KEY

    s = i2v_server
    client = openai.OpenAI(base_url=s.url + "/v1", api_key=s.api_key or API_KEY, max_retries=0)
    settings = {"num_frames": FRAMES, "num_inference_steps": 2, "seed": 21}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with open(commands.out / "start.png", "rb") as f:
            video = client.videos.create(prompt="the fox walks away", input_reference=f, size=f"{WIDTH}x{HEIGHT}",
                                         extra_body=settings)
    job = s.wait_job(video.id)
    assert job["status"] == "completed" and job["input_reference"] is True, f"{job}\n{s.log_tail()}"
    client.videos.download_content(video.id).write_to_file(tmp_path / "sdk.mp4")
    by_sdk, fps = read_mp4(tmp_path / "sdk.mp4")
    assert by_sdk.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == 16

    url = "data:image/png;base64," + base64.b64encode((commands.out / "start.png").read_bytes()).decode()
    by_url = s.submit({"prompt": "the fox walks away", "size": f"{WIDTH}x{HEIGHT}", "input_reference": url,
                       **settings})
    assert s.wait_job(by_url["id"])["status"] == "completed"
    (tmp_path / "url.mp4").write_bytes(s.client.get(f"/v1/videos/{by_url['id']}/content").content)
    np.testing.assert_array_equal(read_mp4(tmp_path / "url.mp4")[0], by_sdk)

    r = s.client.post("/v1/videos", json={"prompt": "a fox", "size": f"{WIDTH}x{HEIGHT}", **settings})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference", r.text


def _data_url(pixels: np.ndarray) -> str:
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


@pytest.mark.timeout(300)
def test_a_live_wan_video_directed_with_an_image_is_the_one_request_video(i2v_server, commands, tmp_path):
    """A live Wan 2.1 I2V video over HTTP at 2 ranks, its second direction (sent while the group waits for it after
    its first two windows) with an image of its own (a cut: window 2 starts from it), makes the video of the one
    request with the same prompt_segments and that image as conditions at frame 32 (where window 2 starts), frame
    for frame; a direction's image that is not one is refused naming it."""
    s = i2v_server
    first = "data:image/png;base64," + base64.b64encode((commands.out / "start.png").read_bytes()).decode()
    cut = _data_url(255 - _picture()[::-1])
    settings = {"size": f"{WIDTH}x{HEIGHT}", "num_inference_steps": 2, "seed": 8, "temporal_tile_size": 17}
    live = s.submit({"prompt": "the fox walks away", "input_reference": first, "num_frames": 33, "live": True,
                     **settings})
    waiting = s.wait_job(live["id"], timeout=120, statuses=("in_progress", "completed", "failed"))
    while waiting["status"] == "in_progress" and not (waiting["live"] or {}).get("waiting"):
        time.sleep(0.1)
        waiting = s.client.get(f"/v1/videos/{live['id']}").json()
    assert waiting["live"]["waiting"] and waiting["live"]["windows_made"] == 2, f"{waiting}\n{s.log_tail()}"
    for bad, code in (("data:image/png;base64,AAAA", "invalid_media"), (12, "invalid_value")):
        r = s.client.post(f"/v1/videos/{live['id']}/directions", json={"prompt": "night", "image": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "image", r.text
        assert r.json()["error"]["code"] == code, r.text
    r = s.client.post(f"/v1/videos/{live['id']}/directions", json={"prompt": "night falls", "image": cut})
    assert r.status_code == 200, r.text
    assert [d["image"] for d in r.json()["live"]["directions"]] == [False, True], r.json()
    assert s.client.post(f"/v1/videos/{live['id']}/directions", json={"end": True}).status_code == 200
    made = s.wait_job(live["id"], timeout=240)
    assert made["status"] == "completed" and made["num_frames"] == 49, f"{made}\n{s.log_tail()}"

    whole = s.submit({"prompt": "the fox walks away", "num_frames": 49, **settings,
                      "conditions": [{"media": first, "frame_index": 0}, {"media": cut, "frame_index": 32}],
                      "prompt_segments": [{"start_window": 0, "end_window": 1, "text": "the fox walks away"},
                                          {"start_window": 2, "end_window": 2, "text": "night falls"}]})
    assert s.wait_job(whole["id"], timeout=240)["status"] == "completed", s.log_tail()
    for job in (live, whole):
        (tmp_path / f"{job['id']}.mp4").write_bytes(s.client.get(f"/v1/videos/{job['id']}/content").content)
    live_frames, whole_frames = (read_mp4(tmp_path / f"{j['id']}.mp4")[0] for j in (live, whole))
    assert live_frames.shape == (49, HEIGHT, WIDTH, 3) and live_frames.std() > 1
    np.testing.assert_array_equal(live_frames, whole_frames)
