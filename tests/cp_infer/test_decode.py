"""The decode engine: the round x rank split, the frame exchange and the in-order delivery on group rank 0.

The split is pure arithmetic (no process group). The exchange and the delivery run for real on 1-4 ranks; the
exchange moves frames without arithmetic, so it must return them bit for bit.
"""

import random

import numpy as np
import pytest
import torch

from cp_infer.decode import (
    AUTO,
    ROUND_PIXELS,
    FrameHistory,
    TemporalSplit,
    decode_parallel,
    exchange_frames,
    resolve_frames_per_rank,
)

from ..worker_groups import groups_by_world

groups = groups_by_world()


@pytest.mark.parametrize("latent_frames", [1, 2, 3, 7, 13, 33])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("frames_per_rank", [None, 1, 2, 3])
def test_split_tiles_the_video_round_by_round(latent_frames, world, frames_per_rank):
    split = TemporalSplit(latent_frames=latent_frames, world=world, frames_per_rank=frames_per_rank)
    latent, video = [], []
    for k in range(split.rounds):
        cuts = split.video_cuts(k)
        for r in range(world):
            a, b = split.latent_range(r, k)
            assert (a < b) == (r < split.active), "every active rank has frames in every round, the others none"
            if r >= split.active:
                continue
            # The window, or 2 where a round may not leave an active rank without a frame.
            assert frames_per_rank is None or b - a <= max(frames_per_rank, 2)
            assert split.video_range(r, k) == (cuts[r], cuts[r + 1])
            assert all(split.round_of(i) == k for i in range(a, b))
            latent.extend(range(a, b))
            video.extend(range(*split.video_range(r, k)))
    assert latent == list(range(latent_frames))
    assert video == list(range(split.video_frames))
    if frames_per_rank is None:
        assert split.rounds == 1
    else:
        # As many rounds as the window asks for, unless a round would leave a rank without a frame.
        wanted = -(-latent_frames // (split.active * frames_per_rank))
        assert split.rounds == min(wanted, latent_frames // split.active)


def test_split_refuses_bad_values():
    with pytest.raises(ValueError, match="frames_per_rank=0"):
        TemporalSplit(latent_frames=5, world=2, frames_per_rank=0)
    with pytest.raises(ValueError, match="latent_frames=0"):
        TemporalSplit(latent_frames=0, world=2)


@pytest.mark.parametrize(("height", "width", "expected"), [
    (64, 96, 4), (96, 128, 4), (128, 128, 3), (128, 192, 2), (256, 384, 2), (704, 1216, 2)])
def test_auto_round_size_follows_the_frame_size(height, width, expected):
    got = resolve_frames_per_rank(AUTO, height=height, width=width)
    assert got == expected
    # Enough output per rank per round, unless capped at 4; never fewer than 2 latent frames.
    assert got == 4 or got == 2 or got * 8 * height * width >= ROUND_PIXELS > (got - 1) * 8 * height * width


def test_explicit_round_sizes_pass_through_and_bad_ones_are_refused():
    assert resolve_frames_per_rank(3, height=704, width=1216) == 3
    assert resolve_frames_per_rank(None, height=64, width=96) is None
    for bad in (0, -1, "two"):
        with pytest.raises(ValueError, match="expected a whole number >= 1, 'auto' or None"):
            resolve_frames_per_rank(bad, height=64, width=96)


def _random_rounds(rng, length, active, keep, rounds):
    """Round boundaries and per-rank cuts/needs that obey exchange_frames' contract."""
    ends = sorted(rng.sample(range(1, length), rounds - 1)) if rounds > 1 else []
    ends = [0, *ends, length]
    plan = []
    for k in range(rounds):
        lo, hi = ends[k], ends[k + 1]
        inner = sorted(rng.choices(range(lo, hi + 1), k=active - 1))  # empty pieces allowed
        cuts = [lo, *inner, hi]
        needs = []
        for _ in range(active):
            first = max(0, lo - keep)  # the earliest frame the history can serve
            a = rng.randrange(first - 2 if first == 0 else first, hi + 1)  # before frame 0: clamped
            b = rng.randrange(a, hi + 1) if a < hi else a
            needs.append((a, b))
        plan.append((cuts, needs))
    return plan


def _exchange(state, seed, length, keep, rounds):
    rng = random.Random(seed)
    active = state.cp_size
    plan = _random_rounds(rng, length, active, keep, rounds)
    seq = torch.randn(2, 3, length, 2, 2, generator=torch.Generator().manual_seed(seed))
    history, got = FrameHistory(), []
    for cuts, needs in plan:
        r = state.cp_rank
        x = seq[:, :, cuts[r]:cuts[r + 1]].clone()
        window = exchange_frames(x, cuts=cuts, needs=needs, length=length, history=history, keep=keep, state=state)
        got.append(window)
    return plan, got, history


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_exchange_returns_exactly_the_needed_frames(groups, world):
    seed = random.randrange(2**31)
    for length, keep, rounds in [(9, 2, 1), (20, 3, 4), (31, 1, 6), (12, 0, 3)]:
        results = groups(world).run(_exchange, seed, length, keep, rounds, timeout=120)
        seq = torch.randn(2, 3, length, 2, 2, generator=torch.Generator().manual_seed(seed))
        for rank, (plan, got, history) in enumerate(results):
            for (cuts, needs), window in zip(plan, got, strict=True):
                lo, hi = max(0, needs[rank][0]), min(length, needs[rank][1])
                expected = seq[:, :, lo:max(lo, hi)]
                assert window.shape == expected.shape, f"seed={seed} rank={rank} cuts={cuts} needs={needs}"
                assert torch.equal(window, expected), f"seed={seed} rank={rank}"
            if rank == 0 and keep:
                assert history.start == max(0, length - keep)
                assert torch.equal(history.frames, seq[:, :, history.start:length])


def _deliver(state, latent_frames, frames_per_rank):
    split = TemporalSplit(latent_frames=latent_frames, world=state.cp_size, frames_per_rank=frames_per_rank)
    events = []

    def decode_range(a, b):
        k = split.round_of(a)
        events.append(("decode", k))
        v0, v1 = split.video_range(state.cp_rank, k)
        # Frame i carries its own index, so the order on rank 0 is observable.
        return np.broadcast_to(np.arange(v0, v1, dtype=np.int64)[:, None, None, None] % 251, (v1 - v0, 2, 3, 3)
                               ).astype(np.uint8)

    chunks = []
    for frames in decode_parallel(split, decode_range, frame_shape=(2, 3, 3), state=state):
        events.append(("yield", len(chunks)))
        chunks.append(frames)
    return split, events, chunks


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank0_streams_each_round_in_order_before_the_next_is_decoded(groups, world):
    for latent_frames, frames_per_rank in [(33, 2), (7, 1), (3, None)]:
        results = groups(world).run(_deliver, latent_frames, frames_per_rank, timeout=120)
        split, events, chunks = results[0]
        video = np.concatenate(chunks)
        assert video.shape == (split.video_frames, 2, 3, 3)
        assert (video[:, 0, 0, 0] == np.arange(split.video_frames) % 251).all(), "frames out of temporal order"
        assert all(not r[2] for r in results[1:]), "only group rank 0 yields frames"
        assert max(len(c) for c in chunks) <= 8 * max(frames_per_rank or latent_frames, 2)  # one piece at a time
        # Round k's frames leave rank 0 before it decodes round k + 1: that is what lets the MP4 stream.
        for k in range(1, split.rounds):
            first_of_previous = sum(1 for j in range(k - 1) for _ in range(split.active))
            assert events.index(("yield", first_of_previous)) < events.index(("decode", k))
        for rank, (_, rank_events, _) in enumerate(results):
            decodes = [e[1] for e in rank_events if e[0] == "decode"]
            assert decodes == (list(range(split.rounds)) if rank < split.active else [])
