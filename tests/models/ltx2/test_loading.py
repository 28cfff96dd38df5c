"""load_ltx2: every component of an LTX-2 folder in the asked dtype, and an error naming the problem (the component,
the file, what is wrong with it) for each bad LTX-2 folder a user can hand us."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from models.common.embedded import MARKER_FILE
from models.common.loading import ModelLoadError, detect_family
from models.ltx2.default import ensure_default_ltx2_model
from models.ltx2.loading import LTX2Components, load_ltx2
from models.ltx_video.default import ensure_default_model
from models.ltx_video.loading import load_ltx_video

MODELS = ("transformer", "vae", "audio_vae", "vocoder", "connectors", "text_encoder")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_ltx2_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def copy_dir(model_dir, tmp_path) -> Path:
    """A private copy of tiny-ltx2 that a test may break."""
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def test_loads_in_bf16(model_dir):
    c = load_ltx2(model_dir, dtype="bf16")
    assert isinstance(c, LTX2Components) and detect_family(model_dir) == "ltx2"
    assert c.path == model_dir and c.dtype == torch.bfloat16 and c.device == torch.device("cpu")
    for name in MODELS:
        model = getattr(c, name)
        assert not model.training
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, name
    mel = torch.randn(1, 2, 4, 16, dtype=torch.bfloat16)  # B, latent channels, audio latents, latent mel bins
    with torch.no_grad():
        spectrogram = c.audio_vae.decode(mel).sample
        waveform = c.vocoder(spectrogram)
    # B, stereo, 4 * 4 - 3 = 13 mel frames, 64 bins -> 13 * 240 samples at 24 kHz.
    assert tuple(spectrogram.shape) == (1, 2, 13, 64) and tuple(waveform.shape) == (1, 2, 13 * 240)
    assert waveform.dtype == torch.bfloat16 and torch.isfinite(waveform).all()


def test_families_point_to_their_loader(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"is an ltx2 model folder, not LTX-Video; load it with load_ltx2\(\)"):
        load_ltx_video(model_dir)
    ltx_video_dir = ensure_default_model(tmp_path)
    with pytest.raises(ModelLoadError, match=r"is an ltx-video model folder, not LTX-2; load it with load_ltx_video"):
        load_ltx2(ltx_video_dir)


@pytest.mark.parametrize("subfolder", ["audio_vae", "vocoder", "connectors", "text_encoder"])
def test_missing_subfolder(copy_dir, subfolder):
    shutil.rmtree(copy_dir / subfolder)
    with pytest.raises(ModelLoadError, match=rf"missing the subfolder\(s\) {subfolder}/; an LTX-2 folder needs"):
        load_ltx2(copy_dir)


def test_truncated_connector_weights(copy_dir):
    (weights,) = (copy_dir / "connectors").glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="could not load connectors/ from") as info:
        load_ltx2(copy_dir)
    assert info.value.__cause__ is not None


def test_tokenizer_without_vocabulary(copy_dir):
    # transformers 5 would quietly build a five-token placeholder Gemma tokenizer from this folder.
    (copy_dir / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer/ .* holds none of tokenizer.json, tokenizer.model"):
        load_ltx2(copy_dir)


def test_unsupported_vocoder_class(copy_dir):
    config_file = copy_dir / "vocoder" / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "_class_name": "HifiGanVocoder"}))
    supported = "supported: LTX2Vocoder, LTX2VocoderWithBWE$"
    with pytest.raises(ModelLoadError, match=f"vocoder class 'HifiGanVocoder' .* {supported}"):
        load_ltx2(copy_dir)


def test_corrupt_text_encoder_config(copy_dir):
    (copy_dir / "text_encoder" / "config.json").write_text("not json")
    with pytest.raises(ModelLoadError, match="could not load text_encoder/"):
        load_ltx2(copy_dir)


def _user_copy(model_dir: Path, tmp_path: Path) -> Path:
    """A copy of tiny-ltx2 without its marker: a folder as a user would hand it over."""
    return Path(shutil.copytree(model_dir, tmp_path / "user", ignore=shutil.ignore_patterns(MARKER_FILE)))


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        ("truncate", r"text_encoder/model\.safetensors is truncated \(\d+ of the \d+ bytes its header describes\)"),
        ("cut_header", r"text_encoder/model\.safetensors is truncated \(5 bytes, shorter than a safetensors header\)"),
        ("delete", r"text_encoder/ holds no weights file \(no \*\.safetensors or \*\.bin\)"),
        ("empty_folder", r"text_encoder/ is empty"),
        ("empty_file", r"text_encoder/model\.safetensors is empty \(0 bytes\)"),
    ],
)
def test_a_broken_user_folder_names_the_component_and_file(model_dir, tmp_path, damage, problem):
    folder = _user_copy(model_dir, tmp_path)
    weights = folder / "text_encoder" / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncate":
        weights.write_bytes(data[: len(data) - 1000])
    elif damage == "cut_header":
        weights.write_bytes(data[:5])
    elif damage == "delete":
        weights.unlink()
    elif damage == "empty_folder":
        shutil.rmtree(folder / "text_encoder")
        (folder / "text_encoder").mkdir()
    else:
        weights.write_bytes(b"")
    with pytest.raises(ModelLoadError) as info:
        load_ltx2(folder)
    message = str(info.value)
    assert re.match(rf"could not load text_encoder/ from '{re.escape(str(folder))}': {problem} \(\w+: [^\n]+\); "
                    "restore what is missing or broken from the checkpoint", message), message
    assert "\n" not in message and "re-download" not in message
    assert info.value.__cause__ is not None


def test_a_broken_embedded_folder_says_how_to_rebuild_it(model_dir, tmp_path):
    folder = Path(shutil.copytree(model_dir, tmp_path / "embedded"))
    shutil.rmtree(folder / "text_encoder")
    (folder / "text_encoder").mkdir()
    expected = (r"could not load text_encoder/ .*: text_encoder/ is empty \(.*\); it is the embedded default model "
                r"'tiny-ltx2': load it by that name to rebuild it")
    with pytest.raises(ModelLoadError, match=expected):
        load_ltx2(folder)
