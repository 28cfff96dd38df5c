"""The options every video model declares (``cp_infer.options.STANDARD``), with each model's own defaults."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from cp_infer.options import Option

from .stages import STAGE_SIZE_STEP

__all__ = ["decode_options", "standard_options"]


def _frames_under(frame_step: int) -> Callable[[float, Mapping[str, Any], Any], int]:
    """``Option.fit`` of ``num_frames``: the longest ``t*k + 1`` frames within the limit (``t``: the geometry's
    temporal compression, else ``frame_step``)."""

    def fit(hi: float, values: Mapping[str, Any], geometry: Any) -> int:
        t = geometry.temporal_compression if geometry is not None else frame_step
        return (int(hi) - 1) // t * t + 1

    return fit


def _side_under(side_step: int, smallest_side: int) -> Callable[[float, Mapping[str, Any], Any], int | None]:
    """``Option.fit`` of ``height`` and ``width``: the largest side within the limit that the geometry takes (else
    a multiple of ``side_step`` of at least ``smallest_side``), and with ``stages=2`` one whose half it takes."""

    def fit(hi: float, values: Mapping[str, Any], geometry: Any) -> int | None:
        step, smallest = side_step, smallest_side
        if geometry is not None:
            step, smallest = geometry.spatial_step, geometry.spatial_step * geometry.min_latent_side
        if values.get("stages") == 2:  # stage 1 runs at half the size (models.common.stages)
            halved = math.lcm(step, STAGE_SIZE_STEP), 2 * smallest
            if int(hi) // halved[0] * halved[0] < max(halved):
                fits = int(hi) // step * step >= max(smallest, step)
                raise ValueError(f"stages=2 halves the size, and no height or width within this server's max_side={hi} "
                                 f"halves to one the model takes: {'use stages=1' if fits else 'raise --max-side'}")
            step, smallest = halved
        side = int(hi) // step * step
        return side if side >= max(smallest, step) else None

    return fit


def standard_options(*, height: int, width: int, num_frames: int, frame_rate: int, num_inference_steps: int,
                     guidance_scale: float, size_step: str, frame_step: int = 8, side_step: int = 32,
                     smallest_side: int | None = None) -> tuple[Option, ...]:
    """``size_step``: how the model's sizes are stepped, for the help (``a multiple of 32``). ``frame_step``,
    ``side_step`` and ``smallest_side`` (default ``side_step``): the model's usual frame and size steps, which a
    default over the deployment's limit is lowered along where the model's geometry is not known."""
    sides = _side_under(side_step, smallest_side or side_step)
    return (
        Option("negative_prompt", str, "", "what the video should not show"),
        Option("num_frames", int, num_frames, "number of frames, 8k+1", lo=1, limit="max_frames",
               flags=("--frames",), fit=_frames_under(frame_step)),
        Option("height", int, height, f"height in pixels, {size_step}", lo=1, limit="max_side", fit=sides),
        Option("width", int, width, f"width in pixels, {size_step}", lo=1, limit="max_side", fit=sides),
        Option("num_inference_steps", int, num_inference_steps, "denoising steps", lo=2, limit="max_steps",
               flags=("--steps",)),
        Option("guidance_scale", float, guidance_scale, "classifier-free guidance scale; <= 1 turns it off", lo=0,
               limit="max_guidance", flags=("--guidance",)),
        Option("frame_rate", int, frame_rate, "frames per second: conditions the model and sets the output's rate",
               lo=1, limit="max_fps", aliases=("fps",), flags=("--fps",)),
    )


def decode_options() -> tuple[Option, ...]:
    """The timestep-conditioned VAE decode's settings (LTX-Video 0.9.1+, LTX-2)."""
    return (
        Option("decode_timestep", float, 0.0, "the VAE decoder's timestep (0.05 is what Lightricks recommends for "
               "timestep-conditioned VAEs)", lo=0, hi=1),
        Option("decode_noise_scale", float, None, "noise mixed into the latents before the decode (unset: "
               "decode_timestep)", lo=0, hi=1, nullable=True),
    )
