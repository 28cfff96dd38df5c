"""Long LTX-Video window by window: diffusers' ``LTXI2VLongMultiPromptPipeline`` on the engine, each window one
sequence-parallel pass of the plan (``models.common.windows`` cuts the windows and builds the plan).

The maths is the pipeline's own, with its own helpers (``inject_prev_tail_latents``,
``build_video_coords_for_window``, ``adain_normalize_latents``, ``linear_overlap_fuse``): each window starts from
noise drawn from ``seed + start`` (by a generator on the model's device, as the pipeline's ``torch.Generator(device)``),
the previous window's tail appended as conditioning tokens (per-token timesteps
``t * mask``, blended towards their clean latents before and after every step, RoPE coordinates of the window's
start), and is fused into the video made so far (first frame dropped, AdaIN to the first window, a linear
crossfade over the overlap). Beyond the pipeline: a window given its own image (the request's ``conditions`` at
the frame it starts from, ``models.common.windows.window_starts``; a live video's direction with an image) takes
it as its negative-index frame in the place of the request's image, and so do the windows after it.

Invariants:
- Every rank prepares the same window, from the same gathered latents; a scheduler that draws noise at every step
  (``LTXEulerAncestralRFScheduler``) draws the noise of the whole window's sequence on every rank from the window's
  generator, each rank keeping its shard (:func:`_shard_noise`), so N ranks equal 1 rank.
- The video made so far (:class:`Video`) is the only state a window hands the next: a few latent frames on the CPU,
  saved after each window (``checkpoint``) so that a restarted job goes on from the last finished one. What a
  window's steps read (its noise, masks, conditioning latents, RoPE coordinates) is made on the model's device.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift
from diffusers.pipelines.ltx.pipeline_ltx_i2v_long_multi_prompt import (
    adain_normalize_latents,
    build_video_coords_for_window,
    inject_prev_tail_latents,
    linear_overlap_fuse,
)

from cp_infer import ShardPlan, pass_shares
from cp_infer.collectives import gather_passes
from cp_infer.request import Condition, GenerationRequest, window_images
from cp_infer.sampler import Prepared
from cp_infer.step_cache import StepCache
from cp_infer.weights import join_call
from models.common.adapter import device_generator
from models.common.step_cache import cached_call
from models.common.windows import Windows, windows_of

from .stages import REFINE_STEPS, refine_pass_steps

__all__ = ["Restored", "Video", "WindowPass", "finish_window", "predict_window", "prepare_window", "restore_state",
           "step_window"]


@dataclass
class Video:
    """The latents made so far ``[1, C, L, H, W]`` and the first window's (the AdaIN reference)."""

    latents: torch.Tensor
    first: torch.Tensor
    window: int
    """The last window folded in."""

    def checkpoint(self) -> dict[str, np.ndarray]:
        return {"latents": self.latents.numpy(), "first": self.first.numpy(),
                "window": np.array(self.window, dtype=np.int64)}


@dataclass
class Restored:
    """What a checkpoint gives back: the state the next window is prepared from (``previous_state``) and decoded
    with."""

    request: GenerationRequest
    windows: Windows
    video: Video
    stage: int = 0
    upsampled: torch.Tensor | None = None


def checkpoint(state: WindowPass) -> dict[str, np.ndarray]:
    arrays = dict(state.video.checkpoint(), stage=np.array(state.stage, dtype=np.int64))
    if state.upsampled is not None:
        arrays["upsampled"] = state.upsampled.numpy()
    return arrays


def restore_state(request: GenerationRequest, arrays: dict[str, np.ndarray]) -> tuple[Restored, int]:
    """A checkpoint (``Video.checkpoint``) of ``request`` back, checked against it; and its final latent frames."""
    windows = windows_of(request)
    try:
        video = Video(torch.from_numpy(np.array(arrays["latents"], dtype=np.float32)),
                      torch.from_numpy(np.array(arrays["first"], dtype=np.float32)), int(arrays["window"]))
        stage = int(arrays.get("stage", 0))
        upsampled = None if "upsampled" not in arrays else torch.from_numpy(np.array(arrays["upsampled"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a checkpoint of a long video: {exc}") from None
    last = len(windows) - 1 if windows is not None else -1
    if windows is None or not 0 <= video.window <= last or (video.window == last and stage != 1) \
            or video.latents.shape[2] != windows.made(video.window) or (stage == 2) != (upsampled is not None):
        raise ValueError("the checkpoint is not one of this request's windows")
    # A stage-1 window's latents are half the size: nothing of the video to decode is final yet.
    return Restored(request, windows, video, stage, upsampled), None if stage == 1 else windows.final(video.window)


@dataclass
class WindowPass:
    """One window's pass (``Prepared.state``): read by ``predict_window`` and ``step_window``."""

    request: GenerationRequest
    windows: Windows
    window: int
    embeds: torch.Tensor
    mask: torch.Tensor
    cfg_on: bool
    generator: torch.Generator
    """``seed + start``, on the model's device as the pipeline's: the window's noise, then the scheduler's per-step
    noise."""
    clean: torch.Tensor
    """``[1, S, C]`` the window's conditioning latents (zeros where it is free, the previous tail after it)."""
    cond: torch.Tensor
    """``[1, S, 1]`` each token's mask: 1 free, ``1 - strength`` for the previous tail."""
    coords: torch.Tensor
    """``[1, 3, S]`` RoPE coordinates (the tail at the window's start). Like ``clean`` and ``cond``, on the model's
    device: every step reads them."""
    size: tuple[int, int, int]
    """The window's latent ``(frames, height, width)`` with the tail."""
    tail: int
    """Latent frames of the previous tail appended (dropped again after the pass)."""
    before: Video | None
    """The video made before this window."""
    stage: int = 0
    """0: a one-stage window; 1: a window of stage 1 of two (half the size); 2: a window of stage 2 (full size)."""
    upsampled: torch.Tensor | None = None
    """Stage 2: stage 1's whole video upsampled ``[1, C, F, H, W]``, which its windows refine."""
    video: Video | None = None
    """The video made with this window (``finish_window``)."""
    cache: StepCache | None = None
    """The window's step cache (``cache="none"``: none): each window starts afresh."""


def prepare_window(model, request: GenerationRequest, previous_state, *, kind: str = "window") -> Prepared:
    """The pipeline's steps 6.1-6.5 for the window after ``previous_state``'s (``None``: the first). ``kind``:
    ``window`` (one stage), ``stage1_window`` (stage 1 of two: ``request`` is at half the size) or ``refine_window``
    (stage 2: the window of stage 1's whole video upsampled, renoised and refined as ``models.ltx_video.stages``'s
    stage 2 refines, conditioned on the refined tail before it)."""
    pipe, device = model.pipe, model.device
    windows = windows_of(request)
    stage = {"window": 0, "stage1_window": 1, "refine_window": 2}[kind]
    upsampled = None
    if stage == 2 and getattr(previous_state, "stage", 0) == 1:
        # Stage 1 is done: its whole video upsampled, once; stage 2's windows start over from the first.
        upsampled = model.upsample_latents(request, previous_state.video.latents).float().cpu()
        before = None
    elif previous_state is not None:
        before, upsampled = previous_state.video, getattr(previous_state, "upsampled", None)
    else:  # an extension's first window follows the video it extends; a long video's, nothing
        before = None if request.extends is None else _extended(model, request)
    w = 0 if before is None else before.window + 1
    start, end = windows.spans[w]
    cfg_on = request.guidance_scale > 1.0
    embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
        prompt=request.prompt, negative_prompt=request.negative_prompt, do_classifier_free_guidance=cfg_on,
        max_sequence_length=request.options["max_sequence_length"] or 128, device=device)
    if cfg_on:
        embeds, mask = torch.cat([neg_embeds, embeds]), torch.cat([neg_mask, mask])
    cfg, s_ratio = model.transformer.config, model.geometry.spatial_compression
    height, width = request.height // s_ratio, request.width // s_ratio
    # The window is built on the device its steps run on (the made video, checkpointed, stays on the CPU).
    window = torch.zeros((1, cfg.in_channels, end - start, height, width), dtype=torch.float32, device=device)
    cond = torch.ones((1, 1, end - start, height, width), dtype=torch.float32, device=device)
    # The pipeline ignores its image at cond_strength 0. A window given its own image (conditions at the frame it
    # starts from) takes it as its negative-index frame, and so do the windows after it until the next one's.
    images = window_images(request, model.options) if request.options["cond_strength"] else {}
    given = max((i for i in images if i <= w), default=None)
    image = None if given is None else _image_latents(model, request, images[given])
    if image is not None and w == 0:
        window[:, :, :1] = image
    tail = 0
    if before is not None and windows.overlap > 0:
        strength = float(request.options["temporal_overlap_cond_strength"])
        k = min(windows.overlap, before.latents.shape[2])
        window, cond, tail = inject_prev_tail_latents(window, before.latents[:, :, -k:].to(device), cond,
                                                      windows.overlap, strength, 0)
    if image is not None:
        # The image as the pipeline's negative-index frame: appended to every window, fully conditioned.
        window, cond, tail = inject_prev_tail_latents(window, image, cond, 1, 1.0, tail)
        if w == 0:  # window 0's image (the request's) also holds the first frame
            cond[:, :, 0] = 1.0 - float(request.options["cond_strength"])
    generator = device_generator(device, int(request.seed) + int(start))
    noise = torch.randn(window.shape, generator=generator, dtype=torch.float32, device=device)
    mixed = noise * cond + (1 - cond) * window
    p, pt = cfg.patch_size, cfg.patch_size_t
    t_ratio = model.geometry.temporal_compression
    coords = build_video_coords_for_window(
        latents=window, overlap_len=windows.overlap if before is not None and windows.overlap > 0 else 0, guiding_len=0,
        negative_len=0 if image is None else 1, rope_interpolation_scale=(t_ratio, s_ratio, s_ratio),
        frame_rate=request.fps)
    scheduler = model.scheduler
    mu = None
    if scheduler.config.get("use_dynamic_shifting", False):
        # NOTE(shift): the pipeline passes no shift, which a dynamic-shifting scheduler (LTX-Video's own config)
        # refuses; it gets LTXPipeline's shift for the window's sequence instead.
        c = scheduler.config
        mu = calculate_shift(mixed[0, 0].numel(), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
    if stage == 2:
        # Stage 2's schedule: the last REFINE_STEPS * DENOISE_STRENGTH of REFINE_STEPS steps, to the end; its free
        # tokens start from the upsampled latents renoised to the first sigma (the conditioned ones as in stage 1).
        scheduler.set_timesteps(num_inference_steps=REFINE_STEPS, device=device, **({} if mu is None else {"mu": mu}))
        first = REFINE_STEPS - refine_pass_steps()
        sigma = scheduler.sigmas[first]  # on the device: read there, not on the host
        part = torch.zeros_like(window)
        part[:, :, :end - start] = upsampled[:, :, start:end].to(device)
        mixed = torch.where(cond == 1.0, sigma * noise + (1 - sigma) * part, mixed)
        timesteps = list(scheduler.timesteps[first:])
    else:
        scheduler.set_timesteps(num_inference_steps=request.num_inference_steps, device=device,
                                **({} if mu is None else {"mu": mu}))
        timesteps = list(scheduler.timesteps[:-1])  # the pipeline runs every timestep but the last
    state = WindowPass(request=request, windows=windows, window=w, embeds=embeds, mask=mask, cfg_on=cfg_on,
                       generator=generator, clean=pipe._pack_latents(window, p, pt),
                       cond=pipe._pack_latents(cond, p, pt), coords=coords, size=tuple(window.shape[2:]), tail=tail,
                       before=before, stage=stage, upsampled=upsampled, cache=model.step_cache(request))
    return Prepared(latents={"video": pipe._pack_latents(mixed, p, pt)}, timesteps=timesteps, state=state)


def _extended(model, request: GenerationRequest) -> Video:
    """The video an extension continues, as the windows see it: its last frames (``GenerationRequest.extends``)
    encoded as ``overlap`` latent frames, the tail the first window is conditioned on and its AdaIN reference."""
    from PIL import Image

    pipe = model.pipe
    clip = [Image.fromarray(frame, mode="RGB") for frame in request.extends.frames]
    pixels = pipe.video_processor.preprocess_video(clip, height=request.height, width=request.width)
    latents = _encode(model, pixels).cpu()
    return Video(latents, latents, window=-1)


def _encode(model, pixels: torch.Tensor) -> torch.Tensor:
    """``[1, 3, F, H, W]`` pixels in [-1, 1] -> normalised latents (the latent distribution's mode, on the model's
    device), as the pipeline encodes its conditioning image."""
    pipe, vae = model.pipe, model.components.vae
    encoded = vae.encode(pixels.to(device=model.device, dtype=vae.dtype))
    latents = (encoded.latent_dist.mode() if hasattr(encoded, "latent_dist") else encoded.latents).float()
    return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def _image_latents(model, request: GenerationRequest, image: Condition) -> torch.Tensor:
    """``[1, C, 1, H, W]`` on the model's device: ``image`` encoded at the request's size as the pipeline encodes
    ``cond_image`` (the latent distribution's mode, normalised), the same on every rank."""
    from PIL import Image

    image = Image.fromarray(image.frames[0], mode="RGB")
    pixels = model.pipe.video_processor.preprocess(image, height=request.height, width=request.width)
    return _encode(model, pixels.unsqueeze(2))


def predict_window(model, latents_local: dict[str, torch.Tensor], t: torch.Tensor, prepared: Prepared,
                   plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
    x: WindowPass = prepared.state
    latents, plan, rank = latents_local["video"], plans["video"], model.state.cp_rank
    batch = 2 if x.cfg_on else 1
    cond = plan.shard(x.cond, rank)  # 1, S, 1 -> 1, S_LOCAL, 1
    share = pass_shares(batch, model.state.guidance_size)[model.state.guidance_rank]
    rows, n = slice(share.start, share.stop), len(share)
    model_in = torch.cat([latents] * n) if n else None  # none: a guidance rank with no pass (no CFG on two)
    # The pre-step blend comes after the model input is taken (the pipeline's order): it changes what is stepped.
    latents.copy_(latents * cond + plan.shard(x.clean, rank) * (1.0 - cond))
    if n:
        timestep = t.expand(n)[:, None, None] * torch.cat([cond] * n)
        s_ratio = model.geometry.spatial_compression
        with model.sharded(plan), cached_call(x.cache, model.transformer.transformer_blocks, "cond_uncond", plan,
                                              rank):
            noise_pred = model.transformer(
                hidden_states=model_in.to(x.embeds.dtype), encoder_hidden_states=x.embeds[rows], timestep=timestep,
                encoder_attention_mask=x.mask[rows], num_frames=1, height=1, width=1,
                rope_interpolation_scale=(model.geometry.temporal_compression, s_ratio, s_ratio),
                video_coords=x.coords, return_dict=False)[0]
    else:  # more guidance ranks than passes: this one runs none, but joins the exchange
        join_call(model.transformer)  # and, with sharded weights, its peers' all-gathers (cp_infer.weights)
        noise_pred = latents.new_empty((0, *latents.shape[1:]), dtype=x.embeds.dtype)
    if x.cache is not None:
        x.cache.end_step()
    noise_pred = gather_passes({"video": noise_pred}, passes=batch, state=model.state)["video"]
    if x.cfg_on:
        uncond, text = noise_pred.chunk(2)
        noise_pred = uncond + x.request.guidance_scale * (text - uncond)
    return {"video": noise_pred}


def step_window(model, noise_pred_local: dict[str, torch.Tensor], t: torch.Tensor,
                latents_local: dict[str, torch.Tensor], prepared: Prepared,
                plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
    x: WindowPass = prepared.state
    latents, plan, rank = latents_local["video"], plans["video"], model.state.cp_rank
    with _shard_noise(model.scheduler, plan, rank, x.clean.shape):
        stepped = model.scheduler.step(noise_pred_local["video"], t, latents, generator=x.generator,
                                       return_dict=False)[0]
    cond = plan.shard(x.cond, rank)
    return {"video": stepped * cond + plan.shard(x.clean, rank) * (1.0 - cond)}


@contextlib.contextmanager
def _shard_noise(scheduler, plan: ShardPlan, rank: int, full_shape: torch.Size) -> Iterator[None]:
    """Inside the block, the scheduler's ``randn_tensor`` draws the noise of the whole sequence ``full_shape`` from the
    generator it is given and returns this rank's shard of it: every rank draws what one rank would."""
    module = sys.modules[type(scheduler).__module__]
    draw = getattr(module, "randn_tensor", None)
    if draw is None:
        yield
        return

    def sharded(shape, generator=None, device=None, dtype=None, layout=None):
        full = torch.randn(tuple(full_shape), generator=generator, dtype=dtype, device=device)
        local = plan.shard(full, rank)
        assert tuple(local.shape) == tuple(shape), (local.shape, shape)
        return local

    module.randn_tensor = sharded
    try:
        yield
    finally:
        module.randn_tensor = draw


def finish_window(model, full: dict[str, torch.Tensor], prepared: Prepared) -> int:
    """Fold the window's gathered latents into the video made so far (the pipeline's 6.7-6.8); returns the latent
    frames of the video that are final."""
    x: WindowPass = prepared.state
    cfg = model.transformer.config
    # NOTE(layout): contiguous [B, C, F, H, W], as the pipeline's latents are (its packed ones are views of them):
    # AdaIN's mean and std then sum in the same order, bit for bit.
    out = model.pipe._unpack_latents(full["video"].float().cpu(), *x.size, cfg.patch_size,
                                     cfg.patch_size_t).contiguous()
    if x.tail > 0:
        out = out[:, :, :-x.tail]
    before = x.before
    if before is None:
        x.video = Video(out, out, x.window)
    else:
        out = out[:, :, 1:]
        factor = x.request.options["adain_factor"]
        factor = 0.25 if factor is None else float(factor)
        if factor > 0:
            out = adain_normalize_latents(out, before.first, factor)
        fused = linear_overlap_fuse(before.latents[:, :, -out.shape[2]:], out, x.windows.blend)
        x.video = Video(torch.cat([before.latents[:, :, :-out.shape[2]], fused], dim=2), before.first, x.window)
    # Stage 1's latents (half the size) are not the video's: nothing to decode before stage 2.
    return None if x.stage == 1 else x.windows.final(x.window)
