"""The embedded default model: deterministic weights, real LTX-Video compression, loads and generates."""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import LTXPipeline
from safetensors.torch import load_file

import models.ltx_video.default as default
from models.ltx_video.default import (
    FORMAT_VERSION,
    MARKER_FILE,
    build_default_components,
    default_model_dir,
    ensure_default_model,
)
from models.ltx_video.loading import load_ltx_video

MODELS = ("transformer", "vae", "text_encoder")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


def _saved_state(folder: Path, name: str) -> dict[str, torch.Tensor]:
    (weights,) = (folder / name).glob("*.safetensors")
    return load_file(weights)


def _run(pipe: LTXPipeline, prompt: str, seed: int) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt,
        num_frames=9,
        height=64,
        width=64,
        num_inference_steps=2,
        decode_timestep=0.05,
        decode_noise_scale=0.025,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
    ).frames


def test_layout_and_marker(model_dir):
    assert model_dir.name == f"tiny-ltx-video-v{FORMAT_VERSION}"
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "LTXPipeline"
    for name in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer"):
        assert (model_dir / name).is_dir() and name in index
    assert json.loads((model_dir / MARKER_FILE).read_text())["format_version"] == FORMAT_VERSION
    scheduler = json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] and scheduler["shift_terminal"] == 0.1
    assert (scheduler["base_shift"], scheduler["max_shift"]) == (0.95, 2.05)
    assert ensure_default_model(model_dir.parent) == model_dir  # second call reuses the folder


def test_two_builds_are_bitwise_identical(tmp_path, model_dir):
    # A different global seed before the second build: the weights must not depend on torch's RNG.
    torch.manual_seed(12345)
    rng_before = torch.get_rng_state()
    other = ensure_default_model(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng_before), "building advanced the caller's global RNG"
    assert other != model_dir
    for name in MODELS:
        a, b = _saved_state(model_dir, name), _saved_state(other, name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}.{key} differs between builds"
    for file in ("tokenizer/tokenizer.json", "vae/config.json", "transformer/config.json"):
        assert (model_dir / file).read_bytes() == (other / file).read_bytes()


def test_vae_keeps_real_compression(model_dir):
    vae = load_ltx_video(model_dir).vae
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio) == (32, 8)
    assert vae.config.timestep_conditioning
    video = torch.rand(1, 3, 17, 64, 96) * 2 - 1  # 17 = 8*2 + 1 frames
    with torch.no_grad():
        latents = vae.encode(video).latent_dist.mode()
        assert tuple(latents.shape) == (1, 16, 3, 2, 3)
        decoded = vae.decode(latents, torch.tensor([0.05])).sample
        decoded_late = vae.decode(latents, torch.tensor([0.5])).sample
    assert tuple(decoded.shape) == (1, 3, 17, 64, 96)
    assert torch.isfinite(decoded).all()
    # Real variation: across pixels, across frames, and the decode timestep reaches the output.
    assert 0.1 < decoded.std().item() < 1.0
    assert (decoded[:, :, 1:] - decoded[:, :, :-1]).abs().mean() > 0.05
    assert (decoded.abs() > 1).float().mean() < 0.1, "too many decoded pixels clip"
    assert (decoded - decoded_late).abs().mean() > 1e-3


def test_loaded_weights_match_in_memory_build(model_dir):
    built = build_default_components()
    loaded = load_ltx_video(model_dir)
    assert loaded.path == model_dir and loaded.dtype == torch.float32
    for name in MODELS:
        model = getattr(loaded, name)
        assert not model.training
        a, b = built[name].state_dict(), model.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}.{key} changed through save/load"


def test_text_encoder_output_is_not_degenerate(model_dir):
    c = load_ltx_video(model_dir)
    ids = c.tokenizer(
        ["a cat walks on the beach", "a red car at night"],
        padding="max_length",
        max_length=16,
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        emb = c.text_encoder(ids.input_ids, attention_mask=ids.attention_mask)[0]
    assert torch.isfinite(emb).all() and 0.3 < emb.std().item() < 3.0
    assert (emb[0] - emb[1]).abs().mean() > 0.1


def test_pipeline_generates_video(model_dir):
    c = load_ltx_video(model_dir)
    pipe = LTXPipeline(
        transformer=c.transformer,
        vae=c.vae,
        scheduler=c.scheduler,
        text_encoder=c.text_encoder,
        tokenizer=c.tokenizer,
    )
    frames = _run(pipe, "a cat walks slowly across the beach at sunset", seed=0)
    assert frames.shape == (1, 9, 64, 64, 3)
    assert np.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    assert frames.std() > 0.05
    assert ((frames == 0) | (frames == 1)).mean() < 0.1, "output is saturated"
    assert np.abs(np.diff(frames[0], axis=0)).mean() > 0.01, "frames do not change over time"
    # The prompt reaches the frames.
    other = _run(pipe, "a red car drives through the city at night", seed=0)
    assert np.abs(frames - other).mean() > 1e-3
    # The stock diffusers loader reads the folder (offline, it is local) and generates the same video.
    stock = LTXPipeline.from_pretrained(model_dir)
    np.testing.assert_array_equal(_run(stock, "a cat walks slowly across the beach at sunset", seed=0), frames)


def test_env_var_and_home_locations(tmp_path, monkeypatch):
    monkeypatch.setenv("CP_INFER_CACHE", str(tmp_path / "env"))
    assert default_model_dir() == (tmp_path / "env" / f"tiny-ltx-video-v{FORMAT_VERSION}").resolve()
    monkeypatch.delenv("CP_INFER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "cp-infer" / f"tiny-ltx-video-v{FORMAT_VERSION}"
    assert default_model_dir() == expected.resolve()


def test_incomplete_folder_is_refused(tmp_path):
    target = default_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "model_index.json").write_text("{}")
    with pytest.raises(ValueError, match="not a complete tiny-ltx-video"):
        ensure_default_model(tmp_path)


def _entries(cache: Path) -> list[str]:
    """The cache folder's entries but the lock files, which stay."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock"))


def test_losing_the_rename_race_uses_the_winner(tmp_path, monkeypatch, model_dir):
    write_model = default._write_model

    def write_then_lose(folder: Path) -> None:
        # A process that takes no lock (an older cp-infer on the same cache) finishes first...
        shutil.copytree(model_dir, default_model_dir(tmp_path))
        write_model(folder)  # ...while this one is still writing its own copy

    monkeypatch.setattr(default, "_write_model", write_then_lose)
    assert ensure_default_model(tmp_path) == default_model_dir(tmp_path)
    assert _entries(tmp_path) == [default_model_dir(tmp_path).name], "temp folder left"


_start_barrier = None


def _init_worker(barrier) -> None:
    global _start_barrier
    _start_barrier = barrier


def _ensure_after_barrier(cache_dir: Path) -> Path:
    # Both processes finish importing before either starts, so both find the folder absent and build.
    _start_barrier.wait(timeout=120)
    return ensure_default_model(cache_dir)


def test_concurrent_builds_from_two_processes(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    with ctx.Pool(2, initializer=_init_worker, initargs=(barrier,)) as pool:
        paths = pool.map_async(_ensure_after_barrier, [tmp_path, tmp_path]).get(timeout=180)
    assert paths[0] == paths[1] == default_model_dir(tmp_path)
    assert _entries(tmp_path) == [paths[0].name], "temp folder left"
    loaded = load_ltx_video(paths[0])
    built = build_default_components()
    for key, value in built["transformer"].state_dict().items():
        assert torch.equal(value, loaded.transformer.state_dict()[key])
