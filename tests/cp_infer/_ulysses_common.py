"""What the Ulysses attention tests (self- and cross-sequence) share: the world sizes, the head size and the
single-process reference they compare against."""

from __future__ import annotations

import torch.nn.functional as F

__all__ = ["HEAD_DIM", "WORLDS", "reference_sdpa"]

WORLDS = [1, 2, 3, 4]
HEAD_DIM = 16


def reference_sdpa(q, k, v, key_mask):
    """``scaled_dot_product_attention`` over whole sequences in one process; q/k/v are [B, S, H, D] as Ulysses
    takes them, ``key_mask`` [B, S_kv] bool (True: attend) or None."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    # B, S, H, D -> B, H, S, D for SDPA, and back
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2)
