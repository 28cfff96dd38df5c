"""Long Wan videos window by window (``models.wan.windows``): at 1 rank window 0 is ``WanPipeline``'s (TI2V-5B with an
image: ``WanImageToVideoPipeline``'s) and every later window the reference loop written here from diffusers'
components (the pipeline's prompt encoding and latents, the folder's scheduler, the transformers) following the
module's recipe, bit for bit; the frames are ``vae.decode`` of the stitched latents, bit for bit. Image-to-video folders
(Wan 2.1 I2V, 2.2 A14B I2V) chain: every window is ``WanImageToVideoPipeline`` itself, given the last frame of the one
before, latents and frames bit for bit. N = 2, 3 equal 1 rank; a resumed job equals the whole run.

Shapes: 16x80 (Wan 2.1: 8x, 2x2 patches) and 32x160 (TI2V-5B: 16x) are 1 x 5 = 5 tokens a latent frame; windows of 5
latent frames (``temporal_tile_size=17``) are 25 tokens, which neither 2 nor 3 ranks divide. Tolerances as
``test_wan``: N ranks differ from 1 only in fp32 summation order (latents 1e-4, frames within 1 uint8 level, mean
0.01).
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
from .._parity import assert_live_is_the_whole

groups = groups_by_world()

VARIANTS = ("t2v", "a14b", "ti2v", "i2v", "a14b-i2v")
CHAINED = ("i2v", "a14b-i2v")  # image-to-video folders: each window the image-to-video of the last frame before
WINDOWS = dict(temporal_tile_size=17, temporal_overlap=8)  # 5 latent frames, each window after the first on 2


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    from models.wan.default import ensure_default_wan_model, save_wan_model

    root = tmp_path_factory.mktemp("wan_windows")
    out = {"t2v": str(ensure_default_wan_model(root / "cache"))}
    out.update({v: str(save_wan_model(root / v, variant=v)) for v in VARIANTS[1:]})
    return out


def _image(seed: int) -> np.ndarray:
    """A colour gradient with noise, uint8 [1, 40, 70, 3] (another size than the video's)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:40, 0:70]
    pixels = np.stack([(x * 3) % 256, (y * 5) % 256, ((x + y) * 2) % 256], axis=-1) + rng.integers(-30, 30, (40, 70, 3))
    return np.clip(pixels, 0, 255).astype(np.uint8)[None]


def _requests(variant: str, seed: int) -> list[GenerationRequest]:
    base = dict(negative_prompt="blurry", num_inference_steps=3, options=dict(WINDOWS))
    if variant == "t2v":
        # 41 frames: 11 latent frames in windows (0, 5), (3, 8), (6, 11); a prompt per window, guidance on
        return [GenerationRequest(**base, prompt="a red fox runs | the fox jumps | snow falls", num_frames=41,
                                  height=16, width=80, guidance_scale=4.0, seed=seed)]
    if variant == "a14b":
        # two windows, each switching from the high-noise expert to the low-noise one with guidance_scale_2
        return [GenerationRequest(**{**base, "options": dict(WINDOWS, guidance_scale_2=2.5)}, prompt="a lake",
                                  num_frames=29, height=16, width=80, guidance_scale=4.0, seed=seed)]
    if variant == "i2v":
        # 41 frames in chained windows (0, 5), (4, 9), (8, 11) of the embedded CLIP image tokens' folder; window 2
        # starts from an image of its own (conditions at frame 32, where it starts), not window 1's last frame
        return [GenerationRequest(negative_prompt="blurry", num_inference_steps=3, prompt="a red fox | it jumps",
                                  options=dict(temporal_tile_size=17), num_frames=41, height=16, width=80,
                                  guidance_scale=4.0, seed=seed, conditions=(
                                      Condition(_image(seed)), Condition(_image(seed + 1), frame_index=32)))]
    if variant == "a14b-i2v":
        # two chained windows, each switching experts (guidance_scale_2)
        return [GenerationRequest(negative_prompt="blurry", num_inference_steps=3, prompt="a lake",
                                  options=dict(temporal_tile_size=17, guidance_scale_2=2.5), num_frames=29,
                                  height=16, width=80, guidance_scale=4.0, seed=seed, image=Condition(_image(seed)))]
    # TI2V-5B: text only without guidance; and an image as window 0's first frame (two windows each)
    return [GenerationRequest(**base, prompt="a storm | calm", num_frames=29, height=32, width=160,
                              guidance_scale=1.0, seed=seed),
            GenerationRequest(**base, prompt="a lighthouse", num_frames=29, height=32, width=160, guidance_scale=4.0,
                              seed=seed + 1, image=Condition(_image(seed)))]


def _sample_all(state, folders: dict[str, str], seed: int, variants=VARIANTS):
    """``{variant: [(frames, latents), ...]}``."""
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    out = {}
    for variant in variants:
        folder = folders[variant]
        model = WanModel(load_wan(folder), state=state)
        model.decode_frames_per_rank = 2
        out[variant] = []
        for request in _requests(variant, seed):
            latents = {}
            frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
            out[variant].append((frames, latents.get("latents")))
    return out


def _spans(latent: int, tile: int, overlap: int) -> list[tuple[int, int]]:
    spans, start = [], 0
    while True:
        end = min(start + tile, latent)
        spans.append((start, end))
        if end == latent:
            return spans
        start += tile - overlap


@torch.no_grad()
def _later_window(pipe, c, r: GenerationRequest, prompt: str, tail: torch.Tensor, frames: int,
                  seed: int) -> torch.Tensor:
    """A window after the first, written from the pipeline's parts: TI2V-5B's first-frame conditioning with the tail
    as its first k latent frames (mask 0, timestep 0); one-timestep models with the tail's frames replaced after
    every step by the tail noised to the scheduler's next sigma, with the window's own noise."""
    cfg_on = r.guidance_scale > 1.0
    cond_embeds, uncond_embeds = pipe.encode_prompt(prompt=prompt, negative_prompt=r.negative_prompt,
                                                    do_classifier_free_guidance=cfg_on, max_sequence_length=512,
                                                    device=torch.device("cpu"))
    scheduler = type(c.scheduler).from_config(c.scheduler.config)
    scheduler.set_timesteps(r.num_inference_steps, device="cpu")
    scheduler.set_begin_index(0)
    noise = pipe.prepare_latents(1, c.transformer.config.in_channels, r.height, r.width, frames, torch.float32,
                                 torch.device("cpu"), torch.Generator("cpu").manual_seed(seed))
    k, expand = tail.shape[2], c.layout.expand_timesteps
    boundary = None if c.layout.boundary_ratio is None else c.layout.boundary_ratio * 1000
    latents = noise.clone()
    if expand:
        mask = torch.ones((1, 1, *noise.shape[2:]))
        mask[:, :, :k] = 0
        condition = torch.zeros_like(noise)
        condition[:, :, :k] = tail
    else:
        sigma = scheduler.sigmas[0]
        latents[:, :, :k] = (1 - sigma) * tail + sigma * noise[:, :, :k]
    for i, t in enumerate(scheduler.timesteps):
        high = boundary is None or t >= boundary
        model = c.transformer if high else c.transformer_2
        guidance = r.guidance_scale if high else r.options.get("guidance_scale_2", r.guidance_scale)
        if expand:
            model_in = (1 - mask) * condition + mask * latents
            timestep = (mask[0][0][:, ::2, ::2] * t).flatten()[None]
        else:
            model_in, timestep = latents, t.expand(1)
        pred = model(hidden_states=model_in, timestep=timestep, encoder_hidden_states=cond_embeds,
                     return_dict=False)[0]
        if cfg_on:
            uncond = model(hidden_states=model_in, timestep=timestep, encoder_hidden_states=uncond_embeds,
                           return_dict=False)[0]
            pred = uncond + guidance * (pred - uncond)
        latents = scheduler.step(pred, t, latents, return_dict=False)[0].clone()
        if not expand:
            sigma = scheduler.sigmas[i + 1]
            latents[:, :, :k] = (1 - sigma) * tail + sigma * noise[:, :, :k]
    return (1 - mask) * condition + mask * latents if expand else latents


@torch.no_grad()
def _reference(c, r: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """The stitched latents and their frames (``vae.decode`` of the whole, as ``WanPipeline`` decodes), from the
    components ``c`` (``models.wan.loading.WanComponents``)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    parts = dict(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae, scheduler=c.scheduler,
                 transformer=c.transformer, transformer_2=c.transformer_2, boundary_ratio=c.layout.boundary_ratio,
                 expand_timesteps=c.layout.expand_timesteps)
    pipe = WanPipeline(**parts)
    o = r.options
    tile, overlap = (o["temporal_tile_size"] - 1) // 4 + 1, o["temporal_overlap"] // 4
    spans = _spans((r.num_frames - 1) // 4 + 1, tile, overlap)
    prompts = [p.strip() for p in r.prompt.split("|")]
    prompts += [prompts[-1]] * (len(spans) - len(prompts))
    call = dict(prompt=prompts[0], negative_prompt=r.negative_prompt, num_frames=(spans[0][1] - 1) * 4 + 1,
                height=r.height, width=r.width, num_inference_steps=r.num_inference_steps,
                guidance_scale=r.guidance_scale, generator=torch.Generator("cpu").manual_seed(r.seed),
                output_type="latent")
    if "guidance_scale_2" in o:
        call["guidance_scale_2"] = o["guidance_scale_2"]
    first = pipe
    if r.image is not None:
        first = WanImageToVideoPipeline(**parts, image_encoder=c.image_encoder, image_processor=c.image_processor)
        call["image"] = Image.fromarray(r.image.frames[0])
    first.set_progress_bar_config(disable=True)
    video = first(**call).frames.float()
    for w, (start, end) in enumerate(spans[1:], start=1):
        window = _later_window(pipe, c, r, prompts[w], video[:, :, -overlap:], (end - start - 1) * 4 + 1,
                               r.seed + start)
        assert torch.equal(window[:, :, :overlap], video[:, :, -overlap:]), "the window ends on its tail"
        video = torch.cat([video, window[:, :, overlap:]], dim=2)
    vae = c.vae
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    pixels = vae.decode(video / std + mean, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(pixels, output_type="np")[0]
    return video.numpy(), (np.clip(frames, 0, 1) * 255).round().astype(np.uint8)


@torch.no_grad()
def _chained_reference(c, r: GenerationRequest) -> tuple[np.ndarray, np.ndarray]:
    """Image-to-video folders: ``WanImageToVideoPipeline`` window by window, each after the first given the last
    frame the one before returned (uint8, as a caller saves it) as its image, or the image the request's conditions
    give it at the frame it starts from, and ``seed + start``; the latents are stitched after each window's first (its
    image's) and the frames after its first (the repeated one, or its own image's)."""
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline(tokenizer=c.tokenizer, text_encoder=c.text_encoder, vae=c.vae,
                                   scheduler=c.scheduler, transformer=c.transformer, transformer_2=c.transformer_2,
                                   boundary_ratio=c.layout.boundary_ratio, image_encoder=c.image_encoder,
                                   image_processor=c.image_processor)
    pipe.set_progress_bar_config(disable=True)
    spans = _spans((r.num_frames - 1) // 4 + 1, (r.options["temporal_tile_size"] - 1) // 4 + 1, 1)
    prompts = [p.strip() for p in r.prompt.split("|")]
    prompts += [prompts[-1]] * (len(spans) - len(prompts))
    given = {c.frame_index: c.frames[0] for c in ([r.image] if r.image is not None else r.conditions)}
    latents, frames = [], []
    for w, (start, end) in enumerate(spans):
        if start * 4 in given:
            image = Image.fromarray(given[start * 4])
        call = dict(image=image, prompt=prompts[w], negative_prompt=r.negative_prompt,
                    num_frames=(end - start - 1) * 4 + 1, height=r.height, width=r.width,
                    num_inference_steps=r.num_inference_steps, guidance_scale=r.guidance_scale)
        if "guidance_scale_2" in r.options:
            call["guidance_scale_2"] = r.options["guidance_scale_2"]
        seed = r.seed + start
        own = pipe(**call, generator=torch.Generator("cpu").manual_seed(seed), output_type="latent").frames
        video = pipe(**call, generator=torch.Generator("cpu").manual_seed(seed), output_type="np").frames[0]
        video = (np.clip(video, 0, 1) * 255).round().astype(np.uint8)
        latents.append(own if w == 0 else own[:, :, 1:])
        frames.append(video if w == 0 else video[1:])
        image = Image.fromarray(video[-1])
    return torch.cat(latents, dim=2).float().numpy(), np.concatenate(frames)


@pytest.fixture(scope="module")
def one_rank(folders):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), folders, seed)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_rank_equals_the_reference_windows(folders, one_rank, variant):
    from models.wan.loading import load_wan

    seed, ours = one_rank
    reference = _chained_reference if variant in CHAINED else _reference
    for r, (frames, latents) in zip(_requests(variant, seed), ours[variant], strict=True):
        ref_latents, ref_frames = one_thread(reference, load_wan(folders[variant]), r)
        assert latents.shape == ref_latents.shape and latents.shape[2] == (r.num_frames - 1) // 4 + 1
        np.testing.assert_array_equal(latents, ref_latents, err_msg=f"{variant} seed={seed}: latents differ")
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref_frames, err_msg=f"{variant} seed={seed}: frames differ")


def test_the_recipe_with_the_flow_matching_euler_scheduler(folders):
    """A folder's FlowMatchEulerDiscreteScheduler (the other scheduler Wan folders name) steps the tail's recipe alike:
    its sigmas, from the same step index, end at 0 as UniPC's do."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    def components():  # each its own: WanModel parallelises the transformers it is given in place
        return dataclasses.replace(load_wan(folders["t2v"]), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))

    seed = random.randrange(2**31)
    (request,) = _requests("t2v", seed)
    request = dataclasses.replace(request, num_frames=29)
    state = single_process_state()
    latents = {}
    frames = one_thread(sample, WanModel(components(), state=state), request, state=state,
                        control=SampleControl(on_latents=latents.update))
    ref_latents, ref_frames = one_thread(_reference, components(), request)
    assert ref_latents.shape[2] == 8, "two windows"
    np.testing.assert_array_equal(latents["latents"], ref_latents, err_msg=f"seed={seed}")
    np.testing.assert_array_equal(frames, ref_frames, err_msg=f"seed={seed}")


def test_each_window_continues_the_tail_and_its_own_prompt(folders, one_rank):
    """Every window after the first starts on the tail it is given and is not the plain pass of its frames: another
    prompt for the last window leaves every latent frame before it as it was and changes the ones it makes."""
    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    seed, ours = one_rank
    (request,) = _requests("t2v", seed)
    state = single_process_state()
    model = WanModel(load_wan(folders["t2v"]), state=state)
    other = dataclasses.replace(request, prompt="a red fox runs | the fox jumps | a volcano erupts")
    latents = {}
    one_thread(sample, model, other, state=state, control=SampleControl(on_latents=latents.update))
    a, b = ours["t2v"][0][1], latents["latents"]
    np.testing.assert_array_equal(a[:, :, :8], b[:, :, :8])  # windows (0, 5), (3, 8): the last makes 8..10
    assert np.abs(a[:, :, 8:] - b[:, :, 8:]).mean() > 1e-3


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_equal_one_rank(folders, one_rank, groups, world):
    """Every variant at 2 ranks (a window's 25 tokens as 13 + 12: the tail's 10 inside rank 0's shard); at 3 (a third
    process on this machine's cores) Wan 2.1's 3 windows (9 + 9 + 7: the tail's end inside rank 1's shard)."""
    seed, expected = one_rank
    variants = VARIANTS if world == 2 else ("t2v",)
    results = groups(world).run(_sample_all, folders, seed, variants, timeout=600)
    assert all(frames is None for rank in results[1:] for runs in rank.values() for frames, _ in runs)
    for variant in variants:
        for (exp, exp_latents), (got, got_latents) in zip(expected[variant], results[0][variant], strict=True):
            np.testing.assert_allclose(got_latents, exp_latents, rtol=0, atol=1e-4,
                                       err_msg=f"{variant} world={world} seed={seed}")
            diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
            assert diff.max() <= 1 and diff.mean() < 0.01, f"{variant} world={world} seed={seed}: max {diff.max()}"


@pytest.mark.parametrize("variant", ["t2v", "i2v"])
def test_a_resumed_job_equals_the_whole_run(folders, one_rank, variant):
    """After each window the video made so far is a checkpoint; going on from the one after window 1 (its latents
    decoded again, then window 2's) makes the video an uninterrupted run makes, bit for bit; chained windows (i2v)
    from either checkpoint (the last frame, the windows' first latent frames in it)."""
    from cp_infer import single_process_state
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    seed, ours = one_rank
    (request,) = _requests(variant, seed)
    state = single_process_state()
    model = WanModel(load_wan(folders[variant]), state=state)
    model.decode_frames_per_rank = 2
    saved = {}
    one_thread(sample, model, request, state=state, control=SampleControl(on_checkpoint=saved.__setitem__))
    assert sorted(saved) == [1, 2]
    for start in (2,) if variant == "t2v" else (1, 2):
        frames = one_thread(sample, model, request, state=state, control=SampleControl(resume=(start, saved[start])))
        np.testing.assert_array_equal(frames, ours[variant][0][0], err_msg=f"seed={seed} from {start}")
    if variant == "i2v":
        broken = {k: v for k, v in saved[2].items() if k != "firsts"}
        with pytest.raises(Exception, match="checkpoint"):
            one_thread(sample, model, request, state=state, control=SampleControl(resume=(2, broken)))


def test_windows_and_plan():
    """The windows are the spans of tile - overlap latent frames apart; the plan a pass per window, each with every
    step; a video that fits one window is one pass."""
    from models.wan.adapter import plan_request
    from models.wan.options import wan_options, wan_windows_of

    options = wan_options()
    for frames in range(1, 200, 4):
        for tile, overlap in ((81, 20), (17, 8), (9, 4), (33, 28)):
            values = {"num_frames": frames, "temporal_tile_size": tile, "temporal_overlap": overlap}
            got, latent = wan_windows_of(values), (frames - 1) // 4 + 1
            if latent <= (tile - 1) // 4 + 1:
                assert got is None
                continue
            assert list(got.spans) == _spans(latent, (tile - 1) // 4 + 1, overlap // 4)
            assert options.window_frames(values) == (max(e - s for s, e in got.spans) - 1) * 4 + 1
    request = GenerationRequest(prompt="a | b", num_frames=41, num_inference_steps=4, options=dict(WINDOWS))
    plan = plan_request(request)
    assert [(p.kind, p.window, p.steps, p.request.prompt) for p in plan.passes] == \
        [("window", 0, 4, "a"), ("window", 1, 4, "b"), ("window", 2, 4, "b")]
    assert len(plan_request(dataclasses.replace(request, num_frames=17)).passes) == 1
    segments = ({"start_window": 1, "end_window": 2, "text": "c"},)
    plan = plan_request(dataclasses.replace(request, options=dict(WINDOWS, prompt_segments=segments)))
    assert [p.request.prompt for p in plan.passes] == ["a | b", "c", "c"]  # window 0 has no segment: the prompt


@pytest.mark.parametrize("layout, values, match", [
    ("t2v", dict(temporal_tile_size=80), "temporal_tile_size=80 is not 4k\\+1; try 77 or 81"),
    ("t2v", dict(temporal_overlap=10), "temporal_overlap=10 is not a multiple of 4"),
    ("t2v", dict(temporal_tile_size=17, temporal_overlap=20), "temporal_overlap=20 is not fewer frames than"),
    ("t2v", dict(num_frames=81, prompt_segments=[{"text": "a"}]), "prompt_segments: the video fits one window"),
    ("i2v", dict(num_frames=161, temporal_overlap=8), "temporal_overlap"),  # chained: no overlap to choose
])
def test_bad_window_requests_are_refused(layout, values, match):
    from cp_infer.request import resolve_request
    from models.wan.options import WanLayout, wan_options

    options = wan_options(WanLayout(image=True) if layout == "i2v" else WanLayout())
    with pytest.raises(ValueError, match=match):
        resolve_request(GenerationRequest(prompt="a fox", options=values), options)
    if layout == "i2v":  # windows without the overlap
        values = {k: v for k, v in values.items() if k != "temporal_overlap"}
        resolve_request(GenerationRequest(prompt="a fox", options=values), options)


@pytest.mark.parametrize("layout, conditions, match", [
    ("i2v", [(0, 1), (16, 1)], None),  # windows (0, 5), (4, 9), (8, 11) start at frames 0, 16, 32
    ("i2v", [(0, 1), (-9, 1)], None),  # frame 32 counted from the end
    ("i2v", [(0, 1), (20, 1)], r"conditions\[1\]\.frame_index=20: .* starts from: 0, 16, 32; give one of them"),
    ("i2v", [(16, 1)], r"conditions\[0\]\.frame_index=16: .* give conditions\[0\] at frame_index 0"),
    ("i2v", [(0, 1), (32, 1), (16, 1)], r"conditions\[2\]\.frame_index=16: give conditions in order"),
    ("i2v", [(0, 1), (16, 0.5)], r"conditions\[1\]\.strength=0.5: .* give strength 1"),
    ("i2v", [(0, 1), (16, 1, 9)], r"conditions\[1\]\.media has 9 frames: .* give one frame"),
    ("i2v-short", [(0, 1)], "conditions: Wan models take an image as the first frame"),
    ("ti2v", [(0, 1), (16, 1)], "conditions: a video longer than one window takes an image"),
])
def test_window_images_are_checked(layout, conditions, match):
    """An image-to-video folder's windowed request takes ``conditions``: an image per window at most, each at the
    frame its window starts from (the first at 0); a video of one window, or another layout, takes none."""
    from cp_infer.request import GenerationLimits, check_request, resolve_request, window_images
    from cp_infer.shapes import VideoGeometry
    from models.wan.options import WanLayout, wan_options

    options = wan_options(WanLayout(expand_timesteps=True) if layout == "ti2v" else WanLayout(image=True))
    geometry = VideoGeometry(temporal_compression=4, spatial_compression=8, patch_size=2)
    conds = tuple(Condition(np.repeat(_image(i), c[2] if len(c) > 2 else 1, axis=0), frame_index=c[0],
                            strength=c[1]) for i, c in enumerate(conditions))
    request = resolve_request(GenerationRequest(
        prompt="a fox", num_frames=17 if layout == "i2v-short" else 41, height=16, width=80, conditions=conds,
        options=dict(temporal_tile_size=17) if layout != "ti2v" else dict(WINDOWS)), options)
    if match is not None:
        with pytest.raises(ValueError, match=match):
            check_request(request, geometry=geometry, limits=GenerationLimits(), options=options)
        return
    check_request(request, geometry=geometry, limits=GenerationLimits(), options=options)
    images = window_images(request, options)
    second = 1 if conditions[1][0] == 16 else 2
    assert sorted(images) == [0, second] and all(c.frame_index == 0 and c.strength == 1 for c in images.values())
    np.testing.assert_array_equal(images[second].frames, _image(1))


def test_long_requests_take_what_the_model_windows():
    """An image windows with TI2V-5B and image-to-video folders (the first window's first frame), not with
    text-to-video ones; extensions are LTX's."""
    from cp_infer.request import GenerationLimits, check_request, resolve_request
    from cp_infer.shapes import VideoGeometry
    from models.wan.options import WanLayout, wan_options

    geometry = VideoGeometry(temporal_compression=4, spatial_compression=8, patch_size=2)
    image = Condition(_image(0))
    for layout, ok in ((WanLayout(expand_timesteps=True), True), (WanLayout(image=True), True), (WanLayout(), False)):
        options = wan_options(layout)
        request = GenerationRequest(prompt="a fox", num_frames=161, height=64, width=64, image=image)
        if ok:
            check_request(resolve_request(request, options), geometry=geometry, limits=GenerationLimits(),
                          options=options)
        else:
            with pytest.raises(ValueError, match="image"):
                check_request(resolve_request(request, options), geometry=geometry, limits=GenerationLimits(),
                              options=options)
    options = wan_options()
    request = GenerationRequest(prompt="a fox", num_frames=161, height=64, width=64, extends=Condition(
        np.zeros((17, 64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ValueError, match="does not extend videos"):
        check_request(resolve_request(request, options), geometry=geometry, limits=GenerationLimits(),
                      options=options)


@pytest.mark.parametrize("variant, frames_per_rank", [("t2v", 2), ("t2v", 3), ("i2v", 2)])
def test_a_live_video_equals_the_one_request_video(folders, variant, frames_per_rank):
    """A live Wan video (``cp_infer.live``) of two windows, directed a window at a time with waits between, makes the
    frames and latents of the one request with the same prompt_segments, bit for bit. Wan's decode carries its causal
    cache from piece to piece, so when the video grows it is decoded again from the start for the longer video (whose
    pieces differ from the shorter one's with 2 latent frames a piece and are its first ones with 3), the frames
    already delivered not delivered twice. ``i2v``: chained windows from an image, each window the image-to-video of
    the last frame before it (the last window's kept too, for the video to go on from), or of the image directed with
    it."""
    from cp_infer import single_process_state
    from cp_infer.live import WAIT, Direction, live_request
    from cp_infer.request import resolve_request
    from models.wan.adapter import WanModel
    from models.wan.loading import load_wan

    seed = random.randrange(2**31)
    state = single_process_state()
    model = WanModel(load_wan(folders[variant]), state=state)
    model.decode_frames_per_rank = frames_per_rank
    chained = variant in CHAINED
    base = resolve_request(GenerationRequest(
        prompt="a red fox runs", negative_prompt="blurry", num_frames=33 if chained else 29, height=16, width=80,
        num_inference_steps=3, guidance_scale=4.0, seed=seed, image=Condition(_image(seed)) if chained else None,
        options=dict(temporal_tile_size=17) if chained else dict(WINDOWS)), model.options)
    # Chained: the second direction starts its window from an image of its own (the one request's conditions at
    # frame 32, where window 2 starts); the third goes on from the last frame before it.
    cut = Condition(_image(seed + 1)) if chained else None
    directions = [Direction(base.prompt, 2), Direction("the fox jumps", 1, cut), Direction("snow falls", 1)]
    whole = live_request(base, directions, model.options)
    assert whole.num_frames == (65 if chained else 53), whole
    if chained:
        assert whole.image is None and [c.frame_index for c in whole.conditions] == [0, 32], whole
        np.testing.assert_array_equal(whole.conditions[1].frames, cut.frames)
    assert_live_is_the_whole(model, base, directions, [WAIT, 2, 3, WAIT, None], state=state, seed=seed)
