"""Parallel, streamed VAE decode: the video cut in time into pieces that the ranks decode as a pipeline.

Invariants:
- :class:`TemporalSplit` cuts the *output* into pieces of whole latent frames, round-major: rank ``r`` decodes
  piece ``k * active + r`` in its round ``k``, its pieces in order. Pieces tile the video in temporal order; each
  holds at least one latent frame; cut to equal frames, at most ``max(frames_per_rank, 2)`` (more than the window
  only where a round would otherwise leave an active rank without a frame); cut to equal work (``cost``), about
  that many.
- A causal video VAE maps latent frame 0 to video frame 0 and latent frame ``k >= 1`` to video frames
  ``T*k - T + 1 .. T*k``; the split converts latent ranges to video ranges with that rule.
- :class:`FrameRelay` is the one communication primitive a model adapter needs: at each temporal op of the decoder,
  a piece hands the next piece's owner the last few input frames that piece reads (a causal VAE's ops read a few
  frames back; the adapter ends each stage of a piece where the next stage's end needs, so nothing is read
  ahead). It does no arithmetic, so the adapter can make every output frame depend on exactly the input frames a
  whole-video decode uses. A piece waits only for the previous piece's frames of the op it is at, never for a
  whole piece: with ``N`` ranks, ``N`` pieces are decoded at once, each a few ops behind the one before
  (NOTE(pipeline): an earlier design cut each round's every op over the ranks, which made every rank wait at every
  op for the slowest; on a shared machine those waits cost 6-15% of the decode).
- :func:`decode_parallel` delivers frames on group rank 0 in temporal order (its piece of round ``k``, then the
  other ranks' pieces of round ``k`` after its piece of round ``k + 1``), so rank 0 holds at most two rounds'
  frames and the encoder can take each as it lands.
"""

from __future__ import annotations

import functools
import itertools
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
    "FrameRelay",
    "Frames",
    "ProgressiveDecode",
    "SegmentedSplit",
    "Split",
    "TemporalSplit",
    "decode_parallel",
    "resolve_frames_per_rank",
    "video_index",
]

AUTO = "auto"
DEFAULT_FRAMES_PER_RANK: int | str | None = AUTO
"""Latent frames (8 video frames each) a rank decodes per round by default (see :func:`resolve_frames_per_rank`):
the unit of decode memory and of streaming. ``--decode-frames-per-rank`` sets it per deployment."""
ROUND_PIXELS = 4 * 8 * 128 * 96
"""Output pixels per rank per round that ``auto`` aims for: pieces large enough that their convolutions run at
full speed and the per-op messages stay small against them; memory and the time to the first frame grow with the
piece, so no larger. Measured on 257 frames at 128x96 (``bench/decode.py``, a real-width VAE): pieces of 4 latent
frames decode on 2 ranks in 0.59x of one rank's time (200 MiB per rank, first byte at 0.18 of the total); the whole
video at once holds 537 MiB. (With the earlier lockstep decode, 4 gave 0.60x and 2 gave 0.66x.)"""


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


def video_index(latent: int, temporal_compression: int) -> int:
    """The first video frame of latent frame ``latent`` (a causal video VAE: latent frame 0 is video frame 0)."""
    t = temporal_compression
    return 0 if latent == 0 else t * latent - t + 1


class _Rounds:
    """What a split's rounds and pieces share: piece ``k * active + r`` is rank ``r``'s of round ``k``."""

    active: int
    rounds: int
    latent_frames: int

    def latent_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        raise NotImplementedError

    def round_of(self, latent: int) -> int:
        """The round whose pieces hold latent frame ``latent``."""
        if not 0 <= latent < self.latent_frames:
            raise IndexError(f"latent frame {latent} is outside 0..{self.latent_frames - 1}")
        return next(k for k in range(self.rounds) if latent < self.latent_range(self.active - 1, k)[1])

    @property
    def pieces(self) -> int:
        return self.rounds * self.active

    def piece(self, rank: int, round: int) -> int:
        """The index of ``rank``'s piece of ``round`` in temporal order."""
        return round * self.active + rank

    def owner(self, piece: int) -> int:
        """The rank that decodes ``piece``."""
        return piece % self.active


@dataclass(frozen=True)
class TemporalSplit(_Rounds):
    """Pieces of whole latent frames over ``rounds`` x ``active`` ranks; ranks past ``active`` get nothing."""

    latent_frames: int
    world: int
    temporal_compression: int = 8
    frames_per_rank: int | None = None
    """Latent frames each rank outputs per round (bounds its decode memory; 2 where fewer would leave an active rank
    without a frame); ``None``: the whole video in one round."""
    cost: tuple[float, ...] | None = None
    """``cost[j]``: the work of decoding the video up to latent frame ``j`` (``latent_frames + 1`` non-decreasing
    values from 0; the adapter's ``decode_cost``). Pieces are then cut to equal work instead of equal frames: the
    first piece also runs the decoder's look-ahead, so it gets fewer frames. ``None``: equal frames."""

    def __post_init__(self) -> None:
        if self.latent_frames < 1 or self.world < 1:
            raise ValueError(f"latent_frames={self.latent_frames} and world={self.world} must both be >= 1")
        if self.frames_per_rank is not None and self.frames_per_rank < 1:
            raise ValueError(f"frames_per_rank={self.frames_per_rank} must be >= 1 (or None for one round)")
        if self.cost is not None and (len(self.cost) != self.latent_frames + 1 or self.cost[0] != 0
                                      or any(b < a for a, b in itertools.pairwise(self.cost))):
            raise ValueError(f"cost must be {self.latent_frames + 1} non-decreasing values from 0, got {self.cost}")

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

    @functools.cached_property
    def _starts(self) -> tuple[int, ...]:
        pieces, frames = self.rounds * self.active, self.latent_frames
        if self.cost is None:
            base, extra = divmod(frames, pieces)
            return tuple(p * base + min(p, extra) for p in range(pieces + 1))
        starts = [0]
        for p in range(1, pieces):
            target = self.cost[-1] * p / pieces
            # At least one frame in this piece and in each piece after it; nearest to an equal share of the work.
            allowed = range(starts[-1] + 1, frames - (pieces - p) + 1)
            starts.append(min(allowed, key=lambda j, target=target: abs(self.cost[j] - target)))
        return (*starts, frames)

    def _piece_start(self, piece: int) -> int:
        return self._starts[piece]

    def latent_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        """The latent frames whose video frames ``rank`` outputs in ``round``."""
        if rank >= self.active:
            return self.latent_frames, self.latent_frames
        if not 0 <= round < self.rounds:
            raise IndexError(f"round={round} is outside 0..{self.rounds - 1}")
        piece = self.piece(rank, round)
        return self._piece_start(piece), self._piece_start(piece + 1)

    def video_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        a, b = self.latent_range(rank, round)
        return video_index(a, self.temporal_compression), video_index(b, self.temporal_compression)

    @property
    def video_frames(self) -> int:
        return (self.latent_frames - 1) * self.temporal_compression + 1

    def afresh(self, round: int) -> bool:
        """Whether round ``round`` reads nothing the rounds before it leave (no frames relayed into it): the first."""
        return round == 0


@dataclass(frozen=True)
class SegmentedSplit(_Rounds):
    """A video of ``count`` segments that the VAE decodes each alone, its caches afresh at each (Helios' chunks),
    cut to ``video_frames``: segment ``s`` is the latent frames ``[s * n, (s + 1) * n)`` (``n =
    segment.latent_frames``) and the video frames ``[s * m, (s + 1) * m)`` (``m = segment.video_frames``), cut in
    pieces as ``segment`` cuts one, its rounds after the segments' before it. No piece spans two segments, and no
    frame is relayed from one segment to the next (:meth:`afresh`)."""

    segment: TemporalSplit
    count: int
    video_frames: int
    """The frames delivered: more than ``count - 1`` segments make, at most ``count`` (the last piece's frames past it
    are decoded, not delivered)."""

    def __post_init__(self) -> None:
        m = self.segment.video_frames
        if self.count < 1 or not (self.count - 1) * m < self.video_frames <= self.count * m:
            raise ValueError(f"video_frames={self.video_frames} is not within the last of {self.count} segments of "
                             f"{m} frames")
        if self.video_range(self.active - 1, self.rounds - 1)[0] >= self.video_frames:
            raise ValueError(f"video_frames={self.video_frames} leaves the last piece of {self.segment} no frame")

    @property
    def latent_frames(self) -> int:
        return self.count * self.segment.latent_frames

    @property
    def world(self) -> int:
        return self.segment.world

    @property
    def temporal_compression(self) -> int:
        return self.segment.temporal_compression

    @property
    def active(self) -> int:
        return self.segment.active

    @property
    def rounds(self) -> int:
        return self.count * self.segment.rounds

    def latent_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        if rank >= self.active:
            return self.latent_frames, self.latent_frames
        if not 0 <= round < self.rounds:
            raise IndexError(f"round={round} is outside 0..{self.rounds - 1}")
        s, k = divmod(round, self.segment.rounds)
        a, b = self.segment.latent_range(rank, k)
        n = self.segment.latent_frames
        return s * n + a, s * n + b

    def video_range(self, rank: int, round: int = 0) -> tuple[int, int]:
        if rank >= self.active:
            return self.video_frames, self.video_frames
        s, k = divmod(round, self.segment.rounds)
        a, b = self.segment.video_range(rank, k)
        m = self.segment.video_frames
        return min(s * m + a, self.video_frames), min(s * m + b, self.video_frames)

    def afresh(self, round: int) -> bool:
        """Whether round ``round`` reads nothing the rounds before it leave: a segment's first."""
        return round % self.segment.rounds == 0


Split = TemporalSplit | SegmentedSplit
"""A decode's pieces: of one video, or of segments each decoded alone."""


class Frames:
    """Frames ``[lo, hi)`` of one decoder stage, held as pieces in temporal order (the frames handed on by the
    previous piece, then this piece's own): :meth:`take` copies only when a range spans pieces."""

    def __init__(self, pieces: Sequence[tuple[int, torch.Tensor]], lo: int, hi: int, dim: int = 2):
        if not pieces:
            raise ValueError("Frames needs at least one (first frame, tensor) piece, even an empty one")
        self.pieces, self.lo, self.hi, self.dim = list(pieces), lo, hi, dim

    def take(self, a: int, b: int) -> torch.Tensor:
        """Frames ``[a, b)`` (within ``[lo, hi)``): a view where one piece holds them all."""
        if not self.lo <= a <= b <= self.hi:
            raise RuntimeError(f"frames {a}..{b} are outside the {self.lo}..{self.hi} held")
        parts = []
        for first, piece in self.pieces:
            lo, hi = max(a, first), min(b, first + piece.shape[self.dim])
            if lo < hi:
                parts.append(piece.narrow(self.dim, lo - first, hi - lo))
        if not parts:
            return self.pieces[0][1].narrow(self.dim, 0, 0)
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)


class FrameRelay:
    """The frames each piece of a :class:`TemporalSplit` hands the next piece, one message per temporal op.

    The owner of piece ``p`` (:meth:`TemporalSplit.owner`) sends, at each op, the last frames of the op's input that
    piece ``p + 1`` reads to that piece's owner as soon as it has them (non-blocking), and receives the frames before
    its own from piece ``p - 1``'s owner when it reaches the op. Every rank decodes its pieces in order and every
    piece runs the same ops in the same order, so the messages from one rank to the next pair up in order (no tags:
    NCCL has none); each direction has its own group (``ParallelState.relay_group``, NOTE(nccl) there). A piece that
    follows one of its own rank's keeps the frames locally instead (one rank).
    """

    def __init__(self, state: ParallelState):
        self.state = state
        self._sending: list[tuple[object, dist.Work, torch.Tensor]] = []
        self._kept: dict[object, torch.Tensor] = {}

    @property
    def pending(self) -> int:
        """Messages handed on and not yet known to have left."""
        return len(self._sending)

    def hand_on(self, key: object, frames: torch.Tensor, *, to: int) -> None:
        """Give ``frames`` (op ``key``'s input frames that the next piece reads) to group rank ``to``'s next piece;
        this rank's own next piece finds them with :meth:`take_over`."""
        # NOTE(relay): a copy, so that the message neither pins the activation it is a view of nor changes with it.
        frames = frames.clone(memory_format=torch.contiguous_format)
        if to == self.state.cp_rank:
            self._kept[key] = frames
            return
        self._sending = [(k, w, t) for k, w, t in self._sending if not w.is_completed()]
        group = self.state.relay_group(self.state.cp_rank, to)
        self._sending.append((key, dist.isend(frames, self.state.cp_ranks[to], group=group), frames))

    def take_over(self, key: object, like: torch.Tensor, count: int, *, src: int, dim: int = 2) -> torch.Tensor:
        """The ``count`` frames the previous piece (on group rank ``src``) handed on for op ``key``; shaped as
        ``like`` but for the frame count (blocks until they arrive)."""
        if src == self.state.cp_rank:
            frames = self._kept.pop(key, None)
            if frames is None or frames.shape[dim] != count:
                raise RuntimeError(f"op {key}: the previous piece kept {None if frames is None else frames.shape[dim]} "
                                   f"frames, this piece needs {count}: pieces must run in order")
            return frames
        buf = like.new_empty((*like.shape[:dim], count, *like.shape[dim + 1:]))
        dist.recv(buf, self.state.cp_ranks[src], group=self.state.relay_group(src, self.state.cp_rank))
        self._settle(key)
        return buf

    def _settle(self, key: object) -> None:
        """Forget the earlier rounds' messages for op ``key``: they have been received.

        NOTE(relay): gloo reports a send complete only once it is waited on, so pruning by ``is_completed`` alone
        kept every message of a long video (and its frames) until the end. A message this rank handed on for op
        ``key`` in an earlier round has certainly been received once this one arrives: the pieces go round the ring
        in order, and the frames just received left the previous rank only after every rank between had taken
        over op ``key`` of the round before, this rank's message included. So these waits return at once."""
        keep = []
        for k, work, frames in self._sending:
            if k == key:
                work.wait()
            else:
                keep.append((k, work, frames))
        self._sending = keep

    def flush(self) -> None:
        """Wait until every frame this rank handed on has left (call after its last piece)."""
        for _, work, _ in self._sending:
            work.wait()
        self._sending, self._kept = [], {}


def decode_parallel(
    split: Split,
    decode_range: Callable[[int, int], np.ndarray],
    *,
    frame_shape: tuple[int, ...],
    state: ParallelState,
) -> Iterator[np.ndarray]:
    """Decode the video over the group, piece by piece; on group rank 0 yield uint8 frames in temporal order.

    ``decode_range(a, b)`` is called on every active rank once per round, rounds in order, with the latent frames
    ``[a, b) = split.latent_range(rank, round)`` of this rank's piece (the frames the pieces hand each other pass
    inside, see :class:`FrameRelay`); it returns that piece's uint8 frames ``[F, H, W, 3]``. Every rank must
    exhaust the iterator.
    """
    yield from ProgressiveDecode(split, decode_range, frame_shape=frame_shape, state=state).advance(None)


class ProgressiveDecode:
    """:func:`decode_parallel` in steps, for latents that become final a part at a time (a long video's windows):
    each :meth:`advance` decodes the rounds whose pieces read only final latent frames, so the video streams while
    later latents are still being made. The rounds run in order across the calls and the pieces hand each other
    frames across them as within one (the decode is the same as :func:`decode_parallel`'s)."""

    def __init__(self, split: Split, decode_range: Callable[[int, int], np.ndarray], *,
                 frame_shape: tuple[int, ...], state: ParallelState,
                 reads: Callable[[int, int], int] | None = None):
        """``reads(a, b)``: the latent frames ``[0, reads)`` that decoding the piece ``[a, b)`` reads (its decoder's
        look-ahead included); ``None``: all of them."""
        self.split, self.decode_range, self.frame_shape, self.state = split, decode_range, frame_shape, state
        self.reads = reads or (lambda a, b: split.latent_frames)
        self.rounds_done = 0
        self._sending: tuple[dist.Work, torch.Tensor] | None = None

    def readable(self, final: int | None) -> int:
        """How many rounds can be decoded once the latent frames ``[0, final)`` are final (``None``: all are)."""
        split = self.split
        if final is None or final >= split.latent_frames:
            return split.rounds
        k = self.rounds_done
        # The same on every rank: the last piece of a round reads furthest.
        while k < split.rounds and self.reads(*split.latent_range(split.active - 1, k)) <= final:
            k += 1
        return k

    @property
    def done(self) -> bool:
        return self.rounds_done == self.split.rounds

    def advance(self, final: int | None) -> Iterator[np.ndarray]:
        """Decode the rounds that latent frames ``[0, final)`` allow; on group rank 0 yield their frames in temporal
        order. Every rank must call it with the same ``final`` and exhaust the iterator."""
        split, state, rank = self.split, self.state, self.state.cp_rank
        first, last = self.rounds_done, self.readable(final)
        self.rounds_done = last
        if rank >= split.active or first == last:
            return
        alone = split.active == 1 or state.cp_group is None

        def others(k: int) -> Iterator[np.ndarray]:
            """Round ``k``'s pieces of ranks 1.. (decoded while rank 0 decoded its piece of round ``k + 1``)."""
            for src in range(1, split.active):
                v0, v1 = split.video_range(src, k)
                buf = torch.empty((v1 - v0, *self.frame_shape), dtype=torch.uint8, device=state.device)
                dist.recv(buf, state.cp_ranks[src], group=state.cp_group)
                yield buf.cpu().numpy()

        for k in range(first, last):
            a, b = split.latent_range(rank, k)
            local = self.decode_range(a, b)
            v0, v1 = split.video_range(rank, k)
            if local.shape != (v1 - v0, *self.frame_shape):
                raise RuntimeError(f"rank {rank} decoded frames of shape {local.shape} in round {k}, expected "
                                   f"{(v1 - v0, *self.frame_shape)}")
            if alone:
                yield local
                continue
            if rank != 0:
                if self._sending is not None:
                    self._sending[0].wait()
                buf = torch.from_numpy(np.ascontiguousarray(local)).to(state.device)
                # Non-blocking: this rank goes on to its next piece while rank 0 decodes its own and encodes.
                self._sending = (dist.isend(buf, state.cp_ranks[0], group=state.cp_group), buf)
                continue
            # NOTE(order): the pieces between rank 0's last one and this one were decoded alongside this one; rank 0
            # receives them only now, after its own piece's relayed frames, in the order their owners sent.
            if k > first:
                yield from others(k - 1)
            yield local
            del local
        if rank == 0 and not alone:
            yield from others(last - 1)
        if self._sending is not None and (self.done or rank == 0):
            self._sending[0].wait()
            self._sending = None
