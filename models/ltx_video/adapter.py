"""LTX-Video on the context-parallel engine.

The model maths is diffusers' (``LTXVideoTransformer3DModel``, ``AutoencoderKLLTXVideo``, the scheduler and
``LTXPipeline``'s own prompt encoding, latent packing and post-processing). Parallelism is applied from
outside by :func:`parallelize_ltx_transformer` (``models.ltx_video.parallel``):
- every self-attention (``attn1``) gets a processor that runs the projections, QK-norm and RoPE on the local
  shard and the attention itself through :func:`cp_infer.ulysses_attention`, handing it q, k and v one at a
  time (each is projected when the exchange packs it, so they are never all alive next to the send buffer);
- the RoPE module is handed the coordinates of this rank's tokens (same :class:`ShardPlan` as the latents) and
  computes (cos, sin) for those tokens only, once for the whole batch, never over the whole grid; on one rank
  it runs unchanged;
- cross-attention (``attn2``) needs no communication: its queries are local and the text keys are replicated. Its
  keys and values depend on the prompt alone, so they are projected once per request and block, not at every step
  (:class:`_TextKVProcessor`, diffusers' processor with the same ops in the same order: bit for bit; the caption
  projection they are made from is kept too). Everything else in
  a block is per token;
- the block list iterates through the request's step cache (``cp_infer.step_cache``: First-Block Cache or TaylorSeer
  over the one ``cond_uncond`` context of LTXPipeline's batched CFG pass, its decision agreed over the Ulysses group
  and, CFG's two passes on two guidance ranks, the mesh); with no cache every block runs, as diffusers'.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from diffusers import (
    LTXConditionPipeline,
    LTXImageToVideoPipeline,
    LTXLatentUpsamplePipeline,
    LTXPipeline,
    LTXVideoTransformer3DModel,
)
from diffusers.loaders import LTXVideoLoraLoaderMixin
from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps
from diffusers.pipelines.ltx.pipeline_ltx_condition import linear_quadratic_schedule
from PIL import Image

from cp_infer import LatentShape, ParallelState, ShardPlan, VideoGeometry, gather_passes, pass_shares
from cp_infer.decode import DEFAULT_FRAMES_PER_RANK, TemporalSplit, video_index
from cp_infer.plan import Plan
from cp_infer.request import Condition, GenerationRequest, resolve_frame_index
from cp_infer.sampler import Decoder, Prepared
from cp_infer.step_cache import CacheContext, CacheStats, StepCache
from cp_infer.weights import join_call
from models.common.adapter import (
    DecodeNoise,
    decode_round_uint8,
    decode_split,
    device_generator,
    noise_for_decode,
    refuse_stochastic_sampling,
    scoped,
)
from models.common.loading import recommended_stages
from models.common.lora import LoadedLoras, LoraSpec, apply_loras
from models.common.ltx_vae_parallel import DecodeContext, decode_reads, parallelize_ltx_decoder
from models.common.step_cache import cached_call, pass_cache, pass_cache_stats
from models.common.windows import two_stage_window_plan, window_plan, windows_of

from .options import ltx_video_options
from .parallel import _ShardContext, parallelize_ltx_transformer
from .stages import DENOISE_STRENGTH, refine_pass_steps, stage_conditions, two_stage_plan
from .windows import (
    WindowPass,
    finish_window,
    predict_window,
    prepare_window,
    restore_state,
    step_window,
)
from .windows import checkpoint as window_checkpoint

__all__ = ["LORA", "LTXVideoModel", "parallelize_ltx_transformer"]

LORA = LoraSpec(loader=LTXVideoLoraLoaderMixin, parts={"transformer": LTXVideoTransformer3DModel})
"""How LTX-Video adapters load: into the transformer, as ``LTXPipeline.load_lora_weights`` loads them."""


@dataclass
class _RequestState:
    """What ``LTXVideoModel.prepare`` builds for one pass, read by its ``predict``, ``step`` and ``decoder``."""

    request: GenerationRequest
    shape: LatentShape
    mode: str
    """``text`` (LTXPipeline), ``image`` (LTXImageToVideoPipeline) or ``conditions`` (LTXConditionPipeline, also
    both stages of two: ``models.ltx_video.stages``)."""
    embeds: torch.Tensor
    mask: torch.Tensor
    cfg_on: bool
    guidance: float
    generator: torch.Generator
    """Drawn from after the initial noise: the conditions' per-step re-noise where it is ``renoise`` (on the CPU), then
    the decode noise."""
    rope_scale: tuple[float, float, float]
    extra_tokens: int = 0
    """Conditioning tokens placed before the video's (conditions after frame 0)."""
    cond_mask: torch.Tensor | None = None
    """``[1, S]``: how strongly each token is conditioned (image and conditions modes; zeros where LTXConditionPipeline
    runs with nothing to condition on)."""
    init_latents: torch.Tensor | None = None
    video_coords: torch.Tensor | None = None
    noise_scale: float = 0.0
    renoise: torch.Generator | None = None
    """Conditions mode: the per-step re-noise's generator, on the device the noise is used on (on the CPU,
    ``generator`` itself, as LTXConditionPipeline draws it; elsewhere one there seeded with the request's seed: no
    host draw and copy of the whole sequence at every step)."""
    cache: StepCache | None = None
    """The pass's step cache (``cache="none"``: none)."""
    # Set by ``predict`` for the ``step`` that follows it (this rank's shard).
    timestep_local: torch.Tensor | None = None
    cond_mask_local: torch.Tensor | None = None


def plan_request(request: GenerationRequest) -> Plan:
    """One pass (text-to-video, image-to-video or conditions: their tokens in the pass's sequence), or with
    ``stages=2`` the two-stage plan (``models.ltx_video.stages``)."""
    windows = windows_of(request)
    if windows is not None:
        # LTXI2VLongMultiPromptPipeline runs every timestep of the schedule but the last.
        steps = request.num_inference_steps - 1
        if request.options.get("stages", 1) == 2:
            return two_stage_window_plan(request, windows, steps=steps, refine_steps=refine_pass_steps())
        return window_plan(request, windows, steps=steps)
    if request.options.get("stages", 1) == 2:
        return two_stage_plan(request)
    return Plan.single(request)


def step_passes(request: GenerationRequest) -> int:
    """The transformer passes a step of one of ``request``'s denoising passes runs: CFG's unconditional and
    conditional, or the conditional alone."""
    return 2 if request.guidance_scale > 1.0 else 1


class LTXVideoModel:
    """An LTX-Video pipeline's components, parallelised, behind the sampler's ``DenoiseModel`` interface."""

    family = "ltx-video"

    def __init__(self, components, *, state: ParallelState):
        self.state = state
        self.components = components
        # NOTE(pipeline): the pipeline object is used only for diffusers' own prompt encoding, noise, packing
        # and post-processing, so that a 1-rank run is the reference implementation step for step.
        parts = dict(scheduler=components.scheduler, vae=components.vae, text_encoder=components.text_encoder,
                     tokenizer=components.tokenizer, transformer=components.transformer)
        self.pipe = LTXPipeline(**parts)
        # The conditioned pipelines over the same modules: their latent preparation (media encode, noise, masks,
        # conditioning-token coordinates) is used as it is.
        self.i2v_pipe = LTXImageToVideoPipeline(**parts)
        self.cond_pipe = LTXConditionPipeline(**parts)
        refuse_stochastic_sampling(self.scheduler)
        cfg = components.transformer.config
        self.geometry = VideoGeometry(
            temporal_compression=self.pipe.vae_temporal_compression_ratio,
            spatial_compression=self.pipe.vae_spatial_compression_ratio,
            patch_size=cfg.patch_size, patch_size_t=cfg.patch_size_t,
        )
        self._ctx = _ShardContext(state=state)
        parallelize_ltx_transformer(components.transformer, self._ctx)
        self._decode_ctx = DecodeContext(state=state.decoding)
        parallelize_ltx_decoder(components.vae, self._decode_ctx)
        # Two-stage generation's upsampler (None: the folder has none, and ``stages`` is refused above 1).
        upsampler = getattr(components, "latent_upsampler", None)
        self.upsample_pipe = (None if upsampler is None
                              else LTXLatentUpsamplePipeline(vae=components.vae, latent_upsampler=upsampler))
        path = getattr(components, "path", None)
        stages = None if path is None else recommended_stages(path, upsampler=upsampler is not None)
        self.options = ltx_video_options(latent_upsampler=upsampler is not None, stages=stages)

    @property
    def transformer(self):
        return self.components.transformer

    def enable_vae_tiling(self) -> None:
        """diffusers' spatial tiles for frames above 512 px, as ``pipe.vae.enable_tiling()`` (``--vae-tiling``): they
        bound the VAE's memory at large frames. The encode of media is tiled too, as the pipelines' is with tiling
        on: the video is then the pipelines' with tiling on (by default, untiled, it is their default's)."""
        self.components.vae.enable_tiling()

    lora_spec = LORA
    loras: LoadedLoras | None = None
    """The adapters requests may apply (``models.registry.open_model`` with a ``lora_dir``); ``None``: none."""

    def lora_parts(self) -> dict[str, torch.nn.Module]:
        """The modules adapters load into, by their keys' prefix (``LORA.parts``)."""
        return {"transformer": self.transformer}

    placement = None
    """Where the components are (``models.common.placement.Placement``, set by ``models.registry.open_model``)."""

    decode_frames_per_rank: int | str | None = DEFAULT_FRAMES_PER_RANK
    """Latent frames each rank decodes per streamed round; ``"auto"``: by frame size
    (``cp_infer.decode.resolve_frames_per_rank``); ``None``: one round (the whole video at once, as diffusers decodes
    it: bit-identical to LTXPipeline, memory growing with the video)."""

    @property
    def layers(self) -> int:
        return len(self.transformer.transformer_blocks)

    @property
    def scheduler(self):
        return self.components.scheduler

    @property
    def device(self) -> torch.device:
        return self.state.device

    def sharded(self, plan: ShardPlan) -> contextlib.AbstractContextManager[None]:
        """The transformer's forward passes inside this block run on the shard of ``plan``."""
        return scoped(self._ctx, "plan", plan)

    def plan(self, request: GenerationRequest) -> Plan:
        return plan_request(request)

    def prepare(self, request: GenerationRequest, shape: LatentShape, *, kind: str = "denoise",
                previous: dict[str, torch.Tensor] | None = None, previous_state: Any = None) -> Prepared:
        """LTXPipeline's preparation; with ``request.image`` LTXImageToVideoPipeline's, with ``request.conditions``
        LTXConditionPipeline's (the media encoded on every rank alike: an image or a short clip is one small encode,
        not worth a time-parallel split). ``kind="stage1"`` and ``"refine"``: the stages of two, both
        LTXConditionPipeline's, stage 2 from the gathered latents of stage 1 (``models.ltx_video.stages``). The pass's
        adapters are made active first (``models.common.lora``), so its prompt's kept projections are theirs too."""
        apply_loras(self.loras, request.loras, kind=kind)
        if kind in ("window", "stage1_window", "refine_window"):
            return prepare_window(self, request, previous_state, kind=kind)
        pipe, device = self.pipe, self.device
        staged = kind in ("stage1", "refine")
        assert staged or kind == "denoise", kind
        assert (previous is not None and previous_state is not None) == (kind == "refine"), kind
        conditions = stage_conditions(request) if staged else request.conditions
        follows_condition = staged or bool(conditions)
        cfg_on = request.guidance_scale > 1.0
        # The pipelines' own defaults: LTXPipeline and LTXImageToVideoPipeline 128, LTXConditionPipeline 256.
        text_tokens = request.options["max_sequence_length"] or (256 if follows_condition else 128)
        # Each pipeline's own prompt encoding (LTXConditionPipeline's passes the attention mask to T5).
        encoder = self.cond_pipe if follows_condition else pipe
        embeds, mask, neg_embeds, neg_mask = encoder.encode_prompt(
            prompt=request.prompt, negative_prompt=request.negative_prompt, do_classifier_free_guidance=cfg_on,
            max_sequence_length=text_tokens, device=device,
        )
        if cfg_on:
            embeds, mask = torch.cat([neg_embeds, embeds]), torch.cat([neg_mask, mask])
        # NOTE(noise): drawn on the CPU from the request's seed so that every rank, and every device
        # type, starts from the same latents.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        t_ratio = self.geometry.temporal_compression
        s_ratio = self.geometry.spatial_compression
        x = _RequestState(request=request, shape=shape, mode="text", embeds=embeds, mask=mask, cfg_on=cfg_on,
                          guidance=request.guidance_scale, generator=generator,
                          rope_scale=(t_ratio / request.fps, s_ratio, s_ratio), cache=self.step_cache(request))
        if follows_condition:
            upsampled = None if kind != "refine" else self._upsampled(request, previous, previous_state)
            return self._prepare_conditions(request, shape, x, conditions, upsampled=upsampled)
        channels = self.transformer.config.in_channels
        if request.image is not None:
            image = _pil(request.image.frames[0])
            image = self.i2v_pipe.video_processor.preprocess(image, height=request.height, width=request.width)
            latents, cond_mask = self.i2v_pipe.prepare_latents(
                image.to(device=device, dtype=embeds.dtype), 1, channels, request.height, request.width,
                request.num_frames, torch.float32, device, generator)
            x.mode, x.cond_mask = "image", cond_mask
        else:
            latents = pipe.prepare_latents(1, channels, request.height, request.width, request.num_frames,
                                           torch.float32, torch.device("cpu"), generator).to(device)
        sigmas = np.linspace(1.0, 1 / request.num_inference_steps, request.num_inference_steps)
        timesteps, _ = retrieve_timesteps(self.scheduler, request.num_inference_steps, device, sigmas=sigmas,
                                          mu=self._shift(shape))
        return Prepared(latents={"video": latents}, timesteps=list(timesteps), state=x)

    def step_cache(self, request: GenerationRequest) -> StepCache | None:
        """A pass's step cache: LTXPipeline's one context, ``cond_uncond`` (CFG's ``[uncond, cond]`` batch, or the
        conditional pass alone)."""
        passes = tuple(range(step_passes(request)))
        return pass_cache(request, state=self.state, contexts=(CacheContext("cond_uncond", passes),),
                          layers=self.layers)

    def cache_stats(self, prepared: Prepared) -> CacheStats | None:
        """What the step just ended saved (``cp_infer.step_cache.StepCache.step_stats``)."""
        return pass_cache_stats(prepared.state.cache)

    def _shift(self, shape: LatentShape) -> float:
        cfg = self.scheduler.config
        return calculate_shift(shape.tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                               cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))

    def _upsampled(self, request: GenerationRequest, previous: dict[str, torch.Tensor],
                   before: _RequestState) -> torch.Tensor:
        """Stage 1's latents as LTXConditionPipeline returns them for ``output_type="latent"``, upsampled by
        LTXLatentUpsamplePipeline(latents=..., output_type="latent") with the request's AdaIN and tone mapping."""
        return self.upsample_latents(request, self._video_latents(previous, before))

    def _prepare_conditions(self, request: GenerationRequest, shape: LatentShape, x: _RequestState,
                            conditions: tuple[Condition, ...], *, upsampled: torch.Tensor | None = None) -> Prepared:
        """LTXConditionPipeline: the media encoded as conditioning latents (at frame 0 they replace the first latent
        frames; later, their first two latent frames become extra tokens placed before the video's, with their own
        coordinates), a linear-quadratic schedule and per-token timesteps. ``upsampled``: the pipeline given
        ``latents`` and ``denoise_strength`` (stage 2 of two): the schedule's tail, the latents renoised to its
        first sigma."""
        pipe, device = self.cond_pipe, self.device
        vae_dtype = self.components.vae.dtype
        tensors, strengths, indices = [], [], []
        for cond in conditions:
            index = resolve_frame_index(cond.frame_index, request.num_frames)
            tensors.append(_condition_tensor(pipe, cond, index, request).to(device, dtype=vae_dtype))
            strengths.append(float(cond.strength))
            indices.append(index)
        steps = request.num_inference_steps
        timesteps = linear_quadratic_schedule(steps) * 1000
        # NOTE(shift): LTXConditionPipeline passes no shift; a scheduler with dynamic shifting (LTX-Video 0.9.0/0.9.1's
        # config) then refuses its schedule, so it gets LTXPipeline's resolution-dependent shift instead.
        mu = self._shift(shape) if self.scheduler.config.get("use_dynamic_shifting", False) else None
        timesteps, _ = retrieve_timesteps(self.scheduler, steps, device, timesteps, mu=mu)
        sigma = None
        if upsampled is not None:
            sigmas, timesteps, _ = pipe.get_timesteps(self.scheduler.sigmas, timesteps, steps, DENOISE_STRENGTH)
            sigma = sigmas[:1]
        latents, cond_mask, coords, extra = pipe.prepare_latents(
            tensors, strengths, indices, batch_size=1, num_channels_latents=self.transformer.config.in_channels,
            height=request.height, width=request.width, num_frames=request.num_frames, sigma=sigma,
            latents=upsampled, generator=x.generator, device=device, dtype=torch.float32)
        coords = coords.float()
        coords[:, 0] = coords[:, 0] * (1.0 / request.fps)
        noise_scale = float(request.options["image_cond_noise_scale"])
        if cond_mask is None:
            # Nothing conditions the video (two stages of a text request): every token is denoised, none re-noised,
            # as LTXConditionPipeline's text-only path does.
            cond_mask, noise_scale = latents.new_zeros(latents.shape[:2]), 0.0
        x.mode, x.cond_mask, x.init_latents, x.extra_tokens = "conditions", cond_mask, latents.clone(), extra
        x.video_coords, x.noise_scale = torch.cat([coords] * 2) if x.cfg_on else coords, noise_scale
        x.renoise = x.generator if device.type == "cpu" else device_generator(device, request.seed)
        return Prepared(latents={"video": latents}, timesteps=list(timesteps), state=x)

    def predict(self, latents_local: dict[str, torch.Tensor], t: torch.Tensor, prepared: Prepared,
                plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        if isinstance(prepared.state, WindowPass):
            return predict_window(self, latents_local, t, prepared, plans)
        x: _RequestState = prepared.state
        latents_local, plan = latents_local["video"], plans["video"]
        mode, batch = x.mode, 2 if x.cfg_on else 1
        rank = self.state.cp_rank
        cond_mask = None if mode == "text" else plan.shard(x.cond_mask, rank)  # 1, S -> 1, S_LOCAL
        if mode == "conditions" and x.noise_scale > 0:
            # LTXConditionPipeline re-noises the fully conditioned tokens at every step; the noise of the whole
            # sequence is drawn on every rank from the same generator, each keeping its shard.
            noise = torch.randn(x.init_latents.shape, generator=x.renoise, dtype=torch.float32,
                                device=latents_local.device)
            noise = plan.shard(noise, rank)
            init = plan.shard(x.init_latents, rank)
            noised = init + x.noise_scale * noise * ((t / 1000.0) ** 2)
            latents_local.copy_(torch.where((cond_mask > 1.0 - 1e-6).unsqueeze(-1), noised, latents_local))
        # The passes of the step are the rows of the CFG batch, [uncond, cond]; this rank runs its share of them
        # (all of them on one guidance rank, as LTXPipeline's batch of 2) and the guidance group exchanges them.
        share = pass_shares(batch, self.state.guidance_size)[self.state.guidance_rank]
        rows = slice(share.start, share.stop)
        n = len(share)
        timestep = t.expand(max(n, 1))
        kwargs = {}
        if mode == "conditions":
            timestep = torch.min(timestep.unsqueeze(-1).float(), (1 - torch.cat([cond_mask] * len(timestep))) * 1000.0)
            kwargs.update(video_coords=x.video_coords[rows])
        else:
            if mode == "image":
                timestep = timestep.unsqueeze(-1) * (1 - torch.cat([cond_mask] * len(timestep)))
            kwargs.update(num_frames=x.shape.frames, height=x.shape.height, width=x.shape.width,
                          rope_interpolation_scale=x.rope_scale)
        if n:
            model_in = torch.cat([latents_local] * n).to(x.embeds.dtype)
            with self.sharded(plan), cached_call(x.cache, self.transformer.transformer_blocks, "cond_uncond", plan,
                                                 rank):
                noise_pred = self.transformer(
                    hidden_states=model_in, encoder_hidden_states=x.embeds[rows], timestep=timestep[:n],
                    encoder_attention_mask=x.mask[rows], return_dict=False, **kwargs,
                )[0]
        else:  # more guidance ranks than passes: this one runs none, but joins the exchange
            join_call(self.transformer)  # and, with sharded weights, its peers' all-gathers (cp_infer.weights)
            noise_pred = latents_local.new_empty((0, *latents_local.shape[1:]), dtype=x.embeds.dtype)
        if x.cache is not None:
            x.cache.end_step()
        if mode != "conditions":
            noise_pred = noise_pred.float()  # LTXConditionPipeline keeps the transformer's dtype
        noise_pred = gather_passes({"video": noise_pred}, passes=batch, state=self.state)["video"]
        if x.cfg_on:
            uncond, cond = noise_pred.chunk(2)
            noise_pred = uncond + x.guidance * (cond - uncond)
        x.timestep_local, x.cond_mask_local = timestep[:1], cond_mask
        return {"video": noise_pred}

    def step(self, noise_pred_local: dict[str, torch.Tensor], t: torch.Tensor,
             latents_local: dict[str, torch.Tensor], prepared: Prepared,
             plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        if isinstance(prepared.state, WindowPass):
            return step_window(self, noise_pred_local, t, latents_local, prepared, plans)
        x: _RequestState = prepared.state
        noise_pred, latents, mode = noise_pred_local["video"], latents_local["video"], x.mode
        if mode == "conditions":
            # Per-token timesteps (this rank's shard of them); tokens still above their conditioning level stay.
            denoised = self.scheduler.step(-noise_pred, t, latents, per_token_timesteps=x.timestep_local,
                                           return_dict=False)[0]
            keep = (t / 1000 - 1e-6 < (1.0 - x.cond_mask_local)).unsqueeze(-1)
            return {"video": torch.where(keep, denoised, latents)}
        stepped = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        if mode == "image":
            # The first frame's tokens are never stepped (the step is elementwise: stepping all and keeping those
            # is LTXImageToVideoPipeline's stepping of the others alone).
            return {"video": torch.where(x.cond_mask_local.unsqueeze(-1) > 0.5, latents, stepped)}
        return {"video": stepped}

    def finish_pass(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> int | None:
        """A window's latents folded into the video made so far (``models.ltx_video.windows``): the latent frames
        now final; ``None`` for other passes."""
        if isinstance(prepared.state, WindowPass):
            return finish_window(self, latents, prepared)
        return None

    def _video_latents(self, latents: dict[str, torch.Tensor], x: _RequestState) -> torch.Tensor:
        """The video's own tokens unpacked to ``[B, C, F, H, W]`` (conditioning tokens dropped)."""
        if isinstance(x, WindowPass):
            return x.video.latents
        shape, cfg = x.shape, self.transformer.config
        return self.pipe._unpack_latents(latents["video"][:, x.extra_tokens:], shape.frames,
                                         shape.height, shape.width, cfg.patch_size, cfg.patch_size_t)

    def output_latents(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> dict[str, np.ndarray]:
        """``output_type="latent"``: LTXPipeline and LTXImageToVideoPipeline return the packed ``[B, S, C]``
        latents, LTXConditionPipeline the unpacked ``[B, C, F, H, W]`` ones."""
        if isinstance(prepared.state, WindowPass) or prepared.state.mode == "conditions":
            return {"latents": self._video_latents(latents, prepared.state).float().cpu().numpy()}
        return {"latents": latents["video"].float().cpu().numpy()}

    def decoder(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> Decoder:
        """Unpack, denormalise and (timestep-conditioned VAEs) noise the latents once; decode this rank's piece of
        each round (``cp_infer.decode``: rounds of ``decode_frames_per_rank`` latent frames per rank)."""
        pipe, vae = self.pipe, self.components.vae
        x = prepared.state
        if not isinstance(x, _RequestState):  # a long video's windows, fed to the decode as they are made
            return self._window_decoder(x)
        request = x.request
        latents = self._video_latents(latents, x)
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        latents = latents.to(x.embeds.dtype)
        latents, timestep = noise_for_decode(latents, vae=vae, generator=x.generator, request=request)
        latents = latents.to(vae.dtype)
        split = decode_split(vae, latents.shape[2], world=self.state.decoding.cp_size,
                             temporal_compression=self.geometry.temporal_compression,
                             frames_per_rank=self.decode_frames_per_rank, request=request)

        def decode_range(a: int, b: int) -> np.ndarray:
            return decode_round_uint8(pipe, vae, self._decode_ctx, latents, a, b, timestep, seed=request.seed,
                                      split_scope=self.decode_split(split))

        return Decoder(split=split, frame_shape=(request.height, request.width, 3), decode_range=decode_range)

    def _window_decoder(self, x) -> Decoder:
        """The decode of a long video: its latents are written into a whole-video buffer (denormalised, noised with
        noise drawn for the whole video from the request's seed) as the windows make them final; a piece is decoded
        once the latents it reads are there (``Decoder.reads``)."""
        pipe, vae, request = self.pipe, self.components.vae, x.request
        total = x.windows.latent_frames
        shape = (*x.video.latents.shape[:2], total, *x.video.latents.shape[3:])
        buffer = torch.zeros(shape, dtype=vae.dtype, device=self.device)
        noise = DecodeNoise(shape, vae=vae, generator=torch.Generator("cpu").manual_seed(request.seed),
                            request=request, dtype=self.transformer.dtype)
        filled = [0]

        def feed(state, final: int) -> None:
            a = filled[0]
            part = state.video.latents[:, :, a:final].to(self.device)
            part = pipe._denormalize_latents(part, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            buffer[:, :, a:final] = noise.apply(part.to(self.transformer.dtype), a).to(vae.dtype)
            filled[0] = max(a, final)

        split = decode_split(vae, total, world=self.state.decoding.cp_size,
                             temporal_compression=self.geometry.temporal_compression,
                             frames_per_rank=self.decode_frames_per_rank, request=request)

        def decode_range(a: int, b: int) -> np.ndarray:
            return decode_round_uint8(pipe, vae, self._decode_ctx, buffer, a, b, noise.timestep, seed=request.seed,
                                      split_scope=self.decode_split(split))

        # An extension's first latent frames are the video it extends: decoded as context, not delivered.
        skip = 0 if request.extends is None else video_index(x.windows.overlap, self.geometry.temporal_compression)
        return Decoder(split=split, frame_shape=(request.height, request.width, 3), decode_range=decode_range,
                       reads=lambda a, b: decode_reads(vae, split, a, b), feed=feed, skip=skip,
                       length_free=noise.length_free)

    def checkpoint(self, state) -> dict[str, np.ndarray] | None:
        """A long video's windows made so far (``models.ltx_video.windows.Video``); ``None`` for any other pass."""
        return window_checkpoint(state) if isinstance(state, WindowPass) else None

    def upsample_latents(self, request: GenerationRequest, latents: torch.Tensor) -> torch.Tensor:
        """Stage 1's latents ``[1, C, F, H, W]`` (as LTXConditionPipeline returns them for ``output_type="latent"``)
        upsampled by LTXLatentUpsamplePipeline with the request's AdaIN and tone mapping."""
        if self.upsample_pipe is None:
            raise ValueError("stages=2 needs a latent upsampler and this model folder has none: use stages=1")
        # NOTE(upsampler): replicated, on every rank alike (a few 3-D convolutions over the half-size latents, small
        # beside one transformer step); its output is the same on every rank, so the group needs no exchange.
        return self.upsample_pipe(latents=latents.to(self.device), output_type="latent",
                                  adain_factor=float(request.options["adain_factor"] or 0.0),
                                  tone_map_compression_ratio=float(request.options["tone_map_compression_ratio"]),
                                  return_dict=False)[0]

    def restore(self, request: GenerationRequest, arrays: dict[str, np.ndarray]):
        """The state a checkpoint was taken in, and the latent frames final in it."""
        return restore_state(request, arrays)

    def decode_split(self, split: TemporalSplit) -> contextlib.AbstractContextManager[None]:
        """Inside this block, ``decode_round(vae, ..., a, b)`` decodes one round's piece of ``split``."""
        return scoped(self._decode_ctx, "split", split)


def _pil(frame: np.ndarray) -> Image.Image:
    return Image.fromarray(frame, mode="RGB")


def _condition_tensor(pipe, cond: Condition, index: int, request: GenerationRequest) -> torch.Tensor:
    """``[1, 3, F, H, W]`` in [-1, 1]: the media resized as LTXConditionPipeline resizes it, a clip trimmed to the
    frames left from ``index`` on, to ``8k + 1``."""
    if cond.is_image:
        return pipe.video_processor.preprocess(_pil(cond.frames[0]), request.height, request.width).unsqueeze(2)
    tensor = pipe.video_processor.preprocess_video([_pil(f) for f in cond.frames], request.height, request.width)
    return tensor[:, :, :pipe.trim_conditioning_sequence(index, tensor.size(2), request.num_frames)]
