"""Single-file checkpoints in Lightricks' original layout (``--model FILE.safetensors --config ORG/NAME|DIR``): the
transformer and the VAEs come from the one file through diffusers' ``from_single_file``, every other component
(scheduler, text encoder, tokenizer, LTX-2's connectors and vocoder) from the config folder.

Invariants:
- Only safetensors is read, never pickle: any other file is refused before it is opened, and so is one whose header
  is broken or that is shorter than its header says.
- What a file holds is read from its header alone (:func:`checkpoint_contents`): the components by their original
  key prefixes (``model.diffusion_model.``: the transformer, ``vae.``: the video VAE, ``audio_vae.``: LTX-2's audio
  VAE), the family from the transformer's keys (each family's ``is_single_file_transformer``). A component
  is taken from the file only where its diffusers class loads single files (``FromOriginalModelMixin``): in diffusers
  0.42 ``AutoencoderKLLTX2Audio`` does not, so LTX-2's audio VAE comes from the config folder.
- Each component is built from its config in the config folder and is given only its own keys, which diffusers'
  converter for its class turns into diffusers' names; a component whose converted keys miss any parameter of the
  model is refused, naming them, instead of keeping initial values (``from_single_file`` loads non-strictly).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.common.folder_problems import ModelLoadError, error_line, safetensors_problem
from models.families import all_families

__all__ = ["CHECKPOINT_COMPONENTS", "CheckpointContents", "check_checkpoint", "checkpoint_contents",
           "load_from_checkpoint"]

_TRANSFORMER_PREFIX = "model.diffusion_model."
_VAE_PREFIXES = {"vae": "vae.", "audio_vae": "audio_vae."}
# Keys of the parts a single file may carry that come from the config folder here (LTX-2's vocoder).
_OTHER_PREFIXES = ("vocoder.",)
CHECKPOINT_COMPONENTS = ("transformer", "vae", "audio_vae")
"""The components a single file may hold, by the diffusers subfolder names."""


@dataclass(frozen=True)
class CheckpointContents:
    """What one single-file checkpoint holds, from its header."""

    family: str
    """The name of its family (one whose ``single_file_classes`` are set)."""
    keys: dict[str, tuple[str, ...]]
    """Component (``transformer``, ``vae``, ``audio_vae``) -> its keys in the file: the components it holds that
    load from it (their class loads single files)."""
    unused: tuple[str, ...] = ()
    """Components it holds whose diffusers class cannot load them from a single file: they come from the config
    folder."""

    @property
    def components(self) -> frozenset[str]:
        return frozenset(self.keys)


def check_checkpoint(path: Path) -> Path:
    """``path`` if it is a readable safetensors file, else :class:`ModelLoadError` naming the problem and the fix."""
    if not path.name.endswith(".safetensors"):
        raise ModelLoadError(
            f"model path {str(path)!r} is a file but not a .safetensors checkpoint; cp-infer loads safetensors only "
            "(never pickle: .ckpt, .pt, .bin), so pass a .safetensors single file (with --config) or a diffusers "
            "folder")
    problem = safetensors_problem(path)
    if problem is not None:
        raise ModelLoadError(f"single-file checkpoint {str(path)!r} cannot be read: {problem}")
    return path.resolve()


def _single_file_families() -> list:
    """The families of the table whose checkpoints come as single files in this layout."""
    return [f for f in all_families() if f.single_file_classes]


def _transformer_family(keys: set[str]):
    """The family whose transformer has these (unprefixed) keys; None: none."""
    return next((f for f in _single_file_families() if f.is_single_file_transformer(keys)), None)


def checkpoint_contents(path: Path) -> CheckpointContents:
    """The family and the components of the single-file checkpoint ``path`` (its header only)."""
    from safetensors import safe_open

    path = check_checkpoint(path)
    try:
        with safe_open(str(path), framework="pt") as file:
            keys = sorted(file.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError (not an OSError) for a bad header
        raise ModelLoadError(f"single-file checkpoint {str(path)!r} cannot be read ({error_line(exc)})") from exc
    found = {name: tuple(k for k in keys if k.startswith(prefix)) for name, prefix in _VAE_PREFIXES.items()}
    prefixed = tuple(k for k in keys if k.startswith(_TRANSFORMER_PREFIX))
    # A transformer saved on its own carries no prefix: then every key of no other part is the transformer's.
    found["transformer"] = prefixed or tuple(
        k for k in keys if not k.startswith((*_VAE_PREFIXES.values(), *_OTHER_PREFIXES)))
    found = {name: names for name, names in found.items() if names}
    stripped = {k.removeprefix(_TRANSFORMER_PREFIX) for k in found.get("transformer", ())}
    family = _transformer_family(stripped)
    if family is None:
        held = ", ".join(sorted(found)) or "no tensors"
        titles = " or ".join(f.title for f in _single_file_families())
        raise ModelLoadError(
            f"single-file checkpoint {str(path)!r} holds no {titles} transformer (no patchify_proj "
            f"weights; it holds {held}), so its family cannot be told; pass an {titles} checkpoint, or a "
            "diffusers folder")
    import diffusers

    classes = family.single_file_classes
    held = [name for name in CHECKPOINT_COMPONENTS if name in found and name in classes]
    loads = {name for name in held if hasattr(getattr(diffusers, classes[name]), "from_single_file")}
    return CheckpointContents(family=family.name, keys={name: found[name] for name in held if name in loads},
                              unused=tuple(name for name in held if name not in loads))


def _missing_keys(model_class: Any, config: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """The model's parameters that diffusers' converter does not produce from keys of these ``shapes`` (on the meta
    device: names and shapes only)."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    convert = SINGLE_FILE_LOADABLE_CLASSES[model_class.__name__]["checkpoint_mapping_fn"]
    with torch.device("meta"):
        expected = set(model_class.from_config(config).state_dict())
        checkpoint = {k: torch.empty(shape) for k, shape in shapes.items()}
    converted = convert(checkpoint=checkpoint, config=config)
    return sorted(expected - set(converted))


def load_from_checkpoint(path: Path, component: str, model_class: Any, *, folder: Path, contents: CheckpointContents,
                         dtype: torch.dtype) -> Any:
    """``component`` of the single file ``path`` as ``model_class`` (``FromOriginalModelMixin``), its config from
    ``folder/component``, in ``dtype`` on the CPU, eval mode."""
    from safetensors import safe_open

    keys = contents.keys[component]
    where = f"{component} from single-file checkpoint {str(path)!r} (config {str(folder / component)!r})"
    try:
        config = model_class.load_config(folder, subfolder=component, local_files_only=True)
        with safe_open(str(path), framework="pt") as file:
            missing = _missing_keys(model_class, config, {k: tuple(file.get_slice(k).get_shape()) for k in keys})
            if missing:
                raise ModelLoadError(
                    f"could not load {where}: the checkpoint lacks {len(missing)} of the model's weights "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); pass the --config that "
                    "matches this checkpoint's version")
            state = {k: file.get_tensor(k) for k in keys}
        model = model_class.from_single_file(state, config=str(folder), subfolder=component, local_files_only=True,
                                             dtype=dtype, low_cpu_mem_usage=False)
    except ModelLoadError:
        raise
    # As models.common.loading's `_load`: shape mismatches (RuntimeError), bad configs (OSError, ValueError), a
    # converter's
    # KeyError on a key it expects; each means "this checkpoint does not fit this config".
    except Exception as exc:
        raise ModelLoadError(f"could not load {where}: {error_line(exc)}; pass the --config that matches this "
                             "checkpoint") from exc
    return model.eval()
