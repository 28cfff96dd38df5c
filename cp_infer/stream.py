"""Progressive MP4: frames in, fragmented-MP4 bytes out as soon as they are encoded.

PyAV (in-process libavformat + libx264) is used rather than an ffmpeg subprocess: it writes to any
file-like object, so bytes can go to an HTTP response, a file and stdout at once, and it can mux an AAC
audio track in the same container later. ``empty_moov`` puts the header first with no sample table, and
``frag_every_frame`` closes a fragment after every frame; with x264's ``zerolatency`` tuning (no lookahead,
no B-frames) each frame's bytes leave the encoder when the frame goes in. Players and ffmpeg read the result
as an ordinary MP4.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import av
import numpy as np

from .video_io import add_h264_stream, encode_frames

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
    """Encode uint8 RGB frames ``[F, H, W, 3]`` (h264, yuv420p) and hand the bytes to ``emit`` as they come."""

    def __init__(self, emit: Callable[[bytes], None], *, width: int, height: int, fps: int):
        self._sink = _Sink(emit)
        self._container = av.open(self._sink, mode="w", format="mp4",
                                  options={"movflags": "frag_every_frame+empty_moov+default_base_moof"})
        # The same encoder settings and colour tags as whole-file MP4s, tuned for latency.
        self._stream = add_h264_stream(self._container, width=width, height=height, fps=fps, low_latency=True)
        self.frames_written = 0
        self._closed = False

    def write(self, frames: np.ndarray) -> None:
        if frames.ndim != 4 or frames.shape[1:] != (self._stream.height, self._stream.width, 3):
            raise ValueError(f"frames of shape {frames.shape} do not match "
                             f"[F, {self._stream.height}, {self._stream.width}, 3]")
        encode_frames(self._container, self._stream, np.asarray(frames, dtype=np.uint8), self.frames_written)
        self.frames_written += frames.shape[0]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._container.mux(self._stream.encode(None))
        self._container.close()
