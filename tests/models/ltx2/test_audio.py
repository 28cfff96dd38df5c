"""LTX-2's soundtrack decoded a part at a time (``models.ltx2.audio``) against LTX2Pipeline's decode of the whole at
once, on the embedded default's audio VAE and vocoder (no process group): equal within float rounding for random
latents cut at random places (measured: 3e-7 of a peak of 0.3; tolerance 1e-5, convolutions over different lengths
sum in different orders), what it holds bounded, and a context too short is caught by the same comparison."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.ltx2.audio import ProgressiveSoundtrack, progressive_soundtrack, vae_context, vocoder_context

from ...harness import one_thread


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from diffusers import LTX2Pipeline

    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx2.loading import load_ltx2

    c = load_ltx2(str(ensure_default_ltx2_model(tmp_path_factory.mktemp("ltx2"))))
    return LTX2Pipeline(scheduler=c.scheduler, vae=c.vae, audio_vae=c.audio_vae, text_encoder=c.text_encoder,
                        tokenizer=c.tokenizer, connectors=c.connectors, transformer=c.transformer, vocoder=c.vocoder)


def _whole(pipe, audio: torch.Tensor, samples: int) -> np.ndarray:
    """LTX2Pipeline's decode of the whole soundtrack, cut to ``samples`` (``models.ltx2.adapter.fit_duration``)."""
    vae = pipe.audio_vae
    mel_bins = vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    packed = pipe._denormalize_audio_latents(audio, vae.latents_mean, vae.latents_std)
    mel = vae.decode(pipe._unpack_audio_latents(packed, audio.shape[1], num_mel_bins=mel_bins), return_dict=False)[0]
    waveform = pipe.vocoder(mel)[0].float().numpy()
    return np.pad(waveform, ((0, 0), (0, max(0, samples - waveform.shape[1]))))[:, :samples]


def _in_parts(soundtrack: ProgressiveSoundtrack, audio: torch.Tensor, cuts: list[int]) -> tuple[np.ndarray, int]:
    parts, held = [], 0
    for final in cuts:
        parts.append(soundtrack.advance(audio, final, last=False))
        held = max(held, soundtrack.mel.shape[2])
    parts.append(soundtrack.advance(audio, audio.shape[1], last=True))
    return np.concatenate(parts, axis=1), held


@pytest.mark.parametrize("shorter", [True, False])
def test_a_soundtrack_in_parts_is_the_whole_decode(pipe, shorter):
    """``shorter``: the video is shorter than the vocoder's output (cut), else longer (padded with silence)."""
    with torch.inference_mode():
        one_thread(_check_parts, pipe, shorter)


def _check_parts(pipe, shorter: bool) -> None:
    rng = np.random.default_rng()
    latents = int(rng.integers(60, 90))
    features = pipe.audio_vae.config.latent_channels * pipe.audio_vae.config.mel_bins // 4
    audio = torch.from_numpy(rng.standard_normal((1, latents, features)).astype(np.float32))
    hop = pipe.vocoder.total_upsample_factor
    samples = (4 * latents - 3) * hop + int(rng.integers(-3000, -100) if shorter else rng.integers(100, 3000))
    expected = _whole(pipe, audio, samples)
    assert np.abs(expected).max() > 1e-2, "a silent soundtrack would prove nothing"
    # Parts of a window's audio (25 a second), of one latent frame and of a few, and one part that adds nothing.
    cuts = sorted({int(c) for c in rng.integers(27, latents - 1, size=2)} | {25, 26})
    cuts.insert(2, cuts[1])
    got, held = _in_parts(progressive_soundtrack(pipe, pipe.vocoder, total_samples=samples), audio, cuts)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    # What it holds is the context and the longest part's mel frames, not the soundtrack so far.
    longest = max(b - a for a, b in zip([0, *cuts], cuts, strict=False))
    assert held <= 4 * (longest + vae_context(pipe.audio_vae)) + 2 * vocoder_context(pipe.vocoder)

    # The same comparison catches a context shorter than the decoders read.
    short = ProgressiveSoundtrack(pipe, pipe.vocoder, mel_bins=pipe.audio_vae.config.mel_bins // 4,
                                  total_samples=samples, vae_ctx=1, vocoder_ctx=2)
    assert np.abs(_in_parts(short, audio, cuts[:1])[0] - expected).max() > 1e-3
