"""LTX-Video sampled with the Ulysses engine: 1 rank equals diffusers' own LTXPipeline, N ranks equal 1 rank.

Shapes are chosen so the latent token count does not divide the number of ranks (uneven shards and padding).

Tolerances: at 1 rank our loop runs diffusers' own modules in the same order, so the frames are bit-identical
to ``LTXPipeline``. With N ranks the maths is the same but matmuls over fewer rows and SDPA over permuted
layouts may sum in another order: fp32 differences of ~1e-6 that can flip a rounding to uint8, so frames agree
within 1 level (of 255) and on average within 0.01 levels (bf16: see ``_tolerance``).
"""

import random

import numpy as np
import pytest
import torch

from cp_infer import ShardPlan
from cp_infer.request import GenerationRequest
from cp_infer.sampler import sample

from ...worker_groups import SharedGroup

# (frames, height, width) -> latent tokens: 3*2*3=18, 2*3*5=30, 4*1*7=28, 1*1*1=1
SHAPES = [(17, 64, 96), (9, 96, 160), (25, 32, 224), (1, 32, 32)]
DTYPES = (torch.float32, torch.bfloat16)


def _tolerance(dtype, exp, exp_fp32):
    """Allowed (max, mean) difference in uint8 levels between N ranks and 1 rank.

    fp32: 1 level, 0.01 on average (see the module docstring). bf16 rounds every matmul output to 8 mantissa
    bits, so a different summation order moves values by a bf16 ulp: on average the N-rank error may be as large
    as bf16's own error against fp32 for the same video (measured here: mean 0.5-0.7 levels), not larger. The
    worst pixel is the sum of two independent bf16 roundings, so its bound is twice bf16's own worst pixel (max
    4-8 levels here; N=3 was seen at 11). The fp32 check above is the one that proves the algorithm exact.
    """
    if dtype == torch.float32:
        return 1, 0.01
    own = np.abs(exp.astype(np.int16) - exp_fp32.astype(np.int16))
    return 2 * int(own.max()) + 1, float(own.mean()) + 0.05


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from models.ltx_video.default import ensure_default_model

    path = tmp_path_factory.mktemp("cache")
    ensure_default_model(path)
    return str(path)


def _requests(seed):
    return [GenerationRequest(prompt="a red fox runs through fresh snow", negative_prompt="blurry, low quality",
                              num_frames=f, height=h, width=w, num_inference_steps=3, guidance_scale=3.0,
                              seed=seed + i, fps=24) for i, (f, h, w) in enumerate(SHAPES)]


def _load(state, cache_dir, dtype=torch.float32):
    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    return LTXVideoModel(load_ltx_video(ensure_default_model(cache_dir), dtype=dtype), state=state)


def _sample_all(state, cache_dir, seed, dtype=torch.float32, frames_per_rank=2):
    """``frames_per_rank``: latent frames per rank per streamed decode round (None: one round)."""
    model = _load(state, cache_dir, dtype=dtype)
    model.decode_frames_per_rank = frames_per_rank
    return [sample(model, r, state=state) for r in _requests(seed)]


def test_one_rank_equals_diffusers_pipeline(cache_dir):
    from diffusers import LTXPipeline

    from cp_infer import single_process_state
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    seed = random.randrange(2**31)
    # One decode round, as LTXPipeline decodes: bit-identical (rounds change only the summation order).
    ours = _sample_all(single_process_state(), cache_dir, seed, frames_per_rank=None)
    c = load_ltx_video(ensure_default_model(cache_dir))
    pipe = LTXPipeline(scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                       transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    for r, frames in zip(_requests(seed), ours, strict=True):
        ref = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, height=r.height,
                   width=r.width, num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale,
                   frame_rate=r.fps, generator=torch.Generator("cpu").manual_seed(r.seed), output_type="np").frames[0]
        ref8 = (np.clip(ref, 0, 1) * 255).round().astype(np.uint8)
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref8, err_msg=f"seed={seed} shape={frames.shape}")


@pytest.fixture(scope="module")
def one_rank(cache_dir):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    # One thread, as in every worker rank: in bf16 the thread count alone changes how a matmul's reduction is
    # split and rounded, which is not what these tests measure.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return seed, {dtype: _sample_all(single_process_state(), cache_dir, seed, dtype) for dtype in DTYPES}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_n_ranks_equal_one_rank(cache_dir, one_rank, world):
    seed, expected = one_rank
    group = SharedGroup(world)
    results = {dtype: group.run(_sample_all, cache_dir, seed, dtype, timeout=600) for dtype in DTYPES}
    for dtype in DTYPES:
        assert all(r is None for rank in results[dtype][1:] for r in rank), "only group rank 0 returns frames"
        for exp, exp_fp32, got in zip(expected[dtype], expected[torch.float32], results[dtype][0], strict=True):
            assert got.shape == exp.shape
            max_levels, mean_levels = _tolerance(dtype, exp, exp_fp32)
            diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
            assert diff.max() <= max_levels and diff.mean() < mean_levels, \
                f"world={world} {dtype} seed={seed} shape={exp.shape}: max {diff.max()} mean {diff.mean()}"


@pytest.mark.parametrize("world,ring", [(2, 2), (3, 3), (4, 4)], ids=["R2", "R3", "R4"])
def test_a_ring_equals_one_rank(cache_dir, one_rank, world, ring):
    """The sequence over a ring (U=1): each rank's queries over every key/value block passed round it, merged by
    their log-sum-exp; fp32, every request (their tokens divide neither 2 nor 3; 18 and 30 do not divide 4, and the
    1-token video leaves 3 of 4 blocks all padding)."""
    seed, expected = one_rank
    results = SharedGroup(world, ring=ring).run(_sample_all, cache_dir, seed, timeout=600)
    for exp, got in zip(expected[torch.float32], results[0], strict=True):
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert got.shape == exp.shape and diff.max() <= 1 and diff.mean() < 0.02, \
            f"R={ring} seed={seed} shape={exp.shape}: max {diff.max()} mean {diff.mean()}"


@pytest.mark.parametrize("world", [2, 3, 4])
def test_local_rope_equals_the_shard_of_the_whole_grid(world):
    """Each rank's (cos, sin), computed from its own tokens' coordinates only, equal the rows of diffusers' own
    whole-grid (cos, sin) that the rank holds. No process group: the coordinates are pure arithmetic."""
    from diffusers.models.transformers.transformer_ltx import LTXVideoRotaryPosEmbed

    from models.ltx_video.parallel import _local_video_coords

    rope = LTXVideoRotaryPosEmbed(dim=96, patch_size=1, patch_size_t=1)
    frames, height, width = 5, 7, 9  # 315 tokens: uneven shards at 2 and 4 ranks
    scale = (8 / 24, 32, 32)
    hidden = torch.randn(2, frames * height * width, 96)
    full = rope(hidden, frames, height, width, scale)
    plan = ShardPlan(orig_len=frames * height * width, world=world)
    for rank in range(world):
        args = dict(hidden_states=hidden[:, : plan.local_len], num_frames=frames, height=height, width=width,
                    rope_interpolation_scale=scale, video_coords=None)
        coords = _local_video_coords(rope, args, plan, rank)
        local = rope(hidden[:, : plan.local_len], frames, height, width, scale, coords)
        start, stop = plan.token_range(rank)
        for got, whole in zip(local, full, strict=True):
            assert got.shape == (1, plan.local_len, 96)
            assert torch.isfinite(got).all()
            # Same float32 operations per element; only cos/sin may take another SIMD lane: within an ulp.
            torch.testing.assert_close(got[:, : stop - start].expand(2, -1, -1), whole[:, start:stop],
                                       rtol=0, atol=1e-6)
        # The caller's own coordinates are cut like the latents.
        given = torch.randn(2, 3, plan.orig_len)
        torch.testing.assert_close(_local_video_coords(rope, dict(args, video_coords=given), plan, rank),
                                   plan.shard(given, rank, dim=2), rtol=0, atol=0)
