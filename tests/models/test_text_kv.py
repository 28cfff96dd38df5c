"""LTX-Video's cross-attention with the text's keys and values kept through a request (``_TextKVProcessor``):
bit-identical to diffusers' processor at every call, per view of the embeddings (a guidance rank's rows), never
serving other embeddings, and let go with them."""

from __future__ import annotations

import gc

import torch
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoAttnProcessor

from models.ltx_video import _TextKVProcessor


def _attention() -> LTXAttention:
    torch.manual_seed(0)
    return LTXAttention(query_dim=64, heads=4, kv_heads=4, dim_head=16, cross_attention_dim=48, bias=True,
                        out_bias=True, qk_norm="rms_norm_across_heads").eval()


@torch.inference_mode()
def test_kept_keys_and_values_give_diffusers_output_bit_for_bit():
    attn, ours, theirs = _attention(), _TextKVProcessor(), LTXVideoAttnProcessor()
    text = torch.randn(2, 7, 48)
    # As the transformer hands it on: the padding mask as an additive bias, [B, 1, T].
    mask = (1 - torch.tensor([[1] * 7, [1] * 5 + [0] * 2], dtype=torch.float32)).unsqueeze(1) * -10000.0
    for step in range(3):  # the latents change at every step, the text does not
        hidden = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(step))
        for rows in (slice(0, 2), slice(1, 2), slice(0, 1)):  # the CFG batch, and each guidance rank's row
            got = ours(attn, hidden[rows], encoder_hidden_states=text[rows], attention_mask=mask[rows])
            want = theirs(attn, hidden[rows], encoder_hidden_states=text[rows], attention_mask=mask[rows])
            assert torch.equal(got, want), (step, rows)
    assert len(ours._kv._kept) == 3  # one entry per view, computed once
    other = torch.randn(2, 7, 48)  # another request's prompt: never the first one's keys
    hidden = torch.randn(2, 11, 64)
    assert torch.equal(ours(attn, hidden, encoder_hidden_states=other, attention_mask=mask),
                       theirs(attn, hidden, encoder_hidden_states=other, attention_mask=mask))
    assert len(ours._kv._kept) == 1


@torch.inference_mode()
def test_the_entries_go_with_the_embeddings():
    attn, ours = _attention(), _TextKVProcessor()
    text = torch.randn(2, 7, 48)
    ours(attn, torch.randn(2, 11, 64), encoder_hidden_states=text[1:])
    assert len(ours._kv._kept) == 1
    del text
    gc.collect()
    assert not ours._kv._kept


def test_with_gradients_nothing_is_kept():
    attn, ours = _attention(), _TextKVProcessor()
    ours(attn, torch.randn(1, 11, 64), encoder_hidden_states=torch.randn(1, 7, 48))
    assert not ours._kv._kept
