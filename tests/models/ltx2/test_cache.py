"""LTX-2's step caches. First-Block Cache: at 1 rank the unsharded loop (LTX2Pipeline itself, its blocks cached by
the reference below: diffusers' own hook does not take LTX-2's two-stream blocks), on guidance and Ulysses ranks 1
rank's decisions. TaylorSeer: at 1 rank LTX2Pipeline with diffusers' own ``TaylorSeerCacheConfig`` on every block
(its hook takes a block's tuple of outputs: both streams are extrapolated), on guidance and Ulysses ranks 1 rank.

Every guidance of the pipeline is on (CFG, STG, modality isolation), so all three of its cache contexts run
(``cond_uncond``, ``uncond_stg``, ``uncond_modality``). Shape (17, 96, 160): 3 x 3 x 5 = 45 video tokens, which do not
divide 2.

Tolerances: at 1 rank the cached tail is added as the reference adds it, so frames are bit-identical and the waveform
equal to float rounding (as ``test_ltx2_parallel``) whenever the decisions agree; the reference's metric is a float64
mean, ours an exact fixed-point sum (within 1e-9 relative; the threshold, between the middle two of a free run's
metrics, is asserted at least that far from each). At G=2 x U=2 the decision trace is 1 rank's exactly (metrics
within 1e-5: the residuals carry the sharded matmuls' fp32 rounding), the frames within 1 level (mean < 0.02) and the
waveform within 1e-4. TaylorSeer at 1 rank: the schedule is the hook's and the extrapolation the same operations in
the same order (factors in float32, the model's dtype), so frames are bit-identical and the waveform as above; at
G=2 x U=2 the trace is 1 rank's exactly (it is the schedule) and the frames and waveform within the same tolerances
as the uncached N-rank run (``test_ltx2_parallel``).
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import SharedGroup

GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.5)
BASE = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", num_frames=17, height=96,
            width=160, num_inference_steps=8, fps=24, spatio_temporal_guidance_blocks=(0,), **GUIDANCE)
# Steps 0, 1 (the warm-up) and every third from 3 run every block; 2, 4, 5 and 7 are extrapolated (second order).
TAYLORSEER = dict(cache="taylorseer", cache_interval=3, disable_cache_before_step=2, max_order=2)


@pytest.fixture(scope="module")
def folder():
    """The embedded tiny LTX-2 in the session's model cache (``tests/conftest.py``)."""
    from models.ltx2.default import ensure_default_ltx2_model

    return str(ensure_default_ltx2_model())


def _sample(state, folder, requests):
    """Per request: frames and waveform (delivering rank; None elsewhere), this rank's traces, the totals."""
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = None
    out = []
    for request in requests:
        audio, totals = {}, []
        control = SampleControl(on_audio=lambda w, sr, audio=audio: audio.update(waveform=w), on_cache=totals.append)
        frames = sample(model, request, state=state, control=control)
        out.append((frames, audio.get("waveform"), totals[-1]))
    return out


def _traces(state, folder, requests):
    """``_sample``'s results with every pass's trace (this rank's contexts)."""
    from models.ltx2 import adapter as ltx2

    caches = []
    make = ltx2.pass_cache

    def pass_cache(*args, **kwargs):
        caches.append(make(*args, **kwargs))
        return caches[-1]

    ltx2.pass_cache = pass_cache
    try:
        results = _sample(state, folder, requests)
    finally:
        ltx2.pass_cache = make
    traces = [[(d.step, d.context, d.compute, d.metric) for d in c.trace] for c in caches]
    return results, traces


class _ReferenceBlocks(torch.nn.ModuleList):
    """First-Block Cache written plainly over the pipeline's own loop: per cache context, the video residual of the
    first block against the one of the last step that ran every block (a float64 mean ratio), the cached tails of
    both streams added to the first block's outputs."""

    def __init__(self, blocks, threshold):
        super().__init__(blocks)
        self.threshold, self.context, self.states, self.decisions = threshold, None, {}, []

    def __iter__(self):
        blocks, state = list(super().__iter__()), self.states.setdefault(self.context, {})
        skip = []

        def head(**kwargs):
            video, audio = blocks[0](**kwargs)
            residual = video - kwargs["hidden_states"]
            prev = state.get("residual")
            metric = None if prev is None else ((residual - prev).abs().double().mean()
                                                / prev.abs().double().mean()).item()
            self.decisions.append((self.context, metric is None or metric > self.threshold, metric))
            if metric is None or metric > self.threshold:
                state.update(residual=residual, head=(video, audio))
                return video, audio
            skip.append(True)
            return state["tail"][0] + video, state["tail"][1] + audio

        def last(**kwargs):
            video, audio = blocks[-1](**kwargs)
            state["tail"] = (video - state["head"][0], audio - state["head"][1])
            return video, audio

        yield head
        if not skip:
            yield from blocks[1:-1]
            yield last


def _pipeline(folder):
    """LTX2Pipeline over the tiny model's components, and its transformer."""
    from diffusers import LTX2Pipeline

    from models.ltx2.loading import load_ltx2

    c = load_ltx2(folder)
    pipe = LTX2Pipeline(scheduler=c.scheduler, vae=c.vae, audio_vae=c.audio_vae, text_encoder=c.text_encoder,
                        tokenizer=c.tokenizer, connectors=c.connectors, transformer=c.transformer, vocoder=c.vocoder)
    pipe.set_progress_bar_config(disable=True)
    return pipe, c.transformer


def _run(pipe, request):
    """The pipeline's frames (uint8) and waveform for a request as given (every setting the pipeline takes is in
    it)."""
    ref = pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
               height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
               frame_rate=request.fps, spatio_temporal_guidance_blocks=list(BASE["spatio_temporal_guidance_blocks"]),
               generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np", **GUIDANCE)
    return (np.clip(ref.frames[0], 0, 1) * 255).round().astype(np.uint8), ref.audio[0].float().numpy()


def _reference(folder, request):
    """LTX2Pipeline, its blocks cached by ``_ReferenceBlocks`` at the request's threshold; and its decisions."""
    pipe, transformer = _pipeline(folder)
    blocks = _ReferenceBlocks(list(transformer.transformer_blocks), request.options["cache_threshold"])
    transformer.transformer_blocks = blocks

    @contextlib.contextmanager
    def cache_context(name):
        blocks.context = name
        yield

    transformer.cache_context = cache_context
    return (*_run(pipe, request), blocks.decisions)


def _diffusers_taylorseer(folder, request):
    """LTX2Pipeline with ``transformer.enable_cache(TaylorSeerCacheConfig(...))`` on every block (explicit
    identifiers: the default ones hook attention modules, not blocks), its factors in float32."""
    from diffusers.hooks import TaylorSeerCacheConfig

    pipe, transformer = _pipeline(folder)
    o = request.options
    transformer.enable_cache(TaylorSeerCacheConfig(
        cache_interval=o["cache_interval"], disable_cache_before_step=o["disable_cache_before_step"],
        max_order=o["max_order"], taylor_factors_dtype=torch.float32, cache_identifiers=[r"transformer_blocks\.\d+"]))
    return _run(pipe, request)


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    state = single_process_state()
    free = GenerationRequest.of(**BASE, seed=seed, cache="first_block", cache_threshold=0.0)
    _, (trace,) = one_thread(_traces, state, folder, [free])
    metrics = sorted(m for *_, m in trace if m is not None)
    # Between the two middle metrics, not at one: the cached run repeats the free run's metrics until its first skip.
    threshold = (metrics[len(metrics) // 2 - 1] + metrics[len(metrics) // 2]) / 2
    request = GenerationRequest.of(**BASE, seed=seed, cache="first_block", cache_threshold=threshold)
    return seed, request, one_thread(_traces, state, folder, [request])


def test_one_rank_is_the_unsharded_loop(folder, one_rank):
    seed, request, (((frames, waveform, totals),), (trace,)) = one_rank
    ref_frames, ref_audio, decisions = one_thread(_reference, folder, request)
    # The pipeline runs the contexts in our order: CFG's pair, STG, modality isolation.
    assert [d[1:3] for d in trace] == [d[:2] for d in decisions], f"seed={seed}"
    assert {d[2] for d in trace} == {True, False}, f"seed={seed}: the middle threshold did not mix"
    threshold = request.options["cache_threshold"]
    for (*_, metric), (*_, expected) in zip(trace, decisions, strict=True):
        assert (metric is None) == (expected is None)
        if metric is not None:
            assert metric == pytest.approx(expected, rel=1e-9) and abs(metric - threshold) > 1e-9 * threshold
    assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
    np.testing.assert_array_equal(frames, ref_frames, err_msg=f"seed={seed}")
    np.testing.assert_allclose(waveform[:, :ref_audio.shape[1]], ref_audio, rtol=0, atol=1e-6, err_msg=f"seed={seed}")
    skipped = {(d[0], d[1]) for d in trace if not d[2]}
    steps = {d[0] for d in trace}
    assert totals.steps_skipped == sum(all((s, c) in skipped for c in ("cond_uncond", "uncond_stg", "uncond_modality"))
                                       for s in steps)
    # A skipped pass saves the tiny model's second block: two for CFG's pair, one for STG's or modality's pass.
    assert totals.blocks_saved == sum(2 if c == "cond_uncond" else 1 for _, c in skipped)


@pytest.fixture(scope="module")
def taylorseer(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    request = GenerationRequest.of(**BASE, seed=seed, **TAYLORSEER)
    return seed, request, one_thread(_traces, single_process_state(), folder, [request])


@pytest.fixture(scope="module")
def guidance_and_ulysses(folder, one_rank, taylorseer):
    """G=2 x U=2, one group for both caches' requests (first_block's, then taylorseer's): per rank, per request its
    frames, waveform and totals and its pass's trace on that rank. CFG's pair on guidance rank 0, STG's and
    modality's passes on rank 1."""
    group = SharedGroup(4, 2)
    results = group.run(_traces, folder, [one_rank[1], taylorseer[1]], timeout=300)
    return [list(zip(out, traces, strict=True)) for out, traces in results]


def _merge(seed, totals, per_rank, frames, waveform):
    """Every rank's totals are ``totals`` and rank 0's frames and waveform within the uncached N-rank tolerance of
    1 rank's; the decisions of every context, each agreed by its holders (metrics within 1e-5)."""
    merged = {}
    for rank, ((f, w, t), trace) in enumerate(per_rank):
        assert t == totals, f"seed={seed} rank={rank}"
        for d in trace:
            assert merged.setdefault(d[:2], d)[2] == d[2], f"seed={seed}: holders disagree"
            assert d[3] is None or d[3] == pytest.approx(merged[d[:2]][3], rel=1e-5)
        if rank == 0:
            diff = np.abs(f.astype(np.int16) - frames.astype(np.int16))
            assert diff.max() <= 1 and diff.mean() < 0.02, f"seed={seed}: max {diff.max()} mean {diff.mean()}"
            np.testing.assert_allclose(w, waveform, rtol=0, atol=1e-4)
    return sorted(merged.values())


def test_guidance_and_ulysses_ranks_decide_as_one_rank(one_rank, guidance_and_ulysses):
    """First-Block Cache at G=2 x U=2: each context's decision reduced over its Ulysses group only; the totals agreed
    over the mesh."""
    seed, request, (((frames, waveform, totals),), (trace,)) = one_rank
    got = _merge(seed, totals, [ranks[0] for ranks in guidance_and_ulysses], frames, waveform)
    assert [d[:3] for d in got] == sorted(d[:3] for d in trace), f"seed={seed}"
    for d, e in zip(got, sorted(trace), strict=True):
        assert (d[3] is None) == (e[3] is None) and (d[3] is None or d[3] == pytest.approx(e[3], rel=1e-5))


def test_taylorseer_one_rank_is_diffusers(folder, taylorseer):
    seed, request, (((frames, waveform, totals),), (trace,)) = taylorseer
    ref_frames, ref_audio = one_thread(_diffusers_taylorseer, folder, request)
    schedule = [True, True, False, True, False, False, True, False]  # TaylorSeerCacheHook's, for TAYLORSEER
    assert trace == [(s, c, compute, None) for s, compute in enumerate(schedule)
                     for c in ("cond_uncond", "uncond_stg", "uncond_modality")]
    assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
    np.testing.assert_array_equal(frames, ref_frames, err_msg=f"seed={seed}")
    np.testing.assert_allclose(waveform[:, :ref_audio.shape[1]], ref_audio, rtol=0, atol=1e-6, err_msg=f"seed={seed}")
    # Four extrapolated steps, each saving the tiny model's 2 blocks for CFG's pair, STG's and modality's passes.
    assert (totals.steps_computed, totals.steps_skipped, totals.blocks_saved) == (4, 4, 4 * (2 + 1 + 1) * 2)


def test_taylorseer_guidance_and_ulysses_ranks_are_one_rank(taylorseer, guidance_and_ulysses):
    """TaylorSeer at G=2 x U=2: the schedule on every context's holders, each rank extrapolating its own shards."""
    seed, request, (((frames, waveform, totals),), (trace,)) = taylorseer
    got = _merge(seed, totals, [ranks[1] for ranks in guidance_and_ulysses], frames, waveform)
    assert got == sorted(trace), f"seed={seed}"


def test_both_stages_start_afresh(folder):
    """Two stages: each pass's cache is its own (stage 2, unguided, has the one context of its conditional pass), and
    each context's first step runs every block."""
    from cp_infer import single_process_state

    request = GenerationRequest.of(**dict(BASE, num_frames=9, height=128, width=128, num_inference_steps=4),
                                   seed=random.randrange(2**31), stages=2, cache="first_block", cache_threshold=1.0)
    _, traces = one_thread(_traces, single_process_state(), folder, [request])
    assert [sorted({d[1] for d in t}) for t in traces] == [["cond_uncond", "uncond_modality", "uncond_stg"],
                                                          ["cond_uncond"]]
    for trace in traces:
        first = [d for d in trace if d[0] == 0]
        assert first and all(d[2:] == (True, None) for d in first)
        assert all(d[3] is not None for d in trace if d[0] > 0)
