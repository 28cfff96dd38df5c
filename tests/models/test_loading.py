"""The model-folder loader: family detection, dtype parsing, and an error naming the problem for each bad
folder a user can hand us."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from models.common.loading import (
    ModelLoadError,
    detect_family,
    parse_dtype,
    resolve_model,
)
from models.ltx_video.default import default_model_dir, ensure_default_model
from models.ltx_video.loading import LTXVideoComponents, load_ltx_video


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def copy_dir(model_dir, tmp_path) -> Path:
    """A private copy of the default model that a test may break."""
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def _write_index(folder: Path, class_name: str) -> None:
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = class_name
    (folder / "model_index.json").write_text(json.dumps(index))


def test_loads_default_model(model_dir):
    c = load_ltx_video(model_dir, dtype="bf16")
    assert isinstance(c, LTXVideoComponents)
    assert c.path == model_dir and c.dtype == torch.bfloat16 and c.device == torch.device("cpu")
    for model in (c.transformer, c.vae, c.text_encoder):
        assert not model.training and model.dtype == torch.bfloat16
        # 0-d params excepted: diffusers keeps the VAE's timestep_scale_multiplier in float32.
        assert {p.dtype for p in model.parameters() if p.ndim > 0} == {torch.bfloat16}
    with torch.no_grad():
        latents = torch.randn(1, 16, 2, 2, 2, dtype=torch.bfloat16)
        video = c.vae.decode(latents, torch.tensor([0.05], dtype=torch.bfloat16)).sample
    assert video.dtype == torch.bfloat16 and torch.isfinite(video).all()
    with pytest.raises(AttributeError):
        c.dtype = torch.float32  # frozen


def test_detect_family(copy_dir):
    assert detect_family(copy_dir) == "ltx-video"
    _write_index(copy_dir, "LTX2Pipeline")
    assert detect_family(copy_dir) == "ltx2"
    with pytest.raises(ModelLoadError, match=r"is an ltx2 model folder, not LTX-Video; load it with load_ltx2\(\)"):
        load_ltx_video(copy_dir)
    # Without model_index.json the transformer's class decides.
    (copy_dir / "model_index.json").unlink()
    assert detect_family(copy_dir) == "ltx-video"
    config_file = copy_dir / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "_class_name": "LTX2VideoTransformer3DModel"}))
    assert detect_family(copy_dir) == "ltx2"


def test_missing_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        load_ltx_video(missing)
    assert str(missing) in str(info.value) and isinstance(info.value, ValueError)


def test_file_instead_of_directory(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="is a file, not a directory"):
        load_ltx_video(file)


def test_empty_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="not a diffusers-format folder; expected model_index.json"):
        load_ltx_video(tmp_path)


def test_unknown_pipeline_class(copy_dir):
    _write_index(copy_dir, "StableDiffusionPipeline")
    with pytest.raises(ModelLoadError, match="'StableDiffusionPipeline'.*not supported; supported: LTXPipeline"):
        load_ltx_video(copy_dir)


def test_unreadable_model_index(copy_dir):
    (copy_dir / "model_index.json").write_text('{"_class_name": "LTXPip')
    with pytest.raises(ModelLoadError, match="model_index.json is not readable JSON"):
        load_ltx_video(copy_dir)


def test_missing_vae_subfolder(copy_dir):
    shutil.rmtree(copy_dir / "vae")
    with pytest.raises(ModelLoadError, match=r"missing the subfolder\(s\) vae/"):
        load_ltx_video(copy_dir)


def test_truncated_transformer_weights(copy_dir):
    (weights,) = (copy_dir / "transformer").glob("*.safetensors")
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match="could not load transformer/ from") as info:
        load_ltx_video(copy_dir)
    assert info.value.__cause__ is not None  # the underlying error is chained, and quoted in the message


def test_tokenizer_without_vocabulary(copy_dir):
    # transformers 5 would quietly build a placeholder tokenizer from this folder.
    (copy_dir / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer/ .* holds none of tokenizer.json, spiece.model"):
        load_ltx_video(copy_dir)


def test_missing_text_encoder_weights(copy_dir):
    (copy_dir / "text_encoder" / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="could not load text_encoder/"):
        load_ltx_video(copy_dir)


def test_corrupt_vae_config(copy_dir):
    (copy_dir / "vae" / "config.json").write_text("not json")
    with pytest.raises(ModelLoadError, match="could not load vae/"):
        load_ltx_video(copy_dir)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("fp32", torch.float32), ("BF16", torch.bfloat16), ("float16", torch.float16), (torch.bfloat16, torch.bfloat16)],
)
def test_parse_dtype(value, expected):
    assert parse_dtype(value) is expected


@pytest.mark.parametrize("value", ["fp8", "", torch.float64, torch.int8, 16, None])
def test_parse_dtype_rejects(value):
    with pytest.raises(ValueError, match=r"dtype=.* is not supported; use one of 'fp32', 'bf16', 'fp16'"):
        parse_dtype(value)


def test_resolve_model(tmp_path, monkeypatch, model_dir):
    monkeypatch.setenv("CP_INFER_CACHE", str(tmp_path))
    assert resolve_model(None) == default_model_dir() == default_model_dir(tmp_path)
    assert resolve_model("tiny-ltx-video") == default_model_dir(tmp_path)
    assert resolve_model(str(model_dir)) == model_dir
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(tmp_path / "missing")


def test_the_served_name_of_a_model(tmp_path):
    """What ``serve`` answers to as ``model`` by default: a hub id as written, a folder's name, a file's stem."""
    from models.common.loading import model_name

    (tmp_path / "my-ltx").mkdir()
    (tmp_path / "ltxv-2b.safetensors").write_bytes(b"")
    assert model_name(None) == "tiny-ltx-video" and model_name("tiny-ltx2") == "tiny-ltx2"
    assert model_name("Lightricks/LTX-Video") == "Lightricks/LTX-Video"
    assert model_name("Lightricks/LTX-Video@0.9.7") == "Lightricks/LTX-Video@0.9.7"
    assert model_name(tmp_path / "my-ltx") == "my-ltx"
    assert model_name(tmp_path / "ltxv-2b.safetensors") == "ltxv-2b"
