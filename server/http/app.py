"""The HTTP front end (rank 0): ``create_app(config, engine)`` builds the FastAPI app around an engine (a group
leader).

Invariants:
- The app never touches the process group: it reads and writes the engine's job store, and the engine's
  leader thread alone talks to the other ranks. ``lifespan`` starts and stops that thread.
- The routers (``server.http.health``, ``server.http.videos``, ``server.http.usage``, ``server.http.models``,
  ``server.http.playground``) are declared at module level; a route reaches the engine (``app.state.engine``, a
  :class:`server.http.engine.Engine`), this config (``app.state.config``) and the request's tenant through the
  dependencies :func:`server.http.engine.get_engine`, :func:`server.http.config.get_app_config` and
  :func:`server.http.auth.get_tenant`.
- One ASGI middleware in front of every route (FastAPI's own docs routes included), ``server.http.auth``'s guard,
  authenticates the request (``--api-key`` or the job store's keys; none of either: open) and takes its tenant's
  request token; bodies over the cap are refused with 413, from their Content-Length before they are read, and
  while streaming otherwise.
- A store that cannot be reached (``StoreUnavailable``: the job store's database, the output store) answers 503
  ``store_unavailable`` naming it, with ``Retry-After``.
- Every error is a 4xx/5xx JSON ``{"error": {"code", "message", "param"}}``; nothing fails with 200. A request
  that fails FastAPI's own validation is answered 400 as well, and the OpenAPI document says so
  (``server.http.openapi``).
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from server.http import health, live, live_socket, models, playground, usage, videos
from server.http.auth import GuardMiddleware, error_response
from server.http.config import AppConfig
from server.http.engine import Engine
from server.http.openapi import install_openapi
from server.http.schemas import ApiError
from server.outputs.store import StoreUnavailable

__all__ = ["AppConfig", "create_app"]

_PUBLIC_PATHS = frozenset({"/health"})
_PROBE_PATHS = frozenset({"/ready"})  # answers anyone, a key's jobs to the key (server.http.auth)
_STORE_RETRY_AFTER_S = 5


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError) -> JSONResponse:
        app.state.rejected[exc.status] = app.state.rejected.get(exc.status, 0) + 1
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {404: "not_found", 405: "method_not_allowed"}
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return error_response(exc.status_code, codes.get(exc.status_code, "http_error"), detail,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0]
        param = str(err["loc"][-1]) if err.get("loc") else None
        app.state.rejected[400] = app.state.rejected.get(400, 0) + 1
        return error_response(400, "invalid_value", f"{param}: {err['msg']}", param)

    @app.exception_handler(StoreUnavailable)
    async def store_unavailable(_request: Request, exc: StoreUnavailable) -> JSONResponse:
        # Nothing was changed (a store's write either happened whole or not at all): the client may retry.
        return error_response(503, "store_unavailable", f"{exc}; retry later",
                              headers={"Retry-After": str(_STORE_RETRY_AFTER_S)})

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(500, "internal_error", f"{type(exc).__name__}: the server failed; see its log")


def create_app(config: AppConfig, engine: Engine) -> FastAPI:
    """The FastAPI app over ``engine`` (a :class:`server.group.leader.GroupLeader`, or any other :class:`Engine`)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        recovered = engine.store.recover()
        if recovered:
            app.state.recovered = recovered
        engine.start()
        try:
            yield
        finally:
            app.state.shutting_down = True
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="cp-infer", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine
    app.state.config = config
    app.state.rejected = {}
    app.state.shutting_down = False
    app.state.recovered = []
    _install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(videos.router)
    app.include_router(usage.router)
    app.include_router(live.router)
    app.include_router(live_socket.router)
    app.include_router(models.router)
    app.include_router(playground.router)
    install_openapi(app, engine, config, public=_PUBLIC_PATHS | _PROBE_PATHS)
    # Routes cap their own bodies (those that carry media higher); the guard only stops what no route takes.
    app.add_middleware(GuardMiddleware, api_key=config.api_key, tenants=engine.store.tenants, public=_PUBLIC_PATHS,
                       probes=_PROBE_PATHS, max_body_bytes=config.max_body_bytes + 2 * config.max_upload_bytes)
    if config.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        # Outside the guard: a browser's preflight carries no token; the real request still needs one.
        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Video-Id"])
    # The page's own files answer before the guard: a browser cannot send a token when it navigates.
    app.add_middleware(playground.PageFiles)
    return app
