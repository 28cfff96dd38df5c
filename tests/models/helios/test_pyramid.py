"""HeliosPyramidPipeline (each chunk coarse to fine) and a distilled model's DMD schedule, sampled with the Ulysses
engine: 1 rank equals diffusers' own HeliosPyramidPipeline, 2 ranks equal 1 rank.

The toy pyramids are tiny-helios's components in a HeliosPyramidPipeline folder of two stages with CFG-Zero*
(``models.helios.default.build_helios_pipeline``): one with ``HeliosScheduler`` (UniPC per stage), one distilled
with ``HeliosDMDScheduler`` and ``is_amplify_first_chunk`` (the first chunk's stages twice the steps). At 32x32 a
chunk of 3 latent frames is 3 tokens in its coarse stage (2x2 latents) and 12 in its fine one, after 13 history tokens:
16 and 25 tokens, which 2 ranks do not divide.

Tolerances: as tests/models/helios/test_helios.py says (the same loop and ops): bit-identical at 1 rank; at 2 ranks
latents within 1e-4 and frames within 1 uint8 level (sums in another order, carried through the stages and chunks;
CFG-Zero*'s dot product is taken over the whole chunk on every rank, in the pipeline's layout).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import groups_by_layout
from .._parity import assert_ranks_close

groups = groups_by_layout()
KINDS = ("unipc", "dmd")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from models.helios.default import save_helios_model

    root = tmp_path_factory.mktemp("helios_pyramid")
    return {kind: str(save_helios_model(root / kind, kind)) for kind in KINDS}


def _request(kind: str, seed: int) -> GenerationRequest:
    # Two chunks with CFG (CFG-Zero*, its first step zeroed) and stages of 2 and 1 steps; one chunk distilled, no
    # CFG, its stages amplified (2 + 2 steps).
    if kind == "unipc":
        return GenerationRequest(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_frames=17,
                                 height=32, width=32, num_inference_steps=3, guidance_scale=4.0, seed=seed,
                                 options={"num_latent_frames_per_chunk": 3, "pyramid_num_inference_steps_list": [2, 1],
                                          "zero_steps": 0})
    return GenerationRequest(prompt="waves on a beach at dusk", num_frames=9, height=32, width=32,
                             num_inference_steps=2, guidance_scale=1.0, seed=seed + 1,
                             options={"num_latent_frames_per_chunk": 3, "pyramid_num_inference_steps_list": [1, 1],
                                      "is_amplify_first_chunk": True})


def _sample_all(state, folders: dict[str, str], seed: int):
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    out = []
    for kind in KINDS:
        model = HeliosModel(load_helios(folders[kind]), state=state)
        latents = {}
        frames = sample(model, _request(kind, seed), state=state, control=SampleControl(on_latents=latents.update))
        out.append((frames, latents.get("latents")))
    return out


def _reference(folder: str, r: GenerationRequest, output_type: str) -> np.ndarray:
    from diffusers import HeliosPyramidPipeline

    from models.helios.loading import load_helios

    c = load_helios(folder)
    # NOTE(diffusers 0.42.1): with CFG-Zero* and CFG the pipeline flattens the transformer's output with .view, which
    # that output's strides refuse (a RuntimeError); the same values made contiguous take it, as they take the
    # flattening the pipeline means. The adapter computes CFG-Zero* on the contiguous prediction.
    forward = c.transformer.forward
    c.transformer.forward = lambda *a, **k: tuple(o.contiguous() for o in forward(*a, **k))
    pipe = HeliosPyramidPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                 scheduler=c.scheduler, transformer=c.transformer,
                                 is_cfg_zero_star=c.pyramid.cfg_zero_star, is_distilled=c.pyramid.distilled)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt or None, num_frames=r.num_frames, height=r.height,
               width=r.width, guidance_scale=r.guidance_scale, generator=torch.Generator("cpu").manual_seed(r.seed),
               output_type=output_type, **r.options).frames
    if output_type == "latent":
        return out.float().numpy()
    return (np.clip(out[0], 0, 1) * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def one_rank(folders):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folders, seed)


def test_one_rank_equals_helios_pyramid_pipeline(folders, one_rank):
    seed, ours = one_rank
    for kind, (frames, latents) in zip(KINDS, ours, strict=True):
        r = _request(kind, seed)
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(latents, one_thread(_reference, folders[kind], r, "latent"),
                                      err_msg=f"{kind} seed={seed}")
        np.testing.assert_array_equal(frames, one_thread(_reference, folders[kind], r, "np"),
                                      err_msg=f"{kind} seed={seed}")


def test_two_ranks_equal_one_rank(folders, one_rank, groups):
    seed, expected = one_rank
    results = groups(2).run(_sample_all, folders, seed, timeout=600)
    assert_ranks_close(expected, results, world=2, seed=seed)


def test_a_resumed_pyramid_job_equals_the_whole_run(folders, one_rank):
    """A pyramid's job checkpoints after a chunk's last stage only (its plan: a pass per stage), and going on from
    there makes the uninterrupted run's video and latents, bit for bit."""
    from cp_infer import single_process_state
    from models.helios.adapter import HeliosModel
    from models.helios.loading import load_helios

    seed, ours = one_rank
    request = _request("unipc", seed)  # two chunks of two stages: passes 0-1, then 2-3
    state = single_process_state()
    model = HeliosModel(load_helios(folders["unipc"]), state=state)
    saved = {}
    one_thread(sample, model, request, state=state, control=SampleControl(on_checkpoint=saved.__setitem__))
    assert sorted(saved) == [2]
    latents = {}
    frames = one_thread(sample, model, request, state=state,
                        control=SampleControl(resume=(2, saved[2]), on_latents=latents.update))
    np.testing.assert_array_equal(frames, ours[0][0], err_msg=f"seed={seed}")
    np.testing.assert_array_equal(latents["latents"], ours[0][1], err_msg=f"seed={seed}")
