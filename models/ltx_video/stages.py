"""Two-stage LTX-Video generation, the LTX-Video 0.9.7+ recipe as diffusers documents it (``LTXConditionPipeline``,
``LTXLatentUpsamplePipeline``): stage 1 denoises at half the height and width with the request's own settings
(``output_type="latent"``), the latent upsampler doubles its latents, and stage 2 refines them at full size with
``denoise_strength=0.4`` of 10 steps: the last 4 of the 10-step schedule, the upsampled latents renoised to its first.

Invariants:
- Both stages are LTXConditionPipeline's, as in diffusers' examples (its text-only path when nothing conditions the
  request; LTXPipeline takes no ``denoise_strength``), and ordinary passes of the plan (``cp_infer.plan``), each
  sequence-parallel on the whole group; the upsampler runs between them inside stage 2's prepare, replicated on
  every rank (``LTXVideoModel._upsampled``).
- Both stages take the request's guidance, ``image_cond_noise_scale`` and media, and each draws from its own
  generator seeded with the request's seed, as diffusers' example passes ``torch.Generator().manual_seed(0)`` to
  each call. The upsampler's ``adain_factor`` and ``tone_map_compression_ratio`` are the request's options.
- An image (``request.image``) conditions both stages as the recipe's ``LTXVideoCondition(image, frame_index=0)``;
  ``conditions`` condition both stages as they are.
"""

from __future__ import annotations

from cp_infer.plan import Plan
from cp_infer.request import Condition, GenerationRequest
from models.common.stages import two_stage_plan as shared_two_stage_plan

__all__ = ["DENOISE_STRENGTH", "REFINE_STEPS", "refine_pass_steps", "stage_conditions", "two_stage_plan"]

REFINE_STEPS = 10
"""Stage 2's ``num_inference_steps``: the schedule it takes the tail of."""
DENOISE_STRENGTH = 0.4
"""Stage 2's ``denoise_strength``: the share of the schedule it runs."""


def refine_pass_steps() -> int:
    """The steps stage 2 runs (LTXConditionPipeline.get_timesteps: ``int(steps * strength)``)."""
    return min(int(REFINE_STEPS * DENOISE_STRENGTH), REFINE_STEPS)


def two_stage_plan(request: GenerationRequest) -> Plan:
    """Stage 1 (``stage1``: LTXConditionPipeline at half size), stage 2 (``refine``) at the request's size."""
    return shared_two_stage_plan(request, refine_steps=refine_pass_steps(), first_kind="stage1",
                                 num_inference_steps=REFINE_STEPS)


def stage_conditions(request: GenerationRequest) -> tuple[Condition, ...]:
    """What conditions a stage: the request's conditions, or its image as a condition at frame 0."""
    if request.image is not None:
        return (Condition(request.image.frames, frame_index=0, strength=1.0),)
    return tuple(request.conditions)
