"""Shard plans: how a sequence of ``orig_len`` tokens is split over ``world`` ranks.

Invariants:
- Rank ``r`` owns the contiguous token range ``[r * local_len, (r + 1) * local_len)`` of the sequence padded
  to ``world * local_len``; the ``num_pad`` padding tokens therefore sit at the very end of the padded
  sequence (on the last rank or ranks), never between real tokens.
- A plan is pure arithmetic, frozen, computed once per request and shared by every tensor of that
  sequence (latents, RoPE cos/sin, per-token timesteps), so they are always split the same way.
- ``gather`` always trims the padding; attention never lets a padded key be attended (see ``attention``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["ShardPlan"]


@dataclass(frozen=True)
class ShardPlan:
    """The split of one sequence over a context-parallel group."""

    orig_len: int
    """Tokens in the real (unpadded) sequence."""
    world: int
    """Number of ranks the sequence is split over."""

    def __post_init__(self) -> None:
        if self.orig_len < 1:
            raise ValueError(f"orig_len={self.orig_len} must be >= 1 token")
        if self.world < 1:
            raise ValueError(f"world={self.world} must be >= 1 rank")

    @property
    def local_len(self) -> int:
        """Tokens every rank holds, padding included (the same on every rank)."""
        return -(-self.orig_len // self.world)

    @property
    def padded_len(self) -> int:
        return self.local_len * self.world

    @property
    def num_pad(self) -> int:
        return self.padded_len - self.orig_len

    def valid_len(self, rank: int) -> int:
        """Real (non-padding) tokens held by ``rank``."""
        self._check_rank(rank)
        return max(0, min(self.local_len, self.orig_len - rank * self.local_len))

    def token_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of the real tokens ``rank`` owns in the unpadded sequence."""
        start = min(rank * self.local_len, self.orig_len)
        return start, start + self.valid_len(rank)

    def local_valid_mask(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[local_len]``: True for real tokens held by ``rank``, False for padding."""
        return torch.arange(self.local_len, device=device) < self.valid_len(rank)

    def pad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Pad ``x`` (``orig_len`` long on ``dim``) with zeros to ``padded_len``."""
        self._check_len(x, dim, self.orig_len)
        if self.num_pad == 0:
            return x
        dim = dim % x.ndim
        spec = [0, 0] * (x.ndim - dim - 1) + [0, self.num_pad]
        return F.pad(x, spec)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The ``local_len`` slice of the full tensor ``x`` that ``rank`` owns (zero-padded at the end)."""
        self._check_rank(rank)
        self._check_len(x, dim, self.orig_len)
        start, stop = self.token_range(rank)
        local = x.narrow(dim, start, stop - start)
        missing = self.local_len - (stop - start)
        if missing:
            dim = dim % x.ndim
            local = F.pad(local, [0, 0] * (x.ndim - dim - 1) + [0, missing])
        return local.contiguous()

    def trim(self, x_padded: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Drop the padding from a tensor that is ``padded_len`` long on ``dim``."""
        self._check_len(x_padded, dim, self.padded_len)
        return x_padded.narrow(dim, 0, self.orig_len)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is outside this plan's world of {self.world} ranks")

    @staticmethod
    def _check_len(x: torch.Tensor, dim: int, expected: int) -> None:
        if x.shape[dim] != expected:
            raise ValueError(f"tensor of shape {tuple(x.shape)} has {x.shape[dim]} tokens on dim {dim}; "
                             f"this plan expects {expected}")
