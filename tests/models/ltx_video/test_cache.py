"""LTX-Video's step caches (``cache=first_block``, ``cache=taylorseer``): at 1 rank diffusers' own
``LTXPipeline`` with ``transformer.enable_cache(...)``, at N ranks and on guidance ranks the decisions of 1 rank.

Shape (33, 32, 224): 5 x 1 x 7 = 35 latent tokens, which divide neither 2 nor 3 (padding on the last rank).

Tolerances: at 1 rank the adapter runs diffusers' modules and the hooks' arithmetic in the same order, so the frames
are bit-identical whenever the decisions agree; First-Block Cache's metric is summed exactly here (fixed point) where
diffusers takes float32 means, so the two metrics differ by float32 rounding (asserted within 1e-5 relative) and a
threshold within that of a metric could decide otherwise (the threshold here lies between the middle two metrics of
a run that computes every step, asserted at least 1e-5 away from every metric). At N ranks and on guidance ranks the
decision trace is 1 rank's exactly (every decision; the metrics within 1e-5: the residuals themselves carry fp32
summation-order differences of the sharded matmuls and attention, the reduction adds none); the frames then differ
from 1 rank's as the uncached ones do (``test_ltx_video_parallel``: within 1 level, 0.01 on average). Garbage in
the padding rows changes nothing, bit for bit.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import SharedGroup

BASE = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry, low quality", num_frames=33,
            height=32, width=224, num_inference_steps=10, guidance_scale=3.0, fps=24)
TAYLORSEER = dict(cache="taylorseer", cache_interval=3, disable_cache_before_step=2, max_order=2)


@pytest.fixture(scope="module")
def folder():
    """The embedded default in the session's model cache (``tests/conftest.py``): built once for every module that
    takes it so."""
    from models.ltx_video.default import ensure_default_model

    return str(ensure_default_model())


def _model(state, folder):
    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.loading import load_ltx_video

    model = LTXVideoModel(load_ltx_video(folder), state=state)
    model.decode_frames_per_rank = None  # one decode round, as LTXPipeline decodes
    return model


def _traced(model):
    """The caches the model makes, in order (one per pass)."""
    caches = []
    make = model.step_cache

    def step_cache(request):
        cache = make(request)
        caches.append(cache)
        return cache

    model.step_cache = step_cache
    return caches


def _garbage_in_padding(model, state):
    """Large random values in every padding row of the transformer's hidden states, different on every rank."""
    gen = torch.Generator().manual_seed(7 + state.rank)
    n = state.cp_size

    def hook(_module, _args, out):
        plan = model._ctx.plan
        valid = plan.valid_len(state.cp_rank)
        if valid < out.shape[1]:
            out[:, valid:] = 1e4 * torch.randn(out[:, valid:].shape, generator=gen)
        return out

    if n > 1:
        model.transformer.proj_in.register_forward_hook(hook)


def _sample(state, folder, requests, garbage=False):
    """Per request: frames (delivering rank; None elsewhere), every pass's trace on this rank, the cache's totals."""
    model = _model(state, folder)
    if garbage:
        _garbage_in_padding(model, state)
    out = []
    for request in requests:
        caches = _traced(model)
        totals = []
        frames = sample(model, request, state=state, control=SampleControl(on_cache=totals.append))
        traces = [[(d.step, d.context, d.compute, d.metric) for d in c.trace] for c in caches if c is not None]
        out.append((frames, traces, totals[-1] if totals else None))
    return out


def _requests(seed, threshold):
    return [GenerationRequest.of(**BASE, seed=seed, cache="first_block", cache_threshold=threshold),
            GenerationRequest.of(**BASE, seed=seed + 1, cache="first_block", cache_threshold=1.0),  # skips after step 0
            GenerationRequest.of(**BASE, seed=seed + 2, **TAYLORSEER)]


def _middle_threshold(state, folder, seed):
    """A threshold among the metrics of a run that computes every step (some steps then skip, some compute)."""
    (_, traces, _), = _sample(state, folder, [GenerationRequest.of(**BASE, seed=seed, cache="first_block",
                                                                    cache_threshold=0.0)])
    metrics = sorted(m for *_, m in traces[0] if m is not None)
    # Between the two middle metrics, not at one: the cached run repeats the free run's metrics until its first skip.
    return (metrics[len(metrics) // 2 - 1] + metrics[len(metrics) // 2]) / 2


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    state = single_process_state()
    threshold = one_thread(_middle_threshold, state, folder, seed)
    return seed, threshold, one_thread(_sample, state, folder, _requests(seed, threshold))


def _diffusers(folder, request, config):
    """LTXPipeline with ``transformer.enable_cache(config)``; and First-Block Cache's decisions and metrics."""
    import diffusers.hooks.first_block_cache as fbc
    from diffusers import LTXPipeline

    from models.ltx_video.loading import load_ltx_video

    c = load_ltx_video(folder)
    pipe = LTXPipeline(scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                       transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(config)
    seen = []
    decide = fbc.FBCHeadBlockHook._should_compute_remaining_blocks

    def spy(self, residual):
        prev = self.state_manager.get_state().head_block_residual
        metric = None if prev is None else ((residual - prev).abs().mean() / prev.abs().mean()).item()
        compute = decide(self, residual)
        seen.append((compute, metric))
        return compute

    fbc.FBCHeadBlockHook._should_compute_remaining_blocks = spy
    try:
        frames = pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                      height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                      guidance_scale=request.guidance_scale, frame_rate=request.fps,
                      generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np").frames[0]
    finally:
        fbc.FBCHeadBlockHook._should_compute_remaining_blocks = decide
    return (np.clip(frames, 0, 1) * 255).round().astype(np.uint8), seen


def test_one_rank_is_diffusers_first_block_cache_and_taylorseer(folder, one_rank):
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    seed, threshold, ours = one_rank
    requests = _requests(seed, threshold)
    for request, (frames, traces, totals) in zip(requests[:2], ours[:2], strict=True):
        t = request.options["cache_threshold"]
        ref, seen = one_thread(_diffusers, folder, request, FirstBlockCacheConfig(threshold=t))
        (trace,) = traces
        assert [compute for _, _, compute, _ in trace] == [compute for compute, _ in seen], f"seed={seed} t={t}"
        for (*_, metric), (_, expected) in zip(trace, seen, strict=True):
            assert (metric is None) == (expected is None)
            if metric is not None:
                assert metric == pytest.approx(expected, rel=1e-5)
                assert abs(metric - t) > 1e-5 * t, f"seed={seed}: a metric at the threshold would decide either way"
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref, err_msg=f"seed={seed} threshold={t}")
        skipped = sum(not compute for _, _, compute, _ in trace)
        assert totals.steps_skipped == skipped and totals.steps_computed == len(trace) - skipped
        assert totals.blocks_saved == skipped * 2 * (2 - 1)  # CFG's two passes, the tiny model's second block
    assert {c for _, _, c, _ in ours[0][1][0]} == {True, False}, f"seed={seed}: the middle threshold did not mix"
    assert [c for _, _, c, _ in ours[1][1][0]] == [True] + [False] * 9
    o = requests[2].options
    config = TaylorSeerCacheConfig(cache_interval=o["cache_interval"], max_order=o["max_order"],
                                   disable_cache_before_step=o["disable_cache_before_step"],
                                   taylor_factors_dtype=torch.float32, cache_identifiers=[r"transformer_blocks\.\d+"])
    ref, _ = one_thread(_diffusers, folder, requests[2], config)
    frames, (trace,), totals = ours[2]
    np.testing.assert_array_equal(frames, ref, err_msg=f"seed={seed} taylorseer")
    # Steps 0, 1 (the warm-up), then every third from 3: TaylorSeerCacheHook's schedule.
    assert [c for _, _, c, _ in trace] == [True, True, False, True, False, False, True, False, False, True]
    assert (totals.steps_computed, totals.steps_skipped, totals.blocks_saved) == (5, 5, 5 * 2 * 2)


def _compare(seed, expected, got, what):
    for k, ((exp_frames, exp_traces, exp_totals), (frames, traces, totals)) in enumerate(
            zip(expected, got, strict=True)):
        case = f"{what} seed={seed} request {k}"
        assert len(traces) == len(exp_traces), case
        for trace, exp in zip(traces, exp_traces, strict=True):
            assert [d[:3] for d in trace] == [d[:3] for d in exp], case
            for d, e in zip(trace, exp, strict=True):
                assert (d[3] is None) == (e[3] is None) and (d[3] is None or d[3] == pytest.approx(e[3], rel=1e-5))
        assert totals == exp_totals, case
        if exp_frames is not None:
            diff = np.abs(frames.astype(np.int16) - exp_frames.astype(np.int16))
            assert diff.max() <= 1 and diff.mean() < 0.01, f"{case}: max {diff.max()} mean {diff.mean()}"


@pytest.mark.parametrize("world,guidance,ring", [(2, None, None), (3, None, None), (2, 2, None), (4, 2, None),
                                                 (2, None, 2)], ids=["U2", "U3", "G2", "G2xU2", "R2"])
def test_ranks_decide_as_one_rank(folder, one_rank, world, guidance, ring):
    """U2 and U3: uneven shards (35 tokens), U3 also with garbage in their padding rows (bit-identical to the clean
    run); G2: CFG's two passes on two guidance ranks; G2xU2: both, the decision reduced over the mesh; R2: the
    sequence over a ring of two, the decision reduced over it."""
    seed, threshold, expected = one_rank
    group = SharedGroup(world, guidance, ring=ring)
    results = group.run(_sample, folder, _requests(seed, threshold), timeout=300)
    garbage = None if world != 3 else group.run(_sample, folder, _requests(seed, threshold)[:1], True, timeout=300)
    # Rank 0 delivers; every rank holds the one context (Ulysses peers, and both guidance ranks of CFG's pair).
    for rank, result in enumerate(results):
        if rank:
            result = [(expected[k][0], traces, totals) for k, (_, traces, totals) in enumerate(result)]
        _compare(seed, expected, result, f"world={world} rank={rank}")
    if garbage is not None:
        for clean, dirty in zip(results, garbage, strict=True):
            for (f, t, s), (g, u, v) in zip(clean[:1], dirty, strict=True):
                assert t == u and s == v and (f is None or np.array_equal(f, g)), f"seed={seed}: garbage decided"


def test_every_window_and_stage_starts_afresh(folder):
    """Two stages and a long video's windows: every pass's cache starts with a step that runs every block (no
    residual of another pass), and the totals add up over the passes. TaylorSeer's warm-up (3 steps) on stage 2's 4
    steps: its last step is a prediction; on a 3-step pass none would be (it would run every block)."""
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    small = dict(BASE, num_frames=9, height=64, width=64, num_inference_steps=5)
    requests = [
        GenerationRequest.of(**small, seed=seed, stages=2, cache="first_block", cache_threshold=1.0),
        GenerationRequest.of(**dict(small, num_frames=57), seed=seed, temporal_tile_size=40, temporal_overlap=24,
                             cache="first_block", cache_threshold=1.0),
        GenerationRequest.of(**small, seed=seed, stages=2, cache="taylorseer", disable_cache_before_step=3),
    ]
    results = one_thread(_sample, single_process_state(), folder, requests)
    (_, stages, stage_totals), (_, windows, window_totals), (_, taylor, _) = results
    for traces, steps in ((stages, [5, 4]), (windows, [4, 4, 4])):
        assert [len(t) for t in traces] == steps
        for trace in traces:
            assert trace[0][2:] == (True, None) and all(not d[2] for d in trace[1:])
    assert (stage_totals.steps_computed, stage_totals.steps_skipped) == (2, 7)
    assert (window_totals.steps_computed, window_totals.steps_skipped) == (3, 9)
    assert [[d[2] for d in t] for t in taylor] == [[True, True, True, False, True], [True, True, True, False]]
