"""``--offload`` with replicated weights loads the offloaded components on the CPU: none is ever whole on the device
(#42), and the Wan VAE and image encoder load in float32 whatever the dtype (diffusers' Wan examples).

The device is ``meta``: a component moved there keeps no data, so a component found on the CPU when the offload is
applied was never moved to the device. diffusers' group offloading needs a real device's module (``torch.cuda``), so
``apply_offload`` is replaced by a recorder of where each component is when it is called; the rest of
``open_model`` (the loaders, the adapter's construction) runs as it does on a GPU.
"""

from __future__ import annotations

import pytest
import torch

OFFLOAD = ("transformer_blocks", "text_encoder", "vae")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from models.ltx2.default import ensure_default_ltx2_model
    from models.ltx_video.default import ensure_default_model
    from models.wan.default import save_wan_model

    return {"ltx-video": ensure_default_model(), "ltx2": ensure_default_ltx2_model(),
            "wan-i2v": save_wan_model(tmp_path_factory.mktemp("wan") / "i2v", variant="i2v")}


def _devices(module: torch.nn.Module) -> set[str]:
    return {p.device.type for p in module.parameters()} | {b.device.type for b in module.buffers()}


def _open_on_meta(monkeypatch, folder, *, offload, dtype="fp32") -> dict[str, set[str]]:
    """Where each component with weights is when ``open_model`` applies the offload."""
    import models.common.placement as placement
    from cp_infer import single_process_state
    from models.registry import open_model

    seen: dict[str, set[str]] = {}

    def record(components, placement_) -> None:
        seen.update({name: _devices(module) for name, module in placement._modules(components).items()})
        seen["offloaded"] = set(placement.offloaded_components(placement_))

    monkeypatch.setattr(placement, "apply_offload", record)
    model = open_model(folder, dtype=dtype, state=single_process_state("meta"), weights="replicated", offload=offload)
    assert set(model.placement.offload) == set(offload)
    return seen


@pytest.mark.parametrize("family", ["ltx-video", "ltx2", "wan-i2v"])
def test_offloaded_components_never_go_to_the_device(monkeypatch, folders, family):
    seen = _open_on_meta(monkeypatch, folders[family], offload=OFFLOAD)
    offloaded = seen.pop("offloaded")
    expected = {"transformer", "text_encoder", "vae"} | ({"audio_vae", "vocoder", "connectors"} if family == "ltx2"
                                                          else {"image_encoder"} if family == "wan-i2v" else set())
    assert expected <= offloaded and expected <= set(seen), (offloaded, seen)
    for name, devices in seen.items():
        assert devices == ({"cpu"} if name in offloaded else {"meta"}), (name, devices)


def test_without_offload_every_component_goes_to_the_device(monkeypatch, folders):
    seen = _open_on_meta(monkeypatch, folders["ltx-video"], offload=())
    assert seen.pop("offloaded") == set()
    assert seen and all(devices == {"meta"} for devices in seen.values()), seen


def test_wan_keeps_its_vae_and_image_encoder_in_float32(folders):
    from models.wan.loading import load_wan

    components = load_wan(folders["wan-i2v"], dtype="bf16")
    # diffusers and transformers keep a few modules of the others in float32 (``_keep_in_fp32_modules``).
    assert torch.bfloat16 in {p.dtype for p in components.transformer.parameters()}
    assert torch.bfloat16 in {p.dtype for p in components.text_encoder.parameters()}
    assert {p.dtype for p in components.vae.parameters()} == {torch.float32}
    assert {p.dtype for p in components.image_encoder.parameters()} == {torch.float32}


def test_the_memory_plan_counts_wans_vae_and_image_encoder_in_float32(folders):
    """The plan's bytes are the loaded ones (``models.common.placement``): Wan's VAE and image encoder at 4 bytes
    each."""
    from models.common.placement import model_components

    plan = {c.name: c for c in model_components(folders["wan-i2v"], dtype="bf16")}
    assert {size for _, size in plan["vae"].root.tensors} == {4}
    assert {size for c in ("image_encoder",) for u in (plan[c].root, *plan[c].blocks, *plan[c].idle)
            for _, size in u.tensors} == {4}
    assert 2 in {size for _, size in plan["transformer"].blocks[0].tensors}
