"""How parallelism is applied to diffusers' ``WanTransformer3DModel`` (the model maths stays diffusers'; the adapter,
``models.wan.adapter``, runs it):

- the video latents travel as tokens ``[B, S, C*pt*ph*pw]``: one per transformer patch, in the transformer's own
  (frame, row, column) order, each holding its patch's values in the patch embedding's ``(C, pt, ph, pw)`` order
  (:func:`pack_patches`). The engine shards them like any sequence. A rank hands the transformer its tokens as a grid
  of ``S_LOCAL x 1 x 1`` patches (:func:`unpack_patches`), so diffusers' forward (patch embedding, condition
  embedding, blocks, output norm and projection, unpatchify) runs unchanged on the local tokens;
- every self-attention (``attn1``) gets a processor that runs the projections, QK-norm and RoPE on the local shard
  and the attention through :func:`cp_infer.ulysses_attention` (which trims the keys to the real tokens: padding is
  never attended; heads that do not divide the ranks are padded there);
- the RoPE module returns the (cos, sin) rows of this rank's tokens only, gathered from its own frequency tables
  (:func:`local_rope`: the same values as the whole grid's rows, no arithmetic), never the whole grid's; on one rank
  it runs unchanged;
- cross-attention (``attn2``) needs no communication: its queries are local, the text (and image) tokens
  replicated. The text's and image's keys and values depend on the request alone, so they are projected once per
  request and block (:class:`_CrossAttnProcessor`, diffusers' ``WanAttnProcessor`` with the same ops in the same
  order), as are the text and image embedders' outputs and their join.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

from cp_infer import ParallelState, ShardPlan, ulysses_attention
from cp_infer.step_cache import cache_blocks
from models.common.text_kv import KeptPerText, keep_per_text

__all__ = ["WanShardContext", "local_rope", "pack_patches", "parallelize_wan_transformer", "unpack_patches"]


def pack_patches(x: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``[B, C, F, H, W] -> [B, S, C*pt*ph*pw]``: a token per patch, in the transformer's token order."""
    b, c, f, h, w = x.shape
    pt, ph, pw = patch
    # B, C, F', pt, H', ph, W', pw -> B, F', H', W', C, pt, ph, pw
    x = x.view(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpack_patches(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """``[B, S, C*pt*ph*pw] -> [B, C, F, H, W]`` for a token grid of ``F' x H' x W'`` patches (inverse of
    :func:`pack_patches`); the grid ``(S, 1, 1)`` lays any run of tokens out as one column of patches."""
    gf, gh, gw = grid
    pt, ph, pw = patch
    # B, F', H', W', C, pt, ph, pw -> B, C, F', pt, H', ph, W', pw
    x = tokens.view(tokens.shape[0], gf, gh, gw, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(tokens.shape[0], -1, gf * pt, gh * ph, gw * pw)


@dataclass
class WanShardContext:
    """The forward pass in flight: its plan and the video's token grid. Set only inside ``WanModel.sharded``."""

    state: ParallelState
    plan: ShardPlan | None = None
    grid: tuple[int, int, int] | None = None


def _apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """``WanAttnProcessor``'s rotation (diffusers defines it inside the processor's call), the same ops."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


class _UlyssesSelfAttnProcessor:
    """Wan self-attention with the attention itself sequence-parallel (see the module docstring)."""

    def __init__(self, ctx: WanShardContext):
        self.ctx = ctx

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None) -> torch.Tensor:
        plan = self.ctx.plan
        if plan is None:
            raise RuntimeError("the parallel Wan transformer was called outside WanModel.sharded()")
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the Ulysses processor serves self-attention only (no encoder states, no mask)")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # B, S_LOCAL, H*D -> B, S_LOCAL, H, D

        def rotated(linear: torch.nn.Module, norm: torch.nn.Module) -> torch.Tensor:  # q, k: QK-norm and RoPE
            x = heads(norm(linear(hidden_states)))
            return x if rotary_emb is None else _apply_rotary_emb(x, *rotary_emb)

        # Producers: q, k and v are computed one at a time as the exchange packs them (models.ltx_video.adapter's
        # NOTE(memory) holds here too).
        out = ulysses_attention(lambda: rotated(attn.to_q, attn.norm_q), lambda: rotated(attn.to_k, attn.norm_k),
                                lambda: heads(attn.to_v(hidden_states)), plan=plan,
                                group=self.ctx.state.attention_group, ring=self.ctx.state.ring)
        # B, S_LOCAL, H, D -> B, S_LOCAL, H*D
        out = out.flatten(2, 3).type_as(hidden_states)
        return attn.to_out[1](attn.to_out[0](out))


class _CrossAttnProcessor:
    """Wan cross-attention (diffusers' ``WanAttnProcessor`` on encoder states: the same ops in the same order) with
    the keys and values of the text (``norm_k(to_k(text))``, ``to_v(text)``) and of the image tokens
    (``norm_added_k(add_k_proj(image))``, ``add_v_proj(image)``) kept through a request (``models.common.text_kv``)."""

    def __init__(self):
        self._kv = KeptPerText()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None) -> torch.Tensor:
        if encoder_hidden_states is None or rotary_emb is not None:
            raise ValueError("the cross-attention processor serves cross-attention only (encoder states, no RoPE)")
        image = None
        text = encoder_hidden_states
        if attn.add_k_proj is not None:
            # diffusers' WanAttnProcessor: the context is [image tokens, the last 512 (text)].
            image_tokens = encoder_hidden_states.shape[1] - 512
            image, text = encoder_hidden_states[:, :image_tokens], encoder_hidden_states[:, image_tokens:]

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # B, L, H*D -> B, L, H, D

        query = heads(attn.norm_q(attn.to_q(hidden_states)))
        key, value = self._kv.get(text, lambda: (heads(attn.norm_k(attn.to_k(text))), heads(attn.to_v(text))))
        out_image = None
        if image is not None:
            key_image, value_image = self._kv.get(image, lambda: (heads(attn.norm_added_k(attn.add_k_proj(image))),
                                                                  heads(attn.add_v_proj(image))))
            out_image = dispatch_attention_fn(query, key_image, value_image, attn_mask=None, dropout_p=0.0,
                                              is_causal=False)
            out_image = out_image.flatten(2, 3).type_as(query)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.flatten(2, 3).type_as(query)
        if out_image is not None:
            out = out + out_image
        return attn.to_out[1](attn.to_out[0](out))


def local_rope(rope: torch.nn.Module, grid: tuple[int, int, int], plan: ShardPlan, rank: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``WanRotaryPosEmbed``'s ``(cos, sin)``, each ``[1, S_LOCAL, 1, D]``, for ``rank``'s tokens of a ``grid`` of
    ``F' x H' x W'`` patches: each token's frame, row and column rows of the module's own tables, concatenated as its
    forward concatenates them for the whole grid (the same values: no arithmetic). Padding tokens repeat the last
    real token's rows (finite, discarded)."""
    frames, height, width = grid
    token = torch.arange(rank * plan.local_len, (rank + 1) * plan.local_len, device=rope.freqs_cos.device)
    token = token.clamp(max=plan.orig_len - 1)
    index = (token // (height * width), token // width % height, token % width)
    dims = [rope.t_dim, rope.h_dim, rope.w_dim]
    out = []
    for table in (rope.freqs_cos, rope.freqs_sin):
        parts = [part[i] for part, i in zip(table.split(dims, dim=1), index, strict=True)]
        # S_LOCAL, D -> 1, S_LOCAL, 1, D
        out.append(torch.cat(parts, dim=-1)[None, :, None, :])
    return out[0], out[1]


def parallelize_wan_transformer(transformer: torch.nn.Module, ctx: WanShardContext) -> None:
    """Apply sequence parallelism to a diffusers ``WanTransformer3DModel`` in place, and keep what depends on the
    request alone (the text and image embedders' outputs, every block's text and image keys and values) through a
    request; give its blocks a step cache's list (``cp_infer.step_cache.cache_blocks``)."""
    for block in transformer.blocks:
        block.attn1.set_processor(_UlyssesSelfAttnProcessor(ctx))
        block.attn2.set_processor(_CrossAttnProcessor())
    cache_blocks(transformer, streams=("hidden_states",), name="blocks")  # a step cache's (its stream first)
    embedder = transformer.condition_embedder
    keep_per_text(embedder.text_embedder)
    if embedder.image_embedder is not None:
        keep_per_text(embedder.image_embedder)
        kept = KeptPerText()

        def joined_context(_module, _args, output):
            # The forward joins [image tokens, text] at every step; joined here once per request (the same concat)
            # and handed on with no image, so that the blocks get the same tensor at every step and keep its keys.
            temb, timestep_proj, text, image = output
            if image is None:
                return None
            return temb, timestep_proj, kept.get(text, lambda: torch.concat([image, text], dim=1)), None

        embedder.register_forward_hook(joined_context)

    rope, whole_grid = transformer.rope, transformer.rope.forward

    def rope_forward(hidden_states: torch.Tensor):
        plan = ctx.plan
        if plan is None or plan.world == 1:
            return whole_grid(hidden_states)  # one rank: diffusers' own tables over the video's grid, bit for bit
        return local_rope(rope, ctx.grid, plan, ctx.state.cp_rank)

    rope.forward = rope_forward
