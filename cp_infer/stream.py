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

    def __init__(self, emit: Callable[[bytes], None], *, width: int, height: int, fps: int, crf: int = 18):
        if width % 2 or height % 2:
            raise ValueError(f"yuv420p needs an even frame size, got {width}x{height}")
        self._sink = _Sink(emit)
        self._container = av.open(self._sink, mode="w", format="mp4",
                                  options={"movflags": "frag_every_frame+empty_moov+default_base_moof"})
        self._stream = self._container.add_stream("libx264", rate=fps)
        self._stream.width, self._stream.height, self._stream.pix_fmt = width, height, "yuv420p"
        self._stream.options = {"crf": str(crf), "tune": "zerolatency", "preset": "veryfast"}
        self.frames_written = 0
        self._closed = False

    def write(self, frames: np.ndarray) -> None:
        if frames.ndim != 4 or frames.shape[1:] != (self._stream.height, self._stream.width, 3):
            raise ValueError(f"frames of shape {frames.shape} do not match "
                             f"[F, {self._stream.height}, {self._stream.width}, 3]")
        for frame in np.ascontiguousarray(frames, dtype=np.uint8):
            for packet in self._stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                self._container.mux(packet)
            self.frames_written += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for packet in self._stream.encode():
            self._container.mux(packet)
        self._container.close()
