"""The playground: one page at ``GET /`` (``server/http/playground/``: plain HTML, CSS and JS, no build step,
nothing from another origin) that drives the ``/v1/videos`` API from a browser, the site's icon
(``GET /favicon.ico``), and ``GET /playground/options``, the served model's declared options with this deployment's
ranges, which the page builds its form from.

Invariants:
- The page's files (:data:`PAGES`) are public: a browser's navigation cannot send a bearer token, and they hold
  nothing of the server's. :class:`PageFiles` serves them in front of the API key guard, and only them (exact
  paths, GET/HEAD); every request the page makes goes through the guard like any other client's. The page asks for
  the key when the API answers 401 and sends it only to relative, same-origin URLs; no CORS opening is added.
- A Content-Security-Policy of ``'self'`` (plus the page's own ``blob:`` media) is sent with every page file, so
  the page can load and reach nothing but this server.
- ``/playground/options`` is derived from the model's option declaration and the deployment's limits, as the
  OpenAPI document is; the page holds no list of options of its own.
- A default may follow the values before it (``height`` lowered under ``stages=2``): ``POST /playground/defaults``
  resolves the defaults given what the user changed, with the API's own resolution, and the page shows them in the
  fields the user left alone. A field it leaves unsent is then resolved by the API to the value it shows.
"""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import FileResponse

from cp_infer.options import UnknownOption
from cp_infer.request import LORA_SCALE, MAX_LORAS
from server.http.config import ConfigDep
from server.http.engine import EngineDep
from server.http.schemas import ApiError, error_responses

__all__ = ["PAGES", "PageFiles", "router"]

_DIR = Path(__file__).resolve().parent / "playground"
PAGES: dict[str, tuple[str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground/playground.css": ("playground.css", "text/css; charset=utf-8"),
    "/favicon.ico": ("favicon.ico", "image/x-icon"),  # where browsers look for a site's icon
}
"""URL path -> (file in ``server/http/playground/``, media type)."""

_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; media-src 'self' blob:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
}
_KINDS = {int: "integer", float: "number", str: "string", bool: "boolean", tuple: "integers", list: "objects"}


class PageFiles:
    """ASGI middleware: answers GET/HEAD of the playground's files (:data:`PAGES`), passes everything else on."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        page = PAGES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if page is None or scope["method"] not in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        name, media_type = page
        await FileResponse(_DIR / name, media_type=media_type, headers=_HEADERS)(scope, receive, send)


router = APIRouter(prefix="/playground", tags=["playground"])


@router.get("/options")
async def playground_options(engine: EngineDep) -> dict:
    """The served model's options (name, type, default, inclusive range under this deployment's limits, help), the
    adapters a request may name (``loras``: their names, how many at once, the scale's range), what the page needs
    to show a length: the frame geometry (``null`` until the model is loaded), whether it makes live videos
    (``live``), and the group's ``layout``
    (replicas, and each replica's guidance x ring x Ulysses degrees; ``null`` until the group has formed).

    Each default is what a request that leaves the option out gets here (lowered to this deployment's limits), so
    the page's form starts inside its own ranges and sends only what the user changed. An option of a feature
    (``Option.when``) has no maximum here: the limit applies only while the feature is on, which the API checks."""
    limits = engine.limits
    try:
        defaults = engine.options.resolve({}, limits=limits, geometry=engine.geometry)
    except ValueError:  # a limit below anything the model takes: every request is refused, naming it
        defaults = {option.name: option.default for option in engine.options}
    options = []
    for option in engine.options:
        shown = None if option.when else limits
        lo, hi = option.bounds(shown)
        default = defaults[option.name]
        default = list(default) if isinstance(default, tuple) else default
        kind = "numbers" if option.kind is tuple and option.item is float else _KINDS[option.kind]
        note = option.limit_note(limits)
        options.append({"name": option.name, "type": kind, "default": default, "minimum": lo,
                        "maximum": hi, "multiple_of": option.multiple_of, "nullable": option.nullable,
                        "help": option.help, "accepts": option.describe(shown) + (f" ({note})" if note else "")})
    geometry = engine.geometry
    replicas = engine.replica_status()
    layout = replicas[0].get("layout") if replicas else None
    return {
        "model": engine.served_model,
        "layout": None if layout is None else {"replicas": len(replicas), **layout},
        "options": options,
        "max_prompt_chars": limits.max_prompt_chars,
        "loras": {"adapters": [a["name"] for a in engine.adapters()], "max": MAX_LORAS, "scale": list(LORA_SCALE)},
        "temporal_compression": geometry.temporal_compression if geometry else None,
        "window_tile_causal": engine.options.window_tile_causal,
        "live": engine.options.live_frames is not None,
        "window_images": engine.options.window_images is not None,
        "spatial_step": geometry.spatial_step if geometry else None,
    }


_VALUES = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "description": "option values by name (as POST /v1/videos takes them)"}}}}}


@router.post("/defaults", responses=error_responses(400, 413, 415), openapi_extra=_VALUES)
async def playground_defaults(request: Request, engine: EngineDep, config: ConfigDep) -> dict:
    """Every option's value for a request that gives the options in the JSON body and leaves the rest out: the
    given ones as the API takes them, the others' defaults as the API fills them in under this deployment's limits
    (a default may follow a value given: ``height`` and ``width`` under ``stages=2``). A value the API would refuse
    is this route's 400 naming it, with the API's words."""
    ctype = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if not (ctype in ("application/json", "text/json") or ctype.endswith("+json")):
        raise ApiError(415, "unsupported_media_type", f"Content-Type {ctype!r} is not accepted; send application/json")
    body, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body_bytes:
            raise ApiError(413, "request_too_large", f"the body is over the limit of {config.max_body_bytes} bytes")
        body.append(chunk)
    try:
        given = json.loads(b"".join(body).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        given = None
    if not isinstance(given, dict):
        raise ApiError(400, "invalid_json", "the body must be a JSON object of option values")
    try:
        values = engine.options.resolve(given, limits=engine.limits, geometry=engine.geometry)
    except UnknownOption as exc:
        raise ApiError(400, "unknown_parameter", str(exc), exc.name) from None
    except ValueError as exc:
        param = max((name for name in engine.options.names if str(exc).startswith(name)), key=len, default=None)
        raise ApiError(400, "invalid_value", str(exc), param) from None
    return {"defaults": {name: list(v) if isinstance(v, tuple) else v for name, v in values.items()}}
