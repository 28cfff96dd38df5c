"""Guidance parallelism: a step's guidance passes spread over ranks (alone, and with Ulysses), equal to 1 rank.

Layouts (world = guidance x Ulysses): 2 = 2 x 1 (LTX-Video's CFG pair, one pass per rank; without CFG one pass on
two ranks, the second idle; an image and a condition clip; a long video from an image in windows; LTX-2 with three
passes, uneven on two ranks, also in windows), 4 = 2 x 2
(both models, every LTX-2 guidance with the rescale's std over the Ulysses group), 3 = 3 x 1 (LTX-2's default
guidance: CFG's pair, STG and modality isolation, shared 2 + 1 + 1).

Tolerances are the Ulysses tests' (tests/models/ltx_video/test_parallel.py, ltx2/test_parallel.py), for the same
reason: the maths is the same, but a pass run in a batch of one instead of CFG's batch of two, or over a shard, may
sum its matmuls in another order (fp32, ~1e-6 relative), which can flip a rounding to uint8: frames within 1 level
and on average 0.01 (LTX-Video) / 0.02 (LTX-2), the waveform within 1e-4.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer.request import Condition, GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ..worker_groups import groups_by_layout

LTX2_THREE_PASSES = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                         modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.7,
                         audio_guidance_rescale=0.5)
LTX2_FOUR_PASSES = dict(LTX2_THREE_PASSES, modality_scale=2.0, audio_modality_scale=1.5)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx_video.default import ensure_default_model

    root = tmp_path_factory.mktemp("guidance")
    return {"ltx-video": str(ensure_default_model(root / "ltx")), "ltx2": str(ensure_default_ltx2_model(root / "ltx2"))}


layouts = groups_by_layout()  # (world, guidance_degree) -> the session's shared group


def _media(rng: np.random.Generator, frames: int, height: int, width: int) -> np.ndarray:
    """A colour gradient with noise: uint8 [F, H, W, 3], never flat."""
    y, x = np.mgrid[0:height, 0:width]
    out = [np.clip(np.stack([(x * 3 + f * 9) % 256, (y * 5 + f * 4) % 256, ((x + y) * 2 + f * 13) % 256], axis=-1)
                   + rng.integers(-30, 30, (height, width, 3)), 0, 255) for f in range(frames)]
    return np.ascontiguousarray(np.stack(out).astype(np.uint8))


def _ltx_video_requests(seed: int, *, conditioned: bool) -> list[GenerationRequest]:
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=2, fps=24)
    # 9 x 64 x 96 -> 2 x 2 x 3 = 12 latent tokens: uneven over 2 Ulysses ranks with padding only past 4
    requests = [GenerationRequest(**base, num_frames=9, height=64, width=96, guidance_scale=3.0, seed=seed)]
    if conditioned:
        rng = np.random.default_rng(seed)
        requests += [
            # no CFG: one pass on two guidance ranks, the second runs none
            GenerationRequest(**base, num_frames=9, height=64, width=96, guidance_scale=1.0, seed=seed + 1),
            # image-to-video (LTXImageToVideoPipeline): per-token timesteps of the CFG pair
            GenerationRequest(**base, num_frames=9, height=64, width=96, guidance_scale=3.0, seed=seed + 2,
                              image=Condition(_media(rng, 1, 50, 70))),
            # conditions (LTXConditionPipeline): a clip at frame 8 adds its own tokens and coordinates
            GenerationRequest(**base, num_frames=17, height=32, width=64, guidance_scale=3.0, seed=seed + 3,
                              conditions=(Condition(_media(rng, 9, 32, 64), 8, 0.8),)),
            # a long video from an image, window by window (LTXI2VLongMultiPromptPipeline): 3 windows
            GenerationRequest(**base, num_frames=57, height=64, width=96, guidance_scale=3.0, seed=seed + 4,
                              image=Condition(_media(rng, 1, 64, 96)),
                              options=dict(temporal_tile_size=40, temporal_overlap=24)),
        ]
    return requests


def _ltx2_requests(seed: int, guidance: dict | None, *, windows: bool = False) -> list[GenerationRequest]:
    """``guidance=None``: the model's declared defaults (CFG, STG, modality isolation and the rescale all on);
    ``windows``: also a long video made in 3 windows (``models.ltx2.windows``)."""
    base = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", height=64, width=96,
                num_inference_steps=2, fps=24, **(guidance or {}))
    requests = [GenerationRequest.of(**base, num_frames=9, seed=seed)]
    if windows:
        requests.append(GenerationRequest.of(**base, num_frames=73, seed=seed + 1, temporal_tile_size=48,
                                             temporal_overlap=24))
    return requests


def _sample(state, family: str, folder: str, requests: list[GenerationRequest]) -> list[tuple]:
    """``(frames, audio)`` per request; ``audio``: the soundtrack handed to ``on_audio`` (LTX-2), else empty."""
    if family == "ltx-video":
        from models.ltx_video.adapter import LTXVideoModel
        from models.ltx_video.loading import load_ltx_video

        model = LTXVideoModel(load_ltx_video(folder), state=state)
    else:
        from models.ltx2.adapter import LTX2Model
        from models.ltx2.loading import load_ltx2

        model = LTX2Model(load_ltx2(folder), state=state)
    model.decode_frames_per_rank = 1
    out = []
    for request in requests:
        audio: dict = {}
        frames = sample(model, request, state=state,
                        control=SampleControl(on_audio=lambda w, sr, a=audio: a.update(waveform=w, sample_rate=sr)))
        out.append((frames, audio))
    return out


def _one_rank(family: str, folder: str, requests: list[GenerationRequest]) -> list[tuple]:
    from cp_infer import single_process_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in every worker rank
    try:
        return _sample(single_process_state(), family, folder, requests)
    finally:
        torch.set_num_threads(threads)


def _check(results: list[list[tuple]], expected: list[tuple], *, mean_levels: float, what: str) -> None:
    assert all(frames is None and not audio for rank in results[1:] for frames, audio in rank), \
        f"{what}: only the mesh's first rank returns frames and audio"
    for (exp, exp_audio), (got, got_audio) in zip(expected, results[0], strict=True):
        assert got.shape == exp.shape
        assert exp.std() > 5, "degenerate video: the comparison would prove nothing"
        diff = np.abs(got.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < mean_levels, f"{what}: max {diff.max()} mean {diff.mean()}"
        assert got_audio.keys() == exp_audio.keys()
        if exp_audio:
            assert np.abs(exp_audio["waveform"]).max() > 1e-3, "silent soundtrack: the comparison would prove nothing"
            np.testing.assert_allclose(got_audio["waveform"], exp_audio["waveform"], rtol=0, atol=1e-4, err_msg=what)


@pytest.mark.parametrize(("world", "guidance", "conditioned"), [(2, 2, True), (4, 2, False)],
                         ids=["G2", "G2xU2"])
def test_ltx_video_guidance_layouts_equal_one_rank(folders, layouts, world, guidance, conditioned):
    seed = random.randrange(2**31)
    requests = _ltx_video_requests(seed, conditioned=conditioned)
    expected = _one_rank("ltx-video", folders["ltx-video"], requests)
    results = layouts(world, guidance).run(_sample, "ltx-video", folders["ltx-video"], requests, timeout=300)
    _check(results, expected, mean_levels=0.01, what=f"world={world} G={guidance} seed={seed}")


@pytest.mark.parametrize(("world", "guidance", "settings"),
                         [(2, 2, LTX2_THREE_PASSES), (4, 2, LTX2_FOUR_PASSES), (3, 3, None)],
                         ids=["G2-3passes", "G2xU2-4passes", "G3-defaults"])
def test_ltx2_guidance_layouts_equal_one_rank(folders, layouts, world, guidance, settings):
    seed = random.randrange(2**31)
    requests = _ltx2_requests(seed, settings, windows=world == 2)
    expected = _one_rank("ltx2", folders["ltx2"], requests)
    results = layouts(world, guidance).run(_sample, "ltx2", folders["ltx2"], requests, timeout=300)
    _check(results, expected, mean_levels=0.02, what=f"world={world} G={guidance} seed={seed}")


def _layout_of(state) -> tuple:
    from cp_infer.collectives import gather_passes
    from cp_infer.mesh import pass_shares

    # Uneven shares (3 passes over the guidance group) with two streams of other shapes, values naming their pass.
    passes = 3
    share = pass_shares(passes, state.guidance_size)[state.guidance_rank]
    local = {"a": torch.tensor([[float(p)] * 4 for p in share]).reshape(len(share), 2, 2),
             "b": torch.tensor([[10.0 + p] * 3 for p in share]).reshape(len(share), 3)}
    every = gather_passes(local, passes=passes, state=state)
    # The decode runs over the whole mesh: its group is every rank, and a message goes round its ring.
    decoding = state.decoding
    token = torch.tensor([float(state.rank)])
    torch.distributed.all_reduce(token, group=decoding.cp_group)
    return (state.guidance_rank, state.guidance_ranks, state.cp_rank, state.cp_ranks,
            every["a"].tolist(), every["b"].tolist(), decoding.cp_rank, decoding.cp_ranks, token.item())


def test_groups_follow_the_mesh_and_the_exchange_orders_passes(layouts):
    """At 2 x 2: guidance groups stride over the Ulysses groups (ranks {0, 2} and {1, 3}); the exchange returns every
    pass in order on every rank, the 3 passes shared 2 + 1."""
    got = layouts(4, 2).run(_layout_of)
    a = torch.arange(3.0)[:, None, None].expand(3, 2, 2).tolist()
    b = (10 + torch.arange(3.0))[:, None].expand(3, 3).tolist()
    mesh = ((0, 1, 2, 3), 6.0)
    assert got == [(0, (0, 2), 0, (0, 1), a, b, 0, *mesh), (0, (1, 3), 1, (0, 1), a, b, 1, *mesh),
                   (1, (0, 2), 0, (2, 3), a, b, 2, *mesh), (1, (1, 3), 1, (2, 3), a, b, 3, *mesh)]
