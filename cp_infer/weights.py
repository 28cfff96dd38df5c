"""One module's weights across a replica group: torch's FSDP2 per block, loaded a shard at a time.

Invariants:
- A sharded module's parameters are DTensors sharded on dim 0 (FSDP2's ``Shard(0)``: ``torch.chunk`` rows, the
  last ranks the shorter) over its replica group's ranks, the guidance x Ulysses ranks of one replica, on a device
  group of their own (:func:`replica_mesh`). Each block is one FSDP unit and the module's other parameters one more
  (the root); a unit is all-gathered in its forward and freed after it (``reshard_after_forward=True``, the root
  too), and every unit's pre-forward issues the next one's all-gather (FSDP2's explicit forward prefetch,
  ``set_modules_to_forward_prefetch``: root -> block 0 -> block 1 ...), so a rank holds at most the root and two
  blocks whole. Gathered weights are the loaded bits (an all-gather moves bytes): a forward equals the replicated
  module's, bit for bit.
- Every rank of a replica group issues the same all-gathers in the same order. A forward call's are the root's,
  then block 0's, ..., block L-1's. A rank that runs fewer calls than a peer (a guidance rank with fewer passes)
  joins each missing one with :func:`join_call`; a call that runs fewer blocks (a step cache's skip) joins the
  blocks it skipped with :func:`join_blocks`: all-gathers and frees, no compute. A rank that takes part in no
  forward at all therefore still takes part in every all-gather.
- Loading reads this rank's rows only (:func:`load_shards`): the module is built with its parameters on the meta
  device (:func:`meta_parameters`), sharded, given uninitialised storage for its shards, and each shard is filled
  from the safetensors files with ``safe_open(...).get_slice`` (rows ``[start, stop)`` of dim 0). A rank never
  holds a whole parameter it does not own, at load or after. Every rank of the world agrees on the outcome
  (:func:`agree_on_load`): a rank that could not read its shard fails every rank with its message, and none waits
  in a collective for it.
- What a rank's forwards gather and free goes back to the OS: on the CPU, where the gathers are host memory, glibc's
  mmap threshold is fixed (NOTE(malloc) in :func:`_unmap_freed_gathers`), so a rank holds its shards and at most the
  root and two blocks whole, not its shards plus every block it has gathered; on CUDA the load's leftovers in torch's
  cache are released after it.
- Layers added to a sharded module after :func:`shard_module` (a LoRA adapter's, :func:`adding_layers`) are no part
  of any FSDP unit: FSDP2 fixed its units' parameters when it sharded them, so the new ones stay whole on every rank,
  on the device forwards run on, and never take part in an all-gather. The base weights stay sharded.
- An unsharded module (or a group of one rank) is left as it is: every function here is then a no-op.

NOTE(inference-mode): FSDP2 keeps its all-gather buffers from one forward to the next; made under
``torch.inference_mode()`` (the sampler runs every forward there) they are inference tensors, which a later forward
outside it may not write into. Run a sharded module's forwards under inference mode, as the sampler does.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .mesh import MeshLayout
from .placement import shard_rows
from .state import ParallelState

__all__ = [
    "SafetensorsFiles",
    "ShardedWeights",
    "WeightsLoadError",
    "adding_layers",
    "agree_on_load",
    "join_blocks",
    "join_call",
    "load_agreed",
    "load_shards",
    "meta_parameters",
    "replica_mesh",
    "shard_module",
    "sharded_weights",
]

_HANDLE = "_cp_infer_weights"
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
T = TypeVar("T")


class WeightsLoadError(ValueError):
    """A shard that could not be read (a missing, short or mismatched file); the message names it."""


def replica_mesh(state: ParallelState) -> DeviceMesh | None:
    """A 1-D device mesh over this rank's replica group (its guidance x Ulysses ranks), on a device process group of
    its own, so that no all-gather queues behind the Ulysses all-to-alls; ``None`` for a replica of one rank.

    NOTE(groups): every rank of the world creates every replica's group, in replica order, as ``init_parallel``
    creates its groups: call it on every rank, at the same point."""
    layout = MeshLayout(world=state.world_size, guidance=state.guidance_size, ulysses=state.ulysses_size,
                        ring=state.ring_size)
    if layout.replica_size == 1:
        return None
    timeout = datetime.timedelta(seconds=state.timeout_s)
    mine = None
    for replica in range(layout.replicas):
        group = dist.new_group(list(layout.replica_ranks(replica)), backend=state.backend, timeout=timeout)
        if replica == state.replica:
            mine = group
    return DeviceMesh.from_group(mine, state.device.type)


@dataclass(frozen=True)
class ShardedWeights:
    """How a module is sharded (kept on the module: :func:`sharded_weights`)."""

    mesh: DeviceMesh
    blocks: tuple[nn.Module, ...]
    """The FSDP units a forward runs after the root, in order (the prefetch chain)."""
    idle: tuple[nn.Module, ...] = ()
    """Units sharded on their own that a forward never runs (never gathered, never prefetched)."""
    offload: bool = False
    """The shards live on the CPU (FSDP2's ``CPUOffloadPolicy``) and are copied to the device by each all-gather."""

    @property
    def world(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()


def sharded_weights(module: nn.Module) -> ShardedWeights | None:
    """The sharding of ``module`` (:func:`shard_module`), or ``None`` when it is not sharded."""
    return getattr(module, _HANDLE, None)


def shard_module(module: nn.Module, blocks: Sequence[nn.Module], *, mesh: DeviceMesh,
                 idle: Sequence[nn.Module] = (), offload: bool = False, pin_memory: bool = False) -> ShardedWeights:
    """``fully_shard`` each of ``blocks`` (the units a forward runs, in order) and ``idle`` (units it never runs),
    then ``module`` itself (the root: every parameter not in a unit), each resharded after its forward; chain the
    forward prefetch root -> blocks[0] -> blocks[1] ...; ``offload``: the shards stay on the CPU (pinned with
    ``pin_memory``). Call it on a module whose parameters are on the meta device, then :func:`load_shards`."""
    policy = CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy()
    if mesh.device_type == "cpu":
        _unmap_freed_gathers()
    # FSDP2 cannot shard a 0-d parameter (a gain): it stays whole on every rank, read as it is.
    scalars = {p for p in module.parameters() if p.dim() == 0}
    for unit in (*blocks, *idle):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True, offload_policy=policy, ignored_params=scalars)
    # NOTE(root-reshard): an explicit True, not the default None, which keeps the root gathered after forward (for a
    # backward that inference never runs).
    fully_shard(module, mesh=mesh, reshard_after_forward=True, offload_policy=policy, ignored_params=scalars)
    chain = [module, *blocks]
    for unit, following in zip(chain, chain[1:], strict=False):
        unit.set_modules_to_forward_prefetch([following])
    if mesh.device_type == "cpu":
        # NOTE(gloo-prefetch): on CUDA an all-gather runs on FSDP's own stream, so a prefetch overlaps the unit's
        # compute; on the CPU a synchronous gloo all-gather would block the thread that computes. Asynchronous
        # all-gathers run on gloo's threads and are waited for in the prefetched unit's pre-forward.
        module._set_unshard_async_op(True)
    # NOTE(iteration): FSDP2 records every unit's forward for a backward, and clears the record only in one; a
    # forward that begins clears what the last one left (and any state an aborted forward left).
    module.register_forward_pre_hook(lambda m, _args: m.reset_iter_state(), prepend=True)
    handle = ShardedWeights(mesh=mesh, blocks=tuple(blocks), idle=tuple(idle), offload=offload)
    object.__setattr__(module, _HANDLE, handle)
    return handle


_GATHER_MMAP_THRESHOLD = 1 << 20
"""glibc's mmap threshold in a process whose sharded modules gather in host memory (:func:`_unmap_freed_gathers`)."""


def _unmap_freed_gathers() -> bool:
    """Make freed gathered weights go back to the OS: glibc's mmap threshold fixed at
    :data:`_GATHER_MMAP_THRESHOLD` for this process; False where malloc is not glibc's.

    NOTE(malloc): each unit's forward allocates its parameters whole (FSDP2's all-gather) and frees them after it.
    glibc's default threshold is dynamic: every freed mmapped chunk raises it to that chunk's size (up to 32 MiB), so
    after the first block the gathered parameters (1-32 MiB each) come from the heap, whose freed chunks, fragmented
    by the small allocations in between, the process keeps: a sharded rank came to hold about the whole transformer
    again on top of its shard, from its first forward to its end. Fixed (which also stops the dynamic rule), every
    tensor of 1 MiB or more is mmapped and unmapped when freed, so a rank holds what it uses. On CUDA the gathers are
    the caching allocator's, which reuses them; this is for ranks whose device is the CPU."""
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_MMAP_THRESHOLD, _GATHER_MMAP_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False


@contextlib.contextmanager
def adding_layers(module: nn.Module, tensors: Mapping[str, torch.Tensor] | None = None
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """Layers added to (or removed from) ``module`` inside this block, as peft's adapter loader adds them, from
    ``tensors`` (what the block gets to make them of) stay whole on every rank, on the device its forwards run on
    (with ``offload`` the shards are on the CPU, and peft puts a new layer where its base layer's weight is). When
    ``module`` is not sharded the block runs as it is, given ``tensors`` unchanged.

    NOTE(inference-mode): ``state_dict()`` (peft's loader reads the module's) detaches every parameter, and detaching
    a DTensor under inference mode fails ("Cannot set version_counter for inference tensor"): the block runs outside
    inference mode (without grad). Tensors made under inference mode (a file read in the sampler's pass) cannot
    become parameters there: the block gets copies of those."""
    tensors = dict(tensors or {})
    handle = sharded_weights(module)
    if handle is None:
        yield tensors
        return
    with torch.inference_mode(False), torch.no_grad():
        yield {key: t.clone() if t.is_inference() else t for key, t in tensors.items()}
        if handle.offload:
            _onload_unsharded(module, fully_shard.state(module)._device)


def _onload_unsharded(module: nn.Module, device: torch.device) -> None:
    """Every tensor of ``module`` that is not a shard (buffers, 0-d parameters, adapters' layers) on ``device``."""
    for sub in module.modules():
        for table in (sub._buffers, sub._parameters):
            for t in table.values():
                if t is not None and not isinstance(t, DTensor) and t.device != device:
                    t.data = t.data.to(device)


def join_blocks(blocks: Sequence[nn.Module]) -> None:
    """The all-gathers of ``blocks`` (those of a call this rank skips and a peer may run), each freed at once."""
    for block in blocks:
        if isinstance(block, FSDPModule):
            block.unshard()
            block.reshard()


def join_call(module: nn.Module) -> None:
    """The all-gathers of one forward of ``module`` (root, then every block, in order) without its compute: a rank
    that runs fewer calls than its replica group's others joins each one it misses. No-op when not sharded."""
    handle = sharded_weights(module)
    if handle is None:
        return
    module.unshard()
    join_blocks(handle.blocks)
    module.reshard()


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Modules built inside this block get their parameters on the meta device (no memory; initialisers run on
    meta, which costs nothing) and their buffers where they are computed: a buffer that is not in the checkpoint
    (rotary frequencies) keeps its value (accelerate's ``init_empty_weights(include_buffers=False)``).

    NOTE(global): patches ``nn.Module.register_parameter`` for the whole process while it lasts; build nothing else
    meanwhile."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class SafetensorsFiles:
    """The safetensors weights of one folder: ``<name>.safetensors``, or the files ``<name>.safetensors.index.json``
    maps each key to."""

    def __init__(self, folder: str | Path, name: str):
        self.folder = Path(folder)
        index = self.folder / f"{name}.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {key: self.folder / file for key, file in weight_map.items()}
        else:
            single = self.folder / f"{name}.safetensors"
            if not single.is_file():
                raise WeightsLoadError(f"{self.folder} holds neither {single.name} nor {index.name}")
            self._single = single
            self.files = None

    def tensor_keys(self) -> list[str]:
        """Every tensor's key, from the index or the file's header."""
        if self.files is not None:
            return list(self.files)
        from safetensors import safe_open

        with safe_open(str(self._single), framework="pt", device="cpu") as handle:
            return list(handle.keys())

    @contextlib.contextmanager
    def reader(self) -> Iterator[_Reader]:
        """The files opened (each on first use) for the block's reads, closed after it (their pages unmapped)."""
        reader = _Reader(self)
        try:
            yield reader
        finally:
            reader.close()


class _Reader:
    def __init__(self, files: SafetensorsFiles):
        self._files = files
        self._open: dict[Path, contextlib.ExitStack] = {}
        self._handles: dict[Path, object] = {}
        self._keys: dict[Path, set[str]] = {}

    def _handle(self, key: str):
        from safetensors import safe_open

        files = self._files
        path = files._single if files.files is None else files.files.get(key)
        if path is None:
            raise WeightsLoadError(f"{key} is in none of the files of {files.folder}'s index")
        if path not in self._handles:
            stack = contextlib.ExitStack()
            self._handles[path] = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            self._open[path] = stack
            self._keys[path] = set(self._handles[path].keys())
        return self._handles[path], path

    def rows(self, key: str, shape: torch.Size, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``key``, which must have ``shape``."""
        handle, path = self._handle(key)
        if key not in self._keys[path]:
            raise WeightsLoadError(f"{path.name} in {self._files.folder} has no tensor {key!r}")
        piece = handle.get_slice(key)
        found = tuple(piece.get_shape())
        if found != tuple(shape):
            raise WeightsLoadError(f"{key!r} in {path.name} has shape {list(found)}, the model's is {list(shape)}")
        return piece[start:stop] if len(shape) else handle.get_tensor(key)

    def close(self) -> None:
        for stack in self._open.values():
            stack.close()
        self._open.clear()
        self._handles.clear()
        self._keys.clear()


def load_shards(module: nn.Module, files: SafetensorsFiles, *, device: torch.device,
                keys: Mapping[str, str] | None = None) -> None:
    """Fill ``module`` (built by :func:`meta_parameters`, sharded by :func:`shard_module` or not at all) from
    ``files``: each parameter's rows this rank holds, each persistent buffer whole; a buffer the files lack keeps
    the value it was built with. ``keys``: a parameter's or buffer's name -> its key in the files (default: the
    same). Values are cast to the module's dtype by the copy. Storage comes from ``module.to_empty(device=...)``
    (the CPU for an offloaded module)."""
    handle = sharded_weights(module)
    built = {name: b.detach().clone() for name, b in module.named_buffers() if b.device.type != "meta"}
    persistent = {f"{owner}.{name}".lstrip(".") for owner, sub in module.named_modules() for name in sub._buffers
                  if name not in sub._non_persistent_buffers_set}
    offload = handle is not None and handle.offload
    module.to_empty(device=torch.device("cpu") if offload else device)
    key_of = (lambda name: name) if keys is None else (lambda name: keys.get(name, name))
    units = [module] if handle is None else [*handle.blocks, *handle.idle, module]
    names = {id(m): name for name, m in module.named_modules()}
    done: set[str] = set()
    for unit in units:
        prefix = names[id(unit)] + "." if unit is not module else ""
        with files.reader() as reader, torch.no_grad():
            for local_name, param in unit.named_parameters():
                name = prefix + local_name
                if name in done:
                    continue  # a unit's parameters are also the root's: read once, from the unit's pass
                done.add(name)
                if isinstance(param, DTensor):
                    local = param.to_local()
                    start, stop = shard_rows(param.shape[0], handle.world, handle.rank)
                    if local.shape[0] != stop - start:
                        raise AssertionError(f"{name}: FSDP holds {local.shape[0]} rows here, expected {stop - start}")
                else:
                    local, start, stop = param, 0, param.shape[0] if param.dim() else 0
                local.copy_(reader.rows(key_of(name), param.shape, start, stop))
    with files.reader() as reader, torch.no_grad():
        for name, buffer in module.named_buffers():
            key = key_of(name)
            if name in persistent and _has(reader, key):
                buffer.copy_(reader.rows(key, buffer.shape, 0, buffer.shape[0] if buffer.dim() else 0))
            elif name in built:
                buffer.copy_(built[name])
            else:
                raise WeightsLoadError(f"the buffer {name!r} is in no file of {files.folder} and not computed")
    if offload:  # only the shards live on the CPU: buffers and unsharded (0-d) parameters are used where they are
        _onload_unsharded(module, device)
    if device.type == "cuda":
        # Whatever the load allocated and freed on the device stays reserved in torch's cache until reused: released
        # here, so that what a rank reserves after its load is what it holds (the plan's bytes).
        torch.cuda.empty_cache()
    if handle is not None:
        # NOTE(lazy-init): FSDP2 finds its root and shares its streams in the root's first forward; a rank that joins
        # all-gathers (join_call) before running any forward needs that done.
        fully_shard.state(module)._lazy_init()


def _has(reader: _Reader, key: str) -> bool:
    try:
        _, path = reader._handle(key)
    except WeightsLoadError:
        return False
    return key in reader._keys[path]


def load_agreed(load: Callable[[], T], *, state: ParallelState) -> T:
    """``load()`` on every rank of the world, then :func:`agree_on_load` on its outcome: its result where every
    rank's succeeded, else a :class:`WeightsLoadError` on every rank naming the first failure.

    NOTE(agree): whatever failed (a short file, a missing key, a shape), every rank hears of it before any goes on to
    a collective; the message travels, the exception's type does not."""
    result, error = None, None
    try:
        result = load()
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        error = str(exc) if isinstance(exc, WeightsLoadError) else f"{type(exc).__name__}: {lines[0] if lines else ''}"
    agree_on_load(error, state=state)
    return result


def agree_on_load(error: str | None, *, state: ParallelState) -> None:
    """Every rank of the world says whether it loaded its shards (``error``: what went wrong, or ``None``); when any
    did not, every rank raises :class:`WeightsLoadError` with the first failed rank's message. One collective over
    the world's gloo group (start-up only), so no rank waits in a later collective for a rank that stopped."""
    errors: list[str | None] = [error]
    if state.world_group is not None:
        errors = [None] * state.world_size
        dist.all_gather_object(errors, error, group=state.world_group)
    failed = [(rank, message) for rank, message in enumerate(errors) if message]
    if not failed:
        return
    rank, message = failed[0]
    if error:
        raise WeightsLoadError(error)
    raise WeightsLoadError(f"rank {rank} could not read its shard: {message}")
