"""Mesh arithmetic: how the world's ranks are laid out over the parallel axes, and how a step's guidance passes are
shared out. Pure integers; no process group.

Invariants:
- ``world = replicas x guidance x ulysses``: a replica group is ``guidance x ulysses`` consecutive ranks that runs
  its own jobs (its first rank leads it); the replicas share nothing but the front end that dispatches to them.
- Ulysses is the innermost axis: ``rank = (replica * guidance + g) * ulysses + u``. A Ulysses group (two all-to-alls
  per attention layer) is a run of consecutive ranks, which on a GPU node are the ones nearest each other; a
  guidance group (one exchange per step) strides over them.
- :meth:`MeshLayout.guidance_first` is the layout a command picks when no degree is given and its requests are known:
  as many guidance ranks as divide both the world and every step's pass count, Ulysses over the rest.
- :func:`pass_shares` cuts a step's passes into contiguous shares in pass order, sizes differing by at most one, the
  larger first; a guidance rank may get none (more ranks than passes), and then it runs nothing but still joins the
  step's exchange.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MeshLayout", "pass_shares", "valid_layouts"]


def valid_layouts(world: int) -> list[tuple[int, int]]:
    """Every ``(guidance, ulysses)`` whose groups divide ``world`` (``world / (guidance * ulysses)`` replicas), one
    replica first, then by guidance degree."""
    layouts = [(g, u) for g in range(1, world + 1) for u in range(1, world + 1) if world % (g * u) == 0]
    return sorted(layouts, key=lambda gu: (world // (gu[0] * gu[1]), gu[0]))


def _layouts_text(world: int) -> str:
    def one(g: int, u: int) -> str:
        replicas = world // (g * u)
        return f"--guidance-degree {g} --ulysses-degree {u}" + (f" ({replicas} replicas)" if replicas > 1 else "")

    return ", ".join(one(g, u) for g, u in valid_layouts(world))


@dataclass(frozen=True)
class MeshLayout:
    """The sizes of the mesh's axes over a world of ``world`` ranks."""

    world: int
    guidance: int = 1
    """Guidance degree: ranks a step's guidance passes are spread over."""
    ulysses: int = 1
    """Ulysses degree: ranks each pass's token sequences are sharded over."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world={self.world} must be >= 1")
        if self.guidance < 1 or self.ulysses < 1 or self.world % (self.guidance * self.ulysses):
            raise ValueError(f"guidance_degree={self.guidance} x ulysses_degree={self.ulysses} does not divide a "
                             f"world of {self.world} ranks into replica groups; valid layouts: "
                             f"{_layouts_text(self.world)}")

    @classmethod
    def resolve(cls, world: int, *, guidance_degree: int | None = None,
                ulysses_degree: int | None = None) -> MeshLayout:
        """The layout for the given degrees, the unset ones filled in: guidance 1, Ulysses the rest of the world (so
        one replica unless both degrees are set and leave ranks over)."""
        guidance = 1 if guidance_degree is None else guidance_degree
        if ulysses_degree is None:
            if guidance < 1 or world % guidance:
                raise ValueError(f"guidance_degree={guidance} does not divide a world of {world} ranks; valid "
                                 f"layouts: {_layouts_text(world)}")
            ulysses_degree = world // guidance
        return cls(world=world, guidance=guidance, ulysses=ulysses_degree)

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
    def replicas(self) -> int:
        return self.world // (self.guidance * self.ulysses)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(replica, guidance index, Ulysses index)`` of a global rank."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank={rank} is not in a world of {self.world}")
        replica, rest = divmod(rank, self.guidance * self.ulysses)
        g, u = divmod(rest, self.ulysses)
        return replica, g, u

    def rank(self, replica: int, g: int, u: int) -> int:
        return (replica * self.guidance + g) * self.ulysses + u

    @property
    def replica_size(self) -> int:
        return self.guidance * self.ulysses

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """A replica group's global ranks, in order; the first leads it."""
        return tuple(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def leaders(self) -> tuple[int, ...]:
        """Each replica's first rank, by replica."""
        return tuple(r * self.replica_size for r in range(self.replicas))

    def ulysses_groups(self) -> list[tuple[int, ...]]:
        """Every Ulysses group's global ranks (in group-rank order), in the order every rank creates them."""
        return [tuple(self.rank(r, g, u) for u in range(self.ulysses))
                for r in range(self.replicas) for g in range(self.guidance)]

    def guidance_groups(self) -> list[tuple[int, ...]]:
        """Every guidance group's global ranks (in group-rank order), in the order every rank creates them."""
        return [tuple(self.rank(r, g, u) for g in range(self.guidance))
                for r in range(self.replicas) for u in range(self.ulysses)]


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
