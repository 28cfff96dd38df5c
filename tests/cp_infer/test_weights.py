"""Weights sharded over a group (``cp_infer.weights``) and the memory plan (``cp_infer.placement``) on a toy module
that names no model: FSDP2 per block, each rank reading only its rows from a safetensors file.

Equality with the whole module is exact: an all-gather moves bytes, and the gathered parameters, like the
reference's, sit in memory of their own (64-byte aligned; see NOTE(mmap-alignment) in tests/models/test_sharded.py).
World sizes 2 and 3 (3: rows that do not divide, the last rank's shard shorter or empty).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from cp_infer.placement import Component, Unit, plan_memory, shard_rows, unit_of

from ..worker_groups import group_per_world

group = group_per_world([2, 3])

_WIDTH, _BLOCKS = 10, 4


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class _Toy(nn.Module):
    """A root (an input projection, a 0-d gain, an output head, a computed buffer) around blocks; ``skip_from``:
    the blocks from that index on are skipped (joined, not run), as a step cache skips them."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, _WIDTH)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.blocks = nn.ModuleList(_Block(_WIDTH) for _ in range(_BLOCKS))
        self.out = nn.Linear(_WIDTH, 3)
        self.register_buffer("scale", torch.linspace(0.5, 2.0, _WIDTH), persistent=False)
        self.skip_from: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from cp_infer.weights import join_blocks

        x = self.inp(x) * self.scale * self.gain
        for i, block in enumerate(self.blocks):
            if self.skip_from is not None and i >= self.skip_from:
                join_blocks(list(self.blocks)[i:])
                break
            x = block(x)
        return self.out(x)


def _reference(seed: int) -> _Toy:
    torch.manual_seed(seed)
    return _Toy()


def _write(path, seed: int) -> None:
    save_file({k: v.contiguous() for k, v in _reference(seed).state_dict().items()}, str(path))


def _sharded(state, path, *, offload: bool = False) -> _Toy:
    from cp_infer.weights import SafetensorsFiles, load_shards, meta_parameters, replica_mesh, shard_module

    with meta_parameters():
        toy = _Toy()
    shard_module(toy, list(toy.blocks), mesh=replica_mesh(state), offload=offload)
    load_shards(toy, SafetensorsFiles(path.parent, path.name.removesuffix(".safetensors")), device=state.device)
    return toy


def _forward_and_bytes(state, path, seed: int, offload: bool):
    from torch.distributed.tensor import DTensor

    toy, reference = _sharded(state, path, offload=offload), _reference(seed)
    torch.manual_seed(100 + seed)
    outs = []
    with torch.no_grad():
        for x in (torch.randn(1, 5, 7), torch.randn(3, 2, 7)):
            outs.append((toy(x), reference(x)))
    local = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.numel() * p.element_size()
                for p in toy.parameters())
    return outs, local, [type(p).__name__ for p in toy.parameters()]


def _toy_component() -> Component:
    with torch.device("meta"):
        toy = _Toy()
    root = unit_of([toy], exclude=list(toy.blocks))
    return Component("toy", root=root, blocks=tuple(unit_of([b]) for b in toy.blocks), shardable=True)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offloaded"])
def test_sharded_forward_is_the_whole_modules_bit_for_bit(group, tmp_path, offload):
    """Each rank holds its rows only (the plan's bytes exactly, at most 1/N of the whole plus one block), and the
    forward (batch 1 and 3) is the whole module's; with the shards offloaded (FSDP2's CPUOffloadPolicy: on the CPU the
    same device) too. The 0-d gain stays whole on every rank (FSDP2 shards no scalar), the computed buffer survives
    the meta build."""
    path = tmp_path / f"toy_{group.world}_{offload}.safetensors"
    _write(path, seed=group.world)
    results = group.run(_forward_and_bytes, path, group.world, offload)
    component = _toy_component()
    whole, largest = component.nbytes, max(b.nbytes for b in component.blocks)
    buffers = component.root.buffer_bytes  # held whole by every rank, never sharded
    gain = 4  # the 0-d parameter, whole on every rank
    for rank, (outs, local, kinds) in enumerate(results):
        assert kinds.count("Parameter") == 1 and set(kinds) == {"DTensor", "Parameter"}, kinds  # the 0-d gain
        for got, want in outs:
            assert torch.equal(got, want), (rank, (got - want).abs().max())
        assert local == component.shard_nbytes(group.world, rank) - buffers
        assert local <= (whole - buffers) / group.world + largest
    assert sum(r[1] for r in results) == whole - buffers + gain * (group.world - 1)


def _lockstep(state, path, seed: int):
    """Rank r runs r + 1 forwards and joins the rest up to the group's most; then one forward in which the ranks skip
    different blocks (rank r runs blocks 0..r), the skipped ones joined."""
    from cp_infer.weights import join_call

    toy, reference = _sharded(state, path), _reference(seed)
    x = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(seed))
    outs = []
    with torch.no_grad():
        for _ in range(state.rank + 1):
            outs.append(torch.equal(toy(x), reference(x)))
        for _ in range(state.world_size - state.rank - 1):
            join_call(toy)
        toy.skip_from = reference.skip_from = state.rank + 1
        outs.append(torch.equal(toy(x), reference(x)))
        toy.skip_from = reference.skip_from = None
        outs.append(torch.equal(toy(x), reference(x)))
    return outs


def test_ranks_that_run_fewer_calls_or_blocks_join_the_all_gathers(group, tmp_path):
    """The group's all-gathers match whatever each rank computes: nothing hangs (the harness would time out) and every
    forward is still the whole module's."""
    path = tmp_path / "toy_lockstep.safetensors"
    _write(path, seed=7)
    for rank, outs in enumerate(group.run(_lockstep, path, 7)):
        assert outs == [True] * (rank + 3), (rank, outs)


def _load_or_error(state, good, short):
    from cp_infer.weights import WeightsLoadError, load_agreed

    try:
        load_agreed(lambda: _sharded(state, short if state.rank == state.world_size - 1 else good), state=state)
    except WeightsLoadError as exc:
        return str(exc)
    return None


def test_a_short_file_on_one_rank_fails_every_rank(group, tmp_path):
    """The last rank's file is cut short; it alone sees it, and every rank raises, naming that rank's problem."""
    good, short = tmp_path / "good.safetensors", tmp_path / "short.safetensors"
    _write(good, seed=3)
    data = good.read_bytes()
    short.write_bytes(data[: len(data) - 64])
    errors = group.run(_load_or_error, good, short)
    assert all(errors), errors
    assert "incomplete metadata" in errors[-1] or "SafetensorError" in errors[-1], errors[-1]
    for message in errors[:-1]:
        assert message.startswith(f"rank {group.world - 1} could not read its shard: "), message


def test_shard_rows_cut_as_torch_chunk():
    for rows in range(0, 12):
        for world in range(1, 5):
            cuts = [shard_rows(rows, world, r) for r in range(world)]
            sizes = [b - a for a, b in cuts]
            chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
            assert sizes[:len(chunks)] == chunks and not any(sizes[len(chunks):]), (rows, world, sizes)
            assert cuts[0][0] == 0 and all(a == b for (_, a), (b, _) in zip(cuts, cuts[1:], strict=False))


def test_the_plan_adds_up():
    """Shards add up to the whole; at rest a rank holds its shard, a replicated component whole, an offloaded one
    nothing on the device; while running a sharded component gathers its root and its two largest blocks."""
    big = Unit((((64, 8), 4),))
    root = Unit((((5, 3), 2), ((), 4)), buffer_bytes=12)
    component = Component("t", root=root, blocks=(big, Unit((((9, 8), 4),)), big), shardable=True,
                          offload="transformer_blocks")
    other = Component("v", root=Unit((((100,), 2),)), offload="vae")
    for world in (1, 2, 3, 4):  # every rank holds the buffers and the 0-d parameter whole
        assert sum(component.shard_nbytes(world, r) for r in range(world)) == component.nbytes + 16 * (world - 1)
    sharded = plan_memory([component, other], ranks=3, sharded=True)
    t, v = sharded.components
    assert t.device_bytes == component.shard_nbytes(3, 0) and t.host_bytes == 0 and v.device_bytes == 200
    assert t.transient_bytes == component.root.nbytes + 2 * big.nbytes and v.transient_bytes == 0
    assert sharded.peak_device_bytes == t.device_bytes + v.device_bytes + t.transient_bytes
    offloaded = plan_memory([component, other], ranks=3, sharded=True, offload=["vae", "transformer_blocks"])
    assert offloaded.device_bytes == 0 and offloaded.host_bytes == sharded.device_bytes
    assert offloaded.peak_device_bytes == max(t.transient_bytes, 200)
    assert plan_memory([component], ranks=1, sharded=True).components[0].device_bytes == component.nbytes
