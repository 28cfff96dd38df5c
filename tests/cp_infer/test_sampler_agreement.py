"""A failure on one rank outside the denoising steps (preparing the request, decoding the soundtrack) fails the job
on every rank with the same ``JobFailed`` naming that rank: nobody is left waiting in a collective. Running out of
device memory (``torch.OutOfMemoryError``, raised where CUDA's allocator would) in a step or in preparing is
``JobOutOfMemory`` (code ``out_of_memory``) on every rank, and the same group runs the next job. And a plan of
several passes runs them in order, each prepared from the gathered latents of the one before.

The model is a stand-in with two token streams (it needs no weights): its prediction is elementwise, its decode
returns black frames, and it raises where the test tells it to.
"""

import dataclasses

import numpy as np
import pytest
import torch

from cp_infer.decode import TemporalSplit
from cp_infer.options import ModelOptions
from cp_infer.plan import DenoisePass, Plan
from cp_infer.request import GenerationRequest
from cp_infer.sampler import Decoder, JobFailed, JobOutOfMemory, Prepared, SampleControl, sample
from cp_infer.shapes import VideoGeometry
from models.common.standard_options import standard_options

from ..worker_groups import group_per_world


class _FakeModel:
    geometry = VideoGeometry()
    options = ModelOptions("fake", standard_options(height=32, width=32, num_frames=1, frame_rate=24,
                                                    num_inference_steps=2, guidance_scale=1.0, size_step="any"))

    def __init__(self, state, fail: str):
        self.state, self.fail = state, fail

    def plan(self, request):
        return Plan.single(request)

    def prepare(self, request, shape, *, kind="denoise", previous=None, previous_state=None):
        if self.fail == "prepare" and self.state.cp_rank == 1:
            raise RuntimeError("text encoder out of memory")
        if self.fail == "oom-prepare" and self.state.cp_rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 1 has 2 GiB free")
        g = torch.Generator().manual_seed(request.seed)
        return Prepared(latents={"video": torch.randn(1, shape.tokens, 4, generator=g),
                                 "audio": torch.randn(1, 5, 2, generator=g)},
                        timesteps=[torch.tensor(1.0), torch.tensor(0.5)])

    def predict(self, latents, t, prepared, plans):
        if self.fail == "oom-step" and float(t) == 0.5:  # the second step, on every rank: same shapes, same memory
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 9.00 GiB (rank {self.state.rank})")
        return {name: 0.1 * x for name, x in latents.items()}

    def step(self, noise_pred, t, latents, prepared, plans):
        return {name: latents[name] - noise_pred[name] for name in latents}

    def decoder(self, latents, prepared):
        frames = latents["video"].shape[1]  # not used: one latent frame below

        def decode_range(a, b):
            return np.zeros((1, 32, 32, 3), np.uint8)

        def audio():
            if self.fail == "audio":
                raise RuntimeError(f"vocoder failed on {frames} tokens")
            return np.zeros((2, 100), np.float32), 24000

        return Decoder(split=TemporalSplit(latent_frames=1, world=1), frame_shape=(32, 32, 3),
                       decode_range=decode_range, audio=audio)


def _run(state, fail):
    request = GenerationRequest(prompt="x", num_frames=1, height=32, width=32, num_inference_steps=2)
    heard = []
    try:
        frames = sample(_FakeModel(state, fail), request, state=state,
                        control=SampleControl(on_audio=lambda w, sr: heard.append(sr)))
    except JobFailed as exc:
        return "failed", str(exc)
    return "ok", (None if frames is None else frames.shape, heard)


group = group_per_world([2])


@pytest.mark.parametrize("fail,rank,words", [("prepare", 1, "text encoder out of memory"),
                                             ("audio", 0, "vocoder failed")])
def test_one_rank_failing_fails_the_job_everywhere(group, fail, rank, words):
    results = group.run(_run, fail, timeout=120)
    for status, message in results:
        assert status == "failed" and f"rank {rank}: RuntimeError: {words}" in message, results


def _run_out_of_memory(state, fail):
    request = GenerationRequest(prompt="x", num_frames=1, height=32, width=32, num_inference_steps=2)
    steps = []
    try:
        sample(_FakeModel(state, fail), request, state=state,
               control=SampleControl(on_step=lambda i, *_: steps.append(i)))
    except JobOutOfMemory as exc:
        failed = (exc.code, str(exc), steps)
    else:
        failed = None
    frames = sample(_FakeModel(state, ""), request, state=state)  # the same group runs the next job
    return failed, None if frames is None else frames.shape


@pytest.mark.parametrize("fail,ranks,steps", [("oom-step", (0, 1), [1]), ("oom-prepare", (1,), [])])
def test_running_out_of_memory_fails_the_job_with_its_code_and_the_group_goes_on(group, fail, ranks, steps):
    results = group.run(_run_out_of_memory, fail, timeout=120)
    assert [shape for _, shape in results] == [(1, 32, 32, 3), None]
    for (code, message, done), _ in results:
        assert code == "out_of_memory" and done == steps, results
        assert [f"rank {r}: out of device memory (CUDA out of memory. Tried to allocate" in message
                for r in (0, 1)] == [r in ranks for r in (0, 1)], message


def test_without_failure_rank0_gets_frames_and_audio(group):
    results = group.run(_run, "", timeout=120)
    assert results == [("ok", ((1, 32, 32, 3), [24000])), ("ok", (None, []))]


class _TwoPassModel(_FakeModel):
    """A plan of two passes: the second starts from the first's gathered latents (as a window or a refine
    stage does)."""

    def plan(self, request):
        second = dataclasses.replace(request, num_inference_steps=3, seed=request.seed + 1)
        return Plan((DenoisePass(request, steps=2), DenoisePass(second, steps=3, kind="continue")))

    def prepare(self, request, shape, *, kind="denoise", previous=None, previous_state=None):
        assert (kind == "continue") == (previous is not None), kind
        g = torch.Generator().manual_seed(request.seed)
        video = torch.randn(1, shape.tokens, 4, generator=g)
        if previous is not None:
            video = 0.5 * previous["video"].cpu() + video
        steps = [torch.tensor(1.0 - i / request.num_inference_steps) for i in range(request.num_inference_steps)]
        return Prepared(latents={"video": video}, timesteps=steps)

    def output_latents(self, latents, prepared):
        return {"latents": latents["video"].cpu().numpy()}


def _run_plan(state):
    request = GenerationRequest(prompt="x", num_frames=9, height=64, width=96, num_inference_steps=2, seed=11)
    steps, latents = [], []
    sample(_TwoPassModel(state, ""), request, state=state,
           control=SampleControl(on_step=lambda done, total, _s: steps.append((done, total)),
                                 on_latents=latents.append))
    return steps, latents[0]["latents"] if latents else None


def test_a_plan_runs_its_passes_in_order_each_from_the_last(group):
    results = group.run(_run_plan, timeout=120)
    tokens = 2 * 2 * 3  # 9 frames at 96x64: 2 latent frames of 2x3
    g = torch.Generator().manual_seed(11)
    first = torch.randn(1, tokens, 4, generator=g) * 0.9**2  # each step: x - 0.1 x
    second = (0.5 * first + torch.randn(1, tokens, 4, generator=torch.Generator().manual_seed(12))) * 0.9**3
    for rank, (steps, latents) in enumerate(results):
        assert steps == [(i, 5) for i in range(1, 6)], steps  # progress over both passes
        if rank == 0:
            torch.testing.assert_close(torch.from_numpy(latents), second)
        else:
            assert latents is None
