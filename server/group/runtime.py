"""One rank's runtime: the parallel state and the loaded, parallelised model, plus the leader->worker loop.

Invariants:
- Every rank of the group builds the same ``Runtime`` (same model folder, dtype, limits) and then runs the
  same sequence of commands; only the leader (global rank 0) decides what the next command is, and it is
  broadcast over the gloo CPU group as a server-built ``Command`` (never client bytes: broadcast is pickle).
- Both sides of the protocol live here: :class:`GroupDriver` is the leader's (the CLI's ``Leader`` and the
  server's ``GroupLeader`` both send every command through it), :func:`worker_loop` the other ranks'. Each
  command is one broadcast followed by the same collectives on every rank: ``generate`` the sampler's, ``ping``
  one all-reduce, ``stop`` and ``idle`` none.
- ``Command("ping")`` is the heartbeat that every rank answers with one all-reduce, so the leader learns that the
  whole group is alive; a leader waiting for work sends one at least every ``heartbeat_s``, so workers never sit
  in a broadcast longer than the collective timeout. ``Command("idle")`` is a heartbeat that needs no answer.
- Fault injection (tests only) is read from ``$CP_INFER_TEST_FAULT`` by :func:`worker_loop` and by the server's
  leader, and acts only through a :class:`SampleControl` hook, so it follows the same agreed-status path as a
  real failure. Unset, it costs nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.distributed as dist

from cp_infer import ParallelConfig, ParallelState, all_reduce_max_int, broadcast_object, init_parallel, warmup
from cp_infer.decode import DEFAULT_FRAMES_PER_RANK, resolve_frames_per_rank
from cp_infer.devices import AUTO, apply_device_defaults, resolve_dtype
from cp_infer.placement import RankMemory
from cp_infer.request import GenerationLimits, GenerationRequest, LoraWeight
from cp_infer.sampler import DenoiseModel, SampleControl, StepStatus, sample
from models.common.loading import parse_dtype, resolve_files
from models.common.lora import DEFAULT_MAX_LORA_BYTES, LoraDirectory
from models.common.lora_slots import DEFAULT_MAX_LORA_RANK
from models.common.placement import measure_components, parse_offload, parse_weights
from models.registry import open_model
from server.group import phases, process

__all__ = [
    "FAULT_ENV",
    "Command",
    "FaultRule",
    "GroupDriver",
    "Runtime",
    "RuntimeConfig",
    "parse_faults",
    "start_runtime",
    "with_faults",
    "worker_loop",
]

log = logging.getLogger("cp_infer.runtime")


@dataclass(frozen=True)
class RuntimeConfig:
    """What every rank needs to load the same model the same way."""

    model: str | None = None
    """A local diffusers-format folder of a family of ``models.families``, a hub id (``org/name[@revision]``), a
    single-file ``.safetensors`` checkpoint (with ``model_config``), or an embedded default's name (a family's
    ``default_name``); ``None`` serves the default family's. Every rank resolves it
    (``models.common.loading.resolve_files``)."""
    model_config: str | None = None
    """``--config``: the diffusers folder or hub id a single-file ``model`` takes its configs and its other components
    from; ``None`` for any other model."""
    upsampler: str | None = None
    """``--upsampler``: a latent-upsampler folder or hub id paired with the model (two-stage generation); ``None``:
    the model folder's own ``latent_upsampler/``, if any."""
    dtype: str = AUTO
    """``fp32``, ``bf16`` or ``fp16`` for the transformer, text encoder and VAE (a family may keep some components in
    float32: ``Family.float32_components``); ``auto``: the device's (``cp_infer.devices.device_defaults``: bf16 on
    CUDA, fp32 on the CPU)."""
    device: str | None = None
    """``cpu`` or ``cuda``; ``None`` picks ``cuda:LOCAL_RANK`` when CUDA exists."""
    timeout_s: float = 120.0
    """Collective timeout: a rank that stops answering fails the group after this long."""
    limits: GenerationLimits = field(default_factory=GenerationLimits)
    decode_frames_per_rank: int | str | None = DEFAULT_FRAMES_PER_RANK
    """Latent frames each rank decodes per streamed round (decode memory and time to first frame grow with it);
    ``"auto"``: by frame size (``cp_infer.decode.resolve_frames_per_rank``); ``None``: the whole video in one
    round."""
    vae_tiling: bool = False
    """Spatial tiles in the VAE for large frames (``models.registry.open_model``'s ``vae_tiling``): less memory, and
    the video of the pipeline with its VAE's tiling on rather than of its default."""
    guidance_degree: int | None = None
    """Ranks a step's guidance passes are spread over (``cp_infer.mesh``); ``None``: 1."""
    ulysses_degree: int | None = None
    """Ranks of a ring block's all-to-all; ``None``: the world divided by the guidance and ring degrees."""
    ring_degree: int | None = None
    """Ulysses groups each pass's sequences are sharded over, passing key/value blocks round a ring; ``None``: 1."""
    compile_blocks: bool = False
    """``torch.compile`` each transformer block (``models.registry.compile_transformer_blocks``): the first request
    of each shape pays the compile, later ones run the compiled block."""
    lora_dir: str | None = None
    """A folder of ``NAME.safetensors`` LoRA adapters requests may apply by name (``models.common.lora``); ``None``:
    none."""
    max_lora_bytes: int = DEFAULT_MAX_LORA_BYTES
    """Adapter tensors each rank keeps loaded between passes (an LRU; ``models.common.lora.LoadedLoras``)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    """With ``compile_blocks`` and ``lora_dir``: the rank of the adapter slots the compiled blocks hold (the highest
    adapter rank that applies; ``models.common.lora_slots``)."""
    stage_2_loras: tuple[LoraWeight, ...] = ()
    """Adapters of ``lora_dir`` that stage 2 of two-stage generation applies after a request's own (Lightricks'
    distilled LoRA in the dev two-stage recipe; ``models.common.lora.pass_loras``)."""
    weights: str = "auto"
    """``sharded``: the transformer and the text encoder 1/N on each of a replica group's N ranks (FSDP2, read a shard
    at a time); ``replicated``: whole on every rank; ``auto``: sharded where the replicated weights would not fit the
    device's free memory (never on the CPU). ``models.common.placement``."""
    offload: tuple[str, ...] = ()
    """Components kept on the CPU between uses: ``text_encoder``, ``vae``, ``transformer_blocks``."""

    def __post_init__(self) -> None:
        if self.dtype != AUTO:
            parse_dtype(self.dtype)
        if self.max_lora_bytes < 0:
            raise ValueError(f"max_lora_bytes={self.max_lora_bytes} must be >= 0")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be >= 1 (--max-lora-rank)")
        if self.lora_dir is not None:
            LoraDirectory(self.lora_dir)  # raises unless it is a folder
        if self.stage_2_loras and self.lora_dir is None:
            raise ValueError("--stage-2-lora names an adapter of --lora-dir, and no --lora-dir was given; give the "
                             "folder that holds it")
        parse_weights(self.weights)
        parse_offload(list(self.offload))  # raises naming the valid components
        ParallelConfig(guidance_degree=self.guidance_degree, ulysses_degree=self.ulysses_degree,
                       ring_degree=self.ring_degree)  # raises if < 1
        resolve_frames_per_rank(self.decode_frames_per_rank, height=1, width=1)  # raises on a bad setting


@dataclass(frozen=True)
class Command:
    """What the leader tells every rank to do next."""

    kind: str
    """``generate``, ``idle`` (heartbeat), ``ping`` (heartbeat answered by one all-reduce) or ``stop``."""
    request: GenerationRequest | None = None
    job_id: str | None = None
    resume: tuple[int, dict[str, np.ndarray]] | None = None
    """``generate``: the checkpoint the job goes on from (``SampleControl.resume``; saved by an earlier run)."""
    live: bool = False
    """``generate``: a live video (``SampleControl.live``): every rank takes part in asking for its directions."""


@dataclass
class Runtime:
    config: RuntimeConfig
    state: ParallelState
    model: DenoiseModel
    """The family's parallel adapter (``models.registry.open_model``)."""
    memory: tuple[RankMemory, ...] = ()
    """What every rank of the world holds of each component, and where (measured after the load)."""

    def generate(self, request: GenerationRequest, control: SampleControl | None = None) -> np.ndarray | None:
        """Sample ``request`` on this rank; every rank of the group must call it with the same request."""
        return sample(self.model, request, state=self.state, limits=self.config.limits, control=control)


class GroupDriver:
    """The leader's side of the command protocol: each method broadcasts one :class:`Command` and then runs rank
    0's part of it, which every other rank runs in :func:`worker_loop`."""

    local = True
    """The group is this process's own (rank 0's fault rules apply to its jobs; ``server.group.replicas.RemoteDriver``
    drives another replica's)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.jobs_sent = 0
        """``generate`` commands broadcast so far (the server's ``/metrics`` shows them)."""

    def generate(self, request: GenerationRequest, job_id: str, control: SampleControl | None = None
                 ) -> np.ndarray | None:
        """Run ``request`` on the whole group: rank 0's frames (``None`` with ``control.collect=False``). Raises as
        :meth:`Runtime.generate`; ``JobCancelled`` and ``JobFailed`` leave every rank in step. ``control.resume``
        goes to every rank with the command."""
        resume = None if control is None else control.resume
        live = control is not None and control.live
        broadcast_object(Command("generate", request=request, job_id=job_id, resume=resume, live=live),
                         state=self.runtime.state)
        self.jobs_sent += 1
        return self.runtime.generate(request, control)

    def ping(self) -> None:
        """A heartbeat round trip: returns once every rank has answered."""
        broadcast_object(Command("ping"), state=self.runtime.state)
        all_reduce_max_int(0, state=self.runtime.state)

    def stop(self) -> None:
        """End every worker's loop; no command may follow."""
        broadcast_object(Command("stop"), state=self.runtime.state)


def start_runtime(config: RuntimeConfig) -> Runtime:
    """Join the torchrun group (or run alone), load the model, warm the collectives up."""
    state = init_parallel(ParallelConfig(device=config.device, timeout_s=config.timeout_s,
                                         guidance_degree=config.guidance_degree, ulysses_degree=config.ulysses_degree,
                                         ring_degree=config.ring_degree))
    phases.mark("rendezvous and groups")
    if state.world_size > 1:
        process.set_rank_title(state.rank, state.world_size, state.replica)
    apply_device_defaults(state.device)
    dtype = resolve_dtype(config.dtype, state.device)
    files = resolve_files(config.model, config=config.model_config, upsampler=config.upsampler)
    model = open_model(files, dtype=dtype, state=state, compile_blocks=config.compile_blocks,
                       lora_dir=config.lora_dir, max_lora_bytes=config.max_lora_bytes,
                       max_lora_rank=config.max_lora_rank,
                       stage_2_loras=config.stage_2_loras, weights=config.weights,
                       offload=config.offload, vae_tiling=config.vae_tiling)
    model.decode_frames_per_rank = config.decode_frames_per_rank
    memory = _gather_memory(measure_components(model.components, model.placement), state)
    phases.mark("load")
    warmup(state)
    phases.mark("warm-up")
    if state.is_leader:
        ring = f" x ring {state.ring_size}" if state.ring_size > 1 else ""
        log.info("loaded %s on %d rank(s) (guidance %d%s x Ulysses %d), device %s, dtype %s",
                 files.checkpoint or files.folder, state.world_size,
                 state.guidance_size, ring, state.ulysses_size, state.device, dtype)
        log.info("weights %s, offload %s; %s", model.placement.weights, ",".join(model.placement.offload) or "none",
                 "; ".join(f"rank {m.rank}: {m.text()}" for m in memory))
    return Runtime(config=config, state=state, model=model, memory=memory)


def _gather_memory(mine: RankMemory, state: ParallelState) -> tuple[RankMemory, ...]:
    """Every rank's :class:`RankMemory`, in rank order (start-up only: one gather over the world's gloo group)."""
    if state.world_group is None:
        return (mine,)
    every: list[RankMemory | None] = [None] * state.world_size
    dist.all_gather_object(every, mine, group=state.world_group)
    return tuple(every)


FAULT_ENV = "CP_INFER_TEST_FAULT"


@dataclass(frozen=True)
class FaultRule:
    """One injected fault, e.g. ``rank=1,step=2,kind=raise,prompt=boom`` (tests only).

    ``kind``: ``raise`` (an exception in the step poll, or in the decoded-frames hook with ``step=decode``), ``oom``
    (``torch.OutOfMemoryError`` from the model's transformer in that step, as the CUDA allocator raises it), ``kill``
    (SIGKILL to this process), ``exit`` (``os._exit(3)``) or ``sleep`` (``seconds`` per matching step).
    ``rank`` and ``step`` may be ``*``; ``prompt`` is a substring the job's prompt must contain.
    """

    kind: str
    rank: int | None = None
    step: int | str | None = None
    """A step index, ``"decode"`` (rank 0 only: the phase after the gather) or ``None`` for every step."""
    prompt: str = ""
    seconds: float = 0.0
    once: str = ""
    """A marker file's path: the rule fires only while the file does not exist, and creates it when it does (so a
    fault fires once across restarts of the group)."""

    def matches(self, rank: int, prompt: str) -> bool:
        return (self.rank is None or self.rank == rank) and self.prompt in prompt

    def fire(self, where: str, model: DenoiseModel | None = None) -> None:
        if self.kind == "sleep":
            time.sleep(self.seconds)
            return
        if self.once:
            try:
                os.close(os.open(self.once, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                return
        log.warning("injecting fault %s at %s (pid %d)", self, where, os.getpid())
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at {where}")
        if self.kind == "oom":
            _out_of_memory_next_forward(model, where)
            return
        for handler in logging.getLogger().handlers:
            handler.flush()
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)


def parse_faults(text: str | None) -> tuple[FaultRule, ...]:
    """``"rank=1,step=2,kind=raise;rank=0,step=decode,kind=raise,prompt=x"`` -> rules (empty text: none)."""
    rules = []
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        fields = dict(item.split("=", 1) for item in part.split(",") if item.strip())
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        unknown = set(fields) - {"kind", "rank", "step", "prompt", "seconds", "once"}
        if unknown or fields.get("kind") not in ("raise", "oom", "kill", "exit", "sleep"):
            raise ValueError(f"{FAULT_ENV}: cannot parse {part!r}; expected e.g. 'rank=1,step=2,kind=raise'")
        rank = fields.get("rank", "*")
        step = fields.get("step", "*")
        rules.append(FaultRule(
            kind=fields["kind"], rank=None if rank == "*" else int(rank),
            step=None if step == "*" else (step if step == "decode" else int(step)),
            prompt=fields.get("prompt", ""), seconds=float(fields.get("seconds", 0.0)), once=fields.get("once", "")))
    return tuple(rules)


def _out_of_memory_next_forward(model: DenoiseModel | None, where: str) -> None:
    """The next forward of ``model``'s transformer (either expert of a two-expert Wan) raises the CUDA allocator's
    error, inside the step, once."""
    transformers = getattr(model, "experts", None) or (model.transformer,)
    handles = []

    def hook(_module, _args):
        for handle in handles:
            handle.remove()
        raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 20.00 GiB (injected at {where})")

    handles.extend(t.register_forward_pre_hook(hook) for t in transformers)


def with_faults(control: SampleControl | None, request: GenerationRequest, *, rank: int,
                rules: tuple[FaultRule, ...], model: DenoiseModel | None = None) -> SampleControl | None:
    """``control`` with the matching fault rules wrapped around its ``poll`` and ``on_frames`` hooks.

    Step rules fire in ``poll`` (so the sampler turns a raise into an agreed error; an ``oom`` rule arms ``model``'s
    transformer to raise in the step that follows); ``step=decode`` rules fire in ``on_frames``, which only the rank
    that assembles the video (group rank 0) receives.
    """
    active = [r for r in rules if r.matches(rank, request.prompt)]
    if not active:
        return control
    control = control or SampleControl()
    base_poll, base_frames = control.poll, control.on_frames

    def poll(i: int):
        for rule in active:
            if rule.step is None or rule.step == i:
                rule.fire(f"step {i} on rank {rank}", model)
        return base_poll(i) if base_poll else StepStatus.OK

    def on_frames(frames, first: int, total: int) -> None:
        if base_frames:
            base_frames(frames, first, total)
        for rule in active:
            if rule.step == "decode":
                rule.fire(f"decode on rank {rank}")

    return replace(control, poll=poll, on_frames=on_frames)


def worker_loop(runtime: Runtime, *, control_for: Callable[[Command], SampleControl | None] | None = None) -> None:
    """Non-leader ranks: follow the leader's commands until ``stop``. Failures of a job end that job only."""
    from cp_infer.sampler import JobCancelled, JobFailed

    faults = parse_faults(os.environ.get(FAULT_ENV))
    while True:
        command: Command = broadcast_object(None, state=runtime.state)
        if command.kind == "stop":
            return
        if command.kind == "ping":
            all_reduce_max_int(0, state=runtime.state)
            continue
        if command.kind != "generate":
            continue
        control = control_for(command) if control_for else None
        if command.resume is not None:
            control = replace(control or SampleControl(), resume=command.resume)
        if command.live:
            control = replace(control or SampleControl(), live=True)
        control = with_faults(control, command.request, rank=runtime.state.rank, rules=faults, model=runtime.model)
        try:
            runtime.generate(command.request, control)
        except (JobCancelled, JobFailed) as exc:
            log.info("job %s ended on rank %d: %s", command.job_id, runtime.state.rank, exc)
