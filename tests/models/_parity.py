"""What "N ranks equal 1 rank" means for a family's parity tests whose runs return ``[(frames, latents), ...]`` per
request on every rank (frames ``None`` off the delivering rank)."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def assert_ranks_close(expected, results, *, world, seed, exact=False) -> None:
    """``results`` (every rank's runs) against ``expected`` (1 rank's): only rank 0 delivers; frames within 1 uint8
    level (mean under 0.01) and latents within 1e-4, or bit for bit with ``exact``."""
    assert all(r is None for rank in results[1:] for r, _ in rank), "only the delivering rank returns frames"
    for (exp, exp_latents), (got, got_latents) in zip(expected, results[0], strict=True):
        assert got.shape == exp.shape
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        if exact:
            assert diff.max() == 0, f"world={world} seed={seed} shape={exp.shape}: max {diff.max()}"
            np.testing.assert_array_equal(got_latents, exp_latents)
            continue
        assert diff.max() <= 1 and diff.mean() < 0.01, \
            f"world={world} seed={seed} shape={exp.shape}: max {diff.max()} mean {diff.mean()}"
        torch.testing.assert_close(torch.from_numpy(got_latents), torch.from_numpy(exp_latents), rtol=0, atol=1e-4)


def sample_traced(model, requests, state) -> list:
    """Per request, ``model`` sampled with its step cache traced: ``(frames, latents, traces, totals)``, ``traces``
    every pass's decisions on this rank ``[(step, context, compute, metric), ...]``, ``totals`` the cache's last."""
    from cp_infer.sampler import SampleControl, sample

    caches = []
    make = model.step_cache
    model.step_cache = lambda request: caches.append(make(request)) or caches[-1]
    out = []
    for request in requests:
        caches.clear()
        latents, totals = {}, []
        frames = sample(model, request, state=state,
                        control=SampleControl(on_latents=latents.update, on_cache=totals.append))
        traces = [[(d.step, d.context, d.compute, d.metric) for d in c.trace] for c in caches if c is not None]
        out.append((frames, latents.get("latents"), traces, totals[-1]))
    return out


def assert_caches_decide_alike(expected, got, *, guidance, case) -> None:
    """Rank 0's :func:`sample_traced` runs (``got``) against 1 rank's (``expected``): the decisions of the contexts it
    holds (with guidance ranks, ``cond`` alone) are 1 rank's, their metrics within 1e-5 and the totals equal; then the
    latents within 1e-4 and the frames within 1 uint8 level (mean under 0.02)."""
    for k, ((exp_frames, exp_latents, exp_traces, exp_totals), (frames, latents, traces, totals)) in enumerate(
            zip(expected, got, strict=True)):
        what = f"{case} request {k}"
        held = [[d for d in t if guidance is None or d[1] == "cond"] for t in exp_traces]
        assert [[d[:3] for d in t] for t in traces] == [[d[:3] for d in t] for t in held], what
        for t, e in zip(traces, held, strict=True):
            for d, x in zip(t, e, strict=True):
                assert (d[3] is None) == (x[3] is None) and (d[3] is None or d[3] == pytest.approx(x[3], rel=1e-5)), \
                    what
        assert totals == exp_totals, what
        np.testing.assert_allclose(latents, exp_latents, rtol=0, atol=1e-4, err_msg=what)
        diff = np.abs(frames.astype(np.int16) - exp_frames.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.02, f"{what}: max {diff.max()} mean {diff.mean()}"


def assert_live_is_the_whole(model, base, directions, answers, *, state, seed) -> list[int]:
    """A live video started from ``directions[0]`` and told ``answers`` in turn when it asks for more (``WAIT``,
    ``None`` to end, or ``k``: the first ``k`` directions) makes the latents and frames of the one request of all
    ``directions``, bit for bit, its frames delivered once each and in order. Returns how many frame pieces had been
    delivered at each ask."""
    from cp_infer.live import live_request
    from cp_infer.sampler import SampleControl, sample

    from ..harness import one_thread

    expected = {}
    whole = one_thread(sample, model, live_request(base, directions, model.options), state=state,
                       control=SampleControl(on_latents=expected.update))
    told = [a if a is None or not isinstance(a, int) else live_request(base, directions[:a], model.options)
            for a in answers]
    asked, latents, delivered = [], {}, []

    def extend(done, request):
        asked.append(len(delivered))
        return told.pop(0)

    control = SampleControl(live=True, extend=extend, on_latents=latents.update,
                            on_frames=lambda f, first, total: delivered.append((first, len(f))))
    frames = one_thread(sample, model, live_request(base, directions[:1], model.options), state=state,
                        control=control)
    assert not told and [first for first, _ in delivered] == sorted({first for first, _ in delivered})
    np.testing.assert_array_equal(latents["latents"], expected["latents"], err_msg=f"seed={seed}")
    np.testing.assert_array_equal(frames, whole, err_msg=f"seed={seed}")
    return asked


def text_projection_calls(transformer) -> dict[str, int]:
    """Counters of block 0's cross-attention key projection and of the text embedder's first layer (Wan's and
    Helios' layout), each raised when that module runs."""
    calls = {"to_k": 0, "text_embedder": 0}

    def count(name):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    transformer.blocks[0].attn2.to_k.register_forward_hook(count("to_k"))
    transformer.condition_embedder.text_embedder.linear_1.register_forward_hook(count("text_embedder"))
    return calls
