"""Audio in the outputs: an AAC track in whole-file and fragmented MP4s (in sync, as long as the waveform, at the
right pitch), whole or given piece by piece as it is made (the same AAC as the whole), a WAV in frames folders, and
clear errors for bad waveforms. PyAV reads everything back (no ffprobe).
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np
import pytest

from cp_infer.stream import FragmentedMP4Writer
from cp_infer.video_io import MP4FileWriter, read_audio, read_frames_dir, read_mp4, write_mp4, write_output

pytestmark = pytest.mark.timeout(60)

AAC_FRAME = 1024
"""AAC-LC's frame, and also the native encoder's priming delay: the slack allowed on a track's duration."""


def _frames(rng: np.random.Generator, num_frames: int, height: int = 64, width: int = 96) -> np.ndarray:
    # Smooth moving gradients: cheap to encode, and they survive 4:2:0 chroma subsampling.
    y, x = np.mgrid[0:height, 0:width] / max(height, width)
    phase = rng.uniform(0, 6, size=3)
    return np.stack([np.stack([127 + 120 * np.sin(4 * x + 3 * y + phase[c] + 0.2 * i) for c in range(3)], axis=-1)
                     for i in range(num_frames)]).astype(np.uint8)


def _tones(rng: np.random.Generator, channels: int, num_samples: int, sample_rate: int) -> tuple[np.ndarray, list]:
    """A different random tone per channel (so a channel swap shows), plus a quieter chirp, which unlike a tone
    correlates with itself at one lag only (so an offset shows)."""
    t = np.arange(num_samples) / sample_rate
    freqs = [float(f) for f in rng.uniform(300, 3000, size=channels)]
    chirp = np.sin(2 * np.pi * (100 * t + 2000 * t**2))
    wave = np.stack([0.5 * np.sin(2 * np.pi * f * t + rng.uniform(0, 6)) + 0.3 * chirp for f in freqs])
    return wave, freqs


def _dominant_hz(channel: np.ndarray, sample_rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(channel * np.hanning(channel.size)))
    return float(np.fft.rfftfreq(channel.size, 1 / sample_rate)[np.argmax(spectrum)])


def _lag(decoded: np.ndarray, reference: np.ndarray, max_lag: int = 2 * AAC_FRAME) -> int:
    """The shift (in samples) of ``decoded`` against ``reference`` that correlates best, by FFT."""
    n = decoded.size + reference.size
    xcorr = np.fft.irfft(np.fft.rfft(decoded, n) * np.conj(np.fft.rfft(reference, n)), n)
    lags = np.r_[0:max_lag + 1, -max_lag:0]
    return int(lags[np.argmax(xcorr[lags])])


def _check_audio_matches(decoded: np.ndarray, wave: np.ndarray, freqs: list, sample_rate: int) -> None:
    assert decoded.shape == wave.shape and decoded.dtype == np.float32
    for channel, ref, freq in zip(decoded, wave, freqs, strict=True):
        assert abs(_dominant_hz(channel, sample_rate) - freq) <= 10, (_dominant_hz(channel, sample_rate), freq)
        assert _lag(channel, ref) == 0, "audio is shifted against the video clock"
        # Lossy, but the same waveform: AAC at this rate keeps tones within a few percent.
        assert np.corrcoef(channel, ref)[0, 1] > 0.98


def _check_streams(container, *, channels: int, sample_rate: int, num_samples: int, num_frames: int, fps) -> None:
    assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
    video, audio = container.streams.video[0], container.streams.audio[0]
    assert video.codec_context.name == "h264" and audio.codec_context.name == "aac"
    assert (audio.codec_context.channels, audio.codec_context.sample_rate) == (channels, sample_rate)
    assert video.duration * video.time_base == Fraction(num_frames) / Fraction(fps)
    # A whole file's edit list hides the priming (its duration is rounded to the movie's ms clock); a fragmented
    # file's stream duration counts it.
    error = abs(audio.duration * audio.time_base - Fraction(num_samples, sample_rate))
    assert error <= Fraction(2 * AAC_FRAME, sample_rate), float(error)


@pytest.mark.parametrize(("channels", "sample_rate", "mono_1d"),
                         [(1, 24000, True), (2, 24000, False), (2, 48000, False)])
def test_mp4_audio_track_in_sync_and_at_pitch(tmp_path, channels, sample_rate, mono_1d):
    rng = np.random.default_rng()
    fps, num_frames = 24, 25
    frames = _frames(rng, num_frames)
    num_samples = num_frames * sample_rate // fps  # LTX-2: the waveform lasts num_frames / fps
    wave, freqs = _tones(rng, channels, num_samples, sample_rate)
    path = write_output(frames, tmp_path / "clip.mp4", fps, audio=wave[0] if mono_1d else wave,
                        sample_rate=sample_rate)

    with av.open(str(path)) as container:
        _check_streams(container, channels=channels, sample_rate=sample_rate, num_samples=num_samples,
                       num_frames=num_frames, fps=fps)
    decoded, rate = read_audio(path)
    assert rate == sample_rate
    _check_audio_matches(decoded, wave.astype(np.float32), freqs, sample_rate)
    video, video_fps = read_mp4(path)
    assert video.shape == frames.shape and video_fps == fps
    assert np.abs(video.astype(int) - frames.astype(int)).mean() < 3
    data = path.read_bytes()
    assert 0 <= data.find(b"moov") < data.find(b"mdat"), "faststart: the index must come before the media"


def test_out_of_range_audio_is_clipped(tmp_path):
    rng = np.random.default_rng()
    loud = rng.uniform(-3, 3, size=(2, 6000))
    # A WAV is exact to 16 bits: the clip shows as it is.
    write_output(rng.integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8), f"{tmp_path}/f/", 8, audio=loud,
                 sample_rate=24000)
    np.testing.assert_allclose(read_audio(tmp_path / "f")[0], np.clip(loud, -1, 1), atol=1 / 32768)
    # AAC keeps the energy of a clipped tone (~1, a near-square wave), not of the tone (~2.1). Its peaks are no
    # guide: a squared-off wave rings, up to 2x, once its harmonics are cut.
    tone = 3 * np.sin(2 * np.pi * rng.uniform(100, 300) * np.arange(12000) / 24000)
    write_mp4(_frames(rng, 12), tmp_path / "loud.mp4", 24, audio=tone, sample_rate=24000)
    decoded, _ = read_audio(tmp_path / "loud.mp4")
    assert decoded.shape == (1, 12000)
    rms = float(np.sqrt(np.mean(decoded.astype(np.float64) ** 2)))
    assert rms == pytest.approx(np.sqrt(np.mean(np.clip(tone, -1, 1) ** 2)), rel=0.1)


def test_fragmented_mp4_carries_audio_as_it_goes(tmp_path):
    rng = np.random.default_rng()
    fps, sample_rate, num_frames = 24, 24000, 33
    frames = _frames(rng, num_frames)
    num_samples = num_frames * sample_rate // fps
    wave, freqs = _tones(rng, 2, num_samples, sample_rate)
    chunks: list[bytes] = []
    writer = FragmentedMP4Writer(chunks.append, width=96, height=64, fps=fps, audio=wave, sample_rate=sample_rate)
    writer.write(frames[:9])
    after_first = b"".join(chunks)
    writer.write(frames[9:])
    writer.close()
    data = b"".join(chunks)
    assert len(after_first) > 0 and len(data) > len(after_first), "bytes must flow before close()"

    with av.open(io.BytesIO(after_first)) as container:
        # The first bytes already hold both tracks: the header and fragments with audio as well as video.
        kinds = {packet.stream.type for packet in container.demux() if packet.size}
    assert kinds == {"video", "audio"}
    with av.open(io.BytesIO(data)) as container:
        _check_streams(container, channels=2, sample_rate=sample_rate, num_samples=num_samples,
                       num_frames=num_frames, fps=fps)
        pts = {"video": [], "audio": []}
        for packet in container.demux():
            if packet.size:
                pts[packet.stream.type].append(packet.pts)
        video_step = int(1 / (container.streams.video[0].time_base * fps))
    # Evenly spaced: libavformat's frag_every_frame with two tracks repeats and skips timestamps.
    assert sorted(pts["video"]) == [i * video_step for i in range(num_frames)]
    assert sorted(pts["audio"]) == [(i - 1) * AAC_FRAME for i in range(len(pts["audio"]))]  # -1: priming

    (tmp_path / "stream.mp4").write_bytes(data)
    decoded, rate = read_audio(tmp_path / "stream.mp4")
    assert rate == sample_rate
    _check_audio_matches(decoded, wave.astype(np.float32), freqs, sample_rate)
    video, _ = read_mp4(tmp_path / "stream.mp4")
    assert video.shape == frames.shape
    assert np.abs(video.astype(int) - frames.astype(int)).mean() < 3


@pytest.mark.parametrize("seconds", [0.3, 1.7])
def test_fragmented_mp4_with_audio_shorter_or_longer_than_the_video(tmp_path, seconds):
    rng = np.random.default_rng()
    frames = _frames(rng, 25)
    wave = rng.uniform(-0.5, 0.5, size=(1, round(seconds * 24000)))
    chunks: list[bytes] = []
    writer = FragmentedMP4Writer(chunks.append, width=96, height=64, fps=24, audio=wave, sample_rate=24000)
    for first in range(0, 25, 8):
        writer.write(frames[first:first + 8])
    writer.close()
    (tmp_path / "s.mp4").write_bytes(b"".join(chunks))
    assert read_mp4(tmp_path / "s.mp4")[0].shape == frames.shape
    assert read_audio(tmp_path / "s.mp4")[0].shape == wave.shape


def test_frames_folder_gets_a_wav(tmp_path):
    rng = np.random.default_rng()
    frames = rng.integers(0, 256, size=(3, 32, 32, 3), dtype=np.uint8)
    wave = rng.uniform(-1, 1, size=5000)  # mono as [samples], at a rate AAC could not carry
    out = write_output(frames, f"{tmp_path}/f/", 8, audio=wave, sample_rate=22000)
    assert sorted(p.name for p in out.iterdir()) == ["audio.wav", "frame_00000.png", "frame_00001.png",
                                                     "frame_00002.png", "video.json"]
    np.testing.assert_array_equal(read_frames_dir(out)[0], frames)
    decoded, rate = read_audio(out)
    assert rate == 22000 and decoded.shape == (1, 5000)
    np.testing.assert_allclose(decoded[0], wave, atol=1 / 32768)  # 16-bit PCM

    # Written again without audio, the folder loses the old WAV.
    write_output(frames, out, 8)
    assert not (out / "audio.wav").exists()


_WAVE = np.random.default_rng().uniform(-1, 1, size=(2, 4800))


@pytest.mark.parametrize(
    ("audio", "sample_rate", "match"),
    [
        (_WAVE, None, "without sample_rate"),
        (_WAVE, 0, "sample_rate=0 must be a positive int"),
        (_WAVE, -24000, "sample_rate=-24000 must be a positive int"),
        (_WAVE, 24000.0, "sample_rate=24000.0 must be a positive int"),
        (_WAVE, True, "sample_rate=True must be a positive int"),
        (_WAVE, 22000, "sample_rate=22000 cannot be carried by AAC; resample"),
        (np.concatenate([_WAVE, _WAVE[:1]]), 24000, r"shape \(3, 4800\).*1 or 2 channels"),
        (_WAVE.T.copy(), 24000, r"shape \(4800, 2\).*transpose"),
        (_WAVE[:, :0], 24000, "at least one sample"),
        ((_WAVE * 32767).astype(np.int16), 24000, "dtype int16; pass float samples"),
        (_WAVE.tolist(), 24000, "numpy array"),
        (np.where(_WAVE > 0.9, np.nan, _WAVE), 24000, "NaN"),
    ],
)
def test_bad_audio_raises_value_error_and_leaves_nothing(tmp_path, audio, sample_rate, match):
    frames = np.random.default_rng().integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=match):
        write_output(frames, tmp_path / "x.mp4", 24, audio=audio, sample_rate=sample_rate)
    assert list(tmp_path.iterdir()) == []
    emitted: list[bytes] = []
    with pytest.raises(ValueError, match=match):
        FragmentedMP4Writer(emitted.append, width=32, height=32, fps=24, audio=audio, sample_rate=sample_rate)
    assert emitted == []


def _packets(data: bytes) -> dict[str, list[tuple[int, bytes]]]:
    """Every packet of an MP4 by kind: (pts, payload), in stream order."""
    with av.open(io.BytesIO(data)) as container:
        out: dict[str, list] = {"video": [], "audio": []}
        for packet in container.demux():
            if packet.size:
                out[packet.stream.type].append((packet.pts, bytes(packet)))
    return out


def _cuts(rng: np.random.Generator, total: int, pieces: int) -> list[int]:
    return [0, *sorted(int(c) for c in rng.choice(np.arange(1, total), size=pieces - 1, replace=False)), total]


@pytest.mark.parametrize("order", ["audio first", "frames first", "mixed"])
def test_audio_given_piece_by_piece_is_the_whole_waveforms_aac(tmp_path, order):
    """A soundtrack given in pieces of random lengths, before, after or between the frames (which wait for the audio
    under them), makes the AAC stream the whole waveform makes, packet for packet, in both writers; the fragmented
    one streams both tracks as soon as the audio under the first frames has come."""
    rng = np.random.default_rng()
    fps, sample_rate, num_frames = 24, 24000, 61
    frames = _frames(rng, num_frames)
    wave, freqs = _tones(rng, 2, round(num_frames / fps * sample_rate) - 500, sample_rate)
    audio_cuts, frame_cuts = _cuts(rng, wave.shape[1], 6), _cuts(rng, num_frames, 6)

    def feed(writer) -> list[int]:
        """Frames encoded after each step (the writer's count)."""
        written = []
        for i in range(6):
            audio, video = wave[:, audio_cuts[i]:audio_cuts[i + 1]], frames[frame_cuts[i]:frame_cuts[i + 1]]
            steps = {"audio first": [audio, video], "frames first": [video, audio]}.get(
                order, [audio, video] if i % 2 else [video, audio])
            for item in steps:
                (writer.write if item.dtype == np.uint8 else writer.write_audio)(item)
                written.append(writer.frames_written)
        return written

    chunks: list[bytes] = []
    streamed = FragmentedMP4Writer(chunks.append, width=96, height=64, fps=fps, audio_channels=2,
                                   sample_rate=sample_rate)
    written = feed(streamed)
    assert 0 < written[-1] < num_frames, "frames must be encoded as their audio comes, the rest at close()"
    if order == "frames first":
        assert written[0] == 0, "frames wait for the audio under them"
    streamed.close()
    whole: list[bytes] = []
    reference = FragmentedMP4Writer(whole.append, width=96, height=64, fps=fps, audio=wave, sample_rate=sample_rate)
    reference.write(frames)
    reference.close()
    got, expected = _packets(b"".join(chunks)), _packets(b"".join(whole))
    assert got["audio"] == expected["audio"]
    assert [pts for pts, _ in got["video"]] == [pts for pts, _ in expected["video"]]
    (tmp_path / "s.mp4").write_bytes(b"".join(chunks))
    _check_audio_matches(read_audio(tmp_path / "s.mp4")[0], wave.astype(np.float32), freqs, sample_rate)
    assert np.abs(read_mp4(tmp_path / "s.mp4")[0].astype(int) - frames.astype(int)).mean() < 3

    with MP4FileWriter(tmp_path / "p.mp4", width=96, height=64, fps=fps, audio_channels=2,
                       sample_rate=sample_rate) as writer:
        feed(writer)
    write_mp4(frames, tmp_path / "w.mp4", fps, audio=wave, sample_rate=sample_rate)
    assert _packets((tmp_path / "p.mp4").read_bytes())["audio"] == _packets((tmp_path / "w.mp4").read_bytes())["audio"]
    with av.open(str(tmp_path / "p.mp4")) as container:
        _check_streams(container, channels=2, sample_rate=sample_rate, num_samples=wave.shape[1],
                       num_frames=num_frames, fps=fps)


def test_audio_pieces_misused_are_refused(tmp_path):
    emitted: list[bytes] = []
    with pytest.raises(ValueError, match="not both"):
        FragmentedMP4Writer(emitted.append, width=32, height=32, fps=24, audio=_WAVE, sample_rate=24000,
                            audio_channels=2)
    with pytest.raises(ValueError, match="audio_channels=3 must be 1 or 2"):
        MP4FileWriter(tmp_path / "x.mp4", width=32, height=32, fps=24, audio_channels=3, sample_rate=24000)
    with pytest.raises(ValueError, match="sample_rate=22000 cannot be carried by AAC"):
        MP4FileWriter(tmp_path / "x.mp4", width=32, height=32, fps=24, audio_channels=2, sample_rate=22000)
    assert emitted == [] and list(tmp_path.iterdir()) == []
    writer = FragmentedMP4Writer(emitted.append, width=32, height=32, fps=24)
    with pytest.raises(RuntimeError, match="audio_channels"):
        writer.write_audio(_WAVE)
    writer = FragmentedMP4Writer(emitted.append, width=32, height=32, fps=24, audio_channels=2, sample_rate=24000)
    with pytest.raises(ValueError, match=r"expected float \[2, samples\]"):
        writer.write_audio(_WAVE[:1])
