"""Mesh arithmetic: how the world's ranks are laid out over the parallel axes, and how a step's guidance passes are
shared out. Pure integers; no process group.

Invariants:
- ``world = replicas x guidance x ring x ulysses``: a replica group is ``guidance x ring x ulysses`` consecutive
  ranks that runs its own jobs (its first rank leads it); the replicas share nothing but the front end that
  dispatches to them.
- Ulysses is the innermost axis, the ring the next: ``rank = ((replica * guidance + g) * ring + r) * ulysses + u``.
  A pass's sequence is sharded over the ``ring x ulysses`` consecutive ranks of its *sequence group* (sequence
  shard ``r * ulysses + u``). A Ulysses group (two all-to-alls per attention layer) is a run of consecutive ranks,
  which on a GPU node are the ones nearest each other; a ring (one block passed on per ring step, point to point)
  strides over them, so across nodes it is the ring that crosses the slow link; a guidance group (one exchange per
  step) strides over both.
- :meth:`MeshLayout.guidance_first` is the layout a command picks when no degree is given and its requests are known:
  as many guidance ranks as divide both the world and every step's pass count, Ulysses over the rest.
- :func:`auto_ring` splits a sequence group into Ulysses x ring: Ulysses up to the ranks of a node and a divisor of
  the heads, the ring for the rest.
- :func:`pass_shares` cuts a step's passes into contiguous shares in pass order, sizes differing by at most one, the
  larger first; a guidance rank may get none (more ranks than passes), and then it runs nothing but still joins the
  step's exchange.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MeshLayout", "auto_ring", "pass_shares", "valid_layouts"]


def valid_layouts(world: int) -> list[tuple[int, int]]:
    """Every ``(guidance, ulysses)`` whose groups divide ``world`` (``world / (guidance * ulysses)`` replicas), one
    replica first, then by guidance degree."""
    layouts = [(g, u) for g in range(1, world + 1) for u in range(1, world + 1) if world % (g * u) == 0]
    return sorted(layouts, key=lambda gu: (world // (gu[0] * gu[1]), gu[0]))


def _layouts_text(world: int, ring: int = 1) -> str:
    """The valid layouts with a ring of ``ring`` (every ring degree that divides ``world`` if it does not)."""
    if ring < 1 or world % ring:
        rings = [r for r in range(2, world + 1) if world % r == 0]
        return (f"--ring-degree must divide the {world} ranks: one of {rings}" if rings
                else f"no ring fits {world} rank(s): leave out --ring-degree")

    def one(g: int, u: int) -> str:
        replicas = world // (g * u * ring)
        return (f"--guidance-degree {g} {f'--ring-degree {ring} ' if ring > 1 else ''}--ulysses-degree {u}"
                + (f" ({replicas} replicas)" if replicas > 1 else ""))

    return ", ".join(one(g, u) for g, u in valid_layouts(world // ring))


def auto_ring(ranks: int, heads: int, node_ranks: int) -> tuple[int, int]:
    """``(ulysses, ring)`` for a sequence group of ``ranks``: Ulysses the largest divisor of ``ranks`` that divides
    ``heads`` (no padded head) and fits a node of ``node_ranks`` ranks (its all-to-alls stay on the node's links),
    the ring over the rest (``ranks / ulysses``)."""
    if ranks < 1 or heads < 1 or node_ranks < 1:
        raise ValueError(f"ranks={ranks}, heads={heads} and node_ranks={node_ranks} must be >= 1")
    ulysses = max(u for u in range(1, ranks + 1) if ranks % u == 0 and heads % u == 0 and u <= node_ranks)
    return ulysses, ranks // ulysses


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the mesh's axes over a world of ``world`` ranks."""

    world: int
    guidance: int = 1
    """Guidance degree: ranks a step's guidance passes are spread over."""
    ulysses: int = 1
    """Ulysses degree: ranks of a ring block's all-to-all (each attends its share of the heads)."""
    ring: int = 1
    """Ring degree: Ulysses groups a pass's sequence is sharded over, that pass key/value blocks round a ring."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world={self.world} must be >= 1")
        if min(self.guidance, self.ulysses, self.ring) < 1 or self.world % (self.guidance * self.sequence):
            ring = f" x ring_degree={self.ring}" if self.ring > 1 else ""
            raise ValueError(f"guidance_degree={self.guidance}{ring} x ulysses_degree={self.ulysses} does not divide "
                             f"a world of {self.world} ranks into replica groups; valid layouts: "
                             f"{_layouts_text(self.world, self.ring)}")

    @classmethod
    def resolve(cls, world: int, *, guidance_degree: int | None = None, ulysses_degree: int | None = None,
                ring_degree: int | None = None) -> MeshLayout:
        """The layout for the given degrees, the unset ones filled in: guidance 1, ring 1, Ulysses the rest of the
        world (so one replica unless every degree is set and they leave ranks over)."""
        guidance = 1 if guidance_degree is None else guidance_degree
        ring = 1 if ring_degree is None else ring_degree
        if ulysses_degree is None:
            if guidance < 1 or ring < 1 or world % (guidance * ring):
                what = f"guidance_degree={guidance}" + (f" x ring_degree={ring}" if ring != 1 else "")
                raise ValueError(f"{what} does not divide a world of {world} ranks; valid layouts: "
                                 f"{_layouts_text(world, ring)}")
            ulysses_degree = world // (guidance * ring)
        return cls(world=world, guidance=guidance, ulysses=ulysses_degree, ring=ring)

    @classmethod
    def guidance_first(cls, world: int, passes: Iterable[int]) -> MeshLayout:
        """One replica group with the most guidance ranks ``G`` that divides ``world`` and every count in ``passes``
        (each step's guidance passes, over the plans to be run), Ulysses over the other ``world / G``.

        Why guidance first: a guidance group exchanges its predictions once per step, a Ulysses group runs two
        all-to-alls per attention layer, so for the same ranks the guidance axis moves the least data; an even
        share keeps every guidance rank busy (a pass count that ``G`` does not divide would leave some idle for
        part of each step, so such a ``G`` is not taken). ``passes`` empty: Ulysses over every rank."""
        counts = [int(n) for n in passes]
        if any(n < 1 for n in counts):
            raise ValueError(f"passes={counts}: every step runs at least one pass")
        if not counts:
            return cls(world=world, guidance=1, ulysses=world)
        guidance = max(g for g in range(1, world + 1) if world % g == 0 and all(n % g == 0 for n in counts))
        return cls(world=world, guidance=guidance, ulysses=world // guidance)

    @property
    def sequence(self) -> int:
        """Ranks a pass's sequence is sharded over: ``ring x ulysses``."""
        return self.ring * self.ulysses

    @property
    def replicas(self) -> int:
        return self.world // (self.guidance * self.sequence)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(replica, guidance index, sequence index)`` of a global rank; the sequence index is
        ``ring index x ulysses + Ulysses index``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is not in a world of {self.world}")
        replica, rest = divmod(rank, self.guidance * self.sequence)
        g, s = divmod(rest, self.sequence)
        return replica, g, s

    def rank(self, replica: int, g: int, s: int) -> int:
        return (replica * self.guidance + g) * self.sequence + s

    @property
    def replica_size(self) -> int:
        return self.guidance * self.sequence

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """A replica group's global ranks, in order; the first leads it."""
        return tuple(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def leaders(self) -> tuple[int, ...]:
        """Each replica's first rank, by replica."""
        return tuple(r * self.replica_size for r in range(self.replicas))

    def sequence_groups(self) -> list[tuple[int, ...]]:
        """Every sequence group's global ranks (in group-rank order = sequence shard order), in the order every rank
        creates them: ``ring x ulysses`` consecutive ranks."""
        return [tuple(self.rank(r, g, s) for s in range(self.sequence))
                for r in range(self.replicas) for g in range(self.guidance)]

    def ulysses_groups(self) -> list[tuple[int, ...]]:
        """Every Ulysses group's global ranks (in group-rank order), in the order every rank creates them."""
        return [group[i * self.ulysses:(i + 1) * self.ulysses]
                for group in self.sequence_groups() for i in range(self.ring)]

    def ring_groups(self) -> list[tuple[int, ...]]:
        """Every ring's global ranks (in ring order), in the order every rank creates them: a stride of
        ``ulysses`` through a sequence group."""
        return [group[u::self.ulysses] for group in self.sequence_groups() for u in range(self.ulysses)]

    def guidance_groups(self) -> list[tuple[int, ...]]:
        """Every guidance group's global ranks (in group-rank order), in the order every rank creates them."""
        return [tuple(self.rank(r, g, s) for g in range(self.guidance))
                for r in range(self.replicas) for s in range(self.sequence)]


def pass_shares(passes: int, ranks: int) -> tuple[range, ...]:
    """The passes (indices ``0..passes-1``) each of ``ranks`` guidance ranks runs: contiguous, in order, sizes
    differing by at most one, the larger first (3 passes on 2 ranks: ``[0, 1], [2]``; 1 on 2: ``[0], []``)."""
    if passes < 0 or ranks < 1:
        raise ValueError(f"passes={passes} must be >= 0 and ranks={ranks} >= 1")
    base, extra = divmod(passes, ranks)
    shares, start = [], 0
    for g in range(ranks):
        size = base + (1 if g < extra else 0)
        shares.append(range(start, start + size))
        start += size
    return tuple(shares)
