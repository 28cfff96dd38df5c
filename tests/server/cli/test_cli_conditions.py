"""Conditioned generation from the command line: ``generate --image/--video/--condition`` and a prompts file's
``image`` / ``video`` / ``conditions`` on the tiny model, and the latents a frames folder gets.

Four real processes (image-to-video at 1 rank, conditions at 1 and 2 ranks, a batch at 1 rank) share their outputs
across the tests; the bad inputs run ``cli.main`` in this process, where starting a group or loading a model fails
the test. The media are seeded random pixels (never flat), written with PIL and ``write_mp4``.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from cp_infer import VideoGeometry
from cp_infer.request import GenerationLimits
from cp_infer.video_io import read_frames_dir, write_mp4, write_output
from models.ltx_video.default import ensure_default_model
from models.registry import ModelInfo, describe_model, model_options
from server.cli import batch
from server.cli import command as cli
from server.cli.common import UsageError

from .commands import Commands, cli_env

FRAMES, HEIGHT, WIDTH = 9, 64, 64
REQUEST = ["--prompt", "a fox in snow", "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH),
           "--steps", "2", "--seed", "5"]


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """``img.png`` (48x40), ``clip.mp4`` (5 frames), ``long.mp4`` (17 frames: more than FRAMES), a text file and a
    truncated PNG."""
    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(20261201)
    Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8)).save(root / "img.png")
    write_mp4(rng.integers(0, 256, (5, 48, 64, 3), dtype=np.uint8), root / "clip.mp4", fps=8)
    write_mp4(rng.integers(0, 256, (17, 32, 32, 3), dtype=np.uint8), root / "long.mp4", fps=8)
    (root / "notes.txt").write_text("not a picture\n")
    png = (root / "img.png").read_bytes()
    (root / "trunc.png").write_bytes(png[: len(png) // 2])
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cache")
    ensure_default_model(path)  # once, here, rather than racing in the first command
    return path


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("out")


def _conditions_args(nproc: int) -> list[str]:
    return ["generate", *REQUEST, "--condition", "{media}/clip.mp4@0:0.7", "--condition", "{media}/img.png@-1",
            "--nproc", str(nproc), "--out", f"{{out}}/conditions-{nproc}/"]


COMMANDS = {"image": ["generate", *REQUEST, "--image", "{media}/img.png", "--out", "{out}/image/"],
            **{f"conditions-{nproc}": _conditions_args(nproc) for nproc in (1, 2)}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache, media, out):
    """``runs(key)``: ``COMMANDS[key]``'s process (``tests/server/cli/commands.py``); ``runs(key, args)`` one the test
    made the inputs of."""
    commands = Commands(COMMANDS, env=cli_env(cache), cwd=tmp_path_factory.mktemp("cwd"),
                        fields=dict(media=media, out=out))
    yield commands.result
    commands.close()


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc


def _conditions(runs, nproc: int) -> subprocess.CompletedProcess:
    return runs(f"conditions-{nproc}")


def _latent_shape(cache: Path):
    return describe_model(ensure_default_model(cache)).geometry.latent_shape(FRAMES, HEIGHT, WIDTH)


@pytest.mark.timeout(300)
def test_generate_image_to_video_writes_frames_and_latents(runs, out, media, cache):
    _ok(runs("image"))
    frames, _ = read_frames_dir(out / "image")
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and frames.std() > 1
    # LTXImageToVideoPipeline's output_type="latent": packed [B, S, C] (the tiny model has 16 latent channels).
    latents = np.load(out / "image" / "latents.npy")
    assert latents.shape == (1, _latent_shape(cache).tokens, 16) and latents.dtype == np.float32
    assert np.isfinite(latents).all() and latents.std() > 0
    info = json.loads((out / "image" / "video.json").read_text())
    assert info["latents"]["latents"]["shape"] == list(latents.shape)
    assert not (out / "image" / "audio_latents.npy").exists()  # LTX-Video has no soundtrack


@pytest.mark.timeout(300)
def test_generate_conditions_two_ranks_match_one(runs, out, media, cache):
    frames, latents = {}, {}
    for nproc in (1, 2):
        proc = _ok(_conditions(runs, nproc))
        assert f"{nproc} rank(s)" in proc.stdout
        frames[nproc], _ = read_frames_dir(out / f"conditions-{nproc}")
        latents[nproc] = np.load(out / f"conditions-{nproc}" / "latents.npy")
    assert frames[1].shape == (FRAMES, HEIGHT, WIDTH, 3) and frames[1].std() > 1
    # LTXConditionPipeline's output_type="latent": unpacked [B, C, F, H, W].
    shape = _latent_shape(cache)
    assert latents[1].shape == (1, 16, shape.frames, shape.height, shape.width)
    # Ulysses attention reorders fp32 sums: pixels may round to a neighbouring level, never further, and rarely.
    diff = np.abs(frames[1].astype(np.int16) - frames[2].astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.02, (diff.max(), diff.mean())
    np.testing.assert_allclose(latents[2], latents[1], rtol=0, atol=1e-4)
    # The media matter: the image-to-video run of the same prompt and seed made another video.
    _ok(runs("image"))
    assert np.abs(read_frames_dir(out / "image")[0].astype(np.int16) - frames[1]).mean() > 5


def _summary(stdout: str) -> dict[int, tuple[str, str]]:
    rows = {}
    for row in stdout.splitlines():
        match = re.match(r"(\d+)\s+(\S+)\s+(ok|skipped|invalid|failed)\b", row)
        if match:
            rows[int(match.group(1))] = (match.group(2), match.group(3))
    return rows


@pytest.mark.timeout(300)
def test_batch_conditioned_line_and_bad_media_line(runs, out, media, tmp_path_factory):
    """A prompts file in another folder than the media: relative paths are taken from the file's folder. The good
    line is the request of the 1-rank conditions run, so it makes the same video."""
    folder = tmp_path_factory.mktemp("prompts")
    (folder / "media").symlink_to(media, target_is_directory=True)
    good = {"prompt": "a fox in snow", "name": "fox", "frames": FRAMES, "height": HEIGHT, "width": WIDTH,
            "steps": 2, "seed": 5,
            "conditions": [{"media": "media/clip.mp4", "frame_index": 0, "strength": 0.7}, "media/img.png@-1"]}
    bad = {"prompt": "a cat", "frames": FRAMES, "height": HEIGHT, "width": WIDTH, "steps": 2,
           "image": "media/trunc.png"}
    (folder / "p.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    proc = runs("batch", ["batch", str(folder / "p.jsonl"), "--out-dir", f"{out}/batch", "--ext", "frames"])
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert _summary(proc.stdout) == {1: ("fox", "ok"), 2: ("00002", "invalid")}, proc.stdout
    assert "image (media/trunc.png): is truncated or corrupt" in proc.stdout
    assert sorted(p.name for p in (out / "batch").iterdir()) == ["fox"]
    fox, _ = read_frames_dir(out / "batch" / "fox")
    _ok(_conditions(runs, 1))
    np.testing.assert_array_equal(fox, read_frames_dir(out / "conditions-1")[0])
    np.testing.assert_array_equal(np.load(out / "batch" / "fox" / "latents.npy"),
                                  np.load(out / "conditions-1" / "latents.npy"))


# --------------------------------------------------------------------------------- refused before anything starts


@pytest.fixture
def nothing_starts(monkeypatch, cache):
    """In-process ``cli.main`` where starting a group or loading a model fails the test."""
    import server.group.runtime

    monkeypatch.setenv("CP_INFER_CACHE", str(cache))

    def forbidden(*_args, **_kwargs):
        raise AssertionError("a bad request must be refused before anything starts")

    monkeypatch.setattr(cli, "relaunch_under_torchrun", forbidden)
    monkeypatch.setattr(server.group.runtime, "start_runtime", forbidden)
    for name in ("RANK", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "error")  # main() sets them; monkeypatch puts the old values back


BAD = {
    "missing-file": (["--image", "{m}/missing.png"], "--image {m}/missing.png: cannot read", "No such file"),
    "folder": (["--video", "{m}"], "--video {m}: cannot read", ""),
    "not-media": (["--condition", "{m}/notes.txt@0"], "--condition {m}/notes.txt@0: is not an image or video", ""),
    "truncated-png": (["--image", "{m}/trunc.png"], "--image {m}/trunc.png: is truncated or corrupt", ""),
    "frame-out-of-range": (["--condition", "{m}/img.png@999"], "--condition {m}/img.png@999: frame_index=999 is "
                           "out of range", "[-9, 8]"),
    "strength-out-of-range": (["--condition", "{m}/img.png@0:1.5"], "--condition {m}/img.png@0:1.5: strength=1.5 "
                              "is out of range", ""),
    "image-is-a-video": (["--image", "{m}/clip.mp4"], "--image {m}/clip.mp4: is a video (5 frames)", ""),
    "video-is-an-image": (["--video", "{m}/img.png"], "--video {m}/img.png: is an image", ""),
    "image-and-condition": (["--image", "{m}/img.png", "--condition", "{m}/img.png@0"],
                            "--image and --condition were both given", "--condition {m}/img.png@0"),
    "image-and-video": (["--image", "{m}/img.png", "--video", "{m}/clip.mp4"], "--image and --video were both", ""),
    "clip-longer-than-video": (["--video", "{m}/long.mp4"], "--video {m}/long.mp4: clip has more than 9 frames", ""),
    "clip-past-the-end": (["--condition", "{m}/clip.mp4@6"], "--condition {m}/clip.mp4@6: media has 5 frames, "
                          "more than the 3", ""),
    "noise-scale": (["--condition", "{m}/img.png@0", "--image-cond-noise-scale", "2"],
                    "--image-cond-noise-scale: image_cond_noise_scale=2.0 is out of range", ""),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(BAD))
def test_generate_bad_media_exits_2_before_starting(nothing_starts, media, tmp_path, capsys, case):
    flags, expected, also = BAD[case]
    target = tmp_path / "out"
    code = cli.main(["generate", *REQUEST, *(f.format(m=media) for f in flags), "--nproc", "2",
                     "--out", f"{target}/"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"error: {expected.format(m=media)}" in lines[0] and also.format(m=media) in lines[0], err
    assert not target.exists()


@pytest.mark.parametrize("text", ["img.png", "img.png@", "img.png@first", "img.png@0:strong", "@3"])
def test_condition_flag_syntax(capsys, text):
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(["generate", *REQUEST, "--condition", text, "--out", "x/"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --condition: " in err and "is not PATH@FRAME[:STRENGTH]" in err


def test_condition_flag_values():
    args = cli.build_parser().parse_args(["generate", *REQUEST, "--out", "x/", "--condition", "a@b.png@-1:0.25",
                                          "--condition", "c.mp4@8", "--video", "v.mp4"])
    assert args.condition == [("a@b.png@-1:0.25", "a@b.png", -1, 0.25), ("c.mp4@8", "c.mp4", 8, 1.0)]
    image, conditions = cli._media_refs(args)
    assert image is None
    assert [(c.label, str(c.path), c.kind, c.frame_index, c.strength) for c in conditions] == [
        ("--video v.mp4", "v.mp4", "video", 0, 1.0), ("--condition a@b.png@-1:0.25", "a@b.png", None, -1, 0.25),
        ("--condition c.mp4@8", "c.mp4", None, 8, 1.0)]


# ------------------------------------------------------------------------------------- a prompts file, in process


def test_batch_media_lines_are_checked(tmp_path, media):
    """Both ``conditions`` forms, paths from the prompts file's folder, and each kind of bad line (no model)."""
    (tmp_path / "m").symlink_to(media, target_is_directory=True)
    shape = {"frames": FRAMES, "height": HEIGHT, "width": WIDTH}
    lines = [
        {"prompt": "a", "image": "m/img.png"},
        {"prompt": "b", "video": "m/clip.mp4", "conditions": [{"media": str(media / "img.png"), "frame_index": -1,
                                                                "strength": 0.5}, "m/img.png@4:0.9"]},
        {"prompt": "c", "image": "m/img.png", "conditions": ["m/img.png@0"]},
        {"prompt": "d", "conditions": [{"media": "m/img.png", "frame": 2}]},
        {"prompt": "e", "conditions": "m/img.png@0"},
        {"prompt": "f", "conditions": ["m/img.png"]},
        {"prompt": "g", "video": "m/missing.mp4"},
        {"prompt": "h", "conditions": ["m/notes.txt@0"]},
        {"prompt": "i", "conditions": ["m/img.png@0", {"media": "m/img.png", "frame_index": 99}]},
        {"prompt": "j", "image": "m/clip.mp4"},
        {"prompt": "k", "video": "m/long.mp4"},
    ]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({**line, **shape}) + "\n" for line in lines))
    args = cli.build_parser(["batch"]).parse_args(["batch", str(prompts), "--out-dir", str(tmp_path / "o")])
    info = ModelInfo(path=tmp_path, family="ltx-video", geometry=VideoGeometry(), layers=2,
                     options=model_options("ltx-video", layers=2, stages=1))
    items = batch._plan_batch(args, info, GenerationLimits())
    assert [i.status for i in items] == ["todo", "todo"] + ["invalid"] * 9, [(i.line, i.message) for i in items]
    messages = {i.line: i.message for i in items}
    assert "'image' and 'video'/'conditions' were both given" in messages[3]
    assert "conditions[0] has unknown key(s) 'frame'" in messages[4]
    assert "conditions must be a list" in messages[5]
    assert "conditions[0]: 'm/img.png' is not PATH@FRAME[:STRENGTH]" in messages[6]
    assert messages[7].startswith("video (m/missing.mp4): cannot read") and str(tmp_path / "m") in messages[7]
    assert messages[8].startswith("conditions[0] (m/notes.txt@0): is not an image or video")
    assert messages[9].startswith("conditions[1] (m/img.png): frame_index=99 is out of range")
    assert messages[10].startswith("image (m/clip.mp4): is a video")
    assert messages[11].startswith("video (m/long.mp4): clip has more than 9 frames")

    # Held without the media; read again to run, the video first.
    assert all(i.request.image is None and i.request.conditions == () for i in items[:2])
    first = batch._request_to_run(items[0])
    assert first.image.frames.shape == (1, 48, 40, 3) and first.image.frames.std() > 1
    second = batch._request_to_run(items[1])
    assert [(c.frames.shape[0], c.frame_index, c.strength) for c in second.conditions] == [
        (5, 0, 1.0), (1, -1, 0.5), (1, 4, 0.9)]
    # A file that changed after the check fails its line when it comes to run (UsageError: reported ``failed``).
    moved = tmp_path / "m2"
    moved.mkdir()
    (moved / "img.png").write_bytes((media / "img.png").read_bytes())
    write_mp4(np.random.default_rng(3).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), moved / "clip.mp4", fps=8)
    (tmp_path / "m").unlink()
    (tmp_path / "m").symlink_to(moved, target_is_directory=True)
    with pytest.raises(UsageError, match=r"media changed since the batch was checked \(frames \[5, 1, 1\], now"):
        batch._request_to_run(items[1])

    ltx2 = ModelInfo(path=tmp_path, family="ltx2", geometry=VideoGeometry(min_latent_side=2), layers=2,
                     options=model_options("ltx2", layers=2, stages=1))
    # LTX-2 takes the same media (LTX2ImageToVideoPipeline, LTX2ConditionPipeline): both forms are planned to run.
    ltx2_lines = [{"prompt": "a", "image": str(media / "img.png")},
                  {"prompt": "b", "video": str(media / "clip.mp4"),
                   "conditions": [{"media": str(media / "img.png"), "frame_index": -1, "strength": 0.5}]}]
    prompts.write_text("".join(json.dumps({**line, **shape}) + "\n" for line in ltx2_lines))
    items = batch._plan_batch(args, ltx2, GenerationLimits())
    assert [i.status for i in items] == ["todo", "todo"], [(i.line, i.message) for i in items]
    assert batch._request_to_run(items[0]).image.frames.shape == (1, 48, 40, 3)
    assert [(c.frames.shape[0], c.frame_index, c.strength) for c in batch._request_to_run(items[1]).conditions] == [
        (5, 0, 1.0), (1, -1, 0.5)]


def test_frames_folder_latents(tmp_path):
    """``write_output``'s latents: ``NAME.npy`` listed in ``video.json``; a rewrite removes the arrays of the old
    video but no other ``.npy``; an MP4 refuses them."""
    rng = np.random.default_rng(11)
    frames = rng.integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    video, audio = rng.standard_normal((1, 4, 1, 2, 2)).astype(np.float32), rng.standard_normal((1, 8, 3, 4))
    folder = tmp_path / "v"
    write_output(frames, f"{folder}/", 8, latents={"latents": video, "audio_latents": audio})
    np.testing.assert_array_equal(np.load(folder / "latents.npy"), video)
    np.testing.assert_array_equal(np.load(folder / "audio_latents.npy"), audio)
    np.save(folder / "mine.npy", video)
    write_output(frames, f"{folder}/", 8, latents={"latents": video[:, :2]})
    assert sorted(p.name for p in folder.glob("*.npy")) == ["latents.npy", "mine.npy"]
    assert json.loads((folder / "video.json").read_text())["latents"]["latents"]["shape"] == [1, 2, 1, 2, 2]
    with pytest.raises(ValueError, match="latents are saved into a frames folder only"):
        write_output(frames, tmp_path / "v.mp4", 8, latents={"latents": video})
    with pytest.raises(ValueError, match="latents name '../x'"):
        write_output(frames, f"{tmp_path}/w/", 8, latents={"../x": video})
    assert not (tmp_path / "v.mp4").exists() and not (tmp_path / "w").exists()
