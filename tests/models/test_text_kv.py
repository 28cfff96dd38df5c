"""LTX-Video's and LTX-2's cross-attention with the text's keys and values kept through a request
(``_TextKVProcessor``, ``models.common.text_kv``): bit-identical to diffusers' processors at every call, per view of the
embeddings (a guidance rank's rows), never serving other embeddings, and let go with them."""

from __future__ import annotations

import gc

import pytest
import torch
from diffusers.models.transformers.transformer_ltx import LTXAttention, LTXVideoAttnProcessor
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2Attention,
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
)

from cp_infer import single_process_state
from models.ltx2.parallel import _TextKVProcessor as LTX2TextKVProcessor
from models.ltx_video.parallel import _TextKVProcessor


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
    assert len(ours._kv) == 3  # one entry per view, computed once
    other = torch.randn(2, 7, 48)  # another request's prompt: never the first one's keys
    hidden = torch.randn(2, 11, 64)
    assert torch.equal(ours(attn, hidden, encoder_hidden_states=other, attention_mask=mask),
                       theirs(attn, hidden, encoder_hidden_states=other, attention_mask=mask))
    assert len(ours._kv) == 4
    del text  # the first request ends: its entries go, the other's stay
    gc.collect()
    assert len(ours._kv) == 1


@torch.inference_mode()
def test_the_entries_go_with_the_embeddings():
    attn, ours = _attention(), _TextKVProcessor()
    text = torch.randn(2, 7, 48)
    ours(attn, torch.randn(2, 11, 64), encoder_hidden_states=text[1:])
    assert len(ours._kv) == 1
    del text
    gc.collect()
    assert not ours._kv._kept


def test_with_gradients_nothing_is_kept():
    attn, ours = _attention(), _TextKVProcessor()
    ours(attn, torch.randn(1, 11, 64), encoder_hidden_states=torch.randn(1, 7, 48))
    assert not ours._kv._kept


@pytest.mark.parametrize("gated", [False, True], ids=["LTX-2.0", "gated heads"])
@pytest.mark.parametrize("theirs_cls", [LTX2AudioVideoAttnProcessor, LTX2PerturbedAttnProcessor])
@torch.inference_mode()
def test_ltx2_kept_keys_and_values_give_diffusers_output_bit_for_bit(gated, theirs_cls):
    """LTX-2's text cross-attention (``attn2`` / ``audio_attn2``), against both of diffusers' processors."""
    torch.manual_seed(0)
    attn = LTX2Attention(query_dim=64, heads=4, kv_heads=4, dim_head=16, cross_attention_dim=48,
                         apply_gated_attention=gated).eval()
    ours, theirs = LTX2TextKVProcessor(), theirs_cls()
    text = torch.randn(4, 9, 48)  # CFG's pair, then the STG and modality passes' conditional rows
    mask = (1 - torch.tensor([[1] * 9, [1] * 6 + [0] * 3] * 2, dtype=torch.float32)).unsqueeze(1) * -10000.0
    for step in range(3):
        hidden = torch.randn(4, 13, 64, generator=torch.Generator().manual_seed(step))
        for rows in (slice(0, 2), slice(1, 2), slice(2, 3), slice(3, 4)):
            got = ours(attn, hidden[rows], encoder_hidden_states=text[rows], attention_mask=mask[rows])
            want = theirs(attn, hidden[rows], encoder_hidden_states=text[rows], attention_mask=mask[rows])
            assert torch.equal(got, want), (step, rows)
    assert len(ours._kv) == 4  # the two embeddings' views, each computed once, both alive through the steps
    with pytest.raises(ValueError, match="text cross-attention only"):
        ours(attn, torch.randn(1, 13, 64))  # self-attention is not its to serve


@torch.inference_mode()
def test_ltx2_transformer_keeps_the_text_in_every_block_and_projection():
    """``parallelize_ltx2_transformer``: every block's two text cross-attentions keep their keys and values (each its
    own), and the caption projections run once per view of the embeddings."""
    from models.ltx2.default import build_ltx2_components
    from models.ltx2.parallel import _ShardContext, parallelize_ltx2_transformer

    transformer = build_ltx2_components()["transformer"].eval()
    parallelize_ltx2_transformer(transformer, _ShardContext(single_process_state(torch.device("cpu"))))
    processors = [a.processor for b in transformer.transformer_blocks for a in (b.attn2, b.audio_attn2)]
    assert all(isinstance(p, LTX2TextKVProcessor) for p in processors)
    assert len({id(p) for p in processors}) == len(processors)
    for name in ("caption_projection", "audio_caption_projection"):
        projection = getattr(transformer, name)
        calls: list[int] = []
        projection.linear_1.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        caption = torch.randn(2, 5, projection.linear_1.in_features)
        first = projection(caption)
        assert projection(caption) is first and projection(caption[1:]) is not first
        assert len(calls) == 2, name  # the whole batch once, one guidance rank's row once
