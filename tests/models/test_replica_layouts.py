"""Replica groups: a world split into replicas runs a different job on each, every one equal to 1 rank.

Layouts (world = replicas x guidance x Ulysses): 4 = 2 x 1 x 2 (LTX-Video, 12 latent tokens uneven over each
replica's two Ulysses ranks; each replica its own seed and shape) and 4 = 2 x 2 x 1 (LTX-2, three guidance passes
uneven over each replica's two guidance ranks). Tolerances are test_guidance_parallel's, for its reasons.
"""

from __future__ import annotations

import random

import pytest
import torch

from cp_infer.request import GenerationRequest

from ..worker_groups import SharedGroup
from .test_guidance_parallel import LTX2_THREE_PASSES, _check, _ltx2_requests, _one_rank, _sample


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx_video.default import ensure_default_model

    root = tmp_path_factory.mktemp("replicas")
    return {"ltx-video": str(ensure_default_model(root / "ltx")), "ltx2": str(ensure_default_ltx2_model(root / "ltx2"))}


@pytest.fixture(scope="module")
def layouts():
    """``(guidance, ulysses) -> `` the session's group of 4 ranks in that layout."""
    return lambda guidance, ulysses: SharedGroup(4, guidance, ulysses)


def _per_replica(state, family: str, folder: str, requests: list[list[GenerationRequest]]) -> list[tuple]:
    """Each replica runs its own requests (``requests[replica]``) at the same time as the others."""
    return _sample(state, family, folder, requests[state.replica])


def _check_replicas(results, expected, *, mean_levels: float, what: str) -> None:
    for replica, leader in enumerate((0, 2)):
        _check([results[leader], results[leader + 1]], expected[replica], mean_levels=mean_levels,
               what=f"{what} replica {replica}")


def test_ltx_video_two_replicas_of_two_ulysses_ranks_each_equal_one_rank(folders, layouts):
    seed = random.randrange(2**31)
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=2, fps=24,
                guidance_scale=3.0)
    requests = [[GenerationRequest(**base, num_frames=9, height=64, width=96, seed=seed)],
                [GenerationRequest(**base, num_frames=17, height=32, width=64, seed=seed + 1)]]
    expected = [_one_rank("ltx-video", folders["ltx-video"], r) for r in requests]
    results = layouts(1, 2).run(_per_replica, "ltx-video", folders["ltx-video"], requests, timeout=300)
    _check_replicas(results, expected, mean_levels=0.01, what=f"2 replicas x U=2 seed={seed}")


def test_ltx2_two_replicas_of_two_guidance_ranks_each_equal_one_rank(folders, layouts):
    seed = random.randrange(2**31)
    requests = [_ltx2_requests(seed, LTX2_THREE_PASSES), _ltx2_requests(seed + 7, None)]
    expected = [_one_rank("ltx2", folders["ltx2"], r) for r in requests]
    results = layouts(2, 1).run(_per_replica, "ltx2", folders["ltx2"], requests, timeout=300)
    _check_replicas(results, expected, mean_levels=0.02, what=f"2 replicas x G=2 seed={seed}")


def _groups_of(state) -> tuple:
    token = torch.tensor([float(state.rank)])
    torch.distributed.all_reduce(token, group=state.cpu_group)
    return (state.replica, state.replica_ranks, state.leads_replica, state.cp_ranks, state.guidance_ranks,
            state.decoding.cp_ranks, [r for r, _ in state.links], token.item())


def test_each_replica_has_its_own_groups_and_rank_0_a_link_to_the_others(layouts):
    got = layouts(2, 1).run(_groups_of)
    assert got == [(0, (0, 1), True, (0,), (0, 1), (0, 1), [1], 1.0), (0, (0, 1), False, (1,), (0, 1), (0, 1), [], 1.0),
                   (1, (2, 3), True, (2,), (2, 3), (2, 3), [1], 5.0), (1, (2, 3), False, (3,), (2, 3), (2, 3), [], 5.0)]
