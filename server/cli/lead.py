"""The leader's side of a ``cp-infer generate`` or ``cp-infer batch`` run (:class:`Leader`, :func:`run_group`).

Invariants:
- Every job the leader runs is broadcast to every rank before it runs, and every path that leaves the group in step
  ends with ``stop`` (:meth:`Leader.stop`); both go through ``server.group.runtime.GroupDriver``, the leader side of
  the command protocol that the server uses too. ``run_group`` tears the group down on every rank.
- Writing an output never raises anything but :class:`WriteError` (the job itself succeeded). A frames folder also
  gets the final latents (``latents.npy``, and ``audio_latents.npy`` for a model with a soundtrack).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cp_infer.request import GenerationRequest
from server.cli.launch import leader_exit_code
from server.group import phases
from server.outputs.piece_video import WriteError

if TYPE_CHECKING:
    from cp_infer.step_cache import CacheStats
    from server.group.runtime import GroupDriver, Runtime

__all__ = ["Generated", "Leader", "result_writer", "run_group"]

# ------------------------------------------------------------------------------------------- the leader's side


class _Progress:
    """A tqdm bar on stderr for one job: steps, then "decode"."""

    def __init__(self, label: str, steps: int):
        from tqdm import tqdm

        self.label = label
        self.bar = tqdm(total=steps, desc=label, unit="step", file=sys.stderr, dynamic_ncols=True, leave=True)

    def control(self):
        from cp_infer.sampler import SampleControl

        return SampleControl(on_step=self._step, on_phase=self._phase, on_frames=self.frames)

    def _step(self, done: int, total: int, _seconds: float) -> None:
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def _phase(self, phase: str) -> None:
        if phase in ("decode", "done"):
            self.bar.set_description(f"{self.label} [{phase}]")

    def frames(self, frames, first: int, total: int) -> None:
        self.bar.set_description(f"{self.label} [decode {first + len(frames)}/{total} frames]")

    def close(self) -> None:
        self.bar.close()


@dataclass
class Generated:
    """One finished job on the leader."""

    frames: Any = None
    """uint8 ``[F, H, W, 3]``, or None when the frames were streamed."""
    audio: Any = None
    """float ``[C, S]`` waveform of audio-video models, else None."""
    sample_rate: int | None = None
    latents: dict[str, Any] | None = None
    """The final latents (``SampleControl.on_latents``: ``latents``, and ``audio_latents`` for LTX-2), float32
    arrays in the layout the reference pipeline returns for ``output_type="latent"``."""
    cache: CacheStats | None = None
    """The step cache's totals over the job's passes (``SampleControl.on_cache``); ``None`` without a cache."""


@dataclass
class Leader:
    """Rank 0's side of a CLI run: jobs with a progress bar and their results kept, over the command protocol's
    leader side (``group``: every job is broadcast before it runs; ``stop`` ends the workers).

    With replica groups (``batch`` only), one ``Leader`` per replica: rank 0's own first, whose ``replicas`` are the
    others' (``server.group.replicas.RemoteDriver``); each may run a job at the same time as the others, from its own
    thread."""

    group: GroupDriver
    replicas: tuple[Leader, ...] = ()
    extend: Callable[..., Any] | None = None
    """A live video's directions (``SampleControl.extend``; ``generate --live``): its jobs are live."""

    @property
    def runtime(self) -> Runtime:
        return self.group.runtime

    def generate(self, request: GenerationRequest, job_id: str, *, on_frames: Callable[..., None] | None = None,
                 on_audio: Callable[..., None] | None = None,
                 on_audio_piece: Callable[..., None] | None = None) -> Generated:
        """The frames (``None`` with ``on_frames``, called with each decoded piece in order: no rank then holds the
        whole video), the final latents and, for audio-video models, the soundtrack (also handed to ``on_audio``
        before the frames; with ``on_audio_piece``, handed to it piece by piece instead, each piece before the frames
        it plays under, and ``audio`` stays ``None``)."""
        progress = _Progress(job_id, request.num_inference_steps)
        result = Generated()

        def keep_audio(waveform, sample_rate: int) -> None:
            result.audio, result.sample_rate = waveform, sample_rate
            if on_audio is not None:
                on_audio(waveform, sample_rate)

        def keep_latents(latents: dict) -> None:
            result.latents = latents

        def keep_cache(stats: CacheStats) -> None:
            result.cache = stats

        control = phases.timed_control(replace(progress.control(), on_audio=keep_audio, on_latents=keep_latents,
                                               on_cache=keep_cache))
        if on_audio_piece is not None:
            control = replace(control, on_audio_piece=on_audio_piece)
        if self.extend is not None:
            control = replace(control, live=True, extend=self.extend)
        if on_frames is not None:
            def both(frames, first: int, total: int) -> None:
                on_frames(frames, first, total)
                progress.frames(frames, first, total)

            control = replace(control, on_frames=both, collect=False)
        try:
            result.frames = self.group.generate(request, job_id, control)
        finally:
            progress.close()
        return result

    def stop(self) -> None:
        """End the workers of this replica and of every other."""
        self.group.stop()
        for other in self.replicas:
            other.stop()


def run_group(config, lead: Callable[[Leader], int]) -> int:
    """Form the group and load the model on every rank; the leader runs ``lead``, the others follow (another replica
    group's leader takes rank 0's commands for its replica: ``server.group.replicas.replica_loop``)."""
    from cp_infer import destroy_parallel
    from server.group.replicas import RemoteDriver, replica_loop
    from server.group.runtime import GroupDriver, start_runtime, worker_loop

    runtime = start_runtime(config)
    try:
        state = runtime.state
        if state.leads_replica and not state.is_leader:
            replica_loop(runtime)
            return 0
        if not state.is_leader:
            worker_loop(runtime, control_for=(lambda _command: phases.timed_control(None)) if phases.enabled()
                        else None)
            return 0
        others = tuple(Leader(RemoteDriver(runtime, r)) for r in range(1, state.replicas))
        return leader_exit_code(lead(Leader(GroupDriver(runtime), replicas=others)))
    finally:
        destroy_parallel(runtime.state)
        phases.mark("teardown")


def result_writer() -> Callable[[Generated, Any, int], Path]:
    """``write_output`` (frames and soundtrack; into a frames folder also the latents) with its failures (the job
    itself succeeded) raised as ``WriteError``."""
    import av

    from cp_infer.video_io import is_frames_dir_target, write_output

    def write(result: Generated, out, fps) -> Path:
        latents = result.latents if is_frames_dir_target(out) else None
        try:
            return write_output(result.frames, out, fps, audio=result.audio, sample_rate=result.sample_rate,
                                latents=latents)
        except (OSError, ValueError, av.FFmpegError) as exc:
            raise WriteError(f"could not write {out}: {type(exc).__name__}: {exc}") from exc

    return write
