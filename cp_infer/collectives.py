"""Collectives used by the context-parallel engine.

Invariants:
- Every collective takes ``group=`` explicitly and is the identity when the group is ``None`` or has one rank.
- Tensor collectives are differentiable: the backward of an all-to-all is the same all-to-all on the
  gradients (the exchange is its own adjoint in this layout), the backward of a gather is the local slice.
- Control messages (pickled objects) only travel over the gloo CPU group of a :class:`ParallelState`, and
  only server-built objects are ever sent: object broadcast is pickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .mesh import pass_shares
from .shard import ShardPlan
from .state import ParallelState

__all__ = [
    "group_size",
    "all_to_all",
    "gather_sequence",
    "gather_passes",
    "broadcast_object",
    "all_reduce_max_int",
    "all_reduce_max_ints",
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


def gather_passes(local: Mapping[str, torch.Tensor], *, passes: int, state: ParallelState) -> dict[str, torch.Tensor]:
    """A step's guidance passes from every guidance rank, in pass order: one all-gather over the guidance group.

    ``local[name]`` is ``[n_local, ...]``: this rank's share of the ``passes`` (``cp_infer.mesh.pass_shares``, its
    ``guidance_rank``-th share; ``n_local`` may be 0), one pass per row, every stream with the same dtype. Returns
    ``[passes, ...]`` per stream, the same on every rank of the guidance group; on one guidance rank, ``local``."""
    shares = pass_shares(passes, state.guidance_size)
    mine = len(shares[state.guidance_rank])
    for name, x in local.items():
        if x.shape[0] != mine:
            raise ValueError(f"gather_passes: stream {name!r} has {x.shape[0]} passes on guidance rank "
                             f"{state.guidance_rank}, its share of {passes} is {mine}")
    if state.guidance_size == 1:
        return dict(local)
    dtypes = {x.dtype for x in local.values()}
    assert len(dtypes) == 1, f"gather_passes needs one dtype for every stream, got {dtypes}"
    width = len(shares[0])  # the largest share: every rank sends that many rows, padded
    # N_LOCAL, ... -> WIDTH, F_TOTAL: every stream's pass flattened, side by side, padding rows after the real ones
    flat = torch.cat([x.flatten(1) for x in local.values()], dim=1)
    send = flat.new_zeros((width, flat.shape[1]))
    send[:mine] = flat
    recv = send.new_empty((state.guidance_size * width, flat.shape[1]))
    dist.all_gather_into_tensor(recv, send, group=state.guidance_group)
    # G * WIDTH, F_TOTAL -> PASSES, F_TOTAL: each rank's real rows, in rank (= pass) order
    rows = torch.cat([recv[g * width:g * width + len(share)] for g, share in enumerate(shares)])
    out, start = {}, 0
    for name, x in local.items():
        size = x.shape[1:].numel()
        # PASSES, F -> PASSES, ... (this stream's columns)
        out[name] = rows[:, start:start + size].reshape(passes, *x.shape[1:])
        start += size
    return out


def broadcast_object(obj: Any, *, state: ParallelState, src: int | None = None) -> Any:
    """Send a picklable object from global rank ``src`` (default: the replica group's leader) to every rank of the
    replica group over its gloo CPU group."""
    if state.cpu_group is None:
        return obj
    src = state.replica_ranks[0] if src is None else src
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
    """The maximum of an integer over the replica group's ranks (CPU group): how ranks agree on a status code."""
    if state.cpu_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.cpu_group)
    return int(t.item())


def all_reduce_max_ints(values: list[int], *, state: ParallelState) -> list[int]:
    """The elementwise maximum of a list of integers (the same length on every rank) over the replica group's ranks
    (CPU group)."""
    if state.cpu_group is None:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=state.cpu_group)
    return t.tolist()


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
    if state.guidance_group is not None:
        passes = 2 * state.guidance_size - 1  # uneven shares, the last rank's smaller
        share = pass_shares(passes, state.guidance_size)[state.guidance_rank]
        local = torch.tensor([float(p) for p in share], device=state.device)[:, None]
        every = gather_passes({"warmup": local}, passes=passes, state=state)["warmup"]
        if not torch.equal(every[:, 0].cpu(), torch.arange(passes, dtype=every.dtype)):
            raise RuntimeError(f"warm-up guidance exchange returned wrong data on rank {state.rank}")
    if state.cpu_group is not None:
        if broadcast_object("ping", state=state) != "ping":
            raise RuntimeError(f"warm-up broadcast failed on rank {state.rank}")
        all_reduce_max_int(state.rank, state=state)
