"""Module-scoped pytest fixtures over the spawn harness, shared by the multi-rank test modules.

A test module binds one to a module attribute (``group = group_per_world([1, 2, 3, 4])``); pytest finds the
fixture under that name. Being module scoped, each module starts its own worker groups and closes them when its
last test is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from .harness import WorkerGroup

__all__ = ["group_per_world", "groups_by_layout", "groups_by_world"]


def group_per_world(worlds: Sequence[int]):
    """A fixture that is one ``WorkerGroup`` per world size in ``worlds``: every test that takes it runs once per
    world, with ids ``world1``, ``world2``, ..."""

    @pytest.fixture(scope="module", params=worlds, ids=lambda w: f"world{w}")
    def group(request):
        g = WorkerGroup(request.param)
        yield g
        g.close()

    return group


def groups_by_world():
    """A fixture that is a function ``world -> WorkerGroup``, each group started on first use, for modules whose
    tests parametrise the world size themselves (or use several): :func:`groups_by_layout`, Ulysses only."""
    return groups_by_layout()


def groups_by_layout():
    """A fixture that is a function ``(world, guidance_degree) -> WorkerGroup``, each group started on first use
    (``guidance_degree`` unset: Ulysses only)."""

    @pytest.fixture(scope="module")
    def groups():
        made = {}

        def get(world, guidance=None):
            if (world, guidance) not in made:
                made[(world, guidance)] = WorkerGroup(world, guidance_degree=guidance)
            return made[(world, guidance)]

        yield get
        for group in made.values():
            group.close()

    return groups
