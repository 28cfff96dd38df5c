"""Wan (2.1, 2.2 A14B, 2.2 TI2V-5B) on the context-parallel engine.

The model maths is diffusers' (``WanTransformer3DModel``, ``AutoencoderKLWan``, the folder's scheduler, and
``WanPipeline``'s / ``WanImageToVideoPipeline``'s own prompt and image encoding, latents and post-processing).
Parallelism is applied from outside (``models.wan.parallel``: the latents as one token per patch, sharded like any
sequence; Ulysses self-attention; the rotary tables cut to the rank's tokens; cross-attention from local queries with
the text's keys and values kept per request). Here:
- at one rank the tokens are unpacked to the video's own grid for the transformer, which is the pipeline's call bit
  for bit; at N ranks each rank's tokens go in as a column of patches;
- a step's passes (``cond``, then ``uncond`` with CFG, as the pipelines run them, each a batch of one) are shared
  over the guidance ranks and exchanged (``cp_infer.collectives.gather_passes``); Wan 2.2 A14B's step runs the
  expert of its timestep (``transformer`` while ``t >= boundary_ratio * 1000``, then ``transformer_2``, with
  ``guidance_scale_2``); TI2V-5B's timestep is per token, cut like the tokens;
- the decode is ``AutoencoderKLWan``'s own modules on the calls its frame-at-a-time loop makes, time-parallel over
  the decoding group (``models.common.wan_vae_parallel``: each rank decodes pieces of whole latent frames, the pieces
  handing each other their causal convolutions' caches), round by round so the video streams and memory stays one
  round's; bit-identical to ``vae.decode`` at any number of ranks;
- a video longer than one window (``temporal_tile_size``) is made window by window (``models.wan.windows``), its
  latent frames decoded and streamed as each window makes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from diffusers import WanPipeline, WanTransformer3DModel
from diffusers.loaders import WanLoraLoaderMixin
from PIL import Image

from cp_infer import LatentShape, ParallelState, ShardPlan, VideoGeometry, gather_passes, pass_shares
from cp_infer.decode import DEFAULT_FRAMES_PER_RANK, TemporalSplit
from cp_infer.plan import Plan
from cp_infer.request import GenerationRequest
from cp_infer.sampler import Decoder, Prepared
from cp_infer.step_cache import CacheStats, StepCache
from cp_infer.weights import join_call
from models.common.adapter import video_uint8
from models.common.lora import LoadedLoras, LoraSpec, apply_loras
from models.common.step_cache import PASS_CONTEXTS, cached_call, pass_cache, pass_cache_stats, pass_contexts
from models.common.wan_vae_parallel import WanStreamedDecode, decode_split
from models.common.windows import window_plan

from .options import wan_options, wan_windows_of
from .parallel import WanShardContext, pack_patches, parallelize_wan_transformer, unpack_patches
from .windows import (
    TailReplacement,
    WindowPass,
    chained,
    checkpoint,
    finish_window,
    prepare_window,
    replace_tail,
    restore_state,
    windowed,
)

__all__ = ["LORA", "WanModel", "plan_request", "step_passes"]

LORA = LoraSpec(loader=WanLoraLoaderMixin, parts={"transformer": WanTransformer3DModel})
"""How Wan adapters load: into ``transformer`` (Wan 2.2 A14B: the high-noise expert), as
``WanPipeline.load_lora_weights`` loads them by default."""


def plan_request(request: GenerationRequest) -> Plan:
    """One pass, or a video longer than one window: a ``window`` pass per window (``models.wan.windows``), each with
    its own prompt and every step of the schedule."""
    windows = wan_windows_of(request)
    if windows is not None:
        return window_plan(request, windows, steps=request.num_inference_steps)
    return Plan.single(request)


def step_passes(request: GenerationRequest) -> int:
    """The transformer passes of a step: CFG's conditional and unconditional, or the conditional alone. The
    pipelines decide on ``guidance_scale`` alone (Wan 2.2 A14B's low-noise steps run both passes when it is above 1,
    whatever ``guidance_scale_2``)."""
    return 2 if request.guidance_scale > 1.0 else 1


@dataclass
class _RequestState:
    """What ``WanModel.prepare`` builds for one request, read by its ``predict``, ``step`` and ``decoder``."""

    request: GenerationRequest
    shape: LatentShape
    scheduler: Any
    """The request's own scheduler (the folder's config, ``flow_shift`` applied): stateful, multistep."""
    embeds: list[torch.Tensor]
    """The step's passes' prompt embeddings in pass order: ``[cond]`` or ``[cond, uncond]``, each ``[1, L, D]``."""
    guidance: float
    guidance_2: float
    boundary: float | None
    """Wan 2.2 A14B: steps with ``t`` below it run ``transformer_2``; ``None``: one expert."""
    high_noise: tuple[bool, ...] = ()
    """With ``boundary``: whether each step's ``t`` is at or above it (its expert is ``transformer``), decided on the
    host from the schedule computed there, so that no step reads its device timestep back."""
    step: int = 0
    """The steps taken."""
    image_embeds: torch.Tensor | None = None
    """Wan 2.1 I2V's CLIP image tokens ``[1, 257, 1280]``."""
    condition: torch.Tensor | None = None
    """Image-to-video, ``[1, S, C_COND*pt*ph*pw]``: tokens appended to each token's channels (Wan 2.1 I2V and 2.2
    A14B I2V: the 4 mask and 16 image-latent channels), or, with per-token timesteps, ``(1 - mask) * condition`` (the
    first latent frame's image latents, zero elsewhere)."""
    keep: torch.Tensor | None = None
    """Per-token timesteps (TI2V-5B): ``[1, S, C*pt*ph*pw]``, the mask the latents are multiplied by before the
    condition is added (0 on the image's first latent frame, 1 elsewhere); ``None``: no image."""
    token_mask: torch.Tensor | None = None
    """Per-token timesteps: ``[S]``, each token's timestep factor (the pipeline's ``mask[:, ::2, ::2]``)."""
    first_frame: tuple[torch.Tensor, torch.Tensor] | None = None
    """TI2V-5B image-to-video (or a later window's tail): ``(mask, condition)`` in ``[1, C, F, H, W]`` layout, for the
    final latents."""
    tail: TailReplacement | None = None
    """One-timestep models, a window after the first: its tail's tokens, replaced after every step."""
    windowed: WindowPass | None = None
    """A window of a long video: which, and the video made before it."""
    caches: dict[int, StepCache | None] = field(default_factory=dict)
    """The pass's step cache of each expert that ran (0: ``transformer``, 1: ``transformer_2``), made at its first
    step: each expert has its own state, as each of the pipeline's transformers has its own hooks."""
    cache: StepCache | None = None
    """The cache of the expert of the step in hand (``cache_stats`` reads it)."""


class WanModel:
    """A Wan pipeline's components, parallelised, behind the sampler's ``DenoiseModel`` interface."""

    family = "wan"

    def __init__(self, components, *, state: ParallelState):
        self.state = state
        self.components = components
        layout = components.layout
        self.layout = layout
        # NOTE(pipeline): the pipeline object is used only for diffusers' own prompt and image encoding, latents and
        # post-processing, so that a 1-rank run is the reference implementation step for step.
        parts = dict(tokenizer=components.tokenizer, text_encoder=components.text_encoder, vae=components.vae,
                     scheduler=components.scheduler, transformer=components.transformer,
                     transformer_2=components.transformer_2, boundary_ratio=layout.boundary_ratio,
                     expand_timesteps=layout.expand_timesteps)
        self.pipe = WanPipeline(**parts)
        # WanImageToVideoPipeline for an image: the folder's own pipeline (Wan 2.1 I2V, 2.2 A14B I2V), or TI2V-5B's
        # image-to-video over the same components (its folder is a WanPipeline's).
        self.i2v_pipe = None
        if layout.takes_image:
            # Imported here, as in models.wan.default: its module's CLIP image processor import warns without
            # torchvision, which text-to-video never needs.
            from diffusers import WanImageToVideoPipeline

            self.i2v_pipe = WanImageToVideoPipeline(**parts, image_encoder=components.image_encoder,
                                                    image_processor=components.image_processor)
        _check_scheduler(components.scheduler)
        patch = tuple(components.transformer.config.patch_size)
        self.patch = patch
        self.geometry = VideoGeometry(temporal_compression=self.pipe.vae_scale_factor_temporal,
                                      spatial_compression=self.pipe.vae_scale_factor_spatial,
                                      patch_size=patch[1], patch_size_t=patch[0])
        self._ctx = WanShardContext(state=state)
        for transformer in self.experts:
            parallelize_wan_transformer(transformer, self._ctx)
        self.options = wan_options(layout)

    @property
    def transformer(self):
        return self.components.transformer

    @property
    def experts(self) -> list[torch.nn.Module]:
        """The transformers a request may run: ``transformer``, and Wan 2.2 A14B's ``transformer_2``."""
        return [t for t in (self.components.transformer, self.components.transformer_2) if t is not None]

    lora_spec = LORA
    loras: LoadedLoras | None = None
    """The adapters requests may apply (``models.registry.open_model`` with a ``lora_dir``); ``None``: none."""

    def lora_parts(self) -> dict[str, torch.nn.Module]:
        """The modules adapters load into, by their keys' prefix (``LORA.parts``)."""
        return {"transformer": self.transformer}

    placement = None
    """Where the components are (``models.common.placement.Placement``, set by ``models.registry.open_model``)."""

    decode_frames_per_rank: int | str | None = DEFAULT_FRAMES_PER_RANK
    """Latent frames each rank decodes per streamed round (4 video frames each, the first one); ``"auto"``: by frame
    size (``cp_infer.decode.resolve_frames_per_rank``), on one rank below 48x48 frames
    (``models.common.wan_vae_parallel.decode_world``); ``None``: one round (the whole video at once)."""

    @property
    def layers(self) -> int:
        return len(self.transformer.blocks)

    @property
    def scheduler(self):
        return self.components.scheduler

    @property
    def device(self) -> torch.device:
        return self.state.device

    @contextlib.contextmanager
    def sharded(self, plan: ShardPlan, grid: tuple[int, int, int]) -> Iterator[None]:
        """The transformers' forward passes inside this block run on the shard of ``plan`` of a video of ``grid``
        patches."""
        self._ctx.plan, self._ctx.grid = plan, grid
        try:
            yield
        finally:
            self._ctx.plan = self._ctx.grid = None

    def plan(self, request: GenerationRequest) -> Plan:
        if request.conditions and (not self.layout.image or wan_windows_of(request) is None):
            raise ValueError("conditions: Wan models take an image as the first frame (image), not conditions at "
                             "frames; give the first frame as image")
        if self.layout.image and request.image is None and not request.conditions:
            raise ValueError("this Wan model is image-to-video (WanImageToVideoPipeline): give the first frame as "
                             "an image (input_reference, --image)")
        return plan_request(request)

    def _request_scheduler(self, request: GenerationRequest):
        """A fresh scheduler of the folder's config (``flow_shift`` set where the request sets it): the same schedule
        as the folder's own, and no state shared across requests."""
        config = dict(self.scheduler.config)
        shift = request.options.get("flow_shift")
        if shift is not None:
            config["flow_shift" if "flow_shift" in config else "shift"] = float(shift)
        return type(self.scheduler).from_config(config)

    def prepare(self, request: GenerationRequest, shape: LatentShape, *, kind: str = "denoise",
                previous: dict[str, torch.Tensor] | None = None, previous_state: Any = None) -> Prepared:
        """WanPipeline's preparation, or with an image WanImageToVideoPipeline's (the image encoded on every rank
        alike); ``kind="window"``: a long video's window (``models.wan.windows``). The pass's adapters are made active
        first (``models.common.lora``)."""
        if kind == "window":
            return prepare_window(self, request, previous_state)
        assert kind == "denoise" and previous is None, kind
        apply_loras(self.loras, request.loras)
        device, layout = self.device, self.layout
        pipe = self.pipe if request.image is None else self.i2v_pipe
        cfg_on = request.guidance_scale > 1.0
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            prompt=request.prompt, negative_prompt=request.negative_prompt, do_classifier_free_guidance=cfg_on,
            max_sequence_length=request.options["max_sequence_length"], device=device)
        dtype = self.transformer.dtype
        embeds = [prompt_embeds.to(dtype)] + ([negative_embeds.to(dtype)] if cfg_on else [])
        scheduler = self._request_scheduler(request)
        scheduler.set_timesteps(request.num_inference_steps, device=device)
        boundary, high_noise = None, ()
        if layout.boundary_ratio is not None:
            boundary = layout.boundary_ratio * scheduler.config.num_train_timesteps
            host = self._request_scheduler(request)  # the same schedule, on the CPU
            host.set_timesteps(request.num_inference_steps, device="cpu")
            high_noise = tuple(bool(t >= boundary) for t in host.timesteps)
        guidance_2 = request.options.get("guidance_scale_2")
        x = _RequestState(request=request, shape=shape, scheduler=scheduler, embeds=embeds,
                          guidance=request.guidance_scale,
                          guidance_2=request.guidance_scale if guidance_2 is None else guidance_2, boundary=boundary,
                          high_noise=high_noise)
        # NOTE(noise): drawn on the CPU from the request's seed so that every rank, and every device type, starts
        # from the same latents.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        if request.image is not None:
            latents = self._prepare_image(request, x, generator, dtype)
        else:
            latents = pipe.prepare_latents(1, self.transformer.config.in_channels, request.height, request.width,
                                           request.num_frames, torch.float32, torch.device("cpu"), generator)
            latents = latents.to(device)
            # WanPipeline fixes the schedule's start (WanImageToVideoPipeline finds it from the first timestep).
            scheduler.set_begin_index(0)
            if layout.expand_timesteps:
                x.token_mask = torch.ones(latents.shape[2:], dtype=torch.float32, device=device)[:, ::2, ::2].flatten()
        return Prepared(latents={"video": pack_patches(latents, self.patch)}, timesteps=list(scheduler.timesteps),
                        state=x)

    def _prepare_image(self, request: GenerationRequest, x: _RequestState, generator: torch.Generator,
                       dtype: torch.dtype) -> torch.Tensor:
        """WanImageToVideoPipeline's latents and condition for ``request.image`` (its first frame)."""
        pipe, device = self.i2v_pipe, self.device
        image = Image.fromarray(request.image.frames[0], mode="RGB")
        if self.layout.image_tokens:
            x.image_embeds = pipe.encode_image(image, device).to(dtype)
        pixels = pipe.video_processor.preprocess(image, height=request.height, width=request.width)
        out = pipe.prepare_latents(pixels.to(device, dtype=torch.float32), 1, self.components.vae.config.z_dim,
                                   request.height, request.width, request.num_frames, torch.float32, device,
                                   generator)
        if not self.layout.expand_timesteps:
            latents, condition = out
            x.condition = pack_patches(condition, self.patch)
            return latents
        latents, condition, mask = out
        # The pipeline's (1 - mask) * condition + mask * latents, its first term made once: the same values.
        x.first_frame = (mask, condition)
        x.condition = pack_patches((1 - mask) * condition, self.patch)
        x.keep = pack_patches(mask.expand_as(latents), self.patch)
        x.token_mask = mask[0][0][:, ::2, ::2].flatten()
        return latents

    def _expert(self, x: _RequestState) -> tuple[torch.nn.Module, float]:
        """The transformer of the step at hand and its guidance scale (WanPipeline's choice: ``t >= boundary``); the
        step's cache is that expert's."""
        high = x.boundary is None or x.high_noise[x.step]
        which = 0 if high else 1
        if which not in x.caches:
            x.caches[which] = self.step_cache(x.request)
        x.cache = x.caches[which]
        if high:
            return self.transformer, x.guidance
        return self.components.transformer_2, x.guidance_2

    def step_cache(self, request: GenerationRequest) -> StepCache | None:
        """An expert's step cache for a pass: WanPipeline's contexts, ``cond`` and (with CFG) ``uncond``, a pass
        each."""
        return pass_cache(request, state=self.state, contexts=pass_contexts(step_passes(request)),
                          layers=len(self.transformer.blocks))

    def cache_stats(self, prepared: Prepared) -> CacheStats | None:
        """What the step just ended saved (``cp_infer.step_cache.StepCache.step_stats``)."""
        return pass_cache_stats(prepared.state.cache)

    def predict(self, latents_local: dict[str, torch.Tensor], t: torch.Tensor, prepared: Prepared,
                plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        x: _RequestState = prepared.state
        latents, plan = latents_local["video"], plans["video"]
        rank, dtype = self.state.cp_rank, x.embeds[0].dtype
        expert, guidance = self._expert(x)
        if x.condition is None:
            model_in = latents
        elif x.keep is None:  # 1, S_LOCAL, C*P -> 1, S_LOCAL, (C + C_COND)*P: the pipeline's cat on channels
            model_in = torch.cat([latents, plan.shard(x.condition, rank).to(latents.device)], dim=-1)
        else:
            model_in = plan.shard(x.condition, rank).to(latents.device) + plan.shard(x.keep, rank) * latents
        model_in = model_in.to(dtype)
        # Per-token timesteps: S -> 1, S_LOCAL, each token's own, cut like the tokens.
        timestep = t.expand(1) if x.token_mask is None else plan.shard((x.token_mask * t)[None], rank)
        # At one rank the video's own grid (the pipeline's call); else this rank's tokens as a column of patches.
        grid = (x.shape.frames, x.shape.height, x.shape.width)
        local_grid = grid if plan.world == 1 else (plan.local_len, 1, 1)
        hidden = unpack_patches(model_in, local_grid, self.patch)
        # The passes of the step in the pipelines' order, [cond, uncond]; this rank runs its share of them, one
        # batch of one each as the pipelines do, and the guidance group exchanges them.
        passes = len(x.embeds)
        share = pass_shares(passes, self.state.guidance_size)[self.state.guidance_rank]
        outputs = []
        with self.sharded(plan, grid):
            for p in share:
                with cached_call(x.cache, expert.blocks, PASS_CONTEXTS[p], plan, rank):
                    out = expert(hidden_states=hidden, timestep=timestep, encoder_hidden_states=x.embeds[p],
                                 encoder_hidden_states_image=x.image_embeds, attention_kwargs=None,
                                 return_dict=False)[0]
                outputs.append(pack_patches(out, self.patch))
        if x.cache is not None:
            x.cache.end_step()
        if not outputs:  # more guidance ranks than passes: this one runs none, but joins the exchange
            join_call(expert)  # and, with sharded weights, its peers' all-gathers (cp_infer.weights)
            noise_pred = latents.new_empty((0, *latents.shape[1:]), dtype=dtype)
        else:
            noise_pred = torch.cat(outputs)
        noise_pred = gather_passes({"video": noise_pred}, passes=passes, state=self.state)["video"]
        if passes == 2:
            cond, uncond = noise_pred[0:1], noise_pred[1:2]
            noise_pred = uncond + guidance * (cond - uncond)
        return {"video": noise_pred}

    def step(self, noise_pred_local: dict[str, torch.Tensor], t: torch.Tensor,
             latents_local: dict[str, torch.Tensor], prepared: Prepared,
             plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        x: _RequestState = prepared.state
        stepped = x.scheduler.step(noise_pred_local["video"], t, latents_local["video"], return_dict=False)[0]
        x.step += 1
        if x.tail is not None:
            stepped = replace_tail(stepped, x, plans["video"], self.state.cp_rank)
        return {"video": stepped}

    def finish_pass(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> int | None:
        """A window's latents appended to the video made so far (``models.wan.windows``): the latent frames now
        final; ``None`` for a pass of a video in one sequence."""
        if prepared.state.windowed is None:
            return None
        return finish_window(self, latents, prepared)

    def checkpoint(self, state) -> dict[str, np.ndarray] | None:
        """A long video's windows made so far; ``None`` for a video in one sequence."""
        wp = windowed(state)
        return None if wp is None else checkpoint(wp)

    def restore(self, request: GenerationRequest, arrays: dict[str, np.ndarray]):
        """The state a checkpoint was taken in, and the latent frames final in it."""
        return restore_state(request, arrays, chained_windows=chained(self))

    def _video_latents(self, latents: dict[str, torch.Tensor], x: _RequestState) -> torch.Tensor:
        """The final latents ``[1, C, F, H, W]`` as the pipeline has them before its decode."""
        video = unpack_patches(latents["video"], (x.shape.frames, x.shape.height, x.shape.width), self.patch)
        if x.first_frame is not None:
            mask, condition = x.first_frame
            video = (1 - mask) * condition + mask * video
        return video

    def output_latents(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> dict[str, np.ndarray]:
        """``output_type="latent"``: the pipelines return the latents ``[B, C, F, H, W]`` (a long video: all its
        windows')."""
        wp = windowed(prepared.state)
        if wp is not None:
            return {"latents": wp.made.latents.numpy()}
        return {"latents": self._video_latents(latents, prepared.state).float().cpu().numpy()}

    def decoder(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> Decoder:
        """Denormalise the latents as the pipelines do; decode them over the decoding group, time-parallel, round by
        round (``models.common.wan_vae_parallel``)."""
        wp = windowed(prepared.state)
        if wp is not None:
            return self._chained_decoder(wp) if chained(self) else self._window_decoder(wp)
        x: _RequestState = prepared.state
        request, vae = x.request, self.components.vae
        video = _denormalised(vae, self._video_latents(latents, x).to(self.device, dtype=vae.dtype))
        split = self._decode_split(request, video.shape[2])
        decode = WanStreamedDecode(vae, vae.post_quant_conv(video), split, self.state.decoding)
        return Decoder(split=split, frame_shape=(request.height, request.width, 3),
                       decode_range=lambda a, b: video_uint8(self.pipe, decode(a, b)))

    def _decode_split(self, request: GenerationRequest, latent_frames: int) -> TemporalSplit:
        return decode_split(self.components.vae, latent_frames, setting=self.decode_frames_per_rank,
                            world=self.state.decoding.cp_size, height=request.height, width=request.width,
                            temporal_compression=self.geometry.temporal_compression)

    def _window_decoder(self, wp: WindowPass) -> Decoder:
        """The decode of a long video (time-parallel, as above): each window's latent frames, final as it is made, go
        through the post-quant convolution (pointwise in time) into a whole-video buffer (``feed``); a round is
        decoded once the frames it reads, those up to its last (the decoder is causal), are there."""
        request, vae = wp.request, self.components.vae
        total, like = wp.windows.latent_frames, wp.made.latents
        buffer = torch.zeros((1, like.shape[1], total, *like.shape[3:]), dtype=vae.dtype, device=self.device)
        split = self._decode_split(request, total)
        decode = WanStreamedDecode(vae, buffer, split, self.state.decoding)
        fed = [0]

        def feed(state, final: int) -> None:
            a = fed[0]
            if final > a:
                part = windowed(state).made.latents[:, :, a:final].to(self.device, dtype=vae.dtype)
                decode.x[:, :, a:final] = vae.post_quant_conv(_denormalised(vae, part))
            fed[0] = max(a, final)

        return Decoder(split=split, frame_shape=(request.height, request.width, 3),
                       decode_range=lambda a, b: video_uint8(self.pipe, decode(a, b)), reads=lambda a, b: b, feed=feed)

    def decode_whole(self, latents: torch.Tensor) -> np.ndarray:
        """The pipelines' own decode of latents ``[1, C, F, H, W]``, on this rank alone: uint8 ``[F', H, W, 3]``."""
        vae = self.components.vae
        video = vae.decode(_denormalised(vae, latents.to(self.device, dtype=vae.dtype)), return_dict=False)[0]
        return video_uint8(self.pipe, video)

    def _chained_decoder(self, wp: WindowPass) -> Decoder:
        """The decode of a long video of chained windows (``models.wan.windows``): each window decoded alone, its
        repeated first frame dropped, on the decoding group's first rank. Every window was decoded for the next window's
        image as it was made (``finish_window``): those frames are taken as they are fed; a window not decoded yet (one
        before a resume) is decoded here. Rounds of a window's new latent frames
        stream the video window by window."""
        request, windows = wp.request, wp.windows
        t = self.geometry.temporal_compression
        split = TemporalSplit(latent_frames=windows.latent_frames, world=1, temporal_compression=t,
                              frames_per_rank=windows.tile - windows.overlap)
        owner = [0] * windows.latent_frames  # the window whose decode gives each latent frame's video frames
        for w, (start, end) in enumerate(windows.spans):
            owner[start + (w > 0):end] = [w] * (end - start - (w > 0))

        def video_frame(j: int) -> int:  # the first video frame of latent frame j (the first latent frame has one)
            return 0 if j == 0 else (j - 1) * t + 1

        frames: dict[int, np.ndarray] = {}
        latest: list[Any] = [None]
        keeps = self.state.decoding.cp_rank == 0

        def feed(state, final: int) -> None:
            made = windowed(state).made
            latest[0] = made
            if made.decoded is not None:
                if keeps:
                    frames[made.window] = made.decoded
                made.decoded = None

        def window_frames(w: int) -> np.ndarray:
            if w not in frames:
                own = self.decode_whole(latest[0].own_latents(windows, w))
                frames[w] = own if w == 0 else own[1:]
            return frames[w]

        def decode_range(a: int, b: int) -> np.ndarray:
            out = []
            for w in range(owner[a], owner[b - 1] + 1):
                first = video_frame(windows.spans[w][0] + (w > 0))  # the window's first frame in the video
                lo, hi = max(video_frame(a), first), video_frame(b)
                own = window_frames(w)
                out.append(own[lo - first:min(hi, first + len(own)) - first])
                if first + len(own) <= hi:
                    del frames[w]  # all delivered
            return np.concatenate(out)

        return Decoder(split=split, frame_shape=(request.height, request.width, 3), decode_range=decode_range,
                       reads=lambda a, b: windows.spans[owner[b - 1]][1], feed=feed)


def _denormalised(vae, latents: torch.Tensor) -> torch.Tensor:
    """The pipelines' ``latents / (1 / std) + mean`` before their decode (elementwise: any range of frames alike)."""
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
    return latents / std + mean


def _check_scheduler(scheduler) -> None:
    """Refuse a scheduler whose step is not elementwise (each rank steps its shard alone)."""
    config = scheduler.config
    if config.get("stochastic_sampling", False):
        raise ValueError("stochastic_sampling schedulers draw per-step noise that would differ per shard; "
                         "set stochastic_sampling=false in scheduler/scheduler_config.json")
    if config.get("thresholding", False):
        raise ValueError("a thresholding scheduler clips each step by a quantile of the whole sample, which a shard "
                         "does not hold; set thresholding=false in scheduler/scheduler_config.json")
