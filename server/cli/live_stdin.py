"""``cp-infer generate --live``: a live video's directions from standard input, one a line, read on rank 0.

Invariants:
- A line ``K | text`` directs ``K`` more windows (chunks) with that prompt, a line ``text`` one; either may end
  with ``| image: PATH``, the image the first of them starts from (where the model's windows each start from one,
  ``ModelOptions.window_images``), read and decoded here; blank lines are ignored; ``end`` or the end of the input
  ends the video after what is directed. A line that does not parse, or whose video the request's checks refuse
  (over ``--max-frames``), is reported on stderr and ignored.
- The video is ``cp_infer.live.live_request`` of the directions, as the server's live videos: the one-request video
  with the same ``prompt_segments``, whatever the lines' timing.
- The sampler asks (``SampleControl.extend``) only once every directed window is made; after ``idle_s`` without a
  new line it ends there.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from cp_infer.live import WAIT, Direction, directed_windows, live_request
from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest
from server.cli.media_args import MediaRef, attach_media

__all__ = ["StdinDirections", "parse_direction"]

_END = object()
_IMAGE = "image:"


def parse_direction(line: str) -> Direction | None:
    """One line as a direction; ``None`` for a blank line. Raises ``ValueError`` naming the fix (not the line: the
    caller reports which)."""
    text = line.strip()
    if not text:
        return None
    rest, sep, last = text.rpartition("|")
    if sep and last.strip().startswith(_IMAGE):
        path = last.strip()[len(_IMAGE):].strip()
        if not path:
            raise ValueError("write 'K | prompt | image: PATH' with the image's file")
        ref = MediaRef("image", Path(path).expanduser(), kind="image")
        direction = parse_direction(rest)
        if direction is None:
            raise ValueError("an image directs windows with a prompt: 'K | prompt | image: PATH'")
        return replace(direction, image=attach_media(GenerationRequest("", num_frames=1), image=ref).image)
    count, sep, prompt = text.partition("|")
    if sep and count.strip().isdigit():
        return Direction(prompt.strip(), int(count))
    if sep and not count.strip().isdigit():
        raise ValueError("write 'K | prompt' with K a whole number of windows, or the prompt alone")
    return Direction(text, 1)


class StdinDirections:
    """``extend`` for ``generate --live`` (see the module docstring); ``check`` resolves and checks a request (the
    CLI's, raising ``ValueError``)."""

    def __init__(self, request: GenerationRequest, directions: list[Direction], *, options: ModelOptions,
                 check: Callable[[GenerationRequest], GenerationRequest], idle_s: float, lines: IO[str] | None = None):
        self.base, self.directions, self.options, self.check, self.idle_s = request, directions, options, check, idle_s
        self._lines: queue.Queue[Any] = queue.Queue()
        self._directed = directed_windows(directions)
        self._ended = False
        self._idle_since: float | None = None
        threading.Thread(target=self._read, args=(lines or sys.stdin,), name="cp-infer-directions",
                         daemon=True).start()

    def _read(self, lines: IO[str]) -> None:
        for line in lines:
            if line.strip() == "end":
                break
            self._lines.put(line)
        self._lines.put(_END)

    def _take(self, timeout: float) -> None:
        """Fold the lines read within ``timeout`` s into the directions."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return
            if line is _END:
                self._ended = True
                return
            try:
                direction = parse_direction(line)
                if direction is None:
                    continue
                self.check(live_request(self.base, [*self.directions, direction], self.options))
            except ValueError as exc:
                print(f"cp-infer generate --live: ignored {line.strip()!r}: {exc}", file=sys.stderr, flush=True)
                continue
            self.directions.append(direction)
            last = directed_windows(self.directions) - 1
            print(f"cp-infer generate --live: windows {last - direction.windows + 1}..{last}: {direction.prompt!r}",
                  file=sys.stderr, flush=True)
            if self._lines.empty():
                return

    def extend(self, _passes_done: int, request: GenerationRequest) -> Any:
        self._take(0.25)
        if directed_windows(self.directions) > self._directed:
            self._directed = directed_windows(self.directions)
            self._idle_since = None
            return live_request(request, self.directions, self.options)
        if self._ended:
            return None
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        return None if now - self._idle_since >= self.idle_s else WAIT
