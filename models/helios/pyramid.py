"""``HeliosPyramidPipeline``'s stages of one chunk, on the adapter's token layout (``models.helios.adapter``).

Each chunk is denoised coarse to fine: its noise drawn at full size and halved ``stages - 1`` times (bilinear, times
2), then each stage runs its own schedule (``set_timesteps(steps, stage, mu=shift(the stage's tokens))``) and the
next starts from its result doubled in size (nearest), mixed with block noise (``sample_block_noise``, drawn from the
request's generator) by the stage's ``alpha`` and ``beta``. The ops are the pipeline's, on the same whole tensors
(every rank alike), so that at one rank they are the pipeline's bit for bit. Two pieces of a step need the whole chunk:
CFG-Zero*'s scale (a dot product over the whole prediction, computed in the pipeline's layout) and DMD's step (the
stage's start latents, which every rank keeps whole and cuts to its shard).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.pipelines.helios.pipeline_helios import calculate_shift
from diffusers.pipelines.helios.pipeline_helios_pyramid import optimized_scale

__all__ = ["cfg_zero_star", "dmd_step", "downsample", "set_stage_timesteps", "upsample_renoise"]


def downsample(latents: torch.Tensor, times: int) -> torch.Tensor:
    """The chunk's noise ``[B, C, F, H, W]`` halved ``times`` times, as the pipeline halves it before stage 0."""
    b, c, f, h, w = latents.shape
    x = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
    for _ in range(times):
        h, w = h // 2, w // 2
        x = F.interpolate(x, size=(h, w), mode="bilinear") * 2
    return x.reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)


def set_stage_timesteps(scheduler, steps: int, stage: int, tokens: int, *, device, amplify: bool) -> None:
    """The stage's schedule, shifted by its token count (``calculate_shift``), as the pipeline sets it."""
    config = scheduler.config
    mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                         config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    scheduler.set_timesteps(steps, stage, device=device, mu=mu, is_amplify_first_chunk=amplify)


def upsample_renoise(pipe, latents: torch.Tensor, stage: int, *, patch: tuple[int, int, int], generator,
                     device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Stage ``stage``'s start: the previous stage's latents ``[B, C, F, H, W]`` doubled (nearest) and mixed with
    block noise to the stage's start sigma (the pipeline's "fix the stage")."""
    b, c, f, h, w = latents.shape
    x = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
    x = F.interpolate(x, size=(h * 2, w * 2), mode="nearest")
    x = x.reshape(b, f, c, h * 2, w * 2).permute(0, 2, 1, 3, 4)
    scheduler = pipe.scheduler
    ori_sigma = 1 - scheduler.ori_start_sigmas[stage]
    gamma = scheduler.config.gamma
    alpha = 1 / (math.sqrt(1 + (1 / gamma)) * (1 - ori_sigma) + ori_sigma)
    beta = alpha * (1 - ori_sigma) / math.sqrt(gamma)
    noise = pipe.sample_block_noise(b, c, f, h * 2, w * 2, patch, device, generator).to(device=device, dtype=dtype)
    return alpha * x + beta * noise


def cfg_zero_star(cond: torch.Tensor, uncond: torch.Tensor, scale: float, *, zeroed: bool) -> torch.Tensor:
    """CFG-Zero* on whole predictions ``[B, C, F, H, W]`` (the pipeline's layout, so its sums are the pipeline's):
    ``zeroed`` (the first steps of stage 0 with ``use_zero_init``) predicts zero."""
    if zeroed:
        return cond * 0.0
    b = cond.shape[0]
    alpha = optimized_scale(cond.view(b, -1), uncond.view(b, -1))
    alpha = alpha.view(b, *([1] * (cond.ndim - 1))).to(cond.dtype)
    return uncond * alpha + scale * (cond - uncond * alpha)


def dmd_step(scheduler, noise_pred: torch.Tensor, t: torch.Tensor, sample: torch.Tensor, start: torch.Tensor,
             step: int, generator) -> torch.Tensor:
    """``HeliosDMDScheduler.step`` on a shard of tokens ``[B, S, P]`` (element by element: the prediction's x0
    re-noised towards ``start``, the stage's start latents cut to the same shard, at the next timestep)."""
    out = scheduler.step(noise_pred, t, sample, generator=generator, return_dict=False, cur_sampling_step=step,
                         dmd_noisy_tensor=start, dmd_sigmas=scheduler.sigmas, dmd_timesteps=scheduler.timesteps,
                         all_timesteps=scheduler.timesteps)[0]
    # Its sigmas are [B, 1, 1, 1, 1]: on a 3-D sample the result has two more leading dims, the same values.
    return out.reshape(sample.shape)
