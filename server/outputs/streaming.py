"""Streamed jobs (``POST /v1/videos`` with ``stream=true``): the MP4 leaves rank 0 while the decode is still running.

Invariants:
- One file is the truth. The leader thread encodes each decoded piece as :class:`SampleControl`'s ``on_frames``
  delivers it and appends the fragmented MP4's bytes to the job's ``.mp4.tmp`` (handed to the output store as
  ``.mp4`` when the job completes: ``JobStore.publish``); the HTTP response reads that same file through a descriptor
  of its own (:class:`VideoStream`). So the client gets exactly the bytes ``GET .../content`` serves later, and a
  slow client costs disk, not memory.
- Rank 0 never holds the whole video: the sampler runs with ``collect=False`` and a piece is encoded before the
  next one is received. The middle frame (the thumbnail) and, with ``keep_frames``, the raw frames (``.npy``,
  header first, then each piece appended in order) are written as their piece passes.
- An audio-video model's soundtrack comes whole before the first frames (:meth:`StreamedOutputs.set_audio`) or piece
  by piece as it is made (:meth:`StreamedOutputs.add_audio`, a long video's window by window), its first piece before
  the first frames; the MP4 muxes each stretch of audio with the frames it plays under.
- :meth:`StreamedOutputs.write` and :meth:`~StreamedOutputs.add_audio` never raise (they run inside the decode, where
  raising would leave rank 0 out of step with the ranks still sending their pieces): the first error is kept and fails
  the job at :meth:`commit`.
- ``VideoStream.outcome`` (the job's final status) is set once, after the last byte is in the file and the job's
  record is final: a reader that sees it set and then reads to the end has every byte, and a client that sees the
  body end finds the job completed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import BinaryIO

import numpy as np

from cp_infer.request import GenerationRequest

__all__ = ["SpoolReader", "StreamedOutputs", "VideoStream"]

log = logging.getLogger("cp_infer.streaming")

SPOOL_CHUNK = 256 * 1024


class VideoStream:
    """The HTTP side's handle on one streamed job: reads the job's MP4 as the leader writes it (thread-safe)."""

    def __init__(self, job_id: str):
        self.job_id = job_id
        self.outcome: str | None = None
        """The job's final status (``completed``, ``failed``, ``cancelled``) once no more bytes will come."""
        self.message: str | None = None
        self._lock = threading.Lock()
        self._file: BinaryIO | None = None
        self._closed = False

    def attach(self, path: Path) -> None:
        """The leader: ``path`` (the MP4 being written) exists; the reader follows it from its first byte."""
        with self._lock:
            if not self._closed:
                self._file = open(path, "rb", buffering=0)  # noqa: SIM115 -- closed by close()

    def end(self, outcome: str, message: str | None = None) -> None:
        """The leader: the job is over; call after its last byte is written and its record is final."""
        self.message = message
        self.outcome = outcome

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes that were written since the last read; ``b""`` when there are none yet."""
        with self._lock:
            return self._file.read(size) if self._file is not None else b""

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._file is not None:
                self._file.close()
                self._file = None


class StreamedOutputs:
    """A streamed job's files, written piece by piece on rank 0 (see the module docstring); each goes to a ``.tmp``
    sibling that :meth:`commit` hands to the output store and :meth:`discard` removes."""

    def __init__(self, store, job_id: str, request: GenerationRequest, *, keep_frames: bool,
                 stream: VideoStream | None, frames: int | None = None):
        """``frames``: how many the video has (unset: the request's ``num_frames``)."""
        from cp_infer.stream import FragmentedMP4Writer

        self.job_id = job_id
        self._store = store
        self.error: str | None = None
        self.frames_written = 0
        self._shape = (request.num_frames if frames is None else frames, request.height, request.width, 3)
        self._stopped = self._done = False
        self._files: list[tuple[Path, Path]] = []  # (tmp, final), published by commit
        self._mp4 = self._raw = self._writer = None
        thumb = store.path(job_id, ".jpg")
        self._thumb = (thumb.with_suffix(".jpg.tmp"), thumb)
        try:
            mp4 = store.path(job_id, ".mp4")
            self._files.append((mp4.with_suffix(".mp4.tmp"), mp4))
            self._mp4 = open(mp4.with_suffix(".mp4.tmp"), "wb")  # noqa: SIM115 -- closed by _close()
            # Opened at the first frames or the first piece of the soundtrack, so that an audio-video model's
            # soundtrack (its whole waveform or its first piece, delivered before the frames) is in it.
            self._open_writer = lambda audio, sample_rate, channels=None: FragmentedMP4Writer(
                self._emit, width=request.width, height=request.height, fps=request.fps, audio=audio,
                sample_rate=sample_rate, audio_channels=channels)
            self._audio: tuple[np.ndarray | None, int | None] = (None, None)
            self.samples_written = 0
            if keep_frames:
                raw = store.path(job_id, ".npy")
                self._files.append((raw.with_suffix(".npy.tmp"), raw))
                self._raw = open(raw.with_suffix(".npy.tmp"), "wb")  # noqa: SIM115 -- closed by _close()
                np.lib.format.write_array_header_1_0(self._raw, {"descr": np.lib.format.dtype_to_descr(
                    np.dtype(np.uint8)), "fortran_order": False, "shape": self._shape})
        except BaseException:
            self.discard()
            raise
        if stream is not None:  # None: nobody reads it as it is made (a long video, encoded as it comes)
            stream.attach(mp4.with_suffix(".mp4.tmp"))

    def _emit(self, data: bytes) -> None:
        self._mp4.write(data)
        self._mp4.flush()  # to the OS, where the response's own descriptor sees it

    def set_audio(self, waveform: np.ndarray, sample_rate: int) -> None:
        """The soundtrack of an audio-video model, before the first frames; muxed along with them."""
        self._audio = (waveform, sample_rate)

    def add_audio(self, samples: np.ndarray, first: int, sample_rate: int) -> None:
        """The soundtrack's samples ``[first, first + s)`` (``[C, s]``), piece by piece as they are made, each before
        the frames it plays under (``SampleControl.on_audio_piece``); never raises, as :meth:`write`."""
        if self.error is not None or self._stopped:
            return
        try:
            if first != self.samples_written:
                raise RuntimeError(f"got audio samples {first}.. after {self.samples_written}; expected them in order")
            if self._writer is None:
                if self.frames_written:
                    raise RuntimeError("the soundtrack's first piece came after the first frames")
                self._writer = self._open_writer(None, sample_rate, samples.shape[0])
            self._writer.write_audio(samples)
            self.samples_written += samples.shape[1]
        except Exception as exc:  # noqa: BLE001 -- kept for commit(); see the module docstring
            log.exception("job %s: encoding the stream's audio failed", self.job_id)
            self.error = f"{type(exc).__name__}: {exc}"

    def _writer_now(self):
        if self._writer is None:
            self._writer = self._open_writer(*self._audio)
        return self._writer

    def write(self, frames: np.ndarray, first: int) -> None:
        """Encode the decoded frames ``[first, first + len(frames))``; never raises (see the module docstring)."""
        if self.error is not None or self._stopped:
            return
        try:
            if first != self.frames_written or frames.shape[1:] != self._shape[1:]:
                raise RuntimeError(f"got frames {first}.. of shape {frames.shape} after {self.frames_written} "
                                   f"frames; expected the next ones in order, of shape [F, *{self._shape[1:]}]")
            frames = np.ascontiguousarray(frames, dtype=np.uint8)
            self._writer_now().write(frames)
            if self._raw is not None:
                self._raw.write(frames.data)
            middle = self._shape[0] // 2
            if first <= middle < first + len(frames):
                from PIL import Image

                Image.fromarray(frames[middle - first]).save(self._thumb[0], format="JPEG", quality=90,
                                                             subsampling=0)
                if self._thumb not in self._files:  # a live video's middle moves on as it grows
                    self._files.append(self._thumb)
            self.frames_written += len(frames)
        except Exception as exc:  # noqa: BLE001 -- kept for commit(); see the module docstring
            log.exception("job %s: encoding the stream failed", self.job_id)
            self.error = f"{type(exc).__name__}: {exc}"

    def set_frames(self, frames: int) -> None:
        """How many frames the video has, now that it is longer (a live video's, as it is directed)."""
        assert self._raw is None, "a raw frames file's header holds its length"
        self._shape = (frames, *self._shape[1:])

    def stop(self) -> None:
        """Encode nothing more (the job will end cancelled: nobody wants the rest)."""
        self._stopped = True

    def commit(self, *, attempt: int = 0) -> None:
        """Finish the MP4 and hand every file to the output store as ``attempt``'s (``JobStore.publish``); raises
        if anything failed or frames are missing."""
        if self.error is not None:
            raise RuntimeError(self.error)
        self._writer_now().close()
        if self.frames_written != self._shape[0]:
            raise RuntimeError(f"the decode delivered {self.frames_written} frames, expected {self._shape[0]}")
        self._close()
        self._store.publish(self.job_id, [(tmp, "." + final.name.split(".", 1)[1]) for tmp, final in self._files],
                            attempt=attempt)
        self._done = True

    def discard(self) -> None:
        """Remove whatever was written (a no-op after :meth:`commit`)."""
        if self._done:
            return
        self._done = True
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        with contextlib.suppress(OSError):
            self._close()
        for tmp, _ in (*self._files, self._thumb):
            tmp.unlink(missing_ok=True)

    def _close(self) -> None:
        for f in (self._mp4, self._raw):
            if f is not None:
                f.close()


class SpoolReader:
    """A job's MP4 as one more reader follows it (a WebSocket, ``GET .../content?stream=true``): from the spool file
    while it is made on this server (a descriptor of its own, so the file's rename into place or removal does not cut
    it short), else, once the job is completed, from the output store; the bytes together are the stored file."""

    def __init__(self, store, job_id: str):
        self.store, self.job_id = store, job_id
        self.spool = store.path(job_id, ".mp4.tmp")
        self.file: BinaryIO | None = None
        self.sent = 0

    def follow(self) -> tuple[bool, bytes]:
        """``(reset, bytes)``: what was written since the last call (blocking: run in a thread)."""
        reset = False
        if self.file is not None:
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.spool).st_ino != os.fstat(self.file.fileno()).st_ino:  # made again: a new file
                    self.close()
                    reset, self.sent = True, 0
        if self.file is None and (self.sent == 0 or reset):
            try:
                self.file = open(self.spool, "rb", buffering=0)  # noqa: SIM115 -- closed by close()
            except FileNotFoundError:
                return reset, b""
        data = self.file.read(SPOOL_CHUNK) if self.file is not None else b""
        self.sent += len(data)
        return reset, data

    def stored(self, job) -> list[bytes]:
        """A completed video's bytes past those sent, from the output store (blocking)."""
        size = self.store.output_size(job, ".mp4")
        if size is None or size <= self.sent:
            return []
        chunks = list(self.store.read_output(job, ".mp4", self.sent, size))
        self.sent = size
        return chunks

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
