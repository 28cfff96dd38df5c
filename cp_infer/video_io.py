"""Output writers: uint8 frames ``[F, H, W, 3]`` -> an H.264 MP4 or a folder of lossless PNG frames.

Encoder choice: PyAV (in-process libav) rather than imageio-ffmpeg (a piped ffmpeg subprocess). The streaming
path (fragmented MP4 with AAC audio) needs PyAV's muxer anyway, so files and streams share one encoder stack,
one libx264 build and the settings below; failures are Python exceptions rather than a subprocess exit code and
a stderr tail; and the RGB -> YUV conversion is done here, explicitly, so its colour matrix can be tagged.

Invariants:
- MP4s are H.264 High, yuv420p, BT.709 limited range (converted and tagged, so players agree on the colours),
  constant frame rate ``fps``, with the index (moov) in front (``+faststart``) so playback starts before the
  whole file has arrived. yuv420p needs an even width and height; other sizes are a ``ValueError``.
- MP4 bytes are not promised identical run to run (x264's threads now and then decide differently); the decoded
  pictures agree to within compression noise. Frames folders are exact.
- A frames folder holds ``frame_00000.png`` ... (bit-exact) and ``video.json``, written last: a folder with
  ``video.json`` is complete.
- :func:`write_output` never leaves a half-written output under the final name: it writes a hidden temporary
  sibling and renames it into place, so "the output exists" means "the output is complete" (into an existing
  folder it writes in place, and ``video.json``, written last, is the mark of completeness).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc
from PIL import Image

__all__ = [
    "add_h264_stream",
    "encode_frames",
    "is_frames_dir_target",
    "read_frames_dir",
    "read_mp4",
    "write_frames_dir",
    "write_mp4",
    "write_output",
]

VIDEO_JSON = "video.json"
_FRAME_NAME = "frame_{:05d}.png"
_FRAME_GLOB = "frame_*.png"

# One place for the encoder settings; the streaming writer must use the same ones.
_CODEC = "libx264"
_CRF = 17
"""Visually lossless for most content (x264's scale: 0 lossless, 23 default, 51 worst)."""
_PRESET = "medium"
_PIX_FMT = "yuv420p"
"""The only chroma format every player decodes (High 4:4:4 profiles are not widely supported)."""


def _check_frames(frames: np.ndarray) -> tuple[int, int, int]:
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"frames must be a numpy array [F, H, W, 3] of uint8, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames have dtype {frames.dtype}; convert to uint8 (0..255) first")
    if frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape) < 1:
        raise ValueError(f"frames have shape {tuple(frames.shape)}; expected [F, H, W, 3] with F, H, W >= 1")
    num_frames, height, width, _ = frames.shape
    return num_frames, height, width


def _check_fps(fps: float) -> Fraction:
    if isinstance(fps, bool) or not isinstance(fps, (int, float, Fraction)) or not math.isfinite(fps) or fps <= 0:
        raise ValueError(f"fps={fps!r} must be a positive number")
    # 29.97 -> 2997/100; NTSC's 30000/1001 can be passed as a Fraction.
    return Fraction(fps).limit_denominator(1001)


def _check_even(width: int, height: int) -> None:
    if height % 2 or width % 2:
        raise ValueError(f"an MP4 (yuv420p) needs an even width and height, got {width}x{height}; use even sizes "
                         "(models produce multiples of 32), or write a frames folder (an output ending in '/')")


def add_h264_stream(container, *, width: int, height: int, fps: float, low_latency: bool = False):
    """The one H.264 stream setup (codec, quality, BT.709 tags) for files and progressive streams.

    ``low_latency`` adds x264's ``zerolatency`` tuning (no lookahead, no B-frames), so that each frame's bytes
    leave the encoder as soon as the frame goes in.
    """
    rate = _check_fps(fps)
    _check_even(width, height)
    stream = container.add_stream(_CODEC, rate=rate)
    stream.width, stream.height, stream.pix_fmt = width, height, _PIX_FMT
    stream.options = {"crf": str(_CRF), "preset": _PRESET, **({"tune": "zerolatency"} if low_latency else {})}
    ctx = stream.codec_context
    ctx.colorspace, ctx.color_range = Colorspace.ITU709, ColorRange.MPEG
    ctx.color_primaries, ctx.color_trc = ColorPrimaries.BT709, ColorTrc.BT709
    return stream


def encode_frames(container, stream, frames: np.ndarray, first_pts: int) -> None:
    """Convert uint8 RGB frames to BT.709 limited-range yuv420p, encode and mux them."""
    for i, frame in enumerate(frames):
        rgb = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
        yuv = rgb.reformat(format=_PIX_FMT, src_colorspace=Colorspace.ITU709, dst_colorspace=Colorspace.ITU709,
                           src_color_range=ColorRange.JPEG, dst_color_range=ColorRange.MPEG,
                           dst_color_trc=ColorTrc.BT709, dst_color_primaries=ColorPrimaries.BT709)
        yuv.pts = first_pts + i
        container.mux(stream.encode(yuv))


def write_mp4(frames: np.ndarray, path: str | os.PathLike, fps: float) -> None:
    """Encode ``frames`` (uint8 RGB ``[F, H, W, 3]``) as an H.264 MP4 at ``fps`` frames per second."""
    _, height, width = _check_frames(frames)
    _check_fps(fps)
    _check_even(width, height)  # before any file exists
    with av.open(os.fspath(path), mode="w", format="mp4", container_options={"movflags": "+faststart"}) as container:
        stream = add_h264_stream(container, width=width, height=height, fps=fps)
        encode_frames(container, stream, frames, 0)
        container.mux(stream.encode(None))


def read_mp4(path: str | os.PathLike) -> tuple[np.ndarray, float]:
    """Decode a video file to uint8 RGB frames ``[F, H, W, 3]`` and its average frame rate."""
    with av.open(os.fspath(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24", dst_color_range=ColorRange.JPEG) for f in container.decode(stream)]
        rate = stream.average_rate
    if not frames:
        raise ValueError(f"{os.fspath(path)!r} holds no video frames")
    return np.stack(frames), float(rate)


def write_frames_dir(frames: np.ndarray, directory: str | os.PathLike, fps: float) -> None:
    """Write ``frame_00000.png`` ... and ``video.json`` into ``directory`` (created; old frames replaced)."""
    num_frames, height, width = _check_frames(frames)
    rate = _check_fps(fps)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    # The folder may hold an older, longer video; its frames must not survive next to ours.
    (root / VIDEO_JSON).unlink(missing_ok=True)
    for old in root.glob(_FRAME_GLOB):
        old.unlink()
    for i, frame in enumerate(frames):
        # compress_level=1: PNG stays lossless at any level; the higher ones only trade time for size.
        Image.fromarray(frame, mode="RGB").save(root / _FRAME_NAME.format(i), compress_level=1)
    info = {"fps": int(rate) if rate.denominator == 1 else float(rate), "num_frames": num_frames,
            "height": height, "width": width}
    (root / VIDEO_JSON).write_text(json.dumps(info, indent=2) + "\n")


def read_frames_dir(directory: str | os.PathLike) -> tuple[np.ndarray, float]:
    """Read a folder written by :func:`write_frames_dir` back: uint8 frames ``[F, H, W, 3]`` and fps."""
    root = Path(directory)
    try:
        info = json.loads((root / VIDEO_JSON).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{str(root)!r} is not a complete frames folder (no readable {VIDEO_JSON}): {exc}") from exc
    frames = np.stack([np.asarray(Image.open(root / _FRAME_NAME.format(i)).convert("RGB"))
                       for i in range(info["num_frames"])])
    return frames, float(info["fps"])


def is_frames_dir_target(out: str | os.PathLike) -> bool:
    """True when ``out`` names a frames folder: an existing directory, or a path ending in a separator."""
    text = os.fspath(out)
    return text.endswith(("/", os.sep)) or Path(text).expanduser().is_dir()


def write_output(frames: np.ndarray, out: str | os.PathLike, fps: float) -> Path:
    """Write ``frames`` to ``out``: a frames folder if :func:`is_frames_dir_target`, else an MP4.

    Parent folders are created. The output appears under its final name only once complete.
    Returns the final path.
    """
    _check_frames(frames)
    _check_fps(fps)
    as_dir = is_frames_dir_target(out)
    final = Path(os.fspath(out).rstrip("/" + os.sep) or os.sep).expanduser()
    final.parent.mkdir(parents=True, exist_ok=True)
    if as_dir and final.is_dir():
        # An existing folder may hold other files of the user's: write into it (video.json last marks the
        # frames complete) rather than replace it.
        write_frames_dir(frames, final, fps)
        return final
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        if as_dir:
            write_frames_dir(frames, tmp, fps)
        else:
            write_mp4(frames, tmp, fps)
        os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return final
