"""Worker groups shared by the whole test session, and module fixtures over them.

Starting a group costs its ranks' imports of torch, diffusers and the engine (seconds each on two cores), and
the suite asks for about a hundred groups of a handful of layouts. :func:`shared_group` keeps the groups of the
last few layouts used (a small LRU: idle ranks hold hundreds of MB each) and hands the same processes to every test
module that asks for that layout; the session closes them at its end (``tests/conftest.py``).

What a test may rely on: a group from :func:`shared_group` is a fresh group's equal for any function that leaves
no process-wide state behind (every test function here builds its models and requests from its arguments; one that
changes dynamo's config restores it). A test whose group must be new (one that kills ranks, or measures their
memory from outside) starts its own ``WorkerGroup`` and closes it. A group a failure closed is replaced on the next
ask.

A test module binds a fixture to a module attribute (``group = group_per_world([1, 2, 3, 4])``); pytest finds the
fixture under that name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import pytest

from .harness import WorkerGroup

__all__ = ["SharedGroup", "close_shared_groups", "group_per_world", "groups_by_layout", "groups_by_world",
           "shared_group"]

_KEEP_RANKS = 8
"""At most this many idle ranks are kept across layouts (the least recently used groups are closed first)."""

_pool: OrderedDict[tuple, WorkerGroup] = OrderedDict()


def shared_group(world: int, guidance: int | None = None, ulysses: int | None = None,
                 ring: int | None = None) -> WorkerGroup:
    """The session's group of ``world`` ranks in this mesh layout (``guidance``/``ulysses``/``ring`` as
    ``WorkerGroup``'s ``guidance_degree``/``ulysses_degree``/``ring_degree``), started on first use or when the last
    one was closed."""
    key = (world, guidance, ulysses, ring)
    group = _pool.pop(key, None)
    if group is None or not group.usable:
        if group is not None:
            group.close()
        group = WorkerGroup(world, guidance_degree=guidance, ulysses_degree=ulysses, ring_degree=ring)
    _pool[key] = group
    while sum(g.world for g in _pool.values()) > max(_KEEP_RANKS, world):
        _pool.popitem(last=False)[1].close()
    return group


class SharedGroup:
    """A handle on the shared group of one layout: each call asks :func:`shared_group` again, so a group closed
    since (by a failure, or to make room) is started anew instead of failing every later test of the module."""

    def __init__(self, world: int, guidance: int | None = None, ulysses: int | None = None,
                 ring: int | None = None):
        self.world, self._key = world, (world, guidance, ulysses, ring)

    def run(self, fn, *args, timeout: float = 300.0) -> list:
        return shared_group(*self._key).run(fn, *args, timeout=timeout)


def close_shared_groups() -> None:
    while _pool:
        _pool.popitem()[1].close()


def group_per_world(worlds: Sequence[int]):
    """A fixture that is the shared group for each world size in ``worlds``: every test that takes it runs once per
    world, with ids ``world1``, ``world2``, ..."""

    @pytest.fixture(scope="module", params=worlds, ids=lambda w: f"world{w}")
    def group(request):
        return SharedGroup(request.param)

    return group


def groups_by_world():
    """A fixture that is a function ``world -> WorkerGroup`` (shared, Ulysses only), for modules whose tests
    parametrise the world size themselves (or use several): :func:`groups_by_layout`."""
    return groups_by_layout()


def groups_by_layout():
    """A fixture that is a function ``(world, guidance_degree, ring_degree) -> WorkerGroup`` (shared; the degrees
    unset: Ulysses only)."""

    @pytest.fixture(scope="module")
    def groups():
        return lambda world, guidance=None, ring=None: SharedGroup(world, guidance, ring=ring)

    return groups
