"""What the HTTP app needs from the engine behind it: the :class:`Engine` protocol, and :func:`get_engine`, the
FastAPI dependency through which every route reaches it (``engine: EngineDep`` in a route's parameters).

Invariants:
- The app codes against :class:`Engine` alone, never against ``server.group.leader.GroupLeader`` (which implements it,
  as does the test suite's stub): a member the app starts to use is added here first.
- Nothing in the protocol touches the process group: the HTTP thread reads state and goes through the job store;
  the engine's own thread runs the jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Protocol, runtime_checkable

from fastapi import Depends, Request

if TYPE_CHECKING:
    from cp_infer.options import ModelOptions
    from cp_infer.request import GenerationLimits, GenerationRequest, LoraWeight
    from cp_infer.shapes import VideoGeometry
    from server.group.jobs import Job, JobStore, Live
    from server.group.leader import Histogram
    from server.group.tenants import Tenant
    from server.outputs.streaming import VideoStream

__all__ = ["Engine", "EngineDep", "get_engine"]


@runtime_checkable
class Engine(Protocol):
    """The served model and its job queue, as the HTTP app sees them (``server.group.leader.GroupLeader``)."""

    # -- lifecycle (the app's lifespan) ------------------------------------------------------------------------
    def start(self) -> None:
        """Start running queued jobs (returns at once; the model loads in the background)."""

    def stop(self) -> None:
        """Stop after the job in progress, if any; blocks until then (the app calls it from a thread)."""

    # -- jobs --------------------------------------------------------------------------------------------------
    @property
    def store(self) -> JobStore:
        """The job queue and records: routes submit, list, cancel and delete jobs and read their files here."""

    def submit_streamed(self, request: GenerationRequest, *, model: str, tenant: Tenant,
                        live: Live | None = None) -> tuple[Job, VideoStream]:
        """Queue ``request`` as ``tenant``'s streamed job (``live``: a live video's first directions) and return it
        with the handle its MP4 is read from while it is made; raises ``server.group.jobs.QueueFull`` and
        ``server.group.tenants.TenantLimit`` as ``store.submit``
        does."""

    def release_stream(self, job_id: str) -> None:
        """The HTTP side is done with a streamed job's handle (one not yet running then runs unstreamed)."""

    def retry_after_s(self) -> int:
        """Seconds a client refused with 429 should wait (``Retry-After``)."""

    @property
    def keep_frames(self) -> bool:
        """Whether completed jobs also keep their raw frames (``variant=frames``)."""

    # -- the served model: what a request is checked against --------------------------------------------------
    @property
    def served_model(self) -> str:
        """The name clients pass as ``model``."""

    @property
    def limits(self) -> GenerationLimits:
        """The request limits every rank enforces."""

    @property
    def geometry(self) -> VideoGeometry | None:
        """The model's frame geometry; ``None`` until the model is loaded (routes then answer 503)."""

    @property
    def options(self) -> ModelOptions:
        """The request options the served model declares (from its config files: known before it is loaded)."""

    @property
    def family(self) -> str:
        """The served model's family (a name of ``models.families.FAMILIES``), from its config files."""

    def adapters(self) -> list[dict]:
        """The LoRA adapters requests may name (``name``, ``bytes``, ``loaded``); empty without an adapter
        directory."""

    def check_loras(self, loras: tuple[LoraWeight, ...], *, stages: int = 1) -> None:
        """Raise ``ValueError`` naming ``loras[i]`` and the fix for an adapter the server cannot apply (not one of its
        adapters, not a LoRA, or one that matches no module of the model), from the files' headers alone; with
        ``stages=2`` also when stage 2, adding the server's stage-2 adapters, would apply too many."""

    # -- health and metrics ------------------------------------------------------------------------------------
    def ready(self) -> tuple[bool, str]:
        """Whether the group is up and answering, with the reason (``/ready``)."""

    @property
    def world_size(self) -> int | None:
        """Ranks in the group; ``None`` until it has formed."""

    def replica_status(self) -> list[dict]:
        """Each replica group (``server.group.leader.GroupLeader.replica_status``): ``replica``, ``ranks``, ``layout``
        (``{"guidance": G, "ring": R, "ulysses": U}``), ``ready``,
        ``reason``, ``job`` (running, or ``None``), ``heartbeat_rtt_ms``, ``jobs_finished`` by state; empty until the
        group has formed."""

    @property
    def last_ping_rtt_s(self) -> float | None:
        """Round trip of the last heartbeat over the whole group, in seconds; ``None`` before the first."""

    @property
    def restart_count(self) -> int:
        """Times torchrun has restarted the group."""

    @property
    def broadcasts(self) -> int:
        """Validated requests broadcast to the group so far."""

    @property
    def jobs_done(self) -> dict[str, int]:
        """Jobs this engine ended, by final status (``completed``, ``failed``, ``cancelled``)."""

    @property
    def step_seconds(self) -> Histogram:
        """Denoising step latency on rank 0."""

    @property
    def blocks_saved(self) -> int:
        """Transformer block evaluations the requests' step caches saved so far."""

    @property
    def memory(self) -> list[dict]:
        """Where each rank's weights are (``cp_infer.placement.RankMemory.as_dict``: ``rank``, ``weights``,
        ``offload``, ``components`` -> place -> bytes), measured at start-up; empty until the group has loaded."""

    @property
    def generation_seconds(self) -> Histogram:
        """Time from a job's broadcast to its written video."""


def get_engine(request: Request) -> Engine:
    """The app's engine (``app.state.engine``, set by ``server.http.app.create_app``)."""
    return request.app.state.engine


EngineDep = Annotated[Engine, Depends(get_engine)]
"""A route parameter annotated ``engine: EngineDep`` receives the app's engine."""
