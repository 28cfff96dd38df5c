"""The one table of model families: each family package exposes one object implementing :class:`Family`, and
everything that must tell families apart (the registry, placement, the loaders' checks, single files, the CLI, the
docs generator; the HTTP API and the playground through the registry's ``ModelInfo``) asks this table instead of
comparing family names.

Invariants:
- Importing this module imports no family: :data:`FAMILIES` names each family's object by (module, attribute), and
  :func:`family` imports it on first use (vLLM's ``_MODELS`` table). A family's object module stays light (names and
  class names at import time; diffusers classes inside its methods), so recognising a folder costs no model import.
- A family is a folder under ``models/`` plus one row of :data:`FAMILIES`; no family package imports another.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection, Sequence
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from cp_infer import ParallelState, VideoGeometry
    from cp_infer.options import ModelOptions
    from cp_infer.request import GenerationRequest

__all__ = ["DEFAULT_FAMILY", "FAMILIES", "Family", "all_families", "by_default_name", "by_pipeline", "by_transformer",
           "by_upsampler", "default_model_name", "defaults_text", "family", "family_names", "titles_text"]

FAMILIES: dict[str, tuple[str, str]] = {
    "ltx-video": ("models.ltx_video.family", "FAMILY"),
    "ltx2": ("models.ltx2.family", "FAMILY"),
    "wan": ("models.wan.family", "FAMILY"),
    "helios": ("models.helios.family", "FAMILY"),
}
"""Family name -> (module, attribute) of its :class:`Family` object. The order is the order of help texts and docs."""

DEFAULT_FAMILY = "ltx-video"
"""The family whose embedded default is served when no model is named."""


class Family(Protocol):
    """What one model family tells the rest of the code about itself."""

    name: str
    """The family's name (``ModelInfo.family``, ``GET /v1/models``' ``family``)."""
    title: str
    """How prose names it (``LTX-Video``)."""
    pipelines: tuple[str, ...]
    """``model_index.json`` ``_class_name`` values of its folders."""
    transformers: tuple[str, ...]
    """``transformer/config.json`` ``_class_name`` values, for folders without a ``model_index.json``."""
    upsamplers: tuple[str, ...]
    """Latent upsampler ``_class_name`` values that upsample its latents (empty: it takes none)."""
    loader: str
    """Its loader's dotted name, named in the error for a folder of another family."""
    default_name: str
    """Its embedded default's name (``--model tiny-...``)."""
    default_help: str
    """What ``--model``'s help says about that default."""
    has_audio: bool
    """Whether its videos carry a soundtrack."""
    vae_tiling: bool
    """Whether its adapter can run its VAE in diffusers' spatial tiles (``--vae-tiling``: ``enable_vae_tiling()``)."""
    float32_components: tuple[str, ...]
    """Components loaded in float32 whatever ``--dtype`` (where its diffusers examples keep them there)."""
    transformer_subfolders: tuple[str, ...]
    """The subfolders that hold transformers (sharded alike; a folder may lack the later ones)."""
    single_file_classes: dict[str, str]
    """Component -> diffusers class name of the parts a single-file checkpoint of Lightricks' layout holds
    (``models.common.single_file``); empty: the family takes no single file."""

    def is_single_file_transformer(self, keys: set[str]) -> bool:
        """Whether a single file's transformer keys (prefix removed) are this family's."""

    def ensure_default(self) -> Path:
        """The embedded default's folder, built on first use."""

    def options(self, *, layers: int, latent_upsampler: bool = True, stages: int | None = None,
                distilled: bool = False) -> ModelOptions:
        """Its request options (the adapter's declaration) for a model of ``layers`` blocks."""

    def describe(self, files: Any) -> tuple[VideoGeometry, int, ModelOptions]:
        """Geometry, transformer blocks and options of ``files`` (a ``ModelFiles``), from configs alone."""

    def load(self, files: Any, *, dtype: torch.dtype, device: torch.device, loaders: dict[str, Any],
             offloaded: Collection[str] = ()) -> Any:
        """Its components loaded from ``files``; ``loaders``: subfolder -> loader in place of ``from_pretrained``;
        ``offloaded``: the components left on the CPU for offloading to stream to ``device``."""

    def wrap(self, components: Any, *, state: ParallelState) -> Any:
        """Its parallel adapter (the engine's model) around loaded ``components``."""

    def component_classes(self, root: Path | None) -> list[tuple[str, Any, bool]]:
        """``(subfolder, class, is_transformers)`` of every component with weights, in load order."""

    def lora_spec(self) -> Any:
        """How its adapters' LoRA load (``models.common.lora.LoraSpec``)."""

    def step_passes(self, request: GenerationRequest) -> set[int]:
        """How many transformer passes a step runs, over the denoising passes of resolved ``request``'s plan."""


@cache
def family(name: str) -> Family:
    """The family called ``name``; a ``ValueError`` naming the known ones for any other."""
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    module, attribute = FAMILIES[name]
    return getattr(importlib.import_module(module), attribute)


def family_names() -> tuple[str, ...]:
    return tuple(FAMILIES)


def all_families() -> list[Family]:
    return [family(name) for name in FAMILIES]


def _first(found: Sequence[Family]) -> Family | None:
    return found[0] if found else None


def by_pipeline(class_name: str) -> Family | None:
    """The family whose folders' ``model_index.json`` names ``class_name``; None: none."""
    return _first([f for f in all_families() if class_name in f.pipelines])


def by_transformer(class_name: str) -> Family | None:
    """The family whose transformer class is ``class_name``; None: none."""
    return _first([f for f in all_families() if class_name in f.transformers])


def by_upsampler(class_name: str) -> Family | None:
    """The family whose latents a ``class_name`` latent upsampler upsamples; None: none."""
    return _first([f for f in all_families() if class_name in f.upsamplers])


def by_default_name(name: str) -> Family | None:
    """The family whose embedded default is called ``name``; None: none."""
    return _first([f for f in all_families() if f.default_name == name])


def _listed(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


def titles_text() -> str:
    """The families as prose names them, for help texts: ``LTX-Video, LTX-2 or Wan``."""
    return _listed([f.title for f in all_families()])


def defaults_text() -> str:
    """The embedded defaults with a word on each, for help texts."""
    return _listed([f.default_help for f in all_families()])


def default_model_name() -> str:
    """The name of the embedded default served when no model is named."""
    return family(DEFAULT_FAMILY).default_name
