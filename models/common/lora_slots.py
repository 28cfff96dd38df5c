"""Adapter slots for compiled transformer blocks (``--compile`` with ``--lora-dir``): a pass's adapters are copied
into a fixed set of preallocated peft adapters, so what dynamo traced never changes and the blocks compile once.

Invariants:
- Made once, before the blocks are compiled (:func:`make_slots`): ``MAX_LORAS`` peft LoRA adapters (``SLOT_NAMES``)
  of rank ``rank`` (``--max-lora-rank``) on every linear module that some adapter of the directory names at start
  (the union of their converted headers: ``models.common.lora.adapted_modules``), all of them active, each scaling a
  0-dim
  tensor. Modules no adapter names have no slot. From then on the module structure, the active adapters and every
  slot tensor's identity, shape and dtype are fixed: a pass changes values only (``copy_``, ``fill_``), which
  dynamo's guards do not see (they check tensors' metadata, and the graph reads their values).
- A pass applying adapters ``a_1 .. a_k`` (``k <= MAX_LORAS``, in the request's order) holds ``a_i`` in slot ``i``:
  lora_A's first ``r`` rows and lora_B's first ``r`` columns are the adapter's, the rest zero; the scaling is peft's
  ``scale * alpha / r`` (``LoraLayer.set_scale``). peft's forward adds the active adapters in order, so a module adds
  the request's adapters in the request's order, as the eager path (``set_adapters``) does.
- A slot the pass does not use, or a module its adapter does not name, holds zeros with scaling 0: its term is
  ``B (A x) * 0``, exactly zero, so a pass without adapters computes the base layers exactly (plus zeros).
- What cannot fit the slots is refused when it loads (``ValueError``, a predicate on the adapter's name): a module
  without a slot (a file added or changed after the start that names modules the start's adapters did not), a rank
  over the slots', and anything but plain LoRA of linear layers (DoRA, LoRA biases, LoKr). Nothing is ever loaded
  eagerly beside the slots: that would change the compiled modules.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cp_infer.request import MAX_LORAS
from cp_infer.weights import adding_layers

__all__ = ["DEFAULT_MAX_LORA_RANK", "SLOT_NAMES", "LoraSlots", "SlotAdapter", "make_slots", "outside_slots",
           "over_slot_rank"]

log = logging.getLogger("cp_infer.lora")

DEFAULT_MAX_LORA_RANK = 64
"""The slots' rank: adapters of at most this rank (per module) apply under ``--compile``."""
SLOT_NAMES = tuple(f"cp_infer_slot_{i}" for i in range(MAX_LORAS))
_SERIAL = itertools.count()


@dataclass(frozen=True, eq=False)
class _Module:
    """One module's adapter tensors, on the slots' device and in their dtype."""

    a: torch.Tensor
    """``[r, in]``"""
    b: torch.Tensor
    """``[out, r]``"""
    alpha: float
    r: int
    rslora: bool

    def scaling(self, scale: float) -> float:
        """peft's ``LoraLayer.set_scale``, the same expression in the same order (the same float)."""
        if self.rslora:
            return scale * self.alpha / math.sqrt(self.r)
        return scale * self.alpha / self.r


@dataclass(frozen=True, eq=False)
class SlotAdapter:
    """An adapter read for the slots: ``(part, module) -> tensors``."""

    modules: Mapping[tuple[str, str], _Module]
    serial: int = field(default_factory=lambda: next(_SERIAL))
    """Tells a read from another (a file read again is a new adapter to copy in)."""

    @property
    def bytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size() for m in self.modules.values())


class LoraSlots:
    """The slots of a model's parts (:func:`make_slots`) and what is in them."""

    def __init__(self, parts: Mapping[str, torch.nn.Module], modules: Mapping[str, Sequence[str]], *, rank: int):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"max_lora_rank={rank!r} must be an integer >= 1")
        self.parts, self.rank = dict(parts), rank
        self.layers: dict[tuple[str, str], torch.nn.Module] = {}
        """``(part, module)`` -> its peft layer with the slots."""
        for prefix, names in modules.items():
            part = self.parts[prefix]
            for name in names:
                self.layers[prefix, name] = part.get_submodule(name)
        self._held: list[tuple[int, float] | None] = [None] * len(SLOT_NAMES)
        """Per slot, what it holds: (the adapter's serial, its scale); ``None``: zeros."""

    def read(self, state_dict: Mapping[str, torch.Tensor], metadata: Mapping | None, *, name: str) -> SlotAdapter:
        """An adapter's tensors (``state_dict`` and ``metadata`` as the family's ``lora_state_dict`` returns them)
        for the slots, with peft's rank and alpha per module (as ``load_lora_adapter`` configures them);
        ``ValueError`` when they do not fit (the module docstring)."""
        modules = {}
        for prefix, part in self.parts.items():
            own = {k.removeprefix(f"{prefix}."): v for k, v in state_dict.items() if k.startswith(f"{prefix}.")}
            if not own:
                continue
            modules.update(self._read_part(prefix, part, own, metadata, name=name))
        if not modules:
            raise ValueError(f"has no tensors for {', '.join(self.parts)}: it matches no module of the loaded model")
        return SlotAdapter(modules)

    def _read_part(self, prefix, part, own, metadata, *, name):
        from diffusers.utils import convert_unet_state_dict_to_peft
        from diffusers.utils.peft_utils import _create_lora_config
        from peft.utils.other import get_pattern_key

        if any(".lokr_" in key for key in own):
            raise ValueError("is a LoKr adapter: under --compile only LoRA adapters apply (run without --compile)")
        if "lora_A" not in next(iter(own)):
            own = convert_unet_state_dict_to_peft(own)
        if metadata is not None:
            metadata = {k.removeprefix(f"{prefix}."): v for k, v in metadata.items() if k.startswith(f"{prefix}.")}
        ranks = {f"^{key}": value.shape[1] for key, value in own.items() if "lora_B" in key and value.ndim > 1}
        # load_lora_adapter also passes the part's state_dict, which this diffusers reads for nothing (and a sharded
        # part's cannot be read under the sampler's inference mode: cp_infer.weights' NOTE(inference-mode)).
        config = _create_lora_config(own, None, metadata, ranks, adapter_name=name)
        if config.use_dora or getattr(config, "lora_bias", False):
            raise ValueError("is a DoRA adapter or has LoRA biases: under --compile only plain LoRA adapters "
                                "apply (run without --compile)")
        out = {}
        for key in own:
            module, _, tensor = key.rpartition(".lora_")
            if tensor not in ("A.weight", "B.weight"):
                raise ValueError(f"has the tensor {prefix}.{key}, which the adapter slots of --compile do not "
                                    "hold (plain LoRA A and B only); run without --compile")
            if tensor == "B.weight":
                continue
            if (prefix, module) not in self.layers:
                if _is_linear(part, module):
                    raise ValueError(outside_slots(f"{prefix}.{module}"))
                log.warning("adapter %r: %s.%s is not a linear layer of the loaded model; it is ignored", name,
                            prefix, module)
                continue
            a, b = own[f"{module}.lora_A.weight"], own.get(f"{module}.lora_B.weight")
            r = config.rank_pattern.get(get_pattern_key(config.rank_pattern.keys(), module), config.r)
            alpha = config.alpha_pattern.get(get_pattern_key(config.alpha_pattern.keys(), module), config.lora_alpha)
            layer = self.layers[prefix, module]
            if b is None or a.ndim != 2 or b.shape != (layer.out_features, a.shape[0]) or a.shape[0] != r:
                raise ValueError(f"has no consistent LoRA pair for {prefix}.{module} (A {tuple(a.shape)}, B "
                                    f"{None if b is None else tuple(b.shape)}, rank {r})")
            if r > self.rank:
                raise ValueError(over_slot_rank(r, f"{prefix}.{module}", self.rank))
            slot = layer.lora_A[SLOT_NAMES[0]].weight
            out[prefix, module] = _Module(a.to(slot.device, slot.dtype), b.to(slot.device, slot.dtype),
                                          float(alpha), int(r), bool(config.use_rslora))
        return out

    def fill(self, adapters: Sequence[tuple[SlotAdapter, float]]) -> None:
        """Slot ``i`` holds ``adapters[i]`` (an adapter and its scale), the rest zeros (the module docstring); a slot
        that already holds what it should is left as it is."""
        assert len(adapters) <= len(SLOT_NAMES), len(adapters)
        with torch.no_grad():
            for i, slot in enumerate(SLOT_NAMES):
                adapter, scale = adapters[i] if i < len(adapters) else (None, 0.0)
                held = None if adapter is None else (adapter.serial, float(scale))
                if held == self._held[i]:
                    continue
                same_weights = held is not None and self._held[i] is not None and self._held[i][0] == held[0]
                for key, layer in self.layers.items():
                    module = None if adapter is None else adapter.modules.get(key)
                    a, b = layer.lora_A[slot].weight, layer.lora_B[slot].weight
                    if module is None:
                        if not same_weights:
                            a.zero_()
                            b.zero_()
                        layer.scaling[slot].fill_(0.0)
                        continue
                    if not same_weights:
                        a[:module.r].copy_(module.a)
                        a[module.r:].zero_()
                        b[:, :module.r].copy_(module.b)
                        b[:, module.r:].zero_()
                    layer.scaling[slot].fill_(module.scaling(float(scale)))
                self._held[i] = held


def outside_slots(module: str) -> str:
    """Why an adapter of ``module`` (``part.module``) cannot apply: it has no slot (a predicate)."""
    return (f"adapts {module}, which no adapter of --lora-dir adapted when the model was loaded: under --compile the "
            "adapter slots cover those modules only; restart the server (or command) to include this adapter, or "
            "run without --compile")


def over_slot_rank(r: int, module: str, rank: int) -> str:
    """Why an adapter of rank ``r`` at ``module`` cannot apply to slots of ``rank`` (a predicate)."""
    return (f"has rank {r} at {module}, over the adapter slots' rank {rank}: start with --max-lora-rank {r} (or "
            "more) to apply it under --compile")


def _is_linear(part: torch.nn.Module, name: str) -> bool:
    try:
        module = part.get_submodule(name)
    except AttributeError:
        return False
    return isinstance(module, torch.nn.Linear) or isinstance(getattr(module, "base_layer", None), torch.nn.Linear)


def make_slots(parts: Mapping[str, torch.nn.Module], modules: Mapping[str, Sequence[str]], *,
               rank: int = DEFAULT_MAX_LORA_RANK) -> LoraSlots:
    """The slots (the module docstring) injected into ``parts`` on the linear ``modules`` named per part (those of
    no linear layer are left out), zeros with scaling 0: the base model's output until a pass fills them."""
    from peft import LoraConfig

    linear = {prefix: sorted(name for name in names if _is_linear(parts[prefix], name))
              for prefix, names in modules.items() if prefix in parts}
    linear = {prefix: names for prefix, names in linear.items() if names}
    for prefix, names in linear.items():
        part = parts[prefix]
        if getattr(part, "peft_config", None):
            raise ValueError(f"{prefix} already has peft adapters ({', '.join(part.peft_config)}); the adapter slots "
                             "must be its only ones")
        # A regular expression of the whole names: peft matches a list's entries as suffixes (``proj_out`` would
        # also adapt every ``*.proj_out``).
        pattern = "|".join(re.escape(name) for name in names)
        # adding_layers: on a sharded part (FSDP2) the slots stay whole on every rank, as any adapter's layers.
        with warnings.catch_warnings(), adding_layers(part):
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # several slots, by design
            for slot in SLOT_NAMES:
                part.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=f"^(?:{pattern})$",
                                            lora_dropout=0.0), adapter_name=slot)
        part.set_adapters(list(SLOT_NAMES), [1.0] * len(SLOT_NAMES))
    slots = LoraSlots(parts, linear, rank=rank)
    with torch.no_grad():
        for layer in slots.layers.values():
            device = layer.lora_A[SLOT_NAMES[0]].weight.device
            for slot in SLOT_NAMES:
                layer.lora_A[slot].weight.zero_()
                layer.lora_B[slot].weight.zero_()
                layer.lora_A[slot].weight.requires_grad_(False)
                layer.lora_B[slot].weight.requires_grad_(False)
                # A tensor, changed in place: a float would be a constant in the compiled graph (peft's
                # prepare_model_for_compiled_hotswap converts them the same way).
                layer.scaling[slot] = torch.zeros((), device=device, dtype=torch.float32)
    count = sum(len(names) for names in linear.values())
    log.info("adapter slots: %d x rank %d on %d linear modules (%s)", len(SLOT_NAMES), rank, count,
             ", ".join(f"{prefix}: {len(names)}" for prefix, names in linear.items()) or "none")
    return slots
