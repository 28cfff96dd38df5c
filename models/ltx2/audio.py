"""LTX-2's soundtrack decoded a part at a time, as a long video's windows make its audio latents final: the waveform
LTX2Pipeline decodes from the whole soundtrack at once (audio VAE, then vocoder), within float rounding.

Invariants:
- The audio VAE's decoder is causal in time (causal convolutions, per-frame norms, no attention): the mel frames
  ``[0, 4k - 3)`` of the latent frames ``[0, k)`` are those of the whole decode. A part's latents are decoded with
  :func:`vae_context` latent frames before them (more than the decoder reaches back), and only the mel frames past
  that context are kept.
- The vocoder (HiFi-GAN: convolutions and transposed convolutions) reads up to :func:`vocoder_context` mel frames
  either side of a sample's own (``hop`` samples each): samples are final once the mel frames that far after them
  are. Each part is vocoded with that context either side and cut to its own samples; only the mel frames a later
  part still reads are held, so memory does not grow with the video.
- The waveform is cut to the video's duration and its end padded with silence, as ``models.ltx2.adapter.fit_duration``.
- A decoder this cannot bound (attention in the audio VAE, another vocoder class) gets ``None`` from
  :func:`progressive_soundtrack`: the soundtrack is then decoded whole, at the end.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import LTX2AudioAttnBlock, LTX2AudioCausalConv2d
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

__all__ = ["ProgressiveSoundtrack", "progressive_soundtrack", "vae_context", "vocoder_context"]


def _reach(conv) -> int:
    """Frames before its own (causal) or on either side (centred) that a convolution's output frame reads."""
    k, d = conv.kernel_size[0], conv.dilation[0]
    return (k - 1) * d


def vae_context(audio_vae) -> int | None:
    """Latent frames before a part that its decode must start with so that its own mel frames are the whole
    decode's (the decoder's reach back, rounded up, plus one for the upsamplers' shift); ``None``: not causal."""
    decoder = audio_vae.decoder
    if decoder.causality_axis != "height" or any(isinstance(m, LTX2AudioAttnBlock) for m in decoder.modules()):
        return None

    def causal(conv) -> int:
        return _reach(conv.conv) if isinstance(conv, LTX2AudioCausalConv2d) else _reach(conv)

    def block(b) -> int:
        # conv1 then conv2; the shortcut (if any) reads less and runs beside them.
        return causal(b.conv1) + causal(b.conv2)

    reach, rate = Fraction(causal(decoder.conv_in)), 1
    reach += block(decoder.mid.block_1) + block(decoder.mid.block_2)
    for level in reversed(range(decoder.num_resolutions)):
        stage = decoder.up[level]
        reach += sum(Fraction(block(b), rate) for b in stage.block)
        if level != 0 and hasattr(stage, "upsample"):
            rate *= 2
            reach += Fraction(causal(stage.upsample.conv), rate)
    reach += Fraction(causal(decoder.conv_out), rate)
    return math.ceil(reach) + 1


def vocoder_context(vocoder) -> int | None:
    """Mel frames on either side of its own that a sample of the vocoder reads, at most (rounded up, plus one);
    ``None``: a vocoder this does not know."""
    if type(vocoder) is not LTX2Vocoder:
        return None
    cfg = vocoder.config
    # An anti-aliased activation runs a low-pass filter each way at twice the rate: at most its kernel each side.
    act = cfg.antialias_kernel_size if cfg.antialias else 0
    reach, rate = Fraction(_reach(vocoder.conv_in) // 2), 1
    per = vocoder.resnets_per_upsample
    for i, up in enumerate(vocoder.upsamplers):
        # A transposed convolution's output frame reads the input frames within its kernel, ceil(k / s) of them.
        reach += Fraction(math.ceil(up.kernel_size[0] / up.stride[0]), rate)
        rate *= up.stride[0]
        reach += Fraction(max(sum(_reach(c1) // 2 + _reach(c2) // 2 + 2 * act
                                  for c1, c2 in zip(res.convs1, res.convs2, strict=True))
                              for res in vocoder.resnets[i * per:(i + 1) * per]), rate)
    reach += Fraction(_reach(vocoder.conv_out) // 2 + act, rate)
    return math.ceil(reach) + 1


class ProgressiveSoundtrack:
    """The soundtrack of audio latents that become final a prefix at a time: :meth:`advance` returns each time the
    samples that the final latents allow and no earlier call returned."""

    def __init__(self, pipe, vocoder, *, mel_bins: int, total_samples: int, vae_ctx: int, vocoder_ctx: int):
        self.pipe, self.vocoder, self.mel_bins, self.total = pipe, vocoder, mel_bins, total_samples
        self.vae_ctx, self.vocoder_ctx = vae_ctx, vocoder_ctx
        self.hop = vocoder.total_upsample_factor
        """Samples per mel frame."""
        self.latents_done = 0
        """Latent frames decoded to mel."""
        self.mel: torch.Tensor | None = None
        """Mel frames ``[mel_start, mel_end)`` of the whole decode, ``[B, C, T, M]``, held for the vocoder."""
        self.mel_start = self.mel_end = 0
        self.vocoded = 0
        """Mel frames vocoded (their samples returned)."""
        self.samples = 0
        """Samples returned so far (``hop`` per mel frame vocoded, up to ``total``)."""

    def _decode_mel(self, audio: torch.Tensor, final: int) -> None:
        """Mel frames of the latent frames ``[latents_done, final)`` of ``audio`` (packed ``[1, L, D]``)."""
        pipe, audio_vae = self.pipe, self.pipe.audio_vae
        start = max(0, self.latents_done - self.vae_ctx)
        part = pipe._denormalize_audio_latents(audio[:, start:final], audio_vae.latents_mean, audio_vae.latents_std)
        part = pipe._unpack_audio_latents(part, final - start, num_mel_bins=self.mel_bins)
        mel = audio_vae.decode(part.to(audio_vae.dtype), return_dict=False)[0]
        # Latent frames [start, final) decode to the whole decode's mel frames [4 start, 4 final - 3) (a causal
        # decode's first latent frame gives one mel frame, the whole decode's last of that latent frame's four).
        new_from = self.mel_end
        keep = mel[:, :, new_from - 4 * start:]
        self.mel = keep if self.mel is None else torch.cat([self.mel, keep], dim=2)
        self.mel_end = 4 * final - 3
        assert self.mel_start + self.mel.shape[2] == self.mel_end, (self.mel_start, self.mel.shape, self.mel_end)
        self.latents_done = final

    def advance(self, audio: torch.Tensor, final: int, *, last: bool) -> np.ndarray:
        """The next samples ``[C, s]`` once the audio latent frames ``[0, final)`` of ``audio`` (packed, normalised,
        as the model's stream holds them) are final; ``last``: they are all of them (the rest of the soundtrack,
        padded with silence to ``total_samples``)."""
        if final > self.latents_done:
            self._decode_mel(audio, final)
        # Mel frames [vocoded, upto) are vocoded now: those with their whole right context (all of them at the end).
        done = self.vocoded
        upto = self.mel_end if last else max(done, self.mel_end - self.vocoder_ctx)
        samples = np.zeros((self.vocoder.out_channels, 0), dtype=np.float32)
        if upto > done:
            lo, hi = max(self.mel_start, done - self.vocoder_ctx), min(self.mel_end, upto + self.vocoder_ctx)
            mel = self.mel[:, :, lo - self.mel_start:hi - self.mel_start]
            waveform = self.vocoder(mel)[0].float().cpu().numpy()
            assert waveform.shape[1] == (hi - lo) * self.hop, (waveform.shape, hi - lo, self.hop)
            samples = waveform[:, (done - lo) * self.hop:(upto - lo) * self.hop]
            self.vocoded = upto
            # Only what the next part's context reaches back to is held.
            drop = max(0, upto - self.vocoder_ctx - self.mel_start)
            self.mel, self.mel_start = self.mel[:, :, drop:], self.mel_start + drop
        samples = samples[:, :max(0, self.total - self.samples)]
        if last:
            samples = np.pad(samples, ((0, 0), (0, self.total - self.samples - samples.shape[1])))
        self.samples += samples.shape[1]
        return np.ascontiguousarray(samples)


def progressive_soundtrack(pipe, vocoder, *, total_samples: int) -> ProgressiveSoundtrack | None:
    """A :class:`ProgressiveSoundtrack` for ``pipe``'s audio VAE and ``vocoder``, or ``None`` where either cannot
    be decoded a part at a time (see the module docstring)."""
    vae_ctx, vocoder_ctx = vae_context(pipe.audio_vae), vocoder_context(vocoder)
    if vae_ctx is None or vocoder_ctx is None:
        return None
    mel_bins = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    return ProgressiveSoundtrack(pipe, vocoder, mel_bins=mel_bins, total_samples=total_samples, vae_ctx=vae_ctx,
                                 vocoder_ctx=vocoder_ctx)
