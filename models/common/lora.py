"""Per-request LoRA adapters: the deployment's adapter directory, the check a front end runs against it, and each
rank's loaded adapters (an LRU bounded in bytes), activated pass by pass.

Invariants:
- A client names adapters, never paths: a name (``cp_infer.request.LORA_NAME``, no ``/``) is the stem of a
  ``.safetensors`` file directly in the directory, followed through symlinks and refused unless the real file lies
  inside the real directory. Only safetensors are read (``safe_open``, and diffusers' loader with
  ``use_safetensors=True``): never pickle.
- A front end's check (:meth:`LoraCatalog.check`) reads the files' headers only: their keys converted as diffusers'
  loader converts them (Lightricks' and ComfyUI keys through the family's ``lora_state_dict``), mapped to module
  names and checked against the model's own modules (built on the meta device from its configs), so an unknown
  name, a file that is no LoRA, or an adapter that matches no module of the model is refused before anything is
  broadcast, with a message naming ``loras[i]`` and the fix.
- On every rank :meth:`LoadedLoras.activate` runs before a pass's first step (the adapter's ``prepare``, which the
  sampler agrees on, so a failure to load on any rank fails the job on every rank): the pass's adapters loaded (from
  the LRU, or read), activated with the pass's names and scales in order (``set_adapters``), unfused. A pass
  without adapters runs with every adapter disabled (peft then calls the base layer alone: the base weights,
  exactly). Nothing is ever fused, so the base weights never change.
- The LRU keeps at most ``max_bytes`` of adapter tensors between passes: before one is read, and once a pass's are
  loaded, the least recently used adapters the pass does not name are deleted (``delete_adapters``) until the rest
  fit; the adapters of one pass are loaded together even when they alone are over the budget. An adapter whose file
  changed since it was read is read again.
- Stage 2 of two-stage generation (a plan pass of kind ``refine`` / ``refine_window``) also applies the operator's
  stage-2 adapters (``--stage-2-lora``: Lightricks' distilled LoRA in the dev two-stage recipe) after the request's
  own (:func:`pass_loras`); every rank has them from its runtime settings, so every rank activates the same.
- A sharded part (``--weights sharded``) takes an adapter's layers whole on every rank, outside its FSDP2 units
  (``cp_infer.weights.adding_layers`` around each load and delete): its base weights stay sharded.
- Under ``--compile`` (``slots``: ``models.common.lora_slots``) nothing is loaded into the parts per pass: the adapters
  are read for, and copied into, fixed slots made before the compile, so the compiled blocks never change; the LRU
  then holds those read tensors. What does not fit the slots (a rank over theirs, a module without one) is refused
  by the front end's check and by the load, naming the fix.
- Family-free: a family declares its loader (diffusers' ``*LoraLoaderMixin``, whose ``lora_state_dict`` converts
  non-diffusers keys) and its parts (``transformer``; for LTX-2 also ``connectors``) in a :class:`LoraSpec`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from cp_infer.request import LORA_NAME, MAX_LORAS, LoraWeight
from cp_infer.weights import adding_layers

from .lora_slots import LoraSlots, SlotAdapter, outside_slots, over_slot_rank

__all__ = ["DEFAULT_MAX_LORA_BYTES", "STAGE_2_KINDS", "LoadedLoras", "LoraCatalog", "LoraDirectory", "LoraSpec",
           "LoraTargets", "adapted_modules", "apply_loras", "check_stage_2", "pass_loras", "targets_from_configs"]

log = logging.getLogger("cp_infer.lora")

DEFAULT_MAX_LORA_BYTES = 8 * 2**30
"""Adapter tensors kept loaded per rank between passes: some thirty rank-16 adapters of the 19B LTX-2 in bf16
(about 0.25 GiB each), or one rank-384 adapter and a few small ones."""
SUFFIX = ".safetensors"
# A key's first segment from which on it names the adapter's own tensors, not the module they adapt (peft's lora_A /
# lora_B, kohya's lora_down / lora_up and alpha, LoKr's lokr_*, DoRA's scale).
_TENSOR_SEGMENT = re.compile(r"^(lora|lokr)|^(alpha|dora_scale)$")


@dataclass(frozen=True)
class LoraSpec:
    """How a family's adapters load (its adapter module declares one)."""

    loader: type
    """diffusers' ``*LoraLoaderMixin`` of the family's pipeline: its ``lora_state_dict`` (a classmethod) reads a file
    or converts a state dict to diffusers' keys (``<part>.<module>.lora_A.weight``)."""
    parts: Mapping[str, type]
    """The components an adapter loads into, by the prefix of their keys (also their folder and component name:
    ``transformer``, ``connectors``), each with its model class (built on the meta device for the front end's
    check)."""


@dataclass(frozen=True)
class LoraTargets:
    """The modules an adapter may name, by part: module name -> ``(in_features, out_features)`` of a linear layer
    (``None`` for any other module)."""

    modules: Mapping[str, Mapping[str, tuple[int, int] | None]]

    @classmethod
    def of(cls, parts: Mapping[str, torch.nn.Module]) -> LoraTargets:
        def features(module: torch.nn.Module) -> tuple[int, int] | None:
            return (module.in_features, module.out_features) if isinstance(module, torch.nn.Linear) else None

        return cls({prefix: {name: features(m) for name, m in part.named_modules() if name}
                    for prefix, part in parts.items()})


def targets_from_configs(folder: str | os.PathLike, spec: LoraSpec) -> LoraTargets:
    """The targets of the model in ``folder``, its parts built on the meta device from their configs (no weights,
    no memory)."""
    parts = {}
    for prefix, cls in spec.parts.items():
        config = cls.load_config(folder, subfolder=prefix, local_files_only=True)
        with torch.device("meta"):
            parts[prefix] = cls.from_config(config)
    return LoraTargets.of(parts)


def _module_of(key: str) -> tuple[str, str, str]:
    """``transformer.blocks.0.to_q.lora_A.weight`` -> (``transformer``, ``blocks.0.to_q``, ``lora_A.weight``)."""
    prefix, _, rest = key.partition(".")
    segments = rest.split(".")
    cut = next((i for i, s in enumerate(segments) if _TENSOR_SEGMENT.search(s)), len(segments))
    return prefix, ".".join(segments[:cut]), ".".join(segments[cut:])


class LoraDirectory:
    """The adapters of a deployment: each ``NAME.safetensors`` directly in ``root``."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        if not self.root.is_dir():
            raise ValueError(f"lora_dir={str(self.root)!r} is not a folder; give --lora-dir a folder of .safetensors "
                             "adapters")
        self._real_root = self.root.resolve()

    def names(self) -> list[str]:
        """The adapters requests may name, sorted (files that are not regular files inside the directory, or whose
        stem is no adapter name, are left out)."""
        names = []
        for entry in sorted(self.root.iterdir()):
            stem = entry.name[:-len(SUFFIX)]
            if entry.name.endswith(SUFFIX) and LORA_NAME.fullmatch(stem) and self._inside(entry):
                names.append(stem)
        return names

    def _inside(self, path: Path) -> bool:
        real = path.resolve()
        return real.parent == self._real_root and real.is_file()

    def resolve(self, name: str) -> Path:
        """The real file of adapter ``name``; ``ValueError`` when there is none (or it leaves the directory). This
        class's errors say what is wrong with the name, as a sentence's predicate: ``f"adapter {name!r} {error}"``."""
        if not isinstance(name, str) or not LORA_NAME.fullmatch(name):
            raise ValueError("is not an adapter name (1-64 of A-Z a-z 0-9 . _ -)")
        path = self.root / f"{name}{SUFFIX}"
        if not path.exists():
            others = self.names()
            listed = ", ".join(others) if others else "none"
            raise ValueError(f"is not an adapter in --lora-dir (its .safetensors files: {listed}); name one of those")
        if not self._inside(path):
            raise ValueError(f"is not a regular file inside the adapter directory ({path.name} is a link out of it, "
                             "or a folder); the operator must place the adapter file itself there")
        return path.resolve()

    def header(self, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """Adapter ``name``'s tensors as its safetensors header lists them: key -> (shape, dtype); ``ValueError`` for
        a file that is not safetensors."""
        from safetensors import SafetensorError, safe_open

        path = self.resolve(name)
        try:
            with safe_open(path, framework="pt") as f:
                slices = {key: f.get_slice(key) for key in list(f.keys())}  # safe_open is not iterable
                return {key: (tuple(t.get_shape()), t.get_dtype()) for key, t in slices.items()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"is not a readable safetensors file ({path.name}: {exc}); adapters must be "
                             "safetensors") from None

    def signature(self, name: str) -> tuple[int, int]:
        """What tells a changed file: its size and modification time."""
        stat = self.resolve(name).stat()
        return stat.st_size, stat.st_mtime_ns


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}


class LoraCatalog:
    """What a front end checks a request's ``loras`` against before anything is broadcast: the adapter directory
    (``None``: the deployment has none) and the model's modules (:class:`LoraTargets`, made on first use); with
    ``slot_rank`` (``--compile``: ``models.common.lora_slots``) also the slots' rank and modules (those the directory's
    adapters name on first use, as the ranks found them when they loaded the model)."""

    def __init__(self, directory: LoraDirectory | None, *, spec: LoraSpec, targets: Callable[[], LoraTargets],
                 slot_rank: int | None = None):
        self.directory, self.spec = directory, spec
        self._targets_of, self._targets = targets, None
        self.slot_rank = slot_rank
        self._slot_modules: dict[str, set[str]] | None = None
        self._verdicts: dict[tuple, str | None] = {}
        self._lock = threading.Lock()

    def adapters(self) -> list[dict]:
        """Each adapter a request may name: ``name`` and ``bytes`` (of its tensors as stored)."""
        if self.directory is None:
            return []
        out = []
        for name in self.directory.names():
            try:
                header = self.directory.header(name)
            except ValueError:
                continue  # not safetensors: refused by name when asked for
            size = sum(_numel(shape) * _DTYPE_BYTES.get(dtype, 4) for shape, dtype in header.values())
            out.append({"name": name, "bytes": size})
        return out

    def check(self, loras: Sequence[LoraWeight]) -> None:
        """``ValueError`` naming ``loras[i]`` and the fix for an adapter this deployment cannot apply to its model."""
        if not loras:
            return
        if self.directory is None:
            raise ValueError("loras: this deployment has no adapters (it was started without "
                             "--lora-dir DIR, a folder of .safetensors adapters); leave loras out")
        for i, lora in enumerate(loras):
            try:
                key = (lora.name, *self.directory.signature(lora.name))
                with self._lock:
                    verdict = self._verdicts.get(key, "")
                if verdict == "":
                    verdict = self._verdict(lora.name)
                    with self._lock:
                        self._verdicts[key] = verdict
            except ValueError as exc:
                verdict = str(exc)
            if verdict is not None:
                raise ValueError(f"loras[{i}].name={lora.name!r} {verdict}")

    def warm(self) -> None:
        """Make every adapter's verdict (and the model's modules) now, as :meth:`check` would on first use."""
        for name in self.directory.names() if self.directory is not None else ():
            with contextlib.suppress(ValueError):  # refused by name when asked for
                self.check((LoraWeight(name),))

    def _verdict(self, name: str) -> str | None:
        """Why adapter ``name`` cannot apply to the model, as a predicate (``None``: it can)."""
        header = self.directory.header(name)
        if not header:
            return "holds no tensors: it is no LoRA adapter"
        try:
            converted = converted_header(header, self.spec)
        except Exception as exc:  # noqa: BLE001 -- whatever the converter refuses, the client hears why
            return f"is no LoRA checkpoint diffusers can read ({type(exc).__name__}: {exc})"
        keys = list(converted)
        if not all("lora" in key for key in keys):
            bad = next(key for key in keys if "lora" not in key)
            return f"is no LoRA checkpoint (its tensor {bad!r} has no 'lora' in its name)"
        if self._targets is None:
            try:
                self._targets = self._targets_of()
            except Exception as exc:  # noqa: BLE001 -- a model that will not build on the meta device
                log.warning("the model's modules could not be listed (%s: %s); adapters are checked when they load",
                            type(exc).__name__, exc)
                self._targets = LoraTargets({})
        if not self._targets.modules:
            return None  # nothing to match against: every rank's load is the check
        targets = self._targets.modules
        named, missing = set(), set()
        for key in keys:
            prefix, module, tensor = _module_of(key)
            if prefix not in targets:
                continue
            table = targets[prefix]
            if module not in table:
                missing.add(f"{prefix}.{module}")
                continue
            named.add(f"{prefix}.{module}")
            shape, features = tuple(converted[key].shape), table[module]
            if features is not None and len(shape) == 2:
                found, want = _fits(tensor, shape, features)
                if found is not None:
                    return (f"does not fit the loaded model: {prefix}.{module} has {want} features where the "
                            f"adapter's {tensor} has {found}; it was made for another model")
        if not named:
            shown = sorted(missing)[:3] or sorted({k.rsplit(".lora", 1)[0] for k in keys})[:3]
            return (f"matches no module of the loaded model (its {len(keys)} tensors name "
                    f"{', '.join(shown)}, ...; the model's adapters load into {', '.join(self.spec.parts)}): it was "
                    "made for another model")
        if missing:
            log.warning("adapter %r: %d of its modules are not in the loaded model (e.g. %s); they are ignored", name,
                        len(missing), sorted(missing)[0])
        return None if self.slot_rank is None else self._slot_verdict(converted)

    def _slot_verdict(self, converted: Mapping[str, torch.Tensor]) -> str | None:
        """Why an adapter (its converted keys and shapes) does not fit ``--compile``'s slots (``None``: it does)."""
        if self._slot_modules is None:
            self._slot_modules = adapted_modules(self.directory, self.spec)
        for key, value in converted.items():
            prefix, module, tensor = _module_of(key)
            if self._targets.modules.get(prefix, {}).get(module) is None:
                continue  # not a linear layer of the model: ignored, as by the ranks
            if module not in self._slot_modules.get(prefix, ()):
                return outside_slots(f"{prefix}.{module}")
            if tensor.startswith(("lora_A.", "lora_down.")) and value.ndim == 2 and value.shape[0] > self.slot_rank:
                return over_slot_rank(value.shape[0], f"{prefix}.{module}", self.slot_rank)
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fits(tensor: str, shape: tuple[int, int], features: tuple[int, int]) -> tuple[int | None, int | None]:
    """``(found, wanted)`` features when a linear layer's adapter tensor does not fit it, else ``(None, None)``:
    ``lora_A`` / ``lora_down`` are ``[rank, in]``, ``lora_B`` / ``lora_up`` ``[out, rank]``."""
    if tensor.startswith(("lora_A.", "lora_down.")) and shape[1] != features[0]:
        return shape[1], features[0]
    if tensor.startswith(("lora_B.", "lora_up.")) and shape[0] != features[1]:
        return shape[0], features[1]
    return None, None


def converted_header(header: Mapping[str, tuple], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """An adapter file's header (key -> (shape, dtype)) with its keys as diffusers' loader converts them, each a
    meta tensor of its shape: what the front end's checks read instead of the tensors. Raises what the converter
    raises."""
    meta = {key: torch.empty(shape, device="meta") for key, (shape, _) in header.items()}
    return dict(spec.loader.lora_state_dict(meta))


def adapted_modules(directory: LoraDirectory, spec: LoraSpec) -> dict[str, set[str]]:
    """Per part, the modules the adapters of ``directory`` name now, from their headers converted as the front end's
    check converts them (:class:`LoraCatalog`); an adapter whose header does not convert is left out (the check
    refuses it)."""
    out: dict[str, set[str]] = {prefix: set() for prefix in spec.parts}
    for name in directory.names():
        try:
            keys = list(converted_header(directory.header(name), spec))
        except Exception as exc:  # noqa: BLE001 -- whatever the converter refuses, the check refuses too
            log.warning("adapter %r: its header does not convert (%s: %s); no modules from it", name,
                        type(exc).__name__, exc)
            continue
        for key in keys:
            prefix, module, _ = _module_of(key)
            if prefix in out:
                out[prefix].add(module)
    return out


class LoadedLoras:
    """One rank's adapters in its model's parts: an LRU of at most ``max_bytes`` of adapter tensors, and the
    activation of a pass's adapters (see the module docstring)."""

    def __init__(self, directory: LoraDirectory, *, spec: LoraSpec, parts: Mapping[str, torch.nn.Module],
                 max_bytes: int = DEFAULT_MAX_LORA_BYTES, stage_2: Sequence[LoraWeight] = (),
                 slots: LoraSlots | None = None):
        if max_bytes < 0:
            raise ValueError(f"max_lora_bytes={max_bytes} must be >= 0")
        assert set(parts) == set(spec.parts), (set(parts), set(spec.parts))
        self.directory, self.spec, self.parts, self.max_bytes = directory, spec, dict(parts), max_bytes
        self._loaded: OrderedDict[str, tuple[int, tuple[int, int]]] = OrderedDict()
        """name -> (bytes, file signature), least recently used first."""
        self._lock = threading.Lock()  # loaded() is read by another thread (the HTTP front end's)
        self.reads = 0
        """Adapter files read so far (first uses, and reloads after an eviction)."""
        self.active: tuple[LoraWeight, ...] = ()
        """The adapters the last :meth:`activate` made active."""
        self.stage_2 = tuple(stage_2)
        """The operator's stage-2 adapters (:func:`pass_loras`)."""
        self.slots = slots
        """Under ``--compile``: the adapters are read for these slots and copied into them pass by pass
        (``models.common.lora_slots``), never loaded into the parts as peft adapters; ``None``: the unfused peft
        path."""
        self._slotted: dict[str, SlotAdapter] = {}

    def loaded(self) -> dict[str, int]:
        """The adapters loaded now -> their bytes, least recently used first."""
        with self._lock:
            return {name: size for name, (size, _) in self._loaded.items()}

    def activate(self, loras: Sequence[LoraWeight]) -> None:
        """Make ``loras`` (names and scales, in order) the active adapters of every part; none: the base weights."""
        loras = tuple(loras)
        names = [lora.name for lora in loras]
        for name in names:
            try:
                self._use(name, keep=names)
            except ValueError as exc:
                raise ValueError(f"adapter {name!r} {exc}") from exc
            except Exception as exc:
                raise RuntimeError(f"adapter {name!r} could not be loaded: {type(exc).__name__}: {exc}") from exc
        self._make_room(0, keep=names)  # adapters of an earlier pass that were over the budget with it
        if self.slots is not None:
            self.slots.fill([(self._slotted[lora.name], float(lora.scale)) for lora in loras])
            self.active = loras
            return
        holders = [part for part in self.parts.values() if getattr(part, "peft_config", None)]
        for part in holders:
            if loras:
                part.set_adapters(names, [float(lora.scale) for lora in loras])
                part.enable_lora()  # set_adapters leaves a disabled part disabled
            else:
                part.disable_lora()
        self.active = loras

    def _use(self, name: str, *, keep: Sequence[str]) -> None:
        """Adapter ``name`` loaded (read unless it is, and its file has not changed), the most recently used."""
        signature = self.directory.signature(name)
        with self._lock:
            held = self._loaded.get(name)
        if held is not None and held[1] != signature:
            self._delete(name)  # its file changed: read it again
            held = None
        if held is None:
            self._make_room(self._estimate(name), keep=keep)
            self._load(name, signature)
        with self._lock:
            self._loaded.move_to_end(name)

    def _estimate(self, name: str) -> int:
        element = torch.empty((), dtype=next(iter(self.parts.values())).dtype).element_size()
        return sum(_numel(shape) for shape, _ in self.directory.header(name).values()) * element

    def _make_room(self, incoming: int, *, keep: Sequence[str]) -> None:
        while True:
            with self._lock:
                total = sum(size for size, _ in self._loaded.values())
                victim = next((name for name in self._loaded if name not in keep), None)
            if total + incoming <= self.max_bytes or victim is None:
                return
            self._delete(victim)

    def _delete(self, name: str) -> None:
        self._slotted.pop(name, None)
        for part in self.parts.values():
            if name in getattr(part, "peft_config", {}):
                with adding_layers(part):
                    part.delete_adapters(name)
        with self._lock:
            self._loaded.pop(name, None)
        log.info("adapter %r unloaded", name)

    def _load(self, name: str, signature: tuple[int, int]) -> None:
        from diffusers.loaders.lora_pipeline import _LOW_CPU_MEM_USAGE_DEFAULT_LORA

        path = self.directory.resolve(name)
        # As the family's pipeline.load_lora_weights(path, adapter_name=name) reads and converts it; safetensors only.
        state_dict, metadata = self.spec.loader.lora_state_dict(str(path.parent), weight_name=path.name,
                                                                use_safetensors=True, local_files_only=True,
                                                                return_lora_metadata=True)
        if not all("lora" in key for key in state_dict):
            raise ValueError("is no LoRA checkpoint (not every tensor has 'lora' in its name)")
        self.reads += 1
        if self.slots is not None:
            adapter = self.slots.read(state_dict, metadata, name=name)
            self._slotted[name] = adapter
            size = adapter.bytes
            with self._lock:
                self._loaded[name] = (size, signature)
            log.info("adapter %r read for the slots (%d bytes)", name, size)
            return
        done = []
        try:
            for prefix, part in self.parts.items():
                own = {key: value for key, value in state_dict.items() if key.startswith(f"{prefix}.")}
                if own:
                    with adding_layers(part, own) as own:  # a sharded part: the adapter whole on every rank
                        part.load_lora_adapter(own, adapter_name=name, prefix=prefix, metadata=metadata,
                                               low_cpu_mem_usage=_LOW_CPU_MEM_USAGE_DEFAULT_LORA)
                    done.append(part)
        except BaseException:
            for part in done:
                with adding_layers(part):
                    part.delete_adapters(name)
            raise
        if not done:
            raise ValueError(f"has no tensors for {', '.join(self.parts)}: it matches no module of the loaded model")
        pattern = re.compile(rf"\.(lora|lokr)_\w+\.{re.escape(name)}(\.|$)")
        size = sum(p.numel() * p.element_size() for part in done for key, p in part.named_parameters()
                   if pattern.search(key))
        with self._lock:
            self._loaded[name] = (size, signature)
        log.info("adapter %r loaded (%d bytes; %d bytes of adapters loaded)", name, size,
                 sum(s for s, _ in self._loaded.values()))


STAGE_2_KINDS = frozenset({"refine", "refine_window"})
"""The plan passes that are stage 2 of two-stage generation (``models.common.stages``, ``models.common.windows``)."""


def pass_loras(loras: Sequence[LoraWeight], stage_2: Sequence[LoraWeight], *, kind: str) -> tuple[LoraWeight, ...]:
    """The adapters a pass of ``kind`` applies: the request's ``loras``; in stage 2 (``STAGE_2_KINDS``) followed by
    the operator's ``stage_2`` adapters (a name in both takes its stage-2 scale)."""
    if kind not in STAGE_2_KINDS or not stage_2:
        return tuple(loras)
    names = {lora.name for lora in stage_2}
    return tuple(lora for lora in loras if lora.name not in names) + tuple(stage_2)


def check_stage_2(loras: Sequence[LoraWeight], stage_2: Sequence[LoraWeight], *, stages: int) -> None:
    """``ValueError`` naming ``loras`` when a two-stage request's stage 2 would apply more than ``MAX_LORAS``."""
    if stages == 2 and len(pass_loras(loras, stage_2, kind="refine")) > MAX_LORAS:
        own = [lora.name for lora in loras if lora.name not in {s.name for s in stage_2}]
        raise ValueError(f"loras names {len(own)} adapters and stage 2 also applies the server's stage-2 adapter(s) "
                         f"{', '.join(s.name for s in stage_2)}: with stages=2 name at most "
                         f"{MAX_LORAS - len(stage_2)}, or use stages=1")


def apply_loras(loaded: LoadedLoras | None, loras: Sequence[LoraWeight], *, kind: str = "denoise") -> None:
    """A pass's adapters made active (:meth:`LoadedLoras.activate` of :func:`pass_loras`); ``loaded`` ``None`` (no
    adapter directory): only a pass without adapters runs."""
    if loaded is not None:
        loaded.activate(pass_loras(loras, loaded.stage_2, kind=kind))
    elif loras:
        raise ValueError("loras: this deployment has no adapters (it was started without "
                         "--lora-dir DIR, a folder of .safetensors adapters); leave loras out")
