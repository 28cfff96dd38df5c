"""Output writers: MP4 (H.264 yuv420p, faststart) and lossless frames folders, and write_output's dispatch."""

from __future__ import annotations

import json

import av
import numpy as np
import pytest

from cp_infer.video_io import (
    MP4FileWriter,
    read_audio,
    read_frames_dir,
    read_mp4,
    write_frames_dir,
    write_mp4,
    write_output,
)

pytestmark = pytest.mark.timeout(60)


def _smooth_frames(rng: np.random.Generator, frames: int = 9, height: int = 64, width: int = 96) -> np.ndarray:
    """Random but smooth content (per-frame colour ramps), which H.264 at crf 17 keeps within a few levels."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for _ in range(frames):
        base, gx, gy = rng.uniform(40, 140, 3), rng.uniform(0, 1, 3), rng.uniform(0, 1, 3)
        out.append(base + gx * x[..., None] * 0.8 + gy * y[..., None] * 0.8)
    return np.clip(np.stack(out), 0, 255).round().astype(np.uint8)


def test_mp4_round_trip(tmp_path):
    rng = np.random.default_rng()
    frames = _smooth_frames(rng)
    path = tmp_path / "v.mp4"
    write_mp4(frames, path, fps=12)

    decoded, fps = read_mp4(path)
    assert decoded.shape == frames.shape and decoded.dtype == np.uint8
    assert fps == 12
    # Lossy, but close: a channel swap, a wrong colour matrix or range would be off by tens of levels.
    error = np.abs(decoded.astype(np.int16) - frames.astype(np.int16))
    assert error.mean() < 2.5, error.mean()
    with av.open(str(path)) as container:
        ctx = container.streams.video[0].codec_context
        assert (ctx.name, ctx.pix_fmt, ctx.width, ctx.height) == ("h264", "yuv420p", 96, 64)
    data = path.read_bytes()
    assert 0 <= data.find(b"moov") < data.find(b"mdat"), "faststart: the index must come before the media"


def test_frames_dir_round_trip_is_bit_exact(tmp_path):
    frames = np.random.default_rng().integers(0, 256, size=(5, 32, 48, 3), dtype=np.uint8)
    write_frames_dir(frames, tmp_path / "f", fps=30)
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == [f"frame_{i:05d}.png" for i in range(5)] + [
        "video.json"]
    assert json.loads((tmp_path / "f" / "video.json").read_text()) == {
        "fps": 30, "num_frames": 5, "height": 32, "width": 48}
    decoded, fps = read_frames_dir(tmp_path / "f")
    np.testing.assert_array_equal(decoded, frames)
    assert fps == 30


def test_write_output_dispatch(tmp_path):
    rng = np.random.default_rng()
    frames = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)

    # A path ending in '/' is a frames folder (created, parents too).
    assert write_output(frames, f"{tmp_path}/a/b/", fps=8) == tmp_path / "a" / "b"
    np.testing.assert_array_equal(read_frames_dir(tmp_path / "a" / "b")[0], frames)

    # An existing folder is written in place: the user's other files stay, older extra frames go.
    folder = tmp_path / "existing"
    write_frames_dir(rng.integers(0, 256, size=(6, 32, 32, 3), dtype=np.uint8), folder, fps=8)
    (folder / "notes.txt").write_text("mine")
    write_output(frames, folder, fps=8)
    assert (folder / "notes.txt").read_text() == "mine"
    assert len(list(folder.glob("frame_*.png"))) == 3
    np.testing.assert_array_equal(read_frames_dir(folder)[0], frames)

    # Anything else is an MP4, parents created, no temporary file left behind.
    out = write_output(frames, tmp_path / "c" / "clip.mp4", fps=8)
    assert out == tmp_path / "c" / "clip.mp4" and out.is_file()
    assert read_mp4(out)[0].shape == frames.shape
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["clip.mp4"]


@pytest.mark.parametrize(
    ("shape", "dtype", "match"),
    [
        ((3, 33, 32, 3), np.uint8, "even width and height"),
        ((3, 32, 32), np.uint8, r"\[F, H, W, 3\]"),
        ((3, 32, 32, 4), np.uint8, r"\[F, H, W, 3\]"),
        ((0, 32, 32, 3), np.uint8, r"\[F, H, W, 3\]"),
        ((3, 32, 32, 3), np.float32, "uint8"),
    ],
)
def test_bad_frames_raise_value_error_and_leave_nothing(tmp_path, shape, dtype, match):
    frames = np.zeros(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        write_output(frames, tmp_path / "x.mp4", fps=24)
    assert list(tmp_path.iterdir()) == []


def test_bad_fps_raises(tmp_path):
    frames = np.random.default_rng().integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    for fps in (0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="fps"):
            write_mp4(frames, tmp_path / "x.mp4", fps=fps)


@pytest.mark.parametrize("with_audio", [False, True])
def test_mp4_written_in_pieces_is_the_whole_video_file(tmp_path, with_audio):
    # The CLI encodes each decoded piece as it lands; the file must be the one write_mp4 makes of the whole video:
    # the same frames encoded in the same order, a second at a time with the audio under it.
    rng = np.random.default_rng()
    frames = rng.integers(0, 256, size=(57, 64, 96, 3), dtype=np.uint8)
    audio = (rng.standard_normal((2, 48_000 * 57 // 25)) * 0.1).astype(np.float32) if with_audio else None
    rate = 48_000 if with_audio else None
    write_mp4(frames, tmp_path / "whole.mp4", 25, audio=audio, sample_rate=rate)
    cuts = sorted(rng.choice(np.arange(1, 57), size=4, replace=False).tolist())
    with MP4FileWriter(tmp_path / "pieces.mp4", width=96, height=64, fps=25, audio=audio, sample_rate=rate) as w:
        for a, b in zip([0, *cuts], [*cuts, 57], strict=True):
            w.write(frames[a:b])
    whole, pieces = read_mp4(tmp_path / "whole.mp4"), read_mp4(tmp_path / "pieces.mp4")
    assert pieces[1] == whole[1] and pieces[0].shape == frames.shape
    # x264's threads may now and then decide differently (see the module docstring): pictures within noise.
    assert np.abs(pieces[0].astype(int) - whole[0].astype(int)).mean() < 1.0
    if with_audio:
        np.testing.assert_allclose(read_audio(tmp_path / "pieces.mp4")[0], read_audio(tmp_path / "whole.mp4")[0],
                                   atol=1e-6)
