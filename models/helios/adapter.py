"""Helios on the context-parallel engine: a video made chunk by chunk, each chunk denoised with a multi-scale
history of the chunks before it.

The model maths is diffusers' (``HeliosTransformer3DModel``, ``AutoencoderKLWan``, the folder's ``HeliosScheduler``,
and ``HeliosPipeline``'s own prompt encoding, latents and post-processing). Parallelism is applied from outside
(``models.helios.parallel``: the chunk's and the history's tokens sharded together as one self-attention sequence).
Here:
- a request's plan is one ``chunk`` pass per chunk (:func:`plan_request`); every pass draws its noise from the one
  generator of the request, in the pipeline's order, on every rank alike, and runs the pipeline's schedule
  (``set_timesteps(steps, sigmas=linspace(0.999, 0, steps + 1)[:-1], mu=calculate_shift(chunk tokens))``); with a
  ``HeliosPyramidPipeline`` folder, a pass per stage of each chunk, coarse to fine (``models.helios.pyramid``);
- an image (``image``) or a video (``video_clip``: HeliosPipeline's ``video``) is encoded and noised when the first
  chunk is prepared, as the pipeline prepares it; its latents start the history;
- after each chunk (``finish_pass``) its latents join the history (the long, mid and short history are the last
  ``sum(history_sizes)`` latent frames, and with ``keep_first_frame`` the video's first latent frame is put before
  the short one), as ``HeliosPipeline``'s loop does; the history kept on the device is those frames alone, so its
  memory does not grow with the video, and the chunks made so far wait on the CPU for the decode;
- the tokens of a step's chunk are packed one per patch (``models.common`` layout of ``pack_patches``), sharded by
  the engine; at one rank the transformer's own forward runs on the chunk's grid (the pipeline's call, bit for bit);
- a step's passes (``cond``, then ``uncond`` with CFG, each a batch of one) are shared over the guidance ranks and
  exchanged (``cp_infer.collectives.gather_passes``);
- the decode is the pipeline's: each chunk decoded alone, as ``vae.decode`` decodes it (its causal cache starts
  afresh at every chunk), the frames post-processed and cut to ``4k + 1``; each chunk time-parallel over the decoding
  group (pieces of its latent frames, ``models.common.wan_vae_parallel``), streamed chunk by chunk as they are made;
- after each chunk (its last stage) the job can be checkpointed (every chunk's latents, the history, the
  generator's state) and resumed from there, bit-equal to the uninterrupted run.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from diffusers import HeliosPipeline, HeliosPyramidPipeline, HeliosTransformer3DModel
from diffusers.loaders import HeliosLoraLoaderMixin
from diffusers.pipelines.helios.pipeline_helios import calculate_shift
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image

from cp_infer import LatentShape, ParallelState, ShardPlan, VideoGeometry, gather_passes, gather_sequence, pass_shares
from cp_infer.decode import DEFAULT_FRAMES_PER_RANK, SegmentedSplit, video_index
from cp_infer.plan import DenoisePass, Plan
from cp_infer.request import GenerationRequest
from cp_infer.sampler import Decoder, Prepared
from cp_infer.step_cache import CacheStats, StepCache
from cp_infer.weights import join_call
from models.common.adapter import video_uint8
from models.common.lora import LoadedLoras, LoraSpec, apply_loras
from models.common.step_cache import PASS_CONTEXTS, cached_call, pass_cache, pass_cache_stats, pass_contexts
from models.common.wan_vae_parallel import WanStreamedDecode, decode_split

from .options import HELIOS_TEMPORAL_COMPRESSION, Pyramid, chunk_prompts, chunks_of, helios_options, video_clip
from .parallel import HeliosShardContext, parallelize_helios_transformer, sharded_forward
from .pyramid import cfg_zero_star, dmd_step, downsample, set_stage_timesteps, upsample_renoise

__all__ = ["LORA", "HeliosModel", "pack_patches", "plan_request", "step_passes", "unpack_patches"]

LORA = LoraSpec(loader=HeliosLoraLoaderMixin, parts={"transformer": HeliosTransformer3DModel})
"""How Helios adapters load: into ``transformer``, as ``HeliosPipeline.load_lora_weights`` loads them."""


def pack_patches(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C, F, H, W] -> [B, S, C*pt*ph*pw]``: a token per patch, in the transformer's token order."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    # B, C, F', pt, H', ph, W', pw -> B, F', H', W', C, pt, ph, pw
    x = x.view(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpack_patches(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """``[B, S, C*pt*ph*pw] -> [B, C, F, H, W]`` for a token grid of ``F' x H' x W'`` patches (inverse of
    :func:`pack_patches`)."""
    gf, gh, gw = grid
    pt, ph, pw = patch
    # B, F', H', W', C, pt, ph, pw -> B, C, F', pt, H', ph, W', pw
    x = tokens.view(tokens.shape[0], gf, gh, gw, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(tokens.shape[0], -1, gf * pt, gh * ph, gw * pw)


def plan_request(request: GenerationRequest, pyramid: Pyramid | None = None) -> Plan:
    """One ``chunk`` pass per chunk (its ``window``), each with its prompt (``prompt_segments``) and every step of
    the schedule; with a ``pyramid``, a pass per stage of each chunk (the first ``chunk``, the others ``stage``)."""
    passes = []
    for k, prompt in enumerate(chunk_prompts(request)):
        r = replace(request, prompt=prompt)
        if pyramid is None:
            passes.append(DenoisePass(r, steps=request.num_inference_steps, kind="chunk", window=k))
            continue
        amplify = request.options["is_amplify_first_chunk"]
        passes += [DenoisePass(r, steps=pyramid.steps(n, k, amplify), kind="stage" if s else "chunk", window=k)
                   for s, n in enumerate(request.options["pyramid_num_inference_steps_list"])]
    return Plan(tuple(passes))


def final_frames(request: GenerationRequest, chunks_made: int) -> int:
    """The decode's latent frames (:meth:`HeliosModel.decode_split`'s, a segment per chunk) final once
    ``chunks_made`` chunks are made."""
    return chunks_made * chunks_of(request).latent_frames


def step_passes(request: GenerationRequest) -> int:
    """The transformer passes of a step: CFG's conditional and unconditional (``guidance_scale > 1``, the
    pipeline's ``do_classifier_free_guidance``), or the conditional alone."""
    return 2 if request.guidance_scale > 1.0 else 1


@dataclass
class _History:
    """The video made so far, as ``HeliosPipeline``'s loop holds it between chunks."""

    sizes: tuple[int, int, int]
    """``history_sizes`` sorted from big to small."""
    latents: torch.Tensor
    """The last ``sum(history_sizes)`` latent frames ``[1, C, T, H, W]`` (float32, zeros before the first chunk)."""
    first: torch.Tensor | None = None
    """With ``keep_first_frame``: the video's first latent frame (``None`` before the first chunk is made)."""
    made: list[torch.Tensor] = field(default_factory=list)
    """Every chunk's latents made so far ``[1, C, n, H, W]``, on the CPU."""
    context: torch.Tensor | None = None
    """The latents before the first chunk that the pipeline returns before the chunks' (on the CPU): image-to-video's
    still frame (the last latent frame of the image held still for a chunk, noised: the history's last frame),
    video-to-video's video (its latents, noised: the history's last frames); ``None``: text-to-video."""


@dataclass
class _RequestState:
    """What ``HeliosModel.prepare`` builds for one chunk, read by its ``predict``, ``step``, ``finish_pass`` and
    ``decoder``; a chunk's state hands the request's generator, scheduler, embeddings and history to the next."""

    request: GenerationRequest
    shape: LatentShape
    """One chunk's token grid (latent frames, rows, columns of patches)."""
    scheduler: Any
    embeds: list[torch.Tensor]
    """The step's passes' prompt embeddings in pass order: ``[cond]`` or ``[cond, uncond]``, each ``[1, L, D]``."""
    generator: torch.Generator
    """The request's one generator (CPU, seeded), drawn from in the pipeline's order."""
    history: _History
    chunk: int
    """Which chunk this pass makes (from 0)."""
    inputs: dict[str, torch.Tensor]
    """The transformer's history arguments for this chunk (indices and latents, in the transformer's dtype)."""
    stage: int = 0
    """A pyramid's stage of the chunk in hand (0: the coarsest; always 0 without a pyramid)."""
    step: int = 0
    """The step of the pass in hand (from 0)."""
    start: torch.Tensor | None = None
    """DMD: the stage's start latents, whole, in the token layout."""
    cache: StepCache | None = None
    """The pass's step cache (``cache="none"``: none): each chunk and each stage starts afresh."""


def _history_key_scales_in_model_dtype(transformer: torch.nn.Module) -> None:
    """Each self-attention's ``history_key_scale`` in the transformer's dtype. ``from_pretrained`` keeps it in float32
    (``_keep_in_fp32_modules``), and with ``is_amplify_history`` the scaled history keys then reach SDPA in float32
    beside bf16 queries, which it refuses (diffusers' ``HeliosAttnProcessor`` and ours alike). A float32 model is
    untouched."""
    dtype = transformer.dtype
    for block in transformer.blocks:
        scale = getattr(block.attn1, "history_key_scale", None)
        if scale is not None and scale.dtype != dtype:
            scale.data = scale.data.to(dtype)


class HeliosModel:
    """A Helios pipeline's components, parallelised, behind the sampler's ``DenoiseModel`` interface."""

    family = "helios"

    def __init__(self, components, *, state: ParallelState):
        self.state = state
        self.components = components
        # NOTE(pipeline): the pipeline object is used only for diffusers' own prompt encoding, latents and
        # post-processing, so that a 1-rank run is the reference implementation step for step.
        self.pyramid: Pyramid | None = getattr(components, "pyramid", None)
        parts = dict(tokenizer=components.tokenizer, text_encoder=components.text_encoder, vae=components.vae,
                     scheduler=components.scheduler, transformer=components.transformer)
        self.pipe = HeliosPipeline(**parts) if self.pyramid is None else HeliosPyramidPipeline(
            **parts, is_cfg_zero_star=self.pyramid.cfg_zero_star, is_distilled=self.pyramid.distilled)
        _check_scheduler(components.scheduler, self.pyramid)
        self.patch = tuple(components.transformer.config.patch_size)
        self.geometry = VideoGeometry(temporal_compression=self.pipe.vae_scale_factor_temporal,
                                      spatial_compression=self.pipe.vae_scale_factor_spatial,
                                      patch_size=self.patch[1], patch_size_t=self.patch[0])
        self._ctx = HeliosShardContext(state=state)
        parallelize_helios_transformer(components.transformer, self._ctx)
        _history_key_scales_in_model_dtype(components.transformer)
        self.options = helios_options(self.pyramid)

    lora_spec = LORA
    loras: LoadedLoras | None = None
    """The adapters requests may apply (``models.registry.open_model`` with a ``lora_dir``); ``None``: none."""

    placement = None
    """Where the components are (``models.common.placement.Placement``, set by ``models.registry.open_model``)."""

    decode_frames_per_rank: int | str | None = DEFAULT_FRAMES_PER_RANK
    """Latent frames per rank per round of a chunk's decode (``cp_infer.decode.resolve_frames_per_rank``; ``auto``
    decodes frames under 48x48 on one rank, as Wan's decode); ``None``: a chunk in one round."""

    def lora_parts(self) -> dict[str, torch.nn.Module]:
        return {"transformer": self.transformer}

    @property
    def transformer(self):
        return self.components.transformer

    @property
    def layers(self) -> int:
        return len(self.transformer.blocks)

    @property
    def scheduler(self):
        return self.components.scheduler

    @property
    def device(self) -> torch.device:
        return self.state.device

    def plan(self, request: GenerationRequest) -> Plan:
        self.options.check_media(request)
        return plan_request(request, self.pyramid)

    def prepare(self, request: GenerationRequest, shape: LatentShape, *, kind: str = "chunk",
                previous: dict[str, torch.Tensor] | None = None, previous_state: Any = None) -> Prepared:
        """``HeliosPipeline``'s preparation of one chunk: the first encodes the prompts and starts the history; every
        chunk draws its noise from the request's generator and sets the schedule. With a pyramid, a ``chunk`` pass is
        a chunk's first (coarsest) stage, a ``stage`` pass the next stage from the one before (``previous``)."""
        assert kind in ("chunk", "stage"), kind
        device, pipe = self.device, self.pipe
        if kind == "stage":
            return self._next_stage(previous["video"], previous_state)
        chunks = chunks_of(request)
        shape = self.geometry.latent_shape(chunks.chunk_frames, request.height, request.width)
        if previous_state is None:
            x = self._start(request, shape)
        else:
            x = replace(previous_state, chunk=previous_state.chunk + 1, stage=0)
            if request.prompt != x.request.prompt:  # the next range of prompt_segments
                x.request, x.embeds = request, self._embeds(request)
        channels = self.transformer.config.in_channels
        # NOTE(noise): drawn on the CPU from the request's one generator, so that every rank, and every device
        # type, draws the pipeline's latents.
        latents = pipe.prepare_latents(1, channels, request.height, request.width, chunks.chunk_frames, torch.float32,
                                       torch.device("cpu"), x.generator).to(device)
        x.inputs = self._history_inputs(x)
        x.step = 0
        if self.pyramid is not None:
            latents = downsample(latents, self.pyramid.stages - 1)
            return self._stage(x, latents, tokens=None)
        steps = request.num_inference_steps
        sigmas = np.linspace(0.999, 0.0, steps + 1)[:-1]
        config = x.scheduler.config
        tokens = latents.shape[2] * latents.shape[3] * latents.shape[4] // int(np.prod(self.patch))
        mu = calculate_shift(tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        x.scheduler.set_timesteps(steps, device=device, sigmas=sigmas, mu=mu)
        x.cache = self.step_cache(request)
        return Prepared(latents={"video": pack_patches(latents, self.patch)}, timesteps=list(x.scheduler.timesteps),
                        state=x)

    def _stage(self, x: _RequestState, latents: torch.Tensor, *, tokens: int | None) -> Prepared:
        """A pyramid stage's start from its latents ``[1, C, F, h, w]``: its token grid and its schedule, shifted for
        ``tokens`` (``None``: the stage's own)."""
        request = x.request
        x.shape = LatentShape(*(n // p for n, p in zip(latents.shape[2:], self.patch, strict=True)))
        steps = request.options["pyramid_num_inference_steps_list"][x.stage]
        amplify = request.options["is_amplify_first_chunk"] and x.chunk == 0
        tokens = x.shape.tokens if tokens is None else tokens
        set_stage_timesteps(x.scheduler, steps, x.stage, tokens, device=self.device, amplify=amplify)
        tokens = pack_patches(latents, self.patch)
        x.start = tokens if self.pyramid.dmd else None
        x.cache = self.step_cache(request)
        return Prepared(latents={"video": tokens}, timesteps=list(x.scheduler.timesteps), state=x)

    def _next_stage(self, previous: torch.Tensor, previous_state: _RequestState) -> Prepared:
        """The next stage of the chunk: the last one's latents doubled and re-noised (``upsample_renoise``)."""
        x = replace(previous_state, stage=previous_state.stage + 1, step=0)
        grid = (x.shape.frames, x.shape.height, x.shape.width)
        latents = upsample_renoise(self.pipe, unpack_patches(previous, grid, self.patch), x.stage, patch=self.patch,
                                   generator=x.generator, device=self.device, dtype=self.transformer.dtype)
        # NOTE(pipeline): HeliosPyramidPipeline shifts a stage's schedule before it doubles the latents: by the
        # previous stage's token count.
        return self._stage(x, latents, tokens=x.shape.tokens)

    def _start(self, request: GenerationRequest, shape: LatentShape) -> _RequestState:
        """The first chunk's: the adapters, the prompts, the generator, the empty history."""
        apply_loras(self.loras, request.loras)
        device = self.device
        embeds = self._embeds(request)
        # The pipeline's order, big to small (keep_first_frame=False is refused: models.helios.options).
        sizes = sorted(request.options["history_sizes"], reverse=True)
        frames = sum(sizes)
        channels = self.transformer.config.in_channels
        latents = torch.zeros(1, channels, frames, request.height // self.pipe.vae_scale_factor_spatial,
                              request.width // self.pipe.vae_scale_factor_spatial, device=device, dtype=torch.float32)
        x = _RequestState(request=request, shape=shape, scheduler=type(self.scheduler).from_config(
            self.scheduler.config), embeds=embeds, generator=torch.Generator("cpu").manual_seed(request.seed),
            history=_History(sizes=tuple(sizes), latents=latents), chunk=0, inputs={})
        if request.image is not None:
            self._start_image(x)
        elif video_clip(request) is not None:
            self._start_video(x)
        return x

    def _embeds(self, request: GenerationRequest) -> list[torch.Tensor]:
        """The step's passes' prompt embeddings, as ``HeliosPipeline.encode_prompt`` makes them."""
        cfg_on = request.guidance_scale > 1.0
        prompt_embeds, negative_embeds = self.pipe.encode_prompt(
            prompt=request.prompt, negative_prompt=request.negative_prompt, do_classifier_free_guidance=cfg_on,
            max_sequence_length=request.options["max_sequence_length"], device=self.device)
        dtype = self.transformer.dtype
        return [prompt_embeds.to(dtype)] + ([negative_embeds.to(dtype)] if cfg_on else [])

    def _start_image(self, x: _RequestState) -> None:
        """``HeliosPipeline``'s image-to-video preparation: the image's latents (the first latent frame of every
        chunk's short history) and the last latent frame of the image held still for a chunk's frames (the history's
        last), each noised by a sigma drawn from the request's generator, in the pipeline's order."""
        request, pipe, device = x.request, self.pipe, self.device
        options = request.options
        mean, inverse_std = self._latent_stats()
        image = Image.fromarray(request.image.frames[0], mode="RGB")
        pixels = pipe.video_processor.preprocess(image, height=request.height, width=request.width)
        generator = x.generator
        image_latents, still = pipe.prepare_image_latents(
            pixels, latents_mean=mean, latents_std=inverse_std,
            num_latent_frames_per_chunk=options["num_latent_frames_per_chunk"], dtype=torch.float32, device=device,
            generator=generator)
        if options["add_noise_to_image_latents"]:
            # NOTE(noise): the sigmas drawn on the CPU generator (the pipeline's draws there), then moved.
            for kind, latents in (("image", image_latents), ("video", still)):
                lo, hi = options[f"{kind}_noise_sigma_min"], options[f"{kind}_noise_sigma_max"]
                sigma = (torch.rand(1, generator=generator) * (hi - lo) + lo).to(device)
                noised = sigma * randn_tensor(latents.shape, generator=generator, device=device) + (1 - sigma) * latents
                if kind == "image":
                    image_latents = noised
                else:
                    still = noised
        history = x.history
        history.latents = torch.cat([history.latents[:, :, :-1], still], dim=2)
        history.first, history.context = image_latents, still.cpu()

    def _start_video(self, x: _RequestState) -> None:
        """``HeliosPipeline``'s video-to-video preparation (``prepare_video_latents`` and the noise after it): the
        video's first frame encoded alone (the first latent frame of every chunk's short history) and its last whole
        chunks encoded one by one (the history's last latent frames), each noised, the sigmas and the noise drawn
        from the request's generator in the pipeline's order."""
        request, pipe, device = x.request, self.pipe, self.device
        options, generator = request.options, x.generator
        mean, inverse_std = self._latent_stats()
        clip = [Image.fromarray(frame, mode="RGB") for frame in video_clip(request).frames]
        pixels = pipe.video_processor.preprocess_video(clip, height=request.height, width=request.width)
        chunk = options["num_latent_frames_per_chunk"]
        first, video = pipe.prepare_video_latents(pixels, latents_mean=mean, latents_std=inverse_std,
                                                  num_latent_frames_per_chunk=chunk, dtype=torch.float32,
                                                  device=device, generator=generator)
        if options["add_noise_to_video_latents"]:
            # NOTE(noise): the sigmas drawn on the CPU generator (the pipeline's draws there), then moved.
            lo, hi = options["image_noise_sigma_min"], options["image_noise_sigma_max"]
            sigma = (torch.rand(1, generator=generator) * (hi - lo) + lo).to(device)
            first = sigma * randn_tensor(first.shape, generator=generator, device=device) + (1 - sigma) * first
            lo, hi = options["video_noise_sigma_min"], options["video_noise_sigma_max"]
            noised = []
            for part in video.split(chunk, dim=2):
                n = part.shape[2]
                sigmas = (torch.rand(n, generator=generator) * (hi - lo) + lo).to(device).view(1, 1, n, 1, 1)
                noised.append(sigmas * randn_tensor(part.shape, generator=generator, device=device)
                              + (1 - sigmas) * part)
            video = torch.cat(noised, dim=2)
        history = x.history
        frames = history.latents.shape[2]
        # The pipeline's history is the zeros before the video, or the whole video; the frames it splits are its last.
        history.latents = torch.cat([history.latents, video], dim=2)[:, :, -frames:]
        history.first, history.context = first, video.cpu()

    def _latent_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's latent mean and inverse std ``[1, C, 1, 1, 1]``, as the pipeline makes them."""
        vae = self.components.vae
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(self.device, vae.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            self.device, vae.dtype)
        return mean, inverse_std

    def _history_inputs(self, x: _RequestState) -> dict[str, torch.Tensor]:
        """The transformer's history arguments for the chunk at hand, as ``HeliosPipeline`` builds them."""
        history, dtype = x.history, self.transformer.dtype
        chunk = x.request.options["num_latent_frames_per_chunk"]
        sizes = list(history.sizes)
        long, mid, short_1x = history.latents.split(sizes, dim=2)
        # keep_first_frame: the video's first latent frame (zeros before it is made) before the short history.
        prefix = history.first if history.first is not None else torch.zeros_like(short_1x[:, :, :1])
        short = torch.cat([prefix, short_1x], dim=2)
        indices = torch.arange(0, sum([1, *sizes, chunk]))
        i_prefix, i_long, i_mid, i_1x, i_chunk = indices.split([1, *sizes, chunk], dim=0)
        i_short = torch.cat([i_prefix, i_1x], dim=0)
        return dict(indices_hidden_states=i_chunk.unsqueeze(0), indices_latents_history_short=i_short.unsqueeze(0),
                    indices_latents_history_mid=i_mid.unsqueeze(0), indices_latents_history_long=i_long.unsqueeze(0),
                    latents_history_short=short.to(dtype), latents_history_mid=mid.to(dtype),
                    latents_history_long=long.to(dtype))

    def predict(self, latents_local: dict[str, torch.Tensor], t: torch.Tensor, prepared: Prepared,
                plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        x: _RequestState = prepared.state
        latents, plan = latents_local["video"], plans["video"]
        rank, dtype = self.state.cp_rank, x.embeds[0].dtype
        grid = (x.shape.frames, x.shape.height, x.shape.width)
        # The transformer takes the chunk's grid: at N ranks every rank gathers the chunk's latents (C*patch values a
        # token) and the sharded forward cuts the whole sequence, history included, to its shard.
        whole = gather_sequence(latents, plan=plan, group=self.state.cp_group)
        hidden = unpack_patches(whole, grid, self.patch).to(dtype)
        # HeliosPyramidPipeline hands the transformer integer timesteps.
        timestep = t.expand(1) if self.pyramid is None else t.expand(1).to(torch.int64)
        passes = len(x.embeds)
        share = pass_shares(passes, self.state.guidance_size)[self.state.guidance_rank]
        outputs = []
        for p in share:
            kwargs = dict(hidden_states=hidden, timestep=timestep, encoder_hidden_states=x.embeds[p], **x.inputs)
            # The blocks' sequence (history and chunk) is sharded inside the forward: its plan says the real tokens.
            with cached_call(x.cache, self.transformer.blocks, PASS_CONTEXTS[p], None, rank,
                             valid=self._valid_tokens):
                if plan.world == 1:
                    out = self.transformer(**kwargs, attention_kwargs=None, return_dict=False)[0]
                else:
                    out = sharded_forward(self.transformer, self._ctx, **kwargs)
            outputs.append(plan.shard(pack_patches(out, self.patch), rank))
        if x.cache is not None:
            x.cache.end_step()
        if not outputs:  # more guidance ranks than passes: this one runs none, but joins the exchange
            join_call(self.transformer)
            noise_pred = latents.new_empty((0, *latents.shape[1:]), dtype=dtype)
        else:
            noise_pred = torch.cat(outputs)
        noise_pred = gather_passes({"video": noise_pred}, passes=passes, state=self.state)["video"]
        if passes == 2:
            cond, uncond = noise_pred[0:1], noise_pred[1:2]
            if self.pyramid is not None and self.pyramid.cfg_zero_star:
                noise_pred = self._cfg_zero_star(cond, uncond, x, plan)
            else:
                noise_pred = uncond + x.request.guidance_scale * (cond - uncond)
        return {"video": noise_pred}

    def _valid_tokens(self) -> int:
        """This rank's real tokens of the blocks' sequence in flight (every one at 1 rank)."""
        plan = self._ctx.plan
        return sys.maxsize if plan is None else plan.valid_len(self.state.cp_rank)

    def step_cache(self, request: GenerationRequest) -> StepCache | None:
        """A pass's step cache: HeliosPipeline's contexts, ``cond`` and (with CFG) ``uncond``, a pass each."""
        return pass_cache(request, state=self.state, contexts=pass_contexts(step_passes(request)),
                          layers=self.layers)

    def cache_stats(self, prepared: Prepared) -> CacheStats | None:
        """What the step just ended saved (``cp_infer.step_cache.StepCache.step_stats``)."""
        return pass_cache_stats(prepared.state.cache)

    def _cfg_zero_star(self, cond: torch.Tensor, uncond: torch.Tensor, x: _RequestState,
                       plan: ShardPlan) -> torch.Tensor:
        """CFG-Zero* (``pyramid.cfg_zero_star``) on the whole chunk: its scale is a dot product over the whole
        prediction, so every rank gathers both (C*patch values a token) and computes it in the pipeline's layout."""
        grid, group, options = (x.shape.frames, x.shape.height, x.shape.width), self.state.cp_group, x.request.options
        whole = [unpack_patches(gather_sequence(p, plan=plan, group=group), grid, self.patch).contiguous()
                 for p in (cond, uncond)]
        zeroed = options["use_zero_init"] and x.stage == 0 and x.step <= options["zero_steps"]
        out = cfg_zero_star(*whole, x.request.guidance_scale, zeroed=zeroed)
        return plan.shard(pack_patches(out, self.patch), self.state.cp_rank)

    def step(self, noise_pred_local: dict[str, torch.Tensor], t: torch.Tensor,
             latents_local: dict[str, torch.Tensor], prepared: Prepared,
             plans: dict[str, ShardPlan]) -> dict[str, torch.Tensor]:
        x: _RequestState = prepared.state
        if x.start is not None:  # DMD: towards the stage's start latents, cut to this rank's shard
            start = plans["video"].shard(x.start, self.state.cp_rank)
            stepped = dmd_step(x.scheduler, noise_pred_local["video"], t, latents_local["video"], start, x.step,
                               x.generator)
        else:
            stepped = x.scheduler.step(noise_pred_local["video"], t, latents_local["video"], generator=x.generator,
                                       return_dict=False)[0]
        x.step += 1
        return {"video": stepped}

    def finish_pass(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> int | None:
        """The chunk's latents joined to the history, as the pipeline's loop joins them; the decode's latent frames
        now final (:func:`final_frames`): the chunk is decoded and streamed before the next is made."""
        x: _RequestState = prepared.state
        if not self._chunk_done(x):
            return None
        chunk = unpack_patches(latents["video"], (x.shape.frames, x.shape.height, x.shape.width), self.patch)
        history = x.history
        if history.first is None:
            history.first = chunk[:, :, 0:1]
        frames = history.latents.shape[2]
        history.latents = torch.cat([history.latents, chunk], dim=2)[:, :, -frames:]
        history.made.append(chunk.cpu())
        return final_frames(x.request, len(history.made))

    def _chunk_done(self, x: _RequestState) -> bool:
        """Whether the pass just run made the chunk (its last stage, with a pyramid)."""
        return self.pyramid is None or x.stage == self.pyramid.stages - 1

    def checkpoint(self, state: _RequestState) -> dict[str, np.ndarray] | None:
        """The video made so far: every chunk's latents (the decode goes on from the first frame), the history, the
        generator's state (the next chunk's noise is the next draw). ``None`` inside a chunk (a pyramid's stages
        before the last): a job resumes at a chunk's start."""
        if not self._chunk_done(state):
            return None
        history = state.history
        return {"made": torch.cat(history.made, dim=2).float().numpy(), "history": history.latents.cpu().numpy(),
                "first": history.first.cpu().numpy(), "generator": state.generator.get_state().numpy(),
                "chunk": np.array(state.chunk, dtype=np.int64),
                **({} if history.context is None else {"context": history.context.numpy()})}

    def restore(self, request: GenerationRequest, arrays: dict[str, np.ndarray]) -> tuple[_RequestState, int]:
        """The state a checkpoint was taken in (the prompts, and an image, encoded again; the generator's state then
        the checkpoint's), and the decode's latent frames final in it."""
        chunks = chunks_of(request)
        shape = self.geometry.latent_shape(chunks.chunk_frames, request.height, request.width)
        x = self._start(request, shape)
        try:
            chunk = int(arrays["chunk"])
            made = torch.from_numpy(np.array(arrays["made"], dtype=np.float32))
            history = torch.from_numpy(np.array(arrays["history"], dtype=np.float32))
            first = torch.from_numpy(np.array(arrays["first"], dtype=np.float32))
            generator = torch.from_numpy(np.array(arrays["generator"], dtype=np.uint8))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a checkpoint of a Helios video: {exc}") from None
        n = chunks.latent_frames
        if not 0 <= chunk < chunks.count - 1 or made.ndim != 5 or made.shape[2] != (chunk + 1) * n \
                or history.shape != x.history.latents.shape or first.shape != (*history.shape[:2], 1,
                                                                                *history.shape[3:]):
            raise ValueError("the checkpoint is not one of this request's chunks")
        x.generator.set_state(generator)
        x.chunk = chunk
        x.stage = 0 if self.pyramid is None else self.pyramid.stages - 1
        x.history.latents = history.to(self.device)
        x.history.first = first.to(self.device)
        x.history.made = list(made.split(n, dim=2))
        if (x.history.context is not None) != ("context" in arrays) or ("context" in arrays and np.shape(
                arrays["context"]) != tuple(x.history.context.shape)):
            raise ValueError("the checkpoint is not one of this request's chunks (from text, an image or a video)")
        if "context" in arrays:
            x.history.context = torch.from_numpy(np.array(arrays["context"], dtype=np.float32))
        return x, final_frames(request, chunk + 1)

    def output_latents(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> dict[str, np.ndarray]:
        """``output_type="latent"``: the pipeline returns every chunk's latents ``[B, C, F, H, W]`` (after the
        image's still latent frame, or the video's latents)."""
        history = prepared.state.history
        context = [] if history.context is None else [history.context]
        return {"latents": torch.cat([*context, *history.made], dim=2).float().numpy()}

    def decoder(self, latents: dict[str, torch.Tensor], prepared: Prepared) -> Decoder:
        """The pipeline's decode, time-parallel: each chunk decoded alone (a segment of :func:`decode_split`), its
        latents de-normalised and put through ``vae.post_quant_conv`` as ``vae.decode`` puts them, then over the
        decoding group by :class:`~models.common.wan_vae_parallel.WanStreamedDecode` (``vae.decode``'s frames, bit
        for bit) and post-processed; streamed as the chunks are made (``feed``: the state of the chunk just made)."""
        x: _RequestState = prepared.state
        request, vae = x.request, self.components.vae
        split = self.decode_split(request)
        n, m = split.segment.latent_frames, split.segment.video_frames
        mean, inverse_std = self._latent_stats()
        made = {"history": x.history}
        current: list[WanStreamedDecode] = []  # the chunk being decoded (none between chunks)

        def decode_range(a: int, b: int) -> np.ndarray:
            k = a // n
            if not current:
                chunk = made["history"].made[k].to(self.device, dtype=vae.dtype) / inverse_std + mean
                current.append(WanStreamedDecode(vae, vae.post_quant_conv(chunk), split.segment, self.state.decoding))
            frames = video_uint8(self.pipe, current[0](a - k * n, b - k * n))
            if current[0].done:
                current.clear()  # its caches (2 frames of every cached convolution) go before the next chunk is made
            # The video is cut to 4k + 1 frames within the last chunk's last latent frame.
            return frames[:max(0, split.video_frames - k * m - video_index(a - k * n, split.temporal_compression))]

        def feed(state: _RequestState, final: int) -> None:
            made["history"] = state.history

        return Decoder(split=split, frame_shape=(request.height, request.width, 3), decode_range=decode_range,
                       reads=lambda a, b: b, feed=feed)

    def decode_split(self, request: GenerationRequest) -> SegmentedSplit:
        """The decode's pieces: a segment per chunk (each decoded alone, as the pipeline decodes it), each cut over the
        decoding group (``decode_frames_per_rank``, as Wan's decode); the chunks whose frames the video keeps."""
        chunks = chunks_of(request)
        segment = decode_split(self.components.vae, chunks.latent_frames, setting=self.decode_frames_per_rank,
                               world=self.state.decoding.cp_size, height=request.height, width=request.width,
                               temporal_compression=HELIOS_TEMPORAL_COMPRESSION)
        count = -(-request.num_frames // chunks.chunk_frames)
        return SegmentedSplit(segment, count, request.num_frames)


def _check_scheduler(scheduler, pyramid: Pyramid | None) -> None:
    """Refuse a schedule the chunk loop does not run (each rank steps its shard alone)."""
    config = scheduler.config
    if config.get("thresholding", False):
        raise ValueError("a thresholding scheduler clips each step by a quantile of the whole sample, which a shard "
                         "does not hold; set thresholding=false in scheduler/scheduler_config.json")
    kind = config.get("scheduler_type", "unipc")
    if pyramid is None and (config.get("stages", 1) != 1 or kind not in ("unipc", "euler")):
        raise ValueError(f"scheduler/scheduler_config.json has stages={config.get('stages')}, scheduler_type={kind!r}: "
                         "HeliosPipeline runs a one-stage schedule (stages=1, unipc or euler); a pyramid's scheduler "
                         "goes with HeliosPyramidPipeline (model_index.json)")
    if pyramid is not None and type(scheduler).__name__ == "HeliosScheduler" and kind not in ("unipc", "euler"):
        raise ValueError(f"scheduler/scheduler_config.json: HeliosScheduler with scheduler_type={kind!r} does not "
                         "step (diffusers 0.42); use unipc or euler, or HeliosDMDScheduler for a distilled model")
