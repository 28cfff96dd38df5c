"""Parallel, streamed VAE decode: the video cut in time into rounds x ranks pieces, exact through frame exchange.

Invariants:
- :class:`TemporalSplit` cuts the *output* into pieces of whole latent frames, round-major: round ``k`` is decoded
  by the ``active`` ranks together, rank ``r`` producing piece ``k * active + r``. Pieces tile the video in
  temporal order; each holds at least one latent frame and at most ``max(frames_per_rank, 2)`` (more than the
  window only where a round would otherwise leave an active rank without a frame).
- A causal video VAE maps latent frame 0 to video frame 0 and latent frame ``k >= 1`` to video frames
  ``T*k - T + 1 .. T*k``; the split converts latent ranges to video ranges with that rule.
- :func:`exchange_frames` is the one communication primitive a model adapter needs: a sequence of frames at one
  stage of the decoder is cut over the ranks; every rank gets exactly the frames it needs (its neighbours'
  boundary frames, or the previous rounds' last frames, which group rank 0 keeps), by point-to-point messages
  between the ranks that hold and need them. It does no arithmetic, so the adapter can make every output frame
  depend on exactly the input frames a whole-video decode uses.
- :func:`decode_parallel` delivers frames on group rank 0 in temporal order, round by round (its own piece, then
  each other rank's in turn), so rank 0 holds at most two pieces and the encoder can take each as it lands.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .state import ParallelState

__all__ = [
    "AUTO",
    "DEFAULT_FRAMES_PER_RANK",
    "FrameHistory",
    "TemporalSplit",
    "decode_parallel",
    "exchange_frames",
    "resolve_frames_per_rank",
]

AUTO = "auto"
DEFAULT_FRAMES_PER_RANK: int | str | None = AUTO
"""Latent frames (8 video frames each) a rank decodes per round by default (see :func:`resolve_frames_per_rank`):
the unit of decode memory and of streaming. ``--decode-frames-per-rank`` sets it per deployment."""
ROUND_PIXELS = 4 * 8 * 128 * 96
"""Output pixels per rank per round that ``auto`` aims for. Every temporal op of a round waits for its neighbours'
frames, so a round's convolutions must be large enough for those waits (and the jitter between two ranks' op times)
to stay small against them; memory grows with the round, so no larger. Measured on 257 frames at 128x96 on 2 ranks
(``bench/decode.py``, LTX-Video 0.9.0 VAE): rounds of 4 latent frames per rank decode in 0.60x of one rank's time
(146 MiB per rank, first byte at 0.29 of the total), rounds of 2 in 0.66x (107 MiB, 0.13); the whole video at once
holds 537 MiB."""


def resolve_frames_per_rank(setting: int | str | None, *, height: int, width: int,
                            temporal_compression: int = 8) -> int | None:
    """The round size for a video of ``height`` x ``width``: an ``int`` or ``None`` (one round) as given; ``"auto"``:
    enough latent frames to reach :data:`ROUND_PIXELS` of output per rank, at least 2 and at most 4 (4 at 128x96, 2
    from 192x128 frames up, where one latent frame's convolutions are already large)."""
    if setting != AUTO:
        if setting is not None and (isinstance(setting, str) or setting < 1):
            raise ValueError(f"frames per rank {setting!r}: expected a whole number >= 1, 'auto' or None (one round)")
        return setting
    per_latent_frame = temporal_compression * height * width
    return min(4, max(2, -(-ROUND_PIXELS // per_latent_frame)))


@dataclass(frozen=True)
class TemporalSplit:
    """Pieces of whole latent frames over ``rounds`` x ``active`` ranks; ranks past ``active`` get nothing."""

    latent_frames: int
    world: int
    temporal_compression: int = 8
    frames_per_rank: int | None = None
    """Latent frames each rank outputs per round (bounds its decode memory; 2 where fewer would leave an active rank
    without a frame); ``None``: the whole video in one round."""

    def __post_init__(self) -> None:
        if self.latent_frames < 1 or self.world < 1:
            raise ValueError(f"latent_frames={self.latent_frames} and world={self.world} must both be >= 1")
        if self.frames_per_rank is not None and self.frames_per_rank < 1:
            raise ValueError(f"frames_per_rank={self.frames_per_rank} must be >= 1 (or None for one round)")

    @property
    def active(self) -> int:
        """Ranks with at least one latent frame in every round."""
        return min(self.world, self.latent_frames)

    @property
    def rounds(self) -> int:
        if self.frames_per_rank is None:
            return 1
        # At most frames_per_rank per piece, and at least one frame in every piece.
        return min(math.ceil(self.latent_frames / (self.active * self.frames_per_rank)),
                   self.latent_frames // self.active)

    def _piece_start(self, piece: int) -> int:
        base, extra = divmod(self.latent_frames, self.rounds * self.active)
        return piece * base + min(piece, extra)

    def latent_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        """The latent frames whose video frames ``rank`` outputs in ``round``."""
        if rank >= self.active:
            return self.latent_frames, self.latent_frames
        if not 0 <= round < self.rounds:
            raise IndexError(f"round={round} is outside 0..{self.rounds - 1}")
        piece = round * self.active + rank
        return self._piece_start(piece), self._piece_start(piece + 1)

    def round_of(self, latent: int) -> int:
        """The round whose pieces hold latent frame ``latent``."""
        if not 0 <= latent < self.latent_frames:
            raise IndexError(f"latent frame {latent} is outside 0..{self.latent_frames - 1}")
        return next(k for k in range(self.rounds) if latent < self.latent_range(self.active - 1, k)[1])

    def _video_index(self, latent: int) -> int:
        t = self.temporal_compression
        return 0 if latent == 0 else t * latent - t + 1

    def video_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        a, b = self.latent_range(rank, round)
        return self._video_index(a), self._video_index(b)

    def video_cuts(self, round: int) -> list[int]:
        """The round's video frame boundaries: rank ``r`` outputs ``[cuts[r], cuts[r + 1])``."""
        return [self.video_range(r, round)[0] for r in range(self.active)] + [self.video_range(self.active - 1,
                                                                                                round)[1]]

    @property
    def video_frames(self) -> int:
        return (self.latent_frames - 1) * self.temporal_compression + 1


@dataclass
class FrameHistory:
    """The last frames of one decoder stage before the current round; held by group rank 0 only."""

    start: int = 0
    frames: torch.Tensor | None = None


def exchange_frames(
    x: torch.Tensor,
    *,
    cuts: Sequence[int],
    needs: Sequence[tuple[int, int]],
    length: int,
    history: FrameHistory,
    keep: int,
    state: ParallelState,
    dim: int = 2,
) -> torch.Tensor:
    """Give every rank the frames it needs of a sequence cut over the active ranks.

    The sequence (``length`` frames along ``dim``: the whole video at one decoder stage) is cut as ``[cuts[r],
    cuts[r + 1])`` on rank ``r`` of the ``len(cuts) - 1`` active ranks, which holds it as ``x``; frames before
    ``cuts[0]`` belong to earlier rounds, of which group rank 0 holds the last ``keep`` in ``history``. Returns
    frames ``needs[rank]`` (clamped to ``[0, length)``) on this rank, and on rank 0 moves ``history`` on to the
    last ``keep`` frames before ``cuts[-1]``. Every active rank calls this with the same arguments but ``x``; a
    rank may need frames of any rank (not only its neighbours') and of the history, but none before
    ``cuts[0] - keep`` and none after ``cuts[-1]``.
    """
    active, rank = len(cuts) - 1, state.cp_rank
    if x.shape[dim] != cuts[rank + 1] - cuts[rank]:
        raise RuntimeError(f"rank {rank} holds {x.shape[dim]} frames, its cut is {cuts[rank]}..{cuts[rank + 1]}")
    hist_lo = max(0, cuts[0] - keep)
    if rank == 0:
        held = 0 if history.frames is None else history.frames.shape[dim]
        if cuts[0] > hist_lo and (history.start, held) != (hist_lo, cuts[0] - hist_lo):
            raise RuntimeError(f"history holds {held} frames from {history.start}, the round needs "
                               f"{hist_lo}..{cuts[0]}: rounds must run in order")
    # Holders in temporal order: rank 0's history (slot 0), then each rank's piece (slot r + 1).
    holders = [(0, hist_lo, cuts[0])] + [(r, cuts[r], cuts[r + 1]) for r in range(active)]
    wants = []
    for q in range(active):
        lo, hi = max(0, needs[q][0]), min(length, needs[q][1])
        if lo < hi and (lo < hist_lo or hi > cuts[-1]):
            raise RuntimeError(f"rank {q} needs frames {lo}..{hi}, outside the round {cuts[0]}..{cuts[-1]} and the "
                               f"{keep} frames kept before it")
        wants.append([(lo, max(lo, hi))])
    if keep:
        wants[0].append((max(0, cuts[-1] - keep), cuts[-1]))  # the next rounds' history

    def held(slot: int, a: int, b: int) -> torch.Tensor:
        if slot == 0:
            return history.frames.narrow(dim, a - history.start, b - a)
        return x.narrow(dim, a - cuts[rank], b - a)

    # Every rank walks the same (receiver, want, holder) order, so sends and receives pair up in order.
    mine: list[list[tuple[int, int, int, int]]] = [[] for _ in wants[rank]]
    ops, received = [], {}
    for q in range(active):
        for i, (lo, hi) in enumerate(wants[q]):
            for slot, (holder, a, b) in enumerate(holders):
                a, b = max(lo, a), min(hi, b)
                if a >= b:
                    continue
                if q == rank:
                    mine[i].append((holder, slot, a, b))
                if holder == q:
                    continue
                if rank == holder:
                    ops.append(dist.P2POp(dist.isend, held(slot, a, b).contiguous(), state.cp_ranks[q],
                                          group=state.cp_group))
                elif rank == q:
                    buf = x.new_empty((*x.shape[:dim], b - a, *x.shape[dim + 1:]))
                    received[i, slot, a] = buf
                    ops.append(dist.P2POp(dist.irecv, buf, state.cp_ranks[holder], group=state.cp_group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def assemble(i: int) -> torch.Tensor:
        pieces = [received[i, slot, a] if holder != rank else held(slot, a, b) for holder, slot, a, b in mine[i]]
        if not pieces:
            return x.narrow(dim, 0, 0)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    window = assemble(0)
    if rank == 0 and keep:
        # NOTE(history): a copy, so that the kept frames do not pin the whole activation they are a view of.
        history.start, history.frames = max(0, cuts[-1] - keep), assemble(1).clone()
    return window


def decode_parallel(
    split: TemporalSplit,
    decode_range: Callable[[int, int], np.ndarray],
    *,
    frame_shape: tuple[int, ...],
    state: ParallelState,
) -> Iterator[np.ndarray]:
    """Decode the video over the group, round by round; on group rank 0 yield uint8 frames in temporal order.

    ``decode_range(a, b)`` is called on every active rank once per round, rounds in order, with the latent
    frames ``[a, b) = split.latent_range(rank, round)`` whose video frames this rank outputs in that round
    (exchanges between ranks inside); it returns those uint8 frames ``[F, H, W, 3]``. Every rank must exhaust the
    iterator.
    """
    rank = state.cp_rank
    if rank >= split.active:
        return
    alone = split.active == 1 or state.cp_group is None
    sending: tuple[dist.Work, torch.Tensor] | None = None
    for k in range(split.rounds):
        a, b = split.latent_range(rank, k)
        local = decode_range(a, b)
        v0, v1 = split.video_range(rank, k)
        if local.shape != (v1 - v0, *frame_shape):
            raise RuntimeError(f"rank {rank} decoded frames of shape {local.shape} in round {k}, expected "
                               f"{(v1 - v0, *frame_shape)}")
        if alone:
            yield local
            continue
        if rank != 0:
            if sending is not None:
                sending[0].wait()
            buf = torch.from_numpy(np.ascontiguousarray(local)).to(state.device)
            # Non-blocking: this rank goes on to the next round while rank 0 encodes this one.
            sending = (dist.isend(buf, state.cp_ranks[0], group=state.cp_group), buf)
            continue
        yield local
        del local
        for src in range(1, split.active):
            v0, v1 = split.video_range(src, k)
            buf = torch.empty((v1 - v0, *frame_shape), dtype=torch.uint8, device=state.device)
            dist.recv(buf, state.cp_ranks[src], group=state.cp_group)
            yield buf.cpu().numpy()
    if sending is not None:
        sending[0].wait()
