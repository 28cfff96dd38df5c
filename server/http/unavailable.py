"""The front end of a server whose model cannot be had (``cp-infer serve`` when ``server.cli.common.fetch_model``
fails: a missing or gated hub id, one not cached while offline, a missing local path): no worker group starts, and
every request but ``/health`` is answered ``503 model_unavailable`` with the one line that says why and the fix, so
an operator (or a load balancer polling ``/ready``) sees the reason where it looks instead of a process that exited.

Invariants:
- Nothing of the model is loaded and no job is taken: the data directory is not touched.
- ``/health`` is 200 (the process lives, as for any server); ``/ready`` and every other path and method are 503 with
  ``{"error": {"code": "model_unavailable", "message", "param": null, "type"}}`` (``ready``'s body also has
  ``status: "not_ready"`` and the reason), without ``Retry-After``: the model will not appear without the operator.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from server.http.health import health
from server.http.schemas import ApiError

__all__ = ["create_unavailable_app"]

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def create_unavailable_app(reason: str) -> FastAPI:
    """The app answering ``503 model_unavailable`` with ``reason`` (the model error's one line)."""
    app = FastAPI(title="cp-infer (model unavailable)", openapi_url=None, docs_url=None, redoc_url=None)
    body = ApiError(503, "model_unavailable", reason).body()

    app.get("/health")(health)  # the server's own: the process lives
    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({**body, "status": "not_ready", "reason": reason, "world_size": None,
                             "heartbeat_rtt_ms": None, "replicas": [], "memory": []}, status_code=503)

    @app.api_route("/{path:path}", methods=_METHODS)
    async def unavailable(request: Request, path: str) -> JSONResponse:
        return JSONResponse(body, status_code=503)

    return app
