"""The embedded LTX-2 default model "tiny-ltx2": deterministic weights, real compression and audio rates, an
offline Gemma tokenizer, and diffusers' own LTX2Pipeline generating video and audio from it."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import LTX2Pipeline
from safetensors.torch import load_file
from transformers import AutoTokenizer, GemmaTokenizer

from models.common.embedded import MARKER_FILE
from models.common.loading import resolve_model
from models.common.tokenizer import build_offline_gemma_tokenizer
from models.ltx2.default import (
    LTX2_FORMAT_VERSION,
    build_ltx2_components,
    default_ltx2_model_dir,
    ensure_default_ltx2_model,
    save_ltx2_model,
)
from models.ltx2.loading import LTX2Components, load_ltx2

MODELS = ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder")
COMPONENTS = (*MODELS, "scheduler", "tokenizer")
PROMPT = "A cat walks slowly across the beach at sunset."
# 128 = the connectors' learnable-register count: the shortest prompt length LTX2Pipeline accepts here.
MAX_SEQUENCE_LENGTH = 128
NO_GUIDANCE = dict(
    guidance_scale=1.0,
    audio_guidance_scale=1.0,
    stg_scale=0.0,
    audio_stg_scale=0.0,
    modality_scale=1.0,
    audio_modality_scale=1.0,
)
# CFG alone: the pipeline's defaults also run STG and modality-isolation passes (3 forwards per step).
CFG = {**NO_GUIDANCE, "guidance_scale": 3.0, "audio_guidance_scale": 3.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_ltx2_model(tmp_path_factory.mktemp("cache"))


def _pipeline(c: LTX2Components | dict) -> LTX2Pipeline:
    get = c.__getitem__ if isinstance(c, dict) else lambda name: getattr(c, name)
    pipe = LTX2Pipeline(**{name: get(name) for name in COMPONENTS})
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe: LTX2Pipeline, prompt: str, seed: int, *, num_frames: int = 9, frame_rate: float = 24.0, **kw):
    out = pipe(
        prompt,
        height=64,
        width=64,
        num_frames=num_frames,
        frame_rate=frame_rate,
        num_inference_steps=2,
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        generator=torch.Generator().manual_seed(seed),
        output_type="np",
        **{**CFG, **kw},
    )
    return out.frames, out.audio


def _saved_state(folder: Path, name: str) -> dict[str, torch.Tensor]:
    (weights,) = (folder / name).glob("*.safetensors")
    return load_file(weights)


def test_layout_and_marker(model_dir):
    assert model_dir.name == f"tiny-ltx2-v{LTX2_FORMAT_VERSION}"
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == "LTX2Pipeline"
    for name in COMPONENTS:
        assert (model_dir / name).is_dir() and index[name][1] is not None
    marker = json.loads((model_dir / MARKER_FILE).read_text())
    assert (marker["name"], marker["format_version"]) == ("tiny-ltx2", LTX2_FORMAT_VERSION)
    files = {p.relative_to(model_dir).as_posix(): p for p in model_dir.rglob("*") if p.is_file()}
    assert set(marker["files"]) == set(files) - {MARKER_FILE} and "text_encoder/model.safetensors" in marker["files"]
    for rel, entry in marker["files"].items():
        data = files[rel].read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    scheduler = json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] and not scheduler["stochastic_sampling"]
    assert (scheduler["base_shift"], scheduler["max_shift"], scheduler["shift_terminal"]) == (0.95, 2.05, 0.1)
    assert ensure_default_ltx2_model(model_dir.parent) == model_dir  # second call reuses the folder


def test_two_builds_are_bitwise_identical(tmp_path, model_dir):
    # A different global seed before the second build: the weights must not depend on torch's RNG.
    torch.manual_seed(4321)
    rng_before = torch.get_rng_state()
    other = ensure_default_ltx2_model(tmp_path)
    assert torch.equal(torch.get_rng_state(), rng_before), "building advanced the caller's global RNG"
    assert other != model_dir
    for name in MODELS:
        a, b = _saved_state(model_dir, name), _saved_state(other, name)
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}.{key} differs between builds"
    for name in MODELS:
        assert (model_dir / name / "config.json").read_bytes() == (other / name / "config.json").read_bytes()
    assert (model_dir / "tokenizer/tokenizer.json").read_bytes() == (other / "tokenizer/tokenizer.json").read_bytes()


def test_load_roundtrip_matches_in_memory_build(model_dir):
    built = build_ltx2_components()
    loaded = load_ltx2(model_dir)
    assert loaded.path == model_dir and loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    for name in MODELS:
        model = getattr(loaded, name)
        assert type(model) is type(built[name]) and not model.training
        a, b = built[name].state_dict(), model.state_dict()
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}.{key} changed through save/load"
    private = ("_class_name", "_diffusers_version", "_use_default_values")
    assert {k: v for k, v in loaded.scheduler.config.items() if k not in private} == {
        k: v for k, v in built["scheduler"].config.items() if k not in private
    }
    with pytest.raises(AttributeError):
        loaded.dtype = torch.bfloat16  # frozen


def test_gemma_tokenizer_is_offline_and_round_trips(model_dir):
    tok = build_offline_gemma_tokenizer()
    assert isinstance(tok, GemmaTokenizer) and tok.padding_side == "left"
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok(PROMPT).input_ids
    tokens = tok.convert_ids_to_tokens(ids)
    assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
    # Pinned: a change here changes tiny-ltx2's text path, which needs an LTX2_FORMAT_VERSION bump.
    assert tokens == ["<bos>", "A", "▁cat", "▁walks", "▁slowly", "▁across", "▁the", "▁beach", "▁at", "▁sunset", "."]
    assert tok.decode(ids, skip_special_tokens=True) == PROMPT
    # Whatever a user pastes falls back to bytes, never to <unk>, and survives save/load unchanged.
    rng = random.Random(0)
    texts = [PROMPT, "Zebras (slow motion) ÄÖÜ 日本語 🎬", "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(60))]
    for loader in (GemmaTokenizer.from_pretrained, AutoTokenizer.from_pretrained):
        loaded = loader(model_dir / "tokenizer")
        assert type(loaded) is GemmaTokenizer
        kwargs = dict(padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True)
        assert loaded(texts, **kwargs).input_ids == tok(texts, **kwargs).input_ids
    assert all(tok.unk_token_id not in row for row in tok(texts).input_ids)


def test_video_vae_keeps_real_compression(model_dir):
    vae = load_ltx2(model_dir).vae
    assert (vae.spatial_compression_ratio, vae.temporal_compression_ratio) == (32, 8)
    video = torch.rand(1, 3, 17, 64, 96) * 2 - 1  # 17 = 8*2 + 1 frames
    with torch.no_grad():
        latents = vae.encode(video).latent_dist.mode()
        decoded = vae.decode(latents).sample
    assert tuple(latents.shape) == (1, 16, 3, 2, 3)
    assert tuple(decoded.shape) == (1, 3, 17, 64, 96) and torch.isfinite(decoded).all()
    assert 0.1 < decoded.std().item() < 1.0
    assert (decoded.abs() > 1).float().mean() < 0.05, "too many decoded pixels clip"


def test_pipeline_generates_video_and_audio(model_dir):
    c = load_ltx2(model_dir)
    pipe = _pipeline(c)
    frames, audio = _run(pipe, PROMPT, seed=0)
    assert frames.shape == (1, 9, 64, 64, 3)
    assert np.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1
    assert frames.std() > 0.05 and ((frames == 0) | (frames == 1)).mean() < 0.05, "flat or saturated frames"
    assert np.abs(np.diff(frames[0], axis=0)).mean() > 0.01, "frames do not change over time"
    # Stereo at the vocoder's 24 kHz: 9 frames at 24 fps = 0.375 s -> round(0.375 * 25) = 9 audio latents ->
    # 4 * 9 - 3 = 33 mel frames (the causal audio VAE trims 3) -> 33 * 240 samples.
    assert c.vocoder.config.output_sampling_rate == 24_000
    assert isinstance(audio, torch.Tensor) and tuple(audio.shape) == (1, 2, 33 * 240)
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1 and audio.std() > 1e-3
    # Same seed, same output; the prompt reaches both modalities; so does guidance.
    again_frames, again_audio = _run(pipe, PROMPT, seed=0)
    np.testing.assert_array_equal(again_frames, frames)
    torch.testing.assert_close(again_audio, audio, rtol=0, atol=0)
    other_frames, other_audio = _run(pipe, "a red car drives through the city at night", seed=0)
    assert np.abs(other_frames - frames).mean() > 1e-3 and (other_audio - audio).abs().mean() > 1e-4
    plain_frames, plain_audio = _run(pipe, PROMPT, seed=0, **NO_GUIDANCE)
    assert np.isfinite(plain_frames).all() and torch.isfinite(plain_audio).all()
    assert np.abs(plain_frames - frames).mean() > 1e-4
    # The stock diffusers loader reads the folder (offline: it is local) and generates the same output.
    stock = LTX2Pipeline.from_pretrained(model_dir)
    stock.set_progress_bar_config(disable=True)
    stock_frames, stock_audio = _run(stock, PROMPT, seed=0)
    np.testing.assert_array_equal(stock_frames, frames)
    torch.testing.assert_close(stock_audio, audio, rtol=0, atol=0)


def test_audio_length_follows_num_frames_and_frame_rate(model_dir):
    pipe = _pipeline(load_ltx2(model_dir))
    num_frames, frame_rate = 17, 12.0  # 17 / 12 s -> round(1.4167 * 25) = 35 audio latents
    frames, audio = _run(pipe, PROMPT, seed=1, num_frames=num_frames, frame_rate=frame_rate, **NO_GUIDANCE)
    assert frames.shape == (1, 17, 64, 64, 3)
    latents = round(num_frames / frame_rate * 16_000 / 160 / 4)
    assert tuple(audio.shape) == (1, 2, (4 * latents - 3) * 240) == (1, 2, 32_880)


@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_rope_types(tmp_path, rope_type):
    components = build_ltx2_components(rope_type=rope_type)
    assert components["transformer"].config.rope_type == rope_type
    assert components["connectors"].config.rope_type == rope_type
    if rope_type == "split":  # the default ("interleaved") is what the folder tests above run
        c = load_ltx2(save_ltx2_model(tmp_path / "split", rope_type="split"))
        assert c.transformer.config.rope_type == c.connectors.config.rope_type == "split"
        frames, audio = _run(_pipeline(c), PROMPT, seed=0, **NO_GUIDANCE)
        assert np.isfinite(frames).all() and frames.std() > 0.05 and torch.isfinite(audio).all()


def test_unknown_rope_type_is_refused():
    with pytest.raises(ValueError, match=r"rope_type='rotary' is not supported; use one of 'interleaved', 'split'"):
        build_ltx2_components(rope_type="rotary")


def test_locations_and_resolve(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("CP_INFER_CACHE", str(model_dir.parent))
    expected = (model_dir.parent / f"tiny-ltx2-v{LTX2_FORMAT_VERSION}").resolve()
    assert default_ltx2_model_dir() == expected == resolve_model("tiny-ltx2")
    monkeypatch.delenv("CP_INFER_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_ltx2_model_dir() == (tmp_path / "home" / ".cache" / "cp-infer" / expected.name).resolve()


def test_incomplete_folder_is_refused(tmp_path):
    target = default_ltx2_model_dir(tmp_path)
    target.mkdir(parents=True)
    (target / "model_index.json").write_text("{}")
    with pytest.raises(ValueError, match=f"not a complete tiny-ltx2 v{LTX2_FORMAT_VERSION} build"):
        ensure_default_ltx2_model(tmp_path)
