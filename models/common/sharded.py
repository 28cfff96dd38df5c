"""The families' transformers and text encoders loaded sharded over the replica group (``cp_infer.weights``): which
classes, which blocks, which files, which keys.

Invariants:
- A loader here has ``from_pretrained``'s call shape (``loader(root, subfolder=..., dtype=...)``), so
  ``models.common.loading`` runs it in place of ``from_pretrained`` for its subfolder, with the same error handling.
- Each rank reads only its shard of every parameter; nothing of a sharded component is ever whole on a rank
  outside a forward. The module built is the one ``from_pretrained`` builds: the same config, the parameters in
  the same dtypes (diffusers: all in ``dtype``; transformers: ``dtype``, save its keep-in-fp32 modules), the same
  computed buffers, so its gathered weights are the replicated load's bits.
- Every rank of the world agrees on a load (``cp_infer.weights.agree_on_load``): a file cut short on one rank's
  rows fails every rank with that rank's message.
- The transformer's units are its blocks (LTX's ``transformer_blocks``, Wan's ``blocks``); a text encoder's its
  layers (T5's and UMT5's ``encoder.block``, Gemma 3's language-model layers; Gemma 3's vision tower and projector
  are units no forward runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from cp_infer.state import ParallelState
from cp_infer.weights import (
    SafetensorsFiles,
    WeightsLoadError,
    load_agreed,
    load_shards,
    meta_parameters,
    shard_module,
)

__all__ = ["Placement", "build_text_encoder", "build_transformer", "sharded_loader", "text_encoder_units",
           "transformer_blocks"]


@dataclass(frozen=True)
class Placement:
    """How one rank loads a model (``models.common.placement.resolve_placement``): whether its transformer and text
    encoder
    are sharded, over which mesh, and which components are offloaded."""

    weights: str
    """``sharded`` or ``replicated`` (``auto`` resolved)."""
    offload: tuple[str, ...]
    """``--offload``'s components (``cp_infer.placement.OFFLOAD_COMPONENTS``)."""
    state: ParallelState
    mesh: DeviceMesh | None = None
    """The replica group's device mesh (``cp_infer.weights.replica_mesh``); ``None`` when replicated."""

    @property
    def sharded(self) -> bool:
        return self.weights == "sharded" and self.mesh is not None


def build_transformer(cls: type, root: Path, subfolder: str, dtype: torch.dtype) -> nn.Module:
    """A diffusers model of ``cls`` from ``root/subfolder``'s config, its parameters on the meta device in
    ``dtype`` (``from_pretrained``'s: all of them, save the class's keep-in-fp32 modules)."""
    config = cls.load_config(root, subfolder=subfolder, local_files_only=True)
    with meta_parameters():
        model = cls.from_config(config)
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        wanted = torch.float32 if keep and keep & set(name.split(".")) else dtype
        param.data = param.data.to(wanted)
    return model.eval()


def build_text_encoder(cls: type, folder: Path, dtype: torch.dtype) -> nn.Module:
    """A transformers model of ``cls`` from ``folder``'s config, its parameters on the meta device in the dtypes
    ``from_pretrained(dtype=...)`` gives them (its dtype plan: keep-in-fp32 modules), its buffers computed."""
    from transformers.core_model_loading import build_glob_alternation

    config = cls.config_class.from_pretrained(folder)
    with meta_parameters():
        model = cls._from_config(config, dtype=dtype)
    plan = model._get_dtype_plan(dtype)
    pattern, groups, _ = build_glob_alternation(list(plan)) if plan else (None, {}, {})
    for name, param in model.named_parameters():
        match = pattern.search(name) if pattern is not None else None
        param.data = param.data.to(plan[groups[match.lastgroup]] if match else dtype)
    return model.eval()


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """A diffusers video transformer's blocks, in order: LTX's ``transformer_blocks``, Wan's ``blocks``."""
    blocks = getattr(transformer, "transformer_blocks", None)
    return list(transformer.blocks if blocks is None else blocks)


def text_encoder_units(encoder: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(blocks, idle)``: the layers a forward runs in order, and the units it never runs."""
    from transformers import Gemma3ForConditionalGeneration, T5EncoderModel, UMT5EncoderModel

    if isinstance(encoder, (T5EncoderModel, UMT5EncoderModel)):
        return list(encoder.encoder.block), []
    if isinstance(encoder, Gemma3ForConditionalGeneration):
        inner = encoder.model
        return list(inner.language_model.layers), [inner.vision_tower, inner.multi_modal_projector]
    raise WeightsLoadError(f"sharding a {type(encoder).__name__} text encoder is not supported; use "
                           "--weights replicated")


def _text_keys(model: nn.Module, files: SafetensorsFiles) -> dict[str, str]:
    """The model's tensor names -> the files' keys, through transformers' own renamings of its checkpoints (Gemma
    3's ``language_model.model.*`` -> ``model.language_model.*``).

    NOTE(transformers): ``get_model_conversion_mapping`` and ``rename_source_key`` are what ``from_pretrained``
    renames keys with (transformers 5); a conversion that merges or splits tensors cannot be read a shard at a time,
    and is refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    if any(isinstance(t, WeightConverter) for t in transforms):
        raise WeightsLoadError(f"{type(model).__name__}'s checkpoints are converted tensor by tensor on load, which "
                               "cannot be read a shard at a time; use --weights replicated")
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    names = dict(model.state_dict(keep_vars=True))
    keys = {}
    for key in files.tensor_keys():
        name, _ = rename_source_key(key, renamings, [], model.base_model_prefix, names)
        keys.setdefault(name, key)
    return keys


def sharded_loader(placement: Placement, build: Callable[[Path, str, torch.dtype], nn.Module],
                   units: Callable[[nn.Module], tuple[list[nn.Module], list[nn.Module]]], *, weights_name: str,
                   offload: bool, text: bool = False) -> Callable[..., nn.Module]:
    """A ``from_pretrained``-shaped loader of one component sharded over ``placement``'s mesh: built by ``build``,
    its units from ``units``, read from ``<weights_name>.safetensors`` (or its index), kept on the CPU with
    ``offload``; ``text``: a transformers model, whose checkpoint keys are renamed as transformers renames them."""
    state = placement.state

    def load(root: Path, *, subfolder: str, dtype: torch.dtype, **_: Any) -> nn.Module:
        def sharded() -> nn.Module:
            model = build(Path(root), subfolder, dtype)
            files = SafetensorsFiles(Path(root) / subfolder, weights_name)
            blocks, idle = units(model)
            keys = _text_keys(model, files) if text else None
            shard_module(model, blocks, idle=idle, mesh=placement.mesh, offload=offload,
                         pin_memory=offload and state.device.type == "cuda")
            load_shards(model, files, device=state.device, keys=keys)
            return model

        return load_agreed(sharded, state=state)

    return load
