"""How parallelism is applied to diffusers' ``HeliosTransformer3DModel`` (the model maths stays diffusers').

The self-attention sequence of a chunk is ``[long history, mid history, short history, chunk]`` (the forward's
concatenation order): the history tokens are part of every self-attention, so they are sharded with the chunk's, as
one sequence of ``S = S_HIST + S_CHUNK`` tokens over one ``ShardPlan`` (:class:`HeliosShardContext`). At N ranks:

- :func:`sharded_forward` runs the forward's own embedding code (patch embeddings of the chunk and of the three
  histories, their rotary tables) on the whole sequence, on every rank alike (a few convolutions, small against the
  blocks), and cuts them to the rank's shard; the per-token timestep embeddings (timestep 0's for the history) are
  made for the shard's tokens alone, the same rows the forward expands over the whole sequence;
- the blocks run diffusers' code on the shard unchanged: norms, modulation and the feed-forward are per token; the
  block's cross-attention takes the tokens after the history, which on a shard are the rank's chunk tokens, because the
  block is handed ``original_context_length = S_LOCAL - (the rank's history tokens)``;
- every self-attention (``attn1``) gets a processor that runs the projections, QK-norm, RoPE and the history keys'
  amplification (``is_amplify_history``: the keys of tokens before ``S_HIST``) on the shard and the attention through
  :func:`cp_infer.ulysses_attention` (padding never attended; heads that do not divide the ranks padded there);
- the output norm and projection run on the rank's chunk tokens; one all-gather of their outputs (``C * patch``
  values per token, small against the attention's exchanges) gives every rank the chunk's prediction, which the
  adapter cuts to the engine's shard;
- what depends on the prompt alone is kept through a request (``models.common.text_kv``), at any number of ranks:
  the text embedder's output and every cross-attention's (``attn2``) text keys and values, which the forward
  recomputes at every step of every chunk over the whole text (512 tokens, on every rank: at a chunk of a few hundred
  tokens, as much work as the blocks' own projections); the values are those diffusers' call makes.

At one rank the self-attention processor is diffusers' own and the adapter calls the transformer's forward: the
pipeline's call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.transformers.transformer_helios import (
    HeliosAttnProcessor,
    apply_rotary_emb_transposed,
    center_down_sample_3d,
    pad_for_3d_conv,
)

from cp_infer import ParallelState, ShardPlan, gather_sequence, ulysses_attention
from cp_infer.step_cache import cache_blocks
from models.common.text_kv import KeptPerText, keep_per_text, kept_text_attention

__all__ = ["HeliosShardContext", "parallelize_helios_transformer", "sharded_forward"]


@dataclass
class HeliosShardContext:
    """The forward pass in flight at N ranks: the plan of its whole sequence and how many of its first tokens are
    history. ``plan`` is ``None`` outside :func:`sharded_forward` (the 1-rank path: diffusers' processors)."""

    state: ParallelState
    plan: ShardPlan | None = None
    history: int = 0

    def local_history(self) -> int:
        """History tokens among this rank's shard (they come first in it)."""
        return max(0, min(self.plan.local_len, self.history - self.state.cp_rank * self.plan.local_len))


class _UlyssesSelfAttnProcessor:
    """Helios self-attention with the attention itself sequence-parallel (see the module docstring); diffusers'
    ``HeliosAttnProcessor`` where no plan is set."""

    def __init__(self, ctx: HeliosShardContext):
        self.ctx = ctx
        self.reference = HeliosAttnProcessor()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, original_context_length=None) -> torch.Tensor:
        ctx = self.ctx
        if ctx.plan is None:
            return self.reference(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                                  original_context_length)
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("the Ulysses processor serves self-attention only (no encoder states, no mask)")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))  # B, S_LOCAL, H*D -> B, S_LOCAL, H, D

        def rotated(linear: torch.nn.Module, norm: torch.nn.Module) -> torch.Tensor:
            x = heads(norm(linear(hidden_states)))
            return x if rotary_emb is None else apply_rotary_emb_transposed(x, rotary_emb)

        def keys() -> torch.Tensor:
            key = rotated(attn.to_k, attn.norm_k)
            history = ctx.local_history()
            if attn.is_amplify_history and ctx.history > 0 and history > 0:
                # HeliosAttnProcessor: the keys of the tokens before the chunk's, scaled (the same ops per token).
                scale = 1.0 + torch.sigmoid(attn.history_key_scale) * (attn.max_scale - 1.0)
                if attn.history_scale_mode == "per_head":
                    scale = scale.view(1, 1, -1, 1)
                key = torch.cat([key[:, :history] * scale, key[:, history:]], dim=1)
            return key

        out = ulysses_attention(lambda: rotated(attn.to_q, attn.norm_q), keys,
                                lambda: heads(attn.to_v(hidden_states)), plan=ctx.plan,
                                group=ctx.state.attention_group, ring=ctx.state.ring)
        out = out.flatten(2, 3).type_as(hidden_states)  # B, S_LOCAL, H, D -> B, S_LOCAL, H*D
        return attn.to_out[1](attn.to_out[0](out))


class _CrossAttnProcessor:
    """Helios cross-attention (diffusers' ``HeliosAttnProcessor`` on encoder states: the same ops as the LTX
    processors', with no mask) with the text's keys and values kept through a request."""

    def __init__(self):
        self._kv = KeptPerText()

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None, original_context_length=None) -> torch.Tensor:
        if encoder_hidden_states is None or rotary_emb is not None or attention_mask is not None:
            raise ValueError("the cross-attention processor serves cross-attention only (encoder states, no RoPE, "
                             "no mask)")
        out = kept_text_attention(attn, hidden_states, encoder_hidden_states, None, self._kv)
        return attn.to_out[1](attn.to_out[0](out))


def parallelize_helios_transformer(transformer: torch.nn.Module, ctx: HeliosShardContext) -> None:
    """Give every self-attention of a diffusers ``HeliosTransformer3DModel`` the Ulysses processor and every
    cross-attention the processor that keeps the text's keys and values, in place; keep the text embedder's output
    through a request; give the blocks a step cache's list (``cp_infer.step_cache.cache_blocks``: the blocks take the
    token stream first)."""
    for block in transformer.blocks:
        block.attn1.set_processor(_UlyssesSelfAttnProcessor(ctx))
        block.attn2.set_processor(_CrossAttnProcessor())
    keep_per_text(transformer.condition_embedder.text_embedder)
    cache_blocks(transformer, streams=("hidden_states",), name="blocks")


def _history_tokens(model, latents: torch.Tensor, indices: torch.Tensor, conv: torch.nn.Module,
                    pad: tuple[int, int, int] | None, pool: tuple[int, int, int] | None,
                    grid: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
    """One history's tokens, rotary rows and token grid (rows, columns), as the forward's steps 3-5 make them; the
    rotary tables over ``grid`` (``None``: the tokens' own), down-sampled by ``pool``."""
    if pad is not None:
        latents = pad_for_3d_conv(latents, pad)
    tokens = conv(latents)
    grid = tuple(tokens.shape[-2:]) if grid is None else grid
    tokens = tokens.flatten(2).transpose(1, 2)
    rope = model.rope(frame_indices=indices, height=grid[0], width=grid[1], device=tokens.device)
    if pool is not None:
        rope = center_down_sample_3d(pad_for_3d_conv(rope, pool), pool)
    return tokens, rope.flatten(2).transpose(1, 2), grid


@torch.no_grad()
def sharded_forward(model, ctx: HeliosShardContext, *, hidden_states: torch.Tensor, timestep: torch.Tensor,
                    encoder_hidden_states: torch.Tensor, indices_hidden_states: torch.Tensor,
                    indices_latents_history_short: torch.Tensor, indices_latents_history_mid: torch.Tensor,
                    indices_latents_history_long: torch.Tensor, latents_history_short: torch.Tensor,
                    latents_history_mid: torch.Tensor, latents_history_long: torch.Tensor) -> torch.Tensor:
    """``HeliosTransformer3DModel.forward`` (the pipeline's call: every history given, ``return_dict=False``'s
    tensor) with the sequence sharded over ``ctx.state``'s Ulysses group (see the module docstring). Returns the whole
    chunk's prediction ``[B, C, F, H, W]`` on every rank."""
    state = ctx.state
    batch_size = hidden_states.shape[0]
    p_t, p_h, p_w = model.config.patch_size
    # The forward's steps 1-5, the same ops on the same (whole) tensors.
    hidden_states = model.patch_embedding(hidden_states)
    _, _, frames, height, width = hidden_states.shape
    hidden_states = hidden_states.flatten(2).transpose(1, 2)
    rotary_emb = model.rope(frame_indices=indices_hidden_states, height=height, width=width,
                            device=hidden_states.device).flatten(2).transpose(1, 2)
    chunk_tokens = hidden_states.shape[1]
    # Short history at the chunk's patch size; its token grid sets the mid and long histories' rotary grids.
    short, rope_short, (h1, w1) = _history_tokens(model, latents_history_short, indices_latents_history_short,
                                                  model.patch_short, None, None, None)
    mid, rope_mid, _ = _history_tokens(model, latents_history_mid, indices_latents_history_mid, model.patch_mid,
                                       (2, 4, 4), (2, 2, 2), (h1, w1))
    long, rope_long, _ = _history_tokens(model, latents_history_long, indices_latents_history_long,
                                         model.patch_long, (4, 8, 8), (4, 4, 4), (h1, w1))
    hidden_states = torch.cat([long, mid, short, hidden_states], dim=1)
    rotary_emb = torch.cat([rope_long, rope_mid, rope_short, rotary_emb], dim=1)
    history = hidden_states.shape[1] - chunk_tokens
    # The shard: B, S, ... -> B, S_LOCAL, ... (zero padding at the end of the last ranks').
    plan = ShardPlan(orig_len=hidden_states.shape[1], world=state.cp_size)
    rank = state.cp_rank
    hidden_states, rotary_emb = (plan.shard(x, rank).contiguous() for x in (hidden_states, rotary_emb))
    # The per-token timestep embeddings, made for the shard's tokens alone (the forward expands them over the whole
    # sequence): a history token's are timestep 0's (zero_history_timestep), a chunk token's the step's; the same rows.
    start, stop = plan.token_range(rank)
    own = (max(0, min(stop, history) - start), stop - max(start, history) if stop > history else 0)
    if not model.zero_history_timestep:
        own = (0, stop - start)
    pad = plan.local_len - (stop - start)
    rows_temb, rows_proj = [], []
    if own[0]:
        timestep_t0 = torch.zeros((1), dtype=timestep.dtype, device=timestep.device)
        temb_t0, timestep_proj_t0, _ = model.condition_embedder(timestep_t0, encoder_hidden_states,
                                                                is_return_encoder_hidden_states=False)
        rows_temb.append(temb_t0.unsqueeze(1).expand(batch_size, own[0], -1))
        # 1, 6*D -> B, H_LOCAL, 6, D
        rows_proj.append(timestep_proj_t0.unflatten(-1, (6, -1)).view(1, 1, 6, -1).expand(batch_size, own[0], -1, -1))
    temb, timestep_proj, encoder_hidden_states = model.condition_embedder(timestep, encoder_hidden_states)
    rows_temb.append(temb.view(batch_size, 1, -1).expand(batch_size, own[1], -1))
    # B, 6*D -> B, C_LOCAL, 6, D
    rows_proj.append(timestep_proj.unflatten(-1, (6, -1)).view(batch_size, 1, 6, -1).expand(batch_size, own[1], -1, -1))
    rows_temb.append(temb.new_zeros(batch_size, pad, temb.shape[-1]))
    rows_proj.append(timestep_proj.new_zeros(batch_size, pad, 6, timestep_proj.shape[-1] // 6))
    temb, timestep_proj = torch.cat(rows_temb, dim=1), torch.cat(rows_proj, dim=1)
    encoder_hidden_states = encoder_hidden_states.contiguous()
    ctx.plan, ctx.history = plan, history
    try:
        local_history = ctx.local_history()
        local_chunk = plan.local_len - local_history
        for block in model.blocks:
            hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb, local_chunk)
    finally:
        ctx.plan, ctx.history = None, 0
    # The output norm and projection on the rank's chunk tokens (and padding), placed after its history rows.
    chunk = hidden_states[:, local_history:]
    out = model.proj_out(model.norm_out(chunk, temb[:, local_history:], chunk.shape[1]))
    out = torch.cat([out.new_zeros(batch_size, local_history, out.shape[-1]), out], dim=1)
    out = gather_sequence(out, plan=plan, group=state.cp_group)[:, history:]  # B, S_LOCAL, P -> B, S_CHUNK, P
    # The forward's step 8 (unpatchify).
    out = out.reshape(batch_size, frames, height, width, p_t, p_h, p_w, -1)
    out = out.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)
