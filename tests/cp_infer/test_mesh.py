"""Mesh arithmetic without a process group: valid layouts, rank -> coordinates, groups, pass shares."""

import itertools

import pytest

from cp_infer import ParallelConfig
from cp_infer.mesh import MeshLayout, auto_ring, pass_shares, valid_layouts


def test_valid_layouts_divide_the_world_one_replica_first():
    assert valid_layouts(1) == [(1, 1)]
    assert valid_layouts(2) == [(1, 2), (2, 1), (1, 1)]
    assert valid_layouts(4) == [(1, 4), (2, 2), (4, 1), (1, 2), (2, 1), (1, 1)]
    assert valid_layouts(6)[:4] == [(1, 6), (2, 3), (3, 2), (6, 1)]
    for world in range(1, 13):
        assert all(world % (g * u) == 0 for g, u in valid_layouts(world))
        assert len(set(valid_layouts(world))) == len(valid_layouts(world))


def test_replicas_are_runs_of_consecutive_ranks_led_by_their_first():
    layout = MeshLayout.resolve(4, guidance_degree=1, ulysses_degree=2)
    assert layout.replicas == 2 and layout.replica_size == 2
    assert layout.replica_ranks(0) == (0, 1) and layout.replica_ranks(1) == (2, 3)
    assert layout.leaders() == (0, 2)
    assert layout.coords(3) == (1, 0, 1)
    assert layout.ulysses_groups() == [(0, 1), (2, 3)]
    g2 = MeshLayout.resolve(4, guidance_degree=2, ulysses_degree=1)
    assert g2.replicas == 2 and g2.guidance_groups() == [(0, 1), (2, 3)] and g2.leaders() == (0, 2)
    assert MeshLayout.resolve(3, guidance_degree=1, ulysses_degree=1).leaders() == (0, 1, 2)


def test_defaults_are_ulysses_over_the_world():
    assert MeshLayout.resolve(4) == MeshLayout(world=4, guidance=1, ulysses=4)
    assert MeshLayout.resolve(4, guidance_degree=2) == MeshLayout(world=4, guidance=2, ulysses=2)
    assert MeshLayout.resolve(3, guidance_degree=3) == MeshLayout(world=3, guidance=3, ulysses=1)
    assert MeshLayout.resolve(4, guidance_degree=2, ulysses_degree=2).replicas == 1


@pytest.mark.parametrize(("world", "passes", "guidance"), [
    (1, [2], 1), (2, [2], 2), (4, [2], 2), (8, [2], 2),  # CFG's pair on one guidance rank each, Ulysses the rest
    (2, [1], 1), (2, [], 1),  # nothing to spread
    (3, [2], 1),  # 2 does not divide 3 ranks
    (4, [4], 4), (2, [4], 2), (6, [4], 2),  # LTX-2's four passes
    (3, [4], 1),  # G=3 would leave two ranks idle for half of each step
    (4, [4, 1], 1),  # a second stage without guidance runs one pass: Ulysses over all
    (4, [4, 2], 2),
])
def test_guidance_first_takes_the_most_guidance_ranks_that_share_every_step_evenly(world, passes, guidance):
    layout = MeshLayout.guidance_first(world, passes)
    assert layout == MeshLayout(world=world, guidance=guidance, ulysses=world // guidance)
    assert layout.replicas == 1
    assert all(len(set(map(len, pass_shares(n, guidance)))) == 1 for n in passes)  # every rank runs as many


def test_guidance_first_refuses_a_step_without_passes():
    with pytest.raises(ValueError, match="at least one pass"):
        MeshLayout.guidance_first(2, [0])


@pytest.mark.parametrize(("world", "guidance", "ulysses"), [(4, 3, None), (4, 3, 1), (4, None, 3), (2, 4, None),
                                                             (6, 4, 2)])
def test_layouts_that_do_not_make_the_world_are_refused_listing_the_valid_ones(world, guidance, ulysses):
    with pytest.raises(ValueError) as info:
        MeshLayout.resolve(world, guidance_degree=guidance, ulysses_degree=ulysses)
    message = str(info.value)
    for g, u in valid_layouts(world):
        assert f"--guidance-degree {g} --ulysses-degree {u}" in message
    assert "replicas" in message
    assert str(world) in message


def test_degrees_below_one_are_refused():
    with pytest.raises(ValueError, match="guidance_degree=0"):
        ParallelConfig(guidance_degree=0)
    with pytest.raises(ValueError, match="ulysses_degree=-1"):
        ParallelConfig(ulysses_degree=-1)


@pytest.mark.parametrize(("world", "guidance"), [(1, 1), (2, 2), (4, 2), (6, 2), (6, 3), (8, 4)])
def test_rank_coordinates_and_groups(world, guidance):
    layout = MeshLayout.resolve(world, guidance_degree=guidance)
    coords = [layout.coords(r) for r in range(world)]
    # A bijection onto the grid, Ulysses innermost (consecutive ranks share a Ulysses group).
    assert sorted(coords) == list(itertools.product(range(1), range(guidance), range(world // guidance)))
    assert all(layout.rank(*c) == r for r, c in enumerate(coords))
    ulysses, guided = layout.ulysses_groups(), layout.guidance_groups()
    assert sorted(r for g in ulysses for r in g) == list(range(world)) == sorted(r for g in guided for r in g)
    for group in ulysses:  # same guidance index, Ulysses index = position
        assert list(group) == list(range(group[0], group[0] + layout.ulysses))
        assert [layout.coords(r)[2] for r in group] == list(range(layout.ulysses))
    for group in guided:  # same Ulysses index, guidance index = position
        assert len({layout.coords(r)[2] for r in group}) == 1
        assert [layout.coords(r)[1] for r in group] == list(range(guidance))
    assert MeshLayout.resolve(4, guidance_degree=2).guidance_groups() == [(0, 2), (1, 3)]
    with pytest.raises(ValueError, match="rank=4"):
        MeshLayout.resolve(4).coords(4)


def test_pass_shares():
    assert pass_shares(2, 1) == (range(0, 2),)
    assert pass_shares(2, 2) == (range(0, 1), range(1, 2))
    assert pass_shares(3, 2) == (range(0, 2), range(2, 3))
    assert pass_shares(4, 3) == (range(0, 2), range(2, 3), range(3, 4))
    assert pass_shares(1, 2) == (range(0, 1), range(1, 1))
    for passes, ranks in itertools.product(range(0, 7), range(1, 6)):
        shares = pass_shares(passes, ranks)
        assert len(shares) == ranks
        assert [p for s in shares for p in s] == list(range(passes))  # contiguous, in order, each pass once
        sizes = [len(s) for s in shares]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(("world", "guidance", "ring"), [(2, 1, 2), (4, 1, 2), (8, 2, 2), (6, 1, 3), (12, 2, 3)])
def test_ring_axis_strides_over_consecutive_ulysses_groups(world, guidance, ring):
    layout = MeshLayout.resolve(world, guidance_degree=guidance, ring_degree=ring)
    ulysses = world // (guidance * ring)
    assert (layout.ulysses, layout.ring, layout.sequence, layout.replicas) == (ulysses, ring, ulysses * ring, 1)
    sequences = layout.sequence_groups()
    assert sequences == [tuple(range(g * layout.sequence, (g + 1) * layout.sequence)) for g in range(guidance)]
    for group in layout.ulysses_groups():  # consecutive ranks
        assert list(group) == list(range(group[0], group[0] + ulysses))
    for group in layout.ring_groups():  # a stride of U, inside one sequence group, in sequence-shard order
        assert list(group) == list(range(group[0], group[0] + ring * ulysses, ulysses))
        assert [layout.coords(r)[2] for r in group] == [r * ulysses + group[0] % ulysses for r in range(ring)]
    every = sorted(r for g in layout.ring_groups() for r in g)
    assert every == list(range(world)) == sorted(r for g in layout.ulysses_groups() for r in g)
    assert len(layout.guidance_groups()) == layout.sequence


def test_ring_layouts_that_do_not_divide_the_world_name_the_fix():
    with pytest.raises(ValueError, match=r"--ring-degree must divide the 4 ranks: one of \[2, 4\]"):
        MeshLayout.resolve(4, ring_degree=3)
    with pytest.raises(ValueError) as info:
        MeshLayout.resolve(6, ring_degree=2, ulysses_degree=2)
    assert "--guidance-degree 1 --ring-degree 2 --ulysses-degree 3" in str(info.value)
    with pytest.raises(ValueError, match="ring_degree=0"):
        ParallelConfig(ring_degree=0)


@pytest.mark.parametrize(("ranks", "heads", "node", "expected"), [
    (2, 12, 2, (2, 1)), (2, 3, 2, (1, 2)), (8, 12, 8, (4, 2)), (16, 40, 8, (8, 2)), (8, 40, 4, (4, 2)),
    (4, 5, 4, (1, 4)), (1, 7, 1, (1, 1)),
])
def test_auto_ring_keeps_ulysses_in_a_node_and_on_a_divisor_of_the_heads(ranks, heads, node, expected):
    assert auto_ring(ranks, heads, node) == expected
