"""Long LTX-2 (video and soundtrack) window by window (``models.ltx2.windows``): N = 2, 3 equal 1 rank; the
soundtrack runs on across the seams (no gap, no click); a job resumed from a checkpoint equals the whole run; streamed
(``SampleControl.on_audio_piece``), frames and sound reach the MP4 writer while later windows are made, and the MP4
carries the soundtrack of the whole-at-once decode.

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
from cp_infer.stream import FragmentedMP4Writer

from ...harness import one_thread
from ...worker_groups import groups_by_world

groups = groups_by_world()

GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.5)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from models.ltx2.default import ensure_default_ltx2_model

    return str(ensure_default_ltx2_model(tmp_path_factory.mktemp("ltx2")))


def _request(seed: int, frames: int = 137) -> GenerationRequest:
    return GenerationRequest.of(prompt="waves on a beach | a storm comes | rain", negative_prompt="silence",
                                num_frames=frames, height=64, width=96, num_inference_steps=3, seed=seed, fps=24,
                                temporal_tile_size=48, temporal_overlap=24, **GUIDANCE)


def _run(state, folder: str, seed: int, resume=None):
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

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
    from models.ltx2.windows import audio_start

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
    # padded with silence as for any LTX-2 video: ``models.ltx2.adapter.fit_duration``)
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


def _streamed(state, folder: str, seed: int):
    """The streaming path (``collect=False``): rank 0 hands each piece of the soundtrack and each run of frames to a
    fragmented MP4 writer as it comes; the events are logged in order, with the writer's bytes so far."""
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = 2
    request = _request(seed)
    chunks: list[bytes] = []
    out: dict = {"events": [], "audio": [], "frames": [], "writer": None}

    def on_audio_piece(samples, first, rate):
        if out["writer"] is None:
            out["writer"] = FragmentedMP4Writer(chunks.append, width=request.width, height=request.height,
                                                fps=request.fps, audio_channels=samples.shape[0], sample_rate=rate)
        out["writer"].write_audio(samples)
        out["audio"].append(samples)
        out["events"].append(("audio", first, samples.shape[1]))

    def on_frames(frames, first, _total):
        out["writer"].write(frames)
        out["frames"].append(frames)
        out["events"].append(("frames", first, frames.shape[0]))

    def on_pass(index, plan):
        out["events"].append(("pass", index, len(b"".join(chunks))))

    control = SampleControl(on_audio_piece=on_audio_piece, on_frames=on_frames, on_pass=on_pass, collect=False)
    assert sample(model, request, state=state, control=control) is None
    if not state.delivers:
        return None
    out["writer"].close()
    last = max(i for i, e in enumerate(out["events"]) if e[0] == "pass")
    return {"events": out["events"], "last_pass": last, "mp4": b"".join(chunks),
            "audio": np.concatenate(out["audio"], 1), "frames": np.concatenate(out["frames"])}


def _mp4_media(data: bytes, upto: int | None = None) -> set[str]:
    """The kinds of the packets in an MP4's first ``upto`` bytes (all of them: ``None``)."""
    import io

    import av

    with av.open(io.BytesIO(data[:upto])) as container:
        return {packet.stream.type for packet in container.demux() if packet.size}


@pytest.mark.parametrize("world", [1, 2])
def test_streamed_with_its_sound_while_later_windows_are_made(folder, one_rank, groups, tmp_path, world):
    """Order, not timing: before the last window starts, the soundtrack's pieces and frames have been handed to the
    writer and its bytes so far hold both; the pieces come in order, each before the frames of its window. The
    frames and the pieces' waveform equal the whole-at-once run's (1 rank, ``on_audio``); the progressive vocoding
    differs from decoding the whole soundtrack at once by float rounding only (measured: 3e-7 of a peak of 0.27, so no
    seam can click), and the MP4's soundtrack is as true to it as the one the whole waveform gives (AAC's decisions
    react to that rounding, so the two MP4s are not bit-equal; fed the same samples, they are:
    ``tests/cp_infer/test_audio_mux``)."""
    from cp_infer.video_io import read_audio, read_mp4

    seed, expected = one_rank
    from cp_infer import single_process_state

    got = (one_thread(_streamed, single_process_state(), folder, seed) if world == 1
           else groups(world).run(_streamed, folder, seed, timeout=600)[0])
    events, last = got["events"], got["last_pass"]
    assert events[last][:2] == ("pass", 4)
    before = events[:last]
    assert {e[0] for e in before} == {"pass", "audio", "frames"}, before
    assert events[last][2] > 0 and _mp4_media(got["mp4"], events[last][2]) == {"audio", "video"}
    audio = [e for e in events if e[0] == "audio"]
    assert [e[1] for e in audio] == list(np.cumsum([0] + [e[2] for e in audio])[:-1])
    # Each window's piece comes right after its pass, before that window's frames.
    assert all(events[i + 1][0] == "audio" for i, e in enumerate(events) if e[0] == "pass" and i > 0)

    diff = np.abs(got["frames"].astype(np.int16) - expected["frames"].astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.02, f"world={world} seed={seed}: max {diff.max()}"
    np.testing.assert_allclose(got["audio"], expected["audio"], rtol=0, atol=1e-4)
    # No click where the pieces meet: the largest jump at a piece's first sample is no larger than elsewhere.
    wave = got["audio"].mean(axis=0)
    jumps = np.abs(np.diff(wave))
    edges = np.cumsum([e[2] for e in audio])[:-1] - 1
    assert jumps[edges].max() <= jumps.max() and jumps[edges].max() <= 1.25 * np.delete(jumps, edges).max()

    (tmp_path / "streamed.mp4").write_bytes(got["mp4"])
    whole: list[bytes] = []
    writer = FragmentedMP4Writer(whole.append, width=96, height=64, fps=24, audio=expected["audio"],
                                 sample_rate=expected["rate"])
    writer.write(expected["frames"])
    writer.close()
    (tmp_path / "whole.mp4").write_bytes(b"".join(whole))
    streamed_audio, rate = read_audio(tmp_path / "streamed.mp4")
    whole_audio, _ = read_audio(tmp_path / "whole.mp4")
    assert rate == expected["rate"] and streamed_audio.shape == whole_audio.shape == expected["audio"].shape
    def rms(x):
        return float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))

    # AAC's own error (measured RMS 0.004-0.0052 of a signal of 0.12, in either MP4, over random seeds) flips on
    # input changes of 3e-7 here and there, so the two MP4s differ by 0.3-0.55 of it: the streamed MP4 is as true to
    # the soundtrack as the whole one, and the two differ by no more than that error (a wrong or shifted soundtrack
    # would differ by about the signal itself, some 25 times more).
    coding = rms(whole_audio - expected["audio"])
    assert coding < 0.1 * rms(expected["audio"])
    assert abs(rms(streamed_audio - expected["audio"]) - coding) <= 0.15 * coding
    assert rms(streamed_audio - whole_audio) <= coding
    assert read_mp4(tmp_path / "streamed.mp4")[0].shape == expected["frames"].shape


def test_resume_from_a_checkpoint_equals_the_whole_run(folder, one_rank):
    from cp_infer import single_process_state

    seed, expected = one_rank
    resumed = one_thread(_run, single_process_state(), folder, seed, resume=(3, expected["checkpoints"][3]))
    assert resumed["passes"] == [3, 4]
    np.testing.assert_array_equal(resumed["frames"], expected["frames"])
    np.testing.assert_array_equal(resumed["audio"], expected["audio"])


def _two_stage(state, folder: str, seed: int, resume=None):
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

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
    from models.ltx2.stages import REFINE_SIGMAS

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


def test_a_live_video_equals_the_one_request_video(folder):
    """A live LTX-2 video of two whole windows, directed with waits between, makes the latents of both streams and
    the frames of the one request with the same prompt_segments, bit for bit; its soundtrack streams as the windows
    make it final (before the video grows), equal to the one request's within 1e-6 (when the video grows, the
    soundtrack made so far is decoded again for the longer video in other pieces, so the vocoder sums in another
    order; the samples already delivered are not delivered twice)."""
    from cp_infer import single_process_state
    from cp_infer.live import WAIT, Direction, live_request
    from cp_infer.request import resolve_request
    from models.ltx2.adapter import LTX2Model
    from models.ltx2.loading import load_ltx2

    seed = random.randrange(2**31)
    state = single_process_state()
    model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = 2
    base = resolve_request(GenerationRequest.of(
        prompt="waves on a beach", negative_prompt="silence", num_frames=65, height=64, width=96,
        num_inference_steps=2, seed=seed, fps=24, temporal_tile_size=48, temporal_overlap=24, guidance_scale=3.0),
        model.options)
    directions = [Direction(base.prompt, 2), Direction("a storm comes", 2), Direction("rain", 1)]
    whole = live_request(base, directions, model.options)
    assert whole.num_frames == 137, whole

    def run(request, out, **live):
        control = SampleControl(on_latents=out.update, on_audio_piece=lambda s, first, sr: out["audio"].append(s),
                                on_frames=lambda f, first, total: out["frames"].append(first), **live)
        return one_thread(sample, model, request, state=state, control=control)

    expected: dict = {"audio": [], "frames": []}
    expected_frames = run(whole, expected)
    answers = [WAIT, *(live_request(base, directions[:k], model.options) for k in (2, 3)), WAIT, None]
    got: dict = {"audio": [], "frames": []}
    heard = []

    def extend(done, request):
        heard.append(len(got["audio"]))
        return answers.pop(0)

    frames = run(live_request(base, directions[:1], model.options), got, live=True, extend=extend)
    assert not answers and heard[0] == 1, heard  # the first window's sound went out before the video grew
    for name in ("latents", "audio_latents"):
        np.testing.assert_array_equal(got[name], expected[name], err_msg=f"seed={seed} {name}")
    np.testing.assert_array_equal(frames, expected_frames, err_msg=f"seed={seed}")
    assert got["frames"] == sorted(set(got["frames"]))
    wave, expected_wave = np.concatenate(got["audio"], axis=1), np.concatenate(expected["audio"], axis=1)
    assert wave.shape == expected_wave.shape and np.abs(expected_wave).max() > 1e-3
    np.testing.assert_allclose(wave, expected_wave, rtol=0, atol=1e-6, err_msg=f"seed={seed}")


@pytest.mark.parametrize("frames", [49, 57, 65])
def test_a_long_video_takes_no_media(frames):
    """LTX-2's windows are text only: an image or conditions for a video of more than one window is refused at the
    front end, 57 frames included (windows of 40 sharing 24, whose longest pass, a window and the tail before it,
    is as long as the video)."""
    from cp_infer.request import Condition, GenerationLimits, check_request, resolve_request
    from cp_infer.shapes import VideoGeometry
    from models.ltx2.options import ltx2_options

    options = ltx2_options()
    geometry = VideoGeometry(temporal_compression=8, spatial_compression=32, patch_size=1)
    pixels = np.zeros((1, 8, 8, 3), dtype=np.uint8)
    for media, words in ((dict(image=Condition(pixels)), "image: LTX-2 models make a video longer than one window"),
                         (dict(conditions=(Condition(pixels),)), "conditions: a video longer than one window")):
        request = resolve_request(GenerationRequest(prompt="a", num_frames=frames, height=64, width=256, **media,
                                                    options=dict(temporal_tile_size=40, temporal_overlap=24,
                                                                 stages=1)), options)
        with pytest.raises(ValueError, match=words):
            check_request(request, geometry=geometry, limits=GenerationLimits(), options=options)
