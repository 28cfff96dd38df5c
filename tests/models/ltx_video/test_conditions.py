"""Conditioned LTX-Video on the Ulysses engine: at 1 rank equal to diffusers' ``LTXImageToVideoPipeline`` and
``LTXConditionPipeline`` (frames and final latents), at N ranks equal to 1 rank.

Conditioning tokens are part of the sharded sequence: an image or clip placed after frame 0 adds its own tokens in
front of the video's, so the shapes below give token counts (18 + 6 + 6 = 30, 24 + 12 = 36, ...) that 4 and
sometimes 3 or 2 do not divide. Tolerances: as ``test_ltx_video_parallel`` (1 rank: bit-identical, the same modules
in the same order; N ranks: fp32 summation order, frames within 1 uint8 level, mean < 0.01; latents 1e-4).
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

from ...worker_groups import groups_by_world

groups = groups_by_world()


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from models.ltx_video.default import ensure_default_model

    path = tmp_path_factory.mktemp("cache")
    ensure_default_model(path)
    return str(path)


def _media(rng: np.random.Generator, frames: int, height: int, width: int) -> np.ndarray:
    """A moving colour gradient with noise: uint8 [F, H, W, 3], never flat."""
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for f in range(frames):
        base = np.stack([(x * 3 + f * 9) % 256, (y * 5 + f * 4) % 256, ((x + y) * 2 + f * 13) % 256], axis=-1)
        out.append(np.clip(base + rng.integers(-30, 30, base.shape), 0, 255))
    return np.ascontiguousarray(np.stack(out).astype(np.uint8))


def _requests(seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=3,
                guidance_scale=3.0, fps=24)
    return [
        # image-to-video (LTXImageToVideoPipeline): 3 x 2 x 3 = 18 tokens, the image at another size
        GenerationRequest(**base, num_frames=17, height=64, width=96, seed=seed,
                          image=Condition(_media(rng, 1, 50, 70))),
        # conditions (LTXConditionPipeline): an image at frame 0, one at 8 (strength 0.8), one at the last frame
        GenerationRequest(**base, num_frames=17, height=64, width=96, seed=seed + 1, conditions=(
            Condition(_media(rng, 1, 64, 96)), Condition(_media(rng, 1, 40, 40), 8, 0.8),
            Condition(_media(rng, 1, 64, 96), -1, 1.0))),
        # a clip at frame 0 at strength 0.6 (video-to-video), and a 17-frame clip from frame 8: two latent frames
        # become extra tokens, the third replaces the video's fourth latent frame
        GenerationRequest(**base, num_frames=25, height=32, width=96, seed=seed + 2, conditions=(
            Condition(_media(rng, 9, 32, 96), 0, 0.6), Condition(_media(rng, 17, 48, 100), 8, 0.9))),
    ]


def _components(cache_dir: str, *, dynamic_shift: bool):
    """The embedded default's components; ``dynamic_shift=False`` swaps in the scheduler LTXConditionPipeline can run
    (it passes no shift, and a dynamic-shifting scheduler refuses a schedule without one)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    c = load_ltx_video(ensure_default_model(cache_dir))
    if not dynamic_shift:
        config = dict(c.scheduler.config, use_dynamic_shifting=False)
        c = dataclasses.replace(c, scheduler=FlowMatchEulerDiscreteScheduler.from_config(config))
    return c


def _sample_all(state, cache_dir: str, seed: int, dynamic_shift: bool = True, frames_per_rank=2):
    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(cache_dir, dynamic_shift=dynamic_shift), state=state)
    model.decode_frames_per_rank = frames_per_rank
    out = []
    for request in _requests(seed):
        latents = {}
        frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
        out.append((frames, latents.get("latents")))
    return out


def _pil(frames: np.ndarray) -> list[Image.Image]:
    return [Image.fromarray(f) for f in frames]


def _reference(cache_dir: str, request: GenerationRequest, output_type: str, *, tiled: bool = False):
    """``tiled``: the pipeline with its VAE's tiling on (``pipe.vae.enable_tiling()``)."""
    from diffusers import LTXConditionPipeline, LTXImageToVideoPipeline
    from diffusers.pipelines.ltx.pipeline_ltx_condition import LTXVideoCondition

    c = _components(cache_dir, dynamic_shift=False)
    if tiled:
        c.vae.enable_tiling()
    parts = dict(scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder, tokenizer=c.tokenizer,
                 transformer=c.transformer)
    common = dict(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                  height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                  guidance_scale=request.guidance_scale, frame_rate=request.fps, output_type=output_type,
                  generator=torch.Generator("cpu").manual_seed(request.seed))
    if request.image is not None:
        pipe = LTXImageToVideoPipeline(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe(image=_pil(request.image.frames)[0], **common).frames
    pipe = LTXConditionPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    conditions = [LTXVideoCondition(image=_pil(c.frames)[0], frame_index=c.frame_index, strength=c.strength)
                  if c.is_image else
                  LTXVideoCondition(video=_pil(c.frames), frame_index=c.frame_index, strength=c.strength)
                  for c in request.conditions]
    # LTXConditionPipeline takes frame indices as they are; ours count a negative one from the end.
    for cond in conditions:
        if cond.frame_index < 0:
            cond.frame_index += request.num_frames
    return pipe(conditions=conditions, **common).frames


def test_one_rank_equals_diffusers_conditioned_pipelines(cache_dir):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    # One decode round, as the pipelines decode.
    ours = _sample_all(single_process_state(), cache_dir, seed, dynamic_shift=False, frames_per_rank=None)
    for request, (frames, latents) in zip(_requests(seed), ours, strict=True):
        ref = _reference(cache_dir, request, "np")[0]
        ref8 = (np.clip(ref, 0, 1) * 255).round().astype(np.uint8)
        assert frames.shape == (request.num_frames, request.height, request.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref8, err_msg=f"seed={seed} shape={frames.shape}")
        ref_latents = _reference(cache_dir, request, "latent").float().numpy()
        assert latents.shape == ref_latents.shape
        np.testing.assert_array_equal(latents, ref_latents, err_msg=f"seed={seed}: latents differ")


def test_conditioning_changes_the_video(cache_dir):
    """The media is used: a hard image condition at frame 0 shows in the first frame, and other media give
    another video."""
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    state = single_process_state()
    (frames, _), *_ = _sample_all(state, cache_dir, seed, dynamic_shift=False, frames_per_rank=None)
    request = _requests(seed)[0]
    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(cache_dir, dynamic_shift=False), state=state)
    model.decode_frames_per_rank = None
    other = dataclasses.replace(request, image=Condition(255 - request.image.frames))
    plain = dataclasses.replace(request, image=None)
    assert np.abs(sample(model, other, state=state).astype(int) - frames.astype(int)).mean() > 1
    assert np.abs(sample(model, plain, state=state).astype(int) - frames.astype(int)).mean() > 1


@pytest.fixture(scope="module")
def one_rank(cache_dir):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return seed, _sample_all(single_process_state(), cache_dir, seed)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("world,ring", [(2, None), (3, None), (4, 2)], ids=["2", "3", "4-U2xR2"])
def test_n_ranks_equal_one_rank(cache_dir, one_rank, groups, world, ring):
    """Ulysses at 2 and 3 ranks; 4 ranks as a ring of two Ulysses pairs (the conditioning tokens round the ring)."""
    from ...worker_groups import SharedGroup

    seed, expected = one_rank
    group = groups(world) if ring is None else SharedGroup(world, ring=ring)
    results = group.run(_sample_all, cache_dir, seed, timeout=600)
    assert all(frames is None and latents is None for rank in results[1:] for frames, latents in rank)
    for (exp, exp_latents), (got, got_latents) in zip(expected, results[0], strict=True):
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.01, \
            f"world={world} seed={seed} shape={exp.shape}: max {diff.max()} mean {diff.mean()}"
        np.testing.assert_allclose(got_latents, exp_latents, rtol=0, atol=1e-4)


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "vae-tiling"])
def test_frames_wider_than_512_px_are_the_pipelines_with_their_tiling(cache_dir, tiled):
    """Above 512 px (where diffusers' VAE tiling starts) the frames and latents are the pipelines' at their default,
    untiled; with ``--vae-tiling`` (``enable_vae_tiling``) the pipelines' with ``vae.enable_tiling()``, the encode of
    the media tiled too. (Tiling, on in the decode alone, once made image-to-video at 768 x 512 differ from both.)"""
    from cp_infer import single_process_state
    from models.ltx_video.adapter import LTXVideoModel

    seed = random.randrange(2**31)
    rng = np.random.default_rng(seed)
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=2,
                guidance_scale=3.0, fps=24, num_frames=9, height=32, width=544)
    requests = [GenerationRequest(**base, seed=seed, image=Condition(_media(rng, 1, 32, 544))),
                GenerationRequest(**base, seed=seed + 1, conditions=(Condition(_media(rng, 9, 32, 544), 0, 0.7),))]
    state = single_process_state()
    model = LTXVideoModel(_components(cache_dir, dynamic_shift=False), state=state)
    model.decode_frames_per_rank = None  # one decode round, as the pipelines decode
    if tiled:
        model.enable_vae_tiling()
    for request in requests:
        latents = {}
        frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
        expected = _reference(cache_dir, request, "latent", tiled=tiled).float().numpy()
        np.testing.assert_array_equal(latents["latents"], expected, err_msg=f"seed={seed}")
        ref = (np.clip(_reference(cache_dir, request, "np", tiled=tiled)[0], 0, 1) * 255).round().astype(np.uint8)
        np.testing.assert_array_equal(frames, ref, err_msg=f"seed={seed}")
