"""Per-request LoRA adapters (``models.common.lora``) with ``--weights sharded`` (``cp_infer.weights.adding_layers``):
at
N = 2 (Ulysses 2, and guidance 2), LTX-Video's and LTX-2's interleaved requests (a, none, b, a+b, a again; LTX-2's
``a`` also in its connectors) on the sharded model equal the replicated model given the same adapters, bit for bit
(frames, and LTX-2's soundtrack); the base weights stay sharded (each rank holds the plan's shard bytes of the
transformer and the text encoder, to the byte, besides the adapters), the adapters are whole and the same on every
rank; the LRU evicts and reads again as it does replicated.

Exact, not within a tolerance: a sharded forward gathers the loaded bits (``cp_infer.weights``) and peft's layers
compute on them as on the replicated weights; the replicated reference holds its weights in memory of its own
(NOTE(mmap-alignment) in ``test_sharded``).
"""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from cp_infer.request import GenerationRequest
from cp_infer.sampler import SampleControl, sample

from ..lora_adapters import LTX2_A, LTX2_B, LTX2_CONNECTORS, LTX_VIDEO_A, LTX_VIDEO_B, make_adapter
from ..worker_groups import groups_by_layout

FAMILIES = ("ltx-video", "ltx2")
_GUIDANCE = {"ltx-video": dict(guidance_scale=3.0),
             "ltx2": dict(guidance_scale=3.0, audio_guidance_scale=5.0, stg_scale=1.0, audio_stg_scale=0.5,
                          modality_scale=2.0, audio_modality_scale=1.5)}
# 9 x 64 x 160: 20 video tokens (LTX-2: 9 audio tokens, uneven over 2 ranks).
_SHAPE = dict(num_frames=9, height=64, width=160, num_inference_steps=2, fps=24)
SEQUENCE = (("a", (("a", 0.8),)), ("none", ()), ("b", (("b", 1.3),)), ("a+b", (("a", 0.8), ("b", -1.5))),
            ("a again", (("a", 0.8),)))
# With a budget of one adapter: what is loaded after each request of SEQUENCE (least recently used first), and the
# files read so far (b evicts a; a+b loads both, over the budget; then b, which "a again" does not name, goes).
LRU = ((["a"], 1), (["a"], 1), (["b"], 2), (["a", "b"], 3), (["a"], 3))
LAYOUTS = [(2, 1), (2, 2)]
"""(world, guidance degree): Ulysses 2; guidance 2 (each guidance rank its own passes, its peer's all-gathers
joined)."""


layouts = groups_by_layout()  # (world, guidance degree) -> the session's shared group


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """family -> (model folder, adapter folder with a and b)."""
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx2.loading import load_ltx2
    from models.ltx_video.default import ensure_default_model
    from models.ltx_video.loading import load_ltx_video

    root = tmp_path_factory.mktemp("lora_sharded")
    out = {}
    for family, ensure, load, (a, b), connectors in (
            ("ltx-video", ensure_default_model, load_ltx_video, (LTX_VIDEO_A, LTX_VIDEO_B), ()),
            ("ltx2", ensure_default_ltx2_model, load_ltx2, (LTX2_A, LTX2_B), LTX2_CONNECTORS)):
        folder = str(ensure(root / "cache"))
        adapters = root / family
        adapters.mkdir()
        components = load(folder)
        make_adapter(components, adapters / "a.safetensors", seed=1, targets=a, connectors=connectors)
        make_adapter(components, adapters / "b.safetensors", seed=2, targets=b)
        out[family] = (folder, str(adapters))
    return out


def _budget(adapters: str) -> int:
    """Room for one of a and b at a time (fp32: peft casts the adapters to the base layers' dtype)."""
    from models.common.lora import LoraDirectory

    directory = LoraDirectory(adapters)
    return max(sum(int(np.prod(shape)) * 4 for shape, _ in directory.header(name).values())
               for name in ("a", "b")) + 16


def _run(state, folder: str, adapters: str, family: str, weights: str, seed: int, sequence=SEQUENCE, offload=()):
    """Per request of ``sequence`` ``(frames, waveform, loaded, reads)``; and this rank's held bytes of the
    components without the adapters', and a hash of the adapters' tensors (with whether any is a shard)."""
    from torch.distributed.tensor import DTensor

    from models.common.placement import measure_components
    from models.registry import open_model

    model = open_model(folder, dtype="fp32", state=state, weights=weights, lora_dir=adapters,
                       max_lora_bytes=_budget(adapters), offload=offload)
    model.decode_frames_per_rank = None
    if weights == "replicated":  # NOTE(mmap-alignment) in test_sharded
        for module in (model.components.transformer, model.components.text_encoder):
            for param in module.parameters():
                param.data = param.data.clone()
    out = []
    for _label, loras in sequence:
        audio: dict = {}
        request = GenerationRequest.of(prompt="a drummer plays in the snow", negative_prompt="blurry", seed=seed,
                                       loras=[{"name": n, "scale": s} for n, s in loras], **_SHAPE,
                                       **_GUIDANCE[family])
        frames = sample(model, request, state=state,
                        control=SampleControl(on_audio=lambda w, sr, a=audio: a.update(waveform=w)))
        out.append((frames, audio.get("waveform"), list(model.loras.loaded()), model.loras.reads))
    held: dict[str, int] = {}
    for name, _where, n in measure_components(model.components, model.placement).entries:
        held[name] = held.get(name, 0) + n
    digest, shards = hashlib.sha256(), False
    for prefix, part in model.lora_parts().items():
        for name, p in sorted(part.named_parameters()):
            if "lora_" in name:
                held[prefix] -= p.numel() * p.element_size()
                shards |= isinstance(p, DTensor)
                digest.update(name.encode())
                digest.update(p.detach().cpu().numpy().tobytes())
    return out, held, (digest.hexdigest(), shards)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda gu: f"world{gu[0]}-G{gu[1]}")
def test_sharded_with_adapters_equals_replicated(setup, layouts, family, layout):
    from models.common.placement import model_components

    folder, adapters = setup[family]
    group = layouts(*layout)
    seed = random.randrange(2**31)
    replicated = group.run(_run, folder, adapters, family, "replicated", seed, timeout=600)
    sharded = group.run(_run, folder, adapters, family, "sharded", seed, timeout=600)
    want, got = replicated[0][0], sharded[0][0]
    base = want[1][0]
    for (label, _), w, g, lru in zip(SEQUENCE, want, got, LRU, strict=True):
        what = f"{family} {layout} {label} seed={seed}"
        assert w[0].std() > 5, f"{what}: degenerate video, the comparison would prove nothing"
        assert np.array_equal(w[0], g[0]), f"{what}: frames differ (max {np.abs(w[0].astype(int) - g[0]).max()})"
        assert (w[1] is None) == (family == "ltx-video") and (g[1] is None) == (w[1] is None)
        if w[1] is not None:
            assert np.array_equal(w[1], g[1]), f"{what}: the soundtrack differs"
        if label != "none":
            assert np.abs(g[0].astype(int) - base).mean() > 0.5, f"{what}: the adapters changed nothing"
        assert (w[2], w[3]) == lru and (g[2], g[3]) == lru, (what, w[2:], g[2:])
    assert np.array_equal(got[0][0], got[-1][0]), f"{family}: a read again is not the same a"
    plan = {c.name: c for c in model_components(folder, dtype="fp32")}
    adapters_of = {ranks[2] for ranks in (*replicated, *sharded)}
    assert len(adapters_of) == 1 and not adapters_of.pop()[1], "the adapters differ by rank or are sharded"
    for rank, (_, held, _) in enumerate(sharded):
        for name in ("transformer", "text_encoder"):
            assert held[name] == plan[name].shard_nbytes(2, rank), (name, rank, held[name])
            assert held[name] < replicated[rank][1][name] / 2 + max(b.nbytes for b in plan[name].blocks)
        assert {k: v for k, v in held.items() if k not in ("transformer", "text_encoder")} == {
            k: v for k, v in replicated[rank][1].items() if k not in ("transformer", "text_encoder")}


def test_offloaded_shards_with_adapters(setup, layouts):
    """``--offload transformer_blocks,text_encoder`` with sharded weights: the adapters are placed on the device
    forwards run on (``adding_layers``; on the CPU that is where they are) and a+b then a (b evicted) give the frames
    of the run without offload. What only a GPU shows (the adapters moved off the CPU) is not tested here."""
    folder, adapters = setup["ltx-video"]
    group = layouts(2, 1)
    seed = random.randrange(2**31)
    sequence = (SEQUENCE[3], SEQUENCE[4])
    plain = group.run(_run, folder, adapters, "ltx-video", "sharded", seed, sequence, timeout=600)
    offloaded = group.run(_run, folder, adapters, "ltx-video", "sharded", seed, sequence,
                          ("transformer_blocks", "text_encoder"), timeout=600)
    for (label, _), want, got in zip(sequence, plain[0][0], offloaded[0][0], strict=True):
        assert np.array_equal(want[0], got[0]), f"{label} seed={seed}: offloading changed the frames"
        assert want[2:] == got[2:], (label, want[2:], got[2:])
    assert [ranks[1] for ranks in plain] == [ranks[1] for ranks in offloaded]
