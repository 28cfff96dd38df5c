"""Time-parallel decode for diffusers' ``AutoencoderKLLTXVideo``, applied from outside.

Inside :class:`DecodeContext` with a split set, every temporal convolution of the decoder takes its boundary
frames from the neighbouring ranks (:func:`cp_infer.decode.exchange_halo`) instead of replicating its own edge,
and each temporal upsampler drops its leading frames only on the first rank, where the whole video starts.
Outside the context the decoder behaves exactly as diffusers wrote it. Per-position ops (norms, activations,
the timestep modulation, the spatial parts of the convs) need nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoCausalConv3d, LTXVideoUpsampler3d

from cp_infer import ParallelState
from cp_infer.decode import TemporalSplit, exchange_halo

__all__ = ["DecodeContext", "parallelize_ltx_decoder"]


@dataclass
class DecodeContext:
    """The split of the decode in flight; owned by one model, set only inside ``LTXVideoModel.decode_split``."""

    state: ParallelState
    split: TemporalSplit | None = None

    @property
    def first(self) -> bool:
        return self.state.cp_rank == 0


def _conv_forward(conv: LTXVideoCausalConv3d, ctx: DecodeContext, x: torch.Tensor) -> torch.Tensor:
    if ctx.split is None or ctx.split.active == 1:
        return LTXVideoCausalConv3d.forward(conv, x)
    k = conv.kernel_size[0]
    left, right = (k - 1, 0) if conv.is_causal else ((k - 1) // 2, (k - 1) // 2)
    from_left, from_right = exchange_halo(x, left=left, right=right, split=ctx.split, state=ctx.state)
    parts = []
    if left:
        parts.append(from_left if from_left is not None else x[:, :, :1].repeat(1, 1, left, 1, 1))
    parts.append(x)
    if right:
        parts.append(from_right if from_right is not None else x[:, :, -1:].repeat(1, 1, right, 1, 1))
    return conv.conv(torch.cat(parts, dim=2))


def _upsampler_forward(up: LTXVideoUpsampler3d, ctx: DecodeContext, x: torch.Tensor) -> torch.Tensor:
    if ctx.split is None or ctx.split.active == 1:
        return LTXVideoUpsampler3d.forward(up, x)
    # Same maths as diffusers' forward; the first (st - 1) upsampled frames precede the video's first frame,
    # so only the rank that holds the start of the video drops them.
    b, _, f, h, w = x.shape
    st, sh, sw = up.stride
    drop = st - 1 if ctx.first else 0
    if up.residual:
        residual = x.reshape(b, -1, st, sh, sw, f, h, w)
        residual = residual.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)
        residual = residual.repeat(1, (st * sh * sw) // up.upscale_factor, 1, 1, 1)[:, :, drop:]
    out = up.conv(x).reshape(b, -1, st, sh, sw, f, h, w)
    out = out.permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(6, 7).flatten(4, 5).flatten(2, 3)[:, :, drop:]
    return out + residual if up.residual else out


def parallelize_ltx_decoder(vae: torch.nn.Module, ctx: DecodeContext) -> None:
    """Route the decoder's temporal convolutions and upsamplers through ``ctx`` (in place)."""
    for module in vae.decoder.modules():
        if isinstance(module, LTXVideoCausalConv3d):
            if module.conv.stride[0] != 1 or module.conv.dilation[0] != 1:
                raise ValueError(f"temporal stride/dilation {module.conv.stride[0]}/{module.conv.dilation[0]} in "
                                 "the decoder is not supported by the time-parallel decode")
            module.forward = lambda x, m=module: _conv_forward(m, ctx, x)
        elif isinstance(module, LTXVideoUpsampler3d):
            module.forward = lambda x, m=module: _upsampler_forward(m, ctx, x)
