"""``--compile``: the transformer blocks compiled (``models.registry.compile_transformer_blocks``) give the latents and
frames of the eager engine, at 1 rank and at N=2 (the Ulysses all-to-alls compiled inside the blocks).

Tolerance: inductor fuses the blocks' pointwise ops and norms into its own kernels, which sum fp32 in another order
and may keep intermediates in registers instead of rounding them to memory: ~1e-7 relative per op. Over a few steps
of the tiny model the final latents (unit scale) moved by at most 1.4e-6 here at 1 and 2 ranks, so 1e-4 leaves room
for other CPUs' vector widths while catching any real difference (a wrong shard, a skipped exchange, a dropped
head: O(1)). Frames: within 1 level of 255 (a ~1e-6 change can flip a rounding).

The test also checks that the compile happened as intended: dynamo captured graphs and broke none (a graph break
or a fallback to eager would make the comparison prove nothing about the compiled path).
"""

import random

import numpy as np
import pytest
import torch

from ..harness import WorkerGroup

# 3 x 1 x 3 = 9 latent tokens: uneven over 2 ranks (a padded token), CFG on (batch 2 through the blocks).
_SHAPE = dict(num_frames=17, height=32, width=96)


def _sample(state, seed: int, compiled: bool) -> dict:
    import torch._dynamo.utils

    from cp_infer.request import GenerationRequest
    from cp_infer.sampler import SampleControl, sample
    from models.registry import open_model

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = open_model(None, dtype="fp32", state=state, compile_blocks=compiled)
    request = GenerationRequest(prompt="a red fox runs through fresh snow", negative_prompt="blurry",
                                num_inference_steps=2, guidance_scale=3.0, seed=seed, fps=24, **_SHAPE)
    latents = {}
    frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
    counters = torch._dynamo.utils.counters
    return dict(frames=frames, latents=latents.get("latents"), graphs=counters["stats"]["unique_graphs"],
                breaks=sum(counters["graph_break"].values()))


@pytest.mark.parametrize("world", [1, 2])
def test_compiled_blocks_equal_eager(world):
    seed = random.randrange(2**31)
    group = WorkerGroup(world)
    try:
        eager_ranks = group.run(_sample, seed, False, timeout=300)
        compiled_ranks = group.run(_sample, seed, True, timeout=600)
    finally:
        group.close()
    for rank, (e, c) in enumerate(zip(eager_ranks, compiled_ranks, strict=True)):
        assert e["graphs"] == 0 and c["graphs"] >= 1, f"rank {rank}: graphs eager {e['graphs']}, compiled {c['graphs']}"
        assert c["breaks"] == 0, f"rank {rank}: {c['breaks']} graph break(s) in the compiled blocks"
    eager, compiled = eager_ranks[0], compiled_ranks[0]  # rank 0 holds the video and the latents
    assert eager["frames"].std() > 5, "degenerate video: the comparison would prove nothing"
    torch.testing.assert_close(compiled["latents"], eager["latents"], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"seed={seed} world={world}: {m}")
    diff = np.abs(compiled["frames"].astype(np.int16) - eager["frames"].astype(np.int16))
    assert diff.max() <= 1, f"seed={seed} world={world}: frames differ by up to {diff.max()} levels"
