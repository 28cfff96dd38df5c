"""Diffusers' own context parallelism (``enable_parallelism``, Ulysses) made to run on CPU/gloo, for the benchmark.

diffusers 0.42 ships context parallelism for accelerators only. Two patches are needed, and only two, for an
``LTXVideoTransformer3DModel`` under ``LTXPipeline`` on CPU with gloo, a third under ``LTXConditionPipeline`` and a
fourth for ``LTX2VideoTransformer3DModel``; all are applied from here, nothing in diffusers is edited:

1. ``ModelMixin._resolve_parallel_config`` picks the device as
   ``torch.device(accelerator_type, rank % torch.accelerator.device_count())``; on a CPU-only torch the count is
   0 and this raises ``ZeroDivisionError``. ``torch.accelerator.device_count`` is patched to return 1 for the
   duration of the ``enable_parallelism`` call only, which gives ``cpu:0`` (the accelerator type on CPU-only torch
   is ``cpu``, so the mesh is ``init_device_mesh("cpu", (1, degree))`` over gloo). The recorded device is not used
   by the Ulysses path.
2. ``TemplatedUlyssesAttention`` all-to-alls q/k/v from ``H`` heads to ``H / N`` local heads but passes the
   attention mask on unchanged. ``LTXVideoAttnProcessor`` expands the cross-attention (text padding) mask to
   ``[B, H, 1, S_KV]`` with all ``H`` heads, so SDPA fails to broadcast it against ``H / N`` query heads ("The size
   of tensor a (8) must match the size of tensor b (16)"). ``attention_dispatch._native_attention_forward_op`` is
   wrapped (process-wide, it is only reached on the context-parallel path) to narrow a per-head mask to this
   rank's heads, ``[r * H / N, (r + 1) * H / N)``, which are the heads the all-to-all delivered to rank ``r``.
3. ``LTXConditionPipeline`` only: it passes a per-token timestep ``[B, S]`` (``min(t, (1 - conditioning_mask) *
   1000)``), which the shipped ``_cp_plan`` does not split, so ``time_embed`` gives a ``[B, S, D]`` modulation against
   ``[B, S / N, D]`` hidden states and the first block fails to broadcast them. ``per_token_timestep=True`` adds
   ``timestep`` to the plan's root entry on the transformer instance, split on dim 1 like ``hidden_states``
   (``expected_dims=2``: ``LTXPipeline``'s ``[B]`` timestep is left whole, diffusers logs that once).
4. LTX-2 only (:class:`DiffusersLTX2Runner`): the shipped ``_cp_plan`` splits the video tokens and the
   self-attention RoPE (``rope``) but not the cross-modal one (``cross_attn_rope``), so audio-to-video attention
   fails ("The size of tensor a (S/N) must match the size of tensor b (S)"); ``cross_attn_rope``, split like
   ``rope``, is added on the transformer instance. Audio is not in the plan: every rank holds the whole audio stream
   and Ulysses all-to-alls it anyway, so each audio attention runs over N copies of every audio key (exact, as
   duplicated keys leave softmax unchanged; N x the work).

Everything else is diffusers' code path as shipped: the ``_cp_plan`` hooks split the latents, the text states,
the text mask and the RoPE tables over the ranks and all-gather the output of ``proj_out`` on every step; both
self- and cross-attention go through ``funcol.all_to_all_single`` (one per q, k, v and one for the output).
Sequence lengths (latent and text tokens) must divide the degree (``EquipartitionSharder`` asserts it); with
conditions that is the video's tokens plus the conditioning tokens placed before them.

:class:`DiffusersRunner` runs ``LTXPipeline.__call__`` (and, with conditions, ``LTXConditionPipeline.__call__``)
itself, as shipped, recording per-step times from the step's start (the condition pipeline's per-step re-noise of
the conditioned tokens, else the transformer's forward pre-hook) to ``callback_on_step_end``, and the time from the
call to the first step's start (text encode, media preprocessing and encode, latents, schedule). Timing wraps the
re-noise on the pipeline instance and calls it unchanged. :class:`DiffusersLTX2Runner` does the same for
``LTX2Pipeline.__call__`` (every rank runs the whole pipeline, decode included), a step from the first of its
transformer passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any
from unittest import mock

import numpy as np
import torch

__all__ = ["DiffusersLTX2Runner", "DiffusersRunner", "DiffusersWanRunner", "enable_diffusers_context_parallel"]


def _narrow_mask_to_local_heads(forward_op: Any) -> Any:
    """Wrap diffusers' native SDPA forward op so a ``[B, H, S_Q, S_KV]`` mask follows the heads to their rank."""

    def forward_op_local_heads(ctx, query, key, value, attn_mask=None, *args, _parallel_config=None, **kwargs):
        # query: B, S, H_LOCAL, D (after the all-to-all); a per-head mask still has all H heads on dim 1.
        heads_local = query.shape[2]
        if attn_mask is not None and attn_mask.ndim == 4 and attn_mask.shape[1] not in (1, heads_local):
            rank = _parallel_config.context_parallel_config._ulysses_local_rank
            attn_mask = attn_mask.narrow(1, rank * heads_local, heads_local)
        return forward_op(ctx, query, key, value, attn_mask, *args, _parallel_config=_parallel_config, **kwargs)

    forward_op_local_heads.__wrapped__ = forward_op
    return forward_op_local_heads


def enable_diffusers_context_parallel(transformer: torch.nn.Module, *, ulysses_degree: int,
                                      per_token_timestep: bool = False) -> None:
    """``transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=...))`` on CPU/gloo.

    Needs the default process group initialised (gloo) with ``ulysses_degree`` ranks. ``per_token_timestep``: also
    split a ``[B, S]`` timestep with the tokens (patch 3, for ``LTXConditionPipeline``).
    """
    from diffusers import ContextParallelConfig
    from diffusers.models import attention_dispatch
    from diffusers.models._modeling_parallel import ContextParallelInput

    if per_token_timestep:
        plan = type(transformer)._cp_plan
        timestep = ContextParallelInput(split_dim=1, expected_dims=2, split_output=False)  # B, S -> B, S / N
        transformer._cp_plan = {**plan, "": {**plan[""], "timestep": timestep}}

    op = attention_dispatch._native_attention_forward_op
    if not hasattr(op, "__wrapped__"):  # idempotent: wrap once per process
        attention_dispatch._native_attention_forward_op = _narrow_mask_to_local_heads(op)
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses_degree))


class DiffusersRunner:
    """diffusers' own ``LTXPipeline`` over the given components, context-parallel over ``ranks`` when > 1; with
    ``conditioned``, also ``LTXConditionPipeline`` over the same modules, for requests with ``conditions``."""

    def __init__(self, components: dict[str, Any], *, ranks: int, conditioned: bool = False) -> None:
        from diffusers import LTXConditionPipeline, LTXPipeline

        self.pipe = LTXPipeline(**components)
        self.cond_pipe = LTXConditionPipeline(**components) if conditioned else None
        for pipe in (self.pipe, self.cond_pipe):
            if pipe is not None:
                pipe.set_progress_bar_config(disable=True)
        if ranks > 1:
            enable_diffusers_context_parallel(self.pipe.transformer, ulysses_degree=ranks,
                                              per_token_timestep=conditioned)
        self._step_start: float | None = None
        self.pipe.transformer.register_forward_pre_hook(lambda _m, _a: self._mark_step_start())
        if self.cond_pipe is not None:
            renoise = self.cond_pipe.add_noise_to_image_conditioning_latents

            def timed_renoise(*args: Any, **kwargs: Any) -> torch.Tensor:
                self._mark_step_start()  # the condition pipeline's step begins with it, before the transformer
                return renoise(*args, **kwargs)

            self.cond_pipe.add_noise_to_image_conditioning_latents = timed_renoise

    def _mark_step_start(self) -> None:
        if self._step_start is None:
            self._step_start = time.perf_counter()

    def __call__(self, request: Any, on_last_step: Callable[[], None]) -> dict[str, Any]:
        """Generate ``request`` (a resolved ``GenerationRequest``); returns uint8 frames, the final packed latents
        (conditioning tokens included, as ours keeps them), step times and the time before the first step."""
        record: dict[str, Any] = {"steps": []}
        called = time.perf_counter()
        self._step_start = None

        def on_step_end(_pipe, i: int, _t, kwargs: dict[str, Any]) -> dict[str, Any]:
            if i == 0:
                record["before_first_step_s"] = self._step_start - called
            record["steps"].append(time.perf_counter() - self._step_start)
            self._step_start = None
            if i == request.num_inference_steps - 1:
                on_last_step()
                # B, S, C: proj_out's gather hook gave every rank the whole sequence before the scheduler step.
                record["latents"] = kwargs["latents"].numpy().copy()
            return {}

        o = request.options
        common = dict(
            prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
            height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale, frame_rate=request.fps,
            generator=torch.Generator("cpu").manual_seed(request.seed), decode_timestep=o["decode_timestep"],
            decode_noise_scale=o["decode_noise_scale"], max_sequence_length=o["max_sequence_length"],
            output_type="np", callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"],
        )
        if request.conditions:
            video = self.cond_pipe(conditions=_diffusers_conditions(request),
                                   image_cond_noise_scale=o["image_cond_noise_scale"], **common).frames[0]
        else:
            video = self.pipe(**common).frames[0]
        # The same float -> uint8 conversion as models.ltx_video.adapter.LTXVideoModel.decode.
        record["frames"] = (np.clip(video, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        return record


class DiffusersLTX2Runner:
    """``LTX2Pipeline.__call__`` as shipped over the given components, with ``guidance`` (its guidance keyword
    arguments); context-parallel over ``ranks`` when > 1 (patch 4). A call returns uint8 frames, the waveform, the
    final packed latents (video, audio) and the step times."""

    def __init__(self, components: dict[str, Any], *, ranks: int, guidance: dict[str, float]) -> None:
        from diffusers import LTX2Pipeline
        from diffusers.models._modeling_parallel import ContextParallelInput

        self.pipe = pipe = LTX2Pipeline(**components)
        self.guidance = dict(guidance)
        pipe.set_progress_bar_config(disable=True)
        t = pipe.transformer
        if ranks > 1:
            # NOTE(cp-plan): the one plan change: split the cross-modal video RoPE like the self-attention one.
            split = {i: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True) for i in (0, 1)}
            t._cp_plan = {**type(t)._cp_plan, "cross_attn_rope": split}
            enable_diffusers_context_parallel(t, ulysses_degree=ranks)
        self._start: float | None = None
        self.record: dict[str, Any] = {}
        t.register_forward_pre_hook(self._on_pass)
        denormalize = pipe._denormalize_audio_latents  # the final packed audio latents pass through here once

        def recording_denormalize(latents, *args, **kwargs):
            self.record["latents"]["audio"] = latents.numpy().copy()
            return denormalize(latents, *args, **kwargs)

        pipe._denormalize_audio_latents = recording_denormalize

    def _on_pass(self, _module, _args) -> None:
        if self._start is None:  # the first of the step's transformer passes starts the step
            self._start = time.perf_counter()

    def __call__(self, request: Any, on_last_step: Callable[[], None]) -> dict[str, Any]:
        self.record = record = {"steps": [], "latents": {}}

        def on_step_end(_pipe, i: int, _t, kwargs: dict[str, Any]) -> dict[str, Any]:
            record["steps"].append(time.perf_counter() - self._start)
            self._start = None
            if i == request.num_inference_steps - 1:
                on_last_step()
                record["latents"]["video"] = kwargs["latents"].numpy().copy()  # B, S, C: gathered by proj_out's hook
            return {}

        out = self.pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                        height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                        frame_rate=request.fps,
                        spatio_temporal_guidance_blocks=list(request.options["spatio_temporal_guidance_blocks"]),
                        max_sequence_length=request.options["max_sequence_length"], output_type="np",
                        generator=torch.Generator("cpu").manual_seed(request.seed), callback_on_step_end=on_step_end,
                        **self.guidance)
        record["frames"] = (np.clip(out.frames[0], 0.0, 1.0) * 255.0).round().astype(np.uint8)
        record["waveform"] = out.audio[0].float().numpy()
        return record


class DiffusersWanRunner:
    """``WanPipeline.__call__`` as shipped over ``WanComponents`` (Wan 2.1 text-to-video), context-parallel over
    ``ranks`` when > 1 with the shipped ``WanTransformer3DModel._cp_plan`` (RoPE tables and the video tokens split,
    the text left whole, ``proj_out`` gathered) and only patch 1 (Wan's attention takes no mask, so patch 2 never
    acts). ``ulysses_anything`` (uneven token counts) is on where the tokens do not divide ``ranks``. A call returns
    uint8 frames, the final ``[B, C, F, H, W]`` latents and the step times (a step from the conditional pass's start,
    WanPipeline's two guidance passes and its scheduler step)."""

    def __init__(self, components: Any, *, ranks: int, tokens: int | None = None) -> None:
        from diffusers import ContextParallelConfig, WanPipeline

        c = components
        self.pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                                transformer=c.transformer)
        self.pipe.set_progress_bar_config(disable=True)
        if ranks > 1:
            uneven = tokens is not None and tokens % ranks != 0
            with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
                c.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ranks,
                                                                             ulysses_anything=uneven))
        self._start: float | None = None
        c.transformer.register_forward_pre_hook(self._on_pass)

    def _on_pass(self, _module, _args) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def __call__(self, request: Any, on_last_step: Callable[[], None]) -> dict[str, Any]:
        record: dict[str, Any] = {"steps": []}
        self._start = None

        def on_step_end(_pipe, i: int, _t, kwargs: dict[str, Any]) -> dict[str, Any]:
            record["steps"].append(time.perf_counter() - self._start)
            self._start = None
            if i == request.num_inference_steps - 1:
                on_last_step()
                record["latents"] = kwargs["latents"].numpy().copy()  # B, C, F, H, W: gathered by proj_out's hook
            return {}

        video = self.pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, height=request.height,
                          width=request.width, num_frames=request.num_frames,
                          num_inference_steps=request.num_inference_steps, guidance_scale=request.guidance_scale,
                          generator=torch.Generator("cpu").manual_seed(request.seed),
                          max_sequence_length=request.options["max_sequence_length"], output_type="np",
                          callback_on_step_end=on_step_end, callback_on_step_end_tensor_inputs=["latents"]).frames[0]
        record["frames"] = (np.clip(video, 0.0, 1.0) * 255.0).round().astype(np.uint8)
        return record


def _diffusers_conditions(request: Any) -> list[Any]:
    """``request.conditions`` (images only) as ``LTXVideoCondition``s, frame indices counted from the start as
    ``LTXConditionPipeline`` takes them."""
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition
    from PIL import Image

    from cp_infer.request import resolve_frame_index

    out = []
    for cond in request.conditions:
        if not cond.is_image:
            raise ValueError("the benchmark's diffusers runner takes image conditions only")
        out.append(LTXVideoCondition(image=Image.fromarray(cond.frames[0], mode="RGB"), strength=cond.strength,
                                     frame_index=resolve_frame_index(cond.frame_index, request.num_frames)))
    return out
