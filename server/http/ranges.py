"""A file served from a remote output store in pieces, with HTTP ``Range`` honoured (RFC 9110 section 14).

Invariants:
- One range (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) answers 206 with ``Content-Range``; a range past the end
  answers 416 with ``Content-Range: bytes */size``; a header this does not serve (several ranges, another unit, bad
  syntax) is ignored and the whole file answers 200, as the RFC allows. Bytes are read from the store only as the
  client takes them (a sync iterator, which Starlette runs in its thread pool).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from urllib.parse import quote

from fastapi.responses import Response, StreamingResponse

__all__ = ["parse_range", "ranged_response"]

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")


def parse_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """``[start, end)`` of a single satisfiable range; ``None`` to serve the whole file; ``"unsatisfiable"``."""
    match = _RANGE_RE.match((header or "").replace(" ", ""))
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":  # the last n bytes
        n = int(last)
        return (max(0, size - n), size) if n > 0 and size > 0 else "unsatisfiable"
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if last != "" and int(last) < start:
        return None  # invalid: ignored
    return (start, end) if start < size else "unsatisfiable"


def ranged_response(read: Callable[[int, int], Iterator[bytes]], size: int, header: str | None, *,
                    media_type: str, filename: str) -> Response:
    """``read(start, end)`` yields the bytes ``[start, end)`` of a file of ``size`` bytes."""
    headers = {"Accept-Ranges": "bytes", "Content-Disposition": f"attachment; filename*=utf-8''{quote(filename)}"}
    span = parse_range(header, size)
    if span == "unsatisfiable":
        return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"})
    if span is None:
        return StreamingResponse(read(0, size), media_type=media_type,
                                 headers={**headers, "Content-Length": str(size)})
    start, end = span
    return StreamingResponse(read(start, end), status_code=206, media_type=media_type,
                             headers={**headers, "Content-Length": str(end - start),
                                      "Content-Range": f"bytes {start}-{end - 1}/{size}"})
