"""A job as a plan: the sharded denoising passes the sampler runs, in order, for one request.

Invariants:
- A model adapter turns a resolved request into a :class:`Plan` (``DenoiseModel.plan``); the sampler runs its
  passes in order on every rank, each a full sharded loop (prepare agreed on, steps, one gather), hands each pass
  the gathered latents of the one before, and decodes the last pass's latents.
- A plan is built from the request alone, identically on every rank (no collective, no randomness).
- Progress counts the steps of every pass: ``Plan.steps`` is their sum; a long video's passes are its windows
  (``DenoisePass.window``), made in order, each conditioned on the latents of the ones before.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import GenerationRequest

__all__ = ["DenoisePass", "Plan"]


@dataclass(frozen=True)
class DenoisePass:
    """One sharded denoising loop."""

    request: GenerationRequest
    """What this pass generates: its size, frames, steps and conditioning (a window's or a stage's own)."""
    steps: int
    """Denoising steps it runs (its share of the job's progress)."""
    kind: str = "denoise"
    """Which of its passes the adapter prepares (its own names: ``denoise``; ``refine`` for a second stage, ...);
    handed to ``DenoiseModel.prepare`` with the request."""
    window: int | None = None
    """For a long video made window by window: which window this pass makes (from 0); ``None`` otherwise."""


@dataclass(frozen=True)
class Plan:
    passes: tuple[DenoisePass, ...]

    def __post_init__(self) -> None:
        assert self.passes, "a plan has at least one pass"

    @classmethod
    def single(cls, request: GenerationRequest) -> Plan:
        """One pass over the whole request (text-to-video, image-to-video, conditions)."""
        return cls((DenoisePass(request, steps=request.num_inference_steps),))

    @property
    def steps(self) -> int:
        return sum(p.steps for p in self.passes)

    @property
    def windows(self) -> int:
        """How many windows the plan makes the video in (1: not windowed)."""
        return 1 + max((p.window or 0 for p in self.passes), default=0)
