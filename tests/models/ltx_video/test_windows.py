"""Long LTX-Video window by window: at 1 rank the latents equal diffusers' ``LTXI2VLongMultiPromptPipeline``
(``output_type="latent"``) bit for bit, with the folder's Euler scheduler and with ``LTXEulerAncestralRFScheduler``
(per-step noise drawn for the whole window on every rank); at N = 2, 3 equal to 1 rank.

Shapes: 64x224 is 2 x 7 = 14 tokens a latent frame, so the windows with their tails (5, 8 and 7 latent frames: 70,
112, 98 tokens) do not divide 3 (or 4). Tolerances as ``test_ltx_video_parallel``: N ranks differ from 1 only in
fp32 summation order (latents 1e-4, frames within 1 uint8 level).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import JobFailed, SampleControl, sample

from ...harness import one_thread
from ...worker_groups import groups_by_world
from .._parity import assert_live_is_the_whole

groups = groups_by_world()

WINDOWS = dict(temporal_tile_size=40, temporal_overlap=24)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from models.ltx_video.default import ensure_default_model

    return str(ensure_default_model(tmp_path_factory.mktemp("cache")))


def _components(cache_dir: str, scheduler: str):
    """The embedded default with ``euler`` (its FlowMatchEulerDiscreteScheduler without dynamic shift: the pipeline
    passes none) or ``ancestral`` (LTXEulerAncestralRFScheduler, as the pipeline is made for)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXEulerAncestralRFScheduler

    from models.ltx_video.loading import load_ltx_video

    c = load_ltx_video(cache_dir)
    if scheduler == "ancestral":
        return dataclasses.replace(c, scheduler=LTXEulerAncestralRFScheduler())
    config = dict(c.scheduler.config, use_dynamic_shifting=False)
    return dataclasses.replace(c, scheduler=FlowMatchEulerDiscreteScheduler.from_config(config))


def _requests(seed: int) -> list[GenerationRequest]:
    base = dict(negative_prompt="blurry", height=64, width=224, num_inference_steps=3, fps=24)
    return [
        # three windows, one prompt per window from the bars, guidance on
        GenerationRequest(**base, prompt="a red fox runs | the fox jumps | snow falls", num_frames=57,
                          guidance_scale=3.0, seed=seed, options=dict(WINDOWS)),
        # four windows, a prompt per range of windows, no guidance, no AdaIN, a weaker tail
        GenerationRequest(**base, prompt="unused", num_frames=65, guidance_scale=1.0, seed=seed + 1,
                          options=dict(WINDOWS, adain_factor=0.0, temporal_overlap_cond_strength=0.8,
                                       prompt_segments=({"start_window": 0, "end_window": 1, "text": "a calm lake"},
                                                        {"start_window": 3, "end_window": 3, "text": "a storm"}))),
        # image-to-video: the image holds frame 0 and conditions every window as its negative-index frame
        GenerationRequest(**base, prompt="a lighthouse at dusk", num_frames=57, guidance_scale=3.0, seed=seed + 2,
                          image=Condition(_image(seed)), options=dict(WINDOWS, cond_strength=0.7)),
        # the same, window 2 given its own image (conditions at frame 25, where it starts): no pipeline takes one
        GenerationRequest(**base, prompt="a lighthouse at dusk", num_frames=57, guidance_scale=3.0, seed=seed + 2,
                          conditions=(Condition(_image(seed)), Condition(_image(seed + 1), frame_index=25)),
                          options=dict(WINDOWS, cond_strength=0.7)),
    ]


def _image(seed: int) -> np.ndarray:
    """uint8 [1, 50, 70, 3]: a gradient with noise (another size than the video's: the pipeline resizes it)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:50, 0:70]
    base = np.stack([(x * 3) % 256, (y * 5) % 256, ((x + y) * 2) % 256], axis=-1)
    return np.clip(base + rng.integers(-30, 30, base.shape), 0, 255).astype(np.uint8)[None]


def _sample_all(state, cache_dir: str, seed: int, scheduler: str):
    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(cache_dir, scheduler), state=state)
    model.decode_frames_per_rank = 2
    out = []
    for request in _requests(seed):
        latents = {}
        frames = sample(model, request, state=state, control=SampleControl(on_latents=latents.update))
        out.append((frames, latents.get("latents")))
    return out


def _reference(cache_dir: str, request: GenerationRequest, scheduler: str) -> np.ndarray:
    from diffusers.pipelines.ltx.pipeline_ltx_i2v_long_multi_prompt import LTXI2VLongMultiPromptPipeline

    c = _components(cache_dir, scheduler)
    pipe = LTXI2VLongMultiPromptPipeline(scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder,
                                         tokenizer=c.tokenizer, transformer=c.transformer)
    pipe.set_progress_bar_config(disable=True)
    o = request.options
    extra = {k: o[k] for k in ("adain_factor", "temporal_overlap_cond_strength", "prompt_segments", "cond_strength")
             if k in o}
    if request.image is not None:
        from PIL import Image

        extra["cond_image"] = Image.fromarray(request.image.frames[0])
    if "prompt_segments" in extra:
        extra["prompt_segments"] = [dict(s) for s in extra["prompt_segments"]]
    return pipe(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                guidance_scale=request.guidance_scale, frame_rate=request.fps, seed=request.seed,
                temporal_tile_size=o["temporal_tile_size"], temporal_overlap=o["temporal_overlap"],
                output_type="latent", **extra).frames.numpy()


@pytest.mark.parametrize("scheduler", ["euler", "ancestral"])
def test_one_rank_equals_long_multi_prompt_pipeline(cache_dir, scheduler):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    ours = one_thread(_sample_all, single_process_state(), cache_dir, seed, scheduler)
    for request, (frames, latents) in zip(_requests(seed), ours, strict=True):
        if request.conditions:
            # Window 2's own image: the windows before it are the image's video (latent frames 0..3 final before
            # window 2, as test_windows_change_with_their_prompts), the rest another.
            np.testing.assert_array_equal(latents[:, :, :4], ours[2][1][:, :, :4], err_msg=f"seed={seed}")
            assert np.abs(latents[:, :, 4:] - ours[2][1][:, :, 4:]).mean() > 1e-3
            continue
        ref = one_thread(_reference, cache_dir, request, scheduler)
        assert latents.shape == ref.shape == (1, 16, (request.num_frames - 1) // 8 + 1, 2, 7)
        np.testing.assert_array_equal(latents, ref, err_msg=f"seed={seed} {scheduler}: latents differ")
        assert frames.shape == (request.num_frames, request.height, request.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"


def test_windows_change_with_their_prompts(cache_dir):
    """Each window's prompt is used: another prompt for the last window changes only the video from that window's
    start on, never the windows before."""
    from cp_infer import single_process_state
    from models.ltx_video.adapter import LTXVideoModel

    state = single_process_state()
    model = LTXVideoModel(_components(cache_dir, "euler"), state=state)
    request = _requests(3)[0]
    model.decode_frames_per_rank = 2
    latents_a, latents_b = {}, {}
    sample(model, request, state=state, control=SampleControl(on_latents=latents_a.update))
    other = dataclasses.replace(request, prompt="a red fox runs | the fox jumps | a volcano erupts")
    sample(model, other, state=state, control=SampleControl(on_latents=latents_b.update))
    a, b = latents_a["latents"], latents_b["latents"]
    # windows (0, 5), (2, 7), (4, 8): the last changes latent frames 5.. (4 is blended from it, 0..3 are final)
    np.testing.assert_array_equal(a[:, :, :4], b[:, :, :4])
    assert np.abs(a[:, :, 5:] - b[:, :, 5:]).mean() > 1e-3


@pytest.fixture(scope="module")
def one_rank(cache_dir):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_sample_all, single_process_state(), cache_dir, seed, "ancestral")


@pytest.mark.parametrize("world,ring", [(2, None), (3, None), (2, 2)], ids=["2", "3", "R2"])
def test_n_ranks_equal_one_rank(cache_dir, one_rank, groups, world, ring):
    """Ulysses at 2 and 3 ranks, and a ring of two (each window's sequence, its tail included, round the ring)."""
    from ...worker_groups import SharedGroup

    seed, expected = one_rank
    group = groups(world) if ring is None else SharedGroup(world, ring=ring)
    results = group.run(_sample_all, cache_dir, seed, "ancestral", timeout=600)
    assert all(frames is None and latents is None for rank in results[1:] for frames, latents in rank)
    for (exp, exp_latents), (got, got_latents) in zip(expected, results[0], strict=True):
        np.testing.assert_allclose(got_latents, exp_latents, rtol=0, atol=1e-4, err_msg=f"world={world} seed={seed}")
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.01, f"world={world} seed={seed}: max {diff.max()}"


def test_windows_are_the_pipelines():
    """The windows, the prompts per window and the fits-one-window rule are the pipeline's."""
    from diffusers.pipelines.ltx.pipeline_ltx_i2v_long_multi_prompt import (
        parse_prompt_segments,
        split_into_temporal_windows,
    )

    from models.common.windows import window_prompts, windows_of

    for frames in range(9, 400, 8):
        for tile, overlap in ((80, 24), (40, 24), (64, 32), (120, 56)):
            latent = (frames - 1) // 8 + 1
            got = windows_of({"num_frames": frames, "temporal_tile_size": tile, "temporal_overlap": overlap})
            if latent <= tile // 8:
                assert got is None
                continue
            assert list(got.spans) == split_into_temporal_windows(latent, tile // 8, overlap // 8, 8)
            assert got.made(len(got) - 1) == latent and got.final(len(got) - 1) == latent
    segments = ({"start_window": 0, "end_window": 1, "text": "a"}, {"start_window": 3, "end_window": 4, "text": "b"})
    request = GenerationRequest(prompt="x", num_frames=121, options=dict(WINDOWS, prompt_segments=segments))
    windows = windows_of(request)
    parsed = parse_prompt_segments("x", [dict(s) for s in segments])
    assert window_prompts(request, windows) == [parsed[min(w, len(parsed) - 1)] for w in range(len(windows))]
    request = GenerationRequest(prompt=" a | b ", num_frames=121, options=dict(WINDOWS))
    assert window_prompts(request, windows_of(request)) == ["a", "b"] + ["b"] * (len(windows_of(request)) - 2)


@pytest.mark.parametrize("values, match", [
    (dict(temporal_overlap=40), "temporal_overlap=40 is not smaller than temporal_tile_size=40"),
    (dict(temporal_overlap=16), "temporal_overlap=16 is out of range"),
    (dict(temporal_tile_size=24), "temporal_tile_size=24 is out of range"),
    (dict(num_frames=33, prompt_segments=[{"text": "a"}]), "prompt_segments: the video fits one window"),
    (dict(prompt_segments=[{"start_window": 2, "end_window": 1, "text": "a"}]), r"prompt_segments\[0\]: end_window"),
    (dict(prompt_segments=[{"text": " "}]), r"prompt_segments\[0\].text must be a non-empty string"),
    (dict(prompt_segments=[{"txt": "a"}]), r"prompt_segments\[0\] must be an object with text"),
])
def test_bad_window_options_are_refused(values, match):
    from cp_infer.request import GenerationLimits, resolve_request
    from models.ltx_video.options import ltx_video_options

    values = dict(values)
    options = ltx_video_options(latent_upsampler=values.pop("latent_upsampler", False))
    frames = values.pop("num_frames", 121)
    request = GenerationRequest.of(prompt="a", num_frames=frames, height=128, width=128,
                                   **dict(WINDOWS, **values))
    with pytest.raises(ValueError, match=match):
        resolve_request(request, options, limits=GenerationLimits())


def test_token_limit_applies_per_window():
    """A minute of video passes the token limit that one window of it passes; a window over it is refused."""
    from cp_infer.request import GenerationLimits, check_request, resolve_request
    from cp_infer.shapes import VideoGeometry
    from models.ltx_video.options import ltx_video_options

    options, limits = ltx_video_options(), GenerationLimits(max_tokens=1000)
    geometry = VideoGeometry(temporal_compression=8, spatial_compression=32, patch_size=1, patch_size_t=1)
    long = resolve_request(GenerationRequest.of(prompt="a", num_frames=1537, height=128, width=128), options,
                           limits=limits)
    assert check_request(long, geometry=geometry, limits=limits, options=options).tokens > 1000
    wide = resolve_request(GenerationRequest.of(prompt="a", num_frames=1537, height=512, width=512), options,
                           limits=limits)
    with pytest.raises(ValueError, match="per window of 97 frames"):
        check_request(wide, geometry=geometry, limits=limits, options=options)


def _long_run(state, cache_dir: str, frames: int, resume=None):
    """A long video on the embedded default, streamed (``collect=False``): what happened in which order, the
    checkpoints, and the delivered frames' digest."""
    import hashlib

    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(cache_dir, "ancestral"), state=state)
    request = GenerationRequest(prompt="a long walk | a river | mountains", num_frames=frames, height=64, width=96,
                                num_inference_steps=2, guidance_scale=1.0, fps=25, seed=11)
    events, checkpoints, digest = [], {}, hashlib.sha256()

    def on_frames(chunk, first, total):
        events.append(("frames", first, chunk.shape[0], total))
        digest.update(chunk.tobytes())

    control = SampleControl(on_pass=lambda i, plan: events.append(("pass", i, plan.passes[i].window)),
                            on_frames=on_frames, on_checkpoint=lambda i, arrays: checkpoints.update({i: arrays}),
                            collect=False, resume=resume)
    out = sample(model, request, state=state, control=control)
    return out, events, checkpoints, digest.hexdigest()


def test_a_minute_streams_window_by_window(cache_dir, groups):
    """61 s at 25 fps on 2 ranks: 28 windows; frames are delivered in order from the second window on, each
    window's final frames before the next-but-one window starts, in chunks of a decode round (no rank holds the
    video), and the whole video arrives."""
    out, events, checkpoints, _ = groups(2).run(_long_run, cache_dir, 1537, timeout=600)[0]
    assert out is None
    passes = [e for e in events if e[0] == "pass"]
    assert [p[2] for p in passes] == list(range(len(passes))) and len(passes) == 28
    frames = [e for e in events if e[0] == "frames"]
    assert sum(f[2] for f in frames) == 1537 and all(f[3] == 1537 for f in frames)
    assert [f[1] for f in frames] == list(np.cumsum([0] + [f[2] for f in frames[:-1]]))
    assert max(f[2] for f in frames) <= 2 * 2 * 8, "a chunk is one decode round's piece"
    first_frames = events.index(frames[0])
    assert first_frames < events.index(passes[2]), "streaming starts after the first window or two"
    # before window w starts, the frames of every window up to w - 2 have been delivered
    for w in range(3, len(passes)):
        delivered = sum(e[2] for e in events[:events.index(passes[w])] if e[0] == "frames")
        assert delivered >= ((w - 2) * 7 - 1) * 8, (w, delivered)
    assert sorted(checkpoints) == list(range(1, 28))


def test_resume_from_a_checkpoint_equals_the_whole_run(cache_dir):
    """Going on from the checkpoint after window 2 makes the same video, bit for bit, without the windows before."""
    from cp_infer import single_process_state

    state = single_process_state()
    _, events, checkpoints, digest = one_thread(_long_run, state, cache_dir, 161)
    assert len([e for e in events if e[0] == "pass"]) == 3
    _, events2, _, digest2 = one_thread(_long_run, state, cache_dir, 161, resume=(2, checkpoints[2]))
    assert [e for e in events2 if e[0] == "pass"] == [("pass", 2, 2)]
    assert digest2 == digest
    with pytest.raises(JobFailed, match="not one of this request.s windows"):
        one_thread(_long_run, state, cache_dir, 161, resume=(2, dict(checkpoints[2], window=np.array(2))))


def _extend(state, cache_dir: str, tail: np.ndarray, frames: int):
    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(cache_dir, "ancestral"), state=state)
    model.decode_frames_per_rank = 2
    request = GenerationRequest(prompt="the river goes on", num_frames=frames, height=64, width=224,
                                num_inference_steps=3, guidance_scale=3.0, fps=24, seed=7,
                                extends=Condition(tail), options=dict(WINDOWS))
    return sample(model, request, state=state)


def test_an_extension_continues_the_tail_it_is_given(cache_dir, groups):
    """An extension makes num_frames - 1 new frames after the video it extends (window by window from its last 17
    frames, which are not delivered again), depends on that tail, and is the same at N = 2 as at 1 rank."""
    from cp_infer import single_process_state

    rng = np.random.default_rng(5)
    tail = rng.integers(0, 255, (17, 64, 224, 3), dtype=np.uint8)
    one = one_thread(_extend, single_process_state(), cache_dir, tail, 49)
    assert one.shape == (48, 64, 224, 3) and one.std() > 5
    other = one_thread(_extend, single_process_state(), cache_dir, 255 - tail, 49)
    assert np.abs(one.astype(int) - other.astype(int)).mean() > 1
    two = groups(2).run(_extend, cache_dir, tail, 49, timeout=600)[0]
    diff = np.abs(two.astype(np.int16) - one.astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.01


def _two_stage(state, cache_dir: str, seed: int, resume=None):
    from models.ltx_video.adapter import LTXVideoModel

    model = LTXVideoModel(_components(cache_dir, "ancestral"), state=state)
    model.decode_frames_per_rank = 2
    request = GenerationRequest(prompt="a red fox runs | the fox jumps", negative_prompt="blurry", num_frames=57,
                                height=128, width=448, num_inference_steps=3, guidance_scale=3.0, fps=24, seed=seed,
                                options=dict(WINDOWS, stages=2))
    out = {"passes": [], "checkpoints": {}}
    control = SampleControl(on_latents=out.update, resume=resume,
                            on_pass=lambda i, plan: out["passes"].append((plan.passes[i].kind, plan.passes[i].window)),
                            on_checkpoint=lambda i, arrays: out["checkpoints"].update({i: arrays}))
    out["frames"] = sample(model, request, state=state, control=control)
    return out


def test_two_stages_over_the_windows(cache_dir, groups):
    """stages=2 longer than a window: stage 1 window by window at half the size (the pipeline's, bit for bit, at that
    size), the upsampler over its whole video, stage 2 over the windows at full size; N=2 equals 1 rank, and a job
    resumed in either stage equals the whole run."""
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    one = one_thread(_two_stage, single_process_state(), cache_dir, seed)
    kinds = [("stage1_window", w) for w in range(3)] + [("refine_window", w) for w in range(3)]
    assert one["passes"] == kinds
    assert one["frames"].shape == (57, 128, 448, 3) and one["frames"].std() > 5
    assert one["latents"].shape == (1, 16, 8, 4, 14)
    # Stage 1 is the long pipeline at half the size: its checkpoint after the last stage-1 window holds its latents.
    half = GenerationRequest(prompt="a red fox runs | the fox jumps", negative_prompt="blurry", num_frames=57,
                             height=64, width=224, num_inference_steps=3, guidance_scale=3.0, fps=24, seed=seed,
                             options=dict(WINDOWS))
    np.testing.assert_array_equal(one["checkpoints"][3]["latents"], one_thread(_reference, cache_dir, half,
                                                                              "ancestral"))
    two = groups(2).run(_two_stage, cache_dir, seed, timeout=600)[0]
    np.testing.assert_allclose(two["latents"], one["latents"], rtol=0, atol=1e-4)
    diff = np.abs(two["frames"].astype(np.int16) - one["frames"].astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.01
    for done in (2, 3, 4):
        resumed = one_thread(_two_stage, single_process_state(), cache_dir, seed,
                             resume=(done, one["checkpoints"][done]))
        assert resumed["passes"] == kinds[done:]
        np.testing.assert_array_equal(resumed["frames"], one["frames"], err_msg=f"resumed after pass {done}")


@pytest.mark.parametrize("decode", ["plain", "noised"])
def test_a_live_video_equals_the_one_request_video(cache_dir, decode):
    """A live LTX-Video (``cp_infer.live``) of two whole windows, directed a window at a time with waits between, with
    an image conditioning every window, makes the latents and frames of the one request with the same
    prompt_segments, bit for bit. ``plain``: the decode is the same however long the video, so frames stream as the
    windows make them final (the first before the video grows); ``noised``: the decode noise is drawn for the whole
    video, so the frames wait for its end."""
    from cp_infer import single_process_state
    from cp_infer.live import WAIT, Direction, live_request
    from cp_infer.request import resolve_request
    from models.ltx_video.adapter import LTXVideoModel

    seed = random.randrange(2**31)
    state = single_process_state()
    model = LTXVideoModel(_components(cache_dir, "euler"), state=state)
    model.decode_frames_per_rank = 2
    noise = dict(decode_timestep=0.05, decode_noise_scale=0.025) if decode == "noised" else {}
    base = resolve_request(GenerationRequest(prompt="a red fox runs", negative_prompt="blurry", num_frames=49,
                                             height=64, width=224, num_inference_steps=2, guidance_scale=3.0, fps=24,
                                             seed=seed, image=Condition(_image(seed)),
                                             options=dict(WINDOWS, **noise)), model.options)
    # "snow falls" with an image of its own: windows 4 and 5 take it as their negative-index frame, and so does
    # window 6 (the one request's conditions at frame 57, where window 4 starts).
    directions = [Direction(base.prompt, 2), Direction("the fox jumps", 2),
                  Direction("snow falls", 2, Condition(_image(seed + 1))), Direction("night", 1)]
    whole = live_request(base, directions, model.options)
    assert whole.num_frames == 129 and live_request(base, directions[:1], model.options).num_frames == 49, whole
    assert [c.frame_index for c in whole.conditions] == [0, 57] and whole.image is None, whole
    asked = assert_live_is_the_whole(model, base, directions, [WAIT, 2, 3, 4, WAIT, None], state=state,
                                     seed=seed)
    # Asked after windows 1, 1, 3, 5, 6, 6: after window 3 (final: 9 of 15 latent frames) the first frames are
    # delivered (at 1 rank the decode's first piece reads 9), then the video grows again.
    assert (asked[4] > 0) == (decode == "plain"), asked


def test_live_options_are_whole_one_stage_windows():
    from cp_infer.live import first_windows, windows_for_frames
    from cp_infer.request import resolve_request
    from models.ltx_video.options import ltx_video_options

    options = ltx_video_options(latent_upsampler=True, stages=1)
    request = resolve_request(GenerationRequest(prompt="a fox", num_frames=65, options=dict(WINDOWS)), options)
    assert first_windows(request, options)[0] == 2 and windows_for_frames(request, options) == 3
    with pytest.raises(ValueError, match="a live video is whole windows; try 49 or 65"):
        windows_for_frames(dataclasses.replace(request, num_frames=57), options)
    with pytest.raises(ValueError, match="starts with 2 windows or more: num_frames=49 or more"):
        windows_for_frames(dataclasses.replace(request, num_frames=41), options)
    two = resolve_request(GenerationRequest(prompt="a fox", num_frames=49, options=dict(WINDOWS, stages=2)), options)
    with pytest.raises(ValueError, match="stages=2: a live video is made in one stage"):
        first_windows(two, options)


def test_window_images_are_checked():
    """A windowed LTX-Video request's conditions are images its windows start from, at the frames they start (57
    frames in windows (0, 5), (2, 7), (4, 8): frames 0, 9, 25), taken only where cond_strength uses images; a video of
    one window takes conditions anywhere (LTXConditionPipeline's)."""
    from cp_infer.request import GenerationLimits, check_request, resolve_request
    from cp_infer.shapes import VideoGeometry
    from models.ltx_video.options import ltx_video_options

    options = ltx_video_options()
    geometry = VideoGeometry(temporal_compression=8, spatial_compression=32, patch_size=1)

    def check(frames: int, *at: int, **values):
        conditions = tuple(Condition(_image(i), frame_index=f) for i, f in enumerate(at))
        request = GenerationRequest(prompt="a fox", num_frames=frames, height=64, width=224, conditions=conditions,
                                    options=dict(WINDOWS, **values))
        check_request(resolve_request(request, options), geometry=geometry, limits=GenerationLimits(),
                      options=options)

    check(57, 9)  # text-to-video until window 1, which starts from its image
    check(57, 0, 25)
    check(33, 4, 20)  # one window: conditions at any frame
    with pytest.raises(ValueError, match=r"conditions\[1\]\.frame_index=24: .* starts from: 0, 9, 25; give one"):
        check(57, 0, 24)
    with pytest.raises(ValueError, match="at cond_strength=0 .* give cond_strength above 0"):
        check(57, 0, 25, cond_strength=0.0)
