"""Who a request is from: the guard in front of every route (authentication, the request bucket, the body-size cap)
and :func:`get_tenant`, the dependency through which a route reads the request's tenant (``tenant: TenantDep``).

Invariants:
- A request needs a key when the server has ``--api-key`` or its job store holds any key (``cp-infer keys``);
  with neither it is open and every request is the ``OPEN`` tenant (which sees every job), as before tenants.
- The ``--api-key`` token is compared with ``hmac.compare_digest`` and is the ``ADMIN`` tenant; any other token is
  looked up by its digest (``server.group.tenants.Tenants.authenticate``). A missing, wrong or revoked key is the
  same 401: nothing says which. No token is logged or echoed.
- A tenant with ``rpm`` takes a token of its bucket (shared by the fleet) per request, or is answered 429 with
  ``Retry-After``, before any route runs.
- A WebSocket's key is its ``Authorization`` header, or the subprotocol ``bearer.<key>`` (a browser's); refused, it
  is closed before it is accepted.
- Only ``/health`` is exempt, and the playground page's own static files (``server.http.playground.PageFiles``, in
  front of the guard and not routes). A probe path (``/ready``: a kubelet or a load balancer sends no key) answers
  anyone: a valid key's tenant is the request's tenant, anything else (no key, a wrong one, a job store that does not
  answer) is ``NOBODY``, who sees no job; a probe takes no token of a bucket.
- Bodies over the cap are refused with 413 from their Content-Length before they are read (routes cap streamed
  bodies themselves).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Collection
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import JSONResponse

from server.group.tenants import ADMIN, NOBODY, OPEN, Tenant, TenantLimit, Tenants
from server.http.schemas import ApiError
from server.outputs.store import StoreUnavailable

__all__ = ["GuardMiddleware", "TenantDep", "get_tenant", "limit_error"]

_STORE_RETRY_AFTER_S = 5


def error_response(status: int, code: str, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ApiError(status, code, message, param).body(), status_code=status, headers=headers)


def limit_error(exc: TenantLimit) -> ApiError:
    """429 naming the limit (``param``) and its value (in the message), with ``Retry-After``."""
    return ApiError(429, "tenant_limit_exceeded", str(exc), exc.limit,
                    headers={"Retry-After": str(exc.retry_after_s)})


class GuardMiddleware:
    """Authentication, the request bucket and the body-size cap, as plain ASGI so that no route (or 404) can bypass
    them. The request's tenant goes to the route in ``scope["state"]["tenant"]``."""

    def __init__(self, app, *, api_key: str | None, tenants: Tenants, max_body_bytes: int, public: Collection[str],
                 probes: Collection[str] = ()):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.tenants = tenants
        self.max_body_bytes = max_body_bytes
        self.public = frozenset(public)
        self.probes = frozenset(probes)

    def _tenant(self, token: bytes | None) -> Tenant | None:
        """The token's tenant (``OPEN`` when the server asks for none); ``None``: refused. Blocking (the database)."""
        if self.api_key is not None and token is not None and hmac.compare_digest(token, self.api_key):
            return ADMIN
        if self.api_key is None and not self.tenants.any_keys():
            return OPEN
        if not token:
            return None
        try:
            return self.tenants.authenticate(token.decode("ascii"))
        except UnicodeDecodeError:
            return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["path"] not in self.public:
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            token = token.strip() if scheme.lower() == b"bearer" else None
            if token is None and scope["type"] == "websocket":
                # A browser cannot send the header on a WebSocket: the key comes as a subprotocol, bearer.<key>.
                token = next((p[len("bearer."):].encode() for p in scope.get("subprotocols", ())
                              if p.startswith("bearer.")), None)
            response = None
            try:
                tenant = await asyncio.to_thread(self._tenant, token)
                if scope["path"] in self.probes:
                    tenant = tenant or NOBODY
                elif tenant is None:
                    response = error_response(401, "invalid_api_key", "missing, wrong or revoked API key; send the "
                                              "header 'Authorization: Bearer <key>'",
                                              headers={"WWW-Authenticate": "Bearer"})
                elif tenant.rpm is not None:
                    await asyncio.to_thread(self.tenants.take_request, tenant)
            except TenantLimit as exc:
                error = limit_error(exc)
                response = error_response(429, error.code, error.message, error.param, error.headers)
            except StoreUnavailable as exc:
                if scope["path"] in self.probes:
                    tenant = NOBODY  # the probe itself names the store that does not answer
                else:
                    response = error_response(503, "store_unavailable", f"{exc}; retry later",
                                              headers={"Retry-After": str(_STORE_RETRY_AFTER_S)})
            if response is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        if scope["type"] == "http":
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                response = error_response(413, "request_too_large", f"the body is {length.decode(errors='replace')}"
                                          f" bytes; the limit is {self.max_body_bytes} bytes")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def get_tenant(request: Request) -> Tenant:
    """The request's tenant, as the guard found it (``OPEN`` on a route the guard leaves alone)."""
    return request.scope.get("state", {}).get("tenant", OPEN)


TenantDep = Annotated[Tenant, Depends(get_tenant)]
"""A route parameter annotated ``tenant: TenantDep`` receives the request's tenant."""
