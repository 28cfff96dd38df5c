"""A failure on one rank outside the denoising steps (preparing the request, decoding the soundtrack) fails the job
on every rank with the same ``JobFailed`` naming that rank: nobody is left waiting in a collective.

The model is a stand-in with two token streams (it needs no weights): its prediction is elementwise, its decode
returns black frames, and it raises where the test tells it to.
"""

import numpy as np
import pytest
import torch

from cp_infer.decode import TemporalSplit
from cp_infer.options import ModelOptions
from cp_infer.request import GenerationRequest
from cp_infer.sampler import Decoder, JobFailed, Prepared, SampleControl, sample
from cp_infer.shapes import VideoGeometry

from models._standard_options import standard_options

from ..harness import WorkerGroup


class _FakeModel:
    geometry = VideoGeometry()
    options = ModelOptions("fake", standard_options(height=32, width=32, num_frames=1, frame_rate=24,
                                                    num_inference_steps=2, guidance_scale=1.0, size_step="any"))

    def __init__(self, state, fail: str):
        self.state, self.fail = state, fail

    def prepare(self, request, shape):
        if self.fail == "prepare" and self.state.cp_rank == 1:
            raise RuntimeError("text encoder out of memory")
        g = torch.Generator().manual_seed(request.seed)
        return Prepared(latents={"video": torch.randn(1, shape.tokens, 4, generator=g),
                                 "audio": torch.randn(1, 5, 2, generator=g)},
                        timesteps=[torch.tensor(1.0), torch.tensor(0.5)])

    def predict(self, latents, t, prepared, plans):
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


@pytest.fixture(scope="module")
def group():
    g = WorkerGroup(2)
    yield g
    g.close()


@pytest.mark.parametrize("fail,rank,words", [("prepare", 1, "text encoder out of memory"),
                                             ("audio", 0, "vocoder failed")])
def test_one_rank_failing_fails_the_job_everywhere(group, fail, rank, words):
    results = group.run(_run, fail, timeout=120)
    for status, message in results:
        assert status == "failed" and f"rank {rank}: RuntimeError: {words}" in message, results


def test_without_failure_rank0_gets_frames_and_audio(group):
    results = group.run(_run, "", timeout=120)
    assert results == [("ok", ((1, 32, 32, 3), [24000])), ("ok", (None, []))]
