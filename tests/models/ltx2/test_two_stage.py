"""Two-stage LTX-2 (``stages=2``) on the Ulysses engine: at 1 rank equal to diffusers' two-stage recipe run with the
same components (LTX2Pipeline at half size with ``output_type="latent"``, LTX2LatentUpsamplePipeline, LTX2Pipeline
with the distilled stage-2 sigmas, renoised to the first, one generator throughout; LTX2ImageToVideoPipeline for
both stages of image-to-video), N = 2, 3 equal 1 rank; a folder without an upsampler refuses ``stages=2``.

Shapes: (9, 128, 320): stage 1 is 2x2x5 = 20 video tokens, stage 2 2x4x10 = 80, audio 9 tokens: uneven at N = 3 and
N = 2 respectively. Image-to-video at (9, 128, 192): 12 then 48 video tokens.

Tolerances: at 1 rank both stages run diffusers' own modules and arithmetic in the pipelines' order, the upsampler
is the upsample pipeline's call: frames, waveform and latents bit-identical. With N ranks, as in
``test_ltx2_parallel``: matmuls over fewer rows and SDPA over permuted layouts round differently (fp32, ~1e-6
relative), through two stages and the upsampler: frames within 1 level (mean < 0.02), waveform within 1e-4.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import groups_by_world
from ..ltx_video.test_conditions import _media
from .test_parallel import GUIDANCE

groups = groups_by_world()
BASE = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", num_inference_steps=3,
            fps=24, max_sequence_length=128, spatio_temporal_guidance_blocks=(0,), stages=2, **GUIDANCE)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The embedded default (its latent_upsampler/ included)."""
    from models.ltx2.default import ensure_default_ltx2_model

    return str(ensure_default_ltx2_model(tmp_path_factory.mktemp("cache")))


def _requests(seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [GenerationRequest.of(**BASE, num_frames=9, height=128, width=320, seed=seed),
            GenerationRequest.of(**BASE, num_frames=9, height=128, width=192, seed=seed + 1,
                                 image=Condition(_media(rng, 1, 100, 140))),
            # conditions: an image at frame 0 (strength 0.8) and one at the last frame (a keyframe token per
            # latent pixel), in both stages as LTX2ConditionPipeline takes them
            GenerationRequest.of(**BASE, num_frames=17, height=128, width=192, seed=seed + 2,
                                 conditions=(Condition(_media(rng, 1, 90, 120), 0, 0.8),
                                             Condition(_media(rng, 1, 128, 192), -1, 1.0)))]


def _sample_all(state, folder: str, seed: int, frames_per_rank=1):
    """Per request: frames, ``{waveform, sample_rate}``, ``{latents, audio_latents}`` and the step times (rank 0)."""
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = frames_per_rank
    out = []
    for request in _requests(seed):
        audio, latents, steps = {}, {}, []
        control = SampleControl(on_audio=lambda w, sr, a=audio: a.update(waveform=w, sample_rate=sr),
                                on_latents=latents.update, on_step=lambda i, n, s, a=steps: a.append((i, n)))
        out.append((sample(model, request, state=state, control=control), audio, latents, steps))
    return out


def _reference(folder: str, request: GenerationRequest, output_type: str):
    """diffusers' two-stage recipe for ``request`` on ``folder``'s components: (video, audio) of stage 2."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2LatentUpsamplePipeline, LTX2Pipeline
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    from models.ltx2.loading import load_ltx2
    from models.ltx2.stages import REFINE_SETTINGS, refine_scheduler

    c = load_ltx2(folder)
    parts = dict(scheduler=c.scheduler, vae=c.vae, audio_vae=c.audio_vae, text_encoder=c.text_encoder,
                 tokenizer=c.tokenizer, connectors=c.connectors, transformer=c.transformer, vocoder=c.vocoder)
    cls = LTX2Pipeline if request.image is None else LTX2ImageToVideoPipeline
    media = {} if request.image is None else {"image": Image.fromarray(request.image.frames[0])}
    if request.conditions:
        from diffusers import LTX2ConditionPipeline
        from diffusers.pipelines.ltx2 import LTX2VideoCondition

        from models.ltx2.conditions import latent_index

        cls = LTX2ConditionPipeline
        media = {"conditions": [LTX2VideoCondition(frames=Image.fromarray(c.frames[0]),
                                                   index=latent_index(c.frame_index, request.num_frames, 8),
                                                   strength=c.strength) for c in request.conditions]}
    o = request.options
    generator = torch.Generator("cpu").manual_seed(request.seed)
    common = dict(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                  frame_rate=request.fps, return_dict=False, generator=generator,
                  max_sequence_length=o["max_sequence_length"], **media)
    stage1 = cls(**parts)
    stage1.set_progress_bar_config(disable=True)
    video, audio = stage1(height=request.height // 2, width=request.width // 2,
                          num_inference_steps=request.num_inference_steps, output_type="latent",
                          spatio_temporal_guidance_blocks=list(o["spatio_temporal_guidance_blocks"]), **GUIDANCE,
                          **common)
    upsample = LTX2LatentUpsamplePipeline(vae=c.vae, latent_upsampler=c.latent_upsampler)
    upsample.set_progress_bar_config(disable=True)
    video = upsample(latents=video, output_type="latent", return_dict=False)[0]
    stage2 = cls(**{**parts, "scheduler": refine_scheduler(c.scheduler)})
    stage2.set_progress_bar_config(disable=True)
    return stage2(latents=video, audio_latents=audio, height=request.height, width=request.width,
                  num_inference_steps=len(STAGE_2_DISTILLED_SIGMA_VALUES), sigmas=STAGE_2_DISTILLED_SIGMA_VALUES,
                  noise_scale=STAGE_2_DISTILLED_SIGMA_VALUES[0], guidance_scale=1.0, output_type=output_type,
                  **REFINE_SETTINGS, **common)


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folder, seed, frames_per_rank=None)


def test_plan_and_step_count(folder, one_rank):
    seed, ours = one_rank
    for (_, _, _, steps) in ours:
        # stage 1's 3 steps, then stage 2's 3 (the distilled sigmas), counted over the whole plan
        assert steps == [(i, 6) for i in range(1, 7)]


def test_one_rank_equals_diffusers_two_stage_recipe(folder, one_rank):
    seed, ours = one_rank
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as ours ran: the thread count changes how CPU matmuls sum
    try:
        _compare_with_reference(folder, seed, ours)
    finally:
        torch.set_num_threads(threads)


def _compare_with_reference(folder, seed, ours):
    for request, (frames, audio, latents, _) in zip(_requests(seed), ours, strict=True):
        what = f"seed={seed} image={request.image is not None} shape={frames.shape}"
        video, ref_audio = _reference(folder, request, "np")
        ref8 = (np.clip(video[0], 0, 1) * 255).round().astype(np.uint8)
        assert frames.shape == (request.num_frames, request.height, request.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref8, err_msg=what)
        ref_audio = ref_audio[0].float().numpy()
        assert np.abs(ref_audio).max() > 1e-3, "silent soundtrack: the comparison would prove nothing"
        np.testing.assert_array_equal(audio["waveform"][:, :ref_audio.shape[1]], ref_audio, err_msg=what)
        ref_latents, ref_audio_latents = _reference(folder, request, "latent")
        assert latents["latents"].shape[3:] == (request.height // 32, request.width // 32)
        np.testing.assert_array_equal(latents["latents"], ref_latents.float().numpy(), err_msg=what)
        np.testing.assert_array_equal(latents["audio_latents"], ref_audio_latents.float().numpy(), err_msg=what)


def test_two_stages_differ_from_one(folder, one_rank):
    """The plan is really two-staged: the same request at stages=1 gives another video."""
    from dataclasses import replace

    from cp_infer import single_process_state
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    seed, ours = one_rank
    request = _requests(seed)[0]
    model = LTX2Model(load_ltx2(folder), state=single_process_state())
    model.decode_frames_per_rank = None
    one = sample(model, replace(request, options={**request.options, "stages": 1}), state=single_process_state())
    assert one.shape == ours[0][0].shape
    assert np.abs(one.astype(np.int16) - ours[0][0].astype(np.int16)).mean() > 1


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_equal_one_rank(folder, one_rank, groups, world):
    seed, expected = one_rank
    results = groups(world).run(_sample_all, folder, seed, timeout=600)
    for (exp, exp_audio, exp_latents, _), (got, got_audio, got_latents, _) in zip(expected, results[0],
                                                                                  strict=True):
        what = f"world={world} seed={seed} shape={exp.shape}"
        assert got.shape == exp.shape
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.02, f"{what}: max {diff.max()} mean {diff.mean()}"
        np.testing.assert_allclose(got_audio["waveform"], exp_audio["waveform"], rtol=0, atol=1e-4, err_msg=what)
        np.testing.assert_allclose(got_latents["latents"], exp_latents["latents"], rtol=0, atol=1e-4, err_msg=what)


def test_defaults_and_refusals(tmp_path, folder):
    """The embedded default takes stages=2 but defaults to 1; a folder without latent_upsampler/ refuses 2 (the
    server answers 400 for a request ValueError); two stages need sizes that halve to the VAE's step."""
    from cp_infer.request import resolve_request
    from models.common.loading import recommended_stages
    from models.ltx2.default import save_ltx2_model
    from models.registry import describe_model

    info = describe_model(folder)
    assert info.options["stages"].default == 1 == recommended_stages(folder)
    assert resolve_request(GenerationRequest.of(prompt="x", stages=2), info.options).options["stages"] == 2
    with pytest.raises(ValueError, match=r"width=736 with stages=2 is not a multiple of 64.*try width=768"):
        resolve_request(GenerationRequest.of(prompt="x", stages=2, width=736), info.options)
    bare = save_ltx2_model(tmp_path / "bare")
    options = describe_model(bare).options
    assert options["stages"].default == 1
    with pytest.raises(ValueError, match=r"stages=2 needs a latent upsampler.*latent_upsampler/.*use stages=1"):
        resolve_request(GenerationRequest.of(prompt="x", stages=2), options)
    # A folder of diffusers' layout with an upsampler, not an embedded toy: two stages by default.
    real = save_ltx2_model(tmp_path / "real", latent_upsampler=True)
    assert describe_model(real).options["stages"].default == 2
