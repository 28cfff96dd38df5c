"""Parallel VAE decode: the latent video split in time over the ranks, exact through halo exchange.

Invariants:
- Rank ``r`` of the group decodes a contiguous range of latent frames (``TemporalSplit``). Before every temporal
  convolution the model adapter calls :func:`exchange_halo`, which swaps the boundary frames with the
  neighbouring ranks; only the ranks at the two ends of the video pad by replication, as the whole-video
  decode does. So every rank computes exactly the frames a whole-video decode computes for its range (same
  inputs to every convolution), for any number of ranks, with two small point-to-point messages per conv.
- A causal video VAE maps latent frame 0 to video frame 0 and latent frame ``k >= 1`` to video frames
  ``T*k - T + 1 .. T*k``; the split converts latent ranges to video ranges with that rule.
- Group rank 0 delivers the frames in temporal order: its own range first, then each other rank's in turn,
  so it never holds more than two ranks' shares and the encoder can take each as it lands.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .state import ParallelState

__all__ = ["TemporalSplit", "exchange_halo", "decode_parallel"]


@dataclass(frozen=True)
class TemporalSplit:
    """Contiguous latent-frame ranges over ``world`` ranks; ranks past ``active`` get nothing."""

    latent_frames: int
    world: int
    temporal_compression: int = 8

    def __post_init__(self) -> None:
        if self.latent_frames < 1 or self.world < 1:
            raise ValueError(f"latent_frames={self.latent_frames} and world={self.world} must both be >= 1")

    @property
    def active(self) -> int:
        """Ranks with at least one latent frame (a rank must hold a frame to pass halos on)."""
        return min(self.world, self.latent_frames)

    def latent_range(self, rank: int) -> tuple[int, int]:
        if rank >= self.active:
            return self.latent_frames, self.latent_frames
        base, extra = divmod(self.latent_frames, self.active)
        start = rank * base + min(rank, extra)
        return start, start + base + (1 if rank < extra else 0)

    def _video_index(self, latent: int) -> int:
        t = self.temporal_compression
        return 0 if latent == 0 else t * latent - t + 1

    def video_range(self, rank: int) -> tuple[int, int]:
        a, b = self.latent_range(rank)
        if a == b:
            return (self.video_frames,) * 2
        return self._video_index(a), self._video_index(b - 1) + (self.temporal_compression if b - 1 > 0 else 1)

    @property
    def video_frames(self) -> int:
        return (self.latent_frames - 1) * self.temporal_compression + 1


def exchange_halo(
    x: torch.Tensor, *, left: int, right: int, split: TemporalSplit, state: ParallelState, dim: int = 2,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Swap boundary frames with the neighbouring ranks along ``dim``.

    Returns ``(from_left, from_right)``: the last ``left`` frames of the previous rank and the first ``right``
    frames of the next one; ``None`` at the ends of the video (the caller pads as the whole decode would).
    """
    rank, active = state.cp_rank, split.active
    prev_rank = state.cp_ranks[rank - 1] if 0 < rank < active and left else None
    next_rank = state.cp_ranks[rank + 1] if rank + 1 < active and right else None
    # What our neighbours need from us: the next rank pads its left side with our last frames, and so on.
    send_next = rank + 1 < active and left
    send_prev = 0 < rank < active and right
    length = x.shape[dim]
    if (send_next and length < left) or (send_prev and length < right):
        raise RuntimeError(f"rank {rank} holds {length} frames, fewer than the halo it must pass on")
    ops, from_left, from_right = [], None, None
    if prev_rank is not None:
        from_left = x.new_empty((*x.shape[:dim], left, *x.shape[dim + 1:]))
        ops.append(dist.P2POp(dist.irecv, from_left, prev_rank, group=state.cp_group))
    if next_rank is not None:
        from_right = x.new_empty((*x.shape[:dim], right, *x.shape[dim + 1:]))
        ops.append(dist.P2POp(dist.irecv, from_right, next_rank, group=state.cp_group))
    if send_next:
        ops.append(dist.P2POp(dist.isend, x.narrow(dim, length - left, left).contiguous(),
                              state.cp_ranks[rank + 1], group=state.cp_group))
    if send_prev:
        ops.append(dist.P2POp(dist.isend, x.narrow(dim, 0, right).contiguous(), state.cp_ranks[rank - 1],
                              group=state.cp_group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return from_left, from_right


def decode_parallel(
    split: TemporalSplit,
    decode_range: Callable[[int, int], np.ndarray],
    *,
    frame_shape: tuple[int, ...],
    state: ParallelState,
) -> Iterator[np.ndarray]:
    """Decode the video over the group; on group rank 0 yield uint8 frames in temporal order.

    ``decode_range(a, b)`` decodes latent frames ``[a, b)`` on this rank (halo exchange inside) and returns the
    uint8 frames of ``split.video_range(rank)``; every rank calls it, idle ranks with an empty range are not
    asked. Every rank must exhaust the iterator.
    """
    rank = state.cp_rank
    a, b = split.latent_range(rank)
    local = decode_range(a, b) if a < b else None
    if local is not None:
        v0, v1 = split.video_range(rank)
        if local.shape != (v1 - v0, *frame_shape):
            raise RuntimeError(f"rank {rank} decoded frames of shape {local.shape}, expected {(v1 - v0, *frame_shape)}")
    if split.active == 1 or state.cp_group is None:
        if local is not None:
            yield local
        return
    if rank != 0:
        if local is not None:
            dist.send(torch.from_numpy(np.ascontiguousarray(local)).to(state.device), state.cp_ranks[0],
                      group=state.cp_group)
        return
    yield local
    for src in range(1, split.active):
        v0, v1 = split.video_range(src)
        buf = torch.empty((v1 - v0, *frame_shape), dtype=torch.uint8, device=state.device)
        dist.recv(buf, state.cp_ranks[src], group=state.cp_group)
        yield buf.cpu().numpy()
