"""Load a diffusers-format model folder (LTX-Video or LTX-2) into its components, with errors that say what
is wrong.

Invariants:
- Local only: every `from_pretrained` gets `local_files_only=True`, so a bad path never turns into a hub
  download attempt.
- Every failure a user can cause (wrong path, wrong folder, missing component, broken weights) is a
  `ModelLoadError`, a `ValueError` whose message names the path or subfolder, what is wrong with it (the file
  that is missing, truncated or unreadable, where it can tell) and the underlying error in one line. For an
  embedded default's folder (one with `MARKER_FILE`) the fix is to load it by name, which rebuilds it.
- Loaded models are in eval mode, on `device`, in `dtype` (the VAE included).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    AutoencoderKLLTXVideo,
    FlowMatchEulerDiscreteScheduler,
    LTX2VideoTransformer3DModel,
    LTXEulerAncestralRFScheduler,
    LTXVideoTransformer3DModel,
)
from diffusers.pipelines.ltx.modeling_latent_upsampler import LTXLatentUpsamplerModel
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from transformers import Gemma3ForConditionalGeneration, GemmaTokenizer, T5EncoderModel, T5Tokenizer

from models._folder_problems import component_problem, error_line
from models.default import DEFAULT_MODEL_NAME, ensure_default_model
from models.default_ltx2 import DEFAULT_LTX2_NAME, ensure_default_ltx2_model
from models.embedded import LATENT_UPSAMPLER, MARKER_FILE, check_folder

__all__ = [
    "LTX2Components",
    "LTXVideoComponents",
    "ModelLoadError",
    "detect_family",
    "is_distilled",
    "load_ltx2",
    "load_ltx_video",
    "parse_dtype",
    "recommended_stages",
    "resolve_model",
]

# model_index.json `_class_name` -> family. The LTX-Video image-to-video and condition pipelines ship the
# same five components as LTXPipeline, so their folders load the same way.
_PIPELINE_FAMILIES = {
    "LTXPipeline": "ltx-video",
    "LTXImageToVideoPipeline": "ltx-video",
    "LTXConditionPipeline": "ltx-video",
    "LTX2Pipeline": "ltx2",
    "LTX2ImageToVideoPipeline": "ltx2",
}
# transformer/config.json `_class_name` -> family, for folders without a model_index.json.
_TRANSFORMER_FAMILIES = {
    "LTXVideoTransformer3DModel": "ltx-video",
    "LTX2VideoTransformer3DModel": "ltx2",
}
_LTX_VIDEO_SUBFOLDERS = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
_LTX2_SUBFOLDERS = (
    "transformer",
    "vae",
    "audio_vae",
    "vocoder",
    "connectors",
    "scheduler",
    "text_encoder",
    "tokenizer",
)
# The loader for each family, named in the error when a folder of the other family is passed.
_FAMILY_LOADERS = {"ltx-video": "load_ltx_video", "ltx2": "load_ltx2"}
# Either one carries the vocabulary: tokenizer.json (tokenizers) or spiece.model (SentencePiece).
_TOKENIZER_FILES = ("tokenizer.json", "spiece.model")
# The same for Gemma, whose SentencePiece file is tokenizer.model.
_GEMMA_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# vocoder/config.json `_class_name` -> class: LTX-2.0 ships the plain vocoder, LTX-2.3 the one with bandwidth
# extension (48 kHz); LTX2Pipeline takes either.
_VOCODERS = {"LTX2Vocoder": LTX2Vocoder, "LTX2VocoderWithBWE": LTX2VocoderWithBWE}

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; the message names the path or subfolder and the fix."""


@dataclass(frozen=True)
class LTXVideoComponents:
    """The five LTXPipeline components of one loaded LTX-Video folder."""

    transformer: LTXVideoTransformer3DModel
    """Denoiser, eval mode, in `dtype` on `device`."""
    vae: AutoencoderKLLTXVideo
    """Video VAE (32x spatial, 8x temporal compression), eval mode, `dtype` (see NOTE(vae-dtype))."""
    scheduler: FlowMatchEulerDiscreteScheduler
    """Stateful sampler schedule; copy it per request rather than sharing one across requests."""
    text_encoder: T5EncoderModel
    """T5 encoder, eval mode, in `dtype` on `device`."""
    tokenizer: T5Tokenizer
    """Tokenizers-backed T5 tokenizer (in transformers 5 `T5TokenizerFast` is the same class)."""
    path: Path
    """The folder the components were loaded from."""
    dtype: torch.dtype
    """Parameter dtype of the three models."""
    device: torch.device
    """Device of the three models."""
    latent_upsampler: LTXLatentUpsamplerModel | None = None
    """The 2x latent upsampler of two-stage generation (``latent_upsampler/``), eval mode, `dtype`, `device`;
    ``None`` when the folder has none."""


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Map "fp32" / "bf16" / "fp16" (or their long names, or the torch dtype itself) to a torch dtype."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
    elif isinstance(value, str) and value.strip().lower() in _DTYPES:
        return _DTYPES[value.strip().lower()]
    raise ValueError(f"dtype={value!r} is not supported; use one of 'fp32', 'bf16', 'fp16'")


@dataclass(frozen=True)
class LTX2Components:
    """The eight LTX2Pipeline components of one loaded LTX-2 folder."""

    transformer: LTX2VideoTransformer3DModel
    """Audio-video denoiser, eval mode, in `dtype` on `device`."""
    vae: AutoencoderKLLTX2Video
    """Video VAE (32x spatial, 8x temporal compression), eval mode, in `dtype` on `device`."""
    audio_vae: AutoencoderKLLTX2Audio
    """Audio VAE (mel spectrogram <-> latents, 4x in time), eval mode, in `dtype` on `device`."""
    vocoder: LTX2Vocoder | LTX2VocoderWithBWE
    """Mel spectrogram -> waveform at `vocoder.config.output_sampling_rate`, eval mode, `dtype`, `device`."""
    connectors: LTX2TextConnectors
    """Text connectors (Gemma hidden states -> video and audio prompt embeddings), eval, `dtype`, `device`."""
    scheduler: FlowMatchEulerDiscreteScheduler
    """Stateful sampler schedule; copy it per request rather than sharing one across requests."""
    text_encoder: Gemma3ForConditionalGeneration
    """Gemma 3 (the pipeline reads its per-layer hidden states), eval mode, in `dtype` on `device`."""
    tokenizer: GemmaTokenizer
    """Tokenizers-backed Gemma tokenizer (in transformers 5 `GemmaTokenizerFast` is the same class)."""
    path: Path
    """The folder the components were loaded from."""
    dtype: torch.dtype
    """Parameter dtype of the six models."""
    device: torch.device
    """Device of the six models."""
    latent_upsampler: LTX2LatentUpsamplerModel | None = None
    """The 2x latent upsampler of two-stage generation (``latent_upsampler/``, diffusers' layout), eval mode,
    `dtype`, `device`; ``None`` when the folder has none."""


def recommended_stages(path: str | os.PathLike) -> int:
    """How many denoising stages a folder's requests get by default: 2 (half size, the latent upsampler, a short
    refine at full size: Lightricks' recommended recipe) when it holds ``latent_upsampler/``; 1 without one, and for
    the embedded defaults (toy models whose reference is the one-pass pipeline, at sizes too small to halve)."""
    root = Path(path)
    if not (root / LATENT_UPSAMPLER).is_dir():
        return 1
    return 1 if (root / MARKER_FILE).is_file() else 2


def is_distilled(path: str | os.PathLike) -> bool:
    """Whether a folder holds a distilled checkpoint, whose requests default to its fixed few-step schedule without
    guidance. A diffusers folder does not record it in its configs; its name does, as the distilled repositories are
    named (``diffusers/LTX-2.3-Distilled-Diffusers``): the folder's own name, or for a hub snapshot
    (``models--org--name/snapshots/<commit>``) the repository's."""
    root = Path(path).absolute()
    names = [root.name, *(p.name for p in root.parents if p.name.startswith("models--"))]
    return any("distilled" in name.lower() for name in names)


_DEFAULT_MODELS = {DEFAULT_MODEL_NAME: ensure_default_model, DEFAULT_LTX2_NAME: ensure_default_ltx2_model}


def resolve_model(path_or_none: str | os.PathLike | None) -> Path:
    """Return the model folder to load: the embedded default for None or "tiny-ltx-video", the embedded
    LTX-2 default for "tiny-ltx2", else `path`."""
    if path_or_none is None:
        return ensure_default_model()
    if str(path_or_none) in _DEFAULT_MODELS:
        return _DEFAULT_MODELS[str(path_or_none)]()
    return _require_dir(path_or_none)


def _require_dir(path: str | os.PathLike) -> Path:
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelLoadError(
            f"model path {str(root)!r} does not exist; pass a diffusers-format model folder, or "
            f"{DEFAULT_MODEL_NAME!r} / {DEFAULT_LTX2_NAME!r} for an embedded default model"
        )
    if not root.is_dir():
        raise ModelLoadError(
            f"model path {str(root)!r} is a file, not a directory; pass the diffusers-format folder that "
            "holds model_index.json (single-file checkpoints are not supported)"
        )
    return root.resolve()


def _read_class_name(config_file: Path) -> str:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} is not readable JSON ({error_line(exc)})") from exc
    if not isinstance(config, dict) or not isinstance(config.get("_class_name"), str):
        raise ModelLoadError(f"{config_file} has no '_class_name' string, so it names no class to load")
    return config["_class_name"]


def detect_family(path: str | os.PathLike) -> str:
    """Return "ltx-video" or "ltx2" for a diffusers-format folder, from model_index.json or the transformer."""
    root = _require_dir(path)
    index_file = root / "model_index.json"
    transformer_config = root / "transformer" / "config.json"
    if index_file.is_file():
        class_name, known, what = _read_class_name(index_file), _PIPELINE_FAMILIES, "pipeline"
    elif transformer_config.is_file():
        class_name, known, what = _read_class_name(transformer_config), _TRANSFORMER_FAMILIES, "transformer"
    else:
        raise ModelLoadError(
            f"{str(root)!r} is not a diffusers-format folder; expected model_index.json with subfolders "
            f"{', '.join(s + '/' for s in _LTX_VIDEO_SUBFOLDERS)}"
        )
    if class_name not in known:
        raise ModelLoadError(
            f"{what} class {class_name!r} in {str(root)!r} is not supported; supported: {', '.join(known)}"
        )
    return known[class_name]


def _embedded_marker(root: Path) -> dict[str, Any] | None:
    """The name and format version in `root`'s marker when it is an embedded default's folder, else None."""
    try:
        marker = json.loads((root / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("name") not in _DEFAULT_MODELS:
        return None
    return {"name": marker["name"], "format_version": marker.get("format_version")}


def _load_error(root: Path, subfolder: str, exc: Exception, *, config: str | None, weights: bool) -> str:
    """The message of a failed load of `root/subfolder`: what is wrong with it and the underlying error."""
    problem = component_problem(root, subfolder, config=config, weights=weights)
    embedded = _embedded_marker(root)
    if embedded is not None:
        problem = problem or check_folder(root, embedded)
        fix = (f"; it is the embedded default model {embedded['name']!r}: load it by that name to rebuild it, "
               "or delete the folder")
    else:
        fix = "; restore what is missing or broken from the checkpoint the folder came from" if problem else ""
    what = f"{problem} ({error_line(exc)})" if problem else error_line(exc)
    return f"could not load {subfolder}/ from {str(root)!r}: {what}{fix}"


def _load(root: Path, subfolder: str, loader: Any, *, config: str | None = "config.json", weights: bool = True,
          **kwargs: Any) -> Any:
    """`loader(root, subfolder=subfolder, ...)`; `config` and `weights` are what the subfolder must hold (the
    config file's name, whether a weights file), which the error checks when the load fails."""
    try:
        return loader(root, subfolder=subfolder, local_files_only=True, **kwargs)
    # The loaders raise a zoo of types for one cause (OSError, SafetensorError, ValueError,
    # json errors, RuntimeError on shape mismatch); each means "this subfolder is unusable".
    except Exception as exc:
        raise ModelLoadError(_load_error(root, subfolder, exc, config=config, weights=weights)) from exc


def _require_family(root: Path, family: str, what: str, subfolders: tuple[str, ...]) -> None:
    found = detect_family(root)
    if found != family:
        raise ModelLoadError(
            f"{str(root)!r} is an {found} model folder, not {what}; load it with {_FAMILY_LOADERS[found]}()"
        )
    missing = [name for name in subfolders if not (root / name).is_dir()]
    if missing:
        raise ModelLoadError(
            f"{str(root)!r} is missing the subfolder(s) {', '.join(m + '/' for m in missing)}; an {what} "
            f"folder needs {', '.join(s + '/' for s in subfolders)}"
        )


def _require_tokenizer_files(root: Path, names: tuple[str, ...]) -> None:
    # NOTE(empty-tokenizer): transformers 5 builds a placeholder tokenizer (a few special tokens) from a
    # folder with no vocabulary file instead of raising, which would turn every prompt into <unk>s.
    if not any((root / "tokenizer" / name).is_file() for name in names):
        raise ModelLoadError(
            f"could not load tokenizer/ from {str(root)!r}: it holds none of {', '.join(names)}, the files "
            "a tokenizer's vocabulary is in"
        )


def _pick_class(root: Path, subfolder: str, classes: dict[str, Any]) -> Any:
    class_name = _read_class_name(root / subfolder / "config.json")
    if class_name not in classes:
        raise ModelLoadError(
            f"{subfolder} class {class_name!r} in {str(root)!r} is not supported; supported: {', '.join(classes)}"
        )
    return classes[class_name]


# The schedulers the adapters run: LTX-Video's and LTX-2's own, and the per-step-noise Euler-ancestral one
# LTXI2VLongMultiPromptPipeline is made for (its noise is drawn for the whole sequence on every rank).
_SCHEDULERS = {"FlowMatchEulerDiscreteScheduler": FlowMatchEulerDiscreteScheduler,
               "LTXEulerAncestralRFScheduler": LTXEulerAncestralRFScheduler}


def _pick_scheduler(root: Path) -> Any:
    path = root / "scheduler" / "scheduler_config.json"
    try:
        name = json.loads(path.read_text()).get("_class_name", "FlowMatchEulerDiscreteScheduler")
    except (OSError, ValueError):
        return FlowMatchEulerDiscreteScheduler  # the load names the missing or broken file
    if name not in _SCHEDULERS:
        raise ModelLoadError(f"scheduler class {name!r} in {str(root)!r} is not supported; supported: "
                             f"{', '.join(_SCHEDULERS)}")
    return _SCHEDULERS[name]


def _load_components(
    path: str | os.PathLike,
    components_class: Any,
    *,
    family: str,
    what: str,
    subfolders: tuple[str, ...],
    models: tuple[tuple[str, Any], ...],
    text_encoder: Any,
    tokenizer: Any,
    tokenizer_files: tuple[str, ...],
    dtype: str | torch.dtype,
    device: str | torch.device,
) -> Any:
    """Load a `family` folder into `components_class`, whose fields are named after the subfolders.

    `models` are the diffusers models in load order: (subfolder, class), or (subfolder, {`_class_name`: class})
    where the subfolder's config.json picks the class. Then come the scheduler, the transformers `text_encoder`
    and the `tokenizer`, whose folder must hold one of `tokenizer_files` (see NOTE(empty-tokenizer)).
    """
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    root = _require_dir(path)
    _require_family(root, family, what, subfolders)

    # low_cpu_mem_usage=False: the default wants `accelerate`, and without it diffusers warns on every load.
    # NOTE(vae-dtype): on this path diffusers leaves the LTX-Video VAE decoder's 0-d `timestep_scale_multiplier`
    # (created explicitly float32) in float32, as the stock LTXPipeline.from_pretrained does; a 0-d
    # operand does not promote, so the decode still runs and returns in `dtype`.
    diffusers_kwargs = dict(dtype=dtype, low_cpu_mem_usage=False)
    components = {}
    for subfolder, model_class in models:
        if isinstance(model_class, dict):
            model_class = _pick_class(root, subfolder, model_class)
        components[subfolder] = _load(root, subfolder, model_class.from_pretrained, **diffusers_kwargs)
    components["scheduler"] = _load(root, "scheduler", _pick_scheduler(root).from_pretrained,
                                    config="scheduler_config.json", weights=False)
    components["text_encoder"] = _load(root, "text_encoder", text_encoder.from_pretrained, dtype=dtype)
    _require_tokenizer_files(root, tokenizer_files)
    components["tokenizer"] = _load(root, "tokenizer", tokenizer.from_pretrained, config=None, weights=False)
    for name in (*(subfolder for subfolder, _ in models), "text_encoder"):
        # Device only: the dtype was set at load time, and a dtype cast here would bypass diffusers'
        # keep-in-fp32 module list (and warn about it).
        components[name].to(device).eval()
    return components_class(**components, path=root, dtype=dtype, device=device)


def load_ltx_video(
    path: str | os.PathLike, *, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LTXVideoComponents:
    """Load an LTX-Video diffusers folder (e.g. Lightricks/LTX-Video, or `ensure_default_model()`), with its latent
    upsampler where it has ``latent_upsampler/``."""
    components = _load_components(
        path,
        LTXVideoComponents,
        family="ltx-video",
        what="LTX-Video",
        subfolders=_LTX_VIDEO_SUBFOLDERS,
        models=(("transformer", LTXVideoTransformer3DModel), ("vae", AutoencoderKLLTXVideo)),
        text_encoder=T5EncoderModel,
        tokenizer=T5Tokenizer,
        tokenizer_files=_TOKENIZER_FILES,
        dtype=dtype,
        device=device,
    )
    return _with_latent_upsampler(components, LTXLatentUpsamplerModel)


def load_ltx2(
    path: str | os.PathLike, *, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LTX2Components:
    """Load an LTX-2 diffusers folder (e.g. Lightricks/LTX-2, or `ensure_default_ltx2_model()`), with its latent
    upsampler where it has ``latent_upsampler/``."""
    components = _load_components(
        path,
        LTX2Components,
        family="ltx2",
        what="LTX-2",
        subfolders=_LTX2_SUBFOLDERS,
        models=(
            ("transformer", LTX2VideoTransformer3DModel),
            ("vae", AutoencoderKLLTX2Video),
            ("audio_vae", AutoencoderKLLTX2Audio),
            ("vocoder", _VOCODERS),
            ("connectors", LTX2TextConnectors),
        ),
        text_encoder=Gemma3ForConditionalGeneration,
        tokenizer=GemmaTokenizer,
        tokenizer_files=_GEMMA_TOKENIZER_FILES,
        dtype=dtype,
        device=device,
    )
    return _with_latent_upsampler(components, LTX2LatentUpsamplerModel)


def _with_latent_upsampler(components: Any, upsampler_class: Any) -> Any:
    """``components`` with the folder's ``latent_upsampler/`` loaded (unchanged without one)."""
    if not (components.path / LATENT_UPSAMPLER).is_dir():
        return components
    upsampler = _load(components.path, LATENT_UPSAMPLER, upsampler_class.from_pretrained,
                      dtype=components.dtype, low_cpu_mem_usage=False)
    return replace(components, latent_upsampler=upsampler.to(components.device).eval())
