"""Streamed, time-parallel VAE decode: N ranks in rounds equal one whole-video decode.

The split changes which rank computes a frame and when, not what is computed: every temporal op computes each
output frame from exactly the input frames the whole decode uses. Only a convolution's summation order may
differ on a shorter input (measured at most 7e-6 on outputs of order 1), so the float video agrees within
``atol=5e-5`` and the uint8 frames within 1 level (a value next to a rounding boundary), mean < 0.01 levels.
"""

import random

import numpy as np
import pytest
import torch

from cp_infer.decode import TemporalSplit, decode_parallel

from ..worker_groups import groups_by_world

LATENT_FRAMES = [1, 2, 3, 5, 13]  # 13 latent frames = 97 video frames
FRAMES_PER_RANK = [None, 1, 2]
ATOL = 5e-5  # float32 summation order inside a conv3d on a shorter input; see the module docstring


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from models.ltx_video.default import ensure_default_model

    path = tmp_path_factory.mktemp("cache")
    ensure_default_model(path)
    return str(path)


groups = groups_by_world()


def _latents(seed, frames, height=2, width=3):
    return torch.randn(1, 16, frames, height, width, generator=torch.Generator().manual_seed(seed + frames))


def _to_uint8(video):
    return (video.clamp(-1, 1) * 127.5 + 127.5).round().to(torch.uint8).numpy()


def _tiny_vae():
    from models.ltx_video.default import build_default_components

    return build_default_components()["vae"]


def _decode_rounds(state, vae, ctx, latents, temb, frames_per_rank, *, scoped=None, seed=None, balanced=False):
    """Decode ``latents`` over the group in rounds; returns the split and this rank's float pieces, in order.
    ``scoped(split)``: the model's context manager that sets the split (else it is set here); ``seed``: seeds the
    global RNG before every round, as LTXVideoModel does for noise-injecting decoders; ``balanced``: pieces cut to
    equal decoder work, as the models cut them (else to equal frames)."""
    import contextlib

    from models.common.ltx_vae_parallel import decode_cost, decode_round

    split = TemporalSplit(latent_frames=latents.shape[2], world=state.cp_size, frames_per_rank=frames_per_rank,
                          cost=decode_cost(vae, latents.shape[2]) if balanced else None)
    pieces = []

    @contextlib.contextmanager
    def set_split(split):
        ctx.split = split
        try:
            yield
        finally:
            ctx.split = None

    def decode_range(a, b):
        with torch.no_grad(), (scoped or set_split)(split):
            if seed is not None:
                torch.manual_seed(seed)
            video = decode_round(vae, ctx, latents, a, b, temb)
        pieces.append(video)
        return np.zeros((video.shape[2], 1), np.uint8)  # the float video travels back through the test harness

    for _ in decode_parallel(split, decode_range, frame_shape=(1,), state=state):
        pass
    return split, pieces


def _model_decode(state, cache_dir, seed):
    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    model = LTXVideoModel(load_ltx_video(ensure_default_model(cache_dir)), state=state)
    out = {}
    for frames in LATENT_FRAMES:
        for frames_per_rank in FRAMES_PER_RANK:
            _, pieces = _decode_rounds(state, model.components.vae, model._decode_ctx, _latents(seed, frames),
                                       torch.tensor([0.05]), frames_per_rank, scoped=model.decode_split,
                                       balanced=True)
            out[frames, frames_per_rank] = pieces
    return out


def _assemble(results):
    """Every rank's pieces, in temporal order (rounds, then ranks), as one float video."""
    rounds = max(len(r) for r in results)
    return torch.cat([r[k] for k in range(rounds) for r in results if k < len(r)], dim=2)


def _assert_equal(got, whole, what):
    assert got.shape == whole.shape, what
    torch.testing.assert_close(got, whole, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}")
    a, b = _to_uint8(got), _to_uint8(whole)
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.01, f"{what}: max {diff.max()} mean {diff.mean()}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_streamed_parallel_decode_equals_whole_decode(cache_dir, groups, world):
    from cp_infer import single_process_state
    from models.ltx_video.adapter import LTXVideoModel
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    seed = random.randrange(2**31)
    vae = LTXVideoModel(load_ltx_video(ensure_default_model(cache_dir)), state=single_process_state()).components.vae
    results = groups(world).run(_model_decode, cache_dir, seed, timeout=600)
    for frames in LATENT_FRAMES:
        latents = _latents(seed, frames)
        with torch.no_grad():
            whole = vae.decode(latents, torch.tensor([0.05]), return_dict=False)[0]  # diffusers' own forward
        assert whole.shape[2] == 8 * (frames - 1) + 1
        assert whole.std() > 0.1, "degenerate decode: the comparison would prove nothing"
        for frames_per_rank in FRAMES_PER_RANK:
            got = _assemble([r[frames, frames_per_rank] for r in results])
            _assert_equal(got, whole, f"world={world} latent_frames={frames} frames_per_rank={frames_per_rank} "
                                      f"seed={seed}")


def test_receptive_field_is_the_one_the_decoder_has():
    """The plan's dependency model (which input frames each op reads) against the real module: perturbing one
    latent frame changes exactly the video frames the plan says read it."""
    from diffusers import AutoencoderKLLTXVideo

    from models.common.ltx_vae_parallel import decoder_receptive_field

    with torch.device("meta"):
        assert decoder_receptive_field(AutoencoderKLLTXVideo()) == (24, 24)  # LTX-Video 0.9.0 (measured alike)
    vae = _tiny_vae()
    before, after = decoder_receptive_field(vae)
    assert (before, after) == (7, 7)
    frames, k = 2 * (before + after) + 3, before + after + 1
    latents = _latents(random.randrange(2**31), frames)
    changed = latents.clone()
    changed[:, :, k] += torch.randn(changed[:, :, k].shape)
    with torch.no_grad():
        a = vae.decode(latents, torch.tensor([0.05]), return_dict=False)[0]
        b = vae.decode(changed, torch.tensor([0.05]), return_dict=False)[0]
    moved = (a - b).abs().amax(dim=(0, 1, 3, 4))
    own = [(v + 7) // 8 for v in range(a.shape[2])]  # the latent frame each video frame belongs to
    reads = [k - after <= g <= k + before for g in own]
    assert all(moved[v] == 0 for v in range(a.shape[2]) if not reads[v]), "a frame outside the field changed"
    for edge in (k - after, k + before):
        assert any(moved[v] > 0 for v in range(a.shape[2]) if own[v] == edge), "the field is wider than the decoder's"


def _long_decode(state, latent_frames, frames_per_rank, seed):
    from models.common.ltx_vae_parallel import DecodeContext, parallelize_ltx_decoder

    vae = _tiny_vae()
    ctx = DecodeContext(state=state)
    parallelize_ltx_decoder(vae, ctx)
    biggest = [0]

    def record(_module, _args, out):
        if isinstance(out, torch.Tensor):
            biggest[0] = max(biggest[0], out.numel())

    for module in vae.decoder.modules():
        module.register_forward_hook(record)
    _, pieces = _decode_rounds(state, vae, ctx, _latents(seed, latent_frames), torch.tensor([0.05]), frames_per_rank)
    return pieces, biggest[0]


@pytest.mark.parametrize("world", [1, 2])
def test_long_video_decodes_with_bounded_memory(groups, world):
    """257 frames: exact, and no activation on any rank larger than for a 129-frame video (memory does not grow
    with the length), while the whole-video decode's largest is ~4x that of one round."""
    seed = random.randrange(2**31)
    long = groups(world).run(_long_decode, 33, 2, seed, timeout=600)
    half = groups(world).run(_long_decode, 17, 2, seed, timeout=600)
    whole = groups(1).run(_long_decode, 33, None, seed, timeout=600)[0]
    with torch.no_grad():
        reference = _tiny_vae().decode(_latents(seed, 33), torch.tensor([0.05]), return_dict=False)[0]
    assert reference.shape[2] == 257
    _assert_equal(_assemble([pieces for pieces, _ in long]), reference, f"world={world} seed={seed}")
    peak_long = max(b for _, b in long)
    # Equal in practice; 5% for a round that rounds one frame differently.
    assert peak_long <= 1.05 * max(b for _, b in half), "the largest activation grew with the video's length"
    assert peak_long * 3 < whole[1], f"a round's largest activation {peak_long} is not well below the whole decode's"
    assert max(p.shape[2] for rank in long for p in rank[0]) <= 16


def _tiled_decode(state, seed):
    from models.common.ltx_vae_parallel import DecodeContext, parallelize_ltx_decoder

    vae = _tiny_vae()
    # Tiles of 2x2 latent pixels at stride 1 on a 4x6 latent frame: overlapping tiles, blended.
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    ctx = DecodeContext(state=state)
    parallelize_ltx_decoder(vae, ctx)
    calls = [0]
    vae.decoder.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    _, pieces = _decode_rounds(state, vae, ctx, _latents(seed, 9, 4, 6), torch.tensor([0.05]), 1)
    return pieces, calls[0]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_spatially_tiled_frames_decode_alike(groups, world):
    """Large frames: diffusers' spatial tiles inside every round; equal to diffusers' tiled whole-video decode."""
    seed = random.randrange(2**31)
    results = groups(world).run(_tiled_decode, seed, timeout=600)
    vae = _tiny_vae()
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=32,
                      tile_sample_stride_width=32)
    tiles = [0]
    vae.decoder.register_forward_pre_hook(lambda *_: tiles.__setitem__(0, tiles[0] + 1))
    with torch.no_grad():
        whole = vae.decode(_latents(seed, 9, 4, 6), torch.tensor([0.05]), return_dict=False)[0]
    assert whole.shape == (1, 3, 65, 128, 192) and tiles[0] > 1
    split = TemporalSplit(latent_frames=9, world=world, frames_per_rank=1)
    assert results[0][1] == tiles[0] * split.rounds, "every round must decode every spatial tile"
    _assert_equal(_assemble([pieces for pieces, _ in results]), whole, f"world={world} seed={seed}")


def _ltx2_vae(causal):
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(0)
    return AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(16, 32, 32, 32),
        decoder_block_out_channels=(8, 16, 32), layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(True, False, True, False), downsample_type=("spatial", "temporal", "spatiotemporal",
                                                                          "spatiotemporal"),
        upsample_residual=(True, True, True), upsample_factor=(2, 2, 2), timestep_conditioning=True, patch_size=4,
        patch_size_t=1, encoder_causal=True, decoder_causal=causal, spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    ).eval()


def _ltx2_decode(state, causal, seed, frames_per_rank):
    from models.common.ltx_vae_parallel import DecodeContext, parallelize_ltx2_decoder

    vae = _ltx2_vae(causal)
    with torch.no_grad():  # the injected noise scales start at zero: give them weight so they are exercised
        for name, p in vae.decoder.named_parameters():
            if "per_channel_scale" in name:
                p.normal_(0, 0.5)
    ctx = DecodeContext(state=state)
    parallelize_ltx2_decoder(vae, ctx)
    latents = _latents(seed, 13)
    # The injected noise: seeded alike on every rank and in every round, each draws the whole decode's.
    return {fpr: _decode_rounds(state, vae, ctx, latents, torch.tensor([0.05]), fpr, seed=seed)[1]
            for fpr in frames_per_rank}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_ltx2_decoder_parallel_equals_one_rank(groups, world, causal):
    seed = random.randrange(2**31)
    reference = groups(1).run(_ltx2_decode, causal, seed, [None], timeout=600)[0][None][0]  # diffusers' own
    assert reference.shape == (1, 3, 97, 64, 96) and reference.std() > 0.05
    results = groups(world).run(_ltx2_decode, causal, seed, [None, 1, 2], timeout=600)
    for fpr in (None, 1, 2):
        _assert_equal(_assemble([r[fpr] for r in results]), reference,
                      f"world={world} causal={causal} frames_per_rank={fpr} seed={seed}")
