"""Two-stage LTX-Video (``stages=2``) on the Ulysses engine: at 1 rank equal to diffusers' LTX-Video 0.9.7 recipe run
with the same components (LTXConditionPipeline at half size with ``output_type="latent"``, LTXLatentUpsamplePipeline,
LTXConditionPipeline at full size given the upsampled latents with ``denoise_strength=0.4`` of 10 steps, a generator
seeded alike for each call; an image as the recipe's ``LTXVideoCondition`` at frame 0 in both stages), N = 2, 3 equal
1 rank; a folder without an upsampler refuses ``stages=2``, and so do sizes that do not halve.

Shapes: text (9, 128, 320): stage 1 is 2x2x5 = 20 tokens, stage 2 2x4x10 = 80, uneven at N = 3; image at frame 0
(9, 128, 192): 12 then 48; an image at the last frame (9, 128, 192) adds its latent frame as 6 then 24 extra tokens
(18 then 72 in all). The text request runs the upsampler with AdaIN and tone mapping (the 0.9.8 recipe's 1.0, 0.6).

Tolerances: at 1 rank both stages run diffusers' own modules and arithmetic in the pipeline's order and the upsampler
is the upsample pipeline's call, except that a text request's timestep is handed to the transformer per token
(``[B, S]``, as for conditioned requests) where LTXConditionPipeline hands it per sample (``[B, 1]``): the same
values, the time embedding's matmul over more rows, which rounds differently. Measured for text: frames max 1 level
(mean 3e-5), latents 1e-6 (and bit-identical against the recipe with its timestep expanded per token); asserted
frames within 1 level, latents 1e-5; with media (per-token timesteps in both) bit-identical. With N ranks, as in
``test_ltx_video_parallel``: fp32 summation order through two stages and the upsampler: frames within 1 level
(mean < 0.02), latents within 1e-4.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from PIL import Image

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import groups_by_world
from .test_conditions import _media

groups = groups_by_world()
BASE = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=3,
            guidance_scale=3.0, fps=24, stages=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The embedded default (its latent_upsampler/ included)."""
    from models.ltx_video.default import ensure_default_model

    return str(ensure_default_model(tmp_path_factory.mktemp("cache")))


def _requests(seed: int) -> list[GenerationRequest]:
    """Resolved, so that the reference reads every option's value."""
    from cp_infer.request import resolve_request
    from models.ltx_video.options import ltx_video_options

    rng = np.random.default_rng(seed)
    return [resolve_request(r, ltx_video_options(latent_upsampler=True)) for r in (
        GenerationRequest.of(**BASE, num_frames=9, height=128, width=320, seed=seed, adain_factor=1.0,
                             tone_map_compression_ratio=0.6),
        GenerationRequest.of(**BASE, num_frames=9, height=128, width=192, seed=seed + 1,
                             image=Condition(_media(rng, 1, 100, 140))),
        GenerationRequest.of(**BASE, num_frames=9, height=128, width=192, seed=seed + 2,
                             conditions=(Condition(_media(rng, 1, 128, 192), -1, 0.9),)),
    )]


def _components(folder: str):
    """The folder's components with the scheduler LTXConditionPipeline can run (it passes no shift, and the embedded
    default's dynamic-shifting scheduler refuses a schedule without one)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.ltx_video.loading import load_ltx_video

    c = load_ltx_video(folder)
    config = dict(c.scheduler.config, use_dynamic_shifting=False)
    return dataclasses.replace(c, scheduler=FlowMatchEulerDiscreteScheduler.from_config(config))


def _sample_all(state, folder: str, seed: int, frames_per_rank=1):
    """Per request: frames, ``{latents}`` and the step counts seen."""
    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(folder), state=state)
    model.decode_frames_per_rank = frames_per_rank
    out = []
    for request in _requests(seed):
        latents, steps = {}, []
        control = SampleControl(on_latents=latents.update, on_step=lambda i, n, s, a=steps: a.append((i, n)))
        out.append((sample(model, request, state=state, control=control), latents, steps))
    return out


def _reference(folder: str, request: GenerationRequest, output_type: str):
    """diffusers' two-stage LTX-Video recipe for ``request`` on ``folder``'s components: stage 2's output."""
    from diffusers import LTXConditionPipeline, LTXLatentUpsamplePipeline
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    c = _components(folder)
    pipe = LTXConditionPipeline(scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                                transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    conditions = None
    if request.image is not None:
        conditions = [LTXVideoCondition(image=Image.fromarray(request.image.frames[0]), frame_index=0)]
    elif request.conditions:
        conditions = [LTXVideoCondition(image=Image.fromarray(cond.frames[0]), strength=cond.strength,
                                        frame_index=cond.frame_index % request.num_frames)
                      for cond in request.conditions]
    o = request.options
    common = dict(conditions=conditions, prompt=request.prompt, negative_prompt=request.negative_prompt,
                  num_frames=request.num_frames, frame_rate=request.fps, guidance_scale=request.guidance_scale,
                  image_cond_noise_scale=o["image_cond_noise_scale"], decode_timestep=o["decode_timestep"],
                  decode_noise_scale=o["decode_noise_scale"])
    latents = pipe(height=request.height // 2, width=request.width // 2,
                   num_inference_steps=request.num_inference_steps, output_type="latent",
                   generator=torch.Generator().manual_seed(request.seed), **common).frames
    upsample = LTXLatentUpsamplePipeline(vae=c.vae, latent_upsampler=c.latent_upsampler)
    upsample.set_progress_bar_config(disable=True)
    upsampled = upsample(latents=latents, adain_factor=o["adain_factor"] or 0.0,  # unset: the upsampler's 0.0
                         tone_map_compression_ratio=o["tone_map_compression_ratio"], output_type="latent").frames
    return pipe(height=request.height, width=request.width, denoise_strength=0.4, num_inference_steps=10,
                latents=upsampled, output_type=output_type, generator=torch.Generator().manual_seed(request.seed),
                **common).frames


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folder, seed, frames_per_rank=None)


def test_plan_and_step_count(one_rank):
    _, ours = one_rank
    for (_, _, steps) in ours:
        # stage 1's 3 steps, then stage 2's 4 (denoise_strength 0.4 of 10), counted over the whole plan
        assert steps == [(i, 7) for i in range(1, 8)]


def test_one_rank_equals_diffusers_two_stage_recipe(folder, one_rank):
    seed, ours = one_rank
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as ours ran: the thread count changes how CPU matmuls sum
    try:
        for request, (frames, latents, _) in zip(_requests(seed), ours, strict=True):
            media = request.image is not None or bool(request.conditions)
            what = f"seed={seed} media={media} shape={frames.shape}"
            ref = _reference(folder, request, "np")[0]
            ref8 = (np.clip(ref, 0, 1) * 255).round().astype(np.uint8)
            assert frames.shape == ref8.shape == (request.num_frames, request.height, request.width, 3)
            assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
            diff = np.abs(frames.astype(np.int16) - ref8.astype(np.int16))
            ref_latents = _reference(folder, request, "latent").float().numpy()
            assert latents["latents"].shape == ref_latents.shape
            if media:
                np.testing.assert_array_equal(frames, ref8, err_msg=what)
                np.testing.assert_array_equal(latents["latents"], ref_latents, err_msg=what)
            else:  # the per-token timestep (module docstring)
                assert diff.max() <= 1, f"{what}: max {diff.max()}"
                np.testing.assert_allclose(latents["latents"], ref_latents, rtol=0, atol=1e-5, err_msg=what)
    finally:
        torch.set_num_threads(threads)


def test_two_stages_differ_from_one(folder, one_rank):
    """The plan is really two-staged: the same request at stages=1 gives another video."""
    from cp_infer import single_process_state
    from models.ltx_video.adapter import LTXVideoModel

    seed, ours = one_rank
    request = _requests(seed)[0]
    model = LTXVideoModel(_components(folder), state=single_process_state())
    model.decode_frames_per_rank = None
    one = sample(model, dataclasses.replace(request, options={**request.options, "stages": 1}),
                 state=single_process_state())
    assert one.shape == ours[0][0].shape
    assert np.abs(one.astype(np.int16) - ours[0][0].astype(np.int16)).mean() > 1


@pytest.mark.parametrize("world,ring", [(2, None), (3, None), (2, 2)], ids=["2", "3", "R2"])
def test_n_ranks_equal_one_rank(folder, one_rank, groups, world, ring):
    """Ulysses at 2 and 3 ranks, and a ring of two (both stages' sequences, and the upsampled latents refined)."""
    from ...worker_groups import SharedGroup

    seed, expected = one_rank
    group = groups(world) if ring is None else SharedGroup(world, ring=ring)
    results = group.run(_sample_all, folder, seed, timeout=600)
    for (exp, exp_latents, _), (got, got_latents, _) in zip(expected, results[0], strict=True):
        what = f"world={world} seed={seed} shape={exp.shape}"
        assert got.shape == exp.shape
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.02, f"{what}: max {diff.max()} mean {diff.mean()}"
        np.testing.assert_allclose(got_latents["latents"], exp_latents["latents"], rtol=0, atol=1e-4, err_msg=what)


def test_defaults_and_refusals(tmp_path, folder):
    """The embedded default takes stages=2 but defaults to 1; a folder without latent_upsampler/ refuses 2 (the
    server answers 400 for a request ValueError); two stages need sizes that halve to the VAE's step; the folder's
    upsampler is loaded, of the real class."""
    import shutil

    from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel

    from cp_infer.request import resolve_request
    from models.common.embedded import LATENT_UPSAMPLER, MARKER_FILE
    from models.common.loading import recommended_stages
    from models.ltx_video.loading import load_ltx_video
    from models.registry import describe_model

    info = describe_model(folder)
    assert info.options["stages"].default == 1 == recommended_stages(folder)
    assert resolve_request(GenerationRequest.of(prompt="x", stages=2), info.options).options["stages"] == 2
    with pytest.raises(ValueError, match=r"height=480 with stages=2 is not a multiple of 64.*try height=512"):
        resolve_request(GenerationRequest.of(prompt="x", stages=2, height=480), info.options)
    assert isinstance(load_ltx_video(folder).latent_upsampler, LTXLatentUpsamplerModel)
    bare = shutil.copytree(folder, tmp_path / "bare", ignore=shutil.ignore_patterns(LATENT_UPSAMPLER, MARKER_FILE))
    options = describe_model(bare).options
    assert options["stages"].default == 1 and load_ltx_video(bare).latent_upsampler is None
    with pytest.raises(ValueError, match=r"stages=2 needs a latent upsampler.*latent_upsampler/.*use stages=1"):
        resolve_request(GenerationRequest.of(prompt="x", stages=2), options)
    # A folder of diffusers' layout with an upsampler, not an embedded toy: two stages by default.
    real = shutil.copytree(folder, tmp_path / "real", ignore=shutil.ignore_patterns(MARKER_FILE))
    assert describe_model(real).options["stages"].default == 2
