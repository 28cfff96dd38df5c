"""Wan with ``--weights sharded``: the transformer (Wan 2.2 A14B: both experts) and the UMT5 text encoder sharded over
the replica group with FSDP2, each rank reading only its rows, equal to the replicated run bit for bit (frames and
latents), for Wan 2.1 T2V at 2 Ulysses ranks and 2 guidance ranks and Wan 2.2 A14B (two experts) at 2 Ulysses
ranks; each rank holds at most 1/N of each sharded component plus one block, the memory plan's bytes to the byte.

The replicated reference holds its sharded components' weights in memory of their own (NOTE(mmap-alignment) in
``test_sharded``).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...worker_groups import groups_by_layout

SHARDED = ("transformer", "transformer_2", "text_encoder")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from models.wan.default import ensure_default_wan_model, save_wan_model

    return {"t2v": str(ensure_default_wan_model()),
            "a14b": str(save_wan_model(tmp_path_factory.mktemp("wan-a14b") / "a14b", variant="a14b"))}


groups = groups_by_layout()  # (world, guidance_degree) -> the session's shared group


def _run(state, folder: str, weights: str, seed: int):
    from models.common.placement import measure_components
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, weights=weights)
    if weights == "replicated":  # NOTE(mmap-alignment) in test_sharded
        for module in model.experts + [model.components.text_encoder]:
            for param in module.parameters():
                param.data = param.data.clone()
    # 9 frames at 48 x 80 -> 3 x 3 x 5 = 45 tokens: uneven over 2 ranks; CFG on, and a request without it.
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_frames=9, height=48,
                width=80, num_inference_steps=3, max_sequence_length=64)
    out = []
    for i, guidance in enumerate((4.0, 1.0)):
        latents: dict = {}
        frames = sample(model, GenerationRequest.of(**base, guidance_scale=guidance, seed=seed + i), state=state,
                        control=SampleControl(on_latents=latents.update))
        out.append((frames, latents or None))
    return out, measure_components(model.components, model.placement)


def _bytes(held) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _where, n in held.entries:
        out[name] = out.get(name, 0) + n
    return out


@pytest.mark.parametrize(("variant", "layout"), [("t2v", (2, 1)), ("t2v", (2, 2)), ("a14b", (2, 1))],
                         ids=["t2v-world2-G1", "t2v-world2-G2", "a14b-world2-G1"])
def test_sharded_equals_replicated(groups, folders, variant, layout):
    from models.common.placement import model_components

    world, guidance = layout
    group, seed = groups(world, guidance), random.randrange(2**31)
    replicated = group.run(_run, folders[variant], "replicated", seed)
    sharded = group.run(_run, folders[variant], "sharded", seed)
    for i, (want, got) in enumerate(zip(replicated[0][0], sharded[0][0], strict=True)):
        assert want[0].std() > 5, "degenerate video: the comparison would prove nothing"
        assert np.array_equal(want[0], got[0]), f"seed={seed} {variant} {layout} request {i}: frames differ"
        assert want[1].keys() == got[1].keys()
        for name in want[1]:
            assert np.array_equal(want[1][name], got[1][name]), f"seed={seed} request {i}: {name} differ"
    plan = {c.name: c for c in model_components(folders[variant], dtype="fp32")}
    for rank, ((_, held), (_, whole)) in enumerate(zip(sharded, replicated, strict=True)):
        assert held.weights == "sharded" and whole.weights == "replicated"
        mine, all_of = _bytes(held), _bytes(whole)
        names = [n for n in SHARDED if n in plan]
        assert ("transformer_2" in names) == (variant == "a14b")
        for name in names:
            block = max(b.nbytes for b in plan[name].blocks)
            assert mine[name] <= all_of[name] / world + block, (rank, name, mine[name], all_of[name])
            assert mine[name] == plan[name].shard_nbytes(world, held.rank), (rank, name)
        assert {k: v for k, v in mine.items() if k not in names} == {k: v for k, v in all_of.items()
                                                                      if k not in names}
