"""Ulysses attention: sequence-sharded in, head-sharded attention over the full sequence, sequence-sharded out; with
a ring (``cp_infer.ring``), over the ring's blocks of the sequence.

Invariants:
- Queries are ``[B, S_LOCAL, H, D]`` shards of a sequence laid out by ``plan``; keys and values are shards of the
  same sequence (self-attention) or of another one laid out by ``kv_plan`` (cross-sequence attention, e.g. video
  queries over audio keys: its own length, its own padding). The result equals ``scaled_dot_product_attention``
  of this rank's queries over every unpadded key, whichever sequence the keys come from.
- Exactly two collectives per call over the Ulysses group: one ``all_to_all_single`` carries q, k and v together
  (packed into one buffer), one carries the output back. With a ring of ``R`` Ulysses groups the sequence is
  sharded over all ``U x R`` ranks (``plan.world``); the exchange gathers the group's ring block of queries, keys
  and values (shards ``ring rank x U .. + U - 1``, contiguous) for its share of the heads, and between the two
  all-to-alls ``R - 1`` point-to-point steps pass the key/value blocks round the ring (``cp_infer.ring``); the
  heads are padded to a multiple of ``U`` only.
- Padded keys never take part: padding sits at the end of each gathered sequence, so keys and values are cut to
  ``kv_plan.orig_len`` before attention (no mask is needed, which keeps SDPA on its fast kernels); around a ring,
  each step cuts the block it holds to the block's real keys.
- Heads that do not divide the group size are padded with zero heads whose output is dropped.
- Memory (inference): q, k and v may be handed over as producers, called one at a time and packed straight into
  the send buffer, so at most one of them is alive next to it. After the exchange the send buffer is dead and
  takes q, k and v for SDPA; the receive buffer is freed, and the output comes back into the send buffer: a
  call allocates the two exchange buffers (or takes them from a workspace), SDPA's output, the output's send
  copy and its result, and nothing else.
- Under ``torch.compile`` the call traces into the caller's graph, its two all-to-alls included (dynamo turns them
  into functional collectives), and a workspace is ignored: the compiled graph plans its own buffers, and a
  buffer kept on a Python object would be a graph input mutated in place (and its inference-mode check a graph
  break).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .collectives import all_to_all, group_size
from .ring import RingGroup, ring_attention
from .shard import ShardPlan

__all__ = ["ExchangeWorkspace", "AttentionInput", "ulysses_attention", "local_attention", "padded_heads"]

AttentionInput = torch.Tensor | Callable[[], torch.Tensor]
"""A q/k/v input of :func:`ulysses_attention`: the tensor, or a zero-argument callable that returns it (called
once, when that input is packed, so the caller need not hold q, k and v at once)."""


class ExchangeWorkspace:
    """The two exchange buffers (send and receive side), kept from one attention call to the next (inference only).

    Owned by the caller, passed keyword-only. Large fresh CPU allocations are returned to the OS when freed and
    page-faulted in again on the next call; keeping the buffers removes that, at the price of holding them between
    calls (about twice the packed q/k/v of the largest call: a model's activations peak elsewhere, in the
    feed-forward, and the buffers add to that peak). They grow to the largest call seen and serve calls of any
    shape, so self- and cross-sequence attentions of several streams can share one workspace. Ignored when
    autograd records the call: a backward pass needs the buffers of every layer alive at once. On CUDA the
    caching allocator already reuses memory.
    """

    def __init__(self) -> None:
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def buffers(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of ``numel`` elements of ``like``'s dtype and device."""
        bufs = self._buffers
        # NOTE(inference-mode): buffers made under inference_mode cannot be written outside it; make new ones then.
        if (bufs is None or bufs[0].numel() < numel or bufs[0].dtype != like.dtype or bufs[0].device != like.device
                or (bufs[0].is_inference() and not torch.is_inference_mode_enabled())):
            self._buffers = bufs = None  # free the old pair before allocating the new one
            self._buffers = bufs = (like.new_empty(numel), like.new_empty(numel))
        return bufs[0][:numel], bufs[1][:numel]

    @property
    def nbytes(self) -> int:
        return 0 if self._buffers is None else sum(b.numel() * b.element_size() for b in self._buffers)

    def clear(self) -> None:
        self._buffers = None


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


def _produce(x: AttentionInput) -> torch.Tensor:
    return x() if callable(x) else x


def _check_input(name: str, t: torch.Tensor, expected: tuple[int, ...], what: str) -> torch.Tensor:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must be [B, {what}, H, D] = {list(expected)}; got {list(t.shape)}")
    return t


def _pack(slot: torch.Tensor, t: torch.Tensor, n: int, h_pad: int) -> None:
    """Scatter ``t``'s heads over the ranks' chunks of the send buffer (``slot``: ``[N, S_LOCAL, B, H_LOCAL, D]``)."""
    batch, s_local, heads, head_dim = t.shape
    if h_pad != heads:
        t = F.pad(t, (0, 0, 0, h_pad - heads))
    # B, S_LOCAL, H, D -> N, S_LOCAL, B, H_LOCAL, D (chunk j = the heads rank j attends)
    slot.copy_(t.reshape(batch, s_local, n, h_pad // n, head_dim).permute(2, 1, 0, 3, 4))


def ulysses_attention(
    q: AttentionInput,
    k: AttentionInput,
    v: AttentionInput,
    *,
    plan: ShardPlan,
    group: dist.ProcessGroup | None,
    kv_plan: ShardPlan | None = None,
    key_mask: torch.Tensor | None = None,
    scale: float | None = None,
    workspace: ExchangeWorkspace | None = None,
    ring: RingGroup | None = None,
) -> torch.Tensor:
    """Attention of queries sharded by ``plan`` over keys/values sharded by ``kv_plan`` (default: ``plan``).

    ``q``: ``[B, plan.local_len, H, D]``; ``k``, ``v``: ``[B, kv_plan.local_len, H, D]`` (this rank's shards,
    padding included; same ``B``, ``H`` and ``D`` as ``q``). Each may be a tensor or a zero-argument callable
    returning it (see :data:`AttentionInput`); callables are called in the order q, k, v.
    ``kv_plan``: for cross-sequence attention, the plan of the sequence the keys and values come from; ``None``
    (or ``plan`` itself) is self-attention.
    ``key_mask``: optional bool ``[B, kv_plan.orig_len]`` over the other sequence's unpadded tokens, True = attend.
    Returns ``[B, plan.local_len, H, D]``; rows of padding queries hold finite values the caller discards.
    ``workspace``: keep the exchange buffers across calls (see :class:`ExchangeWorkspace`).
    ``ring``: this rank's ring (``cp_infer.ring``): the sequence is sharded over ``ring.size`` Ulysses groups,
    ``plan.world = group size x ring.size`` ranks (sequence shard ``ring.rank * U + Ulysses rank``), and after the
    exchange the group's block of queries attends every group's block of keys/values around the ring. Inference
    only.
    """
    n = group_size(group)
    ring_size = 1 if ring is None else ring.size
    kv_plan = plan if kv_plan is None else kv_plan
    for name, p in (("plan", plan), ("kv_plan", kv_plan)):
        if p.world != n * ring_size:
            raise ValueError(f"{name} is for {p.world} ranks but the group has {n}"
                             + (f" x a ring of {ring_size}" if ring is not None else ""))
    # Callables may return tensors that require grad: assume so when autograd is on.
    recording = torch.is_grad_enabled() and any(callable(t) or t.requires_grad for t in (q, k, v))
    if recording and ring is not None:
        raise ValueError("ring attention runs inference only (its point-to-point receives are not "
                         "differentiable); run under torch.no_grad()/inference_mode, or with ring_degree 1")
    q = _produce(q)
    if q.ndim != 4 or q.shape[1] != plan.local_len:
        raise ValueError(f"q must be [B, local_len={plan.local_len}, H, D]; got {list(q.shape)}")
    batch, s_local, heads, head_dim = q.shape
    kv_local = kv_plan.local_len
    kv_shape = (batch, kv_local, heads, head_dim)
    kv_what = f"{'kv_plan.' if kv_plan is not plan else ''}local_len={kv_local}"
    mask = _sdpa_mask(key_mask, batch, kv_plan.orig_len)
    if n == 1 and ring is not None:
        # B, S_LOCAL, H, D -> B, H, S_LOCAL, D; k, v -> 2, B, H, S_KV_LOCAL, D (the ring's block, padding included)
        kv = q.new_empty(2, batch, heads, kv_local, head_dim)
        kv[0].copy_(_check_input("k", _produce(k), kv_shape, kv_what).transpose(1, 2))
        kv[1].copy_(_check_input("v", _produce(v), kv_shape, kv_what).transpose(1, 2))
        out = ring_attention(q.transpose(1, 2), kv, ring=ring, kv_len=kv_plan.orig_len, key_mask=key_mask,
                             scale=scale)
        return out.transpose(1, 2).contiguous()
    if n == 1:
        k = _check_input("k", _produce(k), kv_shape, kv_what)[:, : kv_plan.orig_len]
        v = _check_input("v", _produce(v), kv_shape, kv_what)[:, : kv_plan.orig_len]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, scale=scale)
        return out.transpose(1, 2)

    h_pad = padded_heads(heads, n)
    h_local = h_pad // n
    like = q.new_empty(())  # dtype and device, once q itself is dropped
    # NOTE(layout): exchange chunks are token-major: rank j's chunk of the send buffer is this rank's tokens for
    # the heads rank j attends, [S_LOCAL, B, 3, H_LOCAL, D] (q, k and v interleaved per token) for self-attention,
    # [q: S_LOCAL, B, H_LOCAL, D | k, v: S_KV_LOCAL, B, 2, H_LOCAL, D] across two sequences. Received chunks then
    # follow one another in sequence order: under autograd q, k and v are views of the receive buffer (self-
    # attention); for inference one copy puts them in SDPA's preferred dense layout (NOTE(sdpa-layout)).
    self_attention = kv_plan == plan
    q_numel = s_local * batch * h_local * head_dim  # per rank's chunk
    chunk = 3 * q_numel if self_attention else q_numel + kv_local * batch * 2 * h_local * head_dim
    if torch.compiler.is_compiling():
        workspace = None  # see the module docstring: the compiled graph plans its own buffers
    if recording:
        send, recv = like.new_empty(n * chunk), None
    elif workspace is not None:
        send, recv = workspace.buffers(n * chunk, like)
    else:
        send, recv = like.new_empty(n * chunk), like.new_empty(n * chunk)

    def views(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q ``[N, S_LOCAL, B, H_LOCAL, D]``, k/v ``[N, S_KV_LOCAL, B, 2, H_LOCAL, D]``) parts of a buffer."""
        if self_attention:
            qkv = flat.view(n, s_local, batch, 3, h_local, head_dim)
            return qkv[:, :, :, 0], qkv[:, :, :, 1:]
        rows = flat.view(n, chunk)
        return (rows[:, :q_numel].view(n, s_local, batch, h_local, head_dim),
                rows[:, q_numel:].view(n, kv_local, batch, 2, h_local, head_dim))

    send_q, send_kv = views(send)
    _pack(send_q, q, n, h_pad)
    del q  # with producers, nothing but the send buffer holds q from here on
    _pack(send_kv[:, :, :, 0], _check_input("k", _produce(k), kv_shape, kv_what), n, h_pad)
    _pack(send_kv[:, :, :, 1], _check_input("v", _produce(v), kv_shape, kv_what), n, h_pad)
    del k, v, send_q, send_kv
    if recording:
        recv = all_to_all(send.view(n, chunk), group=group)
    else:
        dist.all_to_all_single(recv, send, group=group)

    # N, S_LOCAL, B, ... (chunk j = rank j's tokens) -> S_PAD, B, ...
    recv_q, recv_kv = views(recv)
    kv_len = kv_plan.orig_len
    if recording:
        # N, S_LOCAL, B, ... -> S_PAD, B, ... (views for self-attention, copies across sequences) -> B, H_LOCAL, S, D
        q_h = recv_q.flatten(0, 1).permute(1, 2, 0, 3)
        kv = recv_kv.flatten(0, 1)[:kv_len]
        k_h, v_h = kv[:, :, 0].permute(1, 2, 0, 3), kv[:, :, 1].permute(1, 2, 0, 3)
    else:
        # NOTE(sdpa-layout): q, k and v are copied into the dead send buffer as dense [B, H_LOCAL, S, D]. SDPA
        # straight on the strided views of the receive buffer works, but CPU flash attention reads keys
        # 3*B*H_LOCAL*D apart there and is 6-11% slower at 4k tokens than this copy plus SDPA on dense inputs.
        # N, S_LOCAL, B, H_LOCAL, D -> B, H_LOCAL, N, S_LOCAL, D = B, H_LOCAL, S_PAD, D
        q_h = send[: n * q_numel].view(batch, h_local, n, s_local, head_dim)
        q_h = q_h.copy_(recv_q.permute(2, 3, 0, 1, 4)).flatten(2, 3)
        # N, S_KV_LOCAL, B, 2, H_LOCAL, D -> 2, B, H_LOCAL, N, S_KV_LOCAL, D = 2, B, H_LOCAL, S_KV_PAD, D
        kv_h = send[n * q_numel: n * q_numel + 2 * batch * h_local * n * kv_local * head_dim]
        kv_h = kv_h.view(2, batch, h_local, n, kv_local, head_dim).copy_(recv_kv.permute(3, 2, 4, 0, 1, 5))
        kv_h = kv_h.flatten(3, 4)
        k_h, v_h = kv_h[0, :, :, :kv_len], kv_h[1, :, :, :kv_len]
        if workspace is None:
            recv = None  # free the receive buffer before SDPA (a workspace keeps it: the output goes out of it)
    del recv_q, recv_kv
    if ring is not None:
        # The group's block of keys/values, padding included, goes round the ring (cp_infer.ring masks it per step).
        out = ring_attention(q_h, kv_h, ring=ring, kv_len=kv_len, key_mask=key_mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q_h, k_h, v_h, attn_mask=mask, scale=scale)
    del q_h, k_h, v_h

    # B, H_LOCAL, S_PAD, D -> N, S_LOCAL, B, H_LOCAL, D (chunk j = rank j's tokens)
    out_shape = (n, s_local, batch, h_local, head_dim)
    out_parts = out.permute(2, 0, 1, 3).unflatten(0, (n, s_local))
    if recording:
        recv_out = all_to_all(out_parts.contiguous(), group=group)
        # N, S_LOCAL, B, H_LOCAL, D (chunk j = heads of rank j) -> B, S_LOCAL, H, D
        result = recv_out.permute(2, 1, 0, 3, 4).reshape(batch, s_local, h_pad, head_dim)
        return result[:, :, :heads].contiguous()  # dense, see NOTE(dense-result) below
    # The output comes back into the (dead) send buffer.
    send_out = out_parts.contiguous() if recv is None else recv[: n * q_numel].view(out_shape).copy_(out_parts)
    del out, out_parts
    recv_out = send[: n * q_numel].view(out_shape)
    dist.all_to_all_single(recv_out, send_out, group=group)
    del send, recv, send_out
    # N, S_LOCAL, B, H_LOCAL, D (chunk j = heads of rank j) -> B, S_LOCAL, H, D, in fresh memory (never hand the
    # caller a view of a buffer the next call overwrites) and dense: NOTE(dense-result): a view that skips the
    # padded heads would send the next Linear down another GEMM path, which rounds differently in bf16.
    result = recv_out.new_empty(batch, s_local, heads, head_dim)
    if h_pad == heads:
        result.view(batch, s_local, n, h_local, head_dim).copy_(recv_out.permute(2, 1, 0, 3, 4))
    else:
        for j in range(n):  # the padded heads sit at the end of the last chunks: copy the real ones only
            lo, hi = j * h_local, min((j + 1) * h_local, heads)
            if hi > lo:
                result[:, :, lo:hi].copy_(recv_out[j, :, :, : hi - lo].transpose(0, 1))
    return result
