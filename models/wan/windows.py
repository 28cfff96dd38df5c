"""Long Wan videos window by window: each window one sequence-parallel ``WanPipeline`` pass of the plan
(``models.wan.options.wan_windows_of`` cuts the windows, ``models.common.windows.window_plan`` gives each its prompt),
every window after the first starting on the last ``k = temporal_overlap // 4`` latent frames of the video made so
far, which it holds to exactly those latents.

diffusers has no long Wan pipeline. ``SkyReelsV2DiffusionForcingPipeline`` makes long video of the Wan architecture,
but with its own ``SkyReelsV2Transformer3DModel`` trained for diffusion forcing (a noise level per latent frame), which
a Wan checkpoint is not; so the windows here are conditioned on the tail, as LTX-Video's, with each model's own
means of holding frames fixed:

- Wan 2.2 TI2V-5B (``expand_timesteps``: a timestep per token) holds its image-to-video first frame through the
  timesteps: ``WanImageToVideoPipeline`` feeds the transformer ``(1 - mask) * condition + mask * latents`` with the
  masked tokens at timestep 0 and returns the same blend. A window here is that recipe with the mask 0 on its first
  ``k`` latent frames and the condition the tail: the exact generalisation of the model's own conditioning, which it
  was trained for (clean tokens at timestep 0 beside noisy ones).
- Wan 2.1 T2V and 2.2 A14B T2V (one timestep for every token) cannot be told that some tokens are clean. Their
  window's first ``k`` latent frames are replaced, before the first step and after every step, by the tail noised to
  the sigma of the sample just made, with the noise the window drew for them: ``(1 - sigma) * tail + sigma * noise``,
  the flow-matching path from that noise to the tail (the sample the model expects at that sigma), ending on the
  tail itself at sigma 0. The model sees a tail consistent with its noise level at every step and continues it.
- Image-to-video folders (Wan 2.1 I2V, 2.2 A14B I2V) chain their windows on one frame
  (``models.wan.options.CHAINED``): window ``w > 0`` is ``WanImageToVideoPipeline`` with the last video frame of
  window ``w - 1`` (decoded and rounded to uint8, as a caller would save it) as its image. Their condition channels
  and CLIP image tokens were trained on exactly that, a first frame encoded alone, not on a window's worth of
  mid-video latents (which the tail replacement above would hold them to); chaining on the last frame is also what
  their users do by hand. A window given its own image (the request's ``conditions`` at the frame it starts from,
  ``models.wan.options``' ``window_images``; a live video's direction with an image) starts from that image instead:
  a cut. The window's first latent frame is that image again (or its own image), so the stitched latents keep the
  window's other frames after the one before's (the window's own first latent frame kept aside, :attr:`Made.firsts`,
  for its decode), and the frames are each window decoded alone, the repeated frame dropped.

Invariants:
- Window 0 is the plain pass of its frames (``WanPipeline``, or TI2V-5B's ``WanImageToVideoPipeline`` with an image):
  its noise from the request's seed. Window ``w > 0`` draws its noise as the pipeline does, from ``seed + start``
  (its first latent frame), so N ranks equal 1 rank and a resumed job equals an uninterrupted one.
- Every window (but a chained one) ends with its first ``k`` latent frames equal to the tail it started on, bit for
  bit, so the video is stitched by appending each window's frames after those (as
  ``SkyReelsV2DiffusionForcingPipeline`` appends its windows' latents after their prefix; no crossfade: there is
  nothing to blend) and every latent frame made is final at once; the next window never changes it.
- The per-token operations (the blend, the replacement) are elementwise on tokens, applied to each rank's shard of
  the same whole-window tensors, so N ranks equal 1 rank.
- The video made so far (:class:`Made`) is the only state a window hands the next: saved after each window
  (``checkpoint``) so that a restarted job goes on from the last finished one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from cp_infer import ShardPlan
from cp_infer.request import Condition, GenerationRequest, window_images
from cp_infer.sampler import Prepared
from models.common.windows import Windows

from .options import WAN_TEMPORAL_COMPRESSION, wan_windows_of
from .parallel import pack_patches, unpack_patches

__all__ = ["Made", "TailReplacement", "WindowPass", "chained", "checkpoint", "finish_window", "prepare_window",
           "replace_tail", "restore_state", "windowed"]


@dataclass
class Made:
    """The latents ``[1, C, F, H, W]`` made so far (float32, CPU; as the pipeline returns them) and the last window
    folded in."""

    latents: torch.Tensor
    window: int
    firsts: torch.Tensor | None = None
    """Chained windows: the own first latent frames ``[1, C, w, H, W]`` of windows ``1..w`` (each its image's), which
    the stitched latents leave out; ``None`` for the others."""
    last_frame: np.ndarray | None = None
    """Chained windows: the last video frame of the last window, uint8 ``[H, W, 3]``: the next window's image."""
    decoded: np.ndarray | None = None
    """Chained windows: the last window's frames decoded for ``last_frame`` (the repeated first one dropped), until
    the decoder takes them (``WanModel``'s chained decoder); never checkpointed."""

    def own_latents(self, windows: Windows, w: int) -> torch.Tensor:
        """Chained window ``w``'s own latents ``[1, C, end - start, H, W]``, as its pass made them."""
        start, end = windows.spans[w]
        if w == 0:
            return self.latents[:, :, start:end]
        return torch.cat([self.firsts[:, :, w - 1:w], self.latents[:, :, start + 1:end]], dim=2)


@dataclass
class WindowPass:
    """A window's bookkeeping (``_RequestState.windowed``), or a checkpoint restored (the next window's
    ``previous_state``)."""

    request: GenerationRequest
    """The whole video's request (its prompt the window's)."""
    windows: Windows
    window: int
    before: Made | None
    """The video made before this window; ``None`` for the first."""
    made: Made | None = None
    """The video made with this window (:func:`finish_window`)."""


@dataclass
class TailReplacement:
    """One-timestep models: the tokens of a window's first ``k`` latent frames, replaced after every step by the tail
    noised to the scheduler's sigma (:func:`replace_tail`)."""

    is_tail: torch.Tensor
    """``[1, S, 1]``: 1 on the tail's tokens (the first ``k`` latent frames'), 0 elsewhere."""
    tail: torch.Tensor
    """``[1, S, C*P]``: the tail's latents on its tokens (zero elsewhere)."""
    noise: torch.Tensor
    """``[1, S, C*P]``: the window's own noise."""


def windowed(state: Any) -> WindowPass | None:
    """The window bookkeeping of a pass's state (a window's ``_RequestState``, or a restored checkpoint)."""
    return state if isinstance(state, WindowPass) else getattr(state, "windowed", None)


def _noised(tail: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The flow-matching sample at ``sigma`` between ``noise`` (sigma 1) and ``tail`` (sigma 0)."""
    return (1 - sigma) * tail + sigma * noise


def prepare_window(model, request: GenerationRequest, previous_state: Any) -> Prepared:
    """The window after ``previous_state``'s (``None``: the first) as the plain pass of its own frames, its first
    ``k`` latent frames conditioned on the tail of the video made so far (see the module docstring)."""
    windows = wan_windows_of(request)
    assert windows is not None, "a window pass of a request that fits one window"
    before_pass = windowed(previous_state)
    before = None if before_pass is None else before_pass.made
    w = 0 if before is None else before.window + 1
    start, end = windows.spans[w]
    t = WAN_TEMPORAL_COMPRESSION
    frames = (end - start - 1) * t + 1
    # Window 0 is the request's own pass of its frames; later ones take their noise from seed + start, and no image
    # (chained: their own image, or the last frame of the one before).
    own = replace(request, num_frames=frames)
    if w > 0:
        own = replace(own, seed=int(request.seed) + int(start), image=None)
    if chained(model):
        image = window_images(request, model.options).get(w)
        if image is None and w > 0:
            image = Condition(before.last_frame[None])
        own = replace(own, image=image, conditions=())
    shape = model.geometry.latent_shape(frames, request.height, request.width)
    prepared = model.prepare(own, shape)
    x = prepared.state
    x.windowed = WindowPass(request=request, windows=windows, window=w, before=before)
    if before is None or chained(model):
        return prepared
    k, patch = windows.overlap, model.patch
    assert patch[0] == 1, patch  # a latent frame's tokens are whole: the first k frames are the first tokens
    grid = (shape.frames, shape.height, shape.width)
    noise = unpack_patches(prepared.latents["video"], grid, patch)  # 1, S, C*P -> 1, C, F, H, W
    tail = before.latents[:, :, -k:].to(noise.device)
    if model.layout.expand_timesteps:
        # WanImageToVideoPipeline's first-frame conditioning with the tail as its first k latent frames.
        mask = torch.ones((1, 1, *noise.shape[2:]), dtype=torch.float32, device=noise.device)
        mask[:, :, :k] = 0
        condition = torch.zeros_like(noise)
        condition[:, :, :k] = tail
        x.first_frame = (mask, condition)
        x.condition = pack_patches((1 - mask) * condition, patch)
        x.keep = pack_patches(mask.expand_as(noise), patch)
        x.token_mask = mask[0][0][:, ::2, ::2].flatten()
        return prepared
    is_tail = torch.zeros((1, 1, *noise.shape[2:]), dtype=torch.float32, device=noise.device)
    is_tail[:, :, :k] = 1
    padded = torch.zeros_like(noise)
    padded[:, :, :k] = tail
    x.tail = TailReplacement(is_tail=pack_patches(is_tail, patch)[..., :1], tail=pack_patches(padded, patch),
                             noise=prepared.latents["video"])
    latents = noise.clone()
    latents[:, :, :k] = _noised(tail, noise[:, :, :k], x.scheduler.sigmas[0])
    prepared.latents["video"] = pack_patches(latents, patch)
    return prepared


def replace_tail(stepped: torch.Tensor, x, plan: ShardPlan, rank: int) -> torch.Tensor:
    """This rank's stepped tokens with the tail's replaced by the tail noised to the sigma of the sample just made
    (the scheduler's, after its step: 0 after the last)."""
    tail: TailReplacement = x.tail
    sigma = x.scheduler.sigmas[x.scheduler.step_index]
    device = stepped.device
    on_tail = plan.shard(tail.is_tail, rank).to(device) > 0.5  # 1, S, 1 -> 1, S_LOCAL, 1
    noised = _noised(plan.shard(tail.tail, rank).to(device), plan.shard(tail.noise, rank).to(device), sigma)
    return torch.where(on_tail, noised.to(stepped.dtype), stepped)


def finish_window(model, full: dict[str, torch.Tensor], prepared: Prepared) -> int:
    """Append the window's frames after its tail to the video made so far; returns the latent frames now final (all
    of them: the next window keeps its tail as it is)."""
    x = prepared.state
    wp: WindowPass = x.windowed
    own = model._video_latents(full, x).float().cpu().contiguous()
    video = own
    if wp.before is not None:
        video = torch.cat([wp.before.latents, own[:, :, wp.windows.overlap:]], dim=2)
    assert video.shape[2] == wp.windows.made(wp.window), (video.shape, wp.windows.spans, wp.window)
    wp.made = Made(video, wp.window)
    if chained(model):
        if wp.before is not None:
            firsts = own[:, :, :1] if wp.before.firsts is None else torch.cat([wp.before.firsts, own[:, :, :1]], 2)
            wp.made.firsts = firsts
        # The next window's image; the last window's too (a live video may go on from it), which the decoder then
        # takes as it takes the others' instead of decoding the window itself.
        frames = model.decode_whole(own)
        wp.made.last_frame = frames[-1]
        wp.made.decoded = frames if wp.before is None else frames[1:]
    return video.shape[2]


def chained(model) -> bool:
    """Whether ``model``'s windows chain on one frame (an image-to-video folder; see the module docstring)."""
    return model.layout.image


def checkpoint(wp: WindowPass) -> dict[str, np.ndarray]:
    made = wp.made
    arrays = {"latents": made.latents.numpy(), "window": np.array(made.window, dtype=np.int64)}
    if made.firsts is not None:
        arrays["firsts"] = made.firsts.numpy()
    if made.last_frame is not None:
        arrays["last_frame"] = made.last_frame
    return arrays


def restore_state(request: GenerationRequest, arrays: dict[str, np.ndarray], *,
                  chained_windows: bool) -> tuple[WindowPass, int]:
    """A checkpoint (:func:`checkpoint`) of ``request`` back, checked against it (``chained_windows``: the model's
    :func:`chained`); and its final latent frames."""
    windows = wan_windows_of(request)
    try:
        made = Made(torch.from_numpy(np.array(arrays["latents"], dtype=np.float32)), int(arrays["window"]))
        if "firsts" in arrays:
            made.firsts = torch.from_numpy(np.array(arrays["firsts"], dtype=np.float32))
        if "last_frame" in arrays:
            made.last_frame = np.array(arrays["last_frame"], dtype=np.uint8)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a checkpoint of a long video: {exc}") from None
    if windows is None or not 0 <= made.window < len(windows) - 1 or made.latents.ndim != 5 \
            or made.latents.shape[2] != windows.made(made.window):
        raise ValueError("the checkpoint is not one of this request's windows")
    if chained_windows and (made.last_frame is None or made.last_frame.ndim != 3 or (made.window > 0 and (
            made.firsts is None or made.firsts.shape[:2] != made.latents.shape[:2]
            or made.firsts.shape[2] != made.window))):
        raise ValueError("the checkpoint is not one of this request's windows (chained: its last frame and the "
                         "windows' first latent frames)")
    return WindowPass(request=request, windows=windows, window=made.window, before=None, made=made), \
        made.latents.shape[2]
