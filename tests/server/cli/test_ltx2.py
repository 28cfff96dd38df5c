"""LTX-2 (audio and video generated together) through the front ends: a real 2-rank ``cp-infer serve --model
tiny-ltx2`` and ``cp-infer generate --model tiny-ltx2`` processes (1 rank, and 2 through torchrun).

Every MP4 must hold one H.264 and one AAC stream: the video ``num_frames / fps`` long, the soundtrack at the
vocoder's 24 kHz, as long as the video to within one AAC frame (1024 samples), and not silent. The server and each
command start once per module (process start-up dominates); the tests share their outputs.

A request without LTX-2 options gets LTX2Pipeline's defaults, with spatio-temporal guidance on the model's last
block where it has fewer than LTX-2's 29 (tiny-ltx2 has two); naming a block the model lacks is a 400.
"""

from __future__ import annotations

import io
import os
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from cp_infer.video_io import read_audio, read_frames_dir, read_mp4, write_mp4
from models.ltx2.default import ensure_default_ltx2_model

from ..conftest import ServerProcess
from .commands import Commands, cli_env

FRAMES, HEIGHT, WIDTH, FPS = 17, 64, 96, 12
SAMPLE_RATE = 24_000  # tiny-ltx2's vocoder output, as LTX-2's
AAC_FRAME = 1024
# Fresh per run, the same for every command of a run (the 2-rank video is compared with the 1-rank one).
SEED = int(np.random.default_rng().integers(0, 2**16))
OPTIONS = {"stg_scale": 1.5, "stg_blocks": [0], "guidance_rescale": 0.5, "audio_guidance_scale": 5.0,
           "modality_scale": 2.0}
GENERATE = ["generate", "--model", "tiny-ltx2", "--prompt", "rain on a tin roof", "--frames", str(FRAMES),
            "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", "2", "--fps", str(FPS), "--seed", str(SEED),
            "--stg", "1.5", "--stg-blocks", "0", "--guidance-rescale", "0.5"]
COMMANDS = {
    "mp4-2": [*GENERATE, "--nproc", "2", "--out", "{out}/two.mp4"],
    "stdout-2": [*GENERATE, "--nproc", "2", "--out", "-"],
    "frames-1": [*GENERATE, "--nproc", "1", "--out", "{out}/one/"],
    "frames-2": [*GENERATE, "--nproc", "2", "--out", "{out}/two/"],
}
# AAC's loss on tiny-ltx2's noise-like soundtrack is 4-7% RMS (measured over seven seeds), and a waveform changed in
# its last bits encodes 3-4% differently (AAC's coding choices flip): two encodes are compared only this loosely.
# Different seeds' soundtracks differ by ~29%, so a wrong or misaligned soundtrack still fails.
AAC_LOSS = 0.15


def body(prompt: str = "a dog barks in a quiet street", **overrides) -> dict:
    return {"prompt": prompt, "num_frames": FRAMES, "size": f"{WIDTH}x{HEIGHT}", "num_inference_steps": 2,
            "fps": FPS, "seed": SEED, **OPTIONS, **overrides}


def check_media(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Asserts the streams, durations and rates of an LTX-2 MP4; returns its frames and waveform."""
    with av.open(os.fspath(path)) as container:
        assert sorted(s.codec_context.name for s in container.streams) == ["aac", "h264"], container.streams
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert video.average_rate == FPS and audio.codec_context.sample_rate == SAMPLE_RATE
        ends = {}
        for packet in container.demux():
            if packet.pts is not None:
                end = (packet.pts + packet.duration) * packet.time_base
                ends[packet.stream.type] = max(ends.get(packet.stream.type, 0), end)
    assert ends["video"] == Fraction(FRAMES, FPS), ends
    frames, fps = read_mp4(path)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == FPS and frames.std() > 1
    waveform, rate = read_audio(path)
    assert rate == SAMPLE_RATE and waveform.shape[0] in (1, 2)
    assert abs(Fraction(waveform.shape[1], rate) - Fraction(FRAMES, FPS)) <= Fraction(AAC_FRAME, rate), waveform.shape
    # Not silence: the tiny vocoder's output has an RMS of ~0.07 (AAC's own noise floor is far below 0.01).
    assert np.sqrt(np.mean(waveform**2)) > 0.01, np.sqrt(np.mean(waveform**2))
    return frames, waveform


def boxes(data: bytes) -> list[bytes]:
    """The MP4's top-level box types; fails unless the boxes cover ``data`` exactly (no stray bytes anywhere)."""
    types, at = [], 0
    while at < len(data):
        size = int.from_bytes(data[at:at + 4], "big")
        assert size >= 8 and at + size <= len(data), f"no MP4 box at byte {at} of {len(data)}: {data[at:at + 16]!r}"
        types.append(data[at + 4:at + 8])
        at += size
    return types


def relative_error(x: np.ndarray, reference: np.ndarray) -> float:
    n = min(x.shape[1], reference.shape[1])
    x, reference = x[:, :n], reference[:, :n]
    return float(np.sqrt(np.mean((x - reference) ** 2) / np.mean(reference**2)))


@pytest.fixture(scope="module")
def ltx2_cache(tmp_path_factory) -> Path:
    """tiny-ltx2, built once here so that the ranks of every process only load it."""
    path = tmp_path_factory.mktemp("ltx2_cache")
    ensure_default_ltx2_model(path)
    return path


def test_job_store_keeps_the_ltx2_options(tmp_path):
    """A queued request comes back from SQLite equal to what was submitted (the block list a tuple again), every
    declared option in the job object."""
    from cp_infer.request import GenerationRequest, resolve_request
    from models.ltx2.options import ltx2_options
    from server.group.jobs import JobStore

    rng = np.random.default_rng()
    blocks = tuple(int(b) for b in rng.integers(0, 48, size=3))
    request = resolve_request(GenerationRequest.of(
        prompt="surf", seed=int(rng.integers(0, 2**31)), stg_scale=float(rng.uniform(0, 3)), stg_blocks=blocks,
        guidance_rescale=0.25), ltx2_options())
    store = JobStore(tmp_path, max_queue=2)
    try:
        job = store.submit(request, model="tiny-ltx2")
        assert store.get(job.id).request == request
        assert store.claim_next(timeout=0).request == request  # what the leader broadcasts
        public = store.get(job.id).public()
        assert public["spatio_temporal_guidance_blocks"] == list(blocks) and public["guidance_rescale"] == 0.25
        assert public["audio_guidance_scale"] == 7.0 and public["num_frames"] == 121  # LTX2Pipeline's defaults
    finally:
        store.close()


# ------------------------------------------------------------------------------------------------------ CLI


@pytest.fixture(scope="module")
def commands(tmp_path_factory, ltx2_cache) -> Commands:
    out = tmp_path_factory.mktemp("out")
    commands = Commands(COMMANDS, env=cli_env(ltx2_cache), cwd=tmp_path_factory.mktemp("cwd"), fields=dict(out=out),
                        text=False, check=True, context=f" (seed {SEED})", timeout=150)
    yield commands
    commands.close()


def output(commands: Commands, key: str) -> Path:
    """The MP4 that command ``key`` wrote (its stdout, saved as a file, for ``stdout-2``)."""
    proc = commands.result(key)
    if key == "stdout-2":
        (commands.out / "stdout.mp4").write_bytes(proc.stdout)
        return commands.out / "stdout.mp4"
    return commands.out / "two.mp4"


@pytest.mark.timeout(300)
def test_generate_mp4_and_stdout_carry_the_soundtrack(commands):
    check_media(output(commands, "mp4-2"))
    assert f"wrote {commands.out / 'two.mp4'} ({FRAMES} frames" in commands.result("mp4-2").stdout.decode()
    types = boxes(commands.result("stdout-2").stdout)  # stdout holds the MP4 and nothing else
    assert types[:2] == [b"ftyp", b"moov"] and b"moof" in types and b"mdat" in types, types[:6]
    check_media(output(commands, "stdout-2"))


@pytest.mark.timeout(300)
def test_generate_frames_folder_writes_audio_wav(commands):
    commands.result("frames-1")
    folder = commands.out / "one"
    frames, fps = read_frames_dir(folder)
    assert frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and fps == FPS
    waveform, rate = read_audio(folder / "audio.wav")
    # The model cuts or pads its soundtrack to the video's duration exactly; a WAV keeps every sample.
    assert rate == SAMPLE_RATE and waveform.shape == (2, FRAMES * SAMPLE_RATE // FPS), waveform.shape
    assert np.sqrt(np.mean(waveform**2)) > 0.01


@pytest.mark.timeout(300)
def test_two_ranks_make_the_one_rank_video(commands):
    """Lossless outputs (PNG frames, 16-bit WAV) of 1 and 2 ranks: Ulysses only reorders float sums."""
    commands.result("frames-1")
    commands.result("frames-2")
    one_frames, _ = read_frames_dir(commands.out / "one")
    two_frames, _ = read_frames_dir(commands.out / "two")
    difference = np.abs(two_frames.astype(np.int16) - one_frames.astype(np.int16))
    assert difference.max() <= 1 and difference.mean() < 0.02, (difference.max(), difference.mean(), SEED)
    one_audio, two_audio = read_audio(commands.out / "one")[0], read_audio(commands.out / "two")[0]
    assert one_audio.shape == two_audio.shape, (one_audio.shape, two_audio.shape)
    assert np.abs(two_audio - one_audio).max() < 1e-3, (np.abs(two_audio - one_audio).max(), SEED)


@pytest.mark.timeout(300)
def test_two_rank_mp4s_carry_the_lossless_video(commands, tmp_path):
    """The MP4 file and the stdout stream of 2 ranks hold what the 2-rank frames folder holds, within the codecs'
    loss (an MP4 is lossy, so the exactness check above is made on the folders)."""
    commands.result("frames-2")
    frames, _ = read_frames_dir(commands.out / "two")
    waveform, _ = read_audio(commands.out / "two")
    # The tiny model's frames are near pixel noise, which yuv420p cannot keep: compare encodes with encodes. Two
    # encodes of one video differ by a few levels on average, two different videos by ~50.
    write_mp4(frames, tmp_path / "reference.mp4", FPS)
    ref_frames = read_mp4(tmp_path / "reference.mp4")[0].astype(np.int16)
    for key in ("mp4-2", "stdout-2"):
        mp4_frames, mp4_audio = check_media(output(commands, key))
        error = np.abs(mp4_frames.astype(np.int16) - ref_frames).mean()
        assert error < 8, (key, error, SEED)
        assert relative_error(mp4_audio, waveform) < AAC_LOSS, (key, relative_error(mp4_audio, waveform), SEED)


# --------------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def ltx2_server(tmp_path_factory, ltx2_cache):
    server = ServerProcess(tmp_path_factory.mktemp("ltx2_server"), ltx2_cache,
                           extra_args=["--model", "tiny-ltx2", "--heartbeat-s", "0.5", "--collective-timeout", "60"])
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def stored_job(ltx2_server, tmp_path_factory) -> dict:
    """One (unstreamed) job with LTX-2 options, run to completion; its MP4 is saved as ``path``."""
    s = ltx2_server
    job = s.submit(body())
    final = s.wait_job(job["id"])
    assert final["status"] == "completed", f"{final}\n{s.log_tail()}"
    content = s.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    path = tmp_path_factory.mktemp("ltx2_job") / "job.mp4"
    path.write_bytes(content.content)
    return {"submitted": job, "final": final, "path": path}


@pytest.mark.timeout(300)
def test_job_echoes_the_ltx2_options(stored_job):
    for job in (stored_job["submitted"], stored_job["final"]):  # as queued, and as read back from SQLite
        declared = {"spatio_temporal_guidance_blocks" if k == "stg_blocks" else k: v for k, v in OPTIONS.items()}
        assert {k: job[k] for k in declared} == declared, job
        # Unset: LTX2Pipeline's defaults, as used.
        assert job["audio_stg_scale"] == 1.0 and job["audio_modality_scale"] == 3.0
        assert job["model"] == "tiny-ltx2" and job["size"] == f"{WIDTH}x{HEIGHT}" and job["num_frames"] == FRAMES


@pytest.mark.timeout(300)
def test_job_content_has_video_and_audio(stored_job):
    check_media(stored_job["path"])


@pytest.mark.timeout(300)
def test_streamed_job_is_a_fragmented_mp4_with_both_streams(ltx2_server, stored_job, tmp_path):
    s = ltx2_server
    with s.client.stream("POST", "/v1/videos", params={"stream": "true"}, json=body(), timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.read()
        job_id = r.headers["x-video-id"]
        data = r.read()
    types = boxes(data)
    assert types[:2] == [b"ftyp", b"moov"] and b"moof" in types and b"mdat" in types, types[:6]
    (tmp_path / "streamed.mp4").write_bytes(data)
    frames, waveform = check_media(tmp_path / "streamed.mp4")
    final = s.client.get(f"/v1/videos/{job_id}").json()
    assert final["status"] == "completed" and final["spatio_temporal_guidance_blocks"] == [0], final
    assert s.client.get(f"/v1/videos/{job_id}/content").content == data  # the same bytes, not just the same video
    # The same request as the stored job (same seed): the same video and sound, within the encoders' noise.
    stored_frames, stored_audio = read_mp4(stored_job["path"])[0], read_audio(stored_job["path"])[0]
    assert np.abs(frames.astype(np.int16) - stored_frames.astype(np.int16)).mean() < 8
    assert relative_error(waveform, stored_audio) < AAC_LOSS
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].codec_context.channels == waveform.shape[0]


@pytest.mark.timeout(300)
def test_a_long_video_streams_with_its_sound_before_its_last_window(ltx2_server, tmp_path):
    """Windows of 72 frames (24 shared, so each makes 6 latent frames final): the MP4's first bytes, both tracks'
    headers and the first frames with their sound, come while a window before the last is being made; the whole
    stream holds the video and a soundtrack as long as it."""
    s = ltx2_server
    frames = 265
    request = body("waves on a pebble beach", num_frames=frames, temporal_tile_size=72, temporal_overlap=24)
    with s.client.stream("POST", "/v1/videos", params={"stream": "true"}, json=request, timeout=240) as r:
        assert r.status_code == 200, r.read()
        job_id = r.headers["x-video-id"]
        chunks = r.iter_raw()
        first = next(chunks)
        at_first_byte = s.client.get(f"/v1/videos/{job_id}").json()
        data = first + b"".join(chunks)
    assert at_first_byte["status"] == "in_progress" and at_first_byte["windows"] >= 5, at_first_byte
    assert at_first_byte["window"] < at_first_byte["windows"] - 1, {k: at_first_byte[k] for k in ("window", "windows")}
    (tmp_path / "long.mp4").write_bytes(data)
    video, fps = read_mp4(tmp_path / "long.mp4")
    waveform, rate = read_audio(tmp_path / "long.mp4")
    assert video.shape == (frames, HEIGHT, WIDTH, 3) and fps == FPS and rate == SAMPLE_RATE
    assert abs(Fraction(waveform.shape[1], rate) - Fraction(frames, FPS)) <= Fraction(AAC_FRAME, rate)
    assert np.sqrt(np.mean(waveform**2)) > 0.01
    assert s.client.get(f"/v1/videos/{job_id}/content").content == data


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides,param,words", [
    ({"size": None, "width": WIDTH, "height": 32}, "height", "at least 64"),
    ({"size": "32x32"}, "size", "at least 64"),
    ({"guidance_rescale": 2.0}, "guidance_rescale", "[0, 1]"),
    ({"stg_blocks": []}, "stg_blocks", "non-empty"),
    ({"audio_stg_scale": -1.0}, "audio_stg_scale", "out of range"),
    ({"stg_blocks": [0, 2]}, "stg_blocks", "stg_blocks[]=2 is out of range; use a value in [0, 1]"),  # 2 blocks
], ids=["height-32", "size-32x32", "guidance-rescale-2", "stg-blocks-empty", "audio-stg-negative",
        "stg-block-missing"])
def test_bad_ltx2_requests_are_400(ltx2_server, overrides, param, words):
    s = ltx2_server
    before = s.metric("cp_infer_requests_broadcast_total")
    r = s.client.post("/v1/videos", json={k: v for k, v in body(**overrides).items() if v is not None})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == param and words in error["message"], error
    assert s.metric("cp_infer_requests_broadcast_total") == before


@pytest.mark.timeout(300)
def test_request_without_ltx2_options_uses_the_defaults(ltx2_server):
    s = ltx2_server
    job = s.submit({k: v for k, v in body().items() if k not in OPTIONS})
    final = s.wait_job(job["id"])
    assert final["status"] == "completed", f"{final}\n{s.log_tail()}"
    # LTX2Pipeline's defaults (the last block where the model has fewer than 29).
    assert final["spatio_temporal_guidance_blocks"] == [1] and final["stg_scale"] == 1.0, final
    assert final["max_sequence_length"] == 1024 and final["audio_guidance_scale"] == 7.0


@pytest.mark.timeout(300)
def test_conditioned_ltx2_jobs_over_http(ltx2_server, stored_job, tmp_path):
    """An LTX-2 server takes media as an LTX-Video one does: ``input_reference`` (LTX2ImageToVideoPipeline) and
    ``conditions`` (LTX2ConditionPipeline, a keyframe at the last frame: extra tokens), with the soundtrack."""
    import base64

    from PIL import Image

    s = ltx2_server
    rng = np.random.default_rng(SEED)
    image = rng.integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
    jobs = [s.submit(body(input_reference=url)),
            s.submit(body(conditions=[{"media": url, "frame_index": -1, "strength": 0.8}]))]
    stored = read_mp4(stored_job["path"])[0]
    for job, kind in zip(jobs, ("image", "conditions"), strict=True):
        final = s.wait_job(job["id"])
        assert final["status"] == "completed", f"{final}\n{s.log_tail()}"
        path = tmp_path / f"{kind}.mp4"
        path.write_bytes(s.client.get(f"/v1/videos/{job['id']}/content").content)
        frames, _ = check_media(path)
        # Same seed and settings as the text-only job: the media changed the video.
        assert np.abs(frames.astype(np.int16) - stored.astype(np.int16)).mean() > 1, kind
    assert s.client.get(f"/v1/videos/{jobs[1]['id']}").json()["conditions"] == [
        {"frame_index": -1, "strength": 0.8, "num_frames": 1}]
