"""LTX-2's parallel plan: sequence parallelism applied to diffusers' ``LTX2VideoTransformer3DModel`` from outside
(:func:`parallelize_ltx2_transformer`), the model maths untouched.

- the video and the audio token sequences are two streams, each sharded by its own :class:`ShardPlan`;
- both self-attentions run through :func:`cp_infer.ulysses_attention` on their own plan, and both cross-modal
  attentions through its cross-sequence form, so every query sees every real key of the other stream and no padded
  one (:data:`_SHARDED_ATTENTIONS` is the table of what is sharded where);
- RoPE of every kind is a pure function of each token's coordinates: the transformer is handed this rank's shard of
  the coordinates and computes exactly its tokens' rotations;
- text cross-attention keeps the text's keys and values through a request (``models.common.text_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2Attention,
    apply_interleaved_rotary_emb,
    apply_split_rotary_emb,
)

from cp_infer import ExchangeWorkspace, ParallelState, ShardPlan, ulysses_attention
from cp_infer.step_cache import cache_blocks
from models.common.text_kv import KeptPerText, keep_per_text, kept_text_attention

__all__ = ["parallelize_ltx2_transformer"]

# (query stream, key/value stream) of every attention that mixes tokens of a sharded stream.
_SHARDED_ATTENTIONS = {
    "attn1": ("video", "video"),
    "audio_attn1": ("audio", "audio"),
    "audio_to_video_attn": ("video", "audio"),
    "video_to_audio_attn": ("audio", "video"),
}


@dataclass
class _ShardContext:
    """The plans of the forward pass in flight. Owned by one model; set only inside ``LTX2Model.sharded``."""

    state: ParallelState
    plans: dict[str, ShardPlan] | None = None
    workspaces: dict[tuple[str, str], ExchangeWorkspace] = field(default_factory=dict)
    """Exchange buffers per (query, key) stream pair, reused across layers and steps. NOTE(compile-workspace): not
    used in compiled blocks (``ulysses_attention`` ignores a workspace there), and not created from them: a dict
    filled in from compiled code is a guard that fails once it is filled, a recompile of every block."""

    def workspace(self, pair: tuple[str, str]) -> ExchangeWorkspace:
        return self.workspaces.setdefault(pair, ExchangeWorkspace())


def _rope(attn: LTX2Attention, x: torch.Tensor, freqs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    if attn.rope_type == "interleaved":
        return apply_interleaved_rotary_emb(x, freqs)
    if attn.rope_type == "split":
        return apply_split_rotary_emb(x, freqs)
    raise ValueError(f"rope_type={attn.rope_type!r} is not supported; LTX-2 uses 'interleaved' or 'split'")


class _UlyssesAVProcessor:
    """One LTX-2 attention whose queries and keys are shards of (possibly different) token streams."""

    def __init__(self, ctx: _ShardContext, q_stream: str, kv_stream: str):
        self.ctx, self.q_stream, self.kv_stream = ctx, q_stream, kv_stream

    def __call__(self, attn: LTX2Attention, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, query_rotary_emb=None, key_rotary_emb=None, perturbation_mask=None,
                 all_perturbed=None) -> torch.Tensor:
        plans = self.ctx.plans
        if plans is None:
            raise RuntimeError("the parallel LTX-2 transformer was called outside LTX2Model.sharded()")
        if attention_mask is not None:
            raise ValueError("attention masks over sharded streams are not supported (text-to-video needs none)")
        kv_states = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        value = attn.to_v(kv_states)
        if all_perturbed is None:
            all_perturbed = bool(torch.all(perturbation_mask == 0)) if perturbation_mask is not None else False
        if all_perturbed:
            # Spatio-temporal guidance skips the attention: each token keeps its own value (no communication;
            # the flag is the same on every rank, so every rank skips the same exchanges).
            out = value
        else:
            query = attn.norm_q(attn.to_q(hidden_states))
            key = attn.norm_k(attn.to_k(kv_states))
            if query_rotary_emb is not None:
                query = _rope(attn, query, query_rotary_emb)
                key = _rope(attn, key, key_rotary_emb if key_rotary_emb is not None else query_rotary_emb)
            # B, S_LOCAL, H*D -> B, S_LOCAL, H, D
            q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (query, key, value))
            kv_plan = None if self.kv_stream == self.q_stream else plans[self.kv_stream]
            out = ulysses_attention(q, k, v, plan=plans[self.q_stream], kv_plan=kv_plan,
                                    group=self.ctx.state.attention_group, ring=self.ctx.state.ring,
                                    workspace=None if torch.compiler.is_compiling()  # NOTE(compile-workspace)
                                    else self.ctx.workspace((self.q_stream, self.kv_stream)))
            out = out.flatten(2, 3).to(query.dtype)
            if perturbation_mask is not None:
                out = torch.lerp(value, out, perturbation_mask)
        if gate_logits is not None:
            # B, S_LOCAL, H*D -> B, S_LOCAL, H, D: per-head gates of this rank's query tokens
            gates = 2.0 * torch.sigmoid(gate_logits)
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


class _TextKVProcessor:
    """LTX-2's text cross-attention (``attn2``, ``audio_attn2``: diffusers' ``LTX2AudioVideoAttnProcessor``, and
    ``LTX2PerturbedAttnProcessor`` without a perturbation, the same ops) with the text's keys and values
    (``norm_k(to_k(text))``, ``to_v(text)``) kept through a request (``models.common.text_kv.KeptPerText``). Where the
    text
    changes at every step (``cross_attn_adaln`` models shift and scale it by the timestep) each step's is a new
    tensor, so nothing is reused and the result is the same.

    NOTE(text-kv): every pass of a step (CFG's pair, STG, modality) projects the request's 1024 text tokens in
    every block, for video and for audio."""

    def __init__(self):
        self._kv = KeptPerText()

    def __call__(self, attn: LTX2Attention, hidden_states: torch.Tensor, encoder_hidden_states=None,
                 attention_mask=None, query_rotary_emb=None, key_rotary_emb=None, perturbation_mask=None,
                 all_perturbed=None) -> torch.Tensor:
        if encoder_hidden_states is None or query_rotary_emb is not None or perturbation_mask is not None:
            raise ValueError("the text processor serves text cross-attention only (encoder states, no RoPE, no "
                             "perturbation)")
        gate_logits = attn.to_gate_logits(hidden_states) if attn.to_gate_logits is not None else None
        out = kept_text_attention(attn, hidden_states, encoder_hidden_states, attention_mask, self._kv)
        if gate_logits is not None:
            gates = 2.0 * torch.sigmoid(gate_logits)
            out = (out.unflatten(2, (attn.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
        return attn.to_out[1](attn.to_out[0](out))


def parallelize_ltx2_transformer(transformer: torch.nn.Module, ctx: _ShardContext) -> None:
    """Apply sequence parallelism to a diffusers ``LTX2VideoTransformer3DModel`` in place (and keep the text's
    cross-attention keys and values through a request: :class:`_TextKVProcessor`; iterate its blocks through a step
    cache: ``cp_infer.step_cache.cache_blocks``, the two streams in the blocks' output order)."""
    cache_blocks(transformer, streams=("hidden_states", "audio_hidden_states"))
    for block in transformer.transformer_blocks:
        for name, (q_stream, kv_stream) in _SHARDED_ATTENTIONS.items():
            getattr(block, name).set_processor(_UlyssesAVProcessor(ctx, q_stream, kv_stream))
        block.attn2.set_processor(_TextKVProcessor())
        block.audio_attn2.set_processor(_TextKVProcessor())
    for name in ("caption_projection", "audio_caption_projection"):  # LTX-2.0's (use_prompt_embeddings)
        if getattr(transformer, name, None) is not None:
            keep_per_text(getattr(transformer, name))
