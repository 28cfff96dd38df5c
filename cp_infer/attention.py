"""Ulysses attention: sequence-sharded in, head-sharded attention over the full sequence, sequence-sharded out.

Invariants:
- Inputs are ``[B, S_LOCAL, H, D]`` shards laid out by a :class:`ShardPlan`; the result equals
  ``scaled_dot_product_attention`` over the unpadded full sequence, restricted to this rank's queries.
- Exactly two collectives per call: one ``all_to_all_single`` carries q, k and v together (packed into one
  buffer), one carries the output back.
- Padded keys never take part: padding sits at the end of the gathered sequence, so keys and values are
  cut to ``orig_len`` before attention (no mask is needed, which keeps SDPA on its fast kernels).
- Heads that do not divide the group size are padded with zero heads whose output is dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import all_to_all, group_size
from .shard import ShardPlan

__all__ = ["ExchangeWorkspace", "ulysses_attention", "local_attention", "padded_heads"]


class ExchangeWorkspace:
    """Exchange buffers reused from one attention layer to the next (inference only).

    Owned by the caller (one per model), passed keyword-only. Large fresh CPU allocations are returned to the
    OS when freed and page-faulted in again on the next call, which costs about as much as the exchange
    itself; reusing four buffers removes that. Ignored when autograd records the call: a backward pass
    needs the buffers of every layer alive at once. On CUDA the caching allocator already reuses memory.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = like.new_empty(shape)
        return buf

    def clear(self) -> None:
        self._buffers.clear()


def padded_heads(heads: int, world: int) -> int:
    """Heads after padding to a multiple of ``world`` (each rank then holds ``padded_heads // world``)."""
    return -(-heads // world) * world


def _sdpa_mask(key_mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
    if key_mask is None:
        return None
    if key_mask.dtype != torch.bool or key_mask.shape != (batch, keys):
        raise ValueError(f"key_mask must be a bool tensor of shape (B, S)=({batch}, {keys}) with True for keys "
                         f"to attend; got dtype={key_mask.dtype} shape={tuple(key_mask.shape)}")
    return key_mask[:, None, None, :]


def local_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of local queries over keys every rank holds in full (cross-attention to text, or one rank).

    ``q`` is ``[B, S_Q, H, D]``, ``k``/``v`` are ``[B, S_K, H, D]``, ``key_mask`` is bool ``[B, S_K]``.
    No communication: each query only needs the replicated keys.
    """
    mask = _sdpa_mask(key_mask, k.shape[0], k.shape[1])
    # B, S, H, D -> B, H, S, D
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    return out.transpose(1, 2)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    workspace: ExchangeWorkspace | None = None,
) -> torch.Tensor:
    """Self-attention over a sequence sharded by ``plan``.

    ``q``, ``k``, ``v``: ``[B, S_LOCAL, H, D]`` (this rank's ``plan.local_len`` tokens, padding included).
    ``key_mask``: optional bool ``[B, plan.orig_len]`` over the whole unpadded sequence, True = attend.
    Returns ``[B, S_LOCAL, H, D]``; rows of padding queries hold finite values the caller discards.
    ``workspace``: reuse exchange buffers across calls (see :class:`ExchangeWorkspace`).
    """
    n = group_size(group)
    if n != plan.world:
        raise ValueError(f"plan is for {plan.world} ranks but the group has {n}")
    batch, s_local, heads, head_dim = q.shape
    if s_local != plan.local_len or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q/k/v must all be [B, local_len={plan.local_len}, H, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    mask = _sdpa_mask(key_mask, batch, plan.orig_len)
    if n == 1:
        k, v = k[:, : plan.orig_len], v[:, : plan.orig_len]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale)
        return out.transpose(1, 2)

    h_pad = padded_heads(heads, n)
    h_local = h_pad // n
    # NOTE(layout): q, k and v are interleaved per token ([..., S_LOCAL, 3, H_LOCAL, D]) so that after the
    # exchange each of them is a strided *view* of the receive buffer (no unpack copy at B=1), and SDPA, which
    # accepts strided inputs on every backend, returns its output in the query's [B, S, H, D] memory order,
    # which makes the output pack free at B=1 too.
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    reuse = workspace is not None and not recording
    shape = (n, batch, s_local, 3, h_local, head_dim)
    send = workspace.get("send", shape, q) if reuse else q.new_empty(shape)
    for i, t in enumerate((q, k, v)):
        if h_pad != heads:
            t = F.pad(t, (0, 0, 0, h_pad - heads))
        # B, S_LOCAL, H, D -> N, B, S_LOCAL, H_LOCAL, D (chunk j = the heads rank j attends)
        send[:, :, :, i].copy_(t.view(batch, s_local, n, h_local, head_dim).permute(2, 0, 1, 3, 4))
    if reuse:
        recv = workspace.get("recv", shape, q)
        dist.all_to_all_single(recv, send, group=group)
    else:
        recv = all_to_all(send, group=group)
    # N, B, S_LOCAL, 3, H_LOCAL, D (chunk j = rank j's tokens) -> B, S_PAD, 3, H_LOCAL, D
    qkv = recv.transpose(0, 1).reshape(batch, n * s_local, 3, h_local, head_dim)
    # B, S, H_LOCAL, D -> B, H_LOCAL, S, D (views); keys and values cut to the real tokens
    q_h = qkv[:, :, 0].transpose(1, 2)
    k_h = qkv[:, : plan.orig_len, 1].transpose(1, 2)
    v_h = qkv[:, : plan.orig_len, 2].transpose(1, 2)
    out = F.scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=mask, scale=scale)

    # B, H_LOCAL, S_PAD, D -> N, B, S_LOCAL, H_LOCAL, D (chunk j = rank j's tokens)
    send_out = out.transpose(1, 2).reshape(batch, n, s_local, h_local, head_dim).transpose(0, 1).contiguous()
    if reuse:
        recv_out = workspace.get("recv_out", tuple(send_out.shape), q)
        dist.all_to_all_single(recv_out, send_out, group=group)
    else:
        recv_out = all_to_all(send_out, group=group)
    # N, B, S_LOCAL, H_LOCAL, D (chunk j = heads of rank j) -> B, S_LOCAL, H, D
    out = recv_out.permute(1, 2, 0, 3, 4).reshape(batch, s_local, h_pad, head_dim)
    if reuse and out.data_ptr() == recv_out.data_ptr():
        out = out.clone()  # never hand the caller a view of a buffer the next layer overwrites
    return out[:, :, :heads] if h_pad != heads else out
