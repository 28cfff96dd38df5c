"""The request options of LTX-2 (audio + video) models: names and defaults of diffusers' ``LTX2Pipeline``.
Imports no model code, so front ends read it cheaply."""

from __future__ import annotations

from dataclasses import replace

from cp_infer.options import ModelOptions, Option
from cp_infer.step_cache import cache_options
from models.common.stages import STAGE_SIZE_STEP, check_two_stage_size, stages_option
from models.common.standard_options import decode_options, standard_options
from models.common.windows import check_windows, live_frames, window_count, window_frames, window_options

__all__ = ["DISTILLED_SIGMAS", "GUIDANCE_OFF", "STAGE_SIZE_STEP", "ltx2_options"]

# LTX2Pipeline perturbs block 28 (of LTX-2.0's 48); a smaller model gets its last block instead.
_STG_BLOCK = 28

DISTILLED_SIGMAS: tuple[float, ...] = (1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875)
"""The distilled checkpoints' fixed schedule: diffusers' ``DISTILLED_SIGMA_VALUES`` (``diffusers.pipelines.ltx2.utils``,
from Lightricks' ltx-pipelines; ``tests/models/ltx2/test_distilled.py`` holds the two equal), kept here so that
reading the options imports no diffusers."""

GUIDANCE_OFF = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0,
                    audio_guidance_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0)
"""Every guidance besides CFG off (with ``guidance_scale=1.0``, CFG too): LTX2Pipeline's 0 for an audio scale means
"as the video's", so the audio CFG scale is 1 outright; the CFG rescale is the identity without guidance (up to
rounding), so it is off as well. What a distilled model and the second stage run."""

_DISTILLED = dict(num_inference_steps=len(DISTILLED_SIGMAS), guidance_scale=1.0, sigmas=DISTILLED_SIGMAS,
                  **GUIDANCE_OFF)
"""A distilled folder's defaults: its fixed 8-step schedule without guidance, as Lightricks' distilled pipeline runs
and diffusers' examples call LTX2Pipeline for it (``sigmas=DISTILLED_SIGMA_VALUES, guidance_scale=1.0``)."""


def ltx2_options(*, layers: int = 48, latent_upsampler: bool = True, stages: int | None = None,
                 distilled: bool = False) -> ModelOptions:
    """``layers``: the transformer's block count (spatio-temporal guidance names blocks); ``latent_upsampler``:
    whether the folder has one (two-stage generation needs it); ``stages``: the folder's default stage count
    (``models.common.loading.recommended_stages``; unset: 2 with an upsampler, as Lightricks recommends, else 1);
    ``distilled``: the folder holds a distilled checkpoint (``models.common.loading.is_distilled``), whose defaults are
    its
    fixed schedule without guidance."""
    options = (
        *standard_options(height=512, width=768, num_frames=121, frame_rate=24, num_inference_steps=30,
                          guidance_scale=3.0, size_step="a multiple of 32, at least 64", smallest_side=64),
        Option("stg_scale", float, 1.0, "spatio-temporal guidance of the video; 0 turns it off", lo=0,
               limit="max_guidance", flags=("--stg",)),
        Option("modality_scale", float, 3.0, "modality-isolation guidance of the video; 1 turns it off", lo=0,
               limit="max_guidance", flags=("--modality",)),
        Option("guidance_rescale", float, 0.7, "CFG rescale of the video", lo=0, hi=1),
        Option("audio_guidance_scale", float, 7.0, "CFG scale of the soundtrack (0: guidance_scale)", lo=0,
               limit="max_guidance", flags=("--audio-guidance",)),
        Option("audio_stg_scale", float, 1.0, "spatio-temporal guidance of the soundtrack (0: stg_scale)", lo=0,
               limit="max_guidance", flags=("--audio-stg",)),
        Option("audio_modality_scale", float, 3.0, "modality-isolation guidance of the soundtrack (0: "
               "modality_scale)", lo=0, limit="max_guidance", flags=("--audio-modality",)),
        Option("audio_guidance_rescale", float, 0.7, "CFG rescale of the soundtrack (0: guidance_rescale)", lo=0,
               hi=1),
        Option("sigmas", tuple, None, "the denoising schedule, from 1 down, one sigma a step (LTX2Pipeline's sigmas; "
               "its length is num_inference_steps); unset: LTX2Pipeline's linspace(1, 1/steps, steps). A distilled "
               "model's default is its fixed schedule (diffusers' DISTILLED_SIGMA_VALUES) at its 8 steps; at other "
               "num_inference_steps, unset", lo=0, hi=1, nullable=True, item=float),
        Option("spatio_temporal_guidance_blocks", tuple, (min(_STG_BLOCK, layers - 1),),
               "transformer blocks whose self-attention spatio-temporal guidance perturbs", lo=0, hi=layers - 1,
               aliases=("stg_blocks",), flags=("--stg-blocks",)),
        *decode_options(),
        # NOTE(registers): LTX-2's text connectors append 128 learnable registers per 128 text tokens.
        Option("max_sequence_length", int, 1024, "text tokens the prompt is padded or cut to", lo=128, hi=1024,
               multiple_of=128),
        stages_option(latent_upsampler=latent_upsampler, stages=stages, refine="refines them in 3 steps",
                      where="diffusers keeps it in latent_upsampler/, e.g. Lightricks/LTX-2's"),
        # 16 latent frames a window: LTX2Pipeline's own 121 frames are one.
        *window_options(default_tile=128, default_overlap=24, image=False),
        *cache_options(model="LTX-2"),
    )
    if distilled:
        options = tuple(replace(o, default=_DISTILLED[o.name]) if o.name in _DISTILLED else o for o in options)
        options = tuple(replace(o, default_for=_distilled_sigmas) if o.name == "sigmas" else o for o in options)
    return ModelOptions("LTX-2", options, check=_check, window_frames=window_frames, window_count=window_count,
                        window_media=(),
                        live_frames=live_frames, live_prompts="prompt_segments")


def _distilled_sigmas(values) -> tuple[float, ...] | None:
    """A distilled model's default schedule: its own at its step count; at another (a request's, or a deployment's
    --max-steps below 8), unset, LTX2Pipeline's schedule for that many steps."""
    return DISTILLED_SIGMAS if values["num_inference_steps"] == len(DISTILLED_SIGMAS) else None


def _check_sigmas(values) -> None:
    sigmas, steps = values["sigmas"], values["num_inference_steps"]
    if sigmas is None:
        return
    if len(sigmas) != steps:
        raise ValueError(f"sigmas has {len(sigmas)} values and num_inference_steps={steps}: a schedule has one sigma "
                         f"a step, so give num_inference_steps={len(sigmas)}, or {steps} sigmas")
    if any(b >= a for a, b in zip(sigmas, sigmas[1:], strict=False)):
        raise ValueError(f"sigmas={list(sigmas)} must fall strictly, e.g. {list(DISTILLED_SIGMAS)}")
    if sigmas[-1] <= 0:
        raise ValueError(f"sigmas={list(sigmas)} must stay above 0 (the scheduler appends the final 0 itself)")


def _check(values) -> None:
    check_two_stage_size(values)
    check_windows(values)
    _check_sigmas(values)
