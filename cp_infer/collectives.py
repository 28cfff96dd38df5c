"""Collectives used by the context-parallel engine.

Invariants:
- Every collective takes ``group=`` explicitly and is the identity when the group is ``None`` or has one rank.
- Tensor collectives are differentiable: the backward of an all-to-all is the same all-to-all on the
  gradients (the exchange is its own adjoint in this layout), the backward of a gather is the local slice.
- Control messages (pickled objects) only travel over the gloo CPU group of a :class:`ParallelState`, and
  only server-built objects are ever sent: object broadcast is pickle.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .shard import ShardPlan
from .state import ParallelState

__all__ = [
    "group_size",
    "all_to_all",
    "gather_sequence",
    "broadcast_object",
    "all_reduce_max_int",
    "all_reduce_sum",
    "warmup",
]


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        recv = torch.empty_like(send, memory_format=torch.contiguous_format)
        dist.all_to_all_single(recv, send, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad_recv: torch.Tensor) -> tuple[torch.Tensor, None]:
        # NOTE(layout): the incoming gradient may be a permuted view; empty_like would copy its strides
        # and all_to_all_single would then write chunks into the wrong places.
        grad_recv = grad_recv.contiguous()
        grad_send = torch.empty_like(grad_recv, memory_format=torch.contiguous_format)
        dist.all_to_all_single(grad_send, grad_recv, group=ctx.group)
        return grad_send, None


def all_to_all(send: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """One ``all_to_all_single``: chunk ``i`` of dim 0 goes to group rank ``i``.

    ``send`` is ``[N, ...]`` with ``N`` the group size; the result has the same shape, its chunk ``i``
    coming from group rank ``i``.
    """
    n = group_size(group)
    if n == 1:
        return send
    if send.shape[0] != n:
        raise ValueError(f"all_to_all expects dim 0 == group size {n}, got shape {tuple(send.shape)}")
    return _AllToAll.apply(send.contiguous(), group)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, plan: ShardPlan, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.plan, ctx.rank, ctx.dim = plan, dist.get_rank(group), dim
        # B, S_LOCAL, ... -> S_LOCAL, B, ... : all_gather_into_tensor concatenates on dim 0.
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((plan.padded_len, *local.shape[1:]))
        dist.all_gather_into_tensor(out, local, group=group)
        # S_PAD, B, ... -> B, S, ...
        return plan.trim(out, dim=0).movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # NOTE(gather-backward): assumes the code after the gather is replicated on every rank (the
        # same loss everywhere), so each rank's share of the gradient is its own slice.
        return ctx.plan.shard(grad, ctx.rank, dim=ctx.dim), None, None, None


def gather_sequence(
    x_local: torch.Tensor, *, plan: ShardPlan, group: dist.ProcessGroup | None, dim: int = 1
) -> torch.Tensor:
    """All-gather the shards of a sequence and trim the padding: ``[B, S_LOCAL, ...] -> [B, S, ...]``."""
    if x_local.shape[dim] != plan.local_len:
        raise ValueError(f"gather_sequence: shard has {x_local.shape[dim]} tokens on dim {dim}, "
                         f"plan expects local_len={plan.local_len}")
    if group_size(group) == 1:
        return plan.trim(x_local, dim=dim)
    return _GatherSequence.apply(x_local, plan, group, dim)


def broadcast_object(obj: Any, *, state: ParallelState, src: int = 0) -> Any:
    """Send a picklable object from global rank ``src`` to every rank over the gloo CPU group."""
    if state.cpu_group is None:
        return obj
    box = [obj if state.rank == src else None]
    dist.broadcast_object_list(box, src=src, group=state.cpu_group)
    return box[0]


def all_reduce_sum(x: torch.Tensor, *, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The elementwise sum of ``x`` over the group (a new tensor; ``x`` itself on a one-rank group)."""
    if group_size(group) == 1:
        return x
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def all_reduce_max_int(value: int, *, state: ParallelState) -> int:
    """The maximum of an integer over all ranks (CPU group): how ranks agree on a status code."""
    if state.cpu_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.cpu_group)
    return int(t.item())


def warmup(state: ParallelState) -> None:
    """Run every collective once on the real groups so lazy communicator setup happens before serving."""
    if state.cp_group is not None:
        n = state.cp_size
        x = torch.full((n, 4), float(state.cp_rank), device=state.device)
        y = all_to_all(x, group=state.cp_group)
        expected = torch.arange(n, dtype=y.dtype, device=y.device)[:, None].expand(n, 4)
        if not torch.equal(y, expected):
            raise RuntimeError(f"warm-up all_to_all returned wrong data on rank {state.rank}")
        plan = ShardPlan(orig_len=2 * n - 1, world=n)
        full = gather_sequence(torch.ones(1, plan.local_len, device=state.device), plan=plan,
                               group=state.cp_group)
        if full.shape != (1, plan.orig_len):
            raise RuntimeError(f"warm-up gather returned shape {tuple(full.shape)} on rank {state.rank}")
        dist.barrier(group=state.cp_group)
    if state.cpu_group is not None:
        if broadcast_object("ping", state=state) != "ping":
            raise RuntimeError(f"warm-up broadcast failed on rank {state.rank}")
        all_reduce_max_int(state.rank, state=state)
