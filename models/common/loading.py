"""What loading a diffusers-format model folder takes, whatever its family (each family's `loading` module loads
its own components on these helpers), with errors that say what is wrong; and finding the folder first
(`resolve_model`, `resolve_files`): an embedded default, a local folder, a hub id (`models.common.hub`), a single-file
checkpoint with its config folder (`models.common.single_file`), a paired latent upsampler. The family of a folder is
the table's (`models.families`), asked by its class names.

Invariants:
- Loading is local only: every `from_pretrained` gets `local_files_only=True`, so a bad path never turns into a hub
  download attempt; only `resolve_model` reaches the hub, for a name that is no local path and reads as a hub id.
- Every failure a user can cause (wrong path, wrong folder, missing component, broken weights) is a
  `ModelLoadError`, a `ValueError` whose message names the path or subfolder, what is wrong with it (the file
  that is missing, truncated or unreadable, where it can tell) and the underlying error in one line. For an
  embedded default's folder (one with `MARKER_FILE`) the fix is to load it by name, which rebuilds it.
- Loaded models are in eval mode, on `device`, in `dtype` (the VAE included).
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    LTXEulerAncestralRFScheduler,
)

from cp_infer import VideoGeometry
from models.common.embedded import LATENT_UPSAMPLER, MARKER_FILE, check_folder
from models.common.folder_problems import ModelLoadError, component_problem, error_line
from models.common.hub import ALL_FILES, FileSelection, fetch, parse_hub_ref
from models.common.single_file import check_checkpoint, checkpoint_contents, load_from_checkpoint
from models.families import DEFAULT_FAMILY, all_families, by_default_name, by_pipeline, by_transformer, by_upsampler
from models.families import family as family_named

__all__ = [
    "ModelFiles",
    "ModelLoadError",
    "describe_wan_vae_folder",
    "detect_family",
    "is_distilled",
    "model_name",
    "parse_dtype",
    "read_json_config",
    "recommended_stages",
    "resolve_files",
    "resolve_model",
]

# The subfolders a diffusers folder has at least, named when a folder is not one.
_FOLDER_EXAMPLE = ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def parse_dtype(value: str | torch.dtype) -> torch.dtype:
    """Map "fp32" / "bf16" / "fp16" (or their long names, or the torch dtype itself) to a torch dtype."""
    if isinstance(value, torch.dtype):
        if value in _DTYPES.values():
            return value
    elif isinstance(value, str) and value.strip().lower() in _DTYPES:
        return _DTYPES[value.strip().lower()]
    raise ValueError(f"dtype={value!r} is not supported; use one of 'fp32', 'bf16', 'fp16'")


def recommended_stages(path: str | os.PathLike, *, upsampler: bool | None = None) -> int:
    """How many denoising stages a folder's requests get by default: 2 (half size, the latent upsampler, a short
    refine at full size: Lightricks' recommended recipe) when it has a latent upsampler (``upsampler``: whether one
    is loaded with it, a paired one included; None: whether it holds ``latent_upsampler/``); 1 without one, and for
    the embedded defaults (toy models whose reference is the one-pass pipeline, at sizes too small to halve)."""
    root = Path(path)
    if not ((root / LATENT_UPSAMPLER).is_dir() if upsampler is None else upsampler):
        return 1
    return 1 if (root / MARKER_FILE).is_file() else 2


def is_distilled(path: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None) -> bool:
    """Whether a folder (or the single-file ``checkpoint`` loaded with its configs) holds a distilled checkpoint,
    whose requests default to its fixed few-step schedule without guidance. A diffusers folder does not record it in
    its configs; its name does, as the distilled repositories and files are named
    (``diffusers/LTX-2.3-Distilled-Diffusers``, ``ltx-2-19b-distilled.safetensors``): the folder's own name, for a hub
    snapshot (``models--org--name/snapshots/<commit>``) the repository's, and the checkpoint file's."""
    root = Path(path).absolute()
    names = [root.name, *(p.name for p in root.parents if p.name.startswith("models--"))]
    if checkpoint is not None:
        names.append(Path(checkpoint).name)
    return any("distilled" in name.lower() for name in names)


def resolve_model(model: str | os.PathLike | None, *, files: FileSelection = ALL_FILES) -> Path:
    """The local folder (or single file) that ``model`` names, in this order:

    - None or "tiny-ltx-video", "tiny-ltx2", "tiny-wan": the embedded defaults, built on first use;
    - an existing local path: a diffusers folder, or a single-file ``.safetensors`` checkpoint (checked readable);
      it wins over a hub id of the same spelling;
    - ``org/name`` or ``org/name@revision``: that repo's snapshot folder in the hub cache (``models.common.hub.fetch``:
      the
      files ``files`` selects, downloaded once per node; ``HF_HUB_OFFLINE=1``: from the cache alone).

    Anything else is a :class:`ModelLoadError` naming it and the fix."""
    if model is None:
        return family_named(DEFAULT_FAMILY).ensure_default()
    if (embedded := by_default_name(str(model))) is not None:
        return embedded.ensure_default()
    if (ref := _hub_ref(model)) is not None:
        return fetch(ref, files)
    path = Path(model).expanduser()
    if path.is_file():
        return check_checkpoint(path)
    return _require_dir(path)


def model_name(model: str | os.PathLike | None) -> str:
    """The name a model is served under (the ``model`` clients pass) by default: an embedded default's name, a hub
    id as written (``Lightricks/LTX-Video``, with ``@revision`` when one is given), a local folder's name, a single
    file's stem."""
    if model is None:
        return family_named(DEFAULT_FAMILY).default_name
    if by_default_name(str(model)) is None and (ref := _hub_ref(model)) is not None:
        return str(ref)
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".safetensors" else path.name


def _hub_ref(model: str | os.PathLike):
    """``model`` as a hub id (``models.common.hub.HubRef``) when it spells one and no local path of that name exists (a
    local path wins), else None."""
    if Path(model).expanduser().exists():
        return None
    return parse_hub_ref(str(model))


@dataclass(frozen=True)
class ModelFiles:
    """Where one model's files are on this node (:func:`resolve_files`)."""

    folder: Path
    """The diffusers folder: model_index.json, every component's config, and the weights of every component that
    ``checkpoint`` does not hold."""
    checkpoint: Path | None = None
    """A single-file checkpoint in Lightricks' layout holding the transformer and the VAE(s)
    (``models.common.single_file``);
    None: every component comes from ``folder``."""
    upsampler: Path | None = None
    """The folder holding the latent upsampler's config.json and weights (a paired one, else
    ``folder/latent_upsampler``); None: the model has none."""


def resolve_files(model: str | os.PathLike | None, *, config: str | os.PathLike | None = None,
                  upsampler: str | os.PathLike | None = None, weights: bool = True) -> ModelFiles:
    """:func:`resolve_model` for ``model``, for ``config`` (the diffusers folder or hub id that a single-file
    ``model`` takes its configs and every component the file does not hold from: ``--config``) and for ``upsampler``
    (a latent-upsampler folder or hub id to pair with the model: ``--upsampler``), checked against each other. A
    model that is a :class:`ModelFiles` already is returned as it is. ``weights=False`` fetches a hub repo's configs
    alone (enough to describe the model); a local path is used as it is either way."""
    if isinstance(model, ModelFiles):
        return model
    selection = FileSelection(weights=weights)
    path = resolve_model(model, files=selection)
    checkpoint = None
    if path.is_file():
        if config is None:
            raise ModelLoadError(
                f"{str(path)!r} is a single-file checkpoint: name the diffusers folder or hub id its configs and its "
                "other components come from with --config (e.g. Lightricks/LTX-Video, Lightricks/LTX-2)")
        contents = checkpoint_contents(path)
        checkpoint, path = path, resolve_model(config, files=FileSelection(weights=weights,
                                                                             skip_weights=contents.components))
        family = detect_family(path)
        if family != contents.family:
            raise ModelLoadError(f"single-file checkpoint {str(checkpoint)!r} is an {contents.family} model, but "
                                 f"its --config {str(config)!r} is an {family} folder; pass a config of its family")
    elif config is not None:
        raise ModelLoadError(f"--config {str(config)!r} is for a single-file checkpoint, but the model "
                             f"{str(path)!r} is a folder, which holds its own configs; drop --config")
    if upsampler is None:
        paired = path / LATENT_UPSAMPLER if (path / LATENT_UPSAMPLER).is_dir() else None
    else:
        paired = _upsampler_folder(
            resolve_model(upsampler, files=FileSelection(weights=weights, only=frozenset({LATENT_UPSAMPLER}))),
            family=detect_family(path), spec=upsampler)
    return ModelFiles(folder=path, checkpoint=checkpoint, upsampler=paired)


def _upsampler_folder(root: Path, *, family: str, spec: str | os.PathLike) -> Path:
    """The folder of ``--upsampler``'s latent upsampler (its root's config.json, or ``latent_upsampler/``), checked
    to be an upsampler of ``family``'s latents."""
    if root.is_file():
        raise ModelLoadError(f"--upsampler {str(spec)!r} is a file; pass the folder or hub id that holds the "
                             "upsampler's config.json and weights (at its root or in latent_upsampler/)")
    folder = next((f for f in (root / LATENT_UPSAMPLER, root) if (f / "config.json").is_file()), None)
    if folder is None:
        raise ModelLoadError(f"--upsampler {str(spec)!r} holds no latent upsampler: no config.json at its root or "
                             f"in {LATENT_UPSAMPLER}/ ({str(root)!r})")
    class_name = _read_class_name(folder / "config.json")
    upsampled = by_upsampler(class_name)
    if upsampled is None or upsampled.name != family:
        wants = family_named(family).upsamplers
        if not wants:
            raise ModelLoadError(f"--upsampler {str(spec)!r}: a {family} model takes no latent upsampler; drop it")
        raise ModelLoadError(f"--upsampler {str(spec)!r} is a {class_name}, but the model is {family}, whose latents "
                             f"a {wants[0]} upsamples; pass an upsampler of the model's family")
    return folder


def _require_dir(path: str | os.PathLike) -> Path:
    root = Path(path).expanduser()
    if not root.exists():
        raise ModelLoadError(
            f"model path {str(root)!r} does not exist; pass a diffusers-format model folder, a hub id "
            f"(org/name[@revision]), or {' / '.join(repr(f.default_name) for f in all_families())} for an "
            "embedded default model"
        )
    if not root.is_dir():
        raise ModelLoadError(
            f"model path {str(root)!r} is a file, not a directory; pass the diffusers-format folder that "
            "holds model_index.json, or a single-file .safetensors checkpoint with --config naming its configs"
        )
    return root.resolve()


def read_json_config(path: Path) -> dict[str, Any]:
    """A config file's JSON object; ``{}`` when the file is missing (or holds no object), a ``ModelLoadError``
    naming it when it cannot be read."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path} is not readable JSON ({error_line(exc)})") from exc
    return value if isinstance(value, dict) else {}


def describe_wan_vae_folder(path: str | os.PathLike) -> tuple[VideoGeometry, int]:
    """``(geometry, layers)`` of a folder whose VAE is ``AutoencoderKLWan`` and whose transformer patchifies
    ``patch_size`` (Wan, Helios), from its ``transformer/`` and ``vae/`` configs alone (no weights)."""
    root = _require_dir(path)
    transformer = read_json_config(root / "transformer" / "config.json")
    vae = read_json_config(root / "vae" / "config.json")
    if not transformer or not vae:
        problem = component_problem(root, "transformer", config="config.json") or component_problem(
            root, "vae", config="config.json")
        raise ModelLoadError(f"could not read the transformer/ and vae/ configs of {str(root)!r}: "
                             f"{problem or 'a config.json is missing or empty'}")
    patch_t, patch_h, patch_w = transformer.get("patch_size", (1, 2, 2))
    if patch_h != patch_w:
        raise ModelLoadError(f"{str(root)!r}: a transformer patch of {patch_h}x{patch_w} pixels is not square; the "
                             "engine's sizes take square patches")
    # AutoencoderKLWan's own defaults for a config that leaves them out.
    geometry = VideoGeometry(temporal_compression=int(vae.get("scale_factor_temporal", 4)),
                             spatial_compression=int(vae.get("scale_factor_spatial", 8)),
                             patch_size=int(patch_h), patch_size_t=int(patch_t))
    return geometry, int(transformer.get("num_layers", 0))


def _read_class_name(config_file: Path) -> str:
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{config_file} is not readable JSON ({error_line(exc)})") from exc
    if not isinstance(config, dict) or not isinstance(config.get("_class_name"), str):
        raise ModelLoadError(f"{config_file} has no '_class_name' string, so it names no class to load")
    return config["_class_name"]


def detect_family(path: str | os.PathLike) -> str:
    """The name of the family (``models.families``) of a diffusers-format folder, from model_index.json or the
    transformer."""
    root = _require_dir(path)
    index_file = root / "model_index.json"
    transformer_config = root / "transformer" / "config.json"
    if index_file.is_file():
        class_name, find, what = _read_class_name(index_file), by_pipeline, "pipeline"
        known = [name for f in all_families() for name in f.pipelines]
    elif transformer_config.is_file():
        class_name, find, what = _read_class_name(transformer_config), by_transformer, "transformer"
        known = [name for f in all_families() for name in f.transformers]
    else:
        raise ModelLoadError(
            f"{str(root)!r} is not a diffusers-format folder; expected model_index.json with subfolders "
            f"{', '.join(s + '/' for s in _FOLDER_EXAMPLE)}"
        )
    found = find(class_name)
    if found is None:
        raise ModelLoadError(
            f"{what} class {class_name!r} in {str(root)!r} is not supported; supported: {', '.join(known)}"
        )
    return found.name


def _embedded_marker(root: Path) -> dict[str, Any] | None:
    """The name and format version in `root`'s marker when it is an embedded default's folder, else None."""
    try:
        marker = json.loads((root / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or by_default_name(str(marker.get("name"))) is None:
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
            f"{str(root)!r} is an {found} model folder, not {what}; load it with {family_named(found).loader}()"
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


def _pick_scheduler(root: Path, schedulers: dict[str, Any] = _SCHEDULERS) -> Any:
    """The class of ``root``'s scheduler among ``schedulers`` (a family's: class name -> class, its usual one first)."""
    path = root / "scheduler" / "scheduler_config.json"
    usual = next(iter(schedulers.values()))
    try:
        name = json.loads(path.read_text()).get("_class_name", usual.__name__)
    except (OSError, ValueError):
        return usual  # the load names the missing or broken file
    if name not in schedulers:
        raise ModelLoadError(f"scheduler class {name!r} in {str(root)!r} is not supported; supported: "
                             f"{', '.join(schedulers)}")
    return schedulers[name]


def _load_components(
    files: ModelFiles,
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
    loaders: dict[str, Any] | None = None,
    schedulers: dict[str, Any] = _SCHEDULERS,
    float32: tuple[str, ...] = (),
    offloaded: Collection[str] = (),
) -> Any:
    """Load a `family` folder into `components_class`, whose fields are named after the subfolders.

    `models` are the diffusers models in load order: (subfolder, class), or (subfolder, {`_class_name`: class})
    where the subfolder's config.json picks the class; those `files.checkpoint` holds come from it instead. Then come
    the scheduler, the transformers `text_encoder` and the `tokenizer`, whose folder must hold one of
    `tokenizer_files` (see NOTE(empty-tokenizer)). `loaders`: subfolder -> a loader called as `from_pretrained`
    is, used instead of it (``models.common.placement.sharded_loaders``: a shard per rank), whose module is left where
    it put it. `schedulers`: the scheduler classes the family's adapter runs (class name -> class). `float32`: the
    subfolders loaded in float32 whatever `dtype` is (where diffusers' examples keep them there). `offloaded`: the
    components left on the CPU, for ``models.common.placement.apply_offload`` to stream to `device` (moving them
    first would need the device memory that offloading exists to save).
    """
    loaders = loaders or {}
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    root = _require_dir(files.folder)
    _require_family(root, family, what, subfolders)
    contents = None if files.checkpoint is None else checkpoint_contents(files.checkpoint)

    # low_cpu_mem_usage=False: the default wants `accelerate`, and without it diffusers warns on every load.
    # NOTE(vae-dtype): on this path diffusers leaves the LTX-Video VAE decoder's 0-d `timestep_scale_multiplier`
    # (created explicitly float32) in float32, as the stock LTXPipeline.from_pretrained does; a 0-d
    # operand does not promote, so the decode still runs and returns in `dtype`.
    diffusers_kwargs = dict(dtype=dtype, low_cpu_mem_usage=False)
    components = {}
    for subfolder, model_class in models:
        if isinstance(model_class, dict):
            model_class = _pick_class(root, subfolder, model_class)
        kwargs = dict(diffusers_kwargs, dtype=torch.float32) if subfolder in float32 else diffusers_kwargs
        if contents is not None and subfolder in contents.components:
            components[subfolder] = load_from_checkpoint(files.checkpoint, subfolder, model_class, folder=root,
                                                         contents=contents, dtype=kwargs["dtype"])
        else:
            loader = loaders.get(subfolder, model_class.from_pretrained)
            components[subfolder] = _load(root, subfolder, loader, **kwargs)
    components["scheduler"] = _load(root, "scheduler", _pick_scheduler(root, schedulers).from_pretrained,
                                    config="scheduler_config.json", weights=False)
    components["text_encoder"] = _load(root, "text_encoder", loaders.get("text_encoder", text_encoder.from_pretrained),
                                       dtype=dtype)
    _require_tokenizer_files(root, tokenizer_files)
    components["tokenizer"] = _load(root, "tokenizer", tokenizer.from_pretrained, config=None, weights=False)
    for name in (*(subfolder for subfolder, _ in models), "text_encoder"):
        # Device only: the dtype was set at load time, and a dtype cast here would bypass diffusers'
        # keep-in-fp32 module list (and warn about it).
        if name not in offloaded and (name not in loaders or (contents is not None and name in contents.components)):
            components[name].to(device)
        components[name].eval()
    if files.checkpoint is not None:  # the families that read single files record which
        components["checkpoint"] = files.checkpoint
    return components_class(**components, path=root, dtype=dtype, device=device)


def _model_files(path: str | os.PathLike | ModelFiles) -> ModelFiles:
    """A folder's files: every component from it, its own ``latent_upsampler/`` where it has one."""
    if isinstance(path, ModelFiles):
        return path
    root = Path(path).expanduser()
    return ModelFiles(folder=root, upsampler=root / LATENT_UPSAMPLER if (root / LATENT_UPSAMPLER).is_dir() else None)


def _with_latent_upsampler(components: Any, upsampler_class: Any, folder: Path | None) -> Any:
    """``components`` with the latent upsampler in ``folder`` loaded (unchanged for None)."""
    if folder is None:
        return components
    upsampler = _load(folder.parent, folder.name, upsampler_class.from_pretrained,
                      dtype=components.dtype, low_cpu_mem_usage=False)
    return replace(components, latent_upsampler=upsampler.to(components.device).eval())
