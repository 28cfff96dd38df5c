"""Conditioned LTX-2 on the Ulysses engine: at 1 rank equal to diffusers' ``LTX2ImageToVideoPipeline`` and
``LTX2ConditionPipeline`` (frames, waveform and final latents), at N ranks equal to 1 rank.

Every guidance of the pipelines is on (as ``test_ltx2_parallel``), and the requests alternate between the embedded
LTX-2.0 model and the variant with the other RoPE layout and the LTX-2.3 features (whose prompt modulation reads
the scalar ``sigma`` while the video tokens run at per-token timesteps).

Keyframe tokens (conditions after latent frame 0) follow the video's in the one sharded stream; the shapes give
video + keyframe token counts that do not divide some N at every N = 2, 3, 4 (and 18 audio tokens each):
image-to-video 3*2*5 = 30; images at frames 0, 8 and -1 on 3*3*3: 27 + 9 + 9 = 45; clips at frames 0 and 5 on
3*2*2: 12 + 8 = 20. 128 text tokens (the least LTX-2 takes) keep the text encoder cheap.

Tolerances: at 1 rank our loop runs diffusers' own modules, helpers and guidance arithmetic in the same order, so
frames, waveform and latents are bit-identical. With N ranks matmuls over fewer rows, SDPA over permuted layouts
and the rescale's std from per-shard sums round differently (fp32, ~1e-6 relative), which can flip a rounding to
uint8: frames within 1 level (mean < 0.02), waveform and latents within 1e-4 absolute, as in
``test_ltx2_parallel`` (measured at N = 2, 3, 4 over two seeds: frames max 1, mean <= 5e-5; waveform <= 9e-7;
video latents <= 5e-6, audio latents <= 6e-6).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...worker_groups import groups_by_world
from ..ltx_video.test_conditions import _media
from . import test_parallel as test_ltx2_parallel
from .test_parallel import GUIDANCE, ROPES

groups = groups_by_world()
# rope type -> the embedded LTX-2.0 model and the LTX-2.3-featured variant (a module fixture: built for this module)
folders = test_ltx2_parallel.folders
BASE = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", num_inference_steps=3,
            fps=24, max_sequence_length=128, spatio_temporal_guidance_blocks=(0,), **GUIDANCE)
# Per request: the stream's video + keyframe tokens, and which model runs it (an index into ROPES).
TOKENS = (30, 45, 20)
MODEL = (1, 0, 1)


def _requests(seed: int) -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [
        # image-to-video (LTX2ImageToVideoPipeline), the image at another size and aspect
        GenerationRequest.of(**BASE, num_frames=17, height=64, width=160, seed=seed,
                             image=Condition(_media(rng, 1, 50, 70))),
        # images (LTX2ConditionPipeline): at frame 0 (replaces latent frame 0), at frame 8 (latent frame 1, another
        # size) and at the last frame (latent frame 2): two keyframes of 9 tokens
        GenerationRequest.of(**BASE, num_frames=17, height=96, width=96, seed=seed + 1, conditions=(
            Condition(_media(rng, 1, 96, 96)), Condition(_media(rng, 1, 40, 60), 8, 0.7),
            Condition(_media(rng, 1, 96, 96), -1, 0.5))),
        # a 9-frame clip at frame 0 (replaces latent frames 0 and 1) at 0.6, and one from frame 5 (latent frame 1,
        # whose first frame is 1: a keyframe of two latent frames) at 0.9
        GenerationRequest.of(**BASE, num_frames=17, height=64, width=64, seed=seed + 2, conditions=(
            Condition(_media(rng, 9, 64, 80), 0, 0.6), Condition(_media(rng, 9, 70, 64), 5, 0.9))),
    ]


def _models(state, folders: dict[str, str], frames_per_rank):
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    models = []
    for rope in ROPES:
        model = LTX2Model(load_ltx2(folders[rope]), state=state)
        model.decode_frames_per_rank = frames_per_rank
        models.append(model)
    return models


def _sample_all(state, folders: dict[str, str], seed: int, frames_per_rank=1):
    """Per request: frames, ``{waveform, sample_rate}`` and ``{latents, audio_latents}`` (rank 0; empty
    elsewhere). ``frames_per_rank=1``: the streamed decode in rounds of one latent frame per rank."""
    models = _models(state, folders, frames_per_rank)
    out = []
    for request, m in zip(_requests(seed), MODEL, strict=True):
        audio, latents = {}, {}
        control = SampleControl(on_audio=lambda w, sr, a=audio: a.update(waveform=w, sample_rate=sr),
                                on_latents=latents.update)
        out.append((sample(models[m], request, state=state, control=control), audio, latents))
    return out


def _reference(folder: str, request: GenerationRequest, output_type: str):
    """The diffusers pipeline for ``request`` on ``folder``'s components: (video, audio) as it returns them."""
    from diffusers import LTX2ConditionPipeline, LTX2ImageToVideoPipeline
    from diffusers.pipelines.ltx2 import LTX2VideoCondition

    from models.ltx2.conditions import latent_index
    from models.ltx2.loading import load_ltx2

    c = load_ltx2(folder)
    parts = dict(scheduler=c.scheduler, vae=c.vae, audio_vae=c.audio_vae, text_encoder=c.text_encoder,
                 tokenizer=c.tokenizer, connectors=c.connectors, transformer=c.transformer, vocoder=c.vocoder)
    o = request.options
    common = dict(prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
                  height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
                  frame_rate=request.fps, output_type=output_type, return_dict=False,
                  generator=torch.Generator("cpu").manual_seed(request.seed),
                  max_sequence_length=o["max_sequence_length"],
                  spatio_temporal_guidance_blocks=list(o["spatio_temporal_guidance_blocks"]), **GUIDANCE)
    if request.image is not None:
        pipe = LTX2ImageToVideoPipeline(**parts)
        pipe.set_progress_bar_config(disable=True)
        return pipe(image=Image.fromarray(request.image.frames[0]), **common)
    pipe = LTX2ConditionPipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    # The pipeline's conditions are PIL images (a list for a clip) at latent frame indices.
    conditions = [LTX2VideoCondition(
        frames=Image.fromarray(c.frames[0]) if c.is_image else [Image.fromarray(f) for f in c.frames],
        index=latent_index(c.frame_index, request.num_frames, pipe.vae_temporal_compression_ratio),
        strength=c.strength) for c in request.conditions]
    return pipe(conditions=conditions, **common)


def test_latent_index():
    """Output frames to LTX2ConditionPipeline's latent frames: the latent frame that encodes the output frame."""
    from models.ltx2.conditions import latent_index

    assert [latent_index(f, 25, 8) for f in (0, 1, 5, 8, 9, 12, 16, 17, 24, -1, -8, -9, -25)] == \
        [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 2, 0]


def test_conditions_are_tokens_of_the_video_stream(folders):
    """The stream holds the video's tokens then the keyframes', each at its strength; image-to-video keeps its first
    latent frame clean."""
    from cp_infer import single_process_state
    from cp_infer.request import resolve_request

    models = _models(single_process_state(), folders, None)
    strengths = ([1.0] * 10 + [0.0] * 20, [1.0] * 9 + [0.0] * 18 + [0.7] * 9 + [0.5] * 9,
                 [0.6] * 8 + [0.0] * 4 + [0.9] * 8)
    for request, m, tokens, expected in zip(_requests(random.randrange(2**31)), MODEL, TOKENS, strengths,
                                            strict=True):
        model = models[m]
        request = resolve_request(request, model.options)
        shape = model.geometry.latent_shape(request.num_frames, request.height, request.width)
        prepared = model.prepare(request, shape)
        conditioning = prepared.state.conditioning
        assert prepared.latents["video"].shape[1] == tokens == prepared.state.coords["video"].shape[2]
        assert conditioning.video_tokens == shape.tokens
        torch.testing.assert_close(conditioning.mask[0], torch.tensor(expected), rtol=0, atol=0)


@pytest.fixture(scope="module")
def one_rank(folders):
    """Ours at 1 rank (one decode round, as the pipelines decode): the 1-rank reference of the N-rank test too."""
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, _sample_all(single_process_state(), folders, seed, frames_per_rank=None)


def test_one_rank_equals_diffusers_conditioned_pipelines(folders, one_rank):
    seed, ours = one_rank
    for request, m, (frames, audio, latents) in zip(_requests(seed), MODEL, ours, strict=True):
        folder = folders[ROPES[m]]
        video, ref_audio = _reference(folder, request, "np")
        ref8 = (np.clip(video[0], 0, 1) * 255).round().astype(np.uint8)
        what = f"seed={seed} model={ROPES[m]} shape={frames.shape}"
        assert frames.shape == (request.num_frames, request.height, request.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref8, err_msg=what)
        ref_audio = ref_audio[0].float().numpy()
        assert np.abs(ref_audio).max() > 1e-3, "silent soundtrack: the comparison would prove nothing"
        np.testing.assert_array_equal(audio["waveform"][:, :ref_audio.shape[1]], ref_audio, err_msg=what)
        ref_latents, ref_audio_latents = _reference(folder, request, "latent")
        np.testing.assert_array_equal(latents["latents"], ref_latents.float().numpy(), err_msg=what)
        np.testing.assert_array_equal(latents["audio_latents"], ref_audio_latents.float().numpy(), err_msg=what)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_n_ranks_equal_one_rank(folders, one_rank, groups, world):
    seed, expected = one_rank
    results = groups(world).run(_sample_all, folders, seed, timeout=600)
    assert all(frames is None and not audio and not latents
               for rank in results[1:] for frames, audio, latents in rank), "only group rank 0 returns outputs"
    for (exp, exp_audio, exp_latents), (got, got_audio, got_latents), m in zip(expected, results[0], MODEL,
                                                                               strict=True):
        what = f"world={world} model={ROPES[m]} seed={seed} shape={exp.shape}"
        assert got.shape == exp.shape
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.02, f"{what}: max {diff.max()} mean {diff.mean()}"
        np.testing.assert_allclose(got_audio["waveform"], exp_audio["waveform"], rtol=0, atol=1e-4, err_msg=what)
        for name in ("latents", "audio_latents"):
            np.testing.assert_allclose(got_latents[name], exp_latents[name], rtol=0, atol=1e-4, err_msg=what)
