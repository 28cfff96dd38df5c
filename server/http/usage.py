"""``GET /v1/usage``: what each tenant has used (``server.group.tenants``): its jobs now by status, jobs queued and
ended, seconds of video asked for today and made, and rank-seconds, from the job store (the whole fleet's).

Invariants:
- A key sees its own tenant's usage only; an admin's sees every tenant's, or ``tenant``'s.
"""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Query
from pydantic import BaseModel

from server.http.auth import TenantDep
from server.http.engine import EngineDep
from server.http.schemas import ApiError, error_responses

__all__ = ["router"]


class TenantUsage(BaseModel):
    tenant: str
    """The tenant (``''``: jobs made while the server needed no key)."""
    jobs: dict[str, int]
    """Its jobs in the store now, by status."""
    jobs_submitted: int
    """Jobs it has queued (deleted ones too)."""
    jobs_ended: dict[str, int]
    """Jobs of its that ended, by final status."""
    video_seconds: float
    """Seconds of video made for it (completed jobs)."""
    rank_seconds: float
    """Its completed jobs' time from claim to end, times the ranks that ran them (denoising and decoding)."""
    requested_seconds_today: float
    """Seconds of video it has asked for today (UTC): what ``seconds_per_day`` limits."""


class UsageList(BaseModel):
    object: str = "list"
    data: list[TenantUsage]


router = APIRouter(prefix="/v1", tags=["usage"])


@router.get("/usage", response_model=UsageList, responses=error_responses(400))
async def get_usage(engine: EngineDep, tenant: TenantDep, tenant_filter: str | None = Query(
        None, alias="tenant", description="an admin key: only this tenant's usage")) -> dict:
    """The key's tenant's usage; an admin key's: every tenant's (or ``tenant``'s)."""
    if tenant_filter is not None and not tenant.admin and tenant_filter != tenant.name:
        raise ApiError(400, "invalid_value", "tenant: only an admin key reads another tenant's usage; remove it",
                       "tenant")
    name = tenant_filter if tenant.admin else tenant.name
    data = await anyio.to_thread.run_sync(engine.store.tenants.usage, name)
    return {"object": "list", "data": data}
