"""One rank's runtime: the parallel state and the loaded, parallelised model, plus the leader->worker loop.

Invariants:
- Every rank of the group builds the same ``Runtime`` (same model folder, dtype, limits) and then runs the
  same sequence of commands; only the leader (global rank 0) decides what the next command is, and it is
  broadcast over the gloo CPU group as a server-built ``Command`` (never client bytes: broadcast is pickle).
- ``Command("idle")`` is a heartbeat: the leader sends one at least every ``heartbeat_s`` while it waits for
  work, so workers never sit in a broadcast longer than the collective timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cp_infer import ParallelConfig, ParallelState, broadcast_object, init_parallel, warmup
from cp_infer.request import GenerationLimits, GenerationRequest
from cp_infer.sampler import SampleControl, sample
from models.loading import load_ltx_video, parse_dtype, resolve_model
from models.ltx_video import LTXVideoModel

__all__ = ["RuntimeConfig", "Runtime", "Command", "start_runtime", "worker_loop"]

log = logging.getLogger("cp_infer.runtime")


@dataclass(frozen=True)
class RuntimeConfig:
    """What every rank needs to load the same model the same way."""

    model: str | None = None
    """A local diffusers-format LTX-Video folder; ``None`` serves the embedded default (tiny-ltx-video)."""
    dtype: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` for the transformer, text encoder and VAE."""
    device: str | None = None
    """``cpu`` or ``cuda``; ``None`` picks ``cuda:LOCAL_RANK`` when CUDA exists."""
    timeout_s: float = 120.0
    """Collective timeout: a rank that stops answering fails the group after this long."""
    limits: GenerationLimits = field(default_factory=GenerationLimits)

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)


@dataclass(frozen=True)
class Command:
    """What the leader tells every rank to do next."""

    kind: str
    """``generate``, ``idle`` (heartbeat) or ``stop``."""
    request: GenerationRequest | None = None
    job_id: str | None = None


@dataclass
class Runtime:
    config: RuntimeConfig
    state: ParallelState
    model: LTXVideoModel

    def generate(self, request: GenerationRequest, control: SampleControl | None = None) -> np.ndarray | None:
        """Sample ``request`` on this rank; every rank of the group must call it with the same request."""
        return sample(self.model, request, state=self.state, limits=self.config.limits, control=control)


def start_runtime(config: RuntimeConfig) -> Runtime:
    """Join the torchrun group (or run alone), load the model, warm the collectives up."""
    state = init_parallel(ParallelConfig(device=config.device, timeout_s=config.timeout_s))
    path = resolve_model(config.model)
    components = load_ltx_video(path, dtype=parse_dtype(config.dtype), device=state.device)
    model = LTXVideoModel(components, state=state)
    warmup(state)
    if state.is_leader:
        log.info("loaded %s on %d rank(s), device %s, dtype %s", path, state.world_size, state.device, config.dtype)
    return Runtime(config=config, state=state, model=model)


def worker_loop(runtime: Runtime, *, control_for: Callable[[Command], SampleControl | None] | None = None) -> None:
    """Non-leader ranks: follow the leader's commands until ``stop``. Failures of a job end that job only."""
    from cp_infer.sampler import JobCancelled, JobFailed

    while True:
        command: Command = broadcast_object(None, state=runtime.state)
        if command.kind == "stop":
            return
        if command.kind != "generate":
            continue
        control = control_for(command) if control_for else None
        try:
            runtime.generate(command.request, control)
        except (JobCancelled, JobFailed) as exc:
            log.info("job %s ended on rank %d: %s", command.job_id, runtime.state.rank, exc)
