"""Long LTX-2 (video and soundtrack) window by window: the windows of ``models.common.windows`` (those of
``LTXI2VLongMultiPromptPipeline``), each one sequence-parallel ``LTX2Pipeline`` pass of both streams, conditioned on
the tails of both made so far.

diffusers has no long-video LTX-2 pipeline; this is the LTX-Video one's scheme on LTX-2's own conditioning
(``LTX2ConditionPipeline``'s per-token mask: timesteps ``t * (1 - mask)``, the clean latents blended into every
step's denoised sample):
- Video: the window's first ``overlap`` latent frames are the previous window's last ones, conditioned at
  ``temporal_overlap_cond_strength``; the window's first latent frame (a single-frame latent to the causal VAE) is
  dropped and the next ``overlap - 1`` are crossfaded into the video made so far, as the LTX-Video pipeline fuses.
- Audio: each window has the soundtrack of its own frames, starting at its first frame's time; the audio latents it
  shares with the soundtrack made so far are conditioned on it the same way and crossfaded into it, so the
  soundtrack runs on across the seam.
- Each window draws its noise from ``seed + start``, so N ranks equal 1 rank and a resumed job equals an
  uninterrupted one; the made video and soundtrack (:class:`Made`) are the only state a window hands the next.
- After each window (of a one-stage video, or of stage 2) every latent frame of both streams but those the next
  window will crossfade is final: the video's decode (:func:`window_decoder`, into a whole-video buffer, as
  ``models.ltx_video.adapter``'s) delivers the frames they allow, and the soundtrack's (``models.ltx2.audio``) the
  samples
  they allow, so a long LTX-2 video streams with its sound while later windows are made. A caller that takes the
  soundtrack whole (``SampleControl.on_audio``) gets it after the last window, as decoding it at once does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from diffusers.pipelines.ltx.pipeline_ltx_i2v_long_multi_prompt import linear_overlap_fuse

from cp_infer.request import GenerationRequest
from cp_infer.sampler import Decoder, Prepared
from models.common.adapter import DecodeNoise, decode_round_uint8, decode_split, scoped
from models.common.ltx_vae_parallel import decode_reads
from models.common.windows import Windows, windows_of

from .audio import progressive_soundtrack
from .conditions import VideoConditioning
from .stages import REFINE_SIGMAS, pass_sigmas, refine_scheduler

__all__ = ["Made", "WindowState", "checkpoint", "finish_window", "prepare_window", "restore_state",
           "window_decoder"]


@dataclass
class Made:
    """The video latents ``[1, C, F, H, W]`` and the packed audio latents ``[1, L, D]`` made so far (normalised, as
    the model's streams hold them)."""

    video: torch.Tensor
    audio: torch.Tensor
    window: int

    def checkpoint(self) -> dict[str, np.ndarray]:
        return {"video": self.video.numpy(), "audio": self.audio.numpy(), "window": np.array(self.window)}


@dataclass
class WindowState:
    """One window's pass: the pass's own ``_RequestState`` (``state``) and what the fusion needs."""

    state: object
    request: GenerationRequest
    """The whole video's request (``state`` holds the window's own)."""
    windows: Windows
    window: int
    before: Made | None
    audio_start: int
    """The window's first audio latent frame in the whole soundtrack."""
    stage: int = 0
    """0: a one-stage window; 1: stage 1 of two (half the size); 2: stage 2 (full size, refining)."""
    base: Made | None = None
    """Stage 2: stage 1's whole video upsampled and its soundtrack, which its windows refine."""
    made: Made | None = None


@dataclass
class Restored:
    request: GenerationRequest
    windows: Windows
    made: Made
    stage: int = 0
    base: Made | None = None


def checkpoint(state: WindowState) -> dict[str, np.ndarray]:
    arrays = dict(state.made.checkpoint(), stage=np.array(state.stage, dtype=np.int64))
    if state.base is not None:
        arrays.update(base_video=state.base.video.numpy(), base_audio=state.base.audio.numpy())
    return arrays


def _frames(latent_frames: int, t: int) -> int:
    return (latent_frames - 1) * t + 1


def audio_start(model, request: GenerationRequest, start: int) -> int:
    """The audio latent frame where a window starting at latent frame ``start`` begins. A window's frame ``f >= 1`` is
    the video's frame ``f + start * t`` (its first latent frame, a single frame to the causal VAE, stands for the
    video's latent frame ``start``), so its soundtrack starts ``start * t`` frames into the video's, and the last
    window's ends with the video."""
    t = model.geometry.temporal_compression
    return model.audio_latent_frames(replace(request, num_frames=start * t)) if start else 0


def prepare_window(model, request: GenerationRequest, previous_state, *, kind: str = "window") -> Prepared:
    """The window after ``previous_state``'s (``None``: the first) as an LTX2Pipeline pass of its own frames, its
    first latents of both streams conditioned on the tails made so far. ``kind``: ``window``, ``stage1_window``
    (stage 1 of two: ``request`` is at half the size) or ``refine_window`` (stage 2: the window of stage 1's video
    upsampled and of its soundtrack, renoised to the first distilled sigma and refined without guidance, as
    ``models.ltx2.stages``'s stage 2)."""
    pipe, cpu = model.pipe, torch.device("cpu")
    windows = windows_of(request)
    stage = {"window": 0, "stage1_window": 1, "refine_window": 2}[kind]
    base = getattr(previous_state, "base", None)
    if stage == 2 and getattr(previous_state, "stage", 0) == 1:
        # Stage 1 is done: its whole video upsampled once (and its soundtrack); stage 2's windows start over.
        stage1 = previous_state.made
        base, before = Made(model.upsample_made(stage1.video), stage1.audio, -1), None
    else:
        before = None if previous_state is None else previous_state.made
    w = 0 if before is None else before.window + 1
    start, end = windows.spans[w]
    t = model.geometry.temporal_compression
    wreq = replace(request, num_frames=_frames(end - start, t))
    shape = model.geometry.latent_shape(wreq.num_frames, request.height, request.width)
    settings, contexts = model.settings_and_contexts(wreq)
    generator = torch.Generator("cpu").manual_seed(int(request.seed) + int(start))
    channels = model.transformer.config.in_channels
    video = pipe.prepare_latents(1, channels, request.height, request.width, wreq.num_frames, 0.0, torch.float32,
                                 cpu, generator)
    audio_frames = model.audio_latent_frames(wreq)
    audio = pipe.prepare_audio_latents(1, num_channels_latents=pipe.audio_vae.config.latent_channels,
                                       audio_latent_length=audio_frames, num_mel_bins=pipe.audio_vae.config.mel_bins,
                                       noise_scale=0.0, dtype=torch.float32, device=cpu, generator=generator)
    a0 = audio_start(model, request, start)
    scheduler = None
    if stage == 2:
        # The window's part of the upsampled video and of stage 1's soundtrack, renoised to the first sigma with the
        # noise just drawn (LTX2Pipeline's _create_noised_state).
        sigma = float(REFINE_SIGMAS[0])
        part = pipe._pack_latents(base.video[:, :, start:end], pipe.transformer_spatial_patch_size,
                                  pipe.transformer_temporal_patch_size)
        video = sigma * video + (1 - sigma) * part
        audio = sigma * audio + (1 - sigma) * base.audio[:, a0:a0 + audio.shape[1]]
        scheduler = refine_scheduler(pipe.scheduler)
    video_cond = audio_cond = None
    if before is not None:
        strength = float(request.options["temporal_overlap_cond_strength"])
        tail = pipe._pack_latents(before.video[:, :, -windows.overlap:], pipe.transformer_spatial_patch_size,
                                  pipe.transformer_temporal_patch_size)
        video, video_cond = _conditioned(video, tail, strength)
        shared = max(0, min(before.audio.shape[1] - a0, audio.shape[1]))
        if shared:
            audio, audio_cond = _conditioned(audio, before.audio[:, a0:a0 + shared], strength)
    sigmas = REFINE_SIGMAS if stage == 2 else pass_sigmas(request)
    prepared = model.prepared_pass(wreq, shape, settings, contexts, video, audio, sigmas=sigmas, generator=generator,
                                   scheduler=scheduler, conditioning=video_cond, audio_conditioning=audio_cond,
                                   audio_frames=audio_frames)
    prepared.state = WindowState(state=prepared.state, request=request, windows=windows, window=w, before=before,
                                 audio_start=a0, stage=stage, base=base)
    return prepared


def _conditioned(noise: torch.Tensor, tail: torch.Tensor, strength: float
                 ) -> tuple[torch.Tensor, VideoConditioning]:
    """A stream's ``[1, S, C]`` noise with its first ``tail`` tokens conditioned on ``tail`` at ``strength`` (mask,
    clean latents, and those tokens started at ``strength`` of the way from the noise to the tail)."""
    k = tail.shape[1]
    mask = torch.zeros(noise.shape[:2], dtype=torch.float32)
    mask[:, :k] = strength
    clean = torch.zeros_like(noise)
    clean[:, :k] = tail
    latents = noise * (1 - mask.unsqueeze(-1)) + clean * mask.unsqueeze(-1)
    return latents, VideoConditioning(mask=mask, clean=clean, video_tokens=noise.shape[1])


def _crossfade(before: torch.Tensor, new: torch.Tensor, overlap: int, dim: int) -> torch.Tensor:
    """``new`` after ``before``, their last / first ``overlap`` frames along ``dim`` crossfaded linearly."""
    if overlap <= 0:
        return torch.cat([before, new], dim=dim)
    alpha = torch.linspace(1, 0, overlap + 2, dtype=before.dtype)[1:-1]
    shape = [1] * before.ndim
    shape[dim] = overlap
    alpha = alpha.reshape(shape)
    blended = alpha * before.narrow(dim, before.shape[dim] - overlap, overlap) + (1 - alpha) * new.narrow(
        dim, 0, overlap)
    return torch.cat([before.narrow(dim, 0, before.shape[dim] - overlap), blended,
                      new.narrow(dim, overlap, new.shape[dim] - overlap)], dim=dim)


def finish_window(model, full: dict[str, torch.Tensor], prepared: Prepared) -> int | None:
    """Fold the window's gathered video and audio into those made so far. Returns the video's latent frames now final
    (``None`` in stage 1 of two, whose video is not the one decoded)."""
    x: WindowState = prepared.state
    inner = x.state
    video = model.video_latents(full, inner).float().cpu().contiguous()
    audio = full["audio"].float().cpu()
    before = x.before
    final = None if x.stage == 1 else x.windows.final(x.window)
    if before is None:
        x.made = Made(video, audio, x.window)
        return final
    new = video[:, :, 1:]
    fused = linear_overlap_fuse(before.video[:, :, -new.shape[2]:], new, x.windows.blend)
    video = torch.cat([before.video[:, :, :-new.shape[2]], fused], dim=2)
    shared = max(0, min(before.audio.shape[1] - x.audio_start, audio.shape[1]))
    audio = _crossfade(before.audio[:, :x.audio_start + shared], audio, shared, dim=1)
    x.made = Made(video, audio, x.window)
    return final


def window_decoder(model, x: WindowState) -> Decoder:
    """The decode of a long video made window by window (the first window's ``x``; later ones come by ``feed``): its
    video latents are written into a whole-video buffer as they become final (noised for a timestep-conditioned VAE
    with noise drawn for the whole video from the request's seed, then denormalised, as one pass's are), a piece
    decoded once the latents it reads are there; the soundtrack decoded whole (``audio``) or as the windows make it
    final (``audio_piece``)."""
    pipe, vae, request, windows = model.pipe, model.components.vae, x.request, x.windows
    dtype = x.state.video_ctx.dtype
    shape = (*x.made.video.shape[:2], windows.latent_frames, *x.made.video.shape[3:])
    buffer = torch.zeros(shape, dtype=vae.dtype, device=model.device)
    noise = DecodeNoise(shape, vae=vae, generator=torch.Generator("cpu").manual_seed(request.seed), request=request,
                        dtype=dtype)
    fed: dict = {"video": 0, "state": x}

    def feed(state: WindowState, final: int) -> None:
        a = fed["video"]
        part = noise.apply(state.made.video[:, :, a:final].to(model.device).to(dtype), a)
        part = pipe._denormalize_latents(part, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        buffer[:, :, a:final] = part.to(vae.dtype)
        fed.update(video=max(a, final), state=state)

    split = decode_split(vae, windows.latent_frames, world=model.state.decoding.cp_size,
                         temporal_compression=model.geometry.temporal_compression,
                         frames_per_rank=model.decode_frames_per_rank, request=request)

    def decode_range(a: int, b: int) -> np.ndarray:
        return decode_round_uint8(pipe, vae, model._decode_ctx, buffer, a, b, noise.timestep, seed=request.seed,
                                  split_scope=scoped(model._decode_ctx, "split", split))

    def audio() -> tuple[np.ndarray, int]:
        made = fed["state"].made
        return model.soundtrack(made.audio.to(model.device), made.audio.shape[1], request)

    rate = model.sample_rate
    soundtrack = progressive_soundtrack(pipe, model.components.vocoder,
                                        total_samples=round(request.num_frames / request.fps * rate))

    def audio_piece() -> tuple[np.ndarray, int]:
        made = fed["state"].made
        last = fed["video"] >= windows.latent_frames
        # The next window conditions on and crossfades the audio from its own start on; what is before it is final.
        final = made.audio.shape[1] if last else audio_start(model, request, windows.spans[made.window + 1][0])
        return soundtrack.advance(made.audio.to(model.device), final, last=last), rate

    return Decoder(split=split, frame_shape=(request.height, request.width, 3), decode_range=decode_range,
                   reads=lambda a, b: decode_reads(vae, split, a, b), feed=feed, audio=audio,
                   audio_piece=None if soundtrack is None else audio_piece, length_free=noise.length_free)


def restore_state(request: GenerationRequest, arrays: dict[str, np.ndarray]) -> tuple[Restored, None]:
    windows = windows_of(request)

    def tensor(name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(arrays[name], dtype=np.float32))

    try:
        made = Made(tensor("video"), tensor("audio"), int(arrays["window"]))
        stage = int(arrays.get("stage", 0))
        base = Made(tensor("base_video"), tensor("base_audio"), -1) if "base_video" in arrays else None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a checkpoint of a long video: {exc}") from None
    last = len(windows) - 1 if windows is not None else -1
    if windows is None or not 0 <= made.window <= last or (made.window == last and stage != 1) \
            or made.video.shape[2] != windows.made(made.window) or (stage == 2) != (base is not None):
        raise ValueError("the checkpoint is not one of this request's windows")
    return Restored(request, windows, made, stage, base), None
