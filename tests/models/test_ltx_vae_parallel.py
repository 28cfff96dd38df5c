"""Time-parallel VAE decode: N ranks with halo exchange equal one whole-video decode.

The split changes which rank computes a frame, not what is computed: every convolution sees the same input
frames as in the whole decode. Only the convolution kernels may sum in another order on a shorter input,
so frames agree within 1 uint8 level (mean < 0.01 levels) and the float output within 1e-5.
"""

import random

import numpy as np
import pytest
import torch

from cp_infer.decode import TemporalSplit, decode_parallel

from ..harness import WorkerGroup

LATENT_FRAMES = [1, 2, 3, 5, 13]  # 13 latent frames = 97 video frames


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    from models.default import ensure_default_model

    path = tmp_path_factory.mktemp("cache")
    ensure_default_model(path)
    return str(path)


def _latents(seed, frames):
    gen = torch.Generator().manual_seed(seed + frames)
    return torch.randn(1, 16, frames, 2, 3, generator=gen)


def _decode(state, cache_dir, seed):
    from models.default import ensure_default_model
    from models.loading import load_ltx_video
    from models.ltx_video import LTXVideoModel

    model = LTXVideoModel(load_ltx_video(ensure_default_model(cache_dir)), state=state)
    vae, pipe = model.components.vae, model.pipe
    results = []
    for frames in LATENT_FRAMES:
        latents = _latents(seed, frames)
        timestep = torch.tensor([0.05])
        split = TemporalSplit(latent_frames=frames, world=state.cp_size)

        def decode_range(a, b, latents=latents, timestep=timestep, split=split):
            with torch.no_grad(), model.decode_split(split):
                video = vae.decode(latents[:, :, a:b], timestep, return_dict=False)[0]
            return (np.clip(pipe.video_processor.postprocess_video(video, output_type="np")[0], 0, 1) * 255
                    ).round().astype(np.uint8)

        chunks = list(decode_parallel(split, decode_range, frame_shape=(64, 96, 3), state=state))
        results.append(np.concatenate(chunks) if chunks else None)
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_time_parallel_decode_equals_whole_decode(cache_dir, world):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    whole = _decode(single_process_state(), cache_dir, seed)  # one rank: diffusers' own forward, untouched
    group = WorkerGroup(world)
    try:
        results = group.run(_decode, cache_dir, seed, timeout=300)
    finally:
        group.close()
    assert all(r is None for rank in results[1:] for r in rank)
    for frames, exp, got in zip(LATENT_FRAMES, whole, results[0], strict=True):
        assert exp.shape == (8 * (frames - 1) + 1, 64, 96, 3)
        assert exp.std() > 5, "degenerate decode: the comparison would prove nothing"
        assert got.shape == exp.shape, f"world={world} latent_frames={frames}"
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.01, \
            f"world={world} latent_frames={frames} seed={seed}: max {diff.max()} mean {diff.mean()}"


@pytest.mark.parametrize("latent_frames", [1, 2, 3, 7, 13, 33])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_temporal_split_tiles_the_video(latent_frames, world):
    split = TemporalSplit(latent_frames=latent_frames, world=world)
    covered = []
    for r in range(world):
        a, b = split.latent_range(r)
        v0, v1 = split.video_range(r)
        assert (a < b) == (r < split.active)
        covered.extend(range(v0, v1))
    assert covered == list(range(split.video_frames))
