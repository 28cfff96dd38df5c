"""Time-parallel, streamed decode for diffusers' ``AutoencoderKLWan`` (Wan 2.1's and Wan 2.2's VAEs; Helios decodes
each chunk with Wan 2.1's), applied from outside.

``AutoencoderKLWan._decode`` runs its decoder on one latent frame (a *chunk*) at a time; each causal convolution
reads the last ``CACHE_T = 2`` input frames of the chunks before from its slot of ``feat_cache``, and each time
upsampler's convolution skips the very first chunk (its ``"Rep"`` slot: latent frame 0 makes one video frame, every
later one ``4``). Here the same calls run in another order: op by op, and within an op chunk by chunk, over a piece of
the engine's :class:`~cp_infer.decode.TemporalSplit`. A piece's chunk ``j`` of an op reads only chunk ``j`` of the
op's input and the op's cache slot as the chunks before left it, so at every cached op a piece takes over that slot
from the previous piece's owner (its cache after its last chunk) and hands its own on before it computes
(:class:`~cp_infer.decode.FrameRelay`): the ranks run as a pipeline, a piece a few ops behind the one before it.

Invariants:
- Bit-identical to ``vae.decode`` (``use_tiling`` off) at any number of ranks and pieces: every module is called on
  the tensors diffusers' loop calls it on (same values, same shapes: one chunk each, the caches built by the same
  slicing and concatenation, from the caller's post-quant convolution of the latents); only the order of the calls
  and the rank that makes them change. A rank that decodes the whole video alone runs diffusers' own loop, its one
  ``feat_cache`` carried from round to round.
- Nothing is decoded twice: a piece runs its own chunks only; what it reads of the pieces before is the cache slots,
  at most 2 frames per cached op.
- Balanced: :func:`decode_cost` is the decoder's work up to each latent frame (latent frame 0 is a quarter-length
  chunk at every time-upsampled stage); the model cuts pieces to equal work with it.
- Bounded memory: a rank holds one piece at every stage (``frames_per_rank`` latent frames) and the cache slots it
  handed on until they have left; only the latents are whole on every rank.
- The decoder modules are diffusers' own, untouched; the walk below follows ``WanDecoder3d.forward`` and its blocks'
  (:func:`check_decoder` refuses a layout it does not know).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    CACHE_T,
    DupUp3D,
    WanAttentionBlock,
    WanCausalConv3d,
    WanDecoder3d,
    WanMidBlock,
    WanResample,
    WanResidualBlock,
    WanResidualUpBlock,
    WanUpBlock,
    unpatchify,
)

from cp_infer import ParallelState
from cp_infer.decode import AUTO, FrameRelay, TemporalSplit, resolve_frames_per_rank

__all__ = ["MIN_PARALLEL_PIXELS", "WanStreamedDecode", "check_decoder", "decode_cost", "decode_split", "decode_world"]

_REP = "Rep"  # diffusers' marker: the time upsampler's slot after latent frame 0, which skipped its convolution

MIN_PARALLEL_PIXELS = 48 * 48
"""Output pixels per frame below which ``auto`` decodes on one rank (:func:`decode_world`). Measured with
``bench/decode.py --vae wan2.1`` (real widths) on 2 CPU cores shared with other jobs (``docs/benchmarks.md``): at
48x48 two ranks took 0.69x of one rank's time, at 32x32 0.93x and 1.12x (1.03x and 1.21x of diffusers' loop), at
comparable load, while splitting the work evenly (0.55-0.64x of the CPU time per rank): each of the 32 cached ops of
a piece then lasts tens of milliseconds, and a rank that waits for the one before pays the loaded machine's
scheduling delay (a time slice, when every core is taken) at every one. (With both cores taken by other jobs,
neither size wins.)"""


def decode_world(world: int, *, height: int, width: int) -> int:
    """The ranks ``auto`` decodes a ``height`` x ``width`` video on: all ``world``, or one below
    :data:`MIN_PARALLEL_PIXELS`."""
    return world if height * width >= MIN_PARALLEL_PIXELS else 1


def decode_split(vae: torch.nn.Module, latent_frames: int, *, setting: int | str | None, world: int, height: int,
                 width: int, temporal_compression: int) -> TemporalSplit:
    """The pieces ``world`` ranks decode ``latent_frames`` of a ``height`` x ``width`` video in: rounds of ``setting``
    latent frames per rank (``--decode-frames-per-rank``: ``auto`` sizes them by the frame and decodes small frames on
    one rank, :func:`decode_world`), cut to equal work (:func:`decode_cost`)."""
    per_round = resolve_frames_per_rank(setting, height=height, width=width,
                                        temporal_compression=temporal_compression)
    if setting == AUTO:
        world = decode_world(world, height=height, width=width)
    return TemporalSplit(latent_frames=latent_frames, world=world, temporal_compression=temporal_compression,
                         frames_per_rank=per_round, cost=decode_cost(vae, latent_frames))


def check_decoder(vae: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless ``vae``'s decoder is the layout the streamed decode walks (diffusers' Wan 2.1 and
    Wan 2.2 decoders), its cached convolutions reading exactly ``CACHE_T`` frames back."""
    decoder = vae.decoder
    if not isinstance(decoder, WanDecoder3d) or not isinstance(decoder.mid_block, WanMidBlock):
        raise ValueError(f"{type(decoder).__name__}: the streamed Wan decode knows diffusers' WanDecoder3d only")
    cached = [decoder.conv_in, decoder.conv_out]
    for block in [decoder.mid_block, *decoder.up_blocks]:
        if not isinstance(block, (WanMidBlock, WanUpBlock, WanResidualUpBlock)):
            raise ValueError(f"decoder block {type(block).__name__} is not one the streamed Wan decode knows")
        for resnet in block.resnets:
            if not isinstance(resnet, WanResidualBlock):
                raise ValueError(f"{type(resnet).__name__} in {type(block).__name__}: expected WanResidualBlock")
            shortcut = resnet.conv_shortcut
            if isinstance(shortcut, WanCausalConv3d) and shortcut.kernel_size[0] != 1:
                raise ValueError(f"a resnet shortcut with temporal kernel {shortcut.kernel_size[0]}: the streamed "
                                 "decode needs per-frame (1x1x1) shortcuts, as diffusers builds them")
            cached += [resnet.conv1, resnet.conv2]
        if isinstance(block, WanMidBlock) and not all(isinstance(a, WanAttentionBlock) for a in block.attentions):
            raise ValueError("the mid block's attentions must be WanAttentionBlock (per frame)")
        for up in _upsamplers(block):
            if not isinstance(up, WanResample) or up.mode not in ("upsample2d", "upsample3d"):
                raise ValueError(f"upsampler {getattr(up, 'mode', type(up).__name__)} is not one the decode knows")
            if up.mode == "upsample3d":
                cached.append(up.time_conv)
        if isinstance(block, WanResidualUpBlock) and not isinstance(block.avg_shortcut, (DupUp3D, type(None))):
            raise ValueError(f"shortcut {type(block.avg_shortcut).__name__}: expected DupUp3D")
    for conv in cached:
        if conv._padding[4] != CACHE_T or conv.stride[0] != 1 or conv.dilation[0] != 1:
            raise ValueError(f"a decoder convolution with temporal padding {conv._padding[4]}, stride "
                             f"{conv.stride[0]}, dilation {conv.dilation[0]}: the cache holds {CACHE_T} frames of "
                             "stride-1 causal convolutions")


def _upsamplers(block: torch.nn.Module) -> list[torch.nn.Module]:
    if isinstance(block, WanResidualUpBlock):
        return [] if block.upsampler is None else [block.upsampler]
    return list(getattr(block, "upsamplers", None) or [])


def _macs(conv: torch.nn.Module) -> float:
    """Multiply-adds per output pixel of a Conv2d / Conv3d."""
    return conv.out_channels * conv.in_channels // conv.groups * math.prod(conv.kernel_size)


def decode_cost(vae: torch.nn.Module, latent_frames: int) -> tuple[float, ...]:
    """``cost[j]``: the decoder's convolution multiply-adds (all of them, per latent pixel) for the latent frames
    ``[0, j)``: :class:`~cp_infer.decode.TemporalSplit`'s ``cost``. Latent frame 0 is one frame at every stage (the
    time upsamplers pass it through), every later one ``2**s`` frames after ``s`` time upsamplers. (The mid block's
    attention products, quadratic in the latent frame's area, are left out: a small part at any real size.)"""
    decoder = vae.decoder
    frames, area, work = [1, 1], 1.0, [0.0, 0.0]  # latent frame 0's, and any later one's

    def conv(module: torch.nn.Module, which=(0, 1)) -> None:
        for i in which:
            work[i] += _macs(module) * area * frames[i]

    conv(decoder.conv_in)
    for block in [decoder.mid_block, *decoder.up_blocks]:
        for resnet in block.resnets:
            conv(resnet.conv1)
            conv(resnet.conv2)
            if isinstance(resnet.conv_shortcut, WanCausalConv3d):
                conv(resnet.conv_shortcut)
        for attn in getattr(block, "attentions", []):
            conv(attn.to_qkv)
            conv(attn.proj)
        for up in _upsamplers(block):
            if up.mode == "upsample3d":
                conv(up.time_conv, which=(1,))  # latent frame 0 skips it
                frames[1] *= 2
            area *= 4
            conv(up.resample[1])
    conv(decoder.conv_out)
    first, later = work
    return (0.0, *(first + later * j for j in range(latent_frames)))


def _next_cache(cache, x: torch.Tensor, *, upsampler: bool):
    """A cached convolution's slot after the chunk ``x``, given its slot before: diffusers' bookkeeping."""
    if upsampler and cache is None:
        return _REP
    out = x[:, :, -CACHE_T:, :, :].clone()
    if out.shape[2] < 2 and isinstance(cache, torch.Tensor):
        # cache last frame of last two chunk
        out = torch.cat([cache[:, :, -1, :, :].unsqueeze(2).to(out.device), out], dim=2)
    if out.shape[2] < 2 and isinstance(cache, str):
        out = torch.cat([torch.zeros_like(out).to(out.device), out], dim=2)
    return out


@dataclass
class _Piece:
    """This rank's piece in flight: piece ``index`` of the split, from latent frame ``a``."""

    split: TemporalSplit
    index: int
    a: int
    relay: FrameRelay
    op: int = 0

    def slot(self, chunks: list[torch.Tensor], *, upsampler: bool) -> list:
        """The cache slot before each of ``chunks`` (the next cached op's inputs), having taken the first over from
        the previous piece and handed the one after the last on to the next piece."""
        key, self.op = self.op, self.op + 1
        split = self.split
        if self.a == 0:
            first = None
        elif upsampler and self.a == 1:
            first = _REP  # the previous piece is latent frame 0 alone: no frames to hand on
        else:
            # Latent frame 0 is one frame at every stage, so the slot after it holds one; after any later, CACHE_T.
            count = 1 if self.a == 1 else CACHE_T
            first = self.relay.take_over(key, chunks[0], count, src=split.owner(self.index - 1))
        slots = [first]
        for x in chunks:
            slots.append(_next_cache(slots[-1], x, upsampler=upsampler))
        last = slots.pop()
        if self.index + 1 < split.pieces and isinstance(last, torch.Tensor):
            # Before this op's work, so that the next piece (on another rank) can start the op as early as possible.
            self.relay.hand_on(key, last, to=split.owner(self.index + 1))
        return slots

    def conv(self, conv: torch.nn.Module, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        """A causal convolution over the piece, chunk by chunk, each with its cache slot."""
        return [conv(x, cache) for x, cache in zip(chunks, self.slot(chunks, upsampler=False), strict=True)]

    def resnet(self, resnet: torch.nn.Module, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        # WanResidualBlock.forward, op by op.
        h = [resnet.conv_shortcut(x) for x in chunks]
        x = self.conv(resnet.conv1, [resnet.nonlinearity(resnet.norm1(x)) for x in chunks])
        x = self.conv(resnet.conv2, [resnet.dropout(resnet.nonlinearity(resnet.norm2(c))) for c in x])
        return [c + s for c, s in zip(x, h, strict=True)]

    def upsample(self, up: torch.nn.Module, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        # WanResample.forward: the time convolution with its slot (upsample3d), then the per-frame spatial part,
        # which is the module's own forward without a cache.
        if up.mode == "upsample3d":
            out = []
            for x, cache in zip(chunks, self.slot(chunks, upsampler=True), strict=True):
                if cache is not None:
                    b, c, t, h, w = x.shape
                    x = up.time_conv(x) if isinstance(cache, str) else up.time_conv(x, cache)
                    x = x.reshape(b, 2, c, t, h, w)
                    x = torch.stack((x[:, 0, :, :, :, :], x[:, 1, :, :, :, :]), 3)
                    x = x.reshape(b, c, t * 2, h, w)
                out.append(x)
            chunks = out
        return [up(x) for x in chunks]

    def block(self, block: torch.nn.Module, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        # WanUpBlock.forward / WanResidualUpBlock.forward (first_chunk: latent frame 0).
        x_copy = [x.clone() for x in chunks] if isinstance(block, WanResidualUpBlock) else None
        for resnet in block.resnets:
            chunks = self.resnet(resnet, chunks)
        for up in _upsamplers(block):
            chunks = self.upsample(up, chunks)
        if x_copy is not None and block.avg_shortcut is not None:
            chunks = [x + block.avg_shortcut(s, first_chunk=self.a + j == 0)
                      for j, (x, s) in enumerate(zip(chunks, x_copy, strict=True))]
        return chunks

    def decode(self, decoder: torch.nn.Module, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
        # WanDecoder3d.forward, op by op.
        x = self.conv(decoder.conv_in, chunks)
        mid = decoder.mid_block
        x = self.resnet(mid.resnets[0], x)
        for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=True):
            if attn is not None:
                x = [attn(c) for c in x]
            x = self.resnet(resnet, x)
        for block in decoder.up_blocks:
            x = self.block(block, x)
        x = [decoder.nonlinearity(decoder.norm_out(c)) for c in x]
        return self.conv(decoder.conv_out, x)


@dataclass
class WanStreamedDecode:
    """One video's decode over the decoding group: ``self(a, b)`` decodes this rank's piece of the next round of
    ``split``, the latent frames ``[a, b)`` of ``x``, to the float video ``[B, C, F', H', W']`` that ``vae.decode``
    returns for those frames, bit for bit.

    ``x`` is ``vae.post_quant_conv`` of the denormalised latents (``[B, z_dim, F, H, W]``, as ``_decode`` makes it
    over the whole video: a 1x1x1 convolution, so a caller may fill it a part at a time, each part before the first
    piece that reads it). Every active rank calls ``self`` for each of its rounds in order; the cache slots the pieces
    hand each other pass inside (:class:`~cp_infer.decode.FrameRelay`, over ``state``'s relay groups).
    """

    vae: torch.nn.Module
    x: torch.Tensor
    split: TemporalSplit
    state: ParallelState
    _round: int = 0
    _relay: FrameRelay | None = field(default=None, repr=False)
    _cache: list | None = field(default=None, repr=False)
    """One rank decoding the whole video: diffusers' ``feat_cache``, carried from round to round."""

    def __post_init__(self) -> None:
        check_decoder(self.vae)
        if self.vae.use_tiling:
            raise ValueError("use_tiling (diffusers' spatial tiles) is not supported by the streamed Wan decode; "
                             "disable it (vae.disable_tiling())")
        if self.x.shape[2] != self.split.latent_frames:
            raise ValueError(f"the latents have {self.x.shape[2]} frames, the split {self.split.latent_frames}")
        self._relay = FrameRelay(self.state)
        self._cache = [None] * self.vae._cached_conv_counts["decoder"]

    @property
    def done(self) -> bool:
        """Whether this rank decoded its last piece."""
        return self._round == self.split.rounds

    @torch.no_grad()
    def __call__(self, a: int, b: int) -> torch.Tensor:
        split, rank, k = self.split, self.state.cp_rank, self._round
        if k >= split.rounds or (a, b) != split.latent_range(rank, k):
            raise RuntimeError(f"latent frames {a}..{b} are not rank {rank}'s piece of round {k} of {split}: "
                               "rounds run in order, once")
        chunks = [self.x[:, :, i:i + 1, :, :] for i in range(a, b)]  # _decode's chunks
        if split.active == 1:
            # One rank decodes it all: nothing to hand on, so diffusers' own loop, which holds one chunk's
            # activations at a time instead of a piece's at every stage (the same calls: the same video).
            out = torch.cat([self.vae.decoder(x, feat_cache=self._cache, feat_idx=[0], first_chunk=a + j == 0)
                             for j, x in enumerate(chunks)], 2)
        else:
            piece = _Piece(split, split.piece(rank, k), a, self._relay)
            out = torch.cat(piece.decode(self.vae.decoder, chunks), 2)
        self._round += 1
        if self.done:
            self._relay.flush()  # this rank's last piece: what it handed on must have left before the decode ends
        if self.vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return torch.clamp(out, min=-1.0, max=1.0)
