"""``--lora-dir`` / ``--lora NAME[:SCALE]`` and a prompts file's ``loras``: every refusal exits 2 naming ``--lora``
(or the line) before anything starts, and ``generate --nproc 2`` with adapters writes the video that one rank makes
in process with the same adapters."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cp_infer import single_process_state
from cp_infer.request import GenerationLimits, GenerationRequest
from cp_infer.sampler import sample
from cp_infer.video_io import read_frames_dir
from models.ltx_video.default import ensure_default_model
from models.ltx_video.loading import load_ltx_video
from models.registry import describe_model, open_model
from server.cli import batch
from server.cli import command as cli

from ...lora_adapters import LTX_VIDEO_A, LTX_VIDEO_B, make_adapter

REPO = Path(__file__).resolve().parents[3]
SHAPE = ["--frames", "9", "--height", "64", "--width", "96", "--steps", "2", "--fps", "24", "--seed", "7"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(cache, adapter folder): ``a``, ``b``; ``sd`` (another model's modules); ``pickle`` (not safetensors)."""
    root = tmp_path_factory.mktemp("cli_loras")
    cache = root / "cache"
    c = load_ltx_video(ensure_default_model(cache))
    adapters = root / "adapters"
    adapters.mkdir()
    make_adapter(c, adapters / "a.safetensors", seed=1, targets=LTX_VIDEO_A)
    make_adapter(c, adapters / "b.safetensors", seed=2, targets=LTX_VIDEO_B)
    save_file({"transformer.up_blocks.0.to_k.lora_A.weight": torch.randn(4, 32),
               "transformer.up_blocks.0.to_k.lora_B.weight": torch.randn(32, 4)}, adapters / "sd.safetensors")
    (adapters / "pickle.safetensors").write_bytes(b"\x80\x04\x95 a pickle, never loaded")
    return cache, adapters


@pytest.fixture
def nothing_starts(monkeypatch, setup):
    """In-process ``cli.main`` where starting a group or loading a model fails the test."""
    import server.group.runtime

    def forbidden(*_args, **_kwargs):
        raise AssertionError("a bad request must be refused before anything starts")

    monkeypatch.setenv("CP_INFER_CACHE", str(setup[0]))
    monkeypatch.setattr(cli, "relaunch_under_torchrun", forbidden)
    monkeypatch.setattr(server.group.runtime, "start_runtime", forbidden)
    for name in ("RANK", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in ("DIFFUSERS_VERBOSITY", "TRANSFORMERS_VERBOSITY", "TRANSFORMERS_NO_ADVISORY_WARNINGS"):
        monkeypatch.setenv(name, "error")  # main() sets them; monkeypatch puts the old values back


@pytest.mark.parametrize("flags, says", [
    (["--lora", "nope"], "--lora: loras[0].name='nope' is not an adapter in --lora-dir"),
    (["--lora", "../a"], "--lora: loras[0].name='../a' is not an adapter name"),
    (["--lora", "a:9"], "--lora: loras[0].scale=9.0 is out of range"),
    (["--lora", "a:nan"], "--lora: loras[0].scale=nan must be a finite number"),
    (["--lora", "a:high"], "is not NAME[:SCALE]"),
    ([arg for n in ("a", "b", "sd", "pickle", "x") for arg in ("--lora", n)], "--lora: loras names 5 adapters"),
    (["--lora", "a", "--lora", "b:0.5", "--lora", "a:2"], "--lora: loras[2].name='a' is given twice"),
    (["--lora", "sd"], "--lora: loras[0].name='sd' matches no module of the loaded model"),
    (["--lora", "pickle"], "--lora: loras[0].name='pickle' is not a readable safetensors file"),
    (["--lora", "a", "--lora-dir", None],
     "--lora: loras: this deployment has no adapters (it was started without --lora-dir"),
    (["--lora-dir", "/nonexistent/adapters"], "lora_dir='/nonexistent/adapters' is not a folder"),
])
def test_generate_refuses_bad_loras_before_starting(nothing_starts, setup, tmp_path, capsys, flags, says):
    given = ["--lora-dir", str(setup[1])] if "--lora-dir" not in flags else []
    flags = [f for f in flags if f is not None]
    if flags[-1:] == ["--lora-dir"]:
        flags = flags[:-1]  # no directory at all
    try:
        code = cli.main(["generate", "--prompt", "a fox", *SHAPE, *given, *flags, "--nproc", "2",
                         "--out", str(tmp_path / "x.mp4")])
    except SystemExit as exc:  # argparse's own refusal of a flag's value
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err, err


def test_batch_lines_with_loras_are_checked(setup, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in (
        {"prompt": "one", "loras": [{"name": "a", "scale": 0.5}, "b:-1"]},
        {"prompt": "two", "loras": ["nope"]},
        {"prompt": "three", "loras": "a"},
        {"prompt": "four", "loras": [{"name": "a", "weight": 1}]},
        {"prompt": "five", "loras": ["sd"]},
        {"prompt": "six"},  # the --lora default
    )))
    args = cli.build_parser(["batch"]).parse_args(["batch", str(prompts), "--out-dir", str(tmp_path / "o"),
                                                   "--lora-dir", str(setup[1]), "--lora", "b:0.25", *SHAPE[:6]])
    items = batch._plan_batch(args, describe_model(ensure_default_model(setup[0])), GenerationLimits())
    assert [i.status for i in items] == ["todo", "invalid", "invalid", "invalid", "invalid", "todo"], items
    assert [(lora.name, lora.scale) for lora in items[0].request.loras] == [("a", 0.5), ("b", -1.0)]
    assert "is not an adapter in --lora-dir" in items[1].message
    assert "loras must be a list" in items[2].message and "loras[0] must be an object" in items[3].message
    assert "matches no module" in items[4].message
    assert [(lora.name, lora.scale) for lora in items[5].request.loras] == [("b", 0.25)]


def test_generate_with_adapters_on_two_ranks_equals_one_rank(setup, tmp_path):
    cache, adapters = setup
    out = tmp_path / "frames/"
    env = dict(os.environ, CP_INFER_CACHE=str(cache), PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--prompt", "a fox with adapters",
                          *SHAPE, "--guidance-scale", "3", "--lora-dir", str(adapters), "--lora", "a:0.8",
                          "--lora", "b:-1.5", "--nproc", "2", "--out", f"{out}/"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    frames = read_frames_dir(out)[0]
    state = single_process_state()
    model = open_model(ensure_default_model(cache), dtype="fp32", state=state, lora_dir=adapters)
    request = GenerationRequest.of(prompt="a fox with adapters", num_frames=9, height=64, width=96,
                                   num_inference_steps=2, fps=24, seed=7, guidance_scale=3.0,
                                   loras=[{"name": "a", "scale": 0.8}, {"name": "b", "scale": -1.5}])
    expected = sample(model, request, state=state)
    plain = sample(model, dataclasses.replace(request, loras=()), state=state)
    diff = np.abs(frames.astype(np.int16) - expected.astype(np.int16))
    assert diff.max() <= 1 and diff.mean() < 0.02, (diff.max(), diff.mean())  # fp32 order (test_lora.py)
    assert np.abs(frames.astype(int) - plain).mean() > 0.5, "the adapters changed nothing"
