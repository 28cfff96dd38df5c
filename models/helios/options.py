"""The request options of Helios models: names and defaults of diffusers' ``HeliosPipeline``, and the chunk
arithmetic a request's plan follows (:class:`Chunks`). Imports no model code, so front ends read it cheaply.

Invariants:
- A video is made in chunks of ``num_latent_frames_per_chunk`` latent frames, each decoded alone to
  ``(n - 1) * 4 + 1`` video frames; ``HeliosPipeline`` makes ``max(1, ceil(num_frames / chunk_frames))`` chunks and
  returns their frames cut to ``4k + 1``. A request's ``num_frames`` is the frame count the pipeline returns for its
  chunks (:meth:`Chunks.video_frames`), so that the video it asks for is the one it gets; any other is refused
  naming the nearest ones.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cp_infer.options import ModelOptions, Option
from cp_infer.request import GenerationRequest
from cp_infer.step_cache import cache_options
from models.common.standard_options import standard_options
from models.common.windows import prompt_segments_option, window_prompts

__all__ = ["HELIOS_TEMPORAL_COMPRESSION", "HELIOS_TEXT_TOKENS", "Chunks", "Pyramid", "chunk_prompts", "chunks_of",
           "helios_options", "video_clip"]

HELIOS_TEMPORAL_COMPRESSION = 4
"""Video frames per latent frame of Helios's VAE (``AutoencoderKLWan``; the first latent frame of a chunk holds one)."""
HELIOS_TEXT_TOKENS = 512
"""``HeliosPipeline``'s ``max_sequence_length``."""
_MAX_CHUNKS = 10_000


@dataclass(frozen=True)
class Pyramid:
    """What a ``HeliosPyramidPipeline`` folder runs (its ``model_index.json`` and scheduler config): each chunk
    denoised coarse to fine in ``stages`` stages, each at twice the size of the one before."""

    stages: int
    """The scheduler's ``stages`` (the pyramid's levels)."""
    cfg_zero_star: bool = False
    """``is_cfg_zero_star``: CFG-Zero* (the unconditional prediction scaled by its projection on the conditional's)."""
    distilled: bool = False
    """``is_distilled``: a step-distilled checkpoint."""
    dmd: bool = False
    """The scheduler steps by DMD (``HeliosDMDScheduler``): each step re-noised towards the stage's start latents."""

    def steps(self, stage_steps: int, chunk: int, amplify: bool) -> int:
        """Steps of one stage of chunk ``chunk``: ``is_amplify_first_chunk`` doubles the first chunk's under DMD."""
        return stage_steps * 2 if amplify and chunk == 0 and self.dmd else stage_steps


@dataclass(frozen=True)
class Chunks:
    """The chunks of one request."""

    count: int
    """How many chunks the video is made in."""
    latent_frames: int
    """Latent frames per chunk (``num_latent_frames_per_chunk``)."""

    @property
    def chunk_frames(self) -> int:
        """Video frames one chunk decodes to (the pipeline's ``window_num_frames``)."""
        return (self.latent_frames - 1) * HELIOS_TEMPORAL_COMPRESSION + 1

    @property
    def video_frames(self) -> int:
        """Video frames the pipeline returns: every chunk's, cut to ``4k + 1``."""
        t = HELIOS_TEMPORAL_COMPRESSION
        return (self.count * self.chunk_frames - 1) // t * t + 1

    @classmethod
    def for_frames(cls, num_frames: int, latent_frames: int) -> Chunks:
        """The chunks ``HeliosPipeline`` makes for ``num_frames``."""
        chunk_frames = (latent_frames - 1) * HELIOS_TEMPORAL_COMPRESSION + 1
        return cls(max(1, math.ceil(num_frames / chunk_frames)), latent_frames)


def chunks_of(values: GenerationRequest | Mapping[str, Any]) -> Chunks:
    """The chunks of a resolved request (or its option values)."""
    if not isinstance(values, Mapping):
        values = {"num_frames": values.num_frames, **values.options}
    return Chunks.for_frames(values["num_frames"], values["num_latent_frames_per_chunk"])


def chunk_prompts(request: GenerationRequest) -> list[str]:
    """The prompt of each chunk: with ``prompt_segments`` (the windows' option, its windows the chunks), each chunk
    its segment's text, gaps taking the one before (``models.common.windows.window_prompts``); else the prompt, whole,
    as ``HeliosPipeline`` takes it."""
    count = chunks_of(request).count
    if not request.options.get("prompt_segments"):
        return [request.prompt] * count
    return window_prompts(request, range(count))  # only its length is read: the chunks are the windows


def _check_history(sizes: tuple[int, ...]) -> None:
    if len(sizes) != 3:
        raise ValueError(f"history_sizes={list(sizes)} must be 3 sizes in latent frames (long, mid, short), e.g. "
                         "[16, 2, 1]")


def _check(values: Mapping[str, Any]) -> None:
    if not values["keep_first_frame"]:
        # HeliosPipeline (diffusers 0.42) then splits its history into one latent frame more than it holds.
        raise ValueError("keep_first_frame=false: diffusers' HeliosPipeline fails with it (its short history is one "
                         "latent frame longer than the history it cuts it from); use true")
    for kind in ("image", "video"):
        lo, hi = values[f"{kind}_noise_sigma_min"], values[f"{kind}_noise_sigma_max"]
        if lo > hi:
            raise ValueError(f"{kind}_noise_sigma_min={lo} is above {kind}_noise_sigma_max={hi}; swap them")
    chunks = chunks_of(values)
    if values["num_frames"] != chunks.video_frames:
        below = Chunks(max(1, chunks.count - 1), chunks.latent_frames).video_frames
        near = sorted({below, chunks.video_frames})
        raise ValueError(f"num_frames={values['num_frames']}: Helios makes whole chunks of {chunks.chunk_frames} "
                         f"frames (num_latent_frames_per_chunk={chunks.latent_frames}), cut to 4k+1 frames; try "
                         f"{' or '.join(map(str, near))}")
    if values.get("prompt_segments") and chunks.count == 1:
        raise ValueError("prompt_segments: the video is one chunk (num_frames <= the frames of a chunk); give one "
                         "prompt, or ask for more frames")
    if chunks.count > _MAX_CHUNKS:
        raise ValueError(f"num_frames={values['num_frames']} is {chunks.count} chunks; at most {_MAX_CHUNKS}")


def video_clip(request: GenerationRequest):
    """Video-to-video: the video a request continues (``HeliosPipeline``'s ``video``), given as its one condition;
    ``None``: none."""
    return request.conditions[0] if request.conditions else None


def _check_media(request: GenerationRequest) -> None:
    """A request's media as ``HeliosPipeline`` takes them: an image (the first frame), or one clip (``video``, the
    video the chunks continue: its last whole chunks encoded, the frames before them dropped, as the pipeline does)."""
    if not request.conditions:
        return
    chunks = chunks_of(request)
    if len(request.conditions) > 1:
        raise ValueError(f"conditions has {len(request.conditions)} items: Helios takes one video to continue "
                         "(HeliosPipeline's video) as conditions[0], or an image as the first frame; give one")
    clip = request.conditions[0]
    if clip.frame_index != 0 or clip.strength != 1.0:
        raise ValueError(f"conditions[0].frame_index={clip.frame_index}, strength={clip.strength}: Helios continues "
                         "the video (HeliosPipeline's video), it does not place it in the output; give it at "
                         "frame_index 0 with strength 1")
    if clip.frames.shape[0] < chunks.chunk_frames:
        raise ValueError(f"conditions[0].media has {clip.frames.shape[0]} frames: Helios encodes the video it "
                         f"continues in whole chunks of {chunks.chunk_frames} frames (num_latent_frames_per_chunk="
                         f"{chunks.latent_frames}); give at least {chunks.chunk_frames} frames, or an image")


def _frames_under(hi: float, values: Mapping[str, Any], geometry: Any) -> int | None:
    """``num_frames``' fit: the longest video of whole chunks within ``hi`` frames."""
    latent = values["num_latent_frames_per_chunk"]
    count = Chunks.for_frames(int(hi), latent).count
    while count > 1 and Chunks(count, latent).video_frames > hi:
        count -= 1
    frames = Chunks(count, latent).video_frames
    return frames if frames <= hi else None


def _chunk_frames(values: Mapping[str, Any]) -> int:
    """Video frames of the longest sequence denoised at once: one chunk (its history tokens come on top)."""
    return chunks_of(values).chunk_frames


def _live_frames(values: Mapping[str, Any], count: int) -> int:
    """Video frames of ``count`` whole chunks: a chunk's plan and draws do not depend on how many follow it."""
    return Chunks(count, values["num_latent_frames_per_chunk"]).video_frames


def _check_pyramid(values: Mapping[str, Any]) -> None:
    steps = values["pyramid_num_inference_steps_list"]
    if values["num_inference_steps"] != sum(steps):
        raise ValueError(f"num_inference_steps={values['num_inference_steps']}: a pyramid runs "
                         f"pyramid_num_inference_steps_list={list(steps)}'s steps a chunk ({sum(steps)}); give "
                         f"num_inference_steps={sum(steps)}, or a list that adds up to {values['num_inference_steps']}")
    step = 16 * 2 ** (len(steps) - 1)
    for side in ("height", "width"):
        if values[side] % step:
            raise ValueError(f"{side}={values[side]}: a pyramid of {len(steps)} stages halves the size "
                             f"{len(steps) - 1} times, so it takes multiples of {step}; try "
                             f"{max(step, values[side] // step * step)}")


def _pyramid_options(pyramid: Pyramid) -> tuple[Option, ...]:
    def check_stages(steps: tuple[int, ...]) -> None:
        if len(steps) != pyramid.stages:
            raise ValueError(f"pyramid_num_inference_steps_list={list(steps)}: this model's scheduler has "
                             f"{pyramid.stages} stages; give {pyramid.stages} step counts, e.g. "
                             f"{[10] * pyramid.stages}")

    return (
        Option("pyramid_num_inference_steps_list", tuple, (10,) * pyramid.stages, "steps of each stage of the "
               "pyramid, coarse to fine (their sum is num_inference_steps)", lo=1, hi=200, max_items=pyramid.stages,
               check=check_stages),
        Option("use_zero_init", bool, True, "CFG-Zero* (a model that uses it): the first steps of the first stage "
               "predict zero"),
        Option("zero_steps", int, 1, "CFG-Zero*: the steps from the first that predict zero (with use_zero_init), "
               "one more than this", lo=0, hi=200),
        Option("is_amplify_first_chunk", bool, False, "a DMD-scheduled (distilled) model: twice the steps in each "
               "stage of the first chunk"),
    )


def helios_options(pyramid: Pyramid | None = None) -> ModelOptions:
    """``HeliosPipeline``'s options (text-, image- and video-to-video); with ``pyramid``,
    ``HeliosPyramidPipeline``'s (its stages' steps for ``num_inference_steps``)."""
    standard = {o.name: o for o in standard_options(
        height=384, width=640, num_frames=129, frame_rate=24,
        num_inference_steps=50 if pyramid is None else 10 * pyramid.stages, guidance_scale=5.0,
        size_step="a multiple of 16", frame_step=HELIOS_TEMPORAL_COMPRESSION, side_step=16)}
    standard["num_frames"] = dataclasses.replace(
        standard["num_frames"], fit=_frames_under,
        help="number of frames: whole chunks (33 frames each by default), cut to 4k+1 (33, 65, 97, 129, 165, ...)")
    standard["frame_rate"] = dataclasses.replace(
        standard["frame_rate"], help="frames per second of the output (Helios is not conditioned on it)")
    options = (
        *standard.values(),
        Option("max_sequence_length", int, HELIOS_TEXT_TOKENS, "text tokens the prompt is padded or cut to", lo=1,
               hi=HELIOS_TEXT_TOKENS),
        Option("num_latent_frames_per_chunk", int, 9, "latent frames each chunk makes (4 video frames each, the "
               "first one)", lo=1, hi=64),
        Option("history_sizes", tuple, (16, 2, 1), "latent frames of the long, mid and short history each chunk "
               "attends to (sorted from big to small, as the pipeline sorts them)", lo=1, hi=256, max_items=3,
               check=_check_history),
        Option("keep_first_frame", bool, True, "keep the video's first latent frame in every chunk's short history"),
        # The windows' option, its windows the chunks (start_window, end_window: chunk indices).
        dataclasses.replace(prompt_segments_option(), help="a prompt per range of chunks: [{\"start_window\": 0, "
                            "\"end_window\": 1, \"text\": \"...\"}, ...] (windows are chunks; gaps take the prompt "
                            "before; unset: the prompt for every chunk)"),
        Option("add_noise_to_image_latents", bool, True, "with an image: noise its latents (and the still video's "
               "last latent frame in the history) by a sigma drawn between the min and max below"),
        Option("image_noise_sigma_min", float, 0.111, "with an image: the smallest sigma its latents are noised by",
               lo=0, hi=1),
        Option("image_noise_sigma_max", float, 0.135, "with an image: the largest sigma its latents are noised by",
               lo=0, hi=1),
        Option("add_noise_to_video_latents", bool, True, "with a video: noise its first frame's latents (by a sigma "
               "between the image's min and max) and each of its latent frames (by a sigma between the video's)"),
        Option("video_noise_sigma_min", float, 0.111, "with an image, the smallest sigma the still video's latent "
               "frame in the history is noised by; with a video, each of its latent frames", lo=0, hi=1),
        Option("video_noise_sigma_max", float, 0.135, "with an image, the largest sigma the still video's latent "
               "frame in the history is noised by; with a video, each of its latent frames", lo=0, hi=1),
        *(() if pyramid is None else _pyramid_options(pyramid)),
        *cache_options(model="Helios"),
    )

    def check(values: Mapping[str, Any]) -> None:
        _check(values)
        if pyramid is not None:
            _check_pyramid(values)
    # An image is the first frame: the first latent frame every chunk's short history starts with. A video (one clip
    # as conditions[0]) is the video the chunks continue: its latents are the first chunk's history.
    return ModelOptions("Helios", options, takes_media=True, check=check, window_media=("image", "conditions"),
                        window_frames=_chunk_frames, window_tile_causal=True, check_media=_check_media,
                        live_frames=_live_frames, live_prompts="prompt_segments")
