"""What two-stage generation (half size, the latent upsampler, a short refine at full size) shares across model
families: the ``stages`` option and its checks, and the two-pass plan. Imports no model code, so the options modules
that use it stay cheap for front ends.

Invariants:
- Stage 1 runs at exactly half the request's height and width, so the 2x upsampler's output is the request's size;
  both must therefore be multiples of ``STAGE_SIZE_STEP`` (twice the VAE's 32x spatial step).
- Each stage's request carries ``stages=1``: a pass is one stage, never a plan of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from cp_infer.options import Option
from cp_infer.plan import DenoisePass, Plan
from cp_infer.request import GenerationRequest

__all__ = ["STAGE_SIZE_STEP", "check_two_stage_size", "stages_option", "two_stage_plan"]

# Two stages denoise at half the size first, itself a multiple of 32 (the VAE's spatial compression).
STAGE_SIZE_STEP = 64


def stages_option(*, latent_upsampler: bool, stages: int | None, refine: str, where: str) -> Option:
    """The ``stages`` option of a family: ``latent_upsampler``: whether the folder has one (``stages=2`` is refused
    without); ``stages``: the folder's default (``models.common.loading.recommended_stages``; unset: 2 with an
    upsampler,
    as Lightricks recommends, else 1); ``refine``: what stage 2 does, for the help; ``where``: where the refusal says
    an upsampler is found (``latent_upsampler/`` of some repository)."""

    def refuse(value: int) -> None:
        if value != 1:
            raise ValueError(f"stages={value} needs a latent upsampler and this model folder has none ({where}): "
                             "use stages=1, or serve a folder with one")

    default = stages if stages is not None else (2 if latent_upsampler else 1)
    return Option("stages", int, default, "denoising stages: 2 denoises at half the size, upsamples the latents 2x "
                  f"(the folder's latent_upsampler/) and {refine} at full size (Lightricks' recommended recipe; "
                  f"height and width multiples of {STAGE_SIZE_STEP}); 1 denoises once at full size. Default: 2 for a "
                  "folder with a latent upsampler, 1 without one and for the embedded tiny models", lo=1, hi=2,
                  check=None if latent_upsampler else refuse)


def check_two_stage_size(values: Mapping[str, Any]) -> None:
    """``ModelOptions.check``: with ``stages=2``, height and width must halve to the VAE's step."""
    if values["stages"] != 2:
        return
    for name in ("height", "width"):
        if values[name] % STAGE_SIZE_STEP:
            nearest = max(STAGE_SIZE_STEP, round(values[name] / STAGE_SIZE_STEP) * STAGE_SIZE_STEP)
            raise ValueError(f"{name}={values[name]} with stages=2 is not a multiple of {STAGE_SIZE_STEP} (stage 1 "
                             f"runs at half the size); try {name}={nearest}, or stages=1")


def two_stage_plan(request: GenerationRequest, *, refine_steps: int, refine_options: Mapping[str, Any] | None = None,
                   first_kind: str = "denoise", **refine_fields: Any) -> Plan:
    """Stage 1 (``first_kind``) at half size with the request's steps and settings, stage 2 (``refine``, of
    ``refine_steps`` steps) at the request's size, its request changed by ``refine_fields`` (request fields) and
    ``refine_options`` (model options). The options have checked that the size halves (:func:`check_two_stage_size`)."""
    one_stage = {**request.options, "stages": 1}
    first = replace(request, height=request.height // 2, width=request.width // 2, options=one_stage)
    second = replace(request, **refine_fields, options={**one_stage, **(refine_options or {})})
    return Plan((DenoisePass(first, steps=first.num_inference_steps, kind=first_kind),
                 DenoisePass(second, steps=refine_steps, kind="refine")))
