"""The parallel state: one frozen object that names every process group a rank uses.

Invariants:
- Built once per process by :func:`init_parallel` and passed explicitly (keyword-only) to everything that
  communicates. There is no module-level mutable state.
- The world is a mesh (``cp_infer.mesh``): replicas x guidance x ring x Ulysses. The ``cp_*`` fields are the
  sequence group (ring x Ulysses: the group a pass's sequences are sharded over: gathers, the decode); attention
  splits it into its Ulysses group (``ulysses_*``, the all-to-alls) and its ring (``ring_*``, the point-to-point
  key/value blocks; with no ring the Ulysses group is the sequence group); the ``guidance_*`` fields the
  guidance axis (the ranks that share a step's guidance passes and exchange their predictions once per step).
  Status agreement and control messages span the rank's replica group (``cpu_group``, led by its first rank), which
  runs its own jobs; no collective spans two replicas after start-up but the front end's links (``links``). The
  decode runs over the replica's whole mesh (:meth:`ParallelState.decoding`): every guidance rank holds the same
  latents, so none need idle through it.
- Tensors travel over ``cp_group`` and ``guidance_group`` (NCCL with CUDA, gloo otherwise); request metadata and
  control messages travel over ``cpu_group`` (always gloo), so a control message never waits behind device work.
- An axis of degree 1 has the group ``None`` and every collective over it returns its input.
"""

from __future__ import annotations

import datetime
import functools
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .devices import cuda_ordinal
from .mesh import MeshLayout
from .ring import RingGroup

__all__ = ["ParallelConfig", "ParallelState", "init_parallel", "destroy_parallel", "single_process_state"]

_DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class ParallelConfig:
    """How to build the process groups."""

    guidance_degree: int | None = None
    """Ranks a step's guidance passes are spread over; ``None``: 1."""
    ulysses_degree: int | None = None
    """Ranks of a ring block's all-to-all; ``None``: the world divided by the guidance and ring degrees."""
    ring_degree: int | None = None
    """Ulysses groups each pass's sequences are sharded over, passing key/value blocks round a ring; ``None``: 1."""
    backend: str | None = None
    """``"nccl"`` or ``"gloo"``; ``None`` picks NCCL when CUDA is available, else gloo."""
    timeout_s: float = _DEFAULT_TIMEOUT_S
    """Collective timeout. Short by default: a serving group should fail fast, not hang for hours."""
    device: str | None = None
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``None`` picks CUDA when it exists, else cpu. ``cuda`` without an
    ordinal is the rank's own GPU, checked (``cp_infer.devices.cuda_ordinal``)."""

    def __post_init__(self) -> None:
        for name in ("guidance_degree", "ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1 (or unset for the default)")
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r} is not supported; use 'nccl', 'gloo' or None (auto)")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s} must be > 0 seconds")


@dataclass(frozen=True)
class ParallelState:
    """Everything a rank needs to know about the group it belongs to."""

    world_size: int
    rank: int
    local_rank: int
    cp_size: int
    """Sequence group size: ring degree x Ulysses degree."""
    cp_rank: int
    """This rank's sequence shard: ``ring_rank x ulysses_size + Ulysses rank``."""
    cp_ranks: tuple[int, ...]
    """Global ranks of this rank's sequence group, in group-rank order."""
    cp_group: dist.ProcessGroup | None
    """Sequence device group for tensor collectives; ``None`` when ``cp_size == 1``."""
    cpu_group: dist.ProcessGroup | None
    """Gloo group over the replica group's ranks for control messages; ``None`` when it is one rank."""
    device: torch.device
    backend: str
    timeout_s: float
    guidance_size: int = 1
    """Guidance degree."""
    guidance_rank: int = 0
    guidance_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's guidance group (same Ulysses index), in group-rank order."""
    guidance_group: dist.ProcessGroup | None = None
    """Guidance device group (the per-step exchange of predictions); ``None`` when ``guidance_size == 1``."""
    relay_groups: tuple[tuple[int, int, dist.ProcessGroup], ...] = ()
    """``(src, dst, group)``: device groups that carry messages from group rank ``src`` to ``dst`` only, for the
    decode's ring of ranks (``r -> r + 1`` and ``r -> 0``); this rank's edges only. See :meth:`relay_group`."""
    mesh_group: dist.ProcessGroup | None = None
    """With a guidance axis: a device group over the whole mesh, which the decode runs on (:meth:`decoding`)."""
    mesh_relay_groups: tuple[tuple[int, int, dist.ProcessGroup], ...] = ()
    """The decode's ring over the whole mesh (as ``relay_groups`` over the Ulysses group)."""
    ulysses_size: int = 1
    """Ulysses degree (``cp_size / ring_size``)."""
    ulysses_group: dist.ProcessGroup | None = None
    """The Ulysses device group (attention's all-to-alls) when there is a ring; with none it is ``cp_group``: read
    :attr:`attention_group`."""
    ring_size: int = 1
    """Ring degree."""
    ring_rank: int = 0
    ring_group: dist.ProcessGroup | None = None
    """The ring's device group (group rank = ring index); ``None`` when ``ring_size == 1``."""
    replica: int = 0
    """This rank's replica group."""
    replicas: int = 1
    replica_ranks: tuple[int, ...] = (0,)
    """Global ranks of this rank's replica group, in order; the first leads it."""
    world_group: dist.ProcessGroup | None = None
    """Gloo group over the whole world, for start-up only (every rank's pid); ``None`` when ``world_size == 1``."""
    links: tuple[tuple[int, dist.ProcessGroup], ...] = ()
    """``(replica, group)``: a gloo group of global rank 0 and that replica's leader, for each replica but the first,
    over which the front end drives it; rank 0 holds every link, a replica's leader its own, other ranks none."""

    def link(self, replica: int) -> dist.ProcessGroup:
        for r, group in self.links:
            if r == replica:
                return group
        raise ValueError(f"rank {self.rank} holds no link to replica {replica}")

    def relay_group(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group for messages from group rank ``src`` to ``dst`` (one of this rank's ring edges).

        NOTE(nccl): NCCL runs a pair's sends and receives on one stream in issue order, and a large send waits for
        its receive to be posted, so two ranks streaming to each other on one group can each block the other's
        receive behind their own send; a group per direction keeps every stream one-way."""
        for a, b, group in self.relay_groups:
            if (a, b) == (src, dst):
                return group
        raise ValueError(f"no relay group from group rank {src} to {dst}: the ring has r -> r + 1 and r -> 0 only")

    @property
    def is_leader(self) -> bool:
        """True on global rank 0, the rank that talks to clients (and leads the first replica)."""
        return self.rank == 0

    @property
    def leads_replica(self) -> bool:
        """True on the first rank of a replica group, the one that broadcasts its commands."""
        return self.rank == self.replica_ranks[0]

    @property
    def attention_group(self) -> dist.ProcessGroup | None:
        """The group of self-attention's all-to-alls (``cp_infer.ulysses_attention``'s ``group``)."""
        return self.cp_group if self.ring_size == 1 else self.ulysses_group

    @property
    def ring(self) -> RingGroup | None:
        """This rank's ring (``cp_infer.ulysses_attention``'s ``ring``); ``None`` without a ring axis.

        A plain property, not a cached one: the attention processors read it inside compiled blocks, where
        ``functools.cached_property``'s lock on first use is a graph break (a fresh server's first request would
        compile broken graphs). A ``RingGroup`` is three fields; making one costs nothing."""
        if self.ring_size == 1:
            return None
        return RingGroup(group=self.ring_group, rank=self.ring_rank, size=self.ring_size)

    @functools.cached_property
    def decoding(self) -> ParallelState:
        """The state the decode runs on: this one without a guidance axis; with one, the whole mesh as its
        "Ulysses" group (``cp_*`` over every rank in global order, its own ring of relay groups), so that no rank
        idles through the decode. Its first rank is the mesh's, the one that delivers."""
        if self.guidance_size == 1:
            return self
        ranks = self.replica_ranks
        return replace(self, cp_size=len(ranks), cp_rank=ranks.index(self.rank), cp_ranks=ranks,
                       cp_group=self.mesh_group,
                       relay_groups=self.mesh_relay_groups, guidance_size=1, guidance_rank=0,
                       guidance_ranks=(self.rank,), guidance_group=None)

    @property
    def delivers(self) -> bool:
        """True on the rank that hands the frames, soundtrack and latents to the caller (the mesh's first rank)."""
        return self.guidance_rank == 0 and self.cp_rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(config: ParallelConfig, local_rank: int) -> torch.device:
    device = torch.device(config.device) if config.device is not None else None
    if device is None and not torch.cuda.is_available():
        return torch.device("cpu")
    if device is not None and (device.type != "cuda" or device.index is not None):
        return device
    local_world = os.environ.get("LOCAL_WORLD_SIZE")
    return torch.device("cuda", cuda_ordinal(local_rank=local_rank, visible=torch.cuda.device_count(),
                                             local_world_size=None if local_world is None else int(local_world),
                                             env=os.environ))


def single_process_state(device: str | torch.device = "cpu") -> ParallelState:
    """A state for one process with no process group at all (every collective is the identity)."""
    return ParallelState(
        world_size=1, rank=0, local_rank=0, cp_size=1, cp_rank=0, cp_ranks=(0,), cp_group=None,
        cpu_group=None, device=torch.device(device), backend="none", timeout_s=_DEFAULT_TIMEOUT_S,
    )


def init_parallel(
    config: ParallelConfig | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    init_method: str | None = None,
) -> ParallelState:
    """Build the process groups from torchrun's environment or explicit arguments.

    ``rank``/``world_size`` default to ``RANK``/``WORLD_SIZE`` (torchrun sets them); a world of one with no
    process group initialised returns :func:`single_process_state`. The world is laid out as
    ``cp_infer.mesh.MeshLayout`` says (a layout that does not make the world is refused, listing the valid ones).
    """
    config = config or ParallelConfig()
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_rank is None else local_rank
    layout = MeshLayout.resolve(world_size, guidance_degree=config.guidance_degree,
                                ulysses_degree=config.ulysses_degree, ring_degree=config.ring_degree)
    cp_size = layout.sequence
    device = _pick_device(config, local_rank)
    if world_size == 1 and not dist.is_initialized():
        return single_process_state(device)

    backend = config.backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={device}; use backend='gloo'")
    timeout = datetime.timedelta(seconds=config.timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # NOTE(backend): one default group serving both CPU (gloo) and device tensors (nccl), so that
        # control messages never need the device backend.
        pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
        dist.init_process_group(
            backend=pg_backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
            timeout=timeout, device_id=device if backend == "nccl" else None,
        )
    # Every rank must create every group, in the same order, even the ones it does not belong to.
    world_group = dist.new_group(list(range(world_size)), backend="gloo", timeout=timeout)
    replica = layout.coords(rank)[0]
    replica_ranks = layout.replica_ranks(replica)
    cpu_group = world_group if layout.replicas == 1 else None
    if layout.replicas > 1:
        for r in range(layout.replicas):
            ranks = layout.replica_ranks(r)
            group = dist.new_group(list(ranks), backend="gloo", timeout=timeout) if len(ranks) > 1 else None
            if r == replica:
                cpu_group = group
    cp_group = None
    cp_ranks: tuple[int, ...] = (rank,)
    relay_groups = []
    for ranks in layout.sequence_groups():
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout) if cp_size > 1 else None
        if rank in ranks:
            cp_group, cp_ranks = group, tuple(ranks)
        for src, dst in _ring_edges(cp_size):
            edge = dist.new_group([ranks[src], ranks[dst]], backend=backend, timeout=timeout)
            if rank in (ranks[src], ranks[dst]):
                relay_groups.append((src, dst, edge))
    ulysses_group = ring_group = None
    ring_rank = 0
    if layout.ring > 1:  # attention's two sub-axes of the sequence group
        for ranks in layout.ulysses_groups():
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout) if layout.ulysses > 1 else None
            if rank in ranks:
                ulysses_group = group
        for ranks in layout.ring_groups():
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if rank in ranks:
                ring_group, ring_rank = group, ranks.index(rank)
    guidance_group = None
    guidance_ranks: tuple[int, ...] = (rank,)
    for ranks in layout.guidance_groups():
        group = dist.new_group(list(ranks), backend=backend, timeout=timeout) if layout.guidance > 1 else None
        if rank in ranks:
            guidance_group, guidance_ranks = group, ranks
    mesh_group, mesh_relays = None, []
    if layout.guidance > 1:  # the decode's group and ring over each replica's mesh (ParallelState.decoding)
        for r in range(layout.replicas):
            ranks = layout.replica_ranks(r)
            group = dist.new_group(list(ranks), backend=backend, timeout=timeout)
            if r == replica:
                mesh_group = group
            for src, dst in _ring_edges(len(ranks)):
                edge = dist.new_group([ranks[src], ranks[dst]], backend=backend, timeout=timeout)
                if rank in (ranks[src], ranks[dst]):
                    mesh_relays.append((src, dst, edge))
    links = []
    for r, lead in enumerate(layout.leaders()[1:], start=1):  # the front end's link to each other replica
        group = dist.new_group([0, lead], backend="gloo", timeout=timeout)
        if rank in (0, lead):
            links.append((r, group))
    return ParallelState(
        world_size=world_size, rank=rank, local_rank=local_rank, cp_size=cp_size,
        cp_rank=cp_ranks.index(rank), cp_ranks=cp_ranks, cp_group=cp_group, cpu_group=cpu_group,
        device=device, backend=backend, timeout_s=config.timeout_s, guidance_size=layout.guidance,
        guidance_rank=guidance_ranks.index(rank), guidance_ranks=guidance_ranks, guidance_group=guidance_group,
        relay_groups=tuple(relay_groups), mesh_group=mesh_group, mesh_relay_groups=tuple(mesh_relays),
        ulysses_size=layout.ulysses, ulysses_group=ulysses_group, ring_size=layout.ring, ring_rank=ring_rank,
        ring_group=ring_group,
        replica=replica, replicas=layout.replicas, replica_ranks=replica_ranks, world_group=world_group,
        links=tuple(links),
    )


def _ring_edges(size: int) -> list[tuple[int, int]]:
    """The one-way edges of the decode's ring over the first ``k`` group ranks, for every ``k`` from 2 to ``size``
    (a short video uses fewer ranks): ``r -> r + 1``, and ``k - 1 -> 0``."""
    edges = [(r, r + 1) for r in range(size - 1)]
    return edges + [(k - 1, 0) for k in range(2, size + 1)]


def destroy_parallel(state: ParallelState) -> None:
    """Tear down the process groups (idempotent; a single-process state has none)."""
    if state.distributed and dist.is_initialized():
        dist.destroy_process_group()
