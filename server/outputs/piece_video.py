"""MP4s encoded piece by piece as the decode delivers them (rank 0's ``on_frames``, and an audio-video model's
soundtrack whole before them or piece by piece with them: ``on_audio_piece``), so that the encode overlaps the
decode and no rank holds a whole video: to stdout (``generate --out -``) or to a file (``generate --out x.mp4``,
``batch``).

Invariants:
- ``write`` never raises into the sampler (the other ranks are inside the decode): the first failure is kept, the
  rest of the video dropped, and ``close`` raises ``WriteError``.
- A file appears under its final name only once complete (a hidden temporary sibling until then).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO

from cp_infer.request import GenerationRequest

__all__ = ["FileVideo", "PieceVideo", "StdoutVideo", "WriteError"]


class WriteError(RuntimeError):
    """The video was generated but could not be written (disk full, permissions, ...)."""


class PieceVideo:
    """An MP4 encoded piece by piece as the decode delivers them (rank 0's ``on_frames``), its soundtrack (audio-video
    models) given first whole (``set_audio``) or piece by piece with the frames (``add_audio``). Never raises into the
    sampler (the other ranks are inside the decode): the first failure is kept, the rest of the video dropped, and
    ``close`` raises ``WriteError``. Subclasses say where the bytes go."""

    def __init__(self, request: GenerationRequest):
        self.request, self.audio, self.writer, self.error = request, None, None, None
        self.samples_written = 0

    def _make_writer(self, waveform, sample_rate, channels=None):
        """The MP4 writer: with the whole soundtrack (``waveform``), or ``channels`` for one that comes piece by
        piece, or no audio."""
        raise NotImplementedError

    def set_audio(self, waveform, sample_rate: int) -> None:
        """The soundtrack (audio-video models), before the first frames: muxed along with them."""
        self.audio = (waveform, sample_rate)

    def add_audio(self, samples, first: int, sample_rate: int) -> None:
        """The soundtrack's samples ``[first, first + s)`` (``[C, s]``), piece by piece as they are made
        (``SampleControl.on_audio_piece``), the first piece before the first frames: muxed with the frames they play
        under. Never raises, as :meth:`write`."""
        if self.error is None:
            try:
                if first != self.samples_written:
                    raise RuntimeError(f"audio samples {first}.. after {self.samples_written}: expected them in order")
                if self.writer is None:
                    self.writer = self._make_writer(None, sample_rate, samples.shape[0])
                self.writer.write_audio(samples)
                self.samples_written += samples.shape[1]
            except Exception as exc:  # noqa: BLE001 -- kept for close(), as in write()
                self.error = exc

    def _open(self):
        if self.writer is None:
            self.writer = self._make_writer(*(self.audio or (None, None)))
        return self.writer

    def write(self, frames, _first: int, _total: int) -> None:
        if self.error is None:
            try:
                self._open().write(frames)
            except Exception as exc:  # noqa: BLE001 -- kept for close(): PyAV raises more than OSError/ValueError
                self.error = exc

    def _finish(self) -> None:
        if self.error is None:
            try:
                self._open().close()
                self._commit()
            except Exception as exc:  # noqa: BLE001 -- reported as a WriteError, like the ones kept by write()
                self.error = exc

    def _commit(self) -> None:
        """After the MP4 is complete."""

    def abort(self) -> None:
        """The job failed: nothing of it is left behind (where something was written)."""


class StdoutVideo(PieceVideo):
    """A fragmented MP4 to stdout; a reader that closed the pipe is the kept failure."""

    def __init__(self, out: BinaryIO, request: GenerationRequest):
        super().__init__(request)
        self.out = out

    def _make_writer(self, waveform, sample_rate, channels=None):
        from cp_infer.stream import FragmentedMP4Writer

        r = self.request
        return FragmentedMP4Writer(self._emit, width=r.width, height=r.height, fps=r.fps, audio=waveform,
                                   sample_rate=sample_rate, audio_channels=channels)

    def _emit(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()  # progressively: a reader gets each fragment as it is made

    def close(self) -> int:
        """Finish the MP4; returns the number of frames written."""
        self._finish()
        with contextlib.suppress(OSError):
            self.out.close()
        if self.error is not None:
            raise WriteError(f"could not write the video to stdout: {type(self.error).__name__}: {self.error}")
        return self.writer.frames_written


class FileVideo(PieceVideo):
    """An ``.mp4`` file (the file ``write_output`` makes of the whole video, with the encode overlapped with the
    decode), written under a hidden temporary name and renamed into place once complete; failures name ``out`` as
    ``result_writer`` does."""

    def __init__(self, out: str, request: GenerationRequest):
        from cp_infer.video_io import temporary_sibling

        super().__init__(request)
        self.out, self.final = out, Path(out).expanduser()
        self.tmp = temporary_sibling(self.final)

    def _make_writer(self, waveform, sample_rate, channels=None):
        from cp_infer.video_io import MP4FileWriter

        r = self.request
        self.final.parent.mkdir(parents=True, exist_ok=True)
        return MP4FileWriter(self.tmp, width=r.width, height=r.height, fps=r.fps, audio=waveform,
                             sample_rate=sample_rate, audio_channels=channels)

    def _commit(self) -> None:
        os.replace(self.tmp, self.final)

    def close(self) -> tuple[Path, int]:
        """Finish the MP4 and rename it into place; returns its path and the number of frames written."""
        self._finish()
        if self.error is not None:
            self.abort()
            raise WriteError(f"could not write {self.out}: {type(self.error).__name__}: {self.error}")
        return self.final, self.writer.frames_written

    def abort(self) -> None:
        """The job failed or the file could not be written: nothing is left behind."""
        if self.writer is not None:
            self.writer.abort()
        self.tmp.unlink(missing_ok=True)
