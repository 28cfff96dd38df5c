"""What the LTX-Video and LTX-2 adapters do alike: refuse schedulers that would make ranks diverge, and noise and
decode the video latents the way their diffusers pipelines do, reproducibly on every rank.

Invariants:
- Every random draw here is made alike on every rank (same generator state, same seed), so that ranks agree
  without communicating, and a 1-rank run draws what the pipeline draws.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from cp_infer.decode import TemporalSplit, resolve_frames_per_rank
from cp_infer.request import GenerationRequest

from .ltx_vae_parallel import DecodeContext, decode_cost, decode_round

__all__ = ["DecodeNoise", "decode_round_uint8", "decode_split", "device_generator", "noise_for_decode",
           "refuse_stochastic_sampling", "scoped", "video_uint8"]


def refuse_stochastic_sampling(scheduler) -> None:
    """Raise if ``scheduler`` draws noise at every step (each rank would draw its own for its shard)."""
    if scheduler.config.get("stochastic_sampling", False):
        raise ValueError("stochastic_sampling schedulers draw per-step noise that would differ per shard; "
                         "set stochastic_sampling=false in scheduler/scheduler_config.json")


def device_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: noise drawn on the device it is used on, with no host draw and
    copy (on the CPU, the CPU generator of the same seed: the same values). The meta device has none; a draw there has
    no values, so it takes the CPU's."""
    return torch.Generator("cpu" if device.type == "meta" else device).manual_seed(int(seed))


def decode_split(vae, latent_frames: int, *, world: int, temporal_compression: int, frames_per_rank,
                 request: GenerationRequest) -> TemporalSplit:
    """The streamed decode's pieces for this request: the deployment's round size for the frame size, cut to equal
    decoder work (the first piece also runs the decoder's look-ahead)."""
    return TemporalSplit(latent_frames=latent_frames, world=world, temporal_compression=temporal_compression,
                         frames_per_rank=resolve_frames_per_rank(frames_per_rank, height=request.height,
                                                                 width=request.width,
                                                                 temporal_compression=temporal_compression),
                         cost=decode_cost(vae, latent_frames))


def noise_for_decode(latents: torch.Tensor, *, vae, generator: torch.Generator,
                     request: GenerationRequest) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(latents, timestep)`` to decode: for a timestep-conditioned VAE, the latents noised by the request's decode
    noise scale and its decode timestep, as the pipelines do; for any other, ``latents`` unchanged and ``None``."""
    noise = DecodeNoise(latents.shape, vae=vae, generator=generator, request=request, dtype=latents.dtype)
    return noise.apply(latents, 0), noise.timestep


class DecodeNoise:
    """The decode noise of a whole video's latents, drawn at once (on every rank from the same generator state),
    applied to any part of them: the same values as applied to the whole."""

    def __init__(self, shape: torch.Size, *, vae, generator: torch.Generator, request: GenerationRequest,
                 dtype: torch.dtype):
        self.noise = self.timestep = None
        if not vae.config.timestep_conditioning:
            return
        self.noise = torch.randn(shape, generator=generator, dtype=dtype)
        decode_timestep, scale = request.options["decode_timestep"], request.options["decode_noise_scale"]
        self.scale = decode_timestep if scale is None else scale
        self.timestep = torch.tensor([decode_timestep], dtype=dtype)

    @property
    def length_free(self) -> bool:
        """Whether applying it leaves each latent frame the same however long the video is: none is drawn, or its
        scale is 0 (``(1 - 0) * x + 0 * noise`` is ``x``); otherwise a frame's noise depends on the video's length
        (``Decoder.length_free``)."""
        return self.noise is None or float(self.scale) == 0.0

    def apply(self, latents: torch.Tensor, start: int) -> torch.Tensor:
        """``latents``: the latent frames ``start..`` of the video, noised (unchanged for a VAE without)."""
        if self.noise is None:
            return latents
        self.timestep = self.timestep.to(latents.device)
        noise = self.noise[:, :, start:start + latents.shape[2]].to(latents.device)
        return (1 - self.scale) * latents + self.scale * noise


def decode_round_uint8(pipe, vae, ctx: DecodeContext, latents: torch.Tensor, a: int, b: int,
                       timestep: torch.Tensor | None, *, seed: int,
                       split_scope: contextlib.AbstractContextManager[None]) -> np.ndarray:
    """Decode latent frames ``[a, b)`` of ``latents`` (one round's piece, inside ``split_scope``, the model's
    context that sets the split on ``ctx``) into uint8 frames [F, H, W, 3] through the pipeline's post-processing."""
    # NOTE(decode-noise): decoders that inject noise (real LTX-Video 0.9.1 ones) draw it from the global RNG (the
    # pipeline passes no generator), the same spatial noise for every frame; seed it from the request, inside a
    # forked RNG, the same on every rank and in every round, so that each draws the whole decode's noise and the
    # video is reproducible.
    devices = [latents.device] if latents.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), split_scope:
        torch.manual_seed(seed)
        video = decode_round(vae, ctx, latents, a, b, timestep)
    return video_uint8(pipe, video)


def video_uint8(pipe, video: torch.Tensor) -> np.ndarray:
    """The pipelines' post-processing of a decoded piece ``[1, 3, F, H, W]`` to uint8 frames ``[F, H, W, 3]``."""
    frames = pipe.video_processor.postprocess_video(video, output_type="np")[0]
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


@contextlib.contextmanager
def scoped(ctx: object, name: str, value: object) -> Iterator[None]:
    """Set ``ctx.name`` for the duration of a block (a model's per-call parallel context)."""
    setattr(ctx, name, value)
    try:
        yield
    finally:
        setattr(ctx, name, None)
