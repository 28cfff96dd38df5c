"""``/health``, ``/ready`` and ``/metrics``: whether the process lives, whether the worker group answers, and the
Prometheus counters.

Invariants:
- ``/health`` is public (``server.http.app``'s guard exempts it); it touches nothing.
- ``/ready`` answers anyone (a probe sends no key: ``server.http.auth``), but names a running job only to a tenant
  who sees it: another tenant's (or, without a key, any) running job is ``"job": null`` with ``"running": true``,
  its id cut from the reasons, so a probe tells nothing of whose videos exist.
- ``/ready`` and ``/metrics`` read the engine's state (:class:`server.http.engine.Engine`); neither waits on the group.
  ``/ready`` also asks each store one cheap question and names the one that does not answer. With a shared job
  store, the queue's depth and oldest age are the fleet's (what an autoscaler scales on).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel

from server.group.tenants import Tenant
from server.http.auth import TenantDep
from server.http.engine import Engine, EngineDep
from server.http.schemas import ApiError, ErrorBody
from server.outputs.store import StoreUnavailable

__all__ = ["router"]

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: Literal["ok"]


class Ready(BaseModel):
    status: Literal["ready", "not_ready"]
    reason: str
    world_size: int | None
    heartbeat_rtt_ms: float | None
    replicas: list[dict[str, Any]]
    """Each replica group (``Engine.replica_status``), and ``running``: whether it runs a job (``job``: its id, where
    the caller's key sees that job)."""
    memory: list[dict[str, Any]]
    """Each rank's weights: ``weights`` (``sharded``/``replicated``), ``offload``, and per component the bytes on each
    device it lives on (``Engine.memory``)."""


class NotReady(Ready):
    """``/ready``'s 503: the error, and the same fields as when ready."""

    error: ErrorBody


@router.get("/health", response_model=Health)
async def health() -> dict:
    """The process lives (no authentication)."""
    return {"status": "ok"}


@router.get("/ready", response_model=Ready, responses={503: {
    "model": NotReady, "description": "The worker group is not up (yet); retry after Retry-After seconds",
    "headers": {"Retry-After": {"schema": {"type": "integer"}}}}})
async def ready(engine: EngineDep, tenant: TenantDep) -> JSONResponse:
    """The worker group is up and answered the last heartbeat collective (or is running a job). No key needed (a
    probe's); a running job is named to a key that sees it."""
    ok, reason = engine.ready()
    replicas = engine.replica_status()
    problem = await anyio.to_thread.run_sync(_store_problem, engine)
    if problem is not None:
        ok, reason = False, problem
    hidden = await anyio.to_thread.run_sync(_hidden_jobs, engine, tenant, replicas)
    for job_id in hidden:
        reason = reason.replace(job_id, "a job")
    replicas = [{**r, "running": r["job"] is not None} for r in replicas]
    for r in replicas:
        if r["job"] in hidden:
            r["job"], r["reason"] = None, r["reason"].replace(r["job"], "a job")
    body = {"status": "ready" if ok else "not_ready", "reason": reason, "world_size": engine.world_size,
            "heartbeat_rtt_ms": None if engine.last_ping_rtt_s is None else round(engine.last_ping_rtt_s * 1e3, 3),
            "replicas": replicas, "memory": engine.memory}
    if ok:
        return JSONResponse(body)
    return JSONResponse({**ApiError(503, "not_ready", reason).body(), **body}, status_code=503,
                        headers={"Retry-After": "5"})


def _hidden_jobs(engine: Engine, tenant: Tenant, replicas: list[dict[str, Any]]) -> set[str]:
    """The running jobs ``tenant`` does not see (blocking: the job store, for a tenant that is not an admin)."""
    running = {r["job"] for r in replicas if r["job"] is not None}
    if tenant.admin or not running:
        return set()
    hidden = set()
    for job_id in running:
        try:
            job = engine.store.get(job_id)
        except StoreUnavailable:
            job = None  # what the store cannot tell is not told
        if job is None or not tenant.sees(job.tenant):
            hidden.add(job_id)
    return hidden


def _store_problem(engine: Engine) -> str | None:
    """What is wrong with the stores, naming the one (``None``: both answer)."""
    try:
        engine.store.probe()
    except StoreUnavailable as exc:
        return str(exc)
    return None


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request, engine: EngineDep, tenant: TenantDep) -> PlainTextResponse:
    """Prometheus text format; the per-tenant counters are every tenant's for an admin key, the key's own else."""
    text = await asyncio.to_thread(_metrics_text, engine, request.app.state.rejected, tenant)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _metrics_text(engine: Engine, rejected: dict[int, int], tenant: Tenant) -> str:
    store = engine.store
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[str]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples])

    metric("cp_infer_queue_depth", "gauge", "Jobs waiting to run.", [f"cp_infer_queue_depth {store.queue_depth()}"])
    metric("cp_infer_queue_oldest_age_seconds", "gauge", "How long the oldest queued job has waited (0: none).",
           [f"cp_infer_queue_oldest_age_seconds {store.oldest_queued_age():.3f}"])
    usage = store.tenants.usage(None if tenant.admin else tenant.name)  # the fleet's, from the job store
    metric("cp_infer_tenant_jobs_submitted_total", "counter", "Jobs each tenant queued.",
           [f'cp_infer_tenant_jobs_submitted_total{{tenant="{u["tenant"]}"}} {u["jobs_submitted"]}' for u in usage])
    metric("cp_infer_tenant_jobs_ended_total", "counter", "Jobs of each tenant that ended, by final state.",
           [f'cp_infer_tenant_jobs_ended_total{{tenant="{u["tenant"]}",state="{s}"}} {n}'
            for u in usage for s, n in u["jobs_ended"].items()])
    metric("cp_infer_tenant_video_seconds_total", "counter", "Seconds of video made for each tenant.",
           [f'cp_infer_tenant_video_seconds_total{{tenant="{u["tenant"]}"}} {u["video_seconds"]}' for u in usage])
    metric("cp_infer_tenant_rank_seconds_total", "counter", "Rank-seconds of each tenant's completed jobs (time "
           "from claim to end, times the ranks that ran them).",
           [f'cp_infer_tenant_rank_seconds_total{{tenant="{u["tenant"]}"}} {u["rank_seconds"]}' for u in usage])
    metric("cp_infer_jobs", "gauge", "Jobs in the store by state.",
           [f'cp_infer_jobs{{state="{s}"}} {n}' for s, n in store.counts().items()])
    metric("cp_infer_jobs_finished_total", "counter", "Jobs this leader ended, by final state.",
           [f'cp_infer_jobs_finished_total{{state="{s}"}} {n}' for s, n in engine.jobs_done.items()])
    metric("cp_infer_requests_broadcast_total", "counter", "Validated requests the leader broadcast to the group.",
           [f"cp_infer_requests_broadcast_total {engine.broadcasts}"])
    metric("cp_infer_requests_rejected_total", "counter", "Requests refused by the front end, by status code.",
           [f'cp_infer_requests_rejected_total{{code="{c}"}} {n}' for c, n in sorted(rejected.items())])
    metric("cp_infer_step_seconds", "histogram", "Denoising step latency on rank 0.",
           engine.step_seconds.lines("cp_infer_step_seconds"))
    metric("cp_infer_generation_seconds", "histogram", "Time from broadcast to a written video.",
           engine.generation_seconds.lines("cp_infer_generation_seconds"))
    metric("cp_infer_cache_blocks_saved_total", "counter", "Transformer block evaluations step caches saved.",
           [f"cp_infer_cache_blocks_saved_total {engine.blocks_saved}"])
    ok, _ = engine.ready()
    metric("cp_infer_group_ready", "gauge", "1 when the worker group answers.", [f"cp_infer_group_ready {int(ok)}"])
    metric("cp_infer_group_world_size", "gauge", "Ranks in the group.",
           [f"cp_infer_group_world_size {engine.world_size or 0}"])
    metric("cp_infer_group_restarts", "gauge", "torchrun restarts of the group so far.",
           [f"cp_infer_group_restarts {engine.restart_count}"])
    rtt = engine.last_ping_rtt_s
    metric("cp_infer_heartbeat_rtt_seconds", "gauge", "Round trip of the last heartbeat collective.",
           [f"cp_infer_heartbeat_rtt_seconds {rtt if rtt is not None else 'NaN'}"])
    replicas = engine.replica_status()
    metric("cp_infer_replicas", "gauge", "Replica groups the front end dispatches jobs to.",
           [f"cp_infer_replicas {len(replicas)}"])
    metric("cp_infer_replica_ready", "gauge", "1 when the replica group answers.",
           [f'cp_infer_replica_ready{{replica="{r["replica"]}"}} {int(r["ready"])}' for r in replicas])
    metric("cp_infer_replica_busy", "gauge", "1 while the replica group runs a job.",
           [f'cp_infer_replica_busy{{replica="{r["replica"]}"}} {int(r["job"] is not None)}' for r in replicas])
    metric("cp_infer_replica_ranks", "gauge", "Ranks in the replica group.",
           [f'cp_infer_replica_ranks{{replica="{r["replica"]}"}} {len(r["ranks"])}' for r in replicas])
    metric("cp_infer_replica_jobs_finished_total", "counter", "Jobs each replica group ended, by final state.",
           [f'cp_infer_replica_jobs_finished_total{{replica="{r["replica"]}",state="{s}"}} {n}'
            for r in replicas for s, n in r["jobs_finished"].items()])
    metric("cp_infer_replica_heartbeat_rtt_seconds", "gauge", "Round trip of the replica's last heartbeat.",
           [f'cp_infer_replica_heartbeat_rtt_seconds{{replica="{r["replica"]}"}} '
            f'{"NaN" if r["heartbeat_rtt_ms"] is None else r["heartbeat_rtt_ms"] / 1e3}' for r in replicas])
    metric("cp_infer_weight_bytes", "gauge", "Bytes of each component's weights each rank holds, by where they are.",
           [f'cp_infer_weight_bytes{{rank="{m["rank"]}",component="{c}",where="{w}"}} {n}'
            for m in engine.memory for c, places in m["components"].items() for w, n in places.items()])
    return "\n".join(lines) + "\n"
