"""Values computed from a request's prompt embeddings alone (the transformer's caption projection, each block's text
keys and values), kept through the request instead of recomputed at every step.

Invariants:
- Kept per view of the embeddings (offset, shape, stride: a guidance rank's rows of the CFG batch) while their
  storage lives, and dropped with it (``weakref.finalize``): one request's values never serve another, and none
  outlive their request (embeddings are never changed in place).
- What is kept is what the uncached call returns, computed by the same call the first time: the adapters stay
  bit-identical to diffusers' processors.
- Nothing is kept with gradients on or under ``torch.compile`` (a dict filled from compiled code recompiles the
  graph).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn

__all__ = ["KeptPerText", "keep_per_text", "kept_text_attention"]


class KeptPerText:
    """``get(text, make)``: ``make()``'s value for this view of ``text``, made once while ``text``'s storage lives.
    Several embeddings can be alive at once (a step's passes: CFG's pair in one batch, the STG and modality passes'
    conditional row in another); each has its own entries."""

    def __init__(self):
        self._kept: dict[int, tuple[weakref.ref, dict[tuple, Any]]] = {}
        """id of an embeddings' storage -> (that storage, its views' values)."""

    def get(self, text: torch.Tensor, make: Callable[[], Any]) -> Any:
        if torch.compiler.is_compiling() or torch.is_grad_enabled():
            return make()
        # One object for every view of the embeddings (``_base`` is None under inference mode), alive while any is.
        base = text.untyped_storage()
        entry = self._kept.get(id(base))
        if entry is None or entry[0]() is not base:
            entry = self._kept[id(base)] = (weakref.ref(base), {})
            weakref.finalize(base, self._drop, id(base), entry)
        views = entry[1]
        view = (text.storage_offset(), tuple(text.shape), tuple(text.stride()), text.dtype, text.device)
        if view not in views:
            views[view] = make()
        return views[view]

    def _drop(self, key: int, entry: tuple) -> None:
        if self._kept.get(key) is entry:
            del self._kept[key]

    def __len__(self) -> int:
        """Values kept, over every embeddings alive."""
        return sum(len(views) for _ref, views in self._kept.values())


def keep_per_text(projection: torch.nn.Module) -> None:
    """A transformer's caption projection (run on the prompt embeddings at every step) computed once per request:
    the same output tensor at every step, so that the blocks' text keys and values are found kept too. Its
    parameters and state dict are unchanged."""
    kept, forward = KeptPerText(), projection.forward
    projection.forward = lambda caption: kept.get(caption, lambda: forward(caption))


def kept_text_attention(attn: torch.nn.Module, hidden_states: torch.Tensor, text: torch.Tensor,
                        attention_mask: torch.Tensor | None, kept: KeptPerText) -> torch.Tensor:
    """The text cross-attention of diffusers' LTX processors (``LTXVideoAttnProcessor``,
    ``LTX2AudioVideoAttnProcessor``) and of ``HeliosAttnProcessor`` on encoder states (the same ops in the same
    order; Helios passes no mask) up to its heads' output ``[B, S, H*D]``, before any gate and ``to_out``, with the
    text's keys and values (``norm_k(to_k(text))``, ``to_v(text)``: the projected prompt alone) from ``kept``."""
    batch_size, sequence_length, _ = text.shape
    if attention_mask is not None:
        attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
        attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])
    query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
    key, value = kept.get(text, lambda: (attn.norm_k(attn.to_k(text)).unflatten(2, (attn.heads, -1)),
                                         attn.to_v(text).unflatten(2, (attn.heads, -1))))
    out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
    return out.flatten(2, 3).to(query.dtype)
