"""Time-parallel, streamed decode for diffusers' LTX-Video and LTX-2 video VAEs, applied from outside.

The decoder is a chain of *temporal ops* (each temporal convolution, each temporal upsampler, and the residual
of each resnet block, which must wait for the block's two convolutions) with per-frame ops between them (norms,
activations, the timestep modulation, the spatial noise, 1x1x1 shortcuts, the final unpatchify). A *stage* is
the sequence of frames between two temporal ops, from the latents (stage 0) to the video.

Each piece of the engine's :class:`~cp_infer.decode.TemporalSplit` is decoded by one rank; at every stage it is
the frames ``[lo, hi)`` of ``_Plan.piece_cuts``. Each temporal op takes over the few frames before ``lo`` that it
reads from the previous piece's owner, and hands the frames the next piece reads to that piece's owner before it
computes (:class:`~cp_infer.decode.FrameRelay`), so the ranks run as a pipeline, a piece a few ops behind the one
before it.

Invariants:
- Exact. Every output frame of every op is computed from exactly the input frames the whole-video decode uses,
  with replicate padding only at the two ends of the whole video, so the decode does not depend on the number of
  ranks or pieces; only the summation order inside a convolution on a shorter input can differ: at most 7e-6 on
  outputs in [-1, 1] (measured, N = 1..4, any window), i.e. at most one uint8 level where a value sits on a
  rounding boundary (the tests allow 5e-5 and 1 level).
- Nothing is decoded twice (but one conv frame where a cut splits an upsampler's depth-to-time group). A piece
  ends, at each stage, at the last frame the next stage's end needs (the decoder's right receptive field, 24
  latent frames for LTX-Video 0.9.0 and 7 for the embedded default, :func:`decoder_receptive_field`, checked
  against the module by perturbation), so the first piece runs ahead at the cheap early stages instead of later
  pieces recomputing context; a piece reads at most ``keep`` frames per op from the one before.
- Balanced. :func:`decode_cost` is the decoder's work up to each latent frame as the pieces run it (the first with
  its look-ahead); the models cut pieces to equal work with it, so every rank does the same work.
- Bounded memory. A rank holds one piece at every stage (``frames_per_rank`` latent frames' worth, plus the
  look-ahead at the early stages in the first piece) and the frames it handed on until they have left (a few per
  op): independent of the video's length. Only the latents themselves (1/192 of the video's float size for
  LTX-Video) are whole on every rank.
- Outside :func:`decode_round` (or with one rank and one round) the decoder is diffusers' own, untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from diffusers.models.autoencoders.autoencoder_kl_ltx import (
    LTXVideoCausalConv3d,
    LTXVideoResnetBlock3d,
    LTXVideoUpsampler3d,
)
from diffusers.models.autoencoders.autoencoder_kl_ltx2 import (
    LTX2VideoCausalConv3d,
    LTX2VideoResnetBlock3d,
    LTX2VideoUpsampler3d,
)

from cp_infer import ParallelState
from cp_infer.decode import FrameRelay, Frames, TemporalSplit, video_index

__all__ = [
    "DecodeContext",
    "decode_cost",
    "decode_reads",
    "decode_round",
    "decoder_receptive_field",
    "parallelize_ltx2_decoder",
    "parallelize_ltx_decoder",
]

_CONVS = (LTXVideoCausalConv3d, LTX2VideoCausalConv3d)


@dataclass(frozen=True)
class _Op:
    """One temporal op: output frame ``j`` reads input frames ``j - lp .. j + rp`` (after an upsampler's
    depth-to-time by ``st``); a ``delay`` (a resnet's residual) reads frame ``j`` only."""

    kind: str  # "conv" | "up" | "delay"
    lp: int = 0
    rp: int = 0
    st: int = 1

    def need(self, o1: int, o2: int) -> tuple[int, int]:
        """Input frames ``[lo, hi)`` (unclamped) that output frames ``[o1, o2)`` read."""
        if self.kind == "delay":
            return o1, o2
        if self.kind == "up":
            # Output frame o is frame o + st - 1 of the depth-to-time of conv frames; the first st - 1 are dropped.
            o1, o2 = (o1 + self.st - 1) // self.st, (o2 + self.st - 2) // self.st + 1
        return o1 - self.lp, o2 + self.rp

    def out_length(self, t: int) -> int:
        return self.st * t - (self.st - 1)

    @property
    def keep(self) -> int:
        """The most frames before a piece's first frame that the piece can need (see ``_Plan.stage_ends``)."""
        return self.lp + self.rp + (1 if self.st > 1 else 0)


@dataclass(frozen=True)
class _Step:
    op: _Op
    unit: torch.nn.Module
    src: int
    dst: int
    conv: torch.nn.Module | None = None
    """The step's causal convolution (``None`` for a delay)."""


@dataclass(frozen=True)
class _Plan:
    """The temporal ops of a decoder in call order, and which frames of each stage a piece covers."""

    steps: tuple[_Step, ...]
    causal: bool | None

    @property
    def stages(self) -> int:
        return 1 + sum(step.op.kind != "delay" for step in self.steps)

    def _chain(self) -> list[_Op]:
        """``chain[s]`` makes stage ``s + 1`` from stage ``s``."""
        return [step.op for step in self.steps if step.op.kind != "delay"]

    def lengths(self, latent_frames: int) -> list[int]:
        out = [latent_frames]
        for op in self._chain():
            out.append(op.out_length(out[-1]))
        return out

    def stage_ends(self, video_end: int, lengths: list[int]) -> list[int]:
        """Where a piece that outputs video frames up to ``video_end`` ends at every stage: the end goes back through
        the chain as the last input frame the end needs. So no op reads past its piece's end (nothing is read
        ahead), nor more than ``op.keep`` frames before its start (an op's need grows with its output); the first
        piece runs ahead at the early stages by the decoder's right receptive field."""
        ends = [video_end]
        for op, t_in in zip(reversed(self._chain()), reversed(lengths[:-1]), strict=True):
            ends.append(0 if ends[-1] == 0 else min(t_in, op.need(ends[-1] - 1, ends[-1])[1]))
        return ends[::-1]

    def piece_cuts(self, video_range: tuple[int, int], lengths: list[int]) -> list[tuple[int, int]]:
        """The frames ``[lo, hi)`` at every stage of the piece that outputs video frames ``video_range``."""
        return list(zip(self.stage_ends(video_range[0], lengths), self.stage_ends(video_range[1], lengths),
                        strict=True))

    def op_weights(self) -> list[float]:
        """Multiply-adds per output frame of each op of the chain, in units of the latent frame's area."""
        weights, area = [], 1.0
        for step in self.steps:
            if step.op.kind == "delay":
                continue
            weights.append(_macs(step.conv.conv) * area / step.op.st)  # an upsampler's conv frame makes st frames
            if step.op.kind == "up":
                area *= step.unit.stride[1] * step.unit.stride[2]
        return weights


def _macs(conv: torch.nn.Conv3d) -> float:
    """Multiply-adds per output voxel."""
    return conv.out_channels * conv.in_channels // conv.groups * math.prod(conv.kernel_size)


def _pads(conv: torch.nn.Module, causal: bool) -> tuple[int, int]:
    k = conv.kernel_size[0]
    return (k - 1, 0) if causal else ((k - 1) // 2, (k - 1) // 2)


def _plan(decoder: torch.nn.Module, causal: bool | None) -> _Plan:
    """The decoder's temporal ops in the order its forward calls them (checked at run time)."""

    def is_causal(conv: torch.nn.Module) -> bool:
        return conv.is_causal if causal is None else causal

    units: list[torch.nn.Module] = [decoder.conv_in, *decoder.mid_block.resnets]
    for up in decoder.up_blocks:
        units += [up.conv_in] if up.conv_in is not None else []
        units += list(up.upsamplers) if up.upsamplers is not None else []
        units += list(up.resnets)
    units.append(decoder.conv_out)
    steps, stage = [], 0
    for unit in units:
        if isinstance(unit, _CONVS):
            steps.append(_Step(_Op("conv", *_pads(unit, is_causal(unit))), unit, stage, stage + 1, unit))
            stage += 1
        elif isinstance(unit, (LTXVideoUpsampler3d, LTX2VideoUpsampler3d)):
            steps.append(_Step(_Op("up", *_pads(unit.conv, is_causal(unit.conv)), unit.stride[0]), unit, stage,
                               stage + 1, unit.conv))
            stage += 1
        else:
            pads = [_pads(conv, is_causal(conv)) for conv in (unit.conv1, unit.conv2)]
            steps += [_Step(_Op("conv", *pads[0]), unit, stage, stage + 1, unit.conv1),
                      _Step(_Op("conv", *pads[1]), unit, stage + 1, stage + 2, unit.conv2),
                      # The residual waits for both convs' look-ahead: it keeps (rp1 + rp2) frames back.
                      _Step(_Op("delay", 0, pads[0][1] + pads[1][1]), unit, stage, stage + 2)]
            stage += 2
    return _Plan(tuple(steps), causal)


def decoder_receptive_field(vae: torch.nn.Module, *, causal: bool | None = None) -> tuple[int, int]:
    """``(before, after)``: how many latent frames before and after its own latent frame a video frame of the
    whole-video decode reads, at most (away from the ends of the video). ``causal`` is LTX-2's runtime switch."""
    decoder = vae.decoder
    plan = _plan(decoder, _runtime_causal(decoder, causal))
    latents = 256  # long enough that the middle frame sees no end of the video
    lengths = plan.lengths(latents)
    before = after = 0
    t = vae.temporal_compression_ratio
    for v in range(lengths[-1] // 2 - t, lengths[-1] // 2 + t):
        lo, hi = v, v + 1
        for op, t_in in zip(reversed(plan._chain()), reversed(lengths[:-1]), strict=True):
            lo, hi = op.need(lo, hi)
            lo, hi = max(0, lo), min(t_in, hi)
        own = (v + t - 1) // t  # video frame v belongs to latent frame ceil(v / t)
        before, after = max(before, own - lo), max(after, hi - 1 - own)
    return before, after


def decode_cost(vae: torch.nn.Module, latent_frames: int, *, causal: bool | None = None) -> tuple[float, ...]:
    """``cost[j]``: the decoder's multiply-adds (relative) for the video up to latent frame ``j``, as the streamed
    decode runs it (the first piece with its look-ahead): :class:`~cp_infer.decode.TemporalSplit`'s ``cost``."""
    decoder = vae.decoder
    plan = _plan(decoder, _runtime_causal(decoder, causal))
    lengths, weights = plan.lengths(latent_frames), plan.op_weights()
    t = plan.lengths(2)[-1] - plan.lengths(1)[-1]  # the decoder's own temporal compression
    cost = []
    for j in range(latent_frames + 1):
        ends = plan.stage_ends(video_index(j, t), lengths)
        cost.append(float(sum(w * e for w, e in zip(weights, ends[1:], strict=True))))
    return tuple(cost)


def _runtime_causal(decoder: torch.nn.Module, causal: bool | None) -> bool | None:
    """LTX-2 decoders pick causality at run time (``causal or decoder.is_causal``); LTX-Video's convs fix it."""
    if not any(isinstance(m, LTX2VideoCausalConv3d) for m in decoder.modules()):
        return None
    return bool(causal or decoder.is_causal)


@dataclass
class _Round:
    """The state of this rank's piece in flight (its piece of round ``index``)."""

    plan: _Plan
    split: TemporalSplit
    index: int
    piece: int
    cuts: list[tuple[int, int]]
    """The piece's frames ``[lo, hi)`` at every stage."""
    lengths: list[int]
    relay: FrameRelay
    call: int = -1
    step: int = 0


@dataclass
class DecodeContext:
    """The split of the decode in flight; owned by one model, set only inside its decode (``decode_split``)."""

    state: ParallelState
    split: TemporalSplit | None = None
    _round: _Round | None = field(default=None, repr=False)
    """This rank's piece in flight: set only inside :func:`decode_round`'s call of the decoder."""
    _last: _Round | None = field(default=None, repr=False)
    """This rank's previous piece of the decode in flight (its relay carries on into the next)."""
    _plans: dict[bool | None, _Plan] = field(default_factory=dict, repr=False)
    _decoder: torch.nn.Module | None = field(default=None, repr=False)

    def _begin_call(self) -> None:
        run = self._round
        if run is not None:
            # One call per spatial tile (diffusers' tiled decode): each keeps its own history.
            run.call, run.step = run.call + 1, 0

    def _end_call(self) -> None:
        run = self._round
        if run is not None and run.step != len(run.plan.steps):
            raise RuntimeError(f"the decoder ran {run.step} of its {len(run.plan.steps)} temporal ops")

    def _window(self, unit: torch.nn.Module, x: torch.Tensor, causal: bool | None = None
                ) -> tuple[Frames, tuple[int, int], int, _Op]:
        """The input frames of the next temporal op (the previous piece's last ones, then ``x``, this piece's), having
        handed on the ones the next piece reads: ``(frames, this piece's output frames, input length, op)``."""
        run = self._round
        if run.step >= len(run.plan.steps) or run.plan.steps[run.step].unit is not unit:
            raise RuntimeError(f"the decoder called {type(unit).__name__} where its plan has temporal op {run.step}; "
                               "its forward order is not the one parallelize_*_decoder knows")
        if causal is not None and run.plan.causal is not None and bool(causal) != run.plan.causal:
            raise RuntimeError(f"the decode was planned with causal={run.plan.causal} but the decoder ran with "
                               f"causal={causal}")
        step = run.plan.steps[run.step]
        key = (run.call, run.step)
        run.step += 1
        split, piece, keep = run.split, run.piece, step.op.keep
        lo, hi = run.cuts[step.src]
        if x.shape[2] != hi - lo:
            raise RuntimeError(f"temporal op {key[1]} got {x.shape[2]} frames, its piece is {lo}..{hi}")
        first = max(0, lo - keep)  # no op reads further back than its keep (see _Plan.stage_ends)
        pieces = [(lo, x)]
        if first < lo:
            pieces.insert(0, (first, run.relay.take_over(key, x, lo - first, src=split.owner(piece - 1))))
        frames = Frames(pieces, first, hi)
        if piece + 1 < split.pieces and max(0, hi - keep) < hi:
            # Before this op's work, so that the next piece (on another rank) can start the op as early as possible.
            run.relay.hand_on(key, frames.take(max(0, hi - keep), hi), to=split.owner(piece + 1))
        return frames, run.cuts[step.dst], run.lengths[step.src], step.op


def _take(frames: Frames, lo: int, hi: int, length: int) -> torch.Tensor:
    """Frames ``lo..hi`` of the stage, replicating the video's first and last frames beyond its ends, as the
    whole-video decode pads."""
    if lo >= 0 and hi <= length:
        return frames.take(lo, hi)
    parts = [frames.take(max(lo, 0), min(hi, length))]
    if lo < 0:
        parts = [frames.take(0, 1)] * -lo + parts
    if hi > length:
        parts += [frames.take(length - 1, length)] * (hi - length)
    return torch.cat(parts, dim=2)


def _conv(ctx: DecodeContext, unit: torch.nn.Module, conv: torch.nn.Module, x: torch.Tensor,
          causal: bool | None = None) -> torch.Tensor:
    frames, (o1, o2), length, op = ctx._window(unit, x, causal)
    if o1 == o2:
        return x.new_empty((x.shape[0], conv.out_channels, 0, *x.shape[3:]))
    return conv.conv(_take(frames, o1 - op.lp, o2 + op.rp, length))


def _conv_forward(conv: torch.nn.Module, ctx: DecodeContext, x: torch.Tensor, causal: bool | None = None):
    if ctx._round is None:
        return type(conv).forward(conv, x) if causal is None else type(conv).forward(conv, x, causal=causal)
    return _conv(ctx, conv, conv, x, causal)


def _depth_to_time(x: torch.Tensor, stride: tuple[int, int, int]) -> torch.Tensor:
    # B, C*st*sh*sw, F, H, W -> B, C, F*st, H*sh, W*sw (diffusers' upsampler layout)
    b, _, f, h, w = x.shape
    x = x.reshape(b, -1, *stride, f, h, w)
    return x.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _upsampler_forward(up: torch.nn.Module, ctx: DecodeContext, x: torch.Tensor, causal: bool | None = None):
    if ctx._round is None:
        return type(up).forward(up, x) if causal is None else type(up).forward(up, x, causal=causal)
    # Same maths as diffusers' forward, on the conv frames this rank's output piece reads.
    frames, (o1, o2), length, op = ctx._window(up, x, causal)
    st, sh, sw = up.stride
    if o1 == o2:
        return x.new_empty((x.shape[0], up.conv.out_channels // (st * sh * sw), 0, x.shape[3] * sh, x.shape[4] * sw))
    j1, j2 = op.need(o1, o2)
    j1, j2 = j1 + op.lp, j2 - op.rp
    skip = o1 + st - 1 - st * j1  # output frame o1 within the depth-to-time of conv frames j1..j2
    out = _depth_to_time(up.conv.conv(_take(frames, j1 - op.lp, j2 + op.rp, length)), up.stride)
    out = out[:, :, skip:skip + o2 - o1]
    if up.residual:
        residual = _depth_to_time(frames.take(j1, j2), up.stride)
        residual = residual.repeat(1, (st * sh * sw) // up.upscale_factor, 1, 1, 1)[:, :, skip:skip + o2 - o1]
        out = out + residual
    return out


def _noise(resnet: torch.nn.Module, h: torch.Tensor, scale: torch.Tensor | None, generator) -> torch.Tensor:
    if scale is None:
        return h
    # Drawn per call over space only, as diffusers does: each round redraws the same noise when the caller seeds
    # the generator the same way for every round (LTXVideoModel seeds the global one from the request).
    noise = torch.randn(h.shape[-2:], generator=generator, device=h.device, dtype=h.dtype)[None]
    return h + (noise * scale)[None, :, None, ...]


def _resnet_forward(resnet: torch.nn.Module, ctx: DecodeContext, inputs: torch.Tensor, temb=None, generator=None,
                    causal: bool | None = None):
    if ctx._round is None:
        if causal is None:
            return type(resnet).forward(resnet, inputs, temb, generator)
        return type(resnet).forward(resnet, inputs, temb, generator, causal=causal)
    # Same maths as diffusers' LTXVideoResnetBlock3d / LTX2VideoResnetBlock3d forward, except that the residual
    # is taken at the frames the two convolutions output (a delay op), not at the input's.
    ltx2 = isinstance(resnet, LTX2VideoResnetBlock3d)

    def norm(layer, h):
        return layer(h) if ltx2 else layer(h.movedim(1, -1)).movedim(-1, 1)

    h = norm(resnet.norm1, inputs)
    if resnet.scale_shift_table is not None:
        temb = temb.unflatten(1, (4, -1)) + resnet.scale_shift_table[None, ..., None, None, None]
        shift_1, scale_1, shift_2, scale_2 = temb.unbind(dim=1)
        h = h * (1 + scale_1) + shift_1
    h = _conv(ctx, resnet, resnet.conv1, resnet.nonlinearity(h), causal)
    h = _noise(resnet, h, resnet.per_channel_scale1, generator)
    h = norm(resnet.norm2, h)
    if resnet.scale_shift_table is not None:
        h = h * (1 + scale_2) + shift_2
    h = _conv(ctx, resnet, resnet.conv2, resnet.dropout(resnet.nonlinearity(h)), causal)
    h = _noise(resnet, h, resnet.per_channel_scale2, generator)
    residual = inputs
    if resnet.norm3 is not None:
        residual = resnet.norm3(residual.movedim(1, -1)).movedim(-1, 1)
    if resnet.conv_shortcut is not None:
        # A 1x1x1 convolution: per frame, so it runs before the delay, on the (narrower) input piece.
        shortcut = resnet.conv_shortcut if ltx2 else resnet.conv_shortcut.conv
        if residual.shape[2]:
            residual = shortcut(residual)
        else:  # conv3d refuses an empty input
            residual = residual.new_empty((residual.shape[0], shortcut.out_channels, 0, *residual.shape[3:]))
    frames, (o1, o2), _, _ = ctx._window(resnet, residual, causal)
    return h + (frames.take(o1, o2) if o1 < o2 else residual.narrow(2, 0, 0))


def _parallelize(vae: torch.nn.Module, ctx: DecodeContext, conv_cls, resnet_cls, upsampler_cls) -> None:
    decoder = vae.decoder
    if decoder.patch_size_t != 1:
        raise ValueError(f"patch_size_t={decoder.patch_size_t}: the final unpatchify would mix frames in time; the "
                         "time-parallel decode needs 1 (every LTX-Video and LTX-2 VAE has it)")
    plan = _plan(decoder, _runtime_causal(decoder, None))
    covered = set()
    for step in plan.steps:
        unit = step.unit
        convs = [unit] if isinstance(unit, conv_cls) else [unit.conv] if isinstance(unit, upsampler_cls) else \
            [unit.conv1, unit.conv2]
        covered.update(map(id, convs))
        if isinstance(unit, resnet_cls) and isinstance(unit.conv_shortcut, conv_cls):
            if unit.conv_shortcut.kernel_size[0] != 1:
                raise ValueError(f"a resnet shortcut with temporal kernel {unit.conv_shortcut.kernel_size[0]} is not "
                                 "supported by the time-parallel decode (diffusers' are 1x1x1)")
            covered.add(id(unit.conv_shortcut))
        for conv in convs:
            if conv.conv.stride[0] != 1 or conv.conv.dilation[0] != 1:
                raise ValueError(f"temporal stride/dilation {conv.conv.stride[0]}/{conv.conv.dilation[0]} in the "
                                 "decoder is not supported by the time-parallel decode")
            if conv.kernel_size[0] % 2 == 0:
                raise ValueError(f"temporal kernel {conv.kernel_size[0]} is even: a non-causal decode of it would "
                                 "shorten the video")
    stray = [name for name, m in decoder.named_modules() if isinstance(m, conv_cls) and id(m) not in covered]
    if stray:
        raise ValueError(f"temporal convolutions {stray} are outside the decoder layout the time-parallel decode "
                         "knows (conv_in, mid_block, up_blocks, conv_out)")
    for step in plan.steps:
        unit = step.unit
        if isinstance(unit, conv_cls):
            unit.forward = lambda x, causal=None, m=unit: _conv_forward(m, ctx, x, causal)
        elif isinstance(unit, upsampler_cls):
            unit.forward = lambda x, causal=None, m=unit: _upsampler_forward(m, ctx, x, causal)
        else:
            unit.forward = lambda x, temb=None, generator=None, causal=None, m=unit: _resnet_forward(
                m, ctx, x, temb, generator, causal)
    decoder.register_forward_pre_hook(lambda _m, _args: ctx._begin_call())
    decoder.register_forward_hook(lambda _m, _args, _out: ctx._end_call())
    ctx._decoder = decoder


def parallelize_ltx_decoder(vae: torch.nn.Module, ctx: DecodeContext) -> None:
    """Route an ``AutoencoderKLLTXVideo`` decoder's temporal ops through ``ctx`` (in place)."""
    _parallelize(vae, ctx, LTXVideoCausalConv3d, LTXVideoResnetBlock3d, LTXVideoUpsampler3d)


def parallelize_ltx2_decoder(vae: torch.nn.Module, ctx: DecodeContext) -> None:
    """Route an ``AutoencoderKLLTX2Video`` decoder's temporal ops through ``ctx`` (in place); its causality is
    the decoder's ``is_causal`` (the plan checks every call against it)."""
    _parallelize(vae, ctx, LTX2VideoCausalConv3d, LTX2VideoResnetBlock3d, LTX2VideoUpsampler3d)


def decode_round(vae: torch.nn.Module, ctx: DecodeContext, latents: torch.Tensor, a: int, b: int,
                 temb: torch.Tensor | None = None) -> torch.Tensor:
    """Decode this rank's piece of one round of ``ctx.split``: the video frames of latent frames ``[a, b)``.

    ``latents`` is the whole video's ``[B, C, F, H, W]`` on every rank. Every active rank calls this for every
    round, in order (a decode restarts at round 0); the frames the pieces hand each other pass inside
    (:class:`~cp_infer.decode.FrameRelay`). Returns ``[B, 3, F', H', W']`` exactly as ``vae.decode`` of the whole
    video returns for those frames (within float summation order).
    """
    split = ctx.split
    if split is None or ctx._decoder is not vae.decoder:
        raise RuntimeError("decode_round needs a split set on a context that parallelize_*_decoder applied to vae")
    if getattr(vae, "use_framewise_decoding", False):
        raise ValueError("use_framewise_decoding (diffusers' temporal tiling) and the streamed decode both cut time; "
                         "disable it")
    rank = ctx.state.cp_rank
    k = split.round_of(a)
    if (a, b) != split.latent_range(rank, k) or latents.shape[2] != split.latent_frames:
        raise ValueError(f"latent frames {a}..{b} of {latents.shape[2]} are not rank {rank}'s piece of "
                         f"round {k} of {split}")
    ctx._last, previous = None, ctx._last
    if split.pieces == 1:
        return vae.decode(latents, temb, return_dict=False)[0]
    if k > 0 and (previous is None or previous.split != split or previous.index != k - 1):
        raise RuntimeError(f"round {k} of the decode came before round {k - 1}")
    causal = _runtime_causal(vae.decoder, None)
    plan = ctx._plans.get(causal) or ctx._plans.setdefault(causal, _plan(vae.decoder, causal))
    lengths = plan.lengths(split.latent_frames)
    cuts = plan.piece_cuts(split.video_range(rank, k), lengths)
    relay = previous.relay if k > 0 else FrameRelay(ctx.state)
    run = _Round(plan, split, k, split.piece(rank, k), cuts, lengths, relay)
    ctx._round = run
    try:
        video = vae.decode(latents[:, :, cuts[0][0]:cuts[0][1]], temb, return_dict=False)[0]
    finally:
        ctx._round = None
    v0, v1 = split.video_range(rank, k)
    if video.shape[2] != v1 - v0:
        raise RuntimeError(f"rank {rank} decoded {video.shape[2]} frames in round {k}, expected {v1 - v0}")
    if k < split.rounds - 1:
        ctx._last = run
    else:
        relay.flush()  # this rank's last piece: what it handed on must have left before the decode returns
    return video


def decode_reads(vae: torch.nn.Module, split: TemporalSplit, a: int, b: int) -> int:
    """The latent frames ``[0, reads)`` that :func:`decode_round` of the piece ``[a, b)`` of ``split`` reads: its
    first stage's end (the decoder's look-ahead included); everything for a one-piece decode."""
    if split.pieces == 1:
        return split.latent_frames
    plan = _plan(vae.decoder, _runtime_causal(vae.decoder, None))
    video = (video_index(a, split.temporal_compression), video_index(b, split.temporal_compression))
    return plan.piece_cuts(video, plan.lengths(split.latent_frames))[0][1]
