"""The request options of LTX-Video models: names and defaults of diffusers' ``LTXPipeline`` (and, for media,
``LTXImageToVideoPipeline`` and ``LTXConditionPipeline``; for two stages, ``LTXLatentUpsamplePipeline``). Imports no
model code, so front ends read it cheaply."""

from __future__ import annotations

from cp_infer.options import ModelOptions, Option
from cp_infer.step_cache import cache_options
from models.common.stages import check_two_stage_size, stages_option
from models.common.standard_options import decode_options, standard_options
from models.common.windows import (
    check_windows,
    live_frames,
    window_count,
    window_frames,
    window_options,
    window_starts,
    windows_of,
)

__all__ = ["ltx_video_options"]


def ltx_video_options(*, latent_upsampler: bool = False, stages: int | None = None) -> ModelOptions:
    """``latent_upsampler``: whether the folder has one (two-stage generation needs it); ``stages``: the folder's
    default stage count (``models.common.loading.recommended_stages``; unset: 2 with an upsampler, else 1)."""
    return ModelOptions("LTX-Video", (
        *standard_options(height=512, width=704, num_frames=161, frame_rate=25, num_inference_steps=50,
                          guidance_scale=3.0, size_step="a multiple of 32"),
        *decode_options(),
        Option("max_sequence_length", int, None, "text tokens the prompt is padded or cut to (unset: 128, or 256 "
               "with conditions or two stages, as LTXConditionPipeline)", lo=1, hi=1024, nullable=True),
        Option("image_cond_noise_scale", float, 0.15, "noise re-added at every step to fully conditioned tokens "
               "(with conditions)", lo=0, hi=1),
        stages_option(latent_upsampler=latent_upsampler, stages=stages,
                      refine="refines them with LTXConditionPipeline's denoise_strength=0.4 of 10 steps (4 steps)",
                      where="a latent_upsampler/ beside transformer/, e.g. Lightricks/ltxv-spatial-upscaler-0.9.7's"),
        Option("adain_factor", float, None, "AdaIN towards a reference's statistics: across windows, each window to "
               "the first (unset: 0.25, LTXI2VLongMultiPromptPipeline); with stages=2, the upsampled latents to stage "
               "1's (unset: 0.0, LTXLatentUpsamplePipeline; 1.0 in diffusers' LTX-Video 0.9.7/0.9.8 distilled "
               "recipes)", lo=0, hi=1, nullable=True),
        Option("tone_map_compression_ratio", float, 0.0, "with stages=2: tone mapping of the upsampled latents "
               "(LTXLatentUpsamplePipeline; 0.6 in diffusers' LTX-Video 0.9.8 recipe)", lo=0, hi=1),
        *window_options(default_tile=80, default_overlap=24),
        *cache_options(model="LTX-Video"),
    ), check=_check, window_frames=window_frames, live_frames=live_frames, live_prompts="prompt_segments",
        window_count=window_count, window_images=window_starts, check_media=_check_media)


def _check(values) -> None:
    check_two_stage_size(values)
    check_windows(values)


def _check_media(request) -> None:
    if request.conditions and windows_of(request) is not None and not request.options["cond_strength"]:
        raise ValueError("conditions: at cond_strength=0 a video longer than one window uses no image "
                         "(LTXI2VLongMultiPromptPipeline's rule), so its windows' images would be ignored; give "
                         "cond_strength above 0")
