"""``loras`` through the HTTP API: every refusal is a 400 naming ``loras`` and the fix, in JSON and form bodies,
checked in process against a real adapter directory (``models.common.lora.LoraCatalog`` over the tiny model, from the
files' headers); and against the real server (a 2-rank group), a job with adapters completes with them in its job
object, differs from the same job without, is refused there the same way, and ``GET /v1/models`` lists the
adapters and which are loaded."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save_file

from cp_infer.request import LoraWeight
from models.ltx_video.default import ensure_default_model
from models.ltx_video.loading import load_ltx_video
from models.registry import describe_model, lora_catalog
from server.http.app import AppConfig, create_app

from ...lora_adapters import LTX_VIDEO_A, LTX_VIDEO_B, make_adapter
from ..conftest import lossless_frames, tiny
from .test_server_app import StubEngine


def _write_adapters(folder, model_dir) -> None:
    """``a`` and ``b`` (random, for the tiny LTX-Video); ``sd``: a LoRA of another model's modules; ``pickle``: a
    ``.safetensors`` name over pickle bytes; ``weights.bin``: not a ``.safetensors`` file; ``link``: a link out of the
    folder."""
    c = load_ltx_video(model_dir)
    make_adapter(c, folder / "a.safetensors", seed=1, targets=LTX_VIDEO_A)
    make_adapter(c, folder / "b.safetensors", seed=2, targets=LTX_VIDEO_B)
    save_file({"transformer.down_blocks.0.attentions.0.to_q.lora_A.weight": torch.randn(4, 32),
               "transformer.down_blocks.0.attentions.0.to_q.lora_B.weight": torch.randn(32, 4)},
              folder / "sd.safetensors")
    (folder / "pickle.safetensors").write_bytes(b"\x80\x04\x95 a pickle, never loaded")
    shutil.copy(folder / "a.safetensors", folder / "weights.bin")
    outside = folder.parent / f"{folder.name}-outside"
    outside.mkdir(exist_ok=True)
    shutil.copy(folder / "a.safetensors", outside / "a.safetensors")
    os.symlink(outside / "a.safetensors", folder / "link.safetensors")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The app over a stub engine whose adapter check is the real one, over a directory of the adapters above."""
    root = tmp_path_factory.mktemp("loras")
    model_dir = ensure_default_model(root / "cache")
    adapters = root / "adapters"
    adapters.mkdir()
    _write_adapters(adapters, model_dir)
    engine = StubEngine(root / "data")
    catalog = lora_catalog(describe_model(model_dir), adapters)
    engine.check_loras = lambda loras, stages=1: catalog.check(loras)
    engine.adapters = lambda: [{**a, "loaded": False} for a in catalog.adapters()]
    with TestClient(create_app(AppConfig(), engine)) as c:
        yield c


# (loras, what the message says) of every refusal; the same for JSON and for form fields.
REFUSED = [
    ([{"name": "nope"}], "is not an adapter in --lora-dir"),
    ([{"name": "a/b"}], "is not an adapter name"),
    ([{"name": "../a"}], "is not an adapter name"),
    ([{"name": "/etc/passwd"}], "is not an adapter name"),
    ([{"name": "a", "scale": 9}], "out of range"),
    ([{"name": "a", "scale": -4.5}], "out of range"),
    ([{"name": n} for n in ("a", "b", "sd", "pickle", "link")], "at most 4"),
    ([{"name": "a"}, {"name": "b", "scale": 0.5}, {"name": "a", "scale": 2}], "given twice"),
    ([{"name": "sd"}], "matches no module of the loaded model"),
    ([{"name": "pickle"}], "is not a readable safetensors file"),
    ([{"name": "weights"}], "is not an adapter in --lora-dir"),  # weights.bin: only .safetensors are adapters
    ([{"name": "link"}], "is not a regular file inside the adapter directory"),
]


def _form(loras) -> dict[str, str]:
    fields = {}
    for i, lora in enumerate(loras):
        fields.update({f"loras[{i}][{k}]": str(v) for k, v in lora.items()})
    return fields


@pytest.mark.parametrize("loras, says", REFUSED, ids=[f"{i}" for i in range(len(REFUSED))])
@pytest.mark.parametrize("body", ["json", "form"])
def test_every_refusal_is_a_400_naming_loras(client, loras, says, body):
    fields = tiny(num_frames=9)
    if body == "json":
        r = client.post("/v1/videos", json={**fields, "loras": loras})
    else:
        r = client.post("/v1/videos", data={k: str(v) for k, v in fields.items()} | _form(loras))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("loras") and says in error["message"], error


@pytest.mark.parametrize("bad, code", [
    ({"loras": [{"name": "a", "scale": "high"}]}, "invalid_type"),
    ({"loras": [{"name": "a", "weight": 1}]}, "unknown_parameter"),
    ({"loras": {"name": "a"}}, "invalid_type"),
    ({"loras": ["a"]}, "invalid_type"),
])
def test_malformed_loras_are_refused(client, bad, code):
    r = client.post("/v1/videos", json={**tiny(), **bad})
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert r.json()["error"]["param"].startswith("loras"), r.text


def test_warm_makes_every_verdict_so_no_request_builds_the_model(tmp_path):
    """The leader warms its catalog before it reports ready: a request's check then only looks its verdict up."""
    model_dir = ensure_default_model(tmp_path / "cache")
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    _write_adapters(adapters, model_dir)
    info, built = describe_model(model_dir), []
    catalog = lora_catalog(info, adapters)
    targets_of = catalog._targets_of
    catalog._targets_of = lambda: built.append(1) or targets_of()
    catalog.warm()
    assert built == [1]
    verdicts = dict(catalog._verdicts)
    assert {key[0] for key in verdicts} == {"a", "b", "sd"}  # pickle's header is refused by name, link is out
    catalog.check((LoraWeight("a"), LoraWeight("b", 0.5)))
    with pytest.raises(ValueError, match=r"loras\[0\]\.name='sd' matches no module"):
        catalog.check((LoraWeight("sd"),))
    assert built == [1] and catalog._verdicts == verdicts


def test_accepted_loras_are_in_the_job(client):
    r = client.post("/v1/videos", json={**tiny(), "loras": [{"name": "a", "scale": 0.8}, {"name": "b"}]})
    assert r.status_code == 200, r.text
    assert r.json()["loras"] == [{"name": "a", "scale": 0.8}, {"name": "b", "scale": 1.0}]
    assert client.get(f"/v1/videos/{r.json()['id']}").json()["loras"] == r.json()["loras"]
    # Form bodies: fields, or one field holding the JSON list.
    fields = {k: str(v) for k, v in tiny().items()}
    for extra in ({"loras[0][name]": "b", "loras[0][scale]": "-0.5"},
                  {"loras": json.dumps([{"name": "b", "scale": -0.5}])}):
        r = client.post("/v1/videos", data=fields | extra)
        assert r.status_code == 200 and r.json()["loras"] == [{"name": "b", "scale": -0.5}], r.text
    r = client.post("/v1/videos", json=tiny())
    assert r.json()["loras"] == []
    names = [a["name"] for a in client.get("/v1/models").json()["data"][0]["adapters"]]
    assert names == ["a", "b", "sd"], names  # not pickle (no safetensors), not weights.bin, not the link out


@pytest.fixture(scope="module")
def served(api_server, cache_dir):
    """The shared server, its adapter directory holding ``a`` and ``sd`` (placed after it started)."""
    c = load_ltx_video(ensure_default_model(cache_dir))
    make_adapter(c, api_server.lora_dir / "a.safetensors", seed=5, targets=LTX_VIDEO_A, scale=0.8)
    save_file({"transformer.mid_block.to_q.lora_A.weight": torch.randn(4, 32),
               "transformer.mid_block.to_q.lora_B.weight": torch.randn(32, 4)}, api_server.lora_dir / "sd.safetensors")
    return api_server


def test_a_served_job_applies_its_adapters(served):
    body = tiny("a fox with an adapter", num_frames=9, seed=77)
    with_adapter = served.submit({**body, "loras": [{"name": "a", "scale": 1.5}]})
    assert with_adapter["loras"] == [{"name": "a", "scale": 1.5}]
    plain = served.submit(body)
    done = served.wait_job(with_adapter["id"])
    assert done["status"] == "completed" and done["loras"] == [{"name": "a", "scale": 1.5}], done
    assert served.wait_job(plain["id"])["status"] == "completed"
    frames, base = lossless_frames(served, with_adapter["id"]), lossless_frames(served, plain["id"])
    assert np.abs(frames.astype(int) - base).mean() > 0.5, "the adapter changed nothing"
    adapters = {a["name"]: a for a in served.client.get("/v1/models").json()["data"][0]["adapters"]}
    assert adapters["a"]["loaded"] and adapters["a"]["bytes"] > 0 and not adapters["sd"]["loaded"], adapters
    # A remix keeps the adapters.
    remix = served.client.post(f"/v1/videos/{with_adapter['id']}/remix", json={"prompt": "a fox, remixed"})
    assert remix.status_code == 200 and remix.json()["loras"] == [{"name": "a", "scale": 1.5}], remix.text
    assert served.wait_job(remix.json()["id"])["status"] == "completed"


@pytest.mark.parametrize("loras, says", [
    ([{"name": "missing"}], "is not an adapter in --lora-dir"),
    ([{"name": "sd"}], "matches no module"),
    ([{"name": "a", "scale": 5}], "out of range"),
])
def test_the_served_front_end_refuses_before_anything_runs(served, loras, says):
    sent = served.metric("cp_infer_requests_broadcast_total")
    r = served.client.post("/v1/videos", json={**tiny(), "loras": loras})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("loras"), r.text
    assert says in r.json()["error"]["message"], r.text
    assert served.metric("cp_infer_requests_broadcast_total") == sent
