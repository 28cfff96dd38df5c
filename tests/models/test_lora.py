"""Per-request LoRA adapters (``models.common.lora``) on both tiny models: at 1 rank each request of an interleaved
sequence
(a, none, b, a+b, c in Lightricks'/ComfyUI's key layout, a) on one loaded model is bit-identical to diffusers'
pipeline given the same adapters (``load_lora_weights`` + ``set_adapters``, or ``disable_lora``), and the base
weights are unchanged after; N = 2 (guidance 2 x Ulysses 1) and 3 (Ulysses 3) ranks equal 1 rank; a two-stage
image-to-video request and a long video made window by window, each pass with the request's adapters, equal
diffusers' recipes; the LRU evicts and reloads; a file that cannot load on one rank fails the job on every rank and
the next job runs; the front end's checks refuse what cannot apply, from the files' headers.

The adapters are random (``tests.lora_adapters``: peft with ``init_lora_weights=False``, so B is not zero) and
overlap in some modules (a+b adds both updates there, in the request's order).

Tolerances: at 1 rank our loop runs diffusers' modules, peft's layers included, in the pipeline's order: frames and
latents bit-identical (and the LTX-2 soundtrack equal). With N ranks, as in ``test_ltx_video_parallel`` and
``test_ltx2_parallel``: matmuls over fewer rows and SDPA over permuted layouts sum fp32 in another order, which can
flip a rounding to uint8: frames within 1 level (mean < 0.02).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cp_infer.request import GenerationRequest, LoraWeight
from cp_infer.sampler import JobFailed, SampleControl, sample

from ..harness import one_thread
from ..lora_adapters import LTX2_A, LTX2_B, LTX2_CONNECTORS, LTX_VIDEO_A, LTX_VIDEO_B, make_adapter
from ..worker_groups import groups_by_layout

FAMILIES = ("ltx-video", "ltx2")
_LTX2_GUIDANCE = dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                      modality_scale=2.0, audio_modality_scale=1.5, guidance_rescale=0.7,
                      spatio_temporal_guidance_blocks=(0,))
# 9 x 64 x 160: 2 x 2 x 5 = 20 video tokens, uneven over 3 ranks (LTX-2's 9 audio tokens split evenly there).
_SHAPE = dict(num_frames=9, height=64, width=160, num_inference_steps=2, fps=24)
_GUIDANCE = {"ltx-video": dict(guidance_scale=3.0), "ltx2": _LTX2_GUIDANCE}
# The interleaved requests: (label, adapters); "c" is an adapter in Lightricks'/ComfyUI's key layout.
SEQUENCE = (("a", (("a", 0.8),)), ("none", ()), ("b", (("b", 1.3),)), ("a+b", (("a", 0.8), ("b", -1.5))),
            ("c", (("c", 1.0),)), ("a again", (("a", 0.8),)))
N_RANKS = (0, 1, 3, 4)
"""The requests of ``SEQUENCE`` the N-rank groups run (a, none, a+b, c): every kind, in less time."""


def _components(folder: str, family: str):
    from models.ltx2.loading import load_ltx2
    from models.ltx_video.loading import load_ltx_video

    return (load_ltx_video if family == "ltx-video" else load_ltx2)(folder)


def _comfy(path: Path, family: str) -> None:
    """``path``'s adapter rewritten in Lightricks'/ComfyUI's layout (``diffusion_model.``; LTX-2's connectors as
    ``text_embedding_projection.``, ``aggregate_embed``), without diffusers' metadata, as their files come."""
    keys = {}
    for key, value in load_file(path).items():
        if key.startswith("connectors."):
            key = "text_embedding_projection." + key.removeprefix("connectors.").replace("text_proj_in",
                                                                                         "aggregate_embed")
        else:
            key = "diffusion_model." + key.removeprefix("transformer.")
        keys[key] = value
    save_file(keys, path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """family -> (model folder, adapter folder with a, b and c)."""
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx_video.default import ensure_default_model

    root = tmp_path_factory.mktemp("lora")
    out = {}
    for family, ensure, (a, b) in (("ltx-video", ensure_default_model, (LTX_VIDEO_A, LTX_VIDEO_B)),
                                   ("ltx2", ensure_default_ltx2_model, (LTX2_A, LTX2_B))):
        folder = str(ensure(root / "cache"))
        adapters = root / family
        adapters.mkdir()
        c = _components(folder, family)
        connectors = LTX2_CONNECTORS if family == "ltx2" else ()
        make_adapter(c, adapters / "a.safetensors", seed=1, targets=a, connectors=connectors)
        make_adapter(c, adapters / "b.safetensors", seed=2, targets=b)
        make_adapter(c, adapters / "c.safetensors", seed=3, targets=a + b, connectors=connectors)
        _comfy(adapters / "c.safetensors", family)
        out[family] = (folder, str(adapters))
    return out


def _request(family: str, seed: int, loras) -> GenerationRequest:
    return GenerationRequest.of(prompt="a drummer plays in the snow", negative_prompt="blurry", seed=seed,
                                loras=[{"name": n, "scale": s} for n, s in loras], **_SHAPE, **_GUIDANCE[family])


def _weights_hash(model) -> str:
    """The base weights of the parts adapters load into (peft's wrappers see through: ``base_layer``)."""
    digest = hashlib.sha256()
    for part in model.lora_parts().values():
        for name, p in sorted(part.named_parameters()):
            if "lora_" not in name:
                digest.update(name.replace(".base_layer", "").encode())
                digest.update(p.detach().cpu().numpy().tobytes())
    return digest.hexdigest()


def _run(state, folder: str, adapters: str, family: str, seed: int, sequence=SEQUENCE):
    """Every request of ``sequence`` on one loaded model: per request (frames, waveform or None); and the base
    weights' hash before and after."""
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, lora_dir=adapters)
    model.decode_frames_per_rank = None  # one decode round, as the pipelines decode
    before = _weights_hash(model)
    out = []
    for _label, loras in sequence:
        audio = {}
        frames = sample(model, _request(family, seed, loras), state=state,
                        control=SampleControl(on_audio=lambda w, sr, a=audio: a.update(waveform=w)))
        out.append((frames, audio.get("waveform")))
    return out, (before, _weights_hash(model))


def _reference(folder: str, adapters: str, family: str, seed: int):
    """diffusers' pipeline with every adapter loaded once, then per request ``set_adapters`` (and ``enable_lora``:
    ``set_adapters`` leaves a disabled model disabled) or ``disable_lora``."""
    from diffusers import LTX2Pipeline, LTXPipeline

    c = _components(folder, family)
    names = ("scheduler", "vae", "text_encoder", "tokenizer", "transformer")
    if family == "ltx2":
        names += ("audio_vae", "connectors", "vocoder")
    pipe = (LTXPipeline if family == "ltx-video" else LTX2Pipeline)(**{n: getattr(c, n) for n in names})
    pipe.set_progress_bar_config(disable=True)
    for name in ("a", "b", "c"):
        pipe.load_lora_weights(adapters, weight_name=f"{name}.safetensors", adapter_name=name)
    out = []
    for _label, loras in SEQUENCE:
        if loras:
            pipe.set_adapters([n for n, _ in loras], [s for _, s in loras])
            pipe.enable_lora()
        else:
            pipe.disable_lora()
        r = _request(family, seed, ())
        kw = {} if family == "ltx-video" else dict(_LTX2_GUIDANCE, spatio_temporal_guidance_blocks=[0])
        kw["guidance_scale"] = _GUIDANCE[family]["guidance_scale"]
        result = pipe(prompt=r.prompt, negative_prompt=r.negative_prompt, num_frames=r.num_frames, height=r.height,
                      width=r.width, num_inference_steps=r.num_inference_steps, frame_rate=r.fps,
                      generator=torch.Generator("cpu").manual_seed(r.seed), output_type="np", **kw)
        frames = (np.clip(result.frames[0], 0, 1) * 255).round().astype(np.uint8)
        out.append((frames, None if family == "ltx-video" else result.audio[0].float().numpy()))
    return out


@pytest.fixture(scope="module")
def one_rank(setup):
    from cp_infer import single_process_state

    seed = random.randrange(2**31)
    return seed, {family: one_thread(_run, single_process_state(), *setup[family], family, seed)
                  for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_rank_equals_the_pipeline_with_its_adapters(setup, one_rank, family):
    seed, results = one_rank
    ours, (before, after) = results[family]
    assert before == after, "the base weights changed"
    ref = one_thread(_reference, *setup[family], family, seed)
    base = ours[1][0]
    for (label, _), (frames, audio), (ref_frames, ref_audio) in zip(SEQUENCE, ours, ref, strict=True):
        assert frames.std() > 5, "degenerate video: the comparison would prove nothing"
        np.testing.assert_array_equal(frames, ref_frames, err_msg=f"{family} {label} seed={seed}")
        if label != "none":
            assert np.abs(frames.astype(int) - base).mean() > 0.5, f"{label}: the adapters changed nothing"
        if audio is not None:
            np.testing.assert_array_equal(audio[:, :ref_audio.shape[1]], ref_audio, err_msg=f"{family} {label}")
    np.testing.assert_array_equal(ours[0][0], ours[-1][0])  # a, then a again after the others


groups = groups_by_layout()  # (world, guidance degree) -> the session's shared group


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("world, guidance, ring", [(2, 2, None), (3, 1, None), (2, 1, 2)], ids=["G2xU1", "U3", "R2"])
def test_n_ranks_equal_one_rank(setup, one_rank, groups, family, world, guidance, ring):
    seed, results = one_rank
    expected, _ = results[family]
    sequence = tuple(SEQUENCE[i] for i in N_RANKS)
    ranks = groups(world, guidance, ring).run(_run, *setup[family], family, seed, sequence, timeout=600)
    got, (before, after) = ranks[0]
    assert before == after
    for (label, _), (exp, exp_audio), (frames, audio) in zip(sequence, [expected[i] for i in N_RANKS], got,
                                                             strict=True):
        diff = np.abs(frames.astype(np.int16) - exp.astype(np.int16))
        assert diff.max() <= 1 and diff.mean() < 0.02, f"{family} {label} N={world}: max {diff.max()} mean " \
                                                         f"{diff.mean()}"
        if audio is not None:
            np.testing.assert_allclose(audio, exp_audio, rtol=0, atol=1e-4, err_msg=f"{family} {label}")


def _fail_on_rank_1(state, folder: str, adapters: str, broken: str, seed: int):
    """Rank 1 reads its adapters from ``broken`` (an ``a`` that is not safetensors): a request for ``a`` fails on
    every rank; the next (``b``, which rank 1 has too, and then none) runs."""
    from models.common.lora import LoraDirectory
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, lora_dir=adapters)
    if state.rank == 1:
        model.loras.directory = LoraDirectory(broken)
    out = []
    for loras in ((("a", 1.0),), (("b", 1.0),), ()):
        try:
            out.append(sample(model, _request("ltx-video", seed, loras), state=state) is not None)
        except JobFailed as exc:
            out.append(str(exc))
    return out


def test_a_load_failure_on_one_rank_fails_the_job_on_every_rank(setup, groups, tmp_path):
    folder, adapters = setup["ltx-video"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "a.safetensors").write_bytes(b"\x80\x04 not safetensors")
    shutil.copy(Path(adapters) / "b.safetensors", broken)
    ranks = groups(2, 2).run(_fail_on_rank_1, folder, adapters, str(broken), 1, timeout=300)
    for rank, (failed, b, none) in enumerate(ranks):
        assert isinstance(failed, str) and "rank 1" in failed and "'a'" in failed and "safetensors" in failed, failed
        assert (b, none) == (rank == 0, rank == 0), (rank, b, none)  # ran: only the leader returns frames


def _lru(state, folder: str, adapters: str, budget: int, seed: int):
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, lora_dir=adapters, max_lora_bytes=budget)
    model.decode_frames_per_rank = None
    seen = []
    for loras in ((("a", 1.0),), (("b", 1.0),), (("a", 1.0),), (("a", 1.0), ("b", 1.0)), (("b", 1.0),), ()):
        frames = sample(model, _request("ltx-video", seed, loras), state=state)
        seen.append((frames, list(model.loras.loaded()), model.loras.reads))
    return seen


def _fp32_bytes(directory, name: str) -> int:
    """Adapter ``name``'s tensors in an fp32 model (peft casts them to the base layer's dtype)."""
    return sum(int(np.prod(shape)) * 4 for shape, _ in directory.header(name).values())


def test_lru_evicts_and_reloads(setup, tmp_path):
    from cp_infer import single_process_state
    from models.common.lora import LoraDirectory

    folder, adapters = setup["ltx-video"]
    sizes = {name: _fp32_bytes(LoraDirectory(adapters), name) for name in ("a", "b")}
    budget = max(sizes.values()) + 16  # one of them at a time
    seen = _lru(single_process_state(), folder, adapters, budget, seed=3)
    assert [(loaded, reads) for _, loaded, reads in seen] == [
        (["a"], 1), (["b"], 2), (["a"], 3),  # b evicted a, and a b
        (["a", "b"], 4),  # a pass's adapters load together, over the budget
        (["b"], 4),  # then a, the least recently used, goes
        (["b"], 4),  # a pass without adapters loads none
    ]
    np.testing.assert_array_equal(seen[0][0], seen[2][0])  # a, read again: the same video
    np.testing.assert_array_equal(seen[1][0], seen[4][0])
    assert np.abs(seen[0][0].astype(int) - seen[5][0]).mean() > 0.5


def test_a_changed_file_is_read_again(setup, tmp_path):
    from cp_infer import single_process_state
    from models.registry import open_model

    folder, adapters = setup["ltx-video"]
    own = tmp_path / "own"
    shutil.copytree(adapters, own)
    state = single_process_state()
    model = open_model(folder, dtype="fp32", state=state, lora_dir=own)
    first = sample(model, _request("ltx-video", 4, (("a", 1.0),)), state=state)
    make_adapter(_components(folder, "ltx-video"), own / "a.safetensors", seed=11, targets=LTX_VIDEO_A)
    os.utime(own / "a.safetensors", ns=(1, 1))  # a new size or time: here the time, whatever the clock's resolution
    second = sample(model, _request("ltx-video", 4, (("a", 1.0),)), state=state)
    assert model.loras.reads == 2 and np.abs(first.astype(int) - second).mean() > 0.5


def _two_stage_and_windows(state, folder: str, adapters: str, seed: int):
    """A two-stage image-to-video request and a long video (3 windows), both with adapters a and b."""
    from models.common.lora import LoadedLoras, LoraDirectory
    from models.ltx_video.adapter import LORA, LTXVideoModel

    from .ltx_video import test_two_stage as two_stage
    from .ltx_video import test_windows as windows

    loras = (LoraWeight("a", 0.7), LoraWeight("b", 1.2))
    out = {}
    for name, module, components, request in (
            ("two stages", two_stage, two_stage._components(folder), two_stage._requests(seed)[1]),
            ("windows", windows, windows._components(folder, "euler"), windows._requests(seed)[0])):
        model = LTXVideoModel(components, state=state)
        model.loras = LoadedLoras(LoraDirectory(adapters), spec=LORA, parts=model.lora_parts())
        latents = {}
        sample(model, dataclasses.replace(request, loras=loras), state=state,
               control=SampleControl(on_latents=latents.update))
        assert model.loras.active == loras and model.loras.reads == 2
        out[name] = (module, request, latents["latents"])
    return out


def test_two_stages_and_windows_apply_the_adapters_in_every_pass(setup, monkeypatch):
    """Each pass (stage 1, stage 2; every window) runs with the request's adapters: the latents equal diffusers'
    recipes (``test_ltx_video_two_stage``'s, ``test_ltx_video_windows``'s) given the same adapters."""
    from diffusers import LTXConditionPipeline

    from cp_infer import single_process_state

    folder, adapters = setup["ltx-video"]
    seed = random.randrange(2**31)
    ours = one_thread(_two_stage_and_windows, single_process_state(), folder, adapters, seed)
    for name, (module, request, latents) in ours.items():
        real = module._components

        def with_adapters(*args, real=real):
            c = real(*args)
            pipe = LTXConditionPipeline(scheduler=c.scheduler, vae=c.vae, text_encoder=c.text_encoder,
                                        tokenizer=c.tokenizer, transformer=c.transformer)
            for adapter in ("a", "b"):
                pipe.load_lora_weights(adapters, weight_name=f"{adapter}.safetensors", adapter_name=adapter)
            pipe.set_adapters(["a", "b"], [0.7, 1.2])
            assert set(c.transformer.peft_config) == {"a", "b"}
            return c

        monkeypatch.setattr(module, "_components", with_adapters)
        if name == "two stages":
            ref = one_thread(module._reference, folder, request, "latent")
        else:
            ref = one_thread(module._reference, folder, request, "euler")
        ref = ref.float().numpy() if isinstance(ref, torch.Tensor) else ref
        np.testing.assert_array_equal(latents, ref, err_msg=f"{name} seed={seed}")
