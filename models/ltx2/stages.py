"""Two-stage LTX-2 generation, Lightricks' recommended recipe as diffusers documents it (``LTX2Pipeline``,
``LTX2LatentUpsamplePipeline``): stage 1 denoises at half the height and width with the request's own settings,
the latent upsampler doubles its latents, and stage 2 refines them at full size in three steps.

Invariants:
- Both stages are ordinary passes of the plan (``cp_infer.plan``), each sequence-parallel on the whole group; the
  upsampler runs between them inside stage 2's prepare, replicated on every rank (``LTX2Model._prepare_refine``).
- Stage 2 is the recipe's: the distilled sigmas ``STAGE_2_DISTILLED_SIGMA_VALUES`` as they are (a scheduler
  without dynamic shifting or terminal shift), the upsampled latents (and stage 1's audio latents) renoised to the
  first of them, from the same generator stage 1 drew from (diffusers' distilled two-stage example passes one
  generator to both stages), and no guidance: positive prompt only, as Lightricks' stage 2 runs (its distilled LoRA
  is not part of a diffusers folder, so stage 2 runs the folder's transformer as it is).
- An image (``request.image``) conditions both stages: stage 1 as LTX2ImageToVideoPipeline at half size, stage 2
  as that pipeline does given latents (the first latent frame, the upsampled image, kept clean and conditioned).
  ``conditions`` condition both stages: stage 1 as LTX2ConditionPipeline at half size, stage 2 as that pipeline does
  given latents (the conditions applied again at full size, the rest renoised to the first sigma).
"""

from __future__ import annotations

import numpy as np
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

from cp_infer.plan import Plan
from cp_infer.request import GenerationRequest
from models.common.stages import two_stage_plan as shared_two_stage_plan

from .options import GUIDANCE_OFF

__all__ = ["REFINE_OPTIONS", "REFINE_SIGMAS", "REFINE_SETTINGS", "pass_sigmas", "refine_scheduler", "two_stage_plan"]

REFINE_SIGMAS: tuple[float, ...] = tuple(STAGE_2_DISTILLED_SIGMA_VALUES)
"""Stage 2's sigmas; the first is also the noise its latents are renoised to."""
REFINE_SETTINGS = dict(GUIDANCE_OFF)
"""Stage 2's guidance besides ``guidance_scale=1.0``: every guidance off (``GUIDANCE_OFF``), as LTX2Pipeline is
called for it."""
REFINE_OPTIONS = dict(REFINE_SETTINGS, sigmas=None)
"""Stage 2's request options: its guidance, and no ``sigmas`` of stage 1's (it runs ``REFINE_SIGMAS``)."""


def pass_sigmas(request: GenerationRequest) -> list[float] | np.ndarray:
    """A denoising pass's sigmas, as LTX2Pipeline takes them: the request's ``sigmas`` (a list), else its
    ``linspace(1, 1/steps, steps)``."""
    sigmas = request.options.get("sigmas")
    if sigmas is not None:
        return list(sigmas)
    return np.linspace(1.0, 1 / request.num_inference_steps, request.num_inference_steps)


def refine_scheduler(scheduler) -> FlowMatchEulerDiscreteScheduler:
    """Stage 2's scheduler: ``scheduler``'s config without dynamic shifting or terminal shift, so the distilled
    sigmas are used as they are (as diffusers' two-stage example swaps it in)."""
    return FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, use_dynamic_shifting=False,
                                                       shift_terminal=None)


def two_stage_plan(request: GenerationRequest) -> Plan:
    """Stage 1 at half size with the request's steps and guidance, stage 2 (``refine``) at the request's size with
    the distilled sigmas and no guidance (``models.common.stages.two_stage_plan``)."""
    return shared_two_stage_plan(request, refine_steps=len(REFINE_SIGMAS), refine_options=REFINE_OPTIONS,
                                 num_inference_steps=len(REFINE_SIGMAS), guidance_scale=1.0)
