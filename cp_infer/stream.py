"""Progressive MP4: frames in, fragmented-MP4 bytes out as soon as they are encoded.

PyAV (in-process libavformat + libx264) is used rather than an ffmpeg subprocess: it writes to any
file-like object, so bytes can go to an HTTP response, a file and stdout at once, and it can mux an AAC
audio track in the same container later. ``empty_moov`` puts the header first with no sample table, and
``frag_every_frame`` closes a fragment after every frame; with x264's ``zerolatency`` tuning (no lookahead,
no B-frames) each frame's bytes leave the encoder when the frame goes in. Players and ffmpeg read the result
as an ordinary MP4.

Audio (optional) is given whole before the first frame, or piece by piece as it is made
(:meth:`FragmentedMP4Writer.write_audio`, e.g. a long video's soundtrack window by window). The AAC frames that cover
the time span of a run of frames are muxed just before those frames, so fragments carry both streams in time order
as they go; frames whose audio has not come yet wait (unencoded) for it, or for :meth:`~FragmentedMP4Writer.close`,
which muxes whatever is left.
With audio, fragments are cut every frame's duration rather than at every packet (see ``NOTE(fmp4-audio)``),
and the header waits for the first fragment; the audio stream's reported duration then also counts the 1024
priming samples that the edit list hides from playback.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import av
import numpy as np

from .video_io import add_h264_stream, add_piece, check_fps, check_track, encode_frames, open_track

__all__ = ["FragmentedMP4Writer"]


class _Sink(io.RawIOBase):
    def __init__(self, emit: Callable[[bytes], None]):
        self._emit = emit

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def write(self, data) -> int:
        self._emit(bytes(data))
        return len(data)


class FragmentedMP4Writer:
    """Encode uint8 RGB frames ``[F, H, W, 3]`` (h264, yuv420p) and hand the bytes to ``emit`` as they come.

    ``audio`` (float ``[channels, samples]`` or ``[samples]`` at ``sample_rate`` Hz, sample 0 with frame 0) adds
    an AAC track, muxed alongside the frames; ``audio_channels`` instead adds one whose samples come piece by piece
    (:meth:`write_audio`).
    """

    def __init__(self, emit: Callable[[bytes], None], *, width: int, height: int, fps: int,
                 audio: np.ndarray | None = None, sample_rate: int | None = None, audio_channels: int | None = None):
        rate = check_fps(fps)  # before any container exists
        waveform = check_track(audio, sample_rate, audio_channels)
        self._sink = _Sink(emit)
        if waveform is None and audio_channels is None:
            options = {"movflags": "frag_every_frame+empty_moov+default_base_moof"}
        else:
            # NOTE(fmp4-audio): with two tracks, frag_every_frame cuts a fragment at every packet of either one
            # and libavformat then guesses the other track's fragment start wrongly (pts repeat or skip a frame).
            # Cutting by time, one video frame long, gives the same per-frame fragments with exact timestamps.
            # delay_moov holds the header back until the first fragment, so that it can carry the edit list that
            # hides the AAC encoder's priming samples (without it the audio plays 1024 samples late).
            # max_interleave_delta: the muxer holds each packet until every stream has one as late; once a
            # waveform shorter than the video has run out, that wait is capped at 1 s of video (default 10 s).
            options = {"movflags": "empty_moov+delay_moov+default_base_moof",
                       "frag_duration": str(max(1, math.floor(1_000_000 / rate))),
                       "max_interleave_delta": "1000000"}
        self._container = av.open(self._sink, mode="w", format="mp4", options=options)
        # The same encoder settings and colour tags as whole-file MP4s, tuned for latency.
        self._stream = add_h264_stream(self._container, width=width, height=height, fps=fps, low_latency=True)
        self._audio = open_track(self._container, waveform, sample_rate, audio_channels)
        self._rate = rate
        self._waiting: list[np.ndarray] = []
        """Frames whose audio has not come yet, in order."""
        self.frames_written = 0
        self._closed = False

    def write(self, frames: np.ndarray) -> None:
        if frames.ndim != 4 or frames.shape[1:] != (self._stream.height, self._stream.width, 3):
            raise ValueError(f"frames of shape {frames.shape} do not match "
                             f"[F, {self._stream.height}, {self._stream.width}, 3]")
        self._waiting.append(np.asarray(frames, dtype=np.uint8))
        self._pump()

    def write_audio(self, samples: np.ndarray) -> None:
        """The soundtrack's next samples ``[channels, s]`` (a writer opened with ``audio_channels``)."""
        add_piece(self._audio, samples)
        self._pump()

    def _pump(self) -> None:
        """Encode the waiting frames whose audio has come, each run after the audio under it."""
        if not self._waiting:
            return
        frames = np.concatenate(self._waiting) if len(self._waiting) > 1 else self._waiting[0]
        ready = frames.shape[0]
        if self._audio is not None:
            # The audio under these frames goes first, and a little beyond: the muxer releases a packet only once
            # every stream has one at least as late, and the AAC encoder holds back what it was last fed.
            def until(n: int):
                return (self.frames_written + n) / self._rate + self._audio.encoder_delay

            if not self._audio.covers(until(ready)):  # the most frames it covers (monotonic in their number)
                lo, hi = 0, ready
                while lo + 1 < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if self._audio.covers(until(mid)) else (lo, mid)
                ready = lo
            if ready:
                self._audio.encode_until(until(ready))
        if ready:
            encode_frames(self._container, self._stream, frames[:ready], self.frames_written)
            self.frames_written += ready
        self._waiting = [frames[ready:]] if ready < frames.shape[0] else []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._audio is not None:
            self._audio.end()
        self._pump()
        self._container.mux(self._stream.encode(None))
        if self._audio is not None:
            self._audio.finish()
        self._container.close()
