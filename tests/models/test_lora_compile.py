"""Per-request LoRA under ``--compile`` (``models.common.lora_slots``) on the tiny LTX-Video: the interleaved requests
a,
none, b, a+b, a (a Lightricks/ComfyUI-layout adapter among them) on one compiled model, at 1 rank and at Ulysses 2,
each equal the eager engine at 1 rank (``models.common.lora``'s peft path) with the same adapters, and the blocks
compile on
the first request only (dynamo's ``error_on_recompile`` on from then on, and its graph count unchanged on every
rank); the slots uncompiled equal the eager path,
a request without adapters is the model without any, and what cannot fit the slots is refused naming the fix.

Tolerances. Compiled against eager: as ``test_compile`` (inductor's fused kernels sum fp32 in another order, ~1e-7
relative per op); here the final latents (unit scale) moved by at most 2.5e-6 at 1 rank and 2.4e-6 at 2 (two seeds
each), so 1e-4, and frames within 1 level.
Uncompiled slots against the peft path: the same modules in the same order, but each adapter's matmuls run over the
slot's padded rank (zero rows and columns): the BLAS kernels may block a longer sum differently, measured 0 here, held
to 1e-5. A request without adapters adds exact zeros to each base layer: bit-identical to the model without adapters.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cp_infer.request import GenerationRequest

from ..harness import one_thread
from ..lora_adapters import LTX_VIDEO_A, LTX_VIDEO_B, make_adapter
from ..worker_groups import SharedGroup
from .test_lora import _comfy

# 17 x 32 x 96: 3 x 1 x 3 = 9 latent tokens, CFG (batch 2 through the blocks): test_compile's shape.
_SHAPE = dict(num_frames=17, height=32, width=96, num_inference_steps=2, fps=24, guidance_scale=3.0)
SEQUENCE = (("a", (("a", 0.8),)), ("none", ()), ("b", (("c", 1.3),)), ("a+b", (("a", 0.5), ("b", -1.5))),
            ("a again", (("a", 0.8),)))
"""(label, adapters): ``c`` is ``b``'s modules and more in Lightricks'/ComfyUI's key layout."""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(model folder, adapter folder with a, b and c)."""
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    root = tmp_path_factory.mktemp("lora-compile")
    folder = str(ensure_default_model(root / "cache"))
    adapters = root / "adapters"
    adapters.mkdir()
    c = load_ltx_video(folder)
    make_adapter(c, adapters / "a.safetensors", seed=1, targets=LTX_VIDEO_A)
    make_adapter(c, adapters / "b.safetensors", seed=2, targets=LTX_VIDEO_B, rank=8)
    make_adapter(c, adapters / "c.safetensors", seed=3, targets=LTX_VIDEO_B + ("ff.net.0.proj",))
    _comfy(adapters / "c.safetensors", "ltx-video")
    return folder, str(adapters)


def _request(seed: int, loras) -> GenerationRequest:
    return GenerationRequest.of(prompt="a drummer plays in the snow", negative_prompt="blurry", seed=seed,
                                loras=[{"name": n, "scale": s} for n, s in loras], **_SHAPE)


def _sample(model, state, seed: int, loras):
    from cp_infer.sampler import SampleControl, sample

    latents = {}
    frames = sample(model, _request(seed, loras), state=state, control=SampleControl(on_latents=latents.update))
    return frames, latents.get("latents")  # the leader's (rank 0)


def _run(state, folder: str, adapters: str, seed: int, compiled: bool):
    """Every request of ``SEQUENCE`` on one model: per request (frames, latents, dynamo's graphs so far); with
    ``compiled``, any recompile after the first request raises."""
    import torch._dynamo.utils

    from models.registry import open_model

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    model = open_model(folder, dtype="fp32", state=state, compile_blocks=compiled, lora_dir=adapters,
                       max_lora_rank=8)
    model.decode_frames_per_rank = None
    out = []
    try:
        for _label, loras in SEQUENCE:
            frames, latents = _sample(model, state, seed, loras)
            out.append((frames, latents, counters["stats"]["unique_graphs"]))
            torch._dynamo.config.error_on_recompile = compiled
    finally:
        torch._dynamo.config.error_on_recompile = False
    return dict(out=out, breaks=sum(counters["graph_break"].values()), slots=model.loras.slots is not None)


@pytest.fixture(scope="module")
def eager(setup):
    """(seed, the eager engine's run of ``SEQUENCE`` at 1 rank, the compiled one's)."""
    seed = random.randrange(2**31)
    group = SharedGroup(1)
    [run] = group.run(_run, *setup, seed, False, timeout=300)
    [compiled] = group.run(_run, *setup, seed, True, timeout=600)
    return seed, run, compiled


def _check(seed: int, eager: dict, compiled: dict, *, what: str) -> None:
    assert not eager["slots"] and compiled["slots"]
    assert compiled["breaks"] == 0, f"{what}: {compiled['breaks']} graph break(s) in the compiled blocks"
    graphs = [g for *_, g in compiled["out"]]
    assert graphs[0] >= 1 and graphs == [graphs[0]] * len(graphs), f"{what}: graphs after each request: {graphs}"
    base = eager["out"][1][0]
    for (label, _), (e_frames, e_latents, _), (c_frames, c_latents, _) in zip(SEQUENCE, eager["out"],
                                                                              compiled["out"], strict=True):
        assert e_frames.std() > 5, "degenerate video: the comparison would prove nothing"
        if label != "none":
            assert np.abs(e_frames.astype(int) - base).mean() > 0.5, f"{label}: the adapters changed nothing"
        torch.testing.assert_close(c_latents, e_latents, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, label=label: f"{what} {label} seed={seed}: {m}")
        diff = np.abs(c_frames.astype(np.int16) - e_frames.astype(np.int16))
        assert diff.max() <= 1, f"{what} {label} seed={seed}: frames differ by up to {diff.max()} levels"


def test_compiled_slots_equal_eager_and_compile_once(eager):
    seed, run, compiled = eager
    assert all(g == 0 for *_, g in run["out"])
    _check(seed, run, compiled, what="N=1")
    # a, then a again after the others were copied into its slot: the same video, bit for bit
    np.testing.assert_array_equal(compiled["out"][0][0], compiled["out"][-1][0])


def test_two_ranks_compiled_equal_one_rank_eager(setup, eager):
    """Ulysses 2 (9 tokens: a padded one), the all-to-alls compiled inside the blocks with the slots: as 1 rank
    eager, and the same graphs on every rank for every request."""
    seed, run, _ = eager
    group = SharedGroup(2)
    ranks = group.run(_run, *setup, seed, True, timeout=600)
    for rank, got in enumerate(ranks):
        graphs = [g for *_, g in got["out"]]
        assert graphs == [graphs[0]] * len(graphs) and graphs[0] >= 1, f"rank {rank}: graphs {graphs}"
    _check(seed, run, ranks[0], what="N=2")


def _slotted(folder: str, adapters: str, *, rank: int = 8):
    """The tiny model with the slots of ``adapters`` made as ``open_model`` makes them for ``--compile``, uncompiled."""
    from cp_infer import single_process_state
    from models.common.lora import LoadedLoras, LoraDirectory, adapted_modules
    from models.common.lora_slots import make_slots
    from models.registry import open_model

    state = single_process_state()
    model = open_model(folder, dtype="fp32", state=state)
    model.decode_frames_per_rank = None
    directory = LoraDirectory(adapters)
    slots = make_slots(model.lora_parts(), adapted_modules(directory, model.lora_spec), rank=rank)
    model.loras = LoadedLoras(directory, spec=model.lora_spec, parts=model.lora_parts(), slots=slots)
    return model, state


def _uncompiled(folder: str, adapters: str, seed: int):
    from models.registry import open_model

    slotted, state = _slotted(folder, adapters)
    eager = open_model(folder, dtype="fp32", state=state, lora_dir=adapters)
    plain = open_model(folder, dtype="fp32", state=state)
    for model in (eager, plain):
        model.decode_frames_per_rank = None
    out = [(_sample(slotted, state, seed, loras)[1], _sample(eager, state, seed, loras)[1])
           for _label, loras in SEQUENCE]
    linear = [name for name, m in plain.transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    return out, _sample(plain, state, seed, ())[1], sorted(slotted.loras.slots.layers), linear


def test_uncompiled_slots_equal_the_peft_path(setup):
    from models.common.lora_slots import SLOT_NAMES

    seed = random.randrange(2**31)
    out, plain, layers, linear = one_thread(_uncompiled, *setup, seed)
    for (label, _), (slotted, eager) in zip(SEQUENCE, out, strict=True):
        torch.testing.assert_close(slotted, eager, rtol=1e-5, atol=1e-5, msg=lambda m, label=label: f"{label}: {m}")
    torch.testing.assert_close(out[1][0], plain, rtol=0, atol=0)  # no adapters: the base layers plus exact zeros
    assert len(SLOT_NAMES) == 4
    # slots on the union of a, b and c's modules (c adds the feed-forward's input projections), no others
    targets = LTX_VIDEO_A + LTX_VIDEO_B + ("ff.net.0.proj",)
    union = {name for name in linear if any(name == t or name.endswith(f".{t}") for t in targets)}
    assert {prefix for prefix, _ in layers} == {"transformer"}
    assert {name for _, name in layers} == union and len(union) < len(linear), (layers, union)


def _refusals(folder: str, adapters: str, tmp: str):
    import shutil
    from pathlib import Path

    from cp_infer.request import LoraWeight
    from models.ltx_video.loading import load_ltx_video

    own = Path(tmp) / "own"
    shutil.copytree(adapters, own)
    model, _ = _slotted(folder, str(own), rank=4)
    c = load_ltx_video(folder)
    make_adapter(c, own / "late.safetensors", seed=5, targets=("attn1.to_q", "proj_out"))  # proj_out: no slot
    errors = {}
    for name in ("b", "late"):  # b is rank 8, over the slots' 4
        try:
            model.loras.activate((LoraWeight(name),))
        except ValueError as exc:
            errors[name] = str(exc)
    model.loras.activate((LoraWeight("a"),))  # rank 4, its modules slotted: applies
    return errors, list(model.loras.loaded()), own


def test_what_does_not_fit_the_slots_is_refused(setup, tmp_path):
    """By the ranks when an adapter loads, and by the front end's check from the headers, with the same words."""
    from cp_infer.request import LoraWeight
    from models.registry import describe_model, lora_catalog

    errors, loaded, own = one_thread(_refusals, *setup, str(tmp_path))
    assert "rank 8" in errors["b"] and "--max-lora-rank 8" in errors["b"], errors
    assert "transformer.proj_out" in errors["late"] and "restart" in errors["late"], errors
    assert loaded == ["a"]
    # The front end's catalog takes the slots' modules from the folder on its first check: "late" must not be in it.
    (own / "late.safetensors").rename(tmp_path / "late.safetensors")
    catalog = lora_catalog(describe_model(setup[0]), own, slot_rank=4)
    catalog.check([LoraWeight("a"), LoraWeight("c", 0.5)])
    (tmp_path / "late.safetensors").rename(own / "late.safetensors")
    for loras, i in (([LoraWeight("a"), LoraWeight("b")], 1), ([LoraWeight("late")], 0)):
        name = loras[i].name
        with pytest.raises(ValueError) as refused:
            catalog.check(loras)
        assert str(refused.value) == f"loras[{i}].name={name!r} " + errors[name].removeprefix(f"adapter {name!r} ")
    lora_catalog(describe_model(setup[0]), own).check([LoraWeight("b"), LoraWeight("late")])  # eager: both apply
