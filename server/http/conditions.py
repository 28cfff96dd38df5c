"""A request's media (uploads, data URLs, completed jobs' videos) turned into validated conditions on rank 0.

Invariants:
- Only pixels that :mod:`server.http.media` decoded and checked leave this module: a client's bytes never reach a rank.
- Every failure is an :class:`ApiError` naming the field (``input_reference``, ``conditions[1].media``, ``video``)
  and the fix; nothing is fetched from the network.
- Clips are decoded up to the server's frame limit; whether one fits the requested video (frame index, length) is
  ``check_request``'s to say, once the request's frame count is known.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from cp_infer.request import Condition, GenerationLimits
from server.group.jobs import Job, JobStore, valid_job_id
from server.group.tenants import Tenant
from server.http.media import MediaError, MediaLimits, decode_media, media_from_url
from server.http.schemas import ApiError, ConditionParams, ImageReference, MediaRef, VideoCreateParams

__all__ = ["UPLOAD_PREFIX", "Resolved", "completed_job", "job_frames", "load_media", "media_api_error", "media_limits",
           "resolve_media"]

UPLOAD_PREFIX = "upload:"
"""How a multipart file field is referred to from the parsed parameters (``upload:conditions[0][media]``)."""


@dataclass(frozen=True)
class Resolved:
    image: Condition | None = None
    conditions: tuple[Condition, ...] = ()


def media_limits(max_upload_bytes: int, limits: GenerationLimits) -> MediaLimits:
    return MediaLimits(max_bytes=max_upload_bytes, max_frames=limits.max_frames)


def media_api_error(exc: MediaError) -> ApiError:
    """Bad media as the API answers it: its status and code, naming its field."""
    return ApiError(exc.status, exc.code, str(exc), exc.field)


def completed_job(store: JobStore, job_id: str, *, field: str, viewer: Tenant) -> Job:
    """The completed job ``job_id`` names: 404 when there is none or it is not ``viewer``'s to see, 409 when it has
    not completed (naming ``field``)."""
    job = store.get(job_id) if valid_job_id(job_id) else None
    if job is None or not viewer.sees(job.tenant):
        raise ApiError(404, "video_not_found", f"{field}: no video with id {job_id!r}", field)
    if job.status != "completed":
        raise ApiError(409, "video_not_ready", f"{field}: video {job_id} is {job.status}; use a completed video",
                       field)
    return job


def job_frames(store: JobStore, job: Job, *, field: str, limits: MediaLimits) -> np.ndarray:
    """The frames of a completed job (its lossless frames when kept, else its MP4 decoded)."""
    job_id = job.id
    raw = store.output_bytes(job, ".npy")
    if raw is not None:
        return np.load(io.BytesIO(raw), allow_pickle=False)
    mp4 = store.output_bytes(job, ".mp4")
    if mp4 is None:
        raise ApiError(404, "content_not_found", f"{field}: the video of {job_id} is missing on the server", field)
    try:
        return decode_media(mp4, field=field, limits=MediaLimits(
            max_bytes=max(limits.max_bytes, len(mp4)), max_pixels=limits.max_pixels,
            max_frames=limits.max_frames)).frames
    except MediaError as exc:
        raise media_api_error(exc) from None


def load_media(ref: str | MediaRef | ImageReference, *, field: str, uploads: Mapping[str, bytes],
               store: JobStore, limits: MediaLimits, viewer: Tenant) -> np.ndarray:
    """uint8 ``[F, H, W, 3]`` of one media reference (a job's video: one ``viewer`` sees)."""
    if isinstance(ref, MediaRef):
        return job_frames(store, completed_job(store, ref.id, field=field, viewer=viewer), field=field, limits=limits)
    try:
        if isinstance(ref, ImageReference):
            return media_from_url(ref.image_url, field=f"{field}.image_url", limits=limits).frames
        if ref.startswith(UPLOAD_PREFIX):
            key = ref[len(UPLOAD_PREFIX):]
            if key not in uploads:
                raise ApiError(400, "invalid_value", f"{field}: no file was uploaded as {key!r}", field)
            return decode_media(uploads[key], field=field, limits=limits).frames
        return media_from_url(ref, field=field, limits=limits).frames
    except MediaError as exc:
        raise media_api_error(exc) from None


def _condition(item: ConditionParams, i: int, **kw) -> Condition:
    frames = load_media(item.media, field=f"conditions[{i}].media", **kw)
    return Condition(frames, frame_index=item.frame_index, strength=item.strength)


def resolve_media(params: VideoCreateParams, *, uploads: Mapping[str, bytes], store: JobStore,
                  limits: MediaLimits, viewer: Tenant) -> Resolved:
    """Decode the media that ``params`` names (blocking: run it off the event loop); a job's video named as media
    must be ``viewer``'s to see."""
    kw = dict(uploads=uploads, store=store, limits=limits, viewer=viewer)
    if params.input_reference is not None and params.conditions:
        raise ApiError(400, "conflicting_parameters", "give input_reference or conditions, not both (the reference "
                       "image is conditions[0] at frame_index 0)", "input_reference")
    if params.input_reference is not None:
        frames = load_media(params.input_reference, field="input_reference", **kw)
        if frames.shape[0] == 1:
            return Resolved(image=Condition(frames))
        return Resolved(conditions=(Condition(frames),))  # a clip as reference: it conditions from frame 0
    return Resolved(conditions=tuple(_condition(item, i, **kw) for i, item in enumerate(params.conditions or ())))
