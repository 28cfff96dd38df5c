"""Output writers: uint8 frames ``[F, H, W, 3]`` (and optionally a waveform) -> an H.264 + AAC MP4 or a folder of
lossless PNG frames (+ a WAV).

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
- Audio is a float waveform ``[channels, samples]`` (or ``[samples]``: mono), 1 or 2 channels, clipped to [-1, 1],
  whose sample 0 plays with frame 0, given whole or piece by piece (``audio_channels`` and ``write_audio``: frames
  wait, unencoded, for the audio under them, so the AAC and the muxing are those of the whole waveform). In an MP4 it
  is AAC-LC (fltp) with pts counted in samples; the encoder's 1024 priming samples are hidden by the MP4 edit list, so
  the audio lines up with the video sample for sample and lasts as long as the waveform (:func:`read_audio` gives back
  exactly its length; the stream's duration is rounded to the movie's millisecond clock). Audio and video are muxed
  interleaved.
- A frames folder holds ``frame_00000.png`` ... (bit-exact), ``audio.wav`` (16-bit PCM) when there is audio,
  ``NAME.npy`` for each latents array given (``latents.npy``; ``audio_latents.npy`` with audio), and ``video.json``,
  written last: a folder with ``video.json`` is complete. ``video.json`` lists the arrays it has, so a rewrite
  removes those of the old video (and no other ``.npy`` of the user's).
- :func:`write_output` never leaves a half-written output under the final name: it writes a hidden temporary
  sibling and renames it into place, so "the output exists" means "the output is complete" (into an existing
  folder it writes in place, and ``video.json``, written last, is the mark of completeness).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import uuid
import wave
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from av.video.reformatter import ColorPrimaries, ColorRange, Colorspace, ColorTrc
from PIL import Image

__all__ = [
    "AudioTrack",
    "MP4FileWriter",
    "add_h264_stream",
    "add_piece",
    "check_audio",
    "check_fps",
    "check_track",
    "encode_frames",
    "is_frames_dir_target",
    "open_track",
    "read_audio",
    "read_frames_dir",
    "read_mp4",
    "temporary_sibling",
    "write_frames_dir",
    "write_mp4",
    "write_output",
]

VIDEO_JSON = "video.json"
_FRAME_NAME = "frame_{:05d}.png"
_FRAME_GLOB = "frame_*.png"
AUDIO_WAV = "audio.wav"

# One place for the encoder settings; the streaming writer must use the same ones.
_CODEC = "libx264"
_CRF = 17
"""Visually lossless for most content (x264's scale: 0 lossless, 23 default, 51 worst)."""
_PRESET = "medium"
_PIX_FMT = "yuv420p"
"""The only chroma format every player decodes (High 4:4:4 profiles are not widely supported)."""
_AUDIO_CODEC = "aac"
_AAC_BIT_RATE_PER_CHANNEL = 96_000
"""Transparent for most content with FFmpeg's native AAC encoder (its default is ~64 kb/s per channel)."""
_AAC_FRAME = 1024
"""Samples per channel in an AAC-LC frame."""
_AAC_RATES = (96000, 88200, 64000, 48000, 44100, 32000, 24000, 22050, 16000, 12000, 11025, 8000, 7350)
"""The sampling frequencies AAC can signal (ISO 14496-3); the encoder refuses any other."""


def _check_frames(frames: np.ndarray) -> tuple[int, int, int]:
    if not isinstance(frames, np.ndarray):
        raise ValueError(f"frames must be a numpy array [F, H, W, 3] of uint8, got {type(frames).__name__}")
    if frames.dtype != np.uint8:
        raise ValueError(f"frames have dtype {frames.dtype}; convert to uint8 (0..255) first")
    if frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape) < 1:
        raise ValueError(f"frames have shape {tuple(frames.shape)}; expected [F, H, W, 3] with F, H, W >= 1")
    num_frames, height, width, _ = frames.shape
    return num_frames, height, width


def check_fps(fps: float) -> Fraction:
    """``fps`` as the exact frame rate the encoders use, or a ``ValueError``."""
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
    rate = check_fps(fps)
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


def check_audio(audio: np.ndarray | None, sample_rate: int | None, *, aac: bool = True) -> np.ndarray | None:
    """Validate a waveform; return it as contiguous float32 ``[channels, samples]`` clipped to [-1, 1].

    ``audio=None`` (no audio) returns None whatever ``sample_rate`` is. ``aac`` also requires a sample rate AAC
    can carry (a WAV takes any).
    """
    if audio is None:
        return None
    if not isinstance(audio, np.ndarray):
        raise ValueError(f"audio must be a numpy array [channels, samples] of floats in [-1, 1], "
                         f"got {type(audio).__name__}")
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio has dtype {audio.dtype}; pass float samples in [-1, 1] "
                         "(16-bit PCM: divide by 32768)")
    waveform = audio[None] if audio.ndim == 1 else audio
    if waveform.ndim != 2 or waveform.shape[0] not in (1, 2) or waveform.shape[1] < 1:
        raise ValueError(f"audio has shape {tuple(audio.shape)}; expected [channels, samples] with 1 or 2 channels "
                         "(or [samples] for mono) and at least one sample; transpose a [samples, channels] array")
    if not np.isfinite(waveform).all():
        raise ValueError("audio holds NaN or infinite samples; fix the waveform (or pass audio=None)")
    if sample_rate is None:
        raise ValueError("audio was given without sample_rate; pass the waveform's rate, e.g. sample_rate=24000")
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"sample_rate={sample_rate!r} must be a positive int (samples per second), e.g. 24000")
    if aac and sample_rate not in _AAC_RATES:
        raise ValueError(f"sample_rate={sample_rate} cannot be carried by AAC; resample the audio to one of "
                         f"{', '.join(map(str, _AAC_RATES))}, or write a frames folder (its WAV takes any rate)")
    # Out of range, samples would wrap in a 16-bit WAV and distort in AAC; clipping is what a DAC does anyway.
    return np.clip(waveform.astype(np.float32), -1.0, 1.0)


class AudioTrack:
    """An AAC stream in ``container`` fed a stretch of video time at a time, from a waveform known up front or one
    that arrives piece by piece (:meth:`add`, then :meth:`end`).

    ``waveform`` is what :func:`check_audio` returns (``None``: pieces of ``channels`` channels will come). Call
    :meth:`encode_until` as video is muxed (so the two streams interleave and fragments carry both; only samples
    already given are encoded), then :meth:`finish` once, before the container closes. Only the samples not yet
    encoded are held.
    """

    def __init__(self, container, waveform: np.ndarray | None, sample_rate: int, *, channels: int | None = None):
        if (waveform is None) == (channels is None):
            raise ValueError("give AudioTrack either the whole waveform or the channels of the pieces to come")
        self._container = container
        self._rate = int(sample_rate)
        self.channels = waveform.shape[0] if waveform is not None else int(channels)
        if self.channels not in (1, 2):
            raise ValueError(f"audio has {self.channels} channels; 1 or 2 are supported")
        self._held = [] if waveform is None else [waveform]
        """The samples given and not yet encoded, from ``samples_encoded`` on."""
        self.samples_given = 0 if waveform is None else waveform.shape[1]
        self.ended = waveform is not None
        """Every sample has been given (the track may end on a short frame)."""
        self.samples_encoded = 0
        self.stream = container.add_stream(_AUDIO_CODEC, rate=self._rate)
        ctx = self.stream.codec_context
        ctx.layout, ctx.format = ("mono" if self.channels == 1 else "stereo"), "fltp"
        ctx.bit_rate = _AAC_BIT_RATE_PER_CHANNEL * self.channels
        self.encoder_delay = Fraction(2 * _AAC_FRAME, self._rate)
        """How far the packets out of the encoder lag the samples fed in (the 1024 priming and a frame in flight)."""

    def add(self, samples: np.ndarray) -> None:
        """The soundtrack's next samples, ``[channels, s]`` floats (clipped to [-1, 1] as :func:`check_audio`)."""
        if self.ended:
            raise RuntimeError("audio samples were given after the track's end")
        if not isinstance(samples, np.ndarray) or samples.ndim != 2 or samples.shape[0] != self.channels \
                or not np.issubdtype(samples.dtype, np.floating):
            raise ValueError(f"audio piece of shape {getattr(samples, 'shape', None)}; expected float "
                             f"[{self.channels}, samples]")
        if not np.isfinite(samples).all():
            raise ValueError("audio piece holds NaN or infinite samples")
        if samples.shape[1]:
            self._held.append(np.clip(samples.astype(np.float32), -1.0, 1.0))
            self.samples_given += samples.shape[1]

    def end(self) -> None:
        """No more samples will come."""
        self.ended = True

    def _stop(self, seconds: Fraction | float) -> int:
        """Where :meth:`encode_until` ``seconds`` stops, were every sample there."""
        target = math.ceil(Fraction(seconds) * self._rate)
        if self.ended:
            target = min(target, self.samples_given)
        # NOTE(aac-frames): only the last frame may be short, so stop on a frame boundary unless at the end.
        stop = self.samples_encoded + -(-(target - self.samples_encoded) // _AAC_FRAME) * _AAC_FRAME
        return max(self.samples_encoded, min(self.samples_given, stop) if self.ended else stop)

    def covers(self, seconds: Fraction | float) -> bool:
        """Whether :meth:`encode_until` ``seconds`` has every sample it needs (all of them after :meth:`end`)."""
        return self.ended or self._stop(seconds) <= self.samples_given

    def encode_until(self, seconds: Fraction | float) -> None:
        """Encode and mux the samples up to ``seconds`` (rounded up to whole AAC frames; capped at the end, and at
        the whole frames of the samples given so far)."""
        # The encoder's frame size is known once it is open, and the container opens every codec at once.
        self._container.start_encoding()
        frame_size = self.stream.codec_context.frame_size
        assert frame_size == _AAC_FRAME, frame_size
        stop = self._stop(seconds)
        if stop > self.samples_given:
            stop = self.samples_encoded + (self.samples_given - self.samples_encoded) // frame_size * frame_size
        if stop <= self.samples_encoded:
            return
        held = np.concatenate(self._held, axis=1) if len(self._held) > 1 else self._held[0]
        layout = self.stream.codec_context.layout.name
        for start in range(self.samples_encoded, stop, frame_size):
            a, b = start - self.samples_encoded, min(start + frame_size, stop) - self.samples_encoded
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(held[:, a:b]), format="fltp", layout=layout)
            frame.sample_rate, frame.time_base, frame.pts = self._rate, Fraction(1, self._rate), start
            self._container.mux(self.stream.encode(frame))
        rest = held[:, stop - self.samples_encoded:]
        self._held = [rest] if rest.shape[1] else []
        self.samples_encoded = stop

    def finish(self) -> None:
        """Encode what is left of the waveform and flush the encoder (it holds back a frame or two)."""
        self.end()
        self.encode_until(Fraction(self.samples_given, self._rate))
        self._container.mux(self.stream.encode(None))


def check_track(audio: np.ndarray | None, sample_rate: int | None, audio_channels: int | None) -> np.ndarray | None:
    """A writer's audio arguments, checked before anything is opened: the whole waveform (:func:`check_audio`'s),
    or ``audio_channels`` for one given piece by piece (``write_audio``) at ``sample_rate``; not both."""
    if audio_channels is None:
        return check_audio(audio, sample_rate)
    if audio is not None:
        raise ValueError("give the soundtrack whole (audio=...) or piece by piece (audio_channels=...), not both")
    if isinstance(audio_channels, bool) or audio_channels not in (1, 2):
        raise ValueError(f"audio_channels={audio_channels!r} must be 1 or 2")
    check_audio(np.zeros((audio_channels, 1), dtype=np.float32), sample_rate)  # the rate's checks
    return None


def open_track(container, waveform: np.ndarray | None, sample_rate: int | None,
               audio_channels: int | None) -> AudioTrack | None:
    """The :class:`AudioTrack` of :func:`check_track`'s arguments (``None``: no audio)."""
    if waveform is None and audio_channels is None:
        return None
    return AudioTrack(container, waveform, sample_rate, channels=None if waveform is not None else audio_channels)


def add_piece(track: AudioTrack | None, samples: np.ndarray) -> None:
    """A writer's ``write_audio``: ``samples`` onto its soundtrack, which must be one given piece by piece (opened
    with ``audio_channels``) and not ended."""
    if track is None or track.ended:
        raise RuntimeError("write_audio needs a writer opened with audio_channels (its soundtrack given piece by "
                           "piece)")
    track.add(samples)


class MP4FileWriter:
    """An MP4 file (``+faststart``) encoded a piece at a time, as the frames arrive: the same file
    :func:`write_mp4` makes of the whole video at once (which is this writer fed once).

    ``audio`` (float ``[channels, samples]`` or ``[samples]``, at ``sample_rate`` Hz) adds an AAC track that starts
    with the first frame; or ``audio_channels`` one whose samples come piece by piece (:meth:`write_audio`, in any
    order with the frames: frames wait, unencoded, until the audio under them has come or the writer closes). Use as
    a context manager, or call :meth:`close` (the file is complete) or :meth:`abort`.
    """

    def __init__(self, path: str | os.PathLike, *, width: int, height: int, fps: float,
                 audio: np.ndarray | None = None, sample_rate: int | None = None, audio_channels: int | None = None):
        self._rate = check_fps(fps)
        _check_even(width, height)  # before any file exists
        waveform = check_track(audio, sample_rate, audio_channels)
        self._container = av.open(os.fspath(path), mode="w", format="mp4",
                                  container_options={"movflags": "+faststart"})
        try:
            self._stream = add_h264_stream(self._container, width=width, height=height, fps=fps)
            self._track = open_track(self._container, waveform, sample_rate, audio_channels)
        except BaseException:
            self._container.close()
            raise
        # A second of video at a time, each with its audio, so the muxer's interleaving queue stays short.
        self._step = max(1, math.ceil(self._rate))
        self._pending: list[np.ndarray] = []
        self._pending_frames = 0
        self.frames_written = 0
        """Frames encoded so far (up to a second's worth more may wait for their second to fill, or for its audio)."""

    def write(self, frames: np.ndarray) -> None:
        """Append uint8 RGB frames ``[F, H, W, 3]``."""
        if frames.ndim != 4 or frames.shape[1:] != (self._stream.height, self._stream.width, 3):
            raise ValueError(f"frames of shape {frames.shape} do not match "
                             f"[F, {self._stream.height}, {self._stream.width}, 3]")
        self._pending.append(frames)
        self._pending_frames += frames.shape[0]
        self._pump()

    def write_audio(self, samples: np.ndarray) -> None:
        """Append the soundtrack's next samples ``[channels, s]`` (a writer opened with ``audio_channels``)."""
        add_piece(self._track, samples)
        self._pump()

    def _pump(self) -> None:
        """Encode the whole seconds of the frames waiting whose audio has come (all of them once it has ended)."""
        if self._pending_frames < self._step:
            return
        pending = np.concatenate(self._pending) if len(self._pending) > 1 else self._pending[0]
        first = 0
        while pending.shape[0] - first >= self._step and (
                self._track is None or self._track.covers((self.frames_written + self._step) / self._rate)):
            self._encode(pending[first:first + self._step])
            first += self._step
        self._pending = [pending[first:]] if first < pending.shape[0] else []
        self._pending_frames = pending.shape[0] - first

    def _encode(self, frames: np.ndarray) -> None:
        encode_frames(self._container, self._stream, frames, self.frames_written)
        self.frames_written += frames.shape[0]
        if self._track is not None:
            self._track.encode_until(self.frames_written / self._rate)

    def close(self) -> None:
        """Encode what is left, flush the encoders and finish the file."""
        try:
            if self._track is not None:
                self._track.end()
            self._pump()
            if self._pending_frames:
                self._encode(np.concatenate(self._pending))
                self._pending, self._pending_frames = [], 0
            self._container.mux(self._stream.encode(None))
            if self._track is not None:
                self._track.finish()
        finally:
            self._container.close()

    def abort(self) -> None:
        """Stop without finishing: the file is left incomplete (the caller removes it)."""
        with contextlib.suppress(Exception):  # any libav error: the file is being given up anyway
            self._container.close()

    def __enter__(self) -> MP4FileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_mp4(frames: np.ndarray, path: str | os.PathLike, fps: float, *, audio: np.ndarray | None = None,
              sample_rate: int | None = None) -> None:
    """Encode ``frames`` (uint8 RGB ``[F, H, W, 3]``) as an H.264 MP4 at ``fps`` frames per second.

    ``audio`` (float ``[channels, samples]`` or ``[samples]``, at ``sample_rate`` Hz) adds an AAC track that
    starts with the first frame.
    """
    _num_frames, height, width = _check_frames(frames)
    with MP4FileWriter(path, width=width, height=height, fps=fps, audio=audio, sample_rate=sample_rate) as writer:
        writer.write(frames)


def temporary_sibling(final: Path) -> Path:
    """The hidden temporary name an output is written under before it is renamed to ``final``."""
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")


def read_mp4(path: str | os.PathLike) -> tuple[np.ndarray, float]:
    """Decode a video file to uint8 RGB frames ``[F, H, W, 3]`` and its average frame rate."""
    with av.open(os.fspath(path)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24", dst_color_range=ColorRange.JPEG) for f in container.decode(stream)]
        rate = stream.average_rate
    if not frames:
        raise ValueError(f"{os.fspath(path)!r} holds no video frames")
    return np.stack(frames), float(rate)


def read_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Decode the first audio stream of a media file (an MP4, a WAV; a frames folder's ``audio.wav``).

    Returns float32 ``[channels, samples]`` and the sample rate, cut where the last packet ends: AAC decodes its
    short last frame to a whole one, and a fragmented MP4's stream duration also counts the encoder's priming.
    """
    source = Path(path)
    if source.is_dir():
        source = source / AUDIO_WAV
    with av.open(os.fspath(source)) as container:
        if not container.streams.audio:
            raise ValueError(f"{os.fspath(source)!r} holds no audio stream")
        stream = container.streams.audio[0]
        # Planar float whatever the codec decodes to (a WAV's s16 is packed: one interleaved row).
        to_fltp = av.AudioResampler(format="fltp")
        chunks, end = [], 0
        for packet in container.demux(stream):
            if packet.pts is not None:  # pts (after the edit list) and duration are in stream.time_base
                end = max(end, packet.pts + packet.duration)
            chunks += [f.to_ndarray() for frame in packet.decode() for f in to_fltp.resample(frame)]
        chunks += [f.to_ndarray() for f in to_fltp.resample(None)]
        rate, time_base = stream.codec_context.sample_rate, stream.time_base
    if not chunks:
        raise ValueError(f"{os.fspath(source)!r} holds no audio samples")
    waveform = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    return (waveform[:, :round(end * time_base * rate)] if end > 0 else waveform), rate


_ARRAY_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _check_latents(latents: Mapping[str, np.ndarray] | None) -> None:
    for name, array in (latents or {}).items():
        if not isinstance(name, str) or not _ARRAY_NAME.fullmatch(name):
            raise ValueError(f"latents name {name!r} must be 1-64 of a-z 0-9 _ (starting with a letter): it names "
                             "the file NAME.npy")
        if not isinstance(array, np.ndarray):
            raise ValueError(f"latents[{name!r}] must be a numpy array, got {type(array).__name__}")


def _old_arrays(root: Path) -> list[Path]:
    """The ``.npy`` files an earlier ``video.json`` in ``root`` lists (none if it has no readable one)."""
    try:
        info = json.loads((root / VIDEO_JSON).read_text())
        names = list(info.get("latents", {}))
    except (OSError, ValueError, AttributeError):
        return []
    return [root / f"{name}.npy" for name in names if isinstance(name, str) and _ARRAY_NAME.fullmatch(name)]


def write_frames_dir(frames: np.ndarray, directory: str | os.PathLike, fps: float, *,
                     audio: np.ndarray | None = None, sample_rate: int | None = None,
                     latents: Mapping[str, np.ndarray] | None = None) -> None:
    """Write ``frame_00000.png`` ..., ``audio.wav`` if ``audio`` is given, ``NAME.npy`` for each array of ``latents``
    and ``video.json`` into ``directory`` (created; old frames, audio and arrays replaced)."""
    num_frames, height, width = _check_frames(frames)
    rate = check_fps(fps)
    waveform = check_audio(audio, sample_rate, aac=False)
    _check_latents(latents)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    # The folder may hold an older, longer video (or one with audio or latents); none of it may survive next to ours.
    for old in _old_arrays(root):
        old.unlink(missing_ok=True)
    (root / VIDEO_JSON).unlink(missing_ok=True)
    (root / AUDIO_WAV).unlink(missing_ok=True)
    for old in root.glob(_FRAME_GLOB):
        old.unlink()
    for i, frame in enumerate(frames):
        # compress_level=1: PNG stays lossless at any level; the higher ones only trade time for size.
        Image.fromarray(frame, mode="RGB").save(root / _FRAME_NAME.format(i), compress_level=1)
    info = {"fps": int(rate) if rate.denominator == 1 else float(rate), "num_frames": num_frames,
            "height": height, "width": width}
    if waveform is not None:
        _write_wav(root / AUDIO_WAV, waveform, int(sample_rate))
        info["audio"] = {"file": AUDIO_WAV, "sample_rate": int(sample_rate), "channels": waveform.shape[0],
                         "num_samples": waveform.shape[1]}
    if latents:
        info["latents"] = {}
        for name, array in latents.items():
            np.save(root / f"{name}.npy", array, allow_pickle=False)
            info["latents"][name] = {"file": f"{name}.npy", "shape": list(array.shape), "dtype": str(array.dtype)}
    (root / VIDEO_JSON).write_text(json.dumps(info, indent=2) + "\n")


def _write_wav(path: Path, waveform: np.ndarray, sample_rate: int) -> None:
    """16-bit PCM, the WAV every tool reads (the stdlib writes no float WAVs)."""
    # C, S -> S, C: WAV interleaves the channels. Scaled by 2**15 as libswresample reads it back (+1.0 clips to
    # 32767), so a round trip is within half a step.
    pcm = np.clip(np.round(waveform.T * 32768), -32768, 32767).astype("<i2")
    with wave.open(os.fspath(path), "wb") as out:
        out.setnchannels(waveform.shape[0])
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())


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


def write_output(frames: np.ndarray, out: str | os.PathLike, fps: float, *, audio: np.ndarray | None = None,
                 sample_rate: int | None = None, latents: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write ``frames`` to ``out``: a frames folder if :func:`is_frames_dir_target`, else an MP4.

    ``audio`` at ``sample_rate`` Hz goes into the MP4 as AAC, or into the folder as ``audio.wav``; ``latents``
    (name -> array) into the folder as ``NAME.npy`` (an MP4 has no place for them: ``ValueError``).
    Parent folders are created. The output appears under its final name only once complete.
    Returns the final path.
    """
    _check_frames(frames)
    check_fps(fps)
    as_dir = is_frames_dir_target(out)
    check_audio(audio, sample_rate, aac=not as_dir)  # before anything is created
    _check_latents(latents)
    if latents and not as_dir:
        raise ValueError(f"latents are saved into a frames folder only; {os.fspath(out)!r} is an MP4: end the path "
                         "in '/' for a folder, or leave the latents out")
    sound = {"audio": audio, "sample_rate": sample_rate}
    folder = {**sound, "latents": latents}
    final = Path(os.fspath(out).rstrip("/" + os.sep) or os.sep).expanduser()
    final.parent.mkdir(parents=True, exist_ok=True)
    if as_dir and final.is_dir():
        # An existing folder may hold other files of the user's: write into it (video.json last marks the
        # frames complete) rather than replace it.
        write_frames_dir(frames, final, fps, **folder)
        return final
    tmp = temporary_sibling(final)
    try:
        if as_dir:
            write_frames_dir(frames, tmp, fps, **folder)
        else:
            write_mp4(frames, tmp, fps, **sound)
        os.replace(tmp, final)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise
    return final
