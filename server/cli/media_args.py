"""Conditioning media named on the command line or in a prompts file (``--image``, ``--video``, ``--condition``;
``image`` / ``video`` / ``conditions`` keys): read and decoded here, on the front end, with
:func:`server.http.media.decode_media` (at most the request's frames), before any group forms; an error names the
flag or key and the file (:func:`media_error`)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from cp_infer.options import ModelOptions
from cp_infer.request import Condition, GenerationRequest
from server.cli.common import UsageError, field_error

__all__ = ["MediaRef", "attach_media", "media_error"]


@dataclass(frozen=True)
class MediaRef:
    """A conditioning file named by a flag or a prompts file's key, not read yet."""

    label: str
    """What the user wrote, for messages: ``--condition clip.mp4@8``, ``line's conditions[1] (clip.mp4@8)``."""
    path: Path
    """Where it is read from (a prompts file's relative paths already resolved)."""
    kind: str | None = None
    """``"image"`` or ``"video"`` when the flag or key takes that kind only."""
    frame_index: int = 0
    strength: float = 1.0


def _read_media(ref: MediaRef, *, max_frames: int | None) -> Condition:
    from server.http.media import MediaError, MediaLimits, decode_media

    limits = MediaLimits()
    try:
        with ref.path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_bytes:  # refused before it is read
                raise UsageError(f"{ref.label}: {str(ref.path)!r} is {size} bytes, over the limit of "
                                 f"{limits.max_bytes}; use a smaller or shorter file")
            data = f.read()
    except OSError as exc:
        raise UsageError(f"{ref.label}: cannot read {str(ref.path)!r}: {exc.strerror or exc}") from exc
    try:
        media = decode_media(data, field=ref.label, limits=limits, max_frames=max_frames)
    except MediaError as exc:
        raise UsageError(str(exc)) from exc
    if ref.kind == "image" and media.kind != "image":
        raise UsageError(f"{ref.label}: is a video ({media.num_frames} frames), not an image; give a clip as the "
                         "video (video-to-video) or as a condition at a frame")
    if ref.kind == "video" and media.kind != "video":
        raise UsageError(f"{ref.label}: is an image, not a video; give it as the image to start from, or as a "
                         "condition at frame 0")
    return Condition(media.frames, frame_index=ref.frame_index, strength=ref.strength)


def attach_media(request: GenerationRequest, *, image: MediaRef | None = None,
                 conditions: Sequence[MediaRef] = ()) -> GenerationRequest:
    """``request`` with its media read and decoded (a clip: at most the request's frames); ``UsageError`` naming the
    flag or key for a file that cannot be read or is not good media."""
    frames = request.num_frames
    max_frames = frames if isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1 else None
    return replace(request, image=None if image is None else _read_media(image, max_frames=max_frames),
                   conditions=tuple(_read_media(ref, max_frames=max_frames) for ref in conditions))


_MEDIA_FIELD = re.compile(r"(image|conditions)(?:\[(\d+)\])?(\.|:\s*|(?=\s))")


def media_error(exc: ValueError, *, image: MediaRef | None = None, conditions: Sequence[MediaRef] = (),
                conditions_label: str = "conditions", options: ModelOptions | None = None,
                argv: Sequence[str] = ()) -> UsageError:
    """A ``check_request`` error about ``image`` or ``conditions[i]`` told with the flag or key (and file) the user
    gave (``conditions_label`` for the list as a whole); any other error as :func:`field_error`."""
    message = str(exc)
    match = _MEDIA_FIELD.match(message)
    if match is None:
        return field_error(exc, options, argv)
    name, index, sep = match.groups()
    if name == "image":
        label = image.label if image is not None else "image"
    elif index is not None and int(index) < len(conditions):
        label = conditions[int(index)].label
    else:
        label = conditions_label
    # "conditions[1].frame_index=..." -> "<label>: frame_index=..."; a sentence ("image and ...") is kept whole.
    rest = message[match.end():] if sep.strip() else message
    return UsageError(f"{label}: {rest}")
