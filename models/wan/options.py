"""The request options of Wan models: names and defaults of diffusers' ``WanPipeline`` (and, for an image,
``WanImageToVideoPipeline``), what a Wan folder's ``model_index.json`` says of its pipeline (:class:`WanLayout`), and
the windows of a video longer than one (:func:`wan_windows_of`; ``models.wan.windows`` runs them). Imports no model
code, so front ends read it cheaply."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cp_infer.options import ModelOptions, Option
from cp_infer.request import GenerationRequest
from cp_infer.step_cache import cache_options
from models.common.standard_options import standard_options
from models.common.windows import Windows, prompt_segments_option

__all__ = ["CHAINED", "WAN_TEMPORAL_COMPRESSION", "WAN_TEXT_TOKENS", "WanLayout", "wan_options", "wan_windows_of"]

WAN_TEMPORAL_COMPRESSION = 4
"""Video frames per latent frame of ``AutoencoderKLWan`` (the first latent frame holds one): ``4k + 1`` frames are
``k + 1`` latent frames."""

CHAINED = 1
"""The overlap, in latent frames, of the windows of image-to-video folders (``WanImageToVideoPipeline``): each window
after the first is the image-to-video of the last video frame of the one before, its own first latent frame (that
image, a frame alone, as the causal VAE encodes a first frame) in the place of the one before's last."""

WAN_TEXT_TOKENS = 512
"""The text tokens Wan 2.1 image-to-video's cross-attention takes: diffusers' ``WanAttnProcessor`` splits its
context as ``[image tokens, the last 512]``, so with CLIP image tokens a prompt is padded to exactly 512."""


@dataclass(frozen=True)
class WanLayout:
    """Which Wan pipeline a folder holds: its ``model_index.json`` (and, for the image tokens, its transformer)."""

    image: bool = False
    """``WanImageToVideoPipeline``: requests take the first frame as an image (and need one)."""
    experts: int = 1
    """2 for Wan 2.2 A14B: ``transformer`` while ``t >= boundary_ratio * 1000``, then ``transformer_2``."""
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    """Wan 2.2 TI2V-5B: a timestep per token (the image's first latent frame at 0)."""
    image_tokens: bool = False
    """Wan 2.1 I2V: CLIP image tokens in every cross-attention (an image encoder, ``image_dim`` set)."""

    @property
    def takes_image(self) -> bool:
        """Requests may give the first frame: an image-to-video folder (which needs one), or TI2V-5B's."""
        return self.image or self.expand_timesteps

    @classmethod
    def from_index(cls, index: Mapping[str, Any], transformer_config: Mapping[str, Any]) -> WanLayout:
        def present(name: str) -> bool:
            entry = index.get(name)
            return isinstance(entry, (list, tuple)) and len(entry) == 2 and entry[1] is not None

        image = index.get("_class_name") == "WanImageToVideoPipeline"
        experts = 2 if present("transformer_2") and index.get("boundary_ratio") is not None else 1
        return cls(image=image, experts=experts,
                   boundary_ratio=None if experts == 1 else float(index["boundary_ratio"]),
                   expand_timesteps=bool(index.get("expand_timesteps", False)),
                   image_tokens=image and transformer_config.get("image_dim") is not None)


def wan_options(layout: WanLayout = WanLayout()) -> ModelOptions:
    """The options of a Wan folder of ``layout`` (Wan 2.1 text-to-video by default)."""
    # The output's frame rate: 16 fps for Wan 2.1 and 2.2 A14B, 24 for TI2V-5B (their model cards' exports).
    fps = 24 if layout.expand_timesteps else 16
    standard = {o.name: o for o in standard_options(
        height=480, width=832, num_frames=81, frame_rate=fps, num_inference_steps=50, guidance_scale=5.0,
        size_step="a multiple of 32" if layout.expand_timesteps else "a multiple of 16",
        frame_step=WAN_TEMPORAL_COMPRESSION, side_step=32 if layout.expand_timesteps else 16)}
    standard["num_frames"] = dataclasses.replace(standard["num_frames"], help="number of frames, 4k+1")
    standard["frame_rate"] = dataclasses.replace(
        standard["frame_rate"], help="frames per second of the output (Wan is not conditioned on it)")
    options = [
        *standard.values(),
        Option("max_sequence_length", int, WAN_TEXT_TOKENS, "text tokens the prompt is padded or cut to"
               + (f" (exactly {WAN_TEXT_TOKENS} with CLIP image tokens)" if layout.image_tokens else ""),
               lo=1, hi=WAN_TEXT_TOKENS),
        Option("flow_shift", float, None, "the scheduler's flow shift (unset: the folder's scheduler config; Wan "
               "uses 3.0 at 480p, 5.0 at 720p)", lo=0.1, hi=20, nullable=True),
    ]
    if layout.experts == 2:
        options.append(Option("guidance_scale_2", float, None, "guidance scale of the low-noise expert "
                              "(transformer_2; unset: guidance_scale)", lo=0, limit="max_guidance", nullable=True))
    if layout.image:
        # Image-to-video folders chain their windows on one frame (models.wan.windows): no overlap to choose.
        options.append(Option("temporal_tile_size", int, 81, "frames per window, 4k+1: a longer video is made "
                              "window by window, each the image-to-video of the last frame of the one before",
                              lo=5, hi=100_000))
    else:
        options += [
            Option("temporal_tile_size", int, 81, "frames per window, 4k+1: a longer video is made window by window, "
                   "each starting from the last temporal_overlap frames of the one before", lo=5, hi=100_000),
            Option("temporal_overlap", int, 20, "frames each window starts from the one before: a multiple of 4, "
                   "fewer than temporal_tile_size", lo=4, hi=100_000, multiple_of=WAN_TEMPORAL_COMPRESSION),
        ]
    options.append(prompt_segments_option())
    options.extend(cache_options(model="Wan"))

    def check(values: Mapping[str, Any]) -> None:
        if layout.image_tokens:
            _check_text_tokens(values)
        _check_windows(values)

    # The image is the first window's first frame (TI2V-5B, and image-to-video folders, whose later windows chain).
    return ModelOptions("Wan", tuple(options), takes_media=layout.takes_image, needs_image=layout.image, check=check,
                        window_media=("image",) if layout.takes_image else (), window_frames=_window_frames,
                        window_images=_chained_starts if layout.image else None, check_media=_check_media,
                        window_count=_window_count,
                        window_tile_causal=True,
                        live_frames=_live_frames,
                        live_prompts="prompt_segments")


def wan_windows_of(values: GenerationRequest | Mapping[str, Any]) -> Windows | None:
    """The windows of a resolved request (or its option values) in latent frames, ``None`` when it fits one window:
    windows of ``(temporal_tile_size - 1) // 4 + 1`` latent frames (``models.common.windows.Windows``' spans), each
    after
    the first starting on the last ``temporal_overlap // 4`` latent frames of the one before; on the last one
    (:data:`CHAINED`) where the options have no ``temporal_overlap`` (image-to-video folders)."""
    if not isinstance(values, Mapping):
        values = {"num_frames": values.num_frames, **values.options}
    t = WAN_TEMPORAL_COMPRESSION
    latent = (values["num_frames"] - 1) // t + 1
    tile = (values["temporal_tile_size"] - 1) // t + 1
    if latent <= tile:
        return None
    overlap = values.get("temporal_overlap")
    return Windows(latent, tile, CHAINED if overlap is None else overlap // t)


def _live_frames(values: Mapping[str, Any], count: int) -> int:
    """Video frames of ``count`` whole windows (tail-conditioned or chained: a window's pass and draws do not depend
    on how many follow it, and every window, the last included, keeps the frame the next would start from). A video
    of one window is not made in windows, so a live one starts with two."""
    t = WAN_TEMPORAL_COMPRESSION
    tile = (values["temporal_tile_size"] - 1) // t + 1
    overlap = values.get("temporal_overlap")  # unset: chained windows (image-to-video folders)
    stride = tile - (CHAINED if overlap is None else overlap // t)
    if count < 2:
        raise ValueError(f"a live Wan video starts with 2 windows or more: num_frames={(tile + stride - 1) * t + 1} "
                         "or more at this temporal_tile_size and temporal_overlap")
    return (tile + (count - 1) * stride - 1) * t + 1


def _window_count(values: Mapping[str, Any]) -> int:
    windows = wan_windows_of(values)
    return 1 if windows is None else len(windows)


def _chained_starts(values: Mapping[str, Any]) -> tuple[int, ...]:
    """Chained windows (image-to-video folders): the video frame each window starts from (``ModelOptions.
    window_images``), the last frame of the one before; a window given its own image starts from that instead."""
    windows = wan_windows_of(values)
    return (0,) if windows is None else tuple(start * WAN_TEMPORAL_COMPRESSION for start, _ in windows.spans)


def _check_media(request: GenerationRequest) -> None:
    if request.conditions and wan_windows_of(request) is None:
        raise ValueError("conditions: Wan models take an image as the first frame (image), not conditions at frames "
                         "(an image-to-video model's video longer than one window takes images its windows start "
                         "from); give the first frame as image")


def _window_frames(values: Mapping[str, Any]) -> int:
    """Video frames of the longest sequence denoised at once: the whole video, or one window."""
    windows = wan_windows_of(values)
    if windows is None:
        return values["num_frames"]
    return (max(end - start for start, end in windows.spans) - 1) * WAN_TEMPORAL_COMPRESSION + 1


def _check_windows(values: Mapping[str, Any]) -> None:
    tile, overlap, t = values["temporal_tile_size"], values.get("temporal_overlap"), WAN_TEMPORAL_COMPRESSION
    if (tile - 1) % t:
        below = (tile - 1) // t * t + 1
        raise ValueError(f"temporal_tile_size={tile} is not 4k+1; try {below} or {below + t}")
    if overlap is not None and overlap // t >= (tile - 1) // t + 1:
        raise ValueError(f"temporal_overlap={overlap} is not fewer frames than temporal_tile_size={tile} (in latent "
                         f"frames of {t}): use a smaller overlap or a larger tile")
    if wan_windows_of(values) is None and values.get("prompt_segments"):
        raise ValueError("prompt_segments: the video fits one window (num_frames <= temporal_tile_size); give one "
                         "prompt, or ask for more frames")


def _check_text_tokens(values: Mapping[str, Any]) -> None:
    if values["max_sequence_length"] != WAN_TEXT_TOKENS:
        raise ValueError(f"max_sequence_length={values['max_sequence_length']}: this Wan image-to-video model's "
                         f"cross-attention takes exactly {WAN_TEXT_TOKENS} text tokens after its image tokens; use "
                         f"{WAN_TEXT_TOKENS}")
