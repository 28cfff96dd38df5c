"""The options every video model declares (``cp_infer.options.STANDARD``), with each model's own defaults."""

from __future__ import annotations

from cp_infer.options import Option

__all__ = ["decode_options", "standard_options"]


def standard_options(*, height: int, width: int, num_frames: int, frame_rate: int, num_inference_steps: int,
                     guidance_scale: float, size_step: str) -> tuple[Option, ...]:
    """``size_step``: how the model's sizes are stepped, for the help (``a multiple of 32``)."""
    return (
        Option("negative_prompt", str, "", "what the video should not show"),
        Option("num_frames", int, num_frames, "number of frames, 8k+1", lo=1, limit="max_frames",
               flags=("--frames",)),
        Option("height", int, height, f"height in pixels, {size_step}", lo=1, limit="max_side"),
        Option("width", int, width, f"width in pixels, {size_step}", lo=1, limit="max_side"),
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
