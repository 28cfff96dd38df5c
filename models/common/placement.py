"""Where a model's components go on each rank: the families' components as the memory plan sees them (from the
folder's configs, on the meta device), ``--weights auto``'s decision, the sharded loaders, ``--offload`` and the
start-up report.

Invariants:
- ``--weights sharded`` shards the transformer (Wan 2.2 A14B: both experts) and the text encoder over the replica
  group (``models.common.sharded``); every other component (VAEs, vocoder, connectors, latent upsampler, Wan 2.1 I2V's
  image
  encoder) is replicated. A replica group of one rank has nothing to shard over: it loads replicated.
- ``auto`` is ``sharded`` only on CUDA and only when the replicated weights' peak (``cp_infer.placement``) passes
  ``AUTO_FRACTION`` of the device's free memory on some rank; every rank of the world takes the same decision (one
  all-reduce over the world's gloo group at start-up). On the CPU it is ``replicated``.
- ``--offload`` keeps the named components on the CPU between uses: sharded ones as FSDP2 CPU shards (its
  ``CPUOffloadPolicy``, pinned on CUDA), the others through diffusers' group offloading (``apply_group_offloading``:
  the transformer's blocks one group each, the next streamed in while one runs; the text encoder and the VAEs leaf
  by leaf; on CUDA on a stream, from pinned memory). On the CPU the offload device is the device itself: the same
  code runs and moves nothing. An offloaded component is loaded on the CPU and never whole on the device
  (``offloaded_components``): a model that does not fit the device loads.
- The plan's components are built from the configs alone (a folder of configs without weights is enough), with the
  same builders and dtypes as the sharded loads, so the plan's shard bytes are the loaded ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from cp_infer.placement import (
    OFFLOAD_COMPONENTS,
    Component,
    RankMemory,
    measure,
    parse_offload,
    parse_weights,
    plan_memory,
    unit_of,
)
from cp_infer.state import ParallelState
from cp_infer.weights import replica_mesh
from models.families import family

from .loading import ModelLoadError, detect_family, parse_dtype
from .sharded import (
    Placement,
    build_text_encoder,
    build_transformer,
    sharded_loader,
    text_encoder_units,
    transformer_blocks,
)

__all__ = ["AUTO_FRACTION", "OFFLOAD_COMPONENTS", "Placement", "apply_offload", "auto_shards", "measure_components",
           "model_components", "offloaded_components", "parse_offload", "parse_weights", "resolve_placement",
           "sharded_loaders"]

# A component (a components dataclass field) -> the --offload name that moves it.
_OFFLOAD_OF = {"transformer": "transformer_blocks", "transformer_2": "transformer_blocks",
               "text_encoder": "text_encoder", "connectors": "text_encoder", "image_encoder": "text_encoder",
               "vae": "vae", "audio_vae": "vae", "vocoder": "vae"}
_TRANSFORMERS = ("transformer", "transformer_2")
_SHARDABLE = (*_TRANSFORMERS, "text_encoder")

AUTO_FRACTION = 0.8
"""``auto`` shards when the replicated weights' peak passes this share of free device memory: the rest is left to
the activations, the allocator's fragmentation and CUDA's own context."""


# ---------------------------------------------------------------------------------------------- the families


def _component_classes(family_name: str, root: Path | None) -> list[tuple[str, Any, bool]]:
    """``(subfolder, class, is_transformers)`` of every component with weights, in load order (its family's
    ``component_classes``)."""
    return family(family_name).component_classes(root)


def _sharded_classes(family_name: str) -> tuple[type, type]:
    """The classes of a family's sharded components: its transformer and its text encoder."""
    classes = {name: cls for name, cls, _ in _component_classes(family_name, None)}
    return classes["transformer"], classes["text_encoder"]


def model_components(model: str | Path, *, dtype: str | torch.dtype) -> list[Component]:
    """The components of the folder ``model`` (its configs only: no weight is read), as the memory plan sees them:
    built on the meta device in ``dtype``, the transformer's blocks and the text encoder's layers as units."""
    root = Path(model)
    dtype = parse_dtype(dtype)
    components = []
    name_of_family = detect_family(root)
    float32 = family(name_of_family).float32_components
    for name, cls, is_transformers in _component_classes(name_of_family, root):
        if not (root / name).is_dir():
            continue  # the latent upsampler is optional; a missing required one is the load's to report
        own = torch.float32 if name in float32 else dtype  # as the family's loader loads them
        try:
            module = (build_text_encoder(cls, root / name, own) if is_transformers
                      else build_transformer(cls, root, name, own))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ModelLoadError(f"could not read the config of {name}/ in {str(root)!r}: {exc}") from exc
        blocks, idle = ([], [])
        if name in _TRANSFORMERS:
            blocks = transformer_blocks(module)
        elif name == "text_encoder":
            blocks, idle = text_encoder_units(module)
        components.append(Component(
            name=name, root=unit_of([module], exclude=[*blocks, *idle]), blocks=tuple(unit_of([b]) for b in blocks),
            idle=tuple(unit_of([m]) for m in idle), shardable=name in _SHARDABLE, offload=_OFFLOAD_OF.get(name)))
    return components


# ----------------------------------------------------------------------------------------------- one rank's load


def resolve_placement(model: str | Path, *, dtype: str | torch.dtype, state: ParallelState, weights: str = "auto",
                      offload: Sequence[str] = ()) -> Placement:
    """How this rank loads ``model``: ``weights`` resolved (``auto``: see the module docstring) and, sharded, the
    replica group's mesh. Every rank of the world calls it at the same point (the decision's all-reduce and the
    mesh's groups are collectives)."""
    weights = parse_weights(weights)
    offload = parse_offload(list(offload))
    replica = len(state.replica_ranks)
    if weights == "auto":
        weights = _auto(model, dtype=dtype, state=state, offload=offload)
    if replica == 1:
        weights = "replicated"
    mesh = replica_mesh(state) if weights == "sharded" else None
    return Placement(weights=weights, offload=offload, state=state, mesh=mesh)


def auto_shards(replicated_peak: int, free: int) -> bool:
    """``--weights auto``'s rule: shard when the replicated weights' peak passes ``AUTO_FRACTION`` of ``free``."""
    return replicated_peak > AUTO_FRACTION * free


def _auto(model: str | Path, *, dtype, state: ParallelState, offload: tuple[str, ...]) -> str:
    if state.device.type != "cuda" or len(state.replica_ranks) == 1:
        return "replicated"
    plan = plan_memory(model_components(model, dtype=dtype), ranks=len(state.replica_ranks), sharded=False,
                       offload=offload)
    free, _ = torch.cuda.mem_get_info(state.device)
    shard = torch.tensor([int(auto_shards(plan.peak_device_bytes, free))])
    if state.world_group is not None:
        dist.all_reduce(shard, op=dist.ReduceOp.MAX, group=state.world_group)
    return "sharded" if int(shard) else "replicated"


def sharded_loaders(family_name: str, placement: Placement) -> dict[str, Any]:
    """``subfolder -> loader`` for ``models.common.loading`` (``from_pretrained``'s call shape): the transformer and the
    text encoder read a shard at a time; empty when ``placement`` is replicated."""
    if not placement.sharded:
        return {}
    transformer_cls, text_cls = _sharded_classes(family_name)
    transformer = sharded_loader(
        placement, lambda root, sub, dtype: build_transformer(transformer_cls, root, sub, dtype),
        lambda m: (transformer_blocks(m), []), weights_name="diffusion_pytorch_model",
        offload="transformer_blocks" in placement.offload)
    return {
        # A folder without transformer_2/ never asks for its loader.
        **dict.fromkeys(family(family_name).transformer_subfolders, transformer),
        "text_encoder": sharded_loader(
            placement, lambda root, sub, dtype: build_text_encoder(text_cls, root / sub, dtype), text_encoder_units,
            weights_name="model", offload="text_encoder" in placement.offload, text=True),
    }


def _modules(components) -> dict[str, nn.Module]:
    return {f.name: getattr(components, f.name) for f in dataclasses.fields(components)
            if isinstance(getattr(components, f.name), nn.Module)}


def offloaded_components(placement: Placement) -> frozenset[str]:
    """The components (components dataclass fields) :func:`apply_offload` keeps on the CPU: the loaders leave them
    there, never moving them to the device first."""
    return frozenset(name for name, what in _OFFLOAD_OF.items()
                     if what in placement.offload and not (placement.sharded and name in _SHARDABLE))


def apply_offload(components, placement: Placement) -> None:
    """Keep the components ``placement.offload`` names on the CPU between uses (sharded ones already are: their
    FSDP2 shards were loaded there). Call it after the adapter has installed its processors and hooks."""
    from diffusers.hooks import apply_group_offloading

    device = placement.state.device
    stream = device.type == "cuda"
    offloaded = offloaded_components(placement)
    for name, module in _modules(components).items():
        if name not in offloaded:
            continue
        if name in _TRANSFORMERS:
            apply_group_offloading(module, onload_device=device, offload_device="cpu", offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=stream)
        else:
            apply_group_offloading(module, onload_device=device, offload_device="cpu", offload_type="leaf_level",
                                   use_stream=stream)


def measure_components(components, placement: Placement) -> RankMemory:
    """What this rank holds of each component, and where (``cp_infer.placement.measure``)."""
    return measure(_modules(components), rank=placement.state.rank, weights=placement.weights,
                   offload=placement.offload)
