"""Where a model's weights live on each rank: the plan, from parameter shapes alone (``cp-infer memory``, and what
``--weights auto`` decides by), and the report of what a loaded rank holds.

Invariants:
- The plan is arithmetic over parameter shapes, no process group and no weights. A component is its units' shapes;
  a sharded component's rank holds FSDP2's rows of every parameter (``cp_infer.weights.shard_rows``), so the plan's
  bytes of a shard are the loaded rank's, to the byte.
- At rest a rank's device holds its components' resident bytes (a shard, a whole replicated component, nothing of an
  offloaded one). While a component runs it also holds what it gathers or streams in, whole: a sharded or offloaded
  component with blocks its root and two blocks (the one running and the one prefetched); an offloaded component
  without blocks all of itself (an upper bound: it is streamed leaf by leaf). Components run one at a time, so the
  device's peak is the resident total plus the largest of those.
- Activations are not in the plan: they depend on the request, and sequence parallelism already shards them.
- The report (:func:`measure`) counts each parameter's local storage (a shard's, for a sharded one) and every buffer,
  by the device it is on; pinned host memory is named as such.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = [
    "OFFLOAD_COMPONENTS",
    "WEIGHTS_MODES",
    "Component",
    "ComponentPlace",
    "MemoryPlan",
    "RankMemory",
    "Unit",
    "format_bytes",
    "measure",
    "parse_offload",
    "parse_weights",
    "plan_memory",
    "shard_rows",
    "unit_of",
]

WEIGHTS_MODES = ("auto", "sharded", "replicated")
"""``--weights``: ``sharded`` over the replica group, ``replicated`` on every rank, ``auto`` sharded where the
replicated weights would not fit the device's free memory (never on the CPU)."""

OFFLOAD_COMPONENTS = ("text_encoder", "vae", "transformer_blocks")
"""``--offload`` names: the text encoder (and what a model runs with it, e.g. text connectors), the VAEs (and a
vocoder), the transformer's blocks (and its root)."""


def parse_offload(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"text_encoder,vae"`` (or a sequence, or ``None``/``""``/``"none"``) -> the names, in
    :data:`OFFLOAD_COMPONENTS`' order; an unknown one is a ``ValueError`` naming the valid ones."""
    if text is None:
        return ()
    parts = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p and p.strip()]
    if parts == ["none"]:
        return ()
    unknown = [p for p in parts if p not in OFFLOAD_COMPONENTS]
    if unknown:
        raise ValueError(f"--offload {','.join(unknown)!s}: not a component that can be offloaded; valid: "
                         f"{', '.join(OFFLOAD_COMPONENTS)} (comma-separated)")
    return tuple(c for c in OFFLOAD_COMPONENTS if c in parts)


def parse_weights(value: str) -> str:
    if value not in WEIGHTS_MODES:
        raise ValueError(f"--weights {value!r}: use one of {', '.join(WEIGHTS_MODES)}")
    return value


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of dim 0 that ``rank`` holds of a ``rows``-row parameter over ``world`` ranks: FSDP2's
    ``Shard(0)``, ``torch.chunk``'s cut (chunks of ``ceil(rows / world)``, the last ranks shorter or empty)."""
    chunk = -(-rows // world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


_IN_FLIGHT_BLOCKS = 2
"""Blocks gathered (or streamed in) at once while a component runs: the one computing and the one prefetched."""


@dataclass(frozen=True)
class Unit:
    """One unit's tensors (an FSDP unit: a block, or a component's root): its parameters' ``(shape, bytes per
    element)``, and its buffers' bytes (never sharded: every rank holds them whole)."""

    tensors: tuple[tuple[tuple[int, ...], int], ...] = ()
    buffer_bytes: int = 0

    @property
    def params(self) -> int:
        return sum(math.prod(shape) for shape, _ in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * size for shape, size in self.tensors) + self.buffer_bytes

    def shard_nbytes(self, world: int, rank: int) -> int:
        """What ``rank`` of ``world`` holds of it: FSDP2's rows of dim 0 of each parameter (a 0-d one whole: FSDP2
        does not shard those), and every buffer."""
        total = self.buffer_bytes
        for shape, size in self.tensors:
            if not shape:
                total += size
                continue
            start, stop = shard_rows(shape[0], world, rank)
            total += (stop - start) * math.prod(shape[1:]) * size
        return total


def unit_of(modules: Iterable[nn.Module], *, exclude: Iterable[nn.Module] = ()) -> Unit:
    """The parameters and buffers of ``modules`` (built on the meta device, or anywhere), less those of
    ``exclude`` (submodules that are units of their own); each tensor once."""
    skip = {id(t) for m in exclude for t in (*m.parameters(), *m.buffers())}
    seen: set[int] = set()
    tensors, buffers = [], 0
    for module in modules:
        for t in module.parameters():
            if id(t) not in skip and id(t) not in seen:
                seen.add(id(t))
                tensors.append((tuple(t.shape), t.element_size()))
        for t in module.buffers():
            if id(t) not in skip and id(t) not in seen:
                seen.add(id(t))
                buffers += t.numel() * t.element_size()
    return Unit(tuple(tensors), buffers)


@dataclass(frozen=True)
class Component:
    """One component of a model, as the plan sees it."""

    name: str
    root: Unit
    """Its parameters outside ``blocks`` and ``idle`` (all of them for a component without blocks)."""
    blocks: tuple[Unit, ...] = ()
    """The units a forward runs one after the other: sharded one per FSDP unit, streamed one at a time offloaded."""
    idle: tuple[Unit, ...] = ()
    """Units that are sharded with the rest but never run (a multimodal text encoder's vision tower)."""
    shardable: bool = False
    """Sharded with ``--weights sharded`` (else replicated in every mode)."""
    offload: str | None = None
    """The ``--offload`` name that keeps it on the CPU between uses (``None``: it cannot be offloaded)."""

    @property
    def units(self) -> tuple[Unit, ...]:
        return (self.root, *self.blocks, *self.idle)

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def shard_nbytes(self, world: int, rank: int) -> int:
        return sum(u.shard_nbytes(world, rank) for u in self.units)

    @property
    def in_flight_nbytes(self) -> int:
        """Gathered or streamed in at once while it runs: the root and two blocks (without blocks: all of it)."""
        if not self.blocks:
            return self.nbytes
        largest = sorted((b.nbytes for b in self.blocks), reverse=True)[:_IN_FLIGHT_BLOCKS]
        return self.root.nbytes + sum(largest)


@dataclass(frozen=True)
class ComponentPlace:
    """Where one component's weights are on one rank."""

    name: str
    params: int
    nbytes: int
    """All of it, as one replicated rank holds it."""
    device_bytes: int
    """On the device at rest."""
    host_bytes: int
    """On the CPU (offloaded; pinned on CUDA)."""
    transient_bytes: int
    """Also on the device while it runs (gathered or streamed in)."""
    where: str


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's weights, component by component."""

    ranks: int
    """The replica group's ranks the sharded components are spread over."""
    rank: int
    sharded: bool
    offload: tuple[str, ...]
    components: tuple[ComponentPlace, ...] = field(default=())

    @property
    def device_bytes(self) -> int:
        return sum(c.device_bytes for c in self.components)

    @property
    def host_bytes(self) -> int:
        return sum(c.host_bytes for c in self.components)

    @property
    def peak_device_bytes(self) -> int:
        return self.device_bytes + max((c.transient_bytes for c in self.components), default=0)

    @property
    def replicated_bytes(self) -> int:
        return sum(c.nbytes for c in self.components)


def plan_memory(components: Sequence[Component], *, ranks: int, rank: int = 0, sharded: bool,
                offload: Iterable[str] = ()) -> MemoryPlan:
    """Where each of ``components`` is on ``rank`` of a replica group of ``ranks``, its shardable components
    ``sharded`` or not, the components ``offload`` names kept on the CPU. Rank 0 holds the most of every shard."""
    offload = tuple(offload)
    shard = sharded and ranks > 1
    places = []
    for c in components:
        off = c.offload is not None and c.offload in offload
        if shard and c.shardable:
            held = c.shard_nbytes(ranks, rank)
            where = f"1/{ranks} shard" + (", on the CPU" if off else "")
            transient = c.in_flight_nbytes
        else:
            held = c.nbytes
            where = "replicated" + (", on the CPU" if off else "")
            transient = c.in_flight_nbytes if off else 0
        places.append(ComponentPlace(name=c.name, params=c.params, nbytes=c.nbytes, device_bytes=0 if off else held,
                                     host_bytes=held if off else 0, transient_bytes=transient, where=where))
    return MemoryPlan(ranks=ranks, rank=rank, sharded=shard, offload=offload, components=tuple(places))


def format_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``37.8 GiB``, ``512 B``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class RankMemory:
    """What one loaded rank holds: ``(component, where, bytes)`` for each place a component's tensors are on."""

    rank: int
    weights: str
    """``sharded`` or ``replicated``: what the rank loaded (``auto`` resolved)."""
    offload: tuple[str, ...]
    entries: tuple[tuple[str, str, int], ...]

    def text(self) -> str:
        return ", ".join(f"{name} {format_bytes(n)} on {where}" for name, where, n in self.entries)

    def as_dict(self) -> dict:
        components: dict[str, dict[str, int]] = {}
        for name, where, n in self.entries:
            components.setdefault(name, {})[where] = n
        return {"rank": self.rank, "weights": self.weights, "offload": list(self.offload), "components": components}


def _local_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter's local storage (a shard's, for a sharded one) and every buffer of ``module``, each once."""
    from torch.distributed.tensor import DTensor

    for param in module.parameters():  # each once (tied parameters too)
        yield param.to_local() if isinstance(param, DTensor) else param
    yield from module.buffers()


def _where(t: torch.Tensor) -> str:
    if t.device.type == "cpu":
        return "cpu (pinned)" if t.is_pinned() else "cpu"
    return str(t.device)


def measure(components: Mapping[str, nn.Module], *, rank: int, weights: str, offload: Sequence[str] = ()
            ) -> RankMemory:
    """The bytes each component's tensors take on this rank, by where they are (shards as held)."""
    entries = []
    for name, module in components.items():
        where: dict[str, int] = {}
        for t in _local_tensors(module):
            where[_where(t)] = where.get(_where(t), 0) + t.numel() * t.element_size()
        entries += [(name, w, n) for w, n in sorted(where.items())]
    return RankMemory(rank=rank, weights=weights, offload=tuple(offload), entries=tuple(entries))
