"""Long LTX-2 (video and soundtrack) window by window (``models.ltx2_windows``): N = 2, 3 equal 1 rank; the
soundtrack runs on across the seams (no gap, no click); a job resumed from a checkpoint equals the whole run.

diffusers has no long LTX-2 pipeline to compare with; the windows are the LTX-Video pipeline's
(``test_ltx_video_windows`` checks those against it). Shapes: 64x96 is 2 x 3 = 6 tokens a latent frame; windows of
6 latent frames (36 video tokens) and about 43 audio tokens, which 4 of the 5 windows' counts do not divide by 3.
Tolerances as ``test_ltx2_parallel`` (fp32 summation order): frames within 1 level (mean < 0.02), waveform and
latents 1e-4.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ..harness import one_thread
from ..worker_groups import groups_by_world

groups = groups_by_world()

GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from models.default_ltx2 import ensure_default_ltx2_model

    return str(ensure_default_ltx2_model(tmp_path_factory.mktemp("ltx2")))


def _request(seed: int, frames: int = 137) -> GenerationRequest:
    return GenerationRequest.of(prompt="waves on a beach | a storm comes | rain", negative_prompt="silence",
                                num_frames=frames, height=64, width=96, num_inference_steps=3, seed=seed, fps=24,
                                temporal_tile_size=48, temporal_overlap=24, **GUIDANCE)


def _run(state, folder: str, seed: int, resume=None):
    from models.loading import load_ltx2
    from models.ltx2 import LTX2Model

    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = 2
    out: dict = {"passes": [], "checkpoints": {}}
    control = SampleControl(on_latents=out.update, on_audio=lambda w, sr: out.update(audio=w, rate=sr),
                            on_pass=lambda i, plan: out["passes"].append(plan.passes[i].window),
                            on_checkpoint=lambda i, arrays: out["checkpoints"].update({i: arrays}), resume=resume)
    out["frames"] = sample(model, _request(seed), state=state, control=control)
    return out


@pytest.fixture(scope="module")
def one_rank(folder):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, one_thread(_run, single_process_state(), folder, seed)


def test_a_long_video_with_its_soundtrack(one_rank):
    """5 windows; the video and the soundtrack have the whole request's length."""
    _, out = one_rank
    assert out["passes"] == [0, 1, 2, 3, 4]
    assert out["frames"].shape == (137, 64, 96, 3) and out["frames"].std() > 5
    assert out["latents"].shape[2] == 18 and out["audio_latents"].shape[2] == round(137 / 24 * 25)
    assert out["audio"].shape[1] == round(137 / 24 * out["rate"])
    assert sorted(out["checkpoints"]) == [1, 2, 3, 4]


def test_the_soundtrack_runs_on_across_the_seams(one_rank):
    """The largest sample-to-sample jump at a seam (either end of the audio a window shares with the soundtrack made
    before it, where the crossfade starts and ends) is within 1.25x of the largest anywhere else: no click (measured
    on this model: about 1x); and there is no silent gap. The soundtrack is not silent."""
    from models.ltx2_windows import audio_start

    _, out = one_rank
    wave = out["audio"].mean(axis=0)
    assert np.abs(wave).max() > 1e-3, "a silent soundtrack would prove nothing"
    jumps = np.abs(np.diff(wave))
    samples_per_latent = len(wave) / out["audio_latents"].shape[2]

    class _Model:  # the audio timing of the embedded default's pipeline (25 audio latents a second)
        geometry = type("G", (), {"temporal_compression": 8})

        @staticmethod
        def audio_latent_frames(request):
            return round(request.num_frames / float(request.fps) * 25)

    starts = [audio_start(_Model, _request(0), s) for s in (3, 6, 9, 12)]
    near = np.zeros(len(jumps), dtype=bool)
    shared = round(3 * 8 / 24 * 25)  # the audio latents of the 3 latent frames a window shares with the one before
    for a in starts:
        for edge in (a, a + shared):
            centre = int(edge * samples_per_latent)
            near[max(centre - int(samples_per_latent), 0):centre + int(samples_per_latent)] = True
    assert near.any() and (~near).any()
    assert jumps[near].max() <= 1.25 * jumps[~near].max(), (jumps[near].max(), jumps[~near].max())
    # no gap: no 10 ms of silence before the end (the last few tenths of a second are the vocoder's shortfall,
    # padded with silence as for any LTX-2 video: ``models.ltx2.fit_duration``)
    quiet = np.abs(wave[:-out["rate"] // 2]) < 1e-6
    assert not any(quiet[i:i + 240].all() for i in range(0, len(quiet) - 240, 120))


@pytest.mark.parametrize("world", [2, 3])
def test_n_ranks_equal_one_rank(folder, one_rank, groups, world):
    seed, expected = one_rank
    got = groups(world).run(_run, folder, seed, timeout=600)[0]
    diff = np.abs(got["frames"].astype(np.int16) - expected["frames"].astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.02, f"world={world} seed={seed}: max {diff.max()}"
    np.testing.assert_allclose(got["audio"], expected["audio"], rtol=0, atol=1e-4)
    for name in ("latents", "audio_latents"):
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-4)


def test_resume_from_a_checkpoint_equals_the_whole_run(folder, one_rank):
    from cp_infer import single_process_state

    seed, expected = one_rank
    resumed = one_thread(_run, single_process_state(), folder, seed, resume=(3, expected["checkpoints"][3]))
    assert resumed["passes"] == [3, 4]
    np.testing.assert_array_equal(resumed["frames"], expected["frames"])
    np.testing.assert_array_equal(resumed["audio"], expected["audio"])


def _two_stage(state, folder: str, seed: int, resume=None):
    from models.loading import load_ltx2
    from models.ltx2 import LTX2Model

    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = 2
    request = GenerationRequest.of(prompt="waves on a beach | a storm comes", negative_prompt="silence",
                                   num_frames=73, height=128, width=128, num_inference_steps=3, seed=seed, fps=24,
                                   temporal_tile_size=48, temporal_overlap=24, stages=2, **GUIDANCE)
    out: dict = {"passes": [], "checkpoints": {}}
    control = SampleControl(on_latents=out.update, on_audio=lambda w, sr: out.update(audio=w),
                            on_pass=lambda i, plan: out["passes"].append((plan.passes[i].kind, plan.passes[i].steps)),
                            on_checkpoint=lambda i, arrays: out["checkpoints"].update({i: arrays}), resume=resume)
    out["frames"] = sample(model, request, state=state, control=control)
    return out


def test_two_stages_over_the_windows(folder, groups):
    """stages=2 longer than a window: stage 1 window by window at half the size, one upsample of its whole video,
    stage 2 over the windows at full size with the distilled sigmas and no guidance; N=2 equals 1 rank, and a job
    resumed in either stage equals the whole run."""
    from cp_infer import single_process_state
    from models.ltx2_stages import REFINE_SIGMAS

    seed = random.randrange(2**31)
    one = one_thread(_two_stage, single_process_state(), folder, seed)
    assert one["passes"] == [("stage1_window", 3)] * 3 + [("refine_window", len(REFINE_SIGMAS))] * 3
    assert one["frames"].shape == (73, 128, 128, 3) and one["frames"].std() > 5
    assert one["latents"].shape[2:] == (10, 4, 4) and one["checkpoints"][3]["video"].shape[3:] == (2, 2)
    two = groups(2).run(_two_stage, folder, seed, timeout=600)[0]
    diff = np.abs(two["frames"].astype(np.int16) - one["frames"].astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.02
    np.testing.assert_allclose(two["audio"], one["audio"], rtol=0, atol=1e-4)
    for done in (2, 3, 4):
        resumed = one_thread(_two_stage, single_process_state(), folder, seed, resume=(done, one["checkpoints"][done]))
        np.testing.assert_array_equal(resumed["frames"], one["frames"], err_msg=f"resumed after pass {done}")
        np.testing.assert_array_equal(resumed["audio"], one["audio"])
