"""The request options of LTX-Video models: names and defaults of diffusers' ``LTXPipeline`` (and, for media,
``LTXImageToVideoPipeline`` and ``LTXConditionPipeline``). Imports no model code, so front ends read it cheaply."""

from __future__ import annotations

from cp_infer.options import ModelOptions, Option

from ._standard_options import decode_options, standard_options

__all__ = ["ltx_video_options"]


def ltx_video_options() -> ModelOptions:
    return ModelOptions("LTX-Video", (
        *standard_options(height=512, width=704, num_frames=161, frame_rate=25, num_inference_steps=50,
                          guidance_scale=3.0, size_step="a multiple of 32"),
        *decode_options(),
        Option("max_sequence_length", int, None, "text tokens the prompt is padded or cut to (unset: 128, or 256 "
               "with conditions, as LTXConditionPipeline)", lo=1, hi=1024, nullable=True),
        Option("image_cond_noise_scale", float, 0.15, "noise re-added at every step to fully conditioned tokens "
               "(with conditions)", lo=0, hi=1),
    ))
