"""A job's record: the :class:`Job` the store hands out, and how a request is kept in a row (its fields as JSON,
conditioning media as compressed arrays: the validated pixels).

Invariants:
- Job ids (``video_`` + 32 hex digits, made by ``server.group.jobs``) are the only names of output files, so a path
  never contains client text; :func:`valid_job_id` gates every id that arrives in a URL.
- A row written by an earlier release reads back (options kept as fields then become options).
"""

from __future__ import annotations

import base64
import io
import json
import re
import struct
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from cp_infer.live import Direction, directed_windows
from cp_infer.request import Condition, GenerationRequest, loras_from

__all__ = ["Job", "Live", "TERMINAL", "valid_job_id", "mp4_complete", "request_to_json", "request_from_json",
           "row_to_job"]

TERMINAL = ("completed", "failed", "cancelled")
_ID_RE = re.compile(r"^video_[0-9a-f]{32}$")


def valid_job_id(job_id: str) -> bool:
    return bool(_ID_RE.match(job_id))


def mp4_complete(path: Path) -> bool:
    """Whether ``path`` is a whole MP4: its top-level boxes tile the file exactly, starting with ``ftyp`` and
    holding ``moov`` and ``mdat``, and a fragmented one ends with its ``mfra`` (its muxer's last box); a file cut
    anywhere fails (reads the box headers only)."""
    try:
        size = path.stat().st_size
        kinds = []
        with open(path, "rb") as f:
            pos = 0
            while pos < size:
                f.seek(pos)
                header = f.read(16)
                if len(header) < 8:
                    return False
                length, kind = struct.unpack(">I4s", header[:8])
                if length == 1:  # a 64-bit size follows the type
                    if len(header) < 16:
                        return False
                    length = struct.unpack(">Q", header[8:16])[0]
                elif length == 0:  # the box runs to the end of the file
                    length = size - pos
                if length < 8:
                    return False
                kinds.append(kind)
                pos += length
    except OSError:
        return False
    if pos != size or not kinds or kinds[0] != b"ftyp" or not {b"moov", b"mdat"} <= set(kinds):
        return False
    return b"moof" not in kinds or kinds[-1] == b"mfra"


@dataclass(frozen=True)
class Live:
    """A live video's directions (``cp_infer.live``) as received, in order: the first is the request's own prompt and
    windows; ``ended``: no more will come (the video ends once they are made)."""

    directions: tuple[Direction, ...]
    ended: bool = False

    def to_json(self) -> str:
        """The directions as stored, byte for byte the same for the same directions (``JobStore.direct`` writes over
        the text it read); an image as its pixels, compressed."""
        return json.dumps({"directions": [{**d.to_json(), **({} if d.image is None else {"image": _pixels_to_json(
            d.image.frames)})} for d in self.directions], "ended": self.ended})

    @classmethod
    def from_json(cls, text: str | None) -> Live | None:
        if text is None:
            return None
        data = json.loads(text)
        return cls(tuple(Direction.from_json(d, None if d.get("image") is None else Condition(
            _pixels_from_json(d["image"]))) for d in data["directions"]), bool(data["ended"]))

    def public(self, job: Job) -> dict[str, Any]:
        """The directions with their windows and where each stands: ``made``, ``in_progress`` or ``queued``."""
        directed = directed_windows(self.directions)
        if job.status == "completed":
            made = directed
        elif job.window is None:
            made = 0
        else:
            made = min(job.window, directed)  # window == windows: all made, waiting for more
        current = job.window if job.status == "in_progress" and job.window is not None and made < directed else None
        items, start = [], 0
        for d in self.directions:
            end = start + d.windows - 1
            state = "made" if end < made else "in_progress" if current is not None and start <= current else "queued"
            items.append({"prompt": d.prompt, "windows": d.windows, "start_window": start, "end_window": end,
                          "state": state, "image": d.image is not None})
            start = end + 1
        return {"directions": items, "ended": self.ended, "windows_directed": directed, "windows_made": made,
                "waiting": job.status == "in_progress" and job.window is not None and made == directed}


@dataclass(frozen=True)
class Job:
    seq: int
    id: str
    status: str
    progress: int
    created_at: int
    completed_at: int | None
    model: str
    request: GenerationRequest
    error_code: str | None = None
    error_message: str | None = None
    deleting: bool = False
    window: int | None = None
    """A long video's window being made (from 0), ``None`` before the first or for one made at once."""
    windows: int | None = None
    attempts: int = 0
    lead_frames: int = 0
    """Frames the video starts with before the ones made (an extension's: the video it extends)."""
    steps_computed: int | None = None
    """A request with a step cache (``cache``): the steps so far that ran every transformer block; ``None``: none."""
    steps_skipped: int | None = None
    """A request with a step cache: the steps so far that used it (``cp_infer.step_cache.CacheStats``)."""
    output_attempt: int | None = None
    """A completed job: the attempt whose files are its outputs (the one that completed it)."""
    tenant: str = ""
    """The tenant that owns it (``server.group.tenants``); ``''``: made while the server was open."""
    live: Live | None = None
    """A live video's directions; ``None`` for any other job."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    def public(self) -> dict[str, Any]:
        """The API's job object (see ``schemas.VideoJob``)."""
        r = self.request
        frames = r.num_frames if not self.lead_frames else self.lead_frames + r.num_frames - 1
        error = None if self.error_code is None else {"code": self.error_code, "message": self.error_message or ""}
        return {
            "id": self.id, "object": "video", "status": self.status, "progress": self.progress,
            "created_at": self.created_at, "completed_at": self.completed_at, "model": self.model,
            "seconds": f"{frames / r.fps:.3g}", "size": f"{r.width}x{r.height}", "prompt": r.prompt,
            "error": error, "window": self.window, "windows": self.windows,
            "steps_computed": self.steps_computed, "steps_skipped": self.steps_skipped,
            "negative_prompt": r.negative_prompt, "num_frames": r.num_frames, "width": r.width,
            "height": r.height, "fps": r.fps, "num_inference_steps": r.num_inference_steps,
            "guidance_scale": r.guidance_scale, "seed": r.seed,
            # The model's own options, as resolved (every one it declares).
            **{name: list(v) if isinstance(v, tuple) else v for name, v in r.options.items()},
            "input_reference": r.image is not None, "extends": r.extends is not None,
            "conditions": [{"frame_index": c.frame_index, "strength": c.strength,
                            "num_frames": int(c.frames.shape[0])} for c in r.conditions] or None,
            "loras": [{"name": lora.name, "scale": lora.scale} for lora in r.loras],
            "tenant": self.tenant or None,
            "live": None if self.live is None else self.live.public(self),
        }


def _condition_to_json(cond: Condition) -> dict[str, Any]:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, frames=cond.frames)
    return {"frames_npz": base64.b64encode(buffer.getvalue()).decode("ascii"), "frame_index": cond.frame_index,
            "strength": cond.strength}


def _condition_from_json(data: dict[str, Any]) -> Condition:
    with np.load(io.BytesIO(base64.b64decode(data["frames_npz"])), allow_pickle=False) as archive:
        frames = archive["frames"]
    return Condition(frames, frame_index=data["frame_index"], strength=data["strength"])


def _pixels_to_json(frames: np.ndarray) -> dict[str, Any]:
    """uint8 pixels as their shape and zlib-compressed bytes: the same text for the same pixels (an npz archive holds
    the time it was written)."""
    return {"shape": list(frames.shape), "zlib": base64.b64encode(zlib.compress(frames.tobytes(), 6)).decode("ascii")}


def _pixels_from_json(data: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(data["zlib"])), dtype=np.uint8).reshape(data["shape"]).copy()


def request_to_json(request: GenerationRequest) -> str:
    """The request as stored: its fields, conditioning media as compressed arrays (the validated pixels)."""
    data = {f.name: getattr(request, f.name) for f in fields(request)}
    data["image"] = None if request.image is None else _condition_to_json(request.image)
    data["conditions"] = [_condition_to_json(c) for c in request.conditions]
    data["extends"] = None if request.extends is None else _condition_to_json(request.extends)
    data["loras"] = [{"name": lora.name, "scale": lora.scale} for lora in request.loras]
    return json.dumps(data)


_REQUEST_FIELDS = frozenset(f.name for f in fields(GenerationRequest))


def request_from_json(text: str) -> GenerationRequest:
    data = json.loads(text)
    options = data.get("options") or {}
    # Rows written before models declared their options hold them as fields: the set ones become options.
    options.update({k: data.pop(k) for k in list(data) if k not in _REQUEST_FIELDS and data[k] is not None})
    data = {k: v for k, v in data.items() if k in _REQUEST_FIELDS}
    # JSON has only lists; a request holds tuples.
    data["options"] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    if data.get("image") is not None:
        data["image"] = _condition_from_json(data["image"])
    data["conditions"] = tuple(_condition_from_json(c) for c in data.get("conditions") or ())
    if data.get("extends") is not None:
        data["extends"] = _condition_from_json(data["extends"])
    data["loras"] = loras_from(data.get("loras"))
    return GenerationRequest(**data)


def row_to_job(row: Any) -> Job:
    return Job(
        seq=row["seq"], id=row["id"], status=row["status"], progress=row["progress"], created_at=row["created_at"],
        completed_at=row["completed_at"], model=row["model"], request=request_from_json(row["request"]),
        error_code=row["error_code"], error_message=row["error_message"], deleting=bool(row["deleting"]),
        window=row["window"], windows=row["windows"], attempts=row["attempts"], lead_frames=row["lead_frames"],
        steps_computed=row["steps_computed"], steps_skipped=row["steps_skipped"], output_attempt=row["output_attempt"],
        tenant=row["tenant"],
        live=Live.from_json(row["live"]),
    )
