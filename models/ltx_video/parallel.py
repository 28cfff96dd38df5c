"""LTX-Video's parallel plan: sequence parallelism applied to diffusers' ``LTXVideoTransformer3DModel`` from outside
(:func:`parallelize_ltx_transformer`), the model maths untouched.

- every self-attention (``attn1``) gets a processor that runs the projections, QK-norm and RoPE on the local shard
  and the attention itself through :func:`cp_infer.ulysses_attention`;
- the RoPE module is handed the coordinates of this rank's tokens (:func:`_local_video_coords`) and computes
  (cos, sin) for those tokens only;
- cross-attention (``attn2``) keeps the text's keys and values through a request (:class:`_TextKVProcessor`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_ltx import LTXAttention, apply_rotary_emb

from cp_infer import ParallelState, ShardPlan, ulysses_attention
from cp_infer.step_cache import cache_blocks
from models.common.text_kv import KeptPerText, keep_per_text, kept_text_attention

__all__ = ["parallelize_ltx_transformer"]


@dataclass
class _ShardContext:
    """The plan of the forward pass in flight. Owned by one model; set only inside ``LTXVideoModel.sharded``."""

    state: ParallelState
    plan: ShardPlan | None = None


class _UlyssesSelfAttnProcessor:
    """LTX self-attention with the attention itself sequence-parallel (see module docstring)."""

    def __init__(self, ctx: _ShardContext):
        self.ctx = ctx

    def __call__(self, attn: LTXAttention, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, image_rotary_emb=None) -> torch.Tensor:
        plan = self.ctx.plan
        if plan is None:
            raise RuntimeError("the parallel LTX transformer was called outside LTXVideoModel.sharded()")
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the Ulysses processor serves self-attention only (no encoder states, no mask)")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # B, S_LOCAL, H*D -> B, S_LOCAL, H, D

        def rotated(linear: torch.nn.Module, norm: torch.nn.Module) -> torch.Tensor:  # q, k: QK-norm and RoPE
            x = norm(linear(hidden_states))
            return heads(x if image_rotary_emb is None else apply_rotary_emb(x, image_rotary_emb))

        # Producers, not tensors: q, k and v are computed one at a time as the exchange packs them.
        # NOTE(memory): no ExchangeWorkspace. Kept exchange buffers (twice the packed q/k/v) would stay allocated
        # through the feed-forward, where activations peak: +40% peak activation memory per rank at 4k tokens.
        # Fresh ones page-fault once they exceed glibc's mmap threshold (32 MiB): measured at 4k tokens on 2 ranks,
        # no step-time difference within noise (interleaved A/B, fresh / kept = 1.00).
        out = ulysses_attention(lambda: rotated(attn.to_q, attn.norm_q), lambda: rotated(attn.to_k, attn.norm_k),
                                lambda: heads(attn.to_v(hidden_states)), plan=plan,
                                group=self.ctx.state.attention_group, ring=self.ctx.state.ring)
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3)))


class _TextKVProcessor:
    """LTX cross-attention (diffusers' ``LTXVideoAttnProcessor``, the same ops in the same order) with the text's
    keys and values (``norm_k(to_k(text))``, ``to_v(text)``: the projected prompt alone) kept through a request
    (``models.common.text_kv.KeptPerText``).

    NOTE(text-kv): at 2 ranks these projections of 2 x 128 text tokens in every block were 27% of a step at 32
    tokens and 5% at 512."""

    def __init__(self):
        self._kv = KeptPerText()

    def __call__(self, attn: LTXAttention, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, image_rotary_emb=None) -> torch.Tensor:
        if encoder_hidden_states is None or image_rotary_emb is not None:
            raise ValueError("the text processor serves cross-attention only (encoder states, no RoPE)")
        out = kept_text_attention(attn, hidden_states, encoder_hidden_states, attention_mask, self._kv)
        return attn.to_out[1](attn.to_out[0](out))


def parallelize_ltx_transformer(transformer: torch.nn.Module, ctx: _ShardContext) -> None:
    """Apply sequence parallelism to a diffusers ``LTXVideoTransformer3DModel`` in place (and keep the text's
    cross-attention keys and values through a request: :class:`_TextKVProcessor`; iterate its blocks through a step
    cache: ``cp_infer.step_cache.cache_blocks``)."""
    cache_blocks(transformer, streams=("hidden_states",))
    for block in transformer.transformer_blocks:
        block.attn1.set_processor(_UlyssesSelfAttnProcessor(ctx))
        block.attn2.set_processor(_TextKVProcessor())
    keep_per_text(transformer.caption_projection)

    rope = transformer.rope
    signature = inspect.signature(rope.forward)

    def local_rope(_module, args, kwargs):
        plan = ctx.plan
        if plan is None or plan.world == 1:
            return None  # one rank: diffusers' own (cos, sin) over the whole grid, bit for bit
        call = signature.bind(*args, **kwargs)
        call.arguments["video_coords"] = _local_video_coords(rope, call.arguments, plan, ctx.state.cp_rank)
        return call.args, call.kwargs

    rope.register_forward_pre_hook(local_rope, with_kwargs=True)


def _local_video_coords(rope: torch.nn.Module, arguments: dict, plan: ShardPlan, rank: int) -> torch.Tensor:
    """``[B, 3, S_LOCAL]`` RoPE coordinates of ``rank``'s tokens (``video_coords`` of ``LTXVideoRotaryPosEmbed``).

    Without ``video_coords`` the module builds the coordinates of the whole grid as ``index * scale * patch /
    base``; given them it computes ``video_coords / base``. These are ``index * scale * patch`` for this rank's
    token range only, the same float32 operations in the same order, so every token gets the same (cos, sin) as
    from the whole grid (up to SIMD vs scalar ``cos``/``sin`` on different lanes: an ulp). Batch 1: the rotation is
    the same for every sample and broadcasts. Padding tokens continue the grid past its end (finite, discarded).
    """
    coords = arguments.get("video_coords")
    if coords is not None:
        # B, 3, S -> B, 3, S_LOCAL (the caller's own coordinates, cut like the latents)
        return plan.shard(coords, rank, dim=2)
    scale = arguments.get("rope_interpolation_scale")
    if scale is None:
        raise ValueError("the parallel LTX transformer needs rope_interpolation_scale (LTXPipeline always passes it)")
    height, width = arguments["height"], arguments["width"]
    token = torch.arange(rank * plan.local_len, (rank + 1) * plan.local_len,
                         device=arguments["hidden_states"].device)
    # S_LOCAL -> 1, 3, S_LOCAL: (frame, row, column) of each token, as the grid's meshgrid(f, h, w) flattens
    coords = torch.stack([token // (height * width), token // width % height, token % width]).to(torch.float32)[None]
    for axis, patch in enumerate((rope.patch_size_t, rope.patch_size, rope.patch_size)):
        coords[:, axis] = coords[:, axis] * scale[axis] * patch
    return coords
