"""The request options of LTX-2 (audio + video) models: names and defaults of diffusers' ``LTX2Pipeline``.
Imports no model code, so front ends read it cheaply."""

from __future__ import annotations

from cp_infer.options import ModelOptions, Option
from cp_infer.step_cache import cache_options

from ._stages import STAGE_SIZE_STEP, check_two_stage_size, stages_option
from ._standard_options import decode_options, standard_options
from ._windows import check_windows, window_frames, window_options

__all__ = ["STAGE_SIZE_STEP", "ltx2_options"]

# LTX2Pipeline perturbs block 28 (of LTX-2.0's 48); a smaller model gets its last block instead.
_STG_BLOCK = 28


def ltx2_options(*, layers: int = 48, latent_upsampler: bool = True, stages: int | None = None) -> ModelOptions:
    """``layers``: the transformer's block count (spatio-temporal guidance names blocks); ``latent_upsampler``:
    whether the folder has one (two-stage generation needs it); ``stages``: the folder's default stage count
    (``models.loading.recommended_stages``; unset: 2 with an upsampler, as Lightricks recommends, else 1)."""
    return ModelOptions("LTX-2", (
        *standard_options(height=512, width=768, num_frames=121, frame_rate=24, num_inference_steps=30,
                          guidance_scale=3.0, size_step="a multiple of 32, at least 64"),
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
    ), check=_check, window_frames=window_frames, window_media=())


def _check(values) -> None:
    check_two_stage_size(values)
    check_windows(values)
