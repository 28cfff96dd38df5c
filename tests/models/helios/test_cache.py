"""Helios' step caches (``cache=first_block``, ``cache=taylorseer``): at 1 rank diffusers' own ``HeliosPipeline``
with ``transformer.enable_cache(...)`` (diffusers registers no Helios block for its hooks: the test registers
``HeliosTransformerBlock`` as diffusers registers Wan's, its hidden states first in and out), at N ranks and on
guidance ranks the decisions of 1 rank.

Each chunk is a pass of its own, so each starts afresh (its first step runs every block), as every family's windows
and stages do; the pipeline never resets its hooks, so its TaylorSeer would go on predicting a new chunk's first
steps from the last chunk's features. The reference resets them where each chunk draws its noise. The contexts are the
pipeline's, ``cond`` and ``uncond``, one pass each. At 2 ranks the blocks' sequence (history and chunk, 25 tokens)
does not divide: the metric is taken over the real tokens alone. Tolerances as ``test_helios`` (frames within 1
level, latents 1e-4) once the decisions agree; the metrics within 1e-5 (fixed-point sums here, diffusers' float32
means there).
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
from .test_helios import _reference
from .test_helios import folder as folder  # the module's fixture

BASE = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry, low quality", num_frames=17,
            height=32, width=32, num_inference_steps=6, guidance_scale=4.0, num_latent_frames_per_chunk=3)
TAYLORSEER = dict(cache="taylorseer", cache_interval=2, disable_cache_before_step=2, max_order=1)


def _requests(seed: int) -> list[GenerationRequest]:
    return [GenerationRequest.of(**BASE, seed=seed, cache="first_block", cache_threshold=1.0),
            GenerationRequest.of(**BASE, seed=seed + 1, **TAYLORSEER)]


def _sample(state, where: str, requests):
    """Per request: frames (delivering rank), latents, every pass's trace on this rank, the cache's totals."""
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    model = HeliosModel(load_helios(where), state=state)
    return sample_traced(model, requests, state)


def _with_cache(where: str, request: GenerationRequest, config, output_type: str):
    """``HeliosPipeline`` with ``transformer.enable_cache(config)`` (``test_helios._reference``'s pipeline)."""
    from diffusers import HeliosPipeline
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry
    from diffusers.models.transformers.transformer_helios import HeliosTransformerBlock

    TransformerBlockRegistry.register(model_class=HeliosTransformerBlock, metadata=TransformerBlockMetadata(
        return_hidden_states_index=0, return_encoder_hidden_states_index=None))
    call = HeliosPipeline.__call__

    def cached(pipe, *args, **kwargs):
        pipe.transformer.enable_cache(config)
        draw = pipe.prepare_latents

        def each_chunk_afresh(*a, **k):  # the pipeline draws each chunk's noise first: its cache starts there
            pipe.transformer._reset_stateful_cache()
            return draw(*a, **k)

        pipe.prepare_latents = each_chunk_afresh
        return call(pipe, *args, **kwargs)

    HeliosPipeline.__call__ = cached
    try:
        options = {k: v for k, v in request.options.items() if not k.startswith(("cache", "disable_cache", "max_"))}
        return _reference(where, GenerationRequest(**{**request.__dict__, "options": options}), output_type)
    finally:
        HeliosPipeline.__call__ = call


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
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(latents, one_thread(_with_cache, folder, request, config, "latent"),
                                      err_msg=f"seed={seed} {request.options['cache']}")
        np.testing.assert_array_equal(frames, one_thread(_with_cache, folder, request, config, "np"),
                                      err_msg=f"seed={seed} {request.options['cache']}")
        assert len(traces) == 2  # a pass a chunk, each starting afresh
        for trace in traces:
            assert {d[1] for d in trace} == {"cond", "uncond"} and trace[0][2] is True
        skipped = sum(not d[2] for t in traces for d in t)
        assert skipped > 0 and totals.steps_skipped + totals.steps_computed == 2 * 6
    # First-Block Cache at threshold 1: every step after a pass's first reuses the tail (the metric stays below 1).
    assert [[d[2] for d in t] for t in ours[0][2]] == [[True, True] + [False] * 10] * 2
    # TaylorSeer: steps 0, 1 (the warm-up), then every second from 3 computes (TaylorSeerCacheHook's schedule).
    assert [[d[2] for d in t][::2] for t in ours[1][2]] == [[True, True, False, True, False, True]] * 2


@pytest.mark.parametrize("world,guidance", [(2, None), (2, 2)], ids=["U2", "G2"])
def test_ranks_decide_as_one_rank(folder, one_rank, world, guidance):
    """U2: the chunk and its history sharded unevenly, the metric summed over both ranks' real tokens; G2: the cond
    and uncond contexts on a guidance rank each."""
    seed, expected = one_rank
    results = SharedGroup(world, guidance).run(_sample, folder, _requests(seed), timeout=300)
    assert_caches_decide_alike(expected, results[0], guidance=guidance,
                               case=f"world={world} guidance={guidance} seed={seed}")
