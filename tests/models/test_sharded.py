"""One model across the group (``--weights sharded``, ``models.common.placement``): the transformer and the text encoder
sharded over the replica group with FSDP2, each rank reading only its rows, equal to the replicated run bit for bit
(frames, latents, LTX-2's waveform), for LTX-Video and LTX-2 at N = 2 and 3 Ulysses ranks and G = 2 guidance ranks,
and LTX-Video at N = 4 (G = 2 x U = 2).

Layouts: 2 = 1 x 2 (with a First-Block Cache that skips, and LTX-2 in two stages), 3 = 1 x 3 (shards that do not
divide), 2 = 2 x 1 (each guidance rank its own passes: LTX-Video without CFG leaves one rank with none, in one pass
and in windows; LTX-2's four passes are one call on one rank and two on the other, and a First-Block Cache decides
differently on the two ranks' contexts: every rank still runs every all-gather, ``cp_infer.weights.join_call`` /
``join_blocks``), 4 = 2 x 2 (LTX-Video: both at once, the weights in quarters).

NOTE(mmap-alignment): ``from_pretrained`` leaves a folder's weights as views into the memory-mapped safetensors file,
at the file's offsets, and the CPU's matrix-vector kernels (a batch of one, e.g. the timestep embedding without CFG)
pick their vectorised path by the data's 16-byte alignment, which changes their summation order (~1e-6). Gathered
shards sit in memory of their own (64-byte aligned), so the replicated reference here holds its transformer's and text
encoder's weights in memory of their own too; then equality is exact. (Against the memory-mapped replicated run the
frames are within one uint8 level: the last test.)
"""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ..worker_groups import groups_by_layout

LTX2_FOUR_PASSES = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                        modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7, audio_guidance_rescale=0.5)
LAYOUTS = [(2, 1), (3, 1), (2, 2)]
CASES = [*((family, layout) for family in ("ltx-video", "ltx2") for layout in [*LAYOUTS, (4, 2)]),
         ("ltx-video", (2, 1, 2))]
"""Each family at every layout of ``LAYOUTS`` and at 4 = 2 x 2 (a replica group of guidance x Ulysses ranks: each
guidance rank's passes over two Ulysses ranks, the weights in quarters); and LTX-Video over a ring of two (the
weights sharded over the replica group, the sequence round the ring)."""


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx_video.default import ensure_default_model

    return {"ltx-video": str(ensure_default_model()), "ltx2": str(ensure_default_ltx2_model()),
            "root": tmp_path_factory.mktemp("sharded")}


layouts = groups_by_layout()  # (world, guidance_degree) -> the session's shared group


def _open(state, folder: str, weights: str, offload=()):
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, weights=weights, offload=offload)
    model.decode_frames_per_rank = 1
    if weights == "replicated":  # NOTE(mmap-alignment)
        for module in (model.components.transformer, model.components.text_encoder):
            for param in module.parameters():
                param.data = param.data.clone()
    return model


def _run(state, folder: str, weights: str, requests: list[GenerationRequest], offload=(), traces: bool = False):
    """Per request ``(frames, latents, waveform, cache totals)`` (frames, latents and waveform on the delivering rank),
    with ``traces`` each pass's step-cache decisions on this rank; and what this rank holds."""
    from models.common.placement import measure_components
    from models.ltx2 import adapter as ltx2

    model = _open(state, folder, weights, offload)
    caches, make = [], ltx2.pass_cache

    def pass_cache(*args, **kwargs):
        caches.append(make(*args, **kwargs))
        return caches[-1]

    ltx2.pass_cache = pass_cache
    out = []
    try:
        for request in requests:
            got: dict = {}
            control = SampleControl(on_audio=lambda w, sr, got=got: got.update(waveform=w),
                                    on_latents=lambda arrays, got=got: got.update(latents=arrays),
                                    on_cache=lambda stats, got=got: got.update(cache=stats))
            frames = sample(model, request, state=state, control=control)
            out.append((frames, got.get("latents"), got.get("waveform"), got.get("cache")))
    finally:
        ltx2.pass_cache = make
    held = measure_components(model.components, model.placement)
    trace = [[(d.step, d.context, d.compute, d.metric) for d in c.trace] for c in caches] if traces else None
    return out, held, trace


def _ltx_video_requests(seed: int, world: int, guidance: int) -> list[GenerationRequest]:
    base = dict(prompt="a red fox runs through fresh snow", negative_prompt="blurry", num_inference_steps=2, fps=24)
    # 9 x 64 x 96 -> 12 latent tokens: uneven over 3 ranks only with padding
    requests = [GenerationRequest(**base, num_frames=9, height=64, width=96, guidance_scale=3.0, seed=seed),
                # no CFG: at G=2 the second guidance rank runs no pass and joins the first one's all-gathers
                GenerationRequest(**base, num_frames=9, height=64, width=96, guidance_scale=1.0, seed=seed + 1)]
    if (world, guidance) == (2, 1):
        # a First-Block Cache that skips: every Ulysses rank skips alike (no all-gather joined)
        requests.append(GenerationRequest.of(**dict(base, num_inference_steps=4), num_frames=9, height=64, width=96,
                                             guidance_scale=3.0, seed=seed + 2, cache="first_block",
                                             cache_threshold=1.0))
    if guidance == 2:
        # a long video in 3 windows without CFG (LTXI2VLongMultiPromptPipeline's plan): the idle rank joins there too
        requests.append(GenerationRequest(**base, num_frames=57, height=64, width=96, guidance_scale=1.0,
                                          seed=seed + 3, options=dict(temporal_tile_size=40, temporal_overlap=24)))
    return requests


def _ltx2_requests(seed: int, world: int, guidance: int) -> list[GenerationRequest]:
    base = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", height=64, width=96,
                num_inference_steps=2, fps=24)
    requests = [GenerationRequest.of(**base, **LTX2_FOUR_PASSES, num_frames=9, seed=seed),
                GenerationRequest.of(**base, num_frames=9, seed=seed + 1, guidance_scale=1.0)]
    if (world, guidance) == (2, 1):
        # two stages: half size, the latent upsampler, a distilled refine at full size
        requests.append(GenerationRequest.of(**dict(base, height=128, width=128, num_inference_steps=3), num_frames=9,
                                             seed=seed + 3, stages=2, max_sequence_length=128))
    return requests


def _assert_same(replicated, sharded, what: str) -> None:
    for i, (want, got) in enumerate(zip(replicated, sharded, strict=True)):
        assert np.array_equal(want[0], got[0]), f"{what} request {i}: frames differ (max {_diff(want[0], got[0])})"
        assert want[1].keys() == got[1].keys()
        for name in want[1]:
            assert np.array_equal(want[1][name], got[1][name]), f"{what} request {i}: {name} differ"
        assert (want[2] is None) == (got[2] is None)
        if want[2] is not None:
            assert np.array_equal(want[2], got[2]), f"{what} request {i}: waveform differs"
        assert want[3] == got[3], f"{what} request {i}: the caches decided differently"


def _diff(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


@pytest.mark.parametrize("family, layout", CASES,
                         ids=[f"{f}-world{w}-G{g}" + "".join(f"-R{r}" for r in ring) for f, (w, g, *ring) in CASES])
def test_sharded_equals_replicated(layouts, folders, family, layout):
    world, guidance, *ring = layout
    group = layouts(world, guidance, *ring)
    seed = random.randrange(2**31)
    requests = (_ltx_video_requests if family == "ltx-video" else _ltx2_requests)(seed, world, guidance)
    replicated = group.run(_run, folders[family], "replicated", requests)
    sharded = group.run(_run, folders[family], "sharded", requests)
    _assert_same(replicated[0][0], sharded[0][0], f"seed={seed} {family} {layout}")
    if (family, layout) == ("ltx-video", (2, 1)):
        assert sharded[0][0][2][3].blocks_saved > 0, "the First-Block request skipped nothing"
    for rank, (_, held, _) in enumerate(sharded):
        assert held.weights == "sharded" and replicated[rank][1].weights == "replicated"
        _assert_held_share(held, replicated[rank][1], folders[family], world)


def _assert_held_share(held, whole, folder: str, ranks: int) -> None:
    """Each rank holds at most 1/N of the transformer (and of the text encoder) plus one block's worth; the other
    components as the replicated rank does."""
    from models.common.placement import model_components

    mine, all_of = _bytes(held), _bytes(whole)
    plan = {c.name: c for c in model_components(folder, dtype="fp32")}
    for name in ("transformer", "text_encoder"):
        block = max(b.nbytes for b in plan[name].blocks)
        assert mine[name] <= all_of[name] / ranks + block, (name, mine[name], all_of[name], ranks, block)
        assert mine[name] == plan[name].shard_nbytes(ranks, held.rank), name  # the plan's bytes, to the byte
    assert {k: v for k, v in mine.items() if k not in plan or not plan[k].shardable} == {
        k: v for k, v in all_of.items() if k not in plan or not plan[k].shardable}


def _bytes(held) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _where, n in held.entries:
        out[name] = out.get(name, 0) + n
    return out


def test_guidance_ranks_deciding_differently_stay_in_step(layouts, folders):
    """G=2, LTX-2's four passes with a First-Block Cache: guidance rank 0 holds CFG's pair, rank 1 STG's and modality
    isolation's, each context deciding for itself. The threshold lies between the contexts' metrics at step 1 (a run
    that never skips measures them), so at that step some context skips its blocks and another runs them; every rank
    joins the all-gathers it does not use, and the sharded run is the replicated one."""
    group = layouts(2, 2)
    seed = random.randrange(2**31)
    base = dict(prompt="a drummer plays on a rainy street", negative_prompt="silence, blurry", height=64, width=96,
                num_inference_steps=4, fps=24, num_frames=9, seed=seed, **LTX2_FOUR_PASSES)
    free = group.run(_run, folders["ltx2"], "replicated",
                     [GenerationRequest.of(**base, cache="first_block", cache_threshold=0.0)], (), True)
    step1 = sorted(metric for _, _, trace in free for (step, _, _, metric) in trace[0] if step == 1)
    threshold = (step1[0] + step1[-1]) / 2
    request = GenerationRequest.of(**base, cache="first_block", cache_threshold=threshold)
    replicated = group.run(_run, folders["ltx2"], "replicated", [request], (), True)
    sharded = group.run(_run, folders["ltx2"], "sharded", [request], (), True)
    decisions = {context: compute for _, _, trace in sharded for (step, context, compute, _) in trace[0] if step == 1}
    assert set(decisions.values()) == {True, False}, f"seed={seed}: {decisions} (threshold {threshold})"
    assert [t for _, _, t in replicated] == [t for _, _, t in sharded], f"seed={seed}"
    _assert_same(replicated[0][0], sharded[0][0], f"seed={seed} mixed decisions")


_OFFLOAD = ("text_encoder", "vae", "transformer_blocks")


def test_offload_runs_and_changes_nothing_on_the_cpu(layouts, folders):
    """``--offload text_encoder,vae,transformer_blocks``: on the CPU the offload device is the device, so the same
    code runs (diffusers' group offloading for the replicated components, FSDP2's CPU offload for the shards) and
    the frames are those of the run without it. What only a GPU shows (the copies, the streams, pinned memory) is
    not tested here."""
    group = layouts(2, 1)
    request = GenerationRequest(prompt="a red fox", negative_prompt="blurry", num_inference_steps=2, fps=24,
                                num_frames=9, height=64, width=96, guidance_scale=3.0, seed=random.randrange(2**31))
    for weights in ("replicated", "sharded"):
        plain = group.run(_run, folders["ltx-video"], weights, [request])
        offloaded = group.run(_run, folders["ltx-video"], weights, [request], _OFFLOAD)
        _assert_same(plain[0][0], offloaded[0][0], f"{weights} offloaded")
        assert offloaded[0][1].offload == _OFFLOAD


def _open_error(state, folder: str) -> str | None:
    from models.common.loading import ModelLoadError

    try:
        _open(state, folder, "sharded")
    except ModelLoadError as exc:
        return str(exc)
    return None


def test_a_cut_short_weights_file_is_an_error_on_every_rank(layouts, folders):
    """The transformer's safetensors file cut short: every rank raises a ModelLoadError naming it (none is left
    waiting in a collective: the harness would time out)."""
    folder = folders["root"] / "short"
    shutil.copytree(folders["ltx-video"], folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    errors = layouts(3, 1).run(_open_error, str(folder))
    for message in errors:
        assert message and "transformer/" in message and "truncated" in message, message


def test_against_the_memory_mapped_replicated_run(layouts, folders):
    """The replicated run as it serves (its weights views into the safetensors files): a batch of one sums in
    another order (NOTE(mmap-alignment)), within one uint8 level."""
    group = layouts(2, 1)
    request = GenerationRequest(prompt="a red fox", negative_prompt="", num_inference_steps=2, fps=24, num_frames=9,
                                height=64, width=96, guidance_scale=1.0, seed=random.randrange(2**31))
    mapped = group.run(_mapped, folders["ltx-video"], request)
    sharded = group.run(_run, folders["ltx-video"], "sharded", [request])
    assert _diff(mapped[0], sharded[0][0][0][0]) <= 1


def _mapped(state, folder: str, request: GenerationRequest):
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, weights="replicated")
    model.decode_frames_per_rank = 1
    return sample(model, request, state=state)
