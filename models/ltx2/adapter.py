"""LTX-2 (audio and video generated together) on the context-parallel engine.

The model maths is diffusers' (``LTX2VideoTransformer3DModel``, the video and audio VAEs, the vocoder, the text
connectors and ``LTX2Pipeline``'s own prompt encoding, noise, guidance and post-processing). Parallelism is
applied from outside by :func:`parallelize_ltx2_transformer` (``models.ltx2.parallel``):
- the video and the audio token sequences are two streams, each sharded by its own :class:`ShardPlan` (they
  rarely divide the group size, and have nothing to do with each other's length);
- both self-attentions run through :func:`cp_infer.ulysses_attention` on their own plan, and both cross-modal
  attentions (audio-to-video: video queries over audio keys; video-to-audio: the reverse) through its
  cross-sequence form, so every query sees every real key of the other stream and no padded one;
- RoPE of every kind the model uses (the "interleaved" and the "split" layout, and the cross-modal RoPE) is a
  pure function of each token's coordinates, so the transformer is handed this rank's shard of the
  coordinates and computes exactly its tokens' rotations, whatever the layout;
- text cross-attention is untouched (local queries, replicated text keys). Everything else is per token.
Guidance is LTX2Pipeline's (CFG, spatio-temporal guidance, modality isolation, CFG rescale); the one
sequence-wide quantity, the rescale's standard deviation, is reduced over the group from per-shard sums.
Conditioning (``request.image``: LTX2ImageToVideoPipeline; ``request.conditions``: LTX2ConditionPipeline) is
prepared by :mod:`models.ltx2.conditions`; its keyframe tokens, per-token timesteps and masks are part of the video
stream, cut by the stream's plan.
A request's step cache (``cp_infer.step_cache``) keeps one state per context of LTX2Pipeline (``cond_uncond``,
``uncond_stg``, ``uncond_modality``): the video stream's first-block residual decides, and the video and audio tails
are cached together (diffusers' First-Block Cache hook does not take LTX-2's two-stream blocks; the reference is
the unsharded loop).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from diffusers import (
    LTX2ConditionPipeline,
    LTX2ImageToVideoPipeline,
    LTX2LatentUpsamplePipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.loaders import LTX2LoraLoaderMixin
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg, retrieve_timesteps

from cp_infer import LatentShape, ParallelState, ShardPlan, VideoGeometry
from cp_infer.collectives import all_reduce_sum, gather_passes
from cp_infer.decode import DEFAULT_FRAMES_PER_RANK
from cp_infer.mesh import pass_shares
from cp_infer.plan import Plan
from cp_infer.request import GenerationRequest
from cp_infer.sampler import Decoder, Prepared
from cp_infer.step_cache import CacheStats, StepCache
from cp_infer.weights import join_call
from models.common.adapter import decode_round_uint8, decode_split, noise_for_decode, refuse_stochastic_sampling, scoped
from models.common.geometry import min_latent_side
from models.common.loading import is_distilled, recommended_stages
from models.common.lora import LoadedLoras, LoraSpec, apply_loras
from models.common.ltx_vae_parallel import DecodeContext, parallelize_ltx2_decoder
from models.common.step_cache import cached_call, pass_cache, pass_cache_stats

from .conditions import VideoConditioning, prepare_conditions, prepare_image
from .options import ltx2_options
from .parallel import _ShardContext, parallelize_ltx2_transformer
from .plan import _CONTEXTS, LTX2Settings, plan_request
from .stages import REFINE_SIGMAS, pass_sigmas, refine_scheduler
from .windows import WindowState, finish_window, prepare_window, restore_state, window_decoder
from .windows import checkpoint as window_checkpoint

__all__ = ["LORA", "LTX2Model", "LTX2Settings", "fit_duration", "parallelize_ltx2_transformer"]

LORA = LoraSpec(loader=LTX2LoraLoaderMixin,
                parts={"transformer": LTX2VideoTransformer3DModel, "connectors": LTX2TextConnectors})
"""How LTX-2 adapters load: into the transformer and the text connectors, as ``LTX2Pipeline.load_lora_weights``
loads them (Lightricks' ``text_embedding_projection`` keys go to the connectors)."""

@dataclass
class _RequestState:
    """What ``LTX2Model.prepare`` builds for one pass, read by ``predict``, ``step`` and the decode."""

    request: GenerationRequest
    shape: LatentShape
    settings: LTX2Settings
    schedulers: dict[str, Any]
    """One per stream (stateful: their step index), copies of the pipeline's."""
    video_ctx: torch.Tensor
    audio_ctx: torch.Tensor
    ctx_mask: torch.Tensor
    coords: dict[str, torch.Tensor]
    """RoPE coordinates of each stream's whole sequence (the video's with its keyframe tokens)."""
    batch: int
    generator: torch.Generator
    audio_frames: int
    fps: float
    conditioning: VideoConditioning | None = None
    audio_conditioning: VideoConditioning | None = None
    """A long video's window: its first audio tokens conditioned on the soundtrack made so far."""
    step: int = 0
    cache: StepCache | None = None
    """The pass's step cache (``cache="none"``: none)."""


def _sharded_std(x_local: torch.Tensor, valid: int, *, state: ParallelState) -> torch.Tensor:
    """``x.std(dim=(1, 2), keepdim=True)`` of the whole sequence, from this rank's ``[B, S_LOCAL, C]`` shard."""
    x = x_local[:, :valid].double()
    # B, S_LOCAL, C -> B, 3 (count, sum, sum of squares), summed over the group
    # A rank may hold no real token of a short stream (9 audio tokens over 4 ranks): it adds zeros, but joins.
    count = x.new_full((x.shape[0],), float(x.shape[1] * x.shape[2]))
    stats = torch.stack([count, x.sum(dim=(1, 2)), x.square().sum(dim=(1, 2))], dim=1)
    stats = all_reduce_sum(stats, group=state.cp_group)
    n, total, squares = stats.unbind(1)
    var = (squares - total * total / n) / (n - 1)
    return var.clamp_min(0).sqrt().to(x_local.dtype)[:, None, None]


def fit_duration(waveform: np.ndarray, seconds: float, sample_rate: int) -> np.ndarray:
    """``[C, S]`` cut or padded with silence at the end to exactly ``seconds`` (the video's duration).

    The vocoder's output is a little shorter than the video (the causal audio VAE decodes ``4k + 1`` mel frames
    from ``k + 1`` latent frames, e.g. 0.33 s for 9 frames at 24 fps); the soundtrack of an MP4 must end with
    its video, so the tail is padded with silence, never stretched (stretching would shift every sound).
    """
    samples = round(seconds * sample_rate)
    if waveform.shape[1] >= samples:
        return np.ascontiguousarray(waveform[:, :samples])
    return np.pad(waveform, ((0, 0), (0, samples - waveform.shape[1])))


class LTX2Model:
    """An LTX-2 pipeline's components, parallelised, behind the sampler's ``DenoiseModel`` interface."""

    family = "ltx2"

    def __init__(self, components, *, state: ParallelState):
        self.state = state
        self.components = components
        # NOTE(pipeline): the pipeline object is used only for diffusers' own prompt encoding, noise, packing
        # and post-processing, so that a 1-rank run is the reference implementation step for step.
        parts = dict(
            scheduler=components.scheduler, vae=components.vae, audio_vae=components.audio_vae,
            text_encoder=components.text_encoder, tokenizer=components.tokenizer,
            connectors=components.connectors, transformer=components.transformer, vocoder=components.vocoder,
        )
        self.pipe = LTX2Pipeline(**parts)
        # The conditioned pipelines over the same modules: their media preparation is used as it is.
        self.i2v_pipe = LTX2ImageToVideoPipeline(**parts)
        self.cond_pipe = LTX2ConditionPipeline(**parts)
        refuse_stochastic_sampling(components.scheduler)
        cfg = components.transformer.config
        self.geometry = VideoGeometry(
            temporal_compression=self.pipe.vae_temporal_compression_ratio,
            spatial_compression=self.pipe.vae_spatial_compression_ratio,
            patch_size=cfg.patch_size, patch_size_t=cfg.patch_size_t,
            min_latent_side=min_latent_side(components.vae.config),
        )
        self._ctx = _ShardContext(state=state)
        parallelize_ltx2_transformer(components.transformer, self._ctx)
        self._decode_ctx = DecodeContext(state=state.decoding)
        parallelize_ltx2_decoder(components.vae, self._decode_ctx)
        # Two-stage generation's upsampler (None: the folder has none, and ``stages`` is refused above 1).
        upsampler = getattr(components, "latent_upsampler", None)
        self.upsample_pipe = (None if upsampler is None
                              else LTX2LatentUpsamplePipeline(vae=components.vae, latent_upsampler=upsampler))
        path = getattr(components, "path", None)
        stages = None if path is None else recommended_stages(path, upsampler=upsampler is not None)
        self.options = ltx2_options(layers=self.layers, latent_upsampler=upsampler is not None, stages=stages,
                                    distilled=path is not None and is_distilled(
                                        path, checkpoint=getattr(components, "checkpoint", None)))

    placement = None
    """Where the components are (``models.common.placement.Placement``, set by ``models.registry.open_model``)."""

    decode_frames_per_rank: int | str | None = DEFAULT_FRAMES_PER_RANK
    """Latent frames each rank decodes per streamed round; ``"auto"``: by frame size
    (``cp_infer.decode.resolve_frames_per_rank``); ``None``: one round (the whole video at once, as diffusers decodes
    it: bit-identical to LTX2Pipeline, memory growing with the video)."""

    @property
    def transformer(self):
        return self.components.transformer

    lora_spec = LORA
    loras: LoadedLoras | None = None
    """The adapters requests may apply (``models.registry.open_model`` with a ``lora_dir``); ``None``: none."""

    def lora_parts(self) -> dict[str, torch.nn.Module]:
        """The modules adapters load into, by their keys' prefix (``LORA.parts``)."""
        return {"transformer": self.transformer, "connectors": self.components.connectors}

    @property
    def layers(self) -> int:
        return len(self.transformer.transformer_blocks)

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def sample_rate(self) -> int:
        vocoder = self.components.vocoder
        return int(getattr(vocoder.config, "output_sampling_rate", None) or self.pipe.audio_sampling_rate)

    def sharded(self, plans: dict[str, ShardPlan]) -> contextlib.AbstractContextManager[None]:
        """The transformer's forward passes inside this block run on the shards of ``plans``."""
        return scoped(self._ctx, "plans", plans)

    def plan(self, request: GenerationRequest) -> Plan:
        return plan_request(request)

    def _stage_output(self, latents: dict[str, torch.Tensor], state: _RequestState) -> dict[str, torch.Tensor]:
        """``output_type="latent"`` of a pass whose state is ``state``: video ``[B, C, F, H, W]`` (its own tokens)
        and audio ``[B, C, L, M]``, unpacked and denormalised."""
        pipe, vae, audio_vae = self.pipe, self.components.vae, self.pipe.audio_vae
        video = self._video_latents(latents, state)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        audio = pipe._denormalize_audio_latents(latents["audio"], audio_vae.latents_mean, audio_vae.latents_std)
        mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        audio = pipe._unpack_audio_latents(audio, state.audio_frames, num_mel_bins=mel_bins)
        return {"latents": video, "audio_latents": audio}

    def prepare(self, request: GenerationRequest, shape: LatentShape, *, kind: str = "denoise",
                previous: dict[str, torch.Tensor] | None = None, previous_state: Any = None) -> Prepared:
        """LTX2Pipeline's preparation; with ``request.image`` LTX2ImageToVideoPipeline's, with
        ``request.conditions`` LTX2ConditionPipeline's (the media encoded on every rank alike: an image or a short
        clip is one small encode, not worth a time-parallel split). ``kind="refine"``: stage 2 of two, from the
        gathered latents of stage 1 (``models.ltx2.stages``). The pass's adapters are made active first
        (``models.common.lora``): the connectors' part of them shapes the prompt's embeddings."""
        apply_loras(self.loras, request.loras, kind=kind)
        if kind in ("window", "stage1_window", "refine_window"):
            return prepare_window(self, request, previous_state, kind=kind)
        if kind == "refine":
            assert previous is not None and previous_state is not None, "a refine pass follows a pass"
            return self._prepare_refine(request, shape, previous, previous_state)
        assert kind == "denoise" and previous is None, kind
        pipe, device = self.pipe, self.device
        # The declaration (models.ltx2.options) bounds the block indices by this model's block count.
        settings = LTX2Settings.from_request(request)
        video_ctx, audio_ctx, ctx_mask = self._encode_prompt(request, settings)
        # NOTE(noise): drawn on the CPU from the request's seed, video then audio as LTX2Pipeline draws them, so
        # that every rank, and every device type, starts from the same latents.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        cpu = torch.device("cpu")
        fps = float(request.fps)
        channels = self.transformer.config.in_channels
        conditioning: VideoConditioning | None = None
        keyframe_coords = None
        if request.image is not None:
            video, conditioning = prepare_image(self.i2v_pipe, request, channels=channels, dtype=video_ctx.dtype,
                                                device=device, generator=generator)
        elif request.conditions:
            video, conditioning, keyframe_coords = prepare_conditions(
                self.cond_pipe, request, shape, channels=channels, fps=fps, device=device, generator=generator)
        else:
            video = pipe.prepare_latents(1, channels, request.height, request.width, request.num_frames, 0.0,
                                         torch.float32, cpu, generator)
        audio_frames = self.audio_latent_frames(request)
        mel_bins = pipe.audio_vae.config.mel_bins
        # LTX2ConditionPipeline draws the audio noise in the packed layout, the others unpacked (other values).
        audio_pipe = self.cond_pipe if request.conditions else pipe
        audio = audio_pipe.prepare_audio_latents(1, num_channels_latents=pipe.audio_vae.config.latent_channels,
                                                 audio_latent_length=audio_frames, num_mel_bins=mel_bins,
                                                 noise_scale=0.0, dtype=torch.float32, device=cpu,
                                                 generator=generator)
        sigmas = pass_sigmas(request)
        return self.prepared_pass(request, shape, settings, (video_ctx, audio_ctx, ctx_mask), video, audio,
                                  sigmas=sigmas, generator=generator, conditioning=conditioning,
                                  keyframe_coords=keyframe_coords, audio_frames=audio_frames)

    def settings_and_contexts(self, request: GenerationRequest):
        """A pass's guidance settings and prompt contexts (``_encode_prompt``)."""
        settings = LTX2Settings.from_request(request)
        return settings, self._encode_prompt(request, settings)

    def _encode_prompt(self, request: GenerationRequest, settings: LTX2Settings
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """LTX2Pipeline's prompt encoding through the connectors: video and audio contexts and their mask
        (negative prompt first where CFG is on)."""
        pipe = self.pipe
        embeds, mask, neg_embeds, neg_mask = pipe.encode_prompt(
            prompt=request.prompt, negative_prompt=request.negative_prompt,
            do_classifier_free_guidance=settings.cfg,
            max_sequence_length=request.options["max_sequence_length"],
            device=self.device,
        )
        if settings.cfg:
            embeds, mask = torch.cat([neg_embeds, embeds]), torch.cat([neg_mask, mask])
        padding_side = getattr(pipe.tokenizer, "padding_side", "left")
        return pipe.connectors(embeds, mask, padding_side=padding_side)

    def _prepare_refine(self, request: GenerationRequest, shape: LatentShape, previous: dict[str, torch.Tensor],
                        before: _RequestState) -> Prepared:
        """Stage 2 (``models.ltx2.stages``): stage 1's latents as LTX2Pipeline returns them for
        ``output_type="latent"``, upsampled by LTX2LatentUpsamplePipeline, renoised to the first sigma of the
        distilled schedule as LTX2Pipeline(latents=..., audio_latents=..., noise_scale=...) does (I2V: as
        LTX2ImageToVideoPipeline does, the first latent frame kept clean and conditioned), from stage 1's generator."""
        device = self.device
        settings = LTX2Settings.from_request(request)
        contexts = self._encode_prompt(request, settings)
        stage1 = self._stage_output(previous, before)
        # NOTE(upsampler): replicated, on every rank alike (a few 3-D convolutions over the half-size latents, small
        # beside one transformer step); its output is the same on every rank, so the group needs no exchange.
        upsampled = self.upsample_pipe(latents=stage1["latents"], output_type="latent", return_dict=False)[0]
        # Renoised on the device with noise drawn on the CPU from stage 1's generator (diffusers' randn_tensor draws a
        # CPU generator's noise there), as LTX2Pipeline given that generator: the same on every rank.
        upsampled, audio = upsampled.to(torch.float32), stage1["audio_latents"].to(torch.float32)
        noise_scale = REFINE_SIGMAS[0]
        generator = before.generator
        conditioning: VideoConditioning | None = None
        keyframe_coords = None
        if request.conditions:
            # As LTX2ConditionPipeline given the latents: the conditions applied to them again at full size, the
            # rest renoised to the first sigma; the audio drawn in its packed layout, as that pipeline draws it.
            video, conditioning, keyframe_coords = prepare_conditions(
                self.cond_pipe, request, shape, channels=self.transformer.config.in_channels, fps=float(request.fps),
                device=device, generator=generator, latents=upsampled, noise_scale=noise_scale)
            audio = self.cond_pipe.prepare_audio_latents(latents=audio, noise_scale=noise_scale, dtype=torch.float32,
                                                         device=device, generator=generator)
        elif request.image is not None:
            video, mask = self.i2v_pipe.prepare_latents(None, 1, upsampled.shape[1], request.height, request.width,
                                                        request.num_frames, noise_scale, torch.float32, device,
                                                        generator, upsampled)
            conditioning = VideoConditioning(mask=mask, clean=None, video_tokens=video.shape[1])
        else:
            video = self.pipe.prepare_latents(latents=upsampled, noise_scale=noise_scale, dtype=torch.float32,
                                              device=device, generator=generator)
        if not request.conditions:
            audio = self.pipe.prepare_audio_latents(latents=audio, noise_scale=noise_scale, dtype=torch.float32,
                                                    device=device, generator=generator)
        scheduler = refine_scheduler(self.pipe.scheduler)
        return self.prepared_pass(request, shape, settings, contexts, video, audio, scheduler=scheduler,
                                  sigmas=REFINE_SIGMAS, generator=generator, conditioning=conditioning,
                                  keyframe_coords=keyframe_coords, audio_frames=before.audio_frames)

    def prepared_pass(self, request: GenerationRequest, shape: LatentShape, settings: LTX2Settings, contexts,
                      video: torch.Tensor, audio: torch.Tensor, *, sigmas, generator: torch.Generator,
                      audio_frames: int, scheduler=None, conditioning: VideoConditioning | None = None,
                      keyframe_coords: torch.Tensor | None = None,
                      audio_conditioning: VideoConditioning | None = None) -> Prepared:
        """A pass's schedules (LTX2Pipeline's shift for the video's token count; ``scheduler``: the pipeline's
        unless given), RoPE coordinates and state. What its steps read (latents, coordinates, conditioning) is put on
        the model's device here, wherever it was made."""
        device = self.device
        scheduler = scheduler or self.pipe.scheduler
        video_ctx, audio_ctx, ctx_mask = contexts
        fps = float(request.fps)
        cfg = scheduler.config
        mu = calculate_shift(video.shape[1], cfg.get("base_image_seq_len", 1024), cfg.get("max_image_seq_len", 4096),
                             cfg.get("base_shift", 0.95), cfg.get("max_shift", 2.05))
        # Per-request copies: the schedulers are stateful (step index), one per stream as in LTX2Pipeline.
        schedulers = {name: copy.deepcopy(scheduler) for name in ("audio", "video")}
        for name in ("audio", "video"):
            timesteps, _ = retrieve_timesteps(schedulers[name], len(sigmas), device, sigmas=sigmas, mu=mu)
            schedulers[name].set_begin_index(0)
        batch = 2 if settings.cfg else 1
        video_coords = self.transformer.rope.prepare_video_coords(1, shape.frames, shape.height, shape.width, device,
                                                                  fps=fps)
        if keyframe_coords is not None:
            # 1, 3, S_VIDEO, 2 -> 1, 3, S_VIDEO + S_KEYFRAMES, 2: the keyframe tokens follow the video's
            video_coords = torch.cat([video_coords, keyframe_coords.to(video_coords)], dim=2)
        audio_coords = self.transformer.audio_rope.prepare_audio_coords(1, audio_frames, device)
        state = _RequestState(
            request=request, shape=shape, settings=settings, schedulers=schedulers, video_ctx=video_ctx,
            audio_ctx=audio_ctx, ctx_mask=ctx_mask, coords={"video": video_coords, "audio": audio_coords},
            batch=batch, generator=generator, audio_frames=audio_frames, fps=fps,
            conditioning=None if conditioning is None else conditioning.to(device),
            audio_conditioning=None if audio_conditioning is None else audio_conditioning.to(device),
            cache=pass_cache(request, state=self.state, contexts=settings.cache_contexts, layers=self.layers))
        return Prepared(latents={"video": video.to(device), "audio": audio.to(device)}, timesteps=list(timesteps),
                        state=state)

    def audio_latent_frames(self, request: GenerationRequest) -> int:
        """Audio latent frames for the video's duration (LTX2Pipeline's rule)."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(request.num_frames / float(request.fps) * per_second)

    def _forward(self, latents: dict[str, torch.Tensor], t: torch.Tensor, x: _RequestState,
                 plans: dict[str, ShardPlan], *,
                 rows: slice, isolate: bool = False, stg_blocks: tuple[int, ...] | None = None,
                 ) -> dict[str, torch.Tensor]:
        """One transformer pass over this rank's shards, batched over ``rows`` of the prompt contexts (CFG's
        ``[uncond, cond]``, or ``[cond]``)."""
        rank = self.state.cp_rank
        video_ctx, audio_ctx, ctx_mask = x.video_ctx[rows], x.audio_ctx[rows], x.ctx_mask[rows]
        batch = video_ctx.shape[0]
        dtype = video_ctx.dtype
        # B, N_DIMS, S, 2 -> B, N_DIMS, S_LOCAL, 2 (same plan as the stream's latents: token i keeps its position)
        coords = {name: plans[name].shard(c, rank, dim=2).expand(batch, -1, -1, -1)
                  for name, c in x.coords.items()}
        inputs = {name: torch.cat([v] * batch).to(dtype) for name, v in latents.items()}
        timestep = t.expand(batch)
        conditioning: VideoConditioning | None = x.conditioning
        # Conditioned video tokens have their own timesteps ([B, S_LOCAL]); audio and the prompt modulation run at t.
        video_timestep = timestep if conditioning is None else conditioning.timestep(timestep, plans["video"], rank)
        audio_cond: VideoConditioning | None = x.audio_conditioning
        audio_timestep = timestep if audio_cond is None else audio_cond.timestep(timestep, plans["audio"], rank)
        shape: LatentShape = x.shape
        with self.sharded(plans):
            video, audio = self.transformer(
                hidden_states=inputs["video"], audio_hidden_states=inputs["audio"],
                encoder_hidden_states=video_ctx, audio_encoder_hidden_states=audio_ctx, timestep=video_timestep,
                audio_timestep=audio_timestep, sigma=timestep, encoder_attention_mask=ctx_mask,
                audio_encoder_attention_mask=ctx_mask,
                num_frames=shape.frames, height=shape.height, width=shape.width, fps=x.fps,
                audio_num_frames=x.audio_frames, video_coords=coords["video"], audio_coords=coords["audio"],
                isolate_modalities=isolate, spatio_temporal_guidance_blocks=list(stg_blocks) if stg_blocks else None,
                perturbation_mask=None, use_cross_timestep=True, return_dict=False,
            )
        return {"video": video.float(), "audio": audio.float()}

    def predict(self, latents_local: dict[str, torch.Tensor], t: torch.Tensor, prepared: Prepared,
                plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        x = _pass_state(prepared.state)
        s: LTX2Settings = x.settings
        i, schedulers = x.step, x.schedulers
        scales = {"video": (s.guidance_scale, s.stg_scale, s.modality_scale, s.guidance_rescale),
                  "audio": (s.audio_guidance_scale, s.audio_stg_scale, s.audio_modality_scale,
                            s.audio_guidance_rescale)}

        def to_x0(name: str, velocity: torch.Tensor) -> torch.Tensor:
            return self.pipe.convert_velocity_to_x0(latents_local[name], velocity, i, schedulers[name])

        preds = self._passes(latents_local, t, x, plans)
        guided: dict[str, torch.Tensor] = {}
        cond: dict[str, torch.Tensor] = {}
        for name, pred in preds.items():
            cond[name] = to_x0(name, pred["cond"])
            if s.cfg:
                guided[name] = cond[name] + (scales[name][0] - 1) * (cond[name] - to_x0(name, pred["uncond"]))
            else:
                guided[name] = cond[name]
            # The extra passes of LTX2Pipeline, on the conditional half only, each adding its own delta.
            if s.stg:
                guided[name] = guided[name] + scales[name][1] * (cond[name] - to_x0(name, pred["stg"]))
            if s.modality:
                guided[name] = guided[name] + (scales[name][2] - 1) * (cond[name] - to_x0(name, pred["modality"]))
        result = {}
        conditioning: VideoConditioning | None = x.conditioning
        for name in preds:
            rescale = scales[name][3]
            g = guided[name]
            if rescale > 0:
                g = self._rescale(g, cond[name], rescale, plans[name])
            stream_conditioning = conditioning if name == "video" else x.audio_conditioning
            if stream_conditioning is not None:
                g = stream_conditioning.blend_denoised(g, plans[name], self.state.cp_rank)
            result[name] = self.pipe.convert_x0_to_velocity(latents_local[name], g, i, schedulers[name])
        return result

    def _passes(self, latents_local: dict[str, torch.Tensor], t: torch.Tensor, x: _RequestState,
                plans: dict[str, ShardPlan]) -> dict[str, dict[str, torch.Tensor]]:
        """Every pass of the step, ``stream -> pass kind -> [1, S_LOCAL, C]``: this rank runs its share
        (``cp_infer.mesh.pass_shares`` over the guidance group; CFG's two in one batch where both are in it, as
        LTX2Pipeline runs them), then one exchange over the guidance group gives every rank all of them."""
        s: LTX2Settings = x.settings
        kinds = s.kinds
        cond_row = int(s.cfg)  # the conditional prompt's row of the contexts
        share = pass_shares(len(kinds), self.state.guidance_size)[self.state.guidance_rank]
        mine = [kinds[k] for k in share]
        outputs: list[dict[str, torch.Tensor]] = []
        prompt = [k for k in mine if k in ("uncond", "cond")]
        blocks, rank = self.transformer.transformer_blocks, self.state.cp_rank

        def cached(context: str) -> contextlib.AbstractContextManager[None]:
            return cached_call(x.cache, blocks, context, plans["video"], rank)

        def calls(passes: range) -> int:  # a share's transformer calls: CFG's pair in one, STG and modality one each
            kinds_of = {kinds[k] for k in passes}
            return int(bool(kinds_of & {"uncond", "cond"})) + ("stg" in kinds_of) + ("modality" in kinds_of)

        if prompt:
            first = 0 if prompt[0] == "uncond" else cond_row
            with cached("cond_uncond"):
                outputs.append(self._forward(latents_local, t, x, plans, rows=slice(first, first + len(prompt))))
        if "stg" in mine:
            with cached(_CONTEXTS["stg"]):
                outputs.append(self._forward(latents_local, t, x, plans, rows=slice(cond_row, cond_row + 1),
                                             stg_blocks=s.stg_blocks))
        if "modality" in mine:
            with cached(_CONTEXTS["modality"]):
                outputs.append(self._forward(latents_local, t, x, plans, rows=slice(cond_row, cond_row + 1),
                                             isolate=True))
        # NOTE(lockstep): with sharded weights every rank of the replica group runs each call's all-gathers; a
        # guidance rank that makes fewer transformer calls this step than another joins the missing ones.
        for _ in range(max(map(calls, pass_shares(len(kinds), self.state.guidance_size))) - len(outputs)):
            join_call(self.transformer)
        if x.cache is not None:
            x.cache.end_step()
        # N_LOCAL, S_LOCAL, C per stream (this rank's passes in order); none: an empty share that joins the exchange
        local = {name: torch.cat([o[name] for o in outputs]) if outputs
                 else latents_local[name].new_empty((0, *latents_local[name].shape[1:]), dtype=torch.float32)
                 for name in ("video", "audio")}
        every = gather_passes(local, passes=len(kinds), state=self.state)
        # PASSES, S_LOCAL, C -> kind: 1, S_LOCAL, C
        return {name: {kind: every[name][k:k + 1] for k, kind in enumerate(kinds)} for name in every}

    def _rescale(self, guided: torch.Tensor, cond: torch.Tensor, rescale: float, plan: ShardPlan) -> torch.Tensor:
        if plan.world == 1:
            return rescale_noise_cfg(guided, cond, guidance_rescale=rescale)
        valid = plan.valid_len(self.state.cp_rank)
        std_cond = _sharded_std(cond, valid, state=self.state)
        std_guided = _sharded_std(guided, valid, state=self.state)
        return rescale * (guided * (std_cond / std_guided)) + (1 - rescale) * guided

    def cache_stats(self, prepared: Prepared) -> CacheStats | None:
        """What the step just ended saved (``cp_infer.step_cache.StepCache.step_stats``)."""
        return pass_cache_stats(_pass_state(prepared.state).cache)

    def step(self, noise_pred_local: dict[str, torch.Tensor], t: torch.Tensor,
             latents_local: dict[str, torch.Tensor], prepared: Prepared,
             plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        x = _pass_state(prepared.state)
        x.step += 1
        stepped = {name: x.schedulers[name].step(noise_pred_local[name], t, latents_local[name],
                                                    return_dict=False)[0]
                   for name in ("video", "audio")}
        conditioning: VideoConditioning | None = x.conditioning
        if conditioning is not None:
            stepped["video"] = conditioning.keep_conditioned(stepped["video"], latents_local["video"], plans["video"],
                                                             self.state.cp_rank)
        return stepped

    def finish_pass(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> int | None:
        """A window's video and audio folded into those made so far (``models.ltx2.windows``): the latent frames now
        final (``None``: a stage-1 window, or not a window)."""
        if isinstance(prepared.state, WindowState):
            return finish_window(self, latents, prepared)
        return None

    def checkpoint(self, state) -> dict[str, np.ndarray] | None:
        """A long video's windows made so far; ``None`` for any other pass."""
        return window_checkpoint(state) if isinstance(state, WindowState) else None

    def upsample_made(self, video: torch.Tensor) -> torch.Tensor:
        """Stage 1's whole video ``[1, C, F, H, W]`` (normalised, as the stream holds it) upsampled 2x by
        LTX2LatentUpsamplePipeline, normalised again (the refine windows' stream latents)."""
        pipe, vae = self.pipe, self.components.vae
        denormalised = pipe._denormalize_latents(video.to(self.device), vae.latents_mean, vae.latents_std,
                                                 vae.config.scaling_factor)
        # NOTE(upsampler): replicated, as for one-sequence two stages (LTX2Model._prepare_refine).
        upsampled = self.upsample_pipe(latents=denormalised, output_type="latent", return_dict=False)[0]
        return pipe._normalize_latents(upsampled.float().cpu(), vae.latents_mean.cpu(), vae.latents_std.cpu(),
                                       vae.config.scaling_factor)

    def restore(self, request: GenerationRequest, arrays: dict[str, np.ndarray]):
        return restore_state(request, arrays)

    def video_latents(self, latents: dict[str, torch.Tensor], x: _RequestState) -> torch.Tensor:
        return self._video_latents(latents, x)

    def _made(self, latents: dict[str, torch.Tensor], state) -> tuple[dict[str, torch.Tensor], _RequestState]:
        """The latents and the state to decode: a long video's made so far, as one pass over all its frames would
        hold them; or the pass's own."""
        if not isinstance(state, WindowState):
            return latents, state
        made, pipe = state.made, self.pipe
        shape = LatentShape(frames=made.video.shape[2], height=made.video.shape[3], width=made.video.shape[4])
        video = pipe._pack_latents(made.video, pipe.transformer_spatial_patch_size,
                                   pipe.transformer_temporal_patch_size)
        device = self.device
        return {"video": video.to(device), "audio": made.audio.to(device)}, replace(
            state.state, request=state.request, shape=shape, conditioning=None, audio_conditioning=None,
            audio_frames=made.audio.shape[1])

    def _video_latents(self, latents: dict[str, torch.Tensor], x: _RequestState) -> torch.Tensor:
        """The video's own tokens unpacked to ``[B, C, F, H, W]`` (keyframe tokens dropped)."""
        pipe = self.pipe
        shape: LatentShape = x.shape
        conditioning: VideoConditioning | None = x.conditioning
        video = latents["video"] if conditioning is None else latents["video"][:, :conditioning.video_tokens]
        return pipe._unpack_latents(video, shape.frames, shape.height, shape.width,
                                    pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)

    def output_latents(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> dict[str, np.ndarray]:
        """``output_type="latent"`` of LTX2Pipeline and of its conditioned pipelines alike: video ``[B, C, F, H, W]``
        (its own tokens) and audio ``[B, C, L, M]``, unpacked and denormalised."""
        latents, state = self._made(latents, prepared.state)
        return {name: x.float().cpu().numpy() for name, x in self._stage_output(latents, state).items()}

    def decoder(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> Decoder:
        """Video: unpack, (timestep-conditioned VAEs) noise, denormalise, decode this rank's range. Audio: the
        audio VAE's mel spectrogram through the vocoder, on group rank 0."""
        pipe, vae = self.pipe, self.components.vae
        if isinstance(prepared.state, WindowState):  # a long video's windows, fed to the decode as they are made
            return window_decoder(self, prepared.state)
        latents, x = self._made(latents, prepared.state)
        request: GenerationRequest = x.request
        video = self._video_latents(latents, x).to(x.video_ctx.dtype)
        video, timestep = noise_for_decode(video, vae=vae, generator=x.generator, request=request)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = video.to(vae.dtype)
        # Time-parallel and streamed in rounds, exact (``cp_infer.decode``), as for LTX-Video.
        split = decode_split(vae, video.shape[2], world=self.state.decoding.cp_size,
                             temporal_compression=self.geometry.temporal_compression,
                             frames_per_rank=self.decode_frames_per_rank, request=request)

        def decode_range(a: int, b: int) -> np.ndarray:
            return decode_round_uint8(pipe, vae, self._decode_ctx, video, a, b, timestep, seed=request.seed,
                                      split_scope=scoped(self._decode_ctx, "split", split))

        return Decoder(split=split, frame_shape=(request.height, request.width, 3), decode_range=decode_range,
                       audio=lambda: self.soundtrack(latents["audio"], x.audio_frames, request))

    def soundtrack(self, audio: torch.Tensor, audio_frames: int, request: GenerationRequest) -> tuple[np.ndarray, int]:
        """The whole soundtrack of the packed audio latents ``audio`` (``audio_frames`` of them) as LTX2Pipeline
        decodes it (audio VAE, vocoder), fitted to the video's duration: ``[C, S]`` and the sample rate."""
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        mel_bins = audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
        packed = pipe._denormalize_audio_latents(audio, audio_vae.latents_mean, audio_vae.latents_std)
        unpacked = pipe._unpack_audio_latents(packed, audio_frames, num_mel_bins=mel_bins)
        mel = audio_vae.decode(unpacked.to(audio_vae.dtype), return_dict=False)[0]
        waveform = self.components.vocoder(mel)[0].float().cpu().numpy()
        return fit_duration(waveform, request.num_frames / request.fps, self.sample_rate), self.sample_rate


def _pass_state(state) -> _RequestState:
    """The ``_RequestState`` of a pass (a window's is inside its ``WindowState``)."""
    return state.state if isinstance(state, WindowState) else state

