"""The decode engine: the round x rank split, the frame relay between pieces and the in-order delivery on group
rank 0.

The split is pure arithmetic (no process group). The relay and the delivery run for real on 1-4 ranks; the relay
moves frames without arithmetic, so it must return them bit for bit.
"""

import random

import numpy as np
import pytest
import torch

from cp_infer.decode import (
    AUTO,
    ROUND_PIXELS,
    FrameRelay,
    Frames,
    SegmentedSplit,
    TemporalSplit,
    decode_parallel,
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
        for r in range(world):
            a, b = split.latent_range(r, k)
            assert (a < b) == (r < split.active), "every active rank has frames in every round, the others none"
            if r >= split.active:
                continue
            # The window, or 2 where a round may not leave an active rank without a frame.
            assert frames_per_rank is None or b - a <= max(frames_per_rank, 2)
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


@pytest.mark.parametrize("segment_frames", [1, 3, 9])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("frames_per_rank", [None, 1, 2])
def test_segments_are_cut_each_as_one_video_in_turn(segment_frames, world, frames_per_rank):
    """Each segment (a chunk the VAE decodes alone) is cut as its own split would cut it, at its own place in the
    latent frames and in the video; the last piece's frames past the cut are not delivered; only a segment's first
    round starts afresh (nothing relayed into it)."""
    segment = TemporalSplit(latent_frames=segment_frames, world=world, temporal_compression=4,
                            frames_per_rank=frames_per_rank)
    m = segment.video_frames
    for count, cut in [(1, 0), (3, 0), (3, 3 if m > 4 else 0)]:
        split = SegmentedSplit(segment, count, count * m - cut)
        assert (split.latent_frames, split.active, split.rounds) == (count * segment_frames, segment.active,
                                                                      count * segment.rounds)
        latent, video = [], []
        for k in range(split.rounds):
            s, j = divmod(k, segment.rounds)
            assert split.afresh(k) == (j == 0)
            for r in range(world):
                a, b = split.latent_range(r, k)
                v0, v1 = split.video_range(r, k)
                if r >= split.active:
                    assert a == b and v0 == v1
                    continue
                sa, sb = segment.latent_range(r, j)
                sv0, sv1 = segment.video_range(r, j)
                assert (a, b) == (s * segment_frames + sa, s * segment_frames + sb), "a piece spans two segments"
                assert (v0, v1) == (s * m + sv0, min(s * m + sv1, split.video_frames))
                assert v0 < v1, "every active rank delivers frames in every round"
                assert all(split.round_of(i) == k for i in range(a, b))
                latent.extend(range(a, b))
                video.extend(range(v0, v1))
        assert latent == list(range(split.latent_frames))
        assert video == list(range(split.video_frames))


def test_segments_refuse_a_cut_outside_the_last_segment():
    segment = TemporalSplit(latent_frames=3, world=2, temporal_compression=4)
    for bad in (9, 19):
        with pytest.raises(ValueError, match=f"video_frames={bad} is not within the last of 2 segments of 9"):
            SegmentedSplit(segment, 2, bad)
    with pytest.raises(ValueError, match="leaves the last piece"):
        SegmentedSplit(TemporalSplit(latent_frames=2, world=2, temporal_compression=4), 2, 6)


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


@pytest.mark.parametrize("latent_frames", [2, 3, 7, 13, 33])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("frames_per_rank", [None, 1, 2, 4])
def test_split_by_cost_gives_every_rank_equal_work(latent_frames, world, frames_per_rank):
    rng = random.Random()
    # Like a decoder's: the first frame also pays for a look-ahead, the others cost about the same.
    steps = [rng.uniform(3, 8)] + [rng.uniform(0.8, 1.2) for _ in range(latent_frames - 1)]
    cost = tuple(float(c) for c in np.concatenate([[0.0], np.cumsum(steps)]))
    split = TemporalSplit(latent_frames=latent_frames, world=world, frames_per_rank=frames_per_rank, cost=cost)
    plain = TemporalSplit(latent_frames=latent_frames, world=world, frames_per_rank=frames_per_rank)
    assert (split.rounds, split.active) == (plain.rounds, plain.active)
    starts = [split.latent_range(r, k)[0] for k in range(split.rounds) for r in range(split.active)]
    assert starts == sorted(set(starts)) and starts[0] == 0, "pieces tile the video, at least one frame each"
    assert split.latent_range(split.active - 1, split.rounds - 1)[1] == latent_frames
    work = [sum(cost[b] - cost[a] for a, b in (split.latent_range(r, k) for k in range(split.rounds)))
            for r in range(split.active)]
    # Each piece ends at the frame nearest its equal share, so a rank is off by at most a frame per piece.
    assert max(work) - min(work) <= split.rounds * 2 * max(steps) + 1e-9, (work, steps)
    if split.active * split.rounds > 1:
        assert split.latent_range(0, 0)[1] <= plain.latent_range(0, 0)[1], "the costly first frame: a shorter piece"


def test_split_refuses_a_bad_cost():
    for bad in ((0.0, 1.0), (1.0, 2.0, 3.0), (0.0, 2.0, 1.0)):
        with pytest.raises(ValueError, match="non-decreasing values from 0"):
            TemporalSplit(latent_frames=2, world=2, cost=bad)


def _relay(state, seed, pieces, ops, active):
    """Pieces decoded as the engine runs them: piece ``p`` by rank ``p % active``, in order; at each op a piece takes
    over the frames the piece before handed on, then hands on its own (frames that carry their piece and op)."""
    rng = random.Random(seed)
    counts = [rng.randint(1, 3) for _ in range(ops)]  # frames handed on at each op, the same for every piece
    relay, got, pending = FrameRelay(state), {}, 0
    for p in range(state.cp_rank, pieces if state.cp_rank < active else 0, active):
        for op in range(ops):
            like = torch.empty(2, 3, 0, 4, 5)
            if p > 0:
                got[p, op] = relay.take_over(op, like, counts[op], src=(p - 1) % active)
            if p + 1 < pieces:
                generator = torch.Generator().manual_seed(seed + 97 * p + op)
                sent = torch.randn(2, 3, counts[op] + 2, 4, 5, generator=generator)
                relay.hand_on(op, sent[:, :, 2:], to=(p + 1) % active)  # a non-contiguous view, as the decoder's
                sent.zero_()  # the relay holds its own copy
            pending = max(pending, relay.pending)
    relay.flush()
    return counts, got, pending


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_relay_hands_each_piece_the_previous_pieces_frames(groups, world):
    seed = random.randrange(2**31)
    pieces, ops = 7, 5
    # All ranks, and fewer (a short video): the last active rank hands on to rank 0.
    for active in sorted({world, max(1, world - 1)}):
        results = groups(world).run(_relay, seed, pieces, ops, active, timeout=120)
        for rank, (counts, got, pending) in enumerate(results):
            assert sorted(got) == [(p, op) for p in range(1, pieces) if p % active == rank for op in range(ops)]
            # A long video has many rounds: frames in flight stay at one round's (one message per op), whatever the
            # backend says of a send's completion before it is waited on.
            assert pending <= ops, (rank, active, pending)
            for (p, op), frames in got.items():
                expected = torch.randn(2, 3, counts[op] + 2, 4, 5,
                                       generator=torch.Generator().manual_seed(seed + 97 * (p - 1) + op))[:, :, 2:]
                assert torch.equal(frames, expected), f"seed={seed} rank={rank} active={active} piece={p} op={op}"


def _edges(state):
    groups = {(a, b): group for a, b, group in state.relay_groups}
    assert all(state.relay_group(a, b) is group for (a, b), group in groups.items())
    if (0, 1) in groups and (1, 0) in groups:
        assert groups[0, 1] is not groups[1, 0]
    return sorted(groups)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_ring_direction_has_its_own_group(groups, world):
    results = groups(world).run(_edges, timeout=60)
    ring = {(r, r + 1) for r in range(world - 1)} | {(k - 1, 0) for k in range(2, world + 1)}
    for rank, edges in enumerate(results):
        assert set(edges) == {e for e in ring if rank in e}, (rank, edges)
    if world == 2:
        assert results[0] == [(0, 1), (1, 0)]  # both directions between the same two ranks, each its own group


def test_a_missing_ring_edge_is_an_error():
    from cp_infer import single_process_state

    with pytest.raises(ValueError, match="no relay group from group rank 0 to 1"):
        single_process_state().relay_group(0, 1)


def test_frames_take_views_within_a_piece_and_joins_across():
    a, b = torch.randn(1, 2, 3, 2, 2), torch.randn(1, 2, 4, 2, 2)
    frames = Frames([(5, a), (8, b)], 5, 12)
    assert frames.take(8, 10).data_ptr() == b.data_ptr()  # no copy inside one piece
    torch.testing.assert_close(frames.take(6, 10), torch.cat([a, b], dim=2)[:, :, 1:5], rtol=0, atol=0)
    assert frames.take(7, 7).shape[2] == 0
    with pytest.raises(RuntimeError, match="outside the 5..12 held"):
        frames.take(4, 6)


def _deliver(state, latent_frames, frames_per_rank, segments=None):
    """``segments``: ``(count, frames cut)``, the video in segments of ``latent_frames`` each."""
    split = TemporalSplit(latent_frames=latent_frames, world=state.cp_size, frames_per_rank=frames_per_rank)
    if segments is not None:
        count, cut = segments
        split = SegmentedSplit(split, count, count * split.video_frames - cut)
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
def test_rank0_streams_the_pieces_in_order_as_they_are_decoded(groups, world):
    for latent_frames, frames_per_rank, segments in [(33, 2, None), (7, 1, None), (3, None, None), (5, 1, (3, 3)),
                                                     (4, None, (2, 0))]:
        results = groups(world).run(_deliver, latent_frames, frames_per_rank, segments, timeout=120)
        split, events, chunks = results[0]
        video = np.concatenate(chunks)
        assert video.shape == (split.video_frames, 2, 3, 3)
        assert (video[:, 0, 0, 0] == np.arange(split.video_frames) % 251).all(), "frames out of temporal order"
        assert all(not r[2] for r in results[1:]), "only group rank 0 yields frames"
        assert max(len(c) for c in chunks) <= 8 * max(frames_per_rank or latent_frames, 2)  # one piece at a time
        # Rank 0's piece of round k leaves it before it decodes round k + 1, and the other ranks' pieces of round k
        # (decoded alongside its round k + 1) before it decodes round k + 2: that is what lets the MP4 stream.
        for k in range(1, split.rounds):
            assert events.index(("yield", (k - 1) * split.active)) < events.index(("decode", k))
        for k in range(2, split.rounds):
            assert events.index(("yield", (k - 1) * split.active - 1)) < events.index(("decode", k))
        for rank, (_, rank_events, _) in enumerate(results):
            decodes = [e[1] for e in rank_events if e[0] == "decode"]
            assert decodes == (list(range(split.rounds)) if rank < split.active else [])
