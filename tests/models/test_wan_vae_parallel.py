"""Streamed, time-parallel Wan VAE decode: N ranks in rounds equal diffusers' ``AutoencoderKLWan.decode``, bit for bit.

The split changes which rank makes each of the decoder's calls and in which order, not the calls: every module runs
on the chunk (one latent frame's worth) and cache slot that diffusers' frame-at-a-time loop gives it, so the video is
the same tensor (no tolerance), for Wan 2.1's VAE (z_dim 16) and Wan 2.2 TI2V-5B's (z_dim 48, residual up blocks
with DupUp3D, 2x2 patches), with 1, 2 and 5 latent frames (fewer than the ranks; 5 divides neither 2 nor 3). A rank
decoding the whole video alone runs diffusers' own loop; two or more run their pieces op by op. Both sides run on
one thread: the thread count alone changes how a convolution's sum is split.
"""

import random

import numpy as np
import pytest
import torch

from cp_infer.decode import TemporalSplit, decode_parallel

from ..harness import one_thread
from ..worker_groups import groups_by_world

VARIANTS = ["wan2.1", "wan2.2"]
LATENT_FRAMES = [1, 2, 5]  # 5 latent frames = 17 video frames: 2 rounds at 2 and 3 ranks with 1 per rank
FRAMES_PER_RANK = [None, 1, 2]

groups = groups_by_world()


def _vae(variant):
    """A tiny VAE of each layout (``models.wan.default``'s: the real compression, narrow channels), weights from a
    fixed seed, so every rank builds the same one."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    if variant == "wan2.2":
        return AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                                temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                                out_channels=12, patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16).eval()
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _latents(vae, seed, frames):
    return torch.randn(1, vae.config.z_dim, frames, 2, 3, generator=torch.Generator().manual_seed(seed + frames))


def _decode_all(state, seed):
    """``{(variant, frames, frames_per_rank): (this rank's float pieces in order, latent frames its conv_in saw)}``."""
    from models.common.wan_vae_parallel import WanStreamedDecode, decode_cost

    out = {}
    for variant in VARIANTS:
        vae = _vae(variant)
        seen = [0]
        vae.decoder.conv_in.register_forward_pre_hook(
            lambda _m, args, seen=seen: seen.__setitem__(0, seen[0] + args[0].shape[2]))
        for frames in LATENT_FRAMES:
            latents = _latents(vae, seed, frames)
            for frames_per_rank in FRAMES_PER_RANK:
                split = TemporalSplit(latent_frames=frames, world=state.cp_size, temporal_compression=4,
                                      frames_per_rank=frames_per_rank, cost=decode_cost(vae, frames))
                with torch.no_grad():
                    decode = WanStreamedDecode(vae, vae.post_quant_conv(latents), split, state)
                pieces, seen[0] = [], 0

                def decode_range(a, b, decode=decode, pieces=pieces):
                    video = decode(a, b)
                    pieces.append(video)
                    return np.zeros((video.shape[2], 1), np.uint8)  # the float video travels back through the harness

                for _ in decode_parallel(split, decode_range, frame_shape=(1,), state=state):
                    pass
                out[variant, frames, frames_per_rank] = (pieces, seen[0])
    return out


def _assemble(results):
    """Every rank's pieces, in temporal order (rounds, then ranks), as one float video."""
    rounds = max(len(r) for r in results)
    return torch.cat([r[k] for k in range(rounds) for r in results if k < len(r)], dim=2)


@pytest.fixture(scope="module")
def references():
    """``(seed, {(variant, frames): diffusers' own frame-at-a-time vae.decode})``."""
    seed, out = random.randrange(2**31), {}
    for variant in VARIANTS:
        vae = _vae(variant)
        for frames in LATENT_FRAMES:
            with torch.no_grad():
                whole = one_thread(lambda latents, vae=vae: vae.decode(latents, return_dict=False)[0],
                                   _latents(vae, seed, frames))
            assert whole.shape[2] == 4 * (frames - 1) + 1
            assert whole.std() > 0.1, "degenerate decode: the comparison would prove nothing"
            out[variant, frames] = whole
    return seed, out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_streamed_parallel_decode_is_diffusers_decode(groups, references, world):
    from cp_infer import single_process_state
    from models.common.wan_vae_parallel import decode_cost

    seed, wholes = references
    if world == 1:  # in this process: a worker's start costs more than the decode
        results = [one_thread(_decode_all, single_process_state(), seed)]
    else:
        results = groups(world).run(_decode_all, seed, timeout=600)
    for variant in VARIANTS:
        vae = _vae(variant)
        for frames in LATENT_FRAMES:
            whole = wholes[variant, frames]
            for frames_per_rank in FRAMES_PER_RANK:
                what = f"{variant} world={world} latent_frames={frames} frames_per_rank={frames_per_rank} seed={seed}"
                runs = [r[variant, frames, frames_per_rank] for r in results]
                got = _assemble([pieces for pieces, _ in runs])
                assert got.shape == whole.shape, what
                assert torch.equal(got, whole), f"{what}: max diff {(got - whole).abs().max().item()}"
                # Nothing decoded twice: each rank ran its own latent frames only, and more than one rank did.
                split = TemporalSplit(latent_frames=frames, world=world, temporal_compression=4,
                                      frames_per_rank=frames_per_rank, cost=decode_cost(vae, frames))
                assert [seen for _, seen in runs] == [
                    sum(b - a for a, b in (split.latent_range(r, k) for k in range(split.rounds)))
                    if r < split.active else 0 for r in range(world)], what


@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_cost_is_the_decoders_convolutions(variant):
    """decode_cost counts what the decoder runs: FlopCounterMode's convolution flops (2 per multiply-add) of diffusers'
    own decode of 1 and of 3 latent frames, latent frame 0 a quarter of any later one's time-upsampled work."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.common.wan_vae_parallel import decode_cost

    vae = _vae(variant)
    cost = decode_cost(vae, 3)
    assert cost[0] == 0 and cost[2] - cost[1] == cost[3] - cost[2] > 2 * cost[1]
    for frames in (1, 3):
        latents = _latents(vae, 0, frames)
        counter = FlopCounterMode(display=False)
        with torch.no_grad():
            x = vae.post_quant_conv(latents)
        with torch.no_grad(), counter:
            vae.clear_cache()
            for i in range(frames):
                vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=[0], first_chunk=i == 0)
        convs = sum(n for op, n in counter.get_flop_counts()["Global"].items() if "convolution" in str(op))
        assert convs == 2 * cost[frames] * latents.shape[3] * latents.shape[4]


def test_refuses_what_it_cannot_decode_alike():
    from cp_infer import single_process_state
    from models.common.wan_vae_parallel import WanStreamedDecode

    vae = _vae("wan2.1")
    x = torch.zeros(1, 16, 3, 3, 5)
    vae.enable_tiling()
    with pytest.raises(ValueError, match="use_tiling"):
        WanStreamedDecode(vae, x, TemporalSplit(latent_frames=3, world=1, temporal_compression=4),
                          single_process_state())
    vae.disable_tiling()
    with pytest.raises(ValueError, match="the latents have 3 frames, the split 4"):
        WanStreamedDecode(vae, x, TemporalSplit(latent_frames=4, world=1, temporal_compression=4),
                          single_process_state())
    decode = WanStreamedDecode(vae, x, TemporalSplit(latent_frames=3, world=1, temporal_compression=4,
                                                     frames_per_rank=1), single_process_state())
    with pytest.raises(RuntimeError, match="rounds run in order"):
        decode(1, 2)


def test_auto_decodes_small_frames_on_one_rank():
    """Below 48x48 frames two ranks lost to one on the measuring machine (``MIN_PARALLEL_PIXELS``): ``auto`` keeps
    them on one; from there on every rank decodes."""
    from models.common.wan_vae_parallel import decode_world

    assert decode_world(3, height=32, width=32) == decode_world(2, height=16, width=80) == 1
    assert decode_world(3, height=48, width=48) == 3 and decode_world(2, height=480, width=832) == 2
    assert decode_world(1, height=480, width=832) == 1
