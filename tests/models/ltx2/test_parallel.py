"""LTX-2 (video and audio together) sampled with the Ulysses engine: 1 rank equals diffusers' own LTX2Pipeline,
N ranks equal 1 rank, for both RoPE layouts ("interleaved" and "split").

Every guidance of the pipeline is on (CFG, spatio-temporal guidance on block 0, modality isolation, CFG rescale),
so every code path of the sharded step runs: the perturbed self-attention, the passes without cross-modal
attention and the group-wide standard deviation of the rescale.

Shapes: the video and audio token counts (in brackets) do not divide N for some shape at every N = 2, 3, 4:
(9, 64, 96) -> video 2*2*3=12, audio 9 tokens; (17, 64, 160) -> video 3*2*5=30, audio 18 tokens (at 24 fps).

Tolerances: at 1 rank our loop runs diffusers' own modules and the pipeline's own guidance arithmetic in the same
order, so frames are bit-identical and the waveform equal to float rounding. With N ranks matmuls over fewer rows,
SDPA over permuted layouts and the rescale's std from per-shard sums round differently (fp32, ~1e-6 relative),
which can flip a rounding to uint8: frames within 1 level (mean < 0.02), waveform within 1e-4 absolute.
"""

import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ...harness import one_thread
from ...worker_groups import SharedGroup

SHAPES = [(9, 64, 96), (17, 64, 160)]
ROPES = ("interleaved", "split")
GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """rope type -> a saved tiny LTX-2 folder: the embedded default (LTX-2.0), and a variant with the other RoPE
    layout and the LTX-2.3 attention features (perturbed self-attention for STG, per-head gates, cross-attention
    modulation), so both kinds of processor path run sharded."""
    from models.ltx2.default import ensure_default_ltx2_model, save_ltx2_model

    root = tmp_path_factory.mktemp("ltx2")
    default = ensure_default_ltx2_model(root / "cache")
    from diffusers import LTX2VideoTransformer3DModel

    default_rope = LTX2VideoTransformer3DModel.load_config(default, subfolder="transformer")["rope_type"]
    other = next(r for r in ROPES if r != default_rope)
    variant = save_ltx2_model(root / other, rope_type=other, perturbed_attn=True, gated_attn=True,
                              audio_gated_attn=True, cross_attn_mod=True, audio_cross_attn_mod=True)
    return {default_rope: str(default), other: str(variant)}


def _text_tokens(r: GenerationRequest) -> dict:
    """The request's text length for LTX2Pipeline; unset: the pipeline's own default (ours must match it)."""
    text_tokens = r.options.get("max_sequence_length")
    return {} if text_tokens is None else {"max_sequence_length": text_tokens}


def _requests(seed):
    return [GenerationRequest.of(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry",
                              num_frames=f, height=h, width=w, num_inference_steps=3, seed=seed + i, fps=24,
                              spatio_temporal_guidance_blocks=(0,), **GUIDANCE)
            for i, (f, h, w) in enumerate(SHAPES)]


def _load(state, folder, frames_per_rank=2):
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = frames_per_rank
    return model


def _sample_av(model, request, state):
    audio = {}
    frames = sample(model, request, state=state,
                    control=SampleControl(on_audio=lambda w, sr: audio.update(waveform=w, sample_rate=sr)))
    return frames, audio


def _sample_all(state, folder, seed, frames_per_rank=1):
    """``frames_per_rank=1``: the streamed decode in rounds of one latent frame per rank (several rounds here)."""
    model = _load(state, folder, frames_per_rank)
    return [_sample_av(model, r, state) for r in _requests(seed)]


@pytest.mark.parametrize("rope", ROPES)
def test_one_rank_equals_ltx2_pipeline(folders, rope):
    from diffusers import LTX2Pipeline

    from cp_infer import single_process_state
    from models.ltx2.loading import load_ltx2

    seed = random.randrange(2**31)
    # One decode round, as LTX2Pipeline decodes: bit-identical (rounds change only the summation order).
    ours = _sample_all(single_process_state(), folders[rope], seed, frames_per_rank=None)
    c = load_ltx2(folders[rope])
    pipe = LTX2Pipeline(scheduler=c.scheduler, vae=c.vae, audio_vae=c.audio_vae, text_encoder=c.text_encoder,
                        tokenizer=c.tokenizer, connectors=c.connectors, transformer=c.transformer, vocoder=c.vocoder)
    pipe.set_progress_bar_config(disable=True)
    for r, (frames, audio) in zip(_requests(seed), ours, strict=True):
        ref = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, height=r.height,
                   width=r.width, num_inference_steps=r.num_inference_steps, frame_rate=r.fps,
                   spatio_temporal_guidance_blocks=list(r.options["spatio_temporal_guidance_blocks"]),
                   **_text_tokens(r),
                   generator=torch.Generator("cpu").manual_seed(r.seed), output_type="np", **GUIDANCE)
        ref8 = (np.clip(ref.frames[0], 0, 1) * 255).round().astype(np.uint8)
        assert frames.shape == (r.num_frames, r.height, r.width, 3)
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref8, err_msg=f"seed={seed} shape={frames.shape}")
        ref_audio = ref.audio[0].float().numpy()
        sample_rate = c.vocoder.config.output_sampling_rate
        assert audio["sample_rate"] == sample_rate
        # The soundtrack lasts exactly as long as the video: the vocoder's output, then silence (fit_duration).
        samples = round(r.num_frames / r.fps * sample_rate)
        assert audio["waveform"].shape == (ref_audio.shape[0], samples)
        assert 0 < samples - ref_audio.shape[1] < 0.1 * sample_rate
        assert np.abs(ref_audio).max() > 1e-3, "silent soundtrack: the comparison would prove nothing"
        np.testing.assert_allclose(audio["waveform"][:, :ref_audio.shape[1]], ref_audio, rtol=0, atol=1e-6,
                                   err_msg=f"seed={seed}")
        assert not audio["waveform"][:, ref_audio.shape[1]:].any()


@pytest.fixture(scope="module")
def one_rank(folders):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(lambda: {rope: _sample_all(single_process_state(), folders[rope], seed)
                                     for rope in ROPES})


@pytest.mark.parametrize("world", [2, 3, 4])
def test_n_ranks_equal_one_rank(folders, one_rank, world):
    seed, expected = one_rank
    group = SharedGroup(world)
    results = {rope: group.run(_sample_all, folders[rope], seed, timeout=600) for rope in ROPES}
    for rope in ROPES:
        assert all(frames is None and not audio for rank in results[rope][1:] for frames, audio in rank), \
            "only group rank 0 returns frames and audio"
        for (exp, exp_audio), (got, got_audio) in zip(expected[rope], results[rope][0], strict=True):
            assert got.shape == exp.shape
            diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
            assert diff.max() <= 1 and diff.mean() < 0.02, \
                f"world={world} rope={rope} seed={seed} shape={exp.shape}: max {diff.max()} mean {diff.mean()}"
            assert got_audio["sample_rate"] == exp_audio["sample_rate"]
            np.testing.assert_allclose(got_audio["waveform"], exp_audio["waveform"], rtol=0, atol=1e-4,
                                       err_msg=f"world={world} rope={rope} seed={seed}")


def _sample_first(state, folder, seed):
    """The first request only (video 12 tokens, audio 9: neither divides 2), streamed decode as ``_sample_all``."""
    model = _load(state, folder, 1)
    return [_sample_av(model, _requests(seed)[0], state)]


def test_ring_of_two_equals_one_rank(folders, one_rank):
    """R=2 x U=1: both self-attentions (video, audio) and both cross-modal attentions (each stream's queries over
    the other's keys, ``kv_plan``) pass their key/value blocks round the ring; the last audio block holds 4 real
    keys of 5."""
    seed, expected = one_rank
    group = SharedGroup(2, ring=2)
    results = {rope: group.run(_sample_first, folders[rope], seed, timeout=600) for rope in ROPES}
    for rope in ROPES:
        (exp, exp_audio), ((got, got_audio),) = expected[rope][0], results[rope][0]
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.02, f"rope={rope} seed={seed}: max {diff.max()} mean {diff.mean()}"
        np.testing.assert_allclose(got_audio["waveform"], exp_audio["waveform"], rtol=0, atol=1e-4,
                                   err_msg=f"R=2 rope={rope} seed={seed}")
