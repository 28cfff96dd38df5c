"""Conditioned LTX-2: ``GenerationRequest.image`` as diffusers' ``LTX2ImageToVideoPipeline`` takes its image,
``GenerationRequest.conditions`` as ``LTX2ConditionPipeline`` takes its ``LTX2VideoCondition`` list, prepared by
those pipelines' own helpers (resize, H.264 re-compression, VAE encode, noise, masks, keyframe coordinates).

Invariants:
- The media are encoded on every rank alike, inside ``LTX2Model.prepare`` (which the sampler agrees on like a
  step), from the request's CPU generator in the pipelines' order: every rank holds the same conditioned latents,
  and a 1-rank run draws what the pipeline draws.
- Conditions after latent frame 0 become keyframe tokens that follow the video's own tokens in the one video
  stream, with their own RoPE coordinates. The stream is sharded as a whole by one ``ShardPlan``, so the
  per-token mask and clean latents are cut exactly like the latents: a keyframe token is a token like any other,
  and padding stays at the stream's end, never attended.
- ``LTX2ConditionPipeline`` indexes conditions by latent frame; a request's ``frame_index`` is an output frame
  (:func:`latent_index` maps one to the other).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import LTX2ConditionPipeline, LTX2ImageToVideoPipeline
from diffusers.pipelines.ltx2 import LTX2VideoCondition
from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
from PIL import Image

from cp_infer import LatentShape, ShardPlan
from cp_infer.request import GenerationRequest, resolve_frame_index

__all__ = ["CONDITION_NOISE_SCALE", "IMAGE_CRF", "VideoConditioning", "latent_index", "prepare_conditions",
           "prepare_image"]

# The pipelines' defaults for their conditioning arguments (no request field sets them yet):
IMAGE_CRF: int | None = None
"""``image_crf`` (LTX2ImageToVideoPipeline) and ``LTX2VideoCondition.crf``: the H.264 CRF a single-frame condition
is re-compressed at before its encode; ``None``: the model's own (``resolve_default_image_crf``: 33 through
LTX-2.3, 18 for LTX-2.5); 0 skips it. Clips are never re-compressed."""
CONDITION_NOISE_SCALE = 1.0
"""LTX2ConditionPipeline's ``noise_scale``: unset, ``sigmas[0]`` of custom sigmas, else 1.0 (the engine passes
none): the noise level the unconditioned tokens start at."""
_I2V_NOISE_SCALE = 0.0
"""LTX2ImageToVideoPipeline's ``noise_scale`` (as LTX2Pipeline's, it only noises caller-supplied latents)."""


@dataclass(frozen=True)
class VideoConditioning:
    """A conditioned request's video stream: which tokens are conditioned and how strongly (the same on every
    rank; each uses its shard)."""

    mask: torch.Tensor
    """``[1, S]``: each token's conditioning strength, 1 kept clean, 0 generated (the pipelines'
    ``conditioning_mask``; S counts the keyframe tokens)."""
    clean: torch.Tensor | None
    """``[1, S, C]``: the conditioning latents (zeros where unconditioned), which LTX2ConditionPipeline blends into
    every step's denoised sample; ``None`` for image-to-video, whose first latent frame is never stepped."""
    video_tokens: int
    """The video's own tokens, first in the stream; any after them are keyframe tokens, dropped at the end."""

    def to(self, device: torch.device) -> VideoConditioning:
        """The same conditioning on ``device`` (the one its steps run on)."""
        clean = None if self.clean is None else self.clean.to(device)
        return dataclasses.replace(self, mask=self.mask.to(device), clean=clean)

    def timestep(self, t: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
        """``[B, S_LOCAL]``: this rank's per-token timesteps ``t * (1 - mask)`` for the batch timesteps ``t [B]``
        (padding tokens get ``t``; their outputs are discarded)."""
        return t.unsqueeze(-1) * (1 - plan.shard(self.mask, rank))  # 1, S -> 1, S_LOCAL; broadcast to B

    def blend_denoised(self, x0_local: torch.Tensor, plan: ShardPlan, rank: int) -> torch.Tensor:
        """The guided denoised sample ``[B, S_LOCAL, C]`` with the conditions blended in by strength (conditions;
        in x0 space, as LTX2ConditionPipeline does); unchanged for image-to-video."""
        if self.clean is None:
            return x0_local
        mask = plan.shard(self.mask, rank).unsqueeze(-1)  # 1, S -> 1, S_LOCAL, 1
        return (x0_local * (1 - mask) + plan.shard(self.clean, rank) * mask).to(x0_local.dtype)

    def keep_conditioned(self, stepped_local: torch.Tensor, latents_local: torch.Tensor, plan: ShardPlan,
                         rank: int) -> torch.Tensor:
        """Image-to-video: the first frame's tokens as they were (LTX2ImageToVideoPipeline steps the others only;
        the step is elementwise, so stepping all and keeping those is the same); conditions: ``stepped_local``."""
        if self.clean is not None:
            return stepped_local
        return torch.where(plan.shard(self.mask, rank).unsqueeze(-1) > 0.5, latents_local, stepped_local)


def latent_index(frame_index: int, num_frames: int, temporal_compression: int) -> int:
    """The latent frame that encodes output frame ``frame_index`` (negative: from the end): 0 for frame 0, else
    ``ceil(frame / temporal_compression)``. LTX2ConditionPipeline starts a condition at latent frame ``k``'s first
    output frame, ``(k - 1) * temporal_compression + 1``: exact for frame 0 and frames ``m * temporal_compression
    + 1``; any other moves back to the nearest such frame before it (-1, the last frame, is the last latent frame,
    as in the pipeline)."""
    frame = resolve_frame_index(frame_index, num_frames)
    return -(-frame // temporal_compression)


def prepare_image(pipe: LTX2ImageToVideoPipeline, request: GenerationRequest, *, channels: int,
                  dtype: torch.dtype, device: torch.device, generator: torch.Generator
                  ) -> tuple[torch.Tensor, VideoConditioning]:
    """LTX2ImageToVideoPipeline's image preparation (``dtype``: the prompt embeddings'): packed latents ``[1, S, C]``
    (the encoded image as the first latent frame, noise elsewhere) and their conditioning."""
    image = Image.fromarray(request.image.frames[0])
    # NOTE(crf): every rank re-compresses the image itself; x264 encodes repeatably (its non-deterministic mode is
    # off by default), so the ranks' pixels agree.
    crf = IMAGE_CRF if IMAGE_CRF is not None else resolve_default_image_crf(pipe.text_encoder)
    if crf != 0:
        image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
    pixels = pipe.video_processor.preprocess(image, height=request.height, width=request.width)
    latents, mask = pipe.prepare_latents(pixels.to(device=device, dtype=dtype), 1, channels, request.height,
                                         request.width, request.num_frames, _I2V_NOISE_SCALE, torch.float32, device,
                                         generator)
    return latents, VideoConditioning(mask=mask, clean=None, video_tokens=latents.shape[1])


def prepare_conditions(pipe: LTX2ConditionPipeline, request: GenerationRequest, shape: LatentShape, *,
                       channels: int, fps: float, device: torch.device, generator: torch.Generator,
                       latents: torch.Tensor | None = None, noise_scale: float = CONDITION_NOISE_SCALE
                       ) -> tuple[torch.Tensor, VideoConditioning, torch.Tensor | None]:
    """LTX2ConditionPipeline's preparation of ``request.conditions``: packed latents ``[1, S, C]`` (the video's
    tokens, then any keyframe tokens), their conditioning, and the keyframe tokens' coordinates ``[1, 3, K, 2]``
    (``None`` without keyframes) to append to the video's. ``latents`` and ``noise_scale``: the pipeline given
    ``latents`` (``[1, C, F, H, W]``, denormalised) renoised to ``noise_scale`` (stage 2 of two)."""
    t_ratio = pipe.vae_temporal_compression_ratio
    conditions = [LTX2VideoCondition(frames=cond.frames, index=latent_index(cond.frame_index, request.num_frames,
                                                                            t_ratio),
                                     strength=float(cond.strength), crf=IMAGE_CRF)
                  for cond in request.conditions]
    latents, mask, clean, keyframe_coords = pipe.prepare_latents(
        conditions=conditions, batch_size=1, num_channels_latents=channels, height=request.height,
        width=request.width, num_frames=request.num_frames, frame_rate=fps, noise_scale=noise_scale,
        dtype=torch.float32, device=device, generator=generator, latents=latents)
    conditioning = VideoConditioning(mask=mask.squeeze(-1), clean=clean, video_tokens=shape.tokens)
    return latents, conditioning, keyframe_coords
