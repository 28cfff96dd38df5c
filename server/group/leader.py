"""The group leader: rank 0's threads that run queued jobs on the worker group, one lane per replica group.

Invariants:
- Every collective of rank 0's own replica (the model load's, heartbeats, each job's) is issued from the leader
  thread; with more replicas (``server.group.replicas``), each other replica has a lane thread of its own that drives it
  over its link and issues nothing else. Idle lanes wait on the queue together, so a job goes to the first idle
  replica; each lane keeps its own running job, heartbeat and counts (``/ready``, ``/metrics``). The HTTP thread
  only reads and writes the job store, never the process group. Encoding the MP4 (rank 0's alone) runs on encoder
  threads (one per replica), so a lane is back to heartbeats and the next job while it runs. A streamed job
  (``submit_streamed``) is the exception: its lane thread encodes each decoded piece as it lands, with
  ``collect=False``, so that its bytes reach the client during the decode and rank 0 never holds the whole video
  (see ``server.outputs.streaming``).
- Every command goes to the group through ``server.group.runtime.GroupDriver``, the leader side of the command
  protocol that the CLI uses too. While waiting for work the leader pings the group every ``heartbeat_s``; each
  rank answers with one all-reduce, so the round trip proves the whole group is alive (``/ready``) and no worker
  sits in a broadcast longer than the collective timeout.
- A job's request is re-checked here against the same limits and geometry every rank uses, then broadcast;
  only these server-built requests are ever broadcast (``broadcasts`` counts them, ``/metrics`` shows it).
- Cancel: the leader's step ``poll`` returns CANCEL once the job is cancelled or deleted; the sampler's
  all-reduce (max) makes every rank stop at that same step. A streamed job whose cancel comes during the decode
  (which cannot stop safely; its client left, say) finishes the decode and then ends cancelled. An exception on
  any rank (or in any rank's poll) fails the job on every rank at the same step and the group goes on to the next
  job.
- Rank 0's own hooks (progress, decoded frames) never raise into the sampler: their exceptions are kept and fail
  the job once every rank has left it; so do exceptions in encoding the MP4, which is rank 0's alone. Any other
  exception escaping the sampler may leave the group out of step (a rank can be inside a step's or the parallel
  decode's collectives), so the leader fails the job and ends the process (exit 1): torchrun restarts the
  group, and the new leader finds the queue in the job store.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from cp_infer.options import ModelOptions
from cp_infer.request import GenerationLimits, check_request, resolve_request
from server.group import phases
from server.group.jobs import Job, JobStore
from server.group.live import LiveDirector
from server.group.tenants import OPEN, Tenant
from server.outputs.store import StoreUnavailable
from server.outputs.streaming import StreamedOutputs, VideoStream

if TYPE_CHECKING:
    from server.group.runtime import GroupDriver, RuntimeConfig

__all__ = ["GroupLeader", "LeaderConfig", "Histogram", "group_pids", "FATAL_EXIT_CODE"]

log = logging.getLogger("cp_infer.leader")

FATAL_EXIT_CODE = 1
# Progress: denoising fills 0..90 (by steps, over every window of a long video), the decode 90..97 (by frames
# delivered once the denoising is done), encoding the MP4 the rest.
_DENOISE_SHARE, _DECODED = 90, 97


@dataclass(frozen=True)
class LeaderConfig:
    runtime: RuntimeConfig
    """The model, dtype, device, collective timeout and request limits (the same on every rank)."""
    data_dir: Path = Path("cp-infer-data")
    """Where ``jobs.sqlite3``, the ``videos/`` and ``group.json`` live."""
    heartbeat_s: float = 2.0
    """How often an idle leader pings the group; must be well under the collective timeout."""
    max_queue: int = 16
    """Queued jobs beyond which submissions get 429."""
    keep_frames: bool = False
    """Also keep each video's raw uint8 frames (``.npy``, lossless) for ``variant=frames`` (large; for tests)."""
    model_name: str | None = None
    """The name clients pass as ``model``; default: ``models.common.loading.model_name`` (a hub id as written, a
    folder's name, the embedded default's name)."""

    job_store: str | None = None
    """The job store's URL (``postgresql://...``: shared by a fleet); ``None``: the SQLite file in ``data_dir``."""
    output_store: str | None = None
    """The output store's URL (``s3://BUCKET/PREFIX``); ``None``: ``data_dir/videos``."""
    lease_s: float = 30.0
    """With a shared job store: how long a running job's claim holds without renewal."""
    live_idle_s: float = 120.0
    """A live video whose every directed window is made ends there (completed) after this long without a new
    direction (``server.group.live``)."""

    def __post_init__(self) -> None:
        if self.job_store is not None and not self.job_store.startswith(("postgresql://", "postgres://",
                                                                           "sqlite://")):
            raise ValueError(f"--job-store {self.job_store.split('://')[0]}://... is not a job store; use "
                             "postgresql://USER:PASS@HOST/DB (or leave it out: the SQLite file in --data-dir)")
        if self.output_store is not None and not self.output_store.startswith(("s3://", "file://")):
            raise ValueError(f"--output-store {self.output_store.split('://')[0]}://... is not an output store; use "
                             "s3://BUCKET/PREFIX (or leave it out: --data-dir/videos)")
        if (self.job_store or "").startswith("postgres") and not (self.output_store or "").startswith("s3://"):
            raise ValueError("--job-store postgresql://... is shared by servers that each serve every job's video: "
                             "give them a shared --output-store s3://BUCKET/PREFIX too")
        if not self.lease_s > 0:
            raise ValueError(f"--lease-s {self.lease_s} must be > 0")
        if not self.live_idle_s >= 0:
            raise ValueError(f"--live-idle-s {self.live_idle_s} must be >= 0")
        if not 0 < self.heartbeat_s < self.runtime.timeout_s / 2:
            raise ValueError(f"heartbeat_s={self.heartbeat_s} must be > 0 and under half the collective timeout "
                             f"({self.runtime.timeout_s} s)")
        if self.max_queue < 1:
            raise ValueError(f"max_queue={self.max_queue} must be >= 1")

    @property
    def served_model(self) -> str:
        if self.model_name:
            return self.model_name
        from models.common.loading import model_name

        return model_name(self.runtime.model)

    @property
    def limits(self) -> GenerationLimits:
        return self.runtime.limits


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count); thread-safe."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.sum += value
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self.counts[i] += 1
                    break
            else:
                self.counts[-1] += 1

    @property
    def count(self) -> int:
        return sum(self.counts)

    def lines(self, name: str) -> list[str]:
        with self._lock:
            out, running = [], 0
            for bound, n in zip((*self.buckets, float("inf")), self.counts, strict=True):
                running += n
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                out.append(f'{name}_bucket{{le="{le}"}} {running}')
            out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {running}"]
        return out


def group_pids(state) -> list[int]:
    """Every rank's pid, in rank order (one all-gather over the whole world; every rank must call it, at start-up)."""
    import torch.distributed as dist

    if state.world_group is None:
        return [os.getpid()]
    pids: list[Any] = [None] * state.world_size
    dist.all_gather_object(pids, os.getpid(), group=state.world_group)
    return pids


_DONE_STATES = ("completed", "failed", "cancelled")


@dataclass
class Lane:
    """One replica group as the leader drives it: its driver (``GroupDriver`` for rank 0's own, else
    ``server.group.replicas.RemoteDriver``) and what ``/ready`` and ``/metrics`` report of it."""

    replica: int
    ranks: tuple[int, ...]
    driver: Any
    current_job: str | None = None
    last_ping_rtt_s: float | None = None
    last_contact_at: float | None = None
    """When a collective over the whole replica last completed (a heartbeat, a step, a job's end)."""
    jobs_done: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_DONE_STATES, 0))


class GroupLeader:
    """Runs jobs from ``store`` on the worker group; see the module docstring for the invariants."""

    def __init__(self, config: LeaderConfig, store: JobStore, *, runtime_factory=None, exit_on_fatal: bool = True):
        self.config = config
        self.store = store
        self._runtime_factory = runtime_factory
        self._exit_on_fatal = exit_on_fatal
        self._stopping = threading.Event()
        self._serving = threading.Event()
        """Set by :meth:`start` (or :meth:`stop`): the leader thread may take jobs from the store."""
        self._thread: threading.Thread | None = None
        self._faults: tuple = ()
        self.lanes: list[Lane] = []
        """One per replica group, the first rank 0's own (set once the group has formed)."""
        self._lane_threads: list[threading.Thread] = []
        self._counts_lock = threading.Lock()
        self._encoder: ThreadPoolExecutor | None = None
        self._streams: dict[str, VideoStream] = {}  # streamed jobs not yet claimed, by id
        self._streams_lock = threading.Lock()
        # Read by the HTTP thread.
        self.geometry = None
        self._model_info = None
        self._lora_catalog = None
        self._loaded_options: ModelOptions | None = None
        self.world_size: int | None = None
        self.layout: dict[str, int] | None = None
        self.pids: list[int] = []
        self.loaded = False
        self.fatal: str | None = None
        self.jobs_done: dict[str, int] = dict.fromkeys(_DONE_STATES, 0)
        self.step_seconds = Histogram((0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.generation_seconds = Histogram((0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
        self.blocks_saved = 0
        """Transformer block evaluations the step caches of this leader's jobs saved (``/metrics``)."""
        self.memory: list[dict] = []
        """Every rank's weights and where they are, measured at start-up (``/ready``, ``/metrics``)."""
        self.restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    # -- the HTTP side -----------------------------------------------------------------------------------------
    @property
    def limits(self) -> GenerationLimits:
        return self.config.limits

    @property
    def served_model(self) -> str:
        return self.config.served_model

    @property
    def options(self) -> ModelOptions:
        """The loaded model's declared options; before it is loaded, read from its config files."""
        return self._loaded_options or self._info.options

    @property
    def family(self) -> str:
        return self._info.family

    @property
    def _info(self):
        """The served model's ``models.registry.ModelInfo`` (its config files; read once)."""
        if self._model_info is None:
            from models.registry import describe_model

            runtime = self.config.runtime
            self._model_info = describe_model(runtime.model, config=runtime.model_config, upsampler=runtime.upsampler)
        return self._model_info

    @property
    def _loras(self):
        """The front end's ``models.common.lora.LoraCatalog`` (the ``--lora-dir`` adapters and the model's modules)."""
        if self._lora_catalog is None:
            from models.registry import lora_catalog

            runtime = self.config.runtime
            self._lora_catalog = lora_catalog(self._info, runtime.lora_dir,
                                              slot_rank=runtime.max_lora_rank if runtime.compile_blocks else None)
        return self._lora_catalog

    def adapters(self) -> list[dict]:
        """Each adapter of ``--lora-dir``: ``name``, ``bytes`` (its tensors, as stored) and ``loaded`` (on rank 0's
        replica now)."""
        lanes = self.lanes
        loras = getattr(lanes[0].driver.runtime.model, "loras", None) if lanes else None
        loaded = set() if loras is None else set(loras.loaded())
        return [{**adapter, "loaded": adapter["name"] in loaded} for adapter in self._loras.adapters()]

    def check_loras(self, loras, *, stages: int = 1) -> None:
        """``ValueError`` naming ``loras[i]`` for an adapter this server cannot apply (``Engine.check_loras``)."""
        if loras:
            from models.common.lora import check_stage_2

            self._loras.check(loras)
            check_stage_2(loras, self.config.runtime.stage_2_loras, stages=stages)

    @property
    def keep_frames(self) -> bool:
        return self.config.keep_frames

    @property
    def broadcasts(self) -> int:
        """Jobs broadcast to the replica groups so far."""
        return sum(lane.driver.jobs_sent for lane in self.lanes)

    @property
    def last_ping_rtt_s(self) -> float | None:
        """The slowest replica's last heartbeat round trip."""
        rtts = [lane.last_ping_rtt_s for lane in self.lanes if lane.last_ping_rtt_s is not None]
        return max(rtts) if rtts else None

    @property
    def current_job(self) -> str | None:
        """A running job (the first replica's that has one)."""
        return next((lane.current_job for lane in self.lanes if lane.current_job), None)

    def preload(self) -> None:
        """Start joining the group and loading the model now, ahead of :meth:`start` (which the front end calls once
        the store is recovered): the leader thread takes no job before then."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name="cp-infer-leader", daemon=True)
            self._thread.start()

    def start(self) -> None:
        self.preload()
        self._serving.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._serving.set()
        self.store.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._encoder is not None:
            # An encode in flight finishes (its job completes); a restarted leader would otherwise fail it.
            self._encoder.shutdown(wait=True, cancel_futures=False)

    def ready(self) -> tuple[bool, str]:
        """Whether every replica group is up and answering; with the reason when one is not."""
        if self.fatal:
            return False, f"the worker group failed: {self.fatal}"
        if not self.loaded or self._thread is None or not self._thread.is_alive():
            return False, "the worker group is starting (loading the model)"
        states = [self._lane_state(lane) for lane in self.lanes]
        if len(states) == 1:
            return states[0]
        for lane, (ok, reason) in zip(self.lanes, states, strict=True):
            if not ok:
                return False, f"replica {lane.replica}: {reason}"
        return True, "; ".join(f"replica {lane.replica}: {reason}" for lane, (_, reason) in zip(self.lanes, states,
                                                                                                    strict=True))

    def _lane_state(self, lane: Lane) -> tuple[bool, str]:
        if lane.current_job is not None:
            return True, f"running {lane.current_job}"
        window = 3 * self.config.heartbeat_s + 1.0
        if lane.last_contact_at is None or time.monotonic() - lane.last_contact_at > window:
            return False, f"no heartbeat round trip in the last {window:.0f} s"
        return True, "idle"

    def replica_status(self) -> list[dict[str, Any]]:
        """Each replica group: its ranks and their layout (degrees of guidance x ring x Ulysses), whether it answers,
        the job it runs, its heartbeat and jobs ended."""
        out = []
        for lane in self.lanes:
            ok, reason = self._lane_state(lane)
            rtt = lane.last_ping_rtt_s
            out.append({"replica": lane.replica, "ranks": list(lane.ranks), "layout": self.layout, "ready": ok,
                        "reason": reason,
                        "job": lane.current_job, "heartbeat_rtt_ms": None if rtt is None else round(rtt * 1e3, 3),
                        "jobs_finished": dict(lane.jobs_done)})
        return out

    def submit_streamed(self, request, *, model: str, tenant: Tenant = OPEN, live=None) -> tuple[Job, VideoStream]:
        """Queue ``request`` as ``tenant``'s streamed job (``live``: a live video's first directions): the returned
        handle reads its MP4 while it is made. Raises ``QueueFull`` as ``store.submit`` does."""
        # Under the lock that the leader takes after claiming a job, so it cannot run the job unstreamed.
        with self._streams_lock:
            # Pinned: its client reads it from this server.
            job = self.store.submit(request, model=model, pinned=True, tenant=tenant, live=live)
            stream = self._streams[job.id] = VideoStream(job.id)
        return job, stream

    def release_stream(self, job_id: str) -> None:
        """The HTTP side is done with a streamed job's handle (a job still queued then runs unstreamed, if at all)."""
        with self._streams_lock:
            self._streams.pop(job_id, None)

    def retry_after_s(self) -> int:
        """A guess at how long until the queue has room: mean generation time times the queue depth."""
        h = self.generation_seconds
        mean = h.sum / h.count if h.count else 10.0
        return int(min(600, max(1, round(mean * max(1, self.store.queue_depth())))))

    # -- the leader thread -------------------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            # NOTE(imports): the runtime pulls in diffusers; imported here so that `import server.http.app` stays light.
            from server.group.runtime import FAULT_ENV, GroupDriver, parse_faults, start_runtime

            self._faults = parse_faults(os.environ.get(FAULT_ENV))
            runtime = (self._runtime_factory or start_runtime)(self.config.runtime)
            state = runtime.state
            self.pids = group_pids(state)
            self.world_size = state.world_size
            self.layout = {"guidance": state.guidance_size, "ring": state.ring_size, "ulysses": state.ulysses_size}
            self.memory = [m.as_dict() for m in runtime.memory]
            self._loaded_options = runtime.model.options
            self.geometry = runtime.model.geometry
            self.lanes = [Lane(0, state.replica_ranks, GroupDriver(runtime))]
            if state.replicas > 1:
                from server.group.replicas import RemoteDriver

                size = len(state.replica_ranks)
                self.lanes += [Lane(r, tuple(range(r * size, (r + 1) * size)), RemoteDriver(runtime, r))
                               for r in range(1, state.replicas)]
            self._write_group_file()
            self._encoder = ThreadPoolExecutor(max_workers=len(self.lanes), thread_name_prefix="cp-infer-encode")
            for lane in self.lanes:
                self._ping(lane)
            if self.config.runtime.lora_dir is not None:
                # The adapters' checks (the model's modules on the meta device, each adapter's header) made here, so
                # that no HTTP request waits for them.
                self._loras.warm()
            self.loaded = True
            phases.mark("ready")
            log.info("group of %d rank(s) in %d replica(s) ready (pids %s, restart %d)", self.world_size,
                     len(self.lanes), self.pids, self.restart_count)
            self._serving.wait()
            for lane in self.lanes[1:]:
                thread = threading.Thread(target=self._serve_remote, args=(lane,), daemon=True,
                                          name=f"cp-infer-replica-{lane.replica}")
                thread.start()
                self._lane_threads.append(thread)
            self._serve(self.lanes[0])
            for thread in self._lane_threads:
                thread.join()
        except BaseException as exc:  # noqa: BLE001 -- the group's state is unknown: restart it
            self._die(f"{type(exc).__name__}: {exc}")

    def _serve(self, lane: Lane) -> None:
        """Run queued jobs on one replica until the leader stops, then stop that replica's ranks."""
        while not self._stopping.is_set():
            try:
                job = self.store.claim_next(timeout=self.config.heartbeat_s)
            except StoreUnavailable as exc:
                # NOTE(outage): a store that does not answer is no fault of the group: it keeps its heartbeats and
                # claims again once the store is back (the requests meanwhile answer 503).
                log.warning("claiming the next job: %s; trying again", exc)
                self._stopping.wait(self.config.heartbeat_s)
                job = None
            if job is None:
                self._ping(lane)
            else:
                self._run_job(lane, job)
        lane.driver.stop()

    def _serve_remote(self, lane: Lane) -> None:
        try:
            self._serve(lane)
        except BaseException as exc:  # noqa: BLE001 -- as the leader thread's own: the world restarts
            self._die(f"replica {lane.replica}: {type(exc).__name__}: {exc}")

    def _die(self, reason: str) -> None:
        self.fatal = reason
        if self._stopping.is_set():
            log.info("leader stopped: %s", reason)
            return
        log.error("worker group failed (%s); exiting so that torchrun restarts it", reason)
        if self._exit_on_fatal:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(FATAL_EXIT_CODE)

    def _write_group_file(self) -> None:
        info = {"pids": self.pids, "restart_count": self.restart_count, "world_size": self.world_size,
                "replicas": [list(lane.ranks) for lane in self.lanes], "started_at": time.time()}
        tmp = self.config.data_dir / "group.json.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        os.replace(tmp, self.config.data_dir / "group.json")

    def _ping(self, lane: Lane) -> None:
        started = time.monotonic()
        lane.driver.ping()
        lane.last_contact_at = time.monotonic()
        lane.last_ping_rtt_s = lane.last_contact_at - started

    def _run_job(self, lane: Lane, job: Job) -> None:
        lane.current_job = job.id
        with self._streams_lock:
            stream = self._streams.pop(job.id, None)
        outputs = None
        try:
            lead = self.store.lead_frames(job.id) if job.lead_frames else None
        except StoreUnavailable as exc:
            lead = exc
        try:
            if isinstance(lead, StoreUnavailable):
                self._finish(lane, job, "failed", "output_store_unavailable", f"the video it extends: {lead}")
                return
            if stream is not None or lead is not None or job.live is not None or self._made_in_windows(lane.driver,
                                                                                                      job):
                # Streamed, or long enough to be made window by window: encoded as the frames come, so that rank 0
                # never holds the whole video.
                try:
                    # An extension's video: the lead, then the num_frames - 1 frames made after its last.
                    frames = None if lead is None else len(lead) + job.request.num_frames - 1
                    # A live video's raw frames are not kept: their file's header holds a length known at its end.
                    outputs = StreamedOutputs(self.store, job.id, job.request, stream=stream, frames=frames,
                                              keep_frames=self.config.keep_frames and job.live is None)
                except (OSError, ValueError) as exc:
                    self._finish(lane, job, "failed", "encode_failed", f"{type(exc).__name__}: {exc}")
                    return
            self._generate_and_write(lane, job, outputs, lead)
        finally:
            if outputs is not None:
                outputs.discard()  # a no-op once committed
            lane.current_job = None
            if stream is not None:
                final = self.store.snapshot_any(job.id)  # None: deleted
                stream.end(final.status if final is not None and final.terminal else "cancelled",
                           None if final is None else final.error_message)

    def _made_in_windows(self, group: GroupDriver, job: Job) -> bool:
        model = group.runtime.model
        if not hasattr(model, "plan"):
            return False  # a test's stand-in model
        try:
            return model.plan(resolve_request(job.request, model.options, limits=self.config.limits,
                                              geometry=model.geometry)).windows > 1
        except ValueError:
            return False  # refused in _generate_and_write, with the reason

    def _generate_and_write(self, lane: Lane, job: Job, outputs: StreamedOutputs | None = None,
                            lead: np.ndarray | None = None) -> None:
        """``lead``: frames the video starts with, written before the ones the group makes (an extension's)."""
        from cp_infer.sampler import JobCancelled, JobFailed, SampleControl, StepStatus
        from server.group.runtime import with_faults

        group = lane.driver
        runtime, request = group.runtime, job.request
        try:
            request = resolve_request(request, runtime.model.options, limits=self.config.limits,
                                      geometry=runtime.model.geometry)
            director = None
            if job.live is not None:
                director = LiveDirector(self.store, job, options=runtime.model.options, idle_s=self.config.live_idle_s,
                                        contact=lambda: setattr(lane, "last_contact_at", time.monotonic()))
                request = director.request(request)
            check_request(request, geometry=runtime.model.geometry, limits=self.config.limits,
                          options=runtime.model.options)
            self.check_loras(request.loras)
        except ValueError as exc:
            self._finish(lane, job, "failed", "invalid_request", f"no longer valid under this server's limits: {exc}")
            return
        phase = {"name": "start"}
        hook_errors: list[tuple[str, str]] = []  # (phase, error) of rank 0's hooks
        started = time.monotonic()

        def poll(_i: int) -> StepStatus:
            # Raising here is safe (the sampler agrees on it); the other hooks must never raise.
            return StepStatus.CANCEL if self.store.cancel_requested(job.id, attempt=job.attempts) else StepStatus.OK

        def on_step(done: int, total: int, seconds: float) -> None:
            lane.last_contact_at = time.monotonic()
            self.step_seconds.observe(seconds)
            self.store.set_progress(job.id, _DENOISE_SHARE * done // total, attempt=job.attempts)

        saved = {"blocks": 0}

        def on_cache(stats) -> None:  # cp_infer.step_cache.CacheStats: the job's totals so far
            self.store.set_cache_steps(job.id, stats.steps_computed, stats.steps_skipped, attempt=job.attempts)
            with self._counts_lock:
                self.blocks_saved += stats.blocks_saved - saved["blocks"]
            saved["blocks"] = stats.blocks_saved

        def on_phase(name: str) -> None:
            phase["name"] = name
            progress = {"decode": _DENOISE_SHARE, "done": _DECODED}.get(name)
            if progress is not None:
                self.store.set_progress(job.id, progress, attempt=job.attempts)

        soundtrack: dict[str, object] = {}

        def on_audio(waveform: np.ndarray, sample_rate: int) -> None:
            soundtrack.update(audio=waveform, sample_rate=sample_rate)
            if outputs is not None:
                outputs.set_audio(waveform, sample_rate)

        offset = 0 if lead is None else len(lead)

        def on_frames(frames: np.ndarray, first: int, total: int) -> None:
            if offset and first == 0:  # an extension: ``outputs`` is always made for one
                for a in range(0, offset, 16):  # the video extended, a few frames at a time (memory-mapped)
                    outputs.write(np.asarray(lead[a:a + 16]), a)
            first += offset
            if outputs is not None and director is not None:
                outputs.set_frames(offset + total)  # a live video's length so far
            if outputs is not None:
                # NOTE(timeout): the ranks whose pieces come later wait in their send while this encodes; that
                # wait (about the encode time of the pieces before theirs) must stay under the collective timeout.
                if self.store.cancel_requested(job.id, attempt=job.attempts):
                    outputs.stop()  # the job ends cancelled: encode nothing more
                outputs.write(frames, first)
            if phase["name"] == "decode":
                # A long video's earlier windows are decoded while later ones denoise: their frames count once the
                # denoising is done, so that progress keeps to the steps until then (90 means all of them ran).
                decoded = (first - offset + len(frames)) / max(total, 1)
                self.store.set_progress(job.id, _DENOISE_SHARE + int((_DECODED - _DENOISE_SHARE) * decoded),
                                        attempt=job.attempts)

        def deferred(hook):
            """``hook`` with its exceptions kept for after the sampler: raising inside it would leave rank 0
            out of step with ranks still inside a step's or the decode's collectives."""
            if hook is None:
                return None

            def call(*args) -> None:
                try:
                    hook(*args)
                except Exception as exc:  # noqa: BLE001
                    log.exception("job %s: rank 0 hook failed", job.id)
                    hook_errors.append((phase["name"], f"{type(exc).__name__}: {exc}"))

            return call

        def on_pass(index: int, plan) -> None:
            window = plan.passes[index].window
            if window is not None:
                self.store.set_window(job.id, window, plan.windows, attempt=job.attempts)

        def on_checkpoint(passes_done: int, arrays: dict[str, np.ndarray]) -> None:
            self.store.save_checkpoint(job.id, passes_done, arrays, attempt=job.attempts)

        resume = self.store.load_checkpoint(job.id)
        if resume is not None:
            log.info("job %s goes on from its checkpoint after pass %d", job.id, resume[0])
        elif job.progress:
            # Requeued with a checkpoint that cannot be read: it runs from its start.
            self.store.start_over(job.id, attempt=job.attempts)
        # Encoded as they come, a long LTX-2 video's soundtrack comes piece by piece too, each before its frames.
        control = SampleControl(poll=poll, on_step=on_step, on_cache=on_cache, on_phase=on_phase, on_frames=on_frames,
                                on_audio=on_audio, on_audio_piece=None if outputs is None else outputs.add_audio,
                                on_pass=on_pass, on_checkpoint=on_checkpoint, resume=resume,
                                collect=outputs is None, live=director is not None,
                                extend=None if director is None else director.extend)
        if lane.driver.local:
            control = with_faults(control, request, rank=runtime.state.rank, rules=self._faults, model=runtime.model)
        control = replace(control, on_step=deferred(control.on_step), on_cache=deferred(control.on_cache),
                          on_phase=deferred(control.on_phase),
                          on_frames=deferred(control.on_frames), on_pass=deferred(control.on_pass))
        log.info("job %s on replica %d: %d frames %dx%d, %d steps%s", job.id, lane.replica, request.num_frames,
                 request.width, request.height, request.num_inference_steps,
                 ", streamed" if outputs is not None else "")
        try:
            frames = group.generate(request, job.id, control)
            lane.last_contact_at = time.monotonic()
        except JobCancelled:
            lane.last_contact_at = time.monotonic()
            self._finish(lane, job, "cancelled", "cancelled", "cancelled while running")
            return
        except JobFailed as exc:
            lane.last_contact_at = time.monotonic()
            self._finish(lane, job, "failed", exc.code, str(exc))
            return
        except Exception as exc:
            if phase["name"] != "done":
                # Raised inside the sampler on this rank only (a step, the gather or the parallel decode): the other
                # ranks may be waiting in a collective that will never come, so the group goes down. The job stays
                # in progress: the restarted group's leader puts it back in the queue (``JobStore.recover``), and a
                # long video goes on from its last checkpoint.
                log.error("job %s: the worker group failed (rank 0: %s: %s); it runs again when the group is back",
                          job.id, type(exc).__name__, exc)
                raise
            log.exception("job %s failed on rank 0 after the decode", job.id)
            self._finish(lane, job, "failed", "decode_failed", f"rank 0: {type(exc).__name__}: {exc}")
            return
        if hook_errors:
            where, error = hook_errors[0]
            self._finish(lane, job, "failed", "decode_failed" if where == "decode" else "internal_error",
                         f"rank 0 ({where}): {error}")
            return
        if outputs is not None:
            self._commit_stream(lane, job, outputs, started)
            return
        # NOTE(encode): rank 0's alone, so it runs beside the group: the lane goes back to heartbeats and the
        # next job at once, and no worker waits in a broadcast for as long as an encode takes.
        self._encoder.submit(self._encode, lane, job, frames, started, soundtrack)

    def _commit_stream(self, lane: Lane, job: Job, outputs: StreamedOutputs, started: float) -> None:
        if self.store.cancel_requested(job.id, attempt=job.attempts):
            # Asked to stop during the decode, which could not be interrupted: the job still ends cancelled.
            self._finish(lane, job, "cancelled", "cancelled", "cancelled during the decode")
            return
        try:
            outputs.commit(attempt=job.attempts)
        except Exception as exc:  # noqa: BLE001 -- the group is done with this job: fail it only
            log.exception("job %s: writing the streamed video failed", job.id)
            code = "output_store_unavailable" if isinstance(exc, StoreUnavailable) else "encode_failed"
            self._finish(lane, job, "failed", code, f"{type(exc).__name__}: {exc}")
            return
        self.generation_seconds.observe(time.monotonic() - started)
        self._finish(lane, job, "completed")

    def _encode(self, lane: Lane, job: Job, frames: np.ndarray, started: float, soundtrack: dict) -> None:
        try:
            self._write_outputs(job, frames, **soundtrack)
        except Exception as exc:  # noqa: BLE001 -- the group is not involved: fail this job only
            log.exception("job %s: writing the video failed", job.id)
            code = "output_store_unavailable" if isinstance(exc, StoreUnavailable) else "encode_failed"
            self._finish(lane, job, "failed", code, f"{type(exc).__name__}: {exc}")
            return
        self.generation_seconds.observe(time.monotonic() - started)
        self._finish(lane, job, "completed")

    def _write_outputs(self, job: Job, frames: np.ndarray, audio: np.ndarray | None = None,
                       sample_rate: int | None = None) -> None:
        from PIL import Image

        from cp_infer.video_io import write_mp4

        expected = (job.request.num_frames, job.request.height, job.request.width, 3)
        if frames.shape != expected:
            raise RuntimeError(f"the model returned frames of shape {frames.shape}, expected {expected}")
        made = []  # (file, suffix), handed to the output store once all are whole
        mp4 = self.store.path(job.id, ".mp4.tmp")
        write_mp4(frames, mp4, job.request.fps, audio=audio, sample_rate=sample_rate)
        made.append((mp4, ".mp4"))
        thumb = self.store.path(job.id, ".jpg.tmp")
        Image.fromarray(frames[len(frames) // 2]).save(thumb, format="JPEG", quality=90, subsampling=0)
        made.append((thumb, ".jpg"))
        if self.config.keep_frames:
            raw = self.store.path(job.id, ".npy.tmp")
            with open(raw, "wb") as f:
                np.save(f, frames)
            made.append((raw, ".npy"))
        self.store.publish(job.id, made, attempt=job.attempts)

    def _finish(self, lane: Lane, job: Job, status: str, code: str | None = None, message: str | None = None) -> None:
        if status != "completed":
            log.warning("job %s %s: %s", job.id, status, message)
        with self._counts_lock:  # the lanes and the encoder threads all end jobs
            self.jobs_done[status] += 1
            lane.jobs_done[status] += 1
        self.store.finish(job.id, status, code, message, attempt=job.attempts, ranks=len(lane.ranks))
