"""A live video: a long video made window by window (chunk by chunk) as long as it is directed, each direction a
prompt for the next windows.

Invariants:
- A live video with directions ``d_0 .. d_n`` (each a prompt and a number of windows) is the one-request video of
  :func:`live_request`: the request's other fields, the frames of ``sum(windows)`` whole windows
  (``ModelOptions.live_frames``), a range of its ``ModelOptions.live_prompts`` per direction, in order, and each
  direction's image (if any) as ``conditions`` at the frame its first window starts from
  (``ModelOptions.window_images``). Its
  plan's passes are the first passes of any longer live video's (the model promises it by declaring
  ``live_frames``), so the sampler goes on from the last pass made when directions arrive
  (``SampleControl.extend``): the video is the same whatever the directions' timing.
- A direction applies from the first window not yet started: directions only append windows after those directed,
  and the group asks for more only once every directed window is made.
- Pure arithmetic on requests: no torch, no model, so front ends use it to check directions before any rank sees
  them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .options import ModelOptions
from .request import Condition, GenerationRequest, resolve_frame_index

__all__ = ["MAX_WINDOWS", "WAIT", "Direction", "directed_windows", "first_windows", "live_request",
           "windows_for_frames", "windows_for_seconds"]

MAX_WINDOWS = 10_000
"""Windows of a live video at most (the window indices of a model's ``live_prompts`` stop there)."""


class _Wait:
    def __repr__(self) -> str:
        return "WAIT"

    def __reduce__(self) -> str:
        return "WAIT"  # unpickled (broadcast to the other ranks) as this module's one WAIT


WAIT = _Wait()
"""``SampleControl.extend``'s answer when nothing new is directed yet (asked again after a poll)."""


@dataclass(frozen=True)
class Direction:
    """What the next ``windows`` windows show; ``image``: the image the first of them starts from, where the model's
    windows each start from one (``ModelOptions.window_images``)."""

    prompt: str
    windows: int
    image: Condition | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError("prompt must be a non-empty string (what the next windows show)")
        if isinstance(self.windows, bool) or not isinstance(self.windows, int) or not 1 <= self.windows <= MAX_WINDOWS:
            raise ValueError(f"windows={self.windows!r} must be a whole number of windows in [1, {MAX_WINDOWS}]")
        if self.image is not None and (not isinstance(self.image, Condition) or not self.image.is_image):
            raise ValueError("image must be one frame (what the next windows start from)")

    def to_json(self) -> dict[str, Any]:
        """The prompt and windows (the image is the store's to write: ``server.group.job_record``)."""
        return {"prompt": self.prompt, "windows": self.windows}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], image: Condition | None = None) -> Direction:
        return cls(data["prompt"], int(data["windows"]), image)


def directed_windows(directions: Sequence[Direction]) -> int:
    return sum(d.windows for d in directions)


def _live_frames(options: ModelOptions) -> Any:
    if options.live_frames is None:
        raise ValueError(f"live: {options.model} makes no live video (it is not made window by window); leave live "
                         "unset")
    return options.live_frames


def live_request(request: GenerationRequest, directions: Sequence[Direction],
                 options: ModelOptions) -> GenerationRequest:
    """The one-request video a live video with these directions is (see the module docstring); ``request`` is
    resolved (its options hold every declared name)."""
    assert directions, "a live video has at least its first direction"
    count = directed_windows(directions)
    frames = _live_frames(options)({"num_frames": request.num_frames, **request.options}, count)
    segments, start = [], 0
    for d in directions:
        segments.append({"start_window": start, "end_window": start + d.windows - 1, "text": d.prompt})
        start += d.windows
    values = {**request.options, options.live_prompts: tuple(segments) if count > 1 else None}
    grown = replace(request, prompt=directions[0].prompt, num_frames=frames, options=values)
    return _with_images(grown, directions, options)


def _with_images(request: GenerationRequest, directions: Sequence[Direction],
                 options: ModelOptions) -> GenerationRequest:
    """The directions' images as ``conditions`` at the frames their first windows start from (with the request's
    own image, or conditions, before them); the request as it is where no direction has one."""
    if not any(d.image is not None for d in directions):
        return request
    if options.window_images is None:
        raise ValueError(f"image: {options.model} windows after the first start from no image of their own; direct "
                         "them with a prompt only")
    starts = options.window_images({"num_frames": request.num_frames, **request.options})
    by_frame = {} if request.image is None else {0: request.image}
    by_frame.update({resolve_frame_index(c.frame_index, request.num_frames): c for c in request.conditions})
    start = 0
    for d in directions:
        if d.image is not None:
            by_frame[starts[start]] = Condition(d.image.frames, frame_index=starts[start])
        start += d.windows
    conditions = tuple(replace(by_frame[f], frame_index=f) for f in sorted(by_frame))
    return replace(request, image=None, conditions=conditions)


def first_windows(request: GenerationRequest, options: ModelOptions) -> tuple[int, str]:
    """The fewest windows a live video of the model starts with (its ``live_frames`` refuses fewer), and why."""
    live_frames = _live_frames(options)
    values = {"num_frames": request.num_frames, **request.options}
    why = ""
    for k in range(1, MAX_WINDOWS + 1):
        try:
            live_frames(values, k)
            return k, why
        except ValueError as exc:
            why = str(exc)
    raise ValueError(f"live: {why}")


def windows_for_frames(request: GenerationRequest, options: ModelOptions) -> int:
    """How many whole windows make the request's ``num_frames``; raises naming the nearest counts when none do."""
    live_frames = _live_frames(options)
    values = {"num_frames": request.num_frames, **request.options}
    first, why = first_windows(request, options)
    if request.num_frames < live_frames(values, first):
        raise ValueError(f"num_frames={request.num_frames}: {why}")
    k = first
    while live_frames(values, k) < request.num_frames and k < MAX_WINDOWS:
        k += 1
    if live_frames(values, k) != request.num_frames:
        near = sorted({live_frames(values, max(first, k - 1)), live_frames(values, k)})
        raise ValueError(f"num_frames={request.num_frames}: a live video is whole windows; try "
                         f"{' or '.join(map(str, near))}")
    return k


def windows_for_seconds(request: GenerationRequest, options: ModelOptions, windows_now: int,
                        seconds: float) -> int:
    """How many windows after ``windows_now`` make the video at least ``seconds`` longer (at the request's fps)."""
    live_frames = _live_frames(options)
    values = {"num_frames": request.num_frames, **request.options}
    base = live_frames(values, windows_now)
    k = 1
    while (live_frames(values, windows_now + k) - base) / request.fps < seconds and windows_now + k < MAX_WINDOWS:
        k += 1
    return k
