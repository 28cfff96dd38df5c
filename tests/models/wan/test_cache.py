"""Wan's step caches (``cache=first_block``, ``cache=taylorseer``): at 1 rank diffusers' own ``WanPipeline`` with
``transformer.enable_cache(...)``, bit for bit; at N ranks and on guidance ranks the decisions of 1 rank. The
contexts are the pipeline's, ``cond`` and ``uncond``, one pass each.

Shape (17, 16, 80): 5 x 1 x 5 = 25 tokens, which do not divide 2 (padding on the last rank: the metric is taken over
the real tokens alone). Tolerances as ``test_wan`` (frames within 1 level, latents 1e-4) once the decisions agree; the
metrics within 1e-5 (fixed-point sums here, diffusers' float32 means there).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest

from ...harness import one_thread
from ...worker_groups import SharedGroup
from .._parity import assert_caches_decide_alike, sample_traced
from .test_wan import _pipeline, _reference
from .test_wan import folder as folder  # the module's fixture

BASE = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry, low quality", num_frames=17,
            height=16, width=80, num_inference_steps=6, guidance_scale=4.0)
TAYLORSEER = dict(cache="taylorseer", cache_interval=2, disable_cache_before_step=2, max_order=1)


def _requests(seed: int) -> list[GenerationRequest]:
    return [GenerationRequest.of(**BASE, seed=seed, cache="first_block", cache_threshold=1.0),
            GenerationRequest.of(**BASE, seed=seed + 1, **TAYLORSEER)]


def _sample(state, where: str, requests):
    """Per request: frames (delivering rank), latents, the pass's trace on this rank, the cache's totals."""
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    model = WanModel(load_wan(where), state=state)
    model.decode_frames_per_rank = 1
    return sample_traced(model, requests, state)


def _with_cache(where: str, request: GenerationRequest, config, output_type: str) -> np.ndarray:
    pipe = _pipeline(where)
    pipe.transformer.enable_cache(config)
    return _reference(pipe, request, output_type)


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample, single_process_state(), folder, _requests(seed))


def test_one_rank_is_diffusers_first_block_cache_and_taylorseer(folder, one_rank):
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    seed, ours = one_rank
    requests = _requests(seed)
    o = requests[1].options
    configs = [FirstBlockCacheConfig(threshold=1.0),
               TaylorSeerCacheConfig(cache_interval=o["cache_interval"], max_order=o["max_order"],
                                     disable_cache_before_step=o["disable_cache_before_step"],
                                     taylor_factors_dtype=torch.float32, cache_identifiers=[r"blocks\.\d+"])]
    for request, config, (frames, latents, traces, totals) in zip(requests, configs, ours, strict=True):
        case = f"seed={seed} {request.options['cache']}"
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(latents, one_thread(_with_cache, folder, request, config, "latent"),
                                      err_msg=case)
        np.testing.assert_array_equal(frames, one_thread(_with_cache, folder, request, config, "np"), err_msg=case)
        (trace,) = traces
        assert {d[1] for d in trace} == {"cond", "uncond"} and trace[0][2] is True
        # A step is skipped when every context's call skipped (StepCache.step_stats); cond and uncond decide apart.
        computes: dict[int, bool] = {}
        for step, _, compute, _ in trace:
            computes[step] = computes.get(step, False) or compute
        skipped = sum(not c for c in computes.values())
        assert any(not d[2] for d in trace) and (totals.steps_computed, totals.steps_skipped) == (6 - skipped, skipped)
    # TaylorSeer: steps 0, 1 (the warm-up), then every second from 3 (TaylorSeerCacheHook's schedule).
    assert [d[2] for d in ours[1][2][0]][::2] == [True, True, False, True, False, True]


@pytest.mark.parametrize("world,guidance", [(2, None), (2, 2)], ids=["U2", "G2"])
def test_ranks_decide_as_one_rank(folder, one_rank, world, guidance):
    """U2: 25 tokens over 2 ranks, the metric summed over both ranks' real tokens; G2: the cond and uncond contexts
    on a guidance rank each."""
    seed, expected = one_rank
    results = SharedGroup(world, guidance).run(_sample, folder, _requests(seed), timeout=300)
    assert_caches_decide_alike(expected, results[0], guidance=guidance,
                               case=f"world={world} guidance={guidance} seed={seed}")


def test_each_expert_has_its_own_cache(tmp_path):
    """Wan 2.2 A14B: the high-noise expert's steps, then the low-noise one's, each expert's cache its own (as each of
    the pipeline's transformers has its own hooks): its first step runs every block. At 1 rank WanPipeline with the
    cache on both transformers, bit for bit."""
    from diffusers import WanPipeline
    from diffusers.hooks import TaylorSeerCacheConfig

    from cp_infer import single_process_state
    from models.wan.default import save_wan_model
    from models.wan.loading import load_wan

    where = str(save_wan_model(tmp_path / "a14b", variant="a14b"))
    seed = random.randrange(2**31)
    request = GenerationRequest.of(**BASE, seed=seed, guidance_scale_2=2.5, **TAYLORSEER)
    ((frames, latents, traces, totals),) = one_thread(_sample, single_process_state(), where, [request])
    assert len(traces) == 2 and all(t[0][2] is True for t in traces), traces
    assert sum(len(t) for t in traces) == 2 * 6 and totals.steps_skipped > 0

    c = load_wan(where)
    pipe = WanPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                       transformer=c.transformer, transformer_2=c.transformer_2, boundary_ratio=c.layout.boundary_ratio)
    pipe.set_progress_bar_config(disable=True)
    o = request.options
    for expert in (pipe.transformer, pipe.transformer_2):
        expert.enable_cache(TaylorSeerCacheConfig(
            cache_interval=o["cache_interval"], max_order=o["max_order"], taylor_factors_dtype=torch.float32,
            disable_cache_before_step=o["disable_cache_before_step"], cache_identifiers=[r"blocks\.\d+"]))
    out = one_thread(lambda: pipe(prompt=request.prompt, negative_prompt=request.negative_prompt,
                                  num_frames=request.num_frames, height=request.height, width=request.width,
                                  num_inference_steps=request.num_inference_steps,
                                  guidance_scale=request.guidance_scale, guidance_scale_2=2.5,
                                  generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").frames)
    np.testing.assert_array_equal(latents, out.float().numpy(), err_msg=f"seed={seed}")
