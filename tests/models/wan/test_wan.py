"""Wan 2.1 text-to-video sampled with the Ulysses engine: 1 rank equals diffusers' own WanPipeline, N ranks and
guidance ranks equal 1 rank.

tiny-wan has 5 heads (they divide neither 2 nor 3 ranks: padded heads), and the shapes' token counts (latent frames x
rows x columns of 2x2 patches) divide neither: 5 x 1 x 5 = 25, and 3 x 3 x 5 = 45 (uneven at 2).

Tolerances: at 1 rank our loop runs diffusers' own modules in the same order (the tokens unpacked to the video's grid
for the transformer, the scheduler stepping the same values in another layout, the decode the VAE's own frame by
frame), so frames and latents are bit-identical to ``WanPipeline``. With N Ulysses ranks the maths is the same, but
the patch embedding over a column of patches instead of the grid, matmuls over fewer rows and SDPA over the exchanged
layout may sum in another order: fp32 differences of ~1e-6 that can flip a rounding to uint8, so frames agree within
1 level and on average within 0.01, latents within 1e-4. Guidance ranks run each pass as the pipeline does (a batch
of one) and exchange the outputs unchanged: bit-identical.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer import ShardPlan
from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import groups_by_world
from .._parity import assert_ranks_close, text_projection_calls

groups = groups_by_world()

# (frames, height, width) -> tokens: 25, 45 (see the module docstring)
SHAPES = [(17, 16, 80), (9, 48, 80)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    from models.wan.default import ensure_default_wan_model

    return str(ensure_default_wan_model(tmp_path_factory.mktemp("wan")))


def _requests(seed: int) -> list[GenerationRequest]:
    guidance = [4.0, 1.0]  # the second without CFG: one pass a step
    return [GenerationRequest(prompt="a red fox runs through fresh snow", negative_prompt="blurry, low quality",
                              num_frames=f, height=h, width=w, num_inference_steps=3, guidance_scale=g, seed=seed + i)
            for i, ((f, h, w), g) in enumerate(zip(SHAPES, guidance, strict=True))]


def _sample_all(state, folder: str, seed: int, frames_per_rank=1, first: int | None = None):
    """``(frames, latents)`` per request (the ``first`` ones only, if given); ``frames_per_rank``: latent frames per
    streamed decode round."""
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    model = WanModel(load_wan(folder), state=state)
    model.decode_frames_per_rank = frames_per_rank
    out = []
    for request in _requests(seed)[:first]:
        latents = {}
        frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
        out.append((frames, latents.get("latents")))
    return out


def _pipeline(folder: str):
    from diffusers import WanPipeline

    from models.wan.loading import load_wan

    c = load_wan(folder)
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                       transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _reference(pipe, r: GenerationRequest, output_type: str) -> np.ndarray:
    out = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, height=r.height,
               width=r.width, num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
               generator=torch.Generator("cpu").manual_seed(r.seed), output_type=output_type).frames
    if output_type == "latent":
        return out.float().numpy()
    return (np.clip(out[0], 0, 1) * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folder, seed)


def test_pack_patches_is_the_transformers_token_order():
    """A token holds its patch's values in the patch embedding's (C, pt, ph, pw) order, tokens in the transformer's
    (frame, row, column) order; unpacking inverts it, and a column grid lays any run of tokens out as patches."""
    from models.wan.parallel import pack_patches, unpack_patches

    rng = np.random.default_rng()
    c, f = int(rng.integers(1, 5)), int(rng.integers(2, 4))  # at least 2 tokens: the column below drops one
    h, w = 2 * int(rng.integers(1, 4)), 2 * int(rng.integers(1, 4))
    x = torch.randn(1, c, f, h, w)
    tokens = pack_patches(x, (1, 2, 2))
    assert tokens.shape == (1, f * (h // 2) * (w // 2), c * 4)
    s = int(rng.integers(tokens.shape[1]))
    frame, row, col = s // ((h // 2) * (w // 2)), s // (w // 2) % (h // 2), s % (w // 2)
    torch.testing.assert_close(tokens[0, s], x[0, :, frame, 2 * row:2 * row + 2, 2 * col:2 * col + 2].flatten(),
                               rtol=0, atol=0)
    torch.testing.assert_close(unpack_patches(tokens, (f, h // 2, w // 2), (1, 2, 2)), x, rtol=0, atol=0)
    column = unpack_patches(tokens[:, 1:], (tokens.shape[1] - 1, 1, 1), (1, 2, 2))
    torch.testing.assert_close(pack_patches(column, (1, 2, 2)), tokens[:, 1:], rtol=0, atol=0)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_local_rope_equals_the_shard_of_the_whole_grid(world):
    """Each rank's (cos, sin), gathered from the module's tables for its own tokens only, are the rows of diffusers'
    own whole-grid (cos, sin) that the rank holds, exactly. No process group: pure indexing."""
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    from models.wan.parallel import local_rope

    rope = WanRotaryPosEmbed(attention_head_dim=24, patch_size=(1, 2, 2), max_seq_len=64)
    frames, height, width = 3, 5, 7  # 105 tokens: uneven shards at 2 and 4 ranks
    full = rope(torch.randn(1, 16, frames, 2 * height, 2 * width))
    plan = ShardPlan(orig_len=frames * height * width, world=world)
    for rank in range(world):
        local = local_rope(rope, (frames, height, width), plan, rank)
        start, stop = plan.token_range(rank)
        for got, whole in zip(local, full, strict=True):
            assert got.shape == (1, plan.local_len, 1, 24) and torch.isfinite(got).all()
            torch.testing.assert_close(got[:, : stop - start], whole[:, start:stop], rtol=0, atol=0)


def test_one_rank_equals_wan_pipeline(folder, one_rank):
    seed, ours = one_rank
    pipe = _pipeline(folder)
    for r, (frames, latents) in zip(_requests(seed), ours, strict=True):
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        # The reference on one thread too, as ours: the thread count alone changes how a matmul's sum is split.
        np.testing.assert_array_equal(latents, one_thread(_reference, pipe, r, "latent"), err_msg=f"seed={seed}")
        np.testing.assert_array_equal(frames, one_thread(_reference, pipe, r, "np"), err_msg=f"seed={seed}")


def test_one_round_decode_equals_the_streamed_one(folder, one_rank):
    """The decode in rounds of one latent frame (as above) and in one round (the VAE's whole-video decode) give the
    same frames: every round continues the feature cache of the one before."""
    from cp_infer import single_process_state

    seed, ours = one_rank
    whole = one_thread(_sample_all, single_process_state(), folder, seed, None)
    for (streamed, _), (once, _) in zip(ours, whole, strict=True):
        np.testing.assert_array_equal(streamed, once)


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_equal_one_rank(folder, one_rank, groups, world):
    seed, expected = one_rank
    results = groups(world).run(_sample_all, folder, seed, timeout=600)
    assert_ranks_close(expected, results, world=world, seed=seed)


def test_guidance_ranks_equal_one_rank(folder, one_rank):
    """G=2: CFG's conditional pass on one rank, the unconditional on the other (the second request has no CFG: one
    pass, the second rank idle but in the exchange)."""
    from ...worker_groups import SharedGroup

    seed, expected = one_rank
    group = SharedGroup(2, 2)
    results = group.run(_sample_all, folder, seed, timeout=600)
    assert_ranks_close(expected, results, world=2, seed=seed, exact=True)


@pytest.mark.parametrize(("ulysses", "ring"), [(2, 2)], ids=["U2xR2"])
def test_ring_ranks_equal_one_rank(folder, one_rank, ulysses, ring):
    """A ring axis: the sequence over ring x Ulysses ranks, key/value blocks passed round the ring; the first
    request (CFG, 25 tokens) only, to keep the test short. 5 heads pad to 6 on U=2; 25 tokens leave the last ring
    block 11 real keys of 14. (A ring of two alone, U=1 x R=2, is LTX-2's test, tests/models/ltx2/test_parallel.py:
    the suite's budget takes one end-to-end ring per layout.)"""
    from ...worker_groups import SharedGroup

    seed, expected = one_rank
    results = SharedGroup(ulysses * ring, None, ulysses, ring).run(_sample_all, folder, seed, 1, 1, timeout=600)
    assert_ranks_close(expected[:1], results, world=f"U{ulysses}xR{ring}", seed=seed)


def test_flow_shift_is_the_schedulers(folder):
    """``flow_shift`` set: the schedule of the folder's scheduler config with that shift (the pipeline given such a
    scheduler), bit for bit; unset: the folder's own (above)."""
    from diffusers import UniPCMultistepScheduler

    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    seed = random.randrange(2**31)
    request = GenerationRequest(prompt="a lighthouse at dusk", num_frames=5, height=32, width=48,
                                num_inference_steps=3, guidance_scale=3.0, seed=seed, options={"flow_shift": 7.5})
    model = WanModel(load_wan(folder), state=single_process_state())
    frames = one_thread(sample, model, request, state=single_process_state())
    pipe = _pipeline(folder)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=7.5)
    np.testing.assert_array_equal(frames, one_thread(_reference, pipe, request, "np"), err_msg=f"seed={seed}")
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=3.0)  # the folder's
    assert np.abs(frames.astype(np.int16) - one_thread(_reference, pipe, request, "np")).mean() > 0.5


def test_text_keys_and_values_are_projected_once_per_request(folder):
    """Each block's cross-attention projects the text's keys and values once per pass of a request (CFG: the
    conditional and the unconditional prompt), not at every step; the text embedder runs once per prompt."""
    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    model = WanModel(load_wan(folder), state=single_process_state())
    calls = text_projection_calls(model.transformer)
    request = GenerationRequest(prompt="a fox", num_frames=5, height=32, width=48, num_inference_steps=4,
                                guidance_scale=3.0, seed=1)
    sample(model, request, state=single_process_state())
    assert calls == {"to_k": 2, "text_embedder": 2}


def _per_replica(state, folder: str, seed: int):
    """Replica ``r`` runs request ``r`` alone, at the same time as the other replica runs its own."""
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    model = WanModel(load_wan(folder), state=state)
    model.decode_frames_per_rank = 1
    return sample(model, _requests(seed)[state.replica], state=state)


def test_two_replicas_each_equal_one_rank(folder, one_rank):
    """World 2 = 2 replicas x 1 rank: each replica runs its own job; each is the 1-rank video bit for bit."""
    from ...worker_groups import SharedGroup

    seed, expected = one_rank
    group = SharedGroup(2, 1, 1)
    results = group.run(_per_replica, folder, seed, timeout=600)
    for replica, frames in enumerate(results):
        np.testing.assert_array_equal(frames, expected[replica][0], err_msg=f"replica {replica} seed={seed}")
