"""``--compile``: the transformer blocks compiled (``models.registry.compile_transformer_blocks``) give the latents and
frames of the eager engine: at 1 rank and at N=2 for the tiny LTX-2, for the tiny LTX-Video on a ring of 2 (R=2) with
its weights sharded (FSDP2) and its blocks compiled (the plain blocks, no adapter slots), and for the tiny Helios at N=2
(a chunk's and its history's tokens exchanged inside the blocks). LTX-Video's Ulysses all-to-alls compiled inside its
blocks at N=2, and its blocks compiled at 1 rank, equal the eager engine in ``test_lora_compile.py`` (adapter slots
compiled in; its requests include one without adapters, and it asserts no graph break). LTX-2 at 1 rank runs every
guidance it has (CFG, spatio-temporal guidance, modality isolation, CFG rescale), so each kind of block call is
compiled (NOTE(recompile-limit) in models/registry.py: batch 2 and batch 1 blocks, cross-modal attention on and off, a
perturbed block: three graphs); at N=2 it runs CFG, one graph with the video's and the audio's all-to-alls and the
cross-modal attention across the ranks inside it (every other guidance off). A graph with the exchanges inside costs
inductor ~30 s of one core here (~9 s without), so the other kinds are not compiled again at N=2, where they add no
exchange of their own.

Tolerance: inductor fuses the blocks' pointwise ops and norms into its own kernels, which sum fp32 in another order
and may keep intermediates in registers instead of rounding them to memory: ~1e-7 relative per op. Over a few steps
of the tiny models the final latents (unit scale) moved by at most 1.4e-6 (LTX-Video) and 4e-6 (LTX-2's audio) here,
so 1e-4 leaves room for other CPUs' vector widths while catching any real difference (a wrong shard, a skipped
exchange, a dropped head: O(1)). Frames: within 1 level of 255 (a ~1e-6 change can flip a rounding).

The test also checks that the compile happened as intended: dynamo captured graphs and broke none but at a ring's
point-to-point steps (a graph break elsewhere or a fallback to eager would make the comparison prove nothing about
the compiled path).
"""

import random

import numpy as np
import pytest
import torch

from models.ltx2.options import GUIDANCE_OFF

from ..worker_groups import SharedGroup

# LTX-Video: 3 x 1 x 3 = 9 latent tokens, uneven over 2 ranks (a padded token), CFG on (batch 2 through the blocks).
# LTX-2 (64 px at least): 2 x 2 x 3 = 12 video tokens and its own audio stream.
_SHAPES = {"ltx-video": dict(num_frames=17, height=32, width=96), "ltx2": dict(num_frames=9, height=64, width=96),
           "helios": dict(num_frames=17, height=32, width=32, num_latent_frames_per_chunk=3)}
_LTX2_GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                      modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7,
                      spatio_temporal_guidance_blocks=(0,))


def _sample(state, seed: int, compiled: bool, model_name: str | None = None, weights: str = "replicated",
            every_guidance: bool = False) -> dict:
    import torch._dynamo.utils

    from cp_infer.request import GenerationRequest
    from cp_infer.sampler import SampleControl, sample
    from models.registry import open_model

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = open_model(model_name, dtype="fp32", state=state, compile_blocks=compiled, weights=weights)
    if every_guidance:
        guidance = _LTX2_GUIDANCE
    elif model.family == "ltx2":  # CFG of both streams alone: one kind of block call (batch 2, cross-modal on)
        guidance = {**GUIDANCE_OFF, "guidance_scale": 3.0, "audio_guidance_scale": 5.0}
    else:
        guidance = dict(guidance_scale=3.0)
    request = GenerationRequest.of(prompt="a red fox runs through fresh snow", negative_prompt="blurry",
                                   num_inference_steps=2, seed=seed, fps=24, **_SHAPES[model.family], **guidance)
    latents = {}
    frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
    counters = torch._dynamo.utils.counters
    return dict(frames=frames, latents=latents or None, graphs=counters["stats"]["unique_graphs"],
                breaks=dict(counters["graph_break"]))


@pytest.mark.parametrize(("model_name", "world", "ring", "weights", "every_guidance"),
                         [("tiny-ltx2", 1, None, "replicated", True),
                          ("tiny-ltx2", 2, None, "replicated", False), (None, 2, 2, "sharded", False),
                          ("tiny-helios", 2, None, "replicated", False)],
                         ids=["ltx2-1-every-guidance", "ltx2-2-cfg", "ltx-video-ring-2-sharded", "helios-2"])
def test_compiled_blocks_equal_eager(model_name, world, ring, weights, every_guidance):
    """``weights="sharded"``: the blocks FSDP2-sharded (``--weights sharded``) and compiled, against the eager
    replicated run: FSDP2's gathers stay outside the compiled graphs (NOTE(compile-fsdp) in models/registry.py).
    ``ring``: a ring of that many ranks (``--ring-degree``), whose point-to-point steps run eagerly between two
    graphs of each block (NOTE(compile-collectives)): the only graph breaks are at the ring."""
    seed = random.randrange(2**31)
    group = SharedGroup(world, ring=ring)
    eager_ranks = group.run(_sample, seed, False, model_name, "replicated", every_guidance, timeout=300)
    compiled_ranks = group.run(_sample, seed, True, model_name, weights, every_guidance, timeout=600)
    for rank, (e, c) in enumerate(zip(eager_ranks, compiled_ranks, strict=True)):
        assert e["graphs"] == 0 and c["graphs"] >= 1, f"rank {rank}: graphs eager {e['graphs']}, compiled {c['graphs']}"
        if ring is None:
            assert not c["breaks"], f"rank {rank}: graph break(s) in the compiled blocks: {c['breaks']}"
        else:
            assert c["breaks"] and all("torch.compiler.disable" in reason for reason in c["breaks"]), \
                f"rank {rank}: graph breaks other than the ring's: {c['breaks']}"
            assert c["graphs"] >= 2, f"rank {rank}: {c['graphs']} graph(s): a block with a ring is two graphs"
    eager, compiled = eager_ranks[0], compiled_ranks[0]  # rank 0 holds the video and the latents
    assert eager["frames"].std() > 5, "degenerate video: the comparison would prove nothing"
    assert set(compiled["latents"]) == set(eager["latents"])
    for name in eager["latents"]:  # latents, and LTX-2's audio_latents
        torch.testing.assert_close(compiled["latents"][name], eager["latents"][name], rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"seed={seed} world={world} {name}: {m}")
    diff = np.abs(compiled["frames"].astype(np.int16) - eager["frames"].astype(np.int16))
    assert diff.max() <= 1, f"seed={seed} world={world}: frames differ by up to {diff.max()} levels"
