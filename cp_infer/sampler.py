"""The sharded sampler: the denoising loop every rank of a context-parallel group runs together.

Invariants:
- Every rank draws the same initial noise (the model prepares it from the request's seed on the CPU) and
  keeps only its shard of the latent sequence for the whole loop; the scheduler step is elementwise, so it
  runs on the shard. One gather at the end; padding rows are zeroed after every step and trimmed there.
- At every step boundary all ranks agree on one status (ok / cancel / error) with one collective that is
  never skipped, before any tensor collective of that step. So an exception or a cancel on any rank ends
  the job on every rank at the same step: no rank is left waiting inside an all-to-all.
- A job is a plan (``cp_infer.plan``): the model turns the request into passes, each a full sharded loop whose
  gathered latents the next pass is prepared from; the last pass's latents are decoded. Steps are counted over the
  whole plan (``on_step``, ``poll``).
- The loop runs on every rank of the mesh: a pass's sequences are sharded over the Ulysses group (``cp_*``), a
  step's guidance passes over the guidance group (the model's ``predict`` exchanges them), the status agreement
  spans the whole world. Every guidance rank ends with the same latents, so the decode runs over the whole mesh
  (``ParallelState.decoding``) and only the mesh's first rank delivers (``ParallelState.delivers``).
- A long video's plan makes the latents final a part (a window) at a time: after each such pass the frames they
  allow are decoded and delivered (``Decoder.feed``, ``cp_infer.decode.ProgressiveDecode``), so the video streams
  while later windows are made and no rank holds every frame; the state after each is a checkpoint to go on from.
  An audio-video model's soundtrack goes before the frames: piece by piece, each window's before that window's
  frames (``SampleControl.on_audio_piece``, ``Decoder.audio_piece``), or whole (``on_audio``), in which case the
  frames wait for the last window. Which of the two is the delivering rank's choice, agreed on by the whole mesh.
- A live video's plan grows (``SampleControl.extend``, ``cp_infer.live``): once its passes are all made, the replica
  group's first rank is asked for more and its answer is broadcast, so every rank takes the same decision; a longer
  request must keep the passes made (checked on every rank), and the pass just made goes on as a resumed job of the
  longer request does (finished, checkpointed, restored), its decode made again for the longer video. A decode
  that reads something drawn for the whole video (``Decoder.length_free`` false) delivers a live video's frames once
  it ends.
- Running out of device memory (``torch.OutOfMemoryError``) in a step, in preparing or in a hook is a failure of
  that job alone, agreed on like any other (``JobOutOfMemory``, code ``out_of_memory``), with the allocator's cache
  emptied on CUDA: the group keeps serving.
- A step cache (``cp_infer.step_cache``) is the model's, made per pass; the sampler only adds up what each step
  saved (``DenoiseModel.cache_stats``, the same on every rank) and reports the request's totals (``on_cache``).
- Models plug in through :class:`DenoiseModel`; this module knows no model and no HTTP.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from .collectives import all_reduce_max_int, gather_sequence
from .decode import ProgressiveDecode, Split
from .options import ModelOptions
from .plan import DenoisePass, Plan
from .request import GenerationLimits, GenerationRequest, check_request, resolve_request
from .shapes import LatentShape, VideoGeometry
from .shard import ShardPlan
from .state import ParallelState
from .step_cache import CacheStats

__all__ = [
    "DenoiseModel",
    "Decoder",
    "Prepared",
    "SampleControl",
    "StepStatus",
    "JobCancelled",
    "JobFailed",
    "JobOutOfMemory",
    "job_failure",
    "sample",
]


class StepStatus(enum.IntEnum):
    """Ordered by severity: the group takes the maximum over ranks."""

    OK = 0
    CANCEL = 1
    ERROR = 2
    OUT_OF_MEMORY = 3
    """A rank ran out of device memory (``torch.OutOfMemoryError``): the job fails, the group goes on."""


class JobCancelled(Exception):
    """The job was cancelled; every rank raises this at the same step."""


class JobFailed(RuntimeError):
    """A rank failed; every rank raises this at the same step, with every failing rank's message."""

    code = "generation_failed"
    """The job's error code (the server's ``error.code``)."""


class JobOutOfMemory(JobFailed):
    """A rank ran out of device memory in the job; every rank raises this at the same step. The group keeps serving:
    what the job held is freed when the exception is (the allocator's cache emptied on CUDA)."""

    code = "out_of_memory"


def job_failure(message: str, code: str = JobFailed.code) -> JobFailed:
    """The :class:`JobFailed` (or subclass) of ``code``, for a failure reported from another process."""
    return JobOutOfMemory(message) if code == JobOutOfMemory.code else JobFailed(message)


@dataclass
class Prepared:
    """What a model prepares for one request (identical on every rank)."""

    latents: dict[str, torch.Tensor]
    """Packed initial noise ``[B, S, C]`` per token stream (``"video"``, and ``"audio"`` for audio-video models),
    over the whole sequence (float32). Each stream is sharded by its own :class:`ShardPlan`."""
    timesteps: Sequence[torch.Tensor]
    state: Any = None
    """The adapter's own typed per-request state (text embeddings, generator, masks...), opaque to the sampler."""


class DenoiseModel(Protocol):
    """What the sampler needs from a model adapter."""

    geometry: VideoGeometry
    options: ModelOptions
    """Every option its requests may set, with its defaults (``cp_infer.options``)."""

    def plan(self, request: GenerationRequest) -> Plan:
        """The passes that generate ``request`` (resolved and checked), the same on every rank."""

    def prepare(self, request: GenerationRequest, shape: LatentShape, *, kind: str = "denoise",
                previous: dict[str, torch.Tensor] | None = None, previous_state: Any = None) -> Prepared:
        """A pass's initial latents, schedule and per-request state (the same on every rank): the pass's
        ``request`` and ``kind`` (``DenoisePass``); ``previous``: the gathered latents of the plan's pass before,
        ``None`` for the first; ``previous_state``: that pass's ``Prepared.state`` (its shape, its generator, to
        go on drawing from), ``None`` for the first."""

    def predict(self, latents_local: dict[str, torch.Tensor], t: torch.Tensor, prepared: Prepared,
                plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        """The guided model output for this rank's shard of every stream (collectives inside, same on every
        rank). With a guidance group the rank runs its share of the step's passes (``cp_infer.mesh.pass_shares``),
        exchanges them (``cp_infer.collectives.gather_passes``) and applies the guidance to all of them, so every
        guidance rank returns the same output."""

    def step(self, noise_pred_local: dict[str, torch.Tensor], t: torch.Tensor,
             latents_local: dict[str, torch.Tensor], prepared: Prepared,
             plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]: ...

    def output_latents(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> dict[str, np.ndarray]:
        """The full packed latents as the model's reference pipeline returns them for ``output_type="latent"``
        (conditioning tokens dropped, unpacked), by name (``"latents"``, ``"audio_latents"``)."""

    def decoder(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> Decoder:
        """How to decode the full packed latents of every stream (same on every rank)."""

    # Optional, for plans whose passes make the video's latents final a part at a time (a long video's windows):
    # ``finish_pass(latents, prepared) -> int | None``: fold a pass's gathered latents into the request's state, and
    # say how many latent frames of the video are now final (``None``: none to decode before the plan's end);
    # ``checkpoint(state) -> dict[str, np.ndarray] | None``: that state, to go on from (``None``: a pass the job cannot
    # go on from); ``restore(request, arrays) -> (state, final)``: the state back (the next pass's
    # ``previous_state``) and its final latent frames (or ``None``).
    # Optional, for models with a step cache: ``cache_stats(prepared) -> CacheStats | None``, called on every rank after
    # every step (collectives inside, the same on every rank): what the pass's cache saved in that step (``None``: the
    # pass has none).


@dataclass(frozen=True)
class Decoder:
    """A model's decode of one finished generation (see ``cp_infer.decode``)."""

    split: Split
    """The latent frames each rank decodes (of one video, or of segments each decoded alone)."""
    frame_shape: tuple[int, ...]
    """The shape of one frame, ``(H, W, 3)``."""
    decode_range: Callable[[int, int], np.ndarray]
    """Decodes latent frames ``[a, b)`` on this rank (frames relayed between ranks inside) to uint8 frames
    ``[F, H, W, 3]``."""
    reads: Callable[[int, int], int] | None = None
    """``reads(a, b)``: decoding latent frames ``[a, b)`` reads the latents ``[0, reads)`` (the decoder's look-ahead
    included); with ``feed``, the decode of a piece waits until those are final. ``None``: all of them."""
    feed: Callable[[Any, int], None] | None = None
    """For a plan whose passes make the latents final a part at a time: ``feed(state, final)`` gives the decoder the
    latent frames ``[0, final)`` of a pass's ``Prepared.state`` (called after each such pass, in order, before the
    decode of what they allow; the decoder was made from the first)."""
    rounds_alone: bool = False
    """Each round of ``split`` is decoded on its own (no state carried over from the rounds before it), so a live
    video's decoder, made again for the longer video, may start at the first round not yet decoded where its rounds
    so far are the shorter video's; otherwise it decodes the video again from the start."""
    length_free: bool = True
    """Each frame it decodes is the same however long the video is; ``False`` where the decode reads something drawn
    for the whole video at once (a timestep-conditioned VAE's decode noise), so a live video's frames wait for its
    end (more windows would change them)."""
    skip: int = 0
    """Decoded video frames that are not delivered, at the start (an extension's: the frames of the video it
    extends, decoded again only as the decoder's context)."""
    audio: Callable[[], tuple[np.ndarray, int]] | None = None
    """For audio-video models: decodes the whole soundtrack to a float waveform ``[C, S]`` in [-1, 1] and its sample
    rate (with ``feed``: once every latent frame was fed). Called on the delivering rank only
    (``ParallelState.delivers``; no collectives inside), before the video decode."""
    audio_piece: Callable[[], tuple[np.ndarray, int]] | None = None
    """With ``feed``, for audio-video models whose soundtrack can be decoded a part at a time: the soundtrack's next
    samples ``[C, s]`` (those the latents fed so far make final and no earlier call returned; after the last feed,
    the rest), equal to ``audio()``'s within float rounding, and the sample rate. Called on the delivering rank only
    (no collectives inside), after each ``feed``; ``None``: the soundtrack is decoded whole, at the end."""


@dataclass
class SampleControl:
    """Hooks the caller (CLI, worker loop) gives the sampler. All are optional."""

    poll: Callable[[int], StepStatus] | None = None
    """Called on every rank before step ``i`` (and once more, with ``i == total``, before the gather); may
    return CANCEL, or raise: an exception counts as ERROR with its message."""
    on_step: Callable[[int, int, float], None] | None = None
    """``(steps_done, total, seconds_of_this_step)`` after every step, on every rank."""
    on_cache: Callable[[CacheStats], None] | None = None
    """A cached request's totals so far (steps computed and skipped, block evaluations saved), on every rank after
    every step, before ``on_step``; never called for a request without a step cache."""
    on_phase: Callable[[str], None] | None = None
    """Phase changes: ``"denoise"``, ``"decode"``, ``"done"``."""
    on_audio: Callable[[np.ndarray, int], None] | None = None
    """``(waveform [C, S], sample_rate)`` on the delivering rank, once, before the first ``on_frames``; audio-video
    models only, and only where ``on_audio_piece`` is unset. A long video's frames then wait for its last window (the
    whole soundtrack comes first)."""
    on_audio_piece: Callable[[np.ndarray, int, int], None] | None = None
    """``(samples [C, s], first_sample, sample_rate)`` on the delivering rank: the soundtrack piece by piece, in order
    (audio-video models; instead of ``on_audio``). A long video's come as its windows make them final, each before the
    frames that the same window allows, so that the video streams with its sound; any other video's soundtrack is one
    piece, before the first ``on_frames``. Together the pieces are the ``on_audio`` waveform (within float rounding
    where pieces are decoded a part at a time: ``Decoder.audio_piece``)."""
    on_latents: Callable[[dict[str, np.ndarray]], None] | None = None
    """The final latents (``DenoiseModel.output_latents``) on the delivering rank, once, before the decode."""
    on_frames: Callable[[np.ndarray, int, int], None] | None = None
    """``(frames, first_frame_index, total_frames)`` on the delivering rank for each decoded chunk, in temporal order
    (a streaming encoder writes them as they come)."""
    on_pass: Callable[[int, Plan], None] | None = None
    """``(index, plan)`` on every rank before each pass of the plan runs (a long video's window:
    ``plan.passes[index].window``)."""
    on_checkpoint: Callable[[int, dict[str, np.ndarray]], None] | None = None
    """``(passes_done, arrays)`` on the delivering rank after each pass the job can go on from (a long video's
    window; ``DenoiseModel.checkpoint``): given back as ``resume``, the job continues there."""
    resume: tuple[int, dict[str, np.ndarray]] | None = None
    """A checkpoint (``on_checkpoint``'s) to go on from, the same on every rank: its passes are not run again, and
    the video is decoded from its first frame."""
    collect: bool = True
    """Also return the whole video; a streaming caller sets False so no rank ever holds every frame."""
    live: bool = False
    """A live video (``cp_infer.live``): once its plan's last pass is made, it goes on as long as ``extend`` directs
    it. Set on every rank of the replica group."""
    extend: Callable[[int, GenerationRequest], Any] | None = None
    """A live video's directions, on the replica group's first rank (the others take its answer): called once every
    pass of the plan is made (before the last one is finished: whether it is the video's last depends on the answer),
    with the passes made and the request so far; returns the request that goes on (the same video with more windows,
    ``cp_infer.live.live_request``), ``None`` (the video ends here) or ``cp_infer.live.WAIT`` (nothing new yet: asked
    again after a ``poll``, so a cancel ends the wait). It should return within a second or so."""


def _agree(status: StepStatus, message: str, *, state: ParallelState) -> None:
    """One collective that every rank always calls; raises on every rank if any rank is not OK."""
    agreed = StepStatus(all_reduce_max_int(int(status), state=state))
    if agreed == StepStatus.OK:
        return
    if agreed == StepStatus.CANCEL:
        raise JobCancelled("cancelled")
    if agreed == StepStatus.OUT_OF_MEMORY:
        _free_cached(state.device)
    messages: list[Any] = [None] * len(state.replica_ranks)
    if state.cpu_group is None:
        messages = [message]
    else:
        dist.all_gather_object(messages, (state.rank, status, message), group=state.cpu_group)
        messages = [f"rank {r}: {m}" for r, s, m in messages if s >= StepStatus.ERROR]
    raise (JobOutOfMemory if agreed == StepStatus.OUT_OF_MEMORY else JobFailed)("; ".join(messages))


def _out_of_memory(exc: torch.OutOfMemoryError) -> tuple[StepStatus, str]:
    # The allocator's message is long (its advice on PYTORCH_CUDA_ALLOC_CONF): its first two sentences say what ran
    # out and what was asked for.
    first = ". ".join(str(exc).split("\n")[0].split(". ")[:2])
    return StepStatus.OUT_OF_MEMORY, (f"out of device memory ({first}); lower the frames or the size, spread the job "
                                      "over more ranks, or use --weights sharded / --offload")


def _free_cached(device: torch.device) -> None:
    """Give the allocator's cached blocks back to the device, once the failed job's tensors are dropped."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


class _CacheTotals:
    """A request's step-cache totals over its passes."""

    def __init__(self) -> None:
        self.value = CacheStats()


def _run_pass(model: DenoiseModel, pass_: DenoisePass, previous: dict[str, torch.Tensor] | None,
              previous_state: Any, *, done: int, total: int, limits: GenerationLimits, control: SampleControl,
              state: ParallelState, cached: _CacheTotals) -> tuple[dict[str, torch.Tensor], Prepared]:
    """One pass of a plan: prepare (agreed on), the sharded loop, the gather. Returns the full latents."""
    shape = check_request(pass_.request, geometry=model.geometry, limits=limits, options=model.options, planned=True)
    # Preparing (text encoding, media encoding, noise, schedule) is local to each rank: agreed on like a step, so
    # that a failure on any rank fails the job on every rank instead of leaving the others in the first exchange.
    prepared_box: list[Prepared] = []

    def prepare() -> None:
        prepared = model.prepare(pass_.request, shape, kind=pass_.kind, previous=previous,
                                 previous_state=previous_state)
        assert len(prepared.timesteps) == pass_.steps, (len(prepared.timesteps), pass_.steps)
        prepared_box.append(prepared)

    _agree(*_run_hook(prepare), state=state)
    prepared = prepared_box[0]
    plans = {name: ShardPlan(orig_len=x.shape[1], world=state.cp_size) for name, x in prepared.latents.items()}
    latents = {name: plans[name].shard(x, state.cp_rank).to(state.device) for name, x in prepared.latents.items()}
    cache_stats = getattr(model, "cache_stats", None)
    for i, t in enumerate(prepared.timesteps):
        _agree(*_poll(control, done + i), state=state)
        started = time.perf_counter()
        oom = None
        try:
            noise_pred = model.predict(latents, t, prepared, plans)
            latents = model.step(noise_pred, t, latents, prepared, plans)
        except torch.OutOfMemoryError as exc:
            # NOTE(oom): agreed on at once, like a poll's status: every rank that ran out of memory in the same step
            # (the ranks' shapes are the same, so they do together) fails the job in step. A rank left alone inside
            # one of the step's collectives waits out the collective timeout, and the group restarts.
            oom = _out_of_memory(exc)
        if oom is not None:
            noise_pred = None  # the previous step's (this step's activations went with the exception's frames)
            _agree(*oom, state=state)
        for name, plan in plans.items():
            # Padding rows carry no meaning; keep them at zero so they can never grow without bound.
            latents[name][:, plan.valid_len(state.cp_rank):] = 0
        saved = None if cache_stats is None else cache_stats(prepared)
        if saved is not None:
            cached.value = cached.value + saved
            if control.on_cache:
                control.on_cache(cached.value)
        if control.on_step:
            control.on_step(done + i + 1, total, time.perf_counter() - started)
    full = {name: gather_sequence(x, plan=plans[name], group=state.cp_group) for name, x in latents.items()}
    return full, prepared


def _run_hook(hook: Callable[[], StepStatus | None]) -> tuple[StepStatus, str]:
    try:
        return StepStatus(hook() or StepStatus.OK), ""
    except torch.OutOfMemoryError as exc:
        return _out_of_memory(exc)
    except Exception as exc:  # noqa: BLE001 -- any failure must become an agreed status, not a desync
        return StepStatus.ERROR, f"{type(exc).__name__}: {exc}"


def _poll(control: SampleControl, i: int) -> tuple[StepStatus, str]:
    if control.poll is None:
        return StepStatus.OK, ""
    return _run_hook(lambda: control.poll(i))


@torch.inference_mode()
def sample(
    model: DenoiseModel,
    request: GenerationRequest,
    *,
    state: ParallelState,
    limits: GenerationLimits | None = None,
    control: SampleControl | None = None,
) -> np.ndarray | None:
    """Generate one video. Returns uint8 frames ``[F, H, W, 3]`` on the delivering rank
    (``ParallelState.delivers``), ``None`` on the others. Options
    ``request`` leaves unset take the model's declared defaults."""
    control = control or SampleControl()
    limits = limits or GenerationLimits()
    request = resolve_request(request, model.options, limits=limits, geometry=model.geometry)
    check_request(request, geometry=model.geometry, limits=limits, options=model.options)
    plan = model.plan(request)
    total = plan.steps
    video = _Delivery(model, control, state)
    full: dict[str, torch.Tensor] = {}
    prepared: Prepared | None = None
    start = 0
    if control.resume is not None:
        start, arrays = control.resume
        if not 0 < start < len(plan.passes):
            raise ValueError(f"a checkpoint after pass {start} of a plan of {len(plan.passes)} passes")
        box: list[Any] = []
        # Agreed on: a checkpoint that does not fit this request fails the job on every rank alike.
        _agree(*_run_hook(lambda: box.append(model.restore(request, arrays))), state=state)
        restored, final = box[0]
        prepared = Prepared(latents={}, timesteps=(), state=restored)
        if final is not None:
            video.progress(full, prepared, final)
    done = sum(p.steps for p in plan.passes[:start])
    if control.on_phase:
        control.on_phase("denoise")
    finish = getattr(model, "finish_pass", None)
    cached = _CacheTotals()
    index = start - 1
    while index + 1 < len(plan.passes):
        index += 1
        pass_ = plan.passes[index]
        if control.on_pass:
            control.on_pass(index, plan)
        full, prepared = _run_pass(model, pass_, full or None, None if prepared is None else prepared.state,
                                   done=done, total=total, limits=limits, control=control, state=state,
                                   cached=cached)
        done += pass_.steps
        if control.live and index + 1 == len(plan.passes):
            grown = _directed(model, control, index + 1, request, done, limits=limits, state=state)
            if grown is not None:
                request, plan = grown
                total = plan.steps
                prepared, final = _go_on(model, control, full, prepared, request, index + 1, state=state)
                full = {}
                video.restart()
                if final is not None:  # a restored state that decodes nothing yet (as a resumed job's)
                    video.progress(full, prepared, final)
                continue
        if finish is None:
            continue
        final_box: list[int | None] = []

        def finished(index=index, full=full, prepared=prepared, final_box=final_box, plan=plan) -> None:
            final_box.append(finish(full, prepared))
            arrays = model.checkpoint(prepared.state)
            if arrays is not None and control.on_checkpoint and state.delivers and index + 1 < len(plan.passes):
                control.on_checkpoint(index + 1, arrays)

        _agree(*_run_hook(finished), state=state)
        if final_box[0] is not None and index + 1 < len(plan.passes):
            video.progress(full, prepared, final_box[0])
    if control.on_phase:
        control.on_phase("decode")
    status, message = _poll(control, total)
    if status == StepStatus.OK:
        # Everything before the video decode's relayed frames is local: run it before the agreement, so that a
        # failure on one rank (the soundtrack is decoded on the delivering rank alone) ends the job on every rank.
        status, message = _run_hook(lambda: video.prepare_last(full, prepared))
    _agree(status, message, state=state)
    video.decode(None)
    if control.on_phase:
        control.on_phase("done")
    if not state.delivers:
        return None
    return np.concatenate(video.pieces) if control.collect else None


def _directed(model: DenoiseModel, control: SampleControl, passes_done: int, request: GenerationRequest, done: int,
              *, limits: GenerationLimits, state: ParallelState) -> tuple[GenerationRequest, Plan] | None:
    """A live video's next request and plan once its plan is made (``SampleControl.extend``, asked on the replica
    group's first rank until it answers, its answer broadcast), checked on every rank alike; ``None``: it ends."""
    from .collectives import broadcast_object
    from .live import WAIT

    while True:
        answer: Any = None
        if state.rank == state.replica_ranks[0]:
            answer = _ask(control, passes_done, request)
        kind, value = broadcast_object(answer, state=state)
        if kind == "error":
            lead = state.rank == state.replica_ranks[0]
            _agree(StepStatus.ERROR if lead else StepStatus.OK, value if lead else "", state=state)
        if value is not WAIT:
            break
        # Nothing new yet: a cancel ends the wait on every rank alike.
        _agree(*_poll(control, done), state=state)
    if value is None:
        return None
    box: list[tuple[GenerationRequest, Plan]] = []

    def check() -> None:
        grown = resolve_request(value, model.options, limits=limits, geometry=model.geometry)
        check_request(grown, geometry=model.geometry, limits=limits, options=model.options)
        plan = model.plan(grown)
        old = model.plan(request)
        same = [(p.kind, p.window, p.steps, p.request.prompt) for p in old.passes]
        if len(plan.passes) <= passes_done or \
                [(p.kind, p.window, p.steps, p.request.prompt) for p in plan.passes[:passes_done]] != same:
            raise ValueError("a live video's next request must go on from its passes made (the same first passes "
                             "and more)")
        box.append((grown, plan))

    _agree(*_run_hook(check), state=state)
    return box[0]


def _ask(control: SampleControl, passes_done: int, request: GenerationRequest) -> tuple[str, Any]:
    """The replica group's first rank: ``extend``'s answer, or its error's message."""
    asked: list[Any] = []
    status, message = _run_hook(lambda: asked.append(control.extend(passes_done, request) if control.extend
                                                     else None))
    return ("ok", asked[0]) if status == StepStatus.OK else ("error", message)


def _go_on(model: DenoiseModel, control: SampleControl, full: dict[str, torch.Tensor], prepared: Prepared,
           request: GenerationRequest, passes_done: int, *, state: ParallelState) -> tuple[Prepared, int | None]:
    """The pass just made, finished as one that more follow in the longer ``request``: finished, checkpointed and
    restored as a resumed job of that request is (the model's ``restore`` makes its state the longer video's)."""
    box: list[tuple[Prepared, int | None]] = []

    def go_on() -> None:
        finish, restore = getattr(model, "finish_pass", None), getattr(model, "restore", None)
        if finish is None or restore is None:
            raise ValueError("a live video needs a model whose plan is made window by window, with checkpoints")
        finish(full, prepared)
        arrays = model.checkpoint(prepared.state)
        restored, final = restore(request, arrays)
        if control.on_checkpoint and state.delivers:
            control.on_checkpoint(passes_done, arrays)
        box.append((Prepared(latents={}, timesteps=(), state=restored), final))

    _agree(*_run_hook(go_on), state=state)
    return box[0]


class _Delivery:
    """The video's decode and delivery: once at the end, or, for a plan whose passes make the latents final a part at
    a time (a long video's windows: ``DenoiseModel.finish_pass``), streamed as they become final. The soundtrack of
    an audio-video model goes first: whole (``on_audio``; a long video's frames then wait for the end), or piece by
    piece (``on_audio_piece``), each piece before the frames decoded after the same feed."""

    def __init__(self, model: DenoiseModel, control: SampleControl, state: ParallelState):
        self.model, self.control, self.state = model, control, state
        self.decoder: Decoder | None = None
        self.stream: ProgressiveDecode | None = None
        self.pieces: list[np.ndarray] = []
        self.delivered = self.skipped = self.samples = 0
        self.hold = False
        """The frames wait for the end: the soundtrack goes first, whole."""
        self.before: tuple[Split, int] | None = None
        """A live video grown (:meth:`restart`): the decode's split and rounds done before it grew."""
        self.replay = self.replayed = 0
        """Frames delivered before a live video grew that its new decode makes again (not delivered twice)."""
        self.resound = 0
        """Soundtrack samples delivered before a live video grew that its new decode makes again, not yet dropped."""

    def _start(self, full: dict[str, torch.Tensor], prepared: Prepared) -> None:
        decoder = self.model.decoder(full, prepared)
        self.decoder = decoder
        self.stream = ProgressiveDecode(decoder.split, decoder.decode_range, frame_shape=decoder.frame_shape,
                                        state=self.state.decoding, reads=decoder.reads)
        if self.before is not None:
            split, rounds = self.before
            self.before = None
            new = decoder.split
            # NOTE(live): the new decode goes on where the old one stopped only where its rounds so far are the old
            # ones and the next reads nothing they left (``Split.afresh``: a segment's first round; or each round
            # decoded alone, ``Decoder.rounds_alone``, on one active rank: no frames relayed across rounds); otherwise
            # it decodes the video again from its first frame, and the frames already delivered are dropped.
            alone = decoder.rounds_alone and new.active == 1
            if rounds <= new.rounds and (alone or new.afresh(rounds)) and split.active == new.active and all(
                    (split.latent_range(r, k), split.video_range(r, k)) == (new.latent_range(r, k),
                                                                            new.video_range(r, k))
                    for r in range(new.active) for k in range(rounds)):
                self.stream.rounds_done = rounds
            else:
                self.replay, self.replayed = self.delivered, 0

    def restart(self) -> None:
        """A live video grew (more windows): the decoder is made again, for the longer video, when next fed."""
        if self.stream is not None:
            self.before = (self.stream.split, self.stream.rounds_done)
        self.decoder = self.stream = None
        self.resound = self.samples  # the new decode's soundtrack pieces start again from the first sample

    def _audio_mode(self) -> int:
        """What the delivering rank's caller takes: 0 no soundtrack, 1 pieces, 2 the whole waveform."""
        if not self.state.delivers or self.decoder.audio is None:
            return 0
        return 1 if self.control.on_audio_piece else 2 if self.control.on_audio else 0

    def _deliver_audio(self, piece: tuple[np.ndarray, int]) -> None:
        samples, rate = piece
        dropped = min(self.resound, samples.shape[1])
        self.resound, samples = self.resound - dropped, samples[:, dropped:]
        if not samples.shape[1]:
            return
        self.control.on_audio_piece(samples, self.samples, rate)
        self.samples += samples.shape[1]

    def progress(self, full: dict[str, torch.Tensor], prepared: Prepared, final: int) -> None:
        """Decode and deliver what the latent frames ``[0, final)`` allow (every rank, agreed on)."""
        started = self.decoder is not None

        def feed() -> None:
            if self.decoder is None:
                self._start(full, prepared)
            if self.decoder.feed is None:
                raise RuntimeError("a plan that makes its latents final a part at a time needs Decoder.feed")
            self.decoder.feed(prepared.state, final)
            if self.state.delivers and self._audio_mode() == 1 and self.decoder.audio_piece is not None:
                self._deliver_audio(self.decoder.audio_piece())

        _agree(*_run_hook(feed), state=self.state)
        if not started:
            # NOTE(hold): the hooks are the delivering rank's alone, and whether the frames wait decides the decode's
            # collectives on every rank: the mesh takes that rank's answer.
            mode = self._audio_mode()
            hold = mode == 2 or (mode == 1 and self.decoder.audio_piece is None) or (
                self.control.live and not self.decoder.length_free)
            self.hold = bool(all_reduce_max_int(int(hold), state=self.state))
        if not self.hold:
            self.decode(final)

    def prepare_last(self, full: dict[str, torch.Tensor], prepared: Prepared) -> None:
        if self.control.on_latents and self.state.delivers:
            self.control.on_latents(self.model.output_latents(full, prepared))
        if self.decoder is None:
            self._start(full, prepared)
        if self.decoder.feed is not None:
            self.decoder.feed(prepared.state, self.decoder.split.latent_frames)
        mode = self._audio_mode()
        if mode == 1 and self.decoder.audio_piece is not None and not self.hold:
            self._deliver_audio(self.decoder.audio_piece())  # the rest
        elif mode == 1:
            self._deliver_audio(self.decoder.audio())
        elif mode == 2:
            self.control.on_audio(*self.decoder.audio())

    def decode(self, final: int | None) -> None:
        # NOTE(decode): collectives of the decode's group (``ParallelState.decoding``: the whole mesh).
        if self.stream is None:
            return
        skip = self.decoder.skip
        total = self.decoder.split.video_frames - skip
        for frames in self.stream.advance(final):
            if self.skipped < skip:
                dropped = min(skip - self.skipped, frames.shape[0])
                self.skipped, frames = self.skipped + dropped, frames[dropped:]
                if not frames.shape[0]:
                    continue
            if self.replayed < self.replay:
                dropped = min(self.replay - self.replayed, frames.shape[0])
                self.replayed, frames = self.replayed + dropped, frames[dropped:]
                if not frames.shape[0]:
                    continue
            if self.control.on_frames:
                self.control.on_frames(frames, self.delivered, total)
            self.delivered += frames.shape[0]
            if self.control.collect:
                self.pieces.append(frames)
