"""Step caches that every rank decides the same way: First-Block Cache and TaylorSeer over a transformer's blocks.

A step cache runs less of the transformer on some steps: First-Block Cache (diffusers' ``FirstBlockCacheConfig``)
runs the first block and, when its residual changed little since the last step that ran every block, adds the
cached residual of the other blocks instead of running them; TaylorSeer (``TaylorSeerCacheConfig``) runs every block
on a fixed schedule of steps and, on the others, extrapolates the last block's output from a Taylor series of it.

Invariants:
- A decision is the same on every rank that runs the context it is for, and it is the decision one rank takes given
  the same residual, bit for bit. First-Block Cache's metric is diffusers' ``mean|r - r_prev| / mean|r_prev|`` of the
  deciding stream's first-block residual ``r`` (``r_prev``: that of the last step that ran every block), over the real
  tokens only (each rank's padding rows are left out) and every pass of the context. Its two sums are taken in fixed
  point (:func:`fixed_point_sum`: every element truncated to 2**-32 and added as 64-bit integers), so the totals do not
  depend on how the sequence is sharded nor on how many ranks add them up; they are summed over exactly the ranks
  that hold the context: its Ulysses group, and where a context's passes are spread over guidance ranks, the
  replica's mesh, whose ranks that hold none of it add zeros. Never over the world: another replica's requests take
  no part. TaylorSeer decides from the step index alone.
- One state per context (a guidance context as diffusers' pipelines name them, e.g. ``cond_uncond``) per
  :class:`StepCache`, and a model makes a StepCache per pass of a plan (``DenoiseModel.prepare``): every request,
  window and stage starts afresh.
- Every rank runs the same collectives in the same order: a context held by one guidance rank reduces over that
  rank's Ulysses group inside its call (its peers run the same calls); a context spread over guidance ranks reduces
  over the mesh, its holders inside their calls and every other rank of the mesh joining with zeros (the contexts
  are visited in one order on every rank: before a rank's next call, and at the step's end, :meth:`StepCache.end_step`).
  What a step saved (:meth:`StepCache.step_stats`) is agreed, for First-Block Cache where the guidance ranks hold
  different contexts, with one maximum over the replica's CPU group (each context's holders report its decision, the
  others 0); TaylorSeer's is the schedule's. With weights sharded over the replica group (``cp_infer.weights``), a
  First-Block call whose context some guidance rank does not hold joins the all-gathers of the blocks it skips
  (a peer deciding for another context may run them); where every rank decides alike nothing is joined.
- The cache is applied from outside: :func:`cache_blocks` swaps a transformer's block list for a
  :class:`CachedBlocks` over the same modules (the state dict's keys and the blocks' own forwards unchanged, compiled
  or not), which yields the blocks to the transformer's own loop, or fewer of them, as the call in flight decides.
  With no call in flight it yields every block: the transformer is exactly its uncached self.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .collectives import all_reduce_max_ints
from .mesh import pass_shares
from .options import Option
from .state import ParallelState
from .weights import join_blocks

__all__ = ["CACHE_KINDS", "CACHE_OPTIONS", "CacheConfig", "CacheContext", "CacheStats", "CachedBlocks", "Decision",
           "StepCache", "cache_blocks", "cache_options", "fixed_point_sum"]

CACHE_KINDS = ("none", "first_block", "taylorseer")
CACHE_OPTIONS = ("cache", "cache_threshold", "cache_interval", "disable_cache_before_step", "max_order")
"""The request options of the step cache (:func:`cache_options`), which a model that has one declares."""

_FRACTION = 2.0**32
_MAX_EXACT = 2.0**31
"""Elements at or above this (and NaN, inf) are not summed but counted: a step with one computes every block."""
_CHUNK = 1 << 22


def cache_options(*, model: str, kinds: tuple[str, ...] = CACHE_KINDS) -> tuple[Option, ...]:
    """The step cache's request options (:data:`CACHE_OPTIONS`), named as diffusers' ``FirstBlockCacheConfig``
    (``threshold``, here ``cache_threshold``) and ``TaylorSeerCacheConfig`` name them, with their defaults, for a
    model to declare (``model``: its name, for messages). ``kinds``: the caches the model can honour (``none``
    first); another is refused, naming ``cache``."""

    def check(value: str) -> None:
        if value not in kinds:
            raise ValueError(f"cache={value!r} is not a step cache of {model} models; use one of {', '.join(kinds)}")

    return (
        Option("cache", str, "none", f"step cache: {', '.join(kinds)}. first_block runs the first transformer block "
               "and reuses the other blocks' cached residual on steps where its residual changed by at most "
               "cache_threshold (diffusers' First-Block Cache); taylorseer runs every block on a schedule and "
               "extrapolates the output between (diffusers' TaylorSeer); none runs every block", check=check),
        Option("cache_threshold", float, 0.05, "first_block: the largest relative change of the first block's residual "
               "(mean |r - r_prev| / mean |r_prev|) whose step reuses the cache; higher skips more", lo=0, hi=1),
        Option("cache_interval", int, 5, "taylorseer: steps between two that run every block, after the warm-up",
               lo=1, limit="max_steps", when=("cache", ("taylorseer",))),
        Option("disable_cache_before_step", int, 3, "taylorseer: the first steps, which all run every block",
               lo=1, limit="max_steps", when=("cache", ("taylorseer",))),
        Option("max_order", int, 1, "taylorseer: the order of the Taylor series the output is extrapolated with",
               lo=0, hi=4),
    )


@dataclass(frozen=True)
class CacheConfig:
    """A request's step cache, in diffusers' names (``FirstBlockCacheConfig``, ``TaylorSeerCacheConfig``)."""

    kind: str = "none"
    """``none``, ``first_block`` or ``taylorseer``."""
    threshold: float = 0.05
    """First-Block Cache: the steps whose metric is at most this reuse the cached tail."""
    cache_interval: int = 5
    """TaylorSeer: steps between two that run every block, after the warm-up."""
    disable_cache_before_step: int = 3
    """TaylorSeer: the first steps, which all run every block (at least 1: a prediction needs one)."""
    max_order: int = 1
    """TaylorSeer: the Taylor series' order."""

    def __post_init__(self) -> None:
        if self.kind not in CACHE_KINDS:
            raise ValueError(f"cache={self.kind!r} is not a step cache; use one of {', '.join(CACHE_KINDS)}")
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"cache_threshold={self.threshold} must be a finite number >= 0")
        for name, lo in (("cache_interval", 1), ("disable_cache_before_step", 1), ("max_order", 0)):
            if getattr(self, name) < lo:
                raise ValueError(f"{name}={getattr(self, name)} must be >= {lo}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> CacheConfig:
        """From a resolved request's options (``cache``, ``cache_threshold``, ``cache_interval``,
        ``disable_cache_before_step``, ``max_order``: those the model declares; the rest keep their defaults)."""
        names = {"cache": "kind", "cache_threshold": "threshold", "cache_interval": "cache_interval",
                 "disable_cache_before_step": "disable_cache_before_step", "max_order": "max_order"}
        return cls(**{field_: options[name] for name, field_ in names.items() if options.get(name) is not None})

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    def computes(self, step: int) -> bool | None:
        """TaylorSeer's schedule (``TaylorSeerCacheHook._measure_should_compute``): whether ``step`` runs every block;
        ``None`` for First-Block Cache, which decides from the residual."""
        if self.kind != "taylorseer":
            return None
        before = self.disable_cache_before_step
        return step < before or (step - before - 1) % self.cache_interval == 0


@dataclass(frozen=True)
class CacheContext:
    """A guidance context: a call of the transformer that keeps its own cache state from step to step (diffusers'
    ``cache_context(name)``), and the step's passes it runs (indices into the passes ``cp_infer.mesh.pass_shares``
    spreads over the guidance ranks)."""

    name: str
    passes: tuple[int, ...]


@dataclass(frozen=True)
class Decision:
    """One entry of a cache's trace: what a context's call at ``step`` did."""

    step: int
    context: str
    compute: bool
    """True: every block ran; False: the cached tail (First-Block Cache) or the prediction (TaylorSeer) was used."""
    metric: float | None = None
    """First-Block Cache: the agreed metric (``None`` on a context's first step, or where an element was not
    finite: both compute); TaylorSeer: ``None``."""


@dataclass(frozen=True)
class CacheStats:
    """What a request's step cache saved so far."""

    steps_computed: int = 0
    """Steps on which some context ran every block."""
    steps_skipped: int = 0
    """Steps on which every context used its cache."""
    blocks_saved: int = 0
    """Transformer block evaluations not run, one per block and pass (a batch of two passes through a block counts
    two)."""

    def __add__(self, other: CacheStats) -> CacheStats:
        return CacheStats(self.steps_computed + other.steps_computed, self.steps_skipped + other.steps_skipped,
                          self.blocks_saved + other.blocks_saved)


def fixed_point_sum(x: torch.Tensor) -> torch.Tensor:
    """int64 ``[3]``: the sum of ``|x|`` in fixed point, its integer part and its fraction in units of 2**-32, and
    the count of elements left out (not finite, or >= 2**31).

    Every element is truncated to a multiple of 2**-32 on its own and the parts are added as integers, which is exact:
    the total is the same however the elements are split over ranks and in whatever order the parts are added.
    NOTE(exact): in float32, ``a - floor(a)`` and the scaling by 2**32 are exact, and ``floor`` of a float32 is; both
    parts' sums stay below 2**63 for up to 2**31 elements (each part is below 2**32).
    NOTE(memory): taken ``_CHUNK`` elements at a time, so the float32 and int64 temporaries stay small beside the
    residual (an exact sum: chunking changes nothing)."""
    total = torch.zeros(3, dtype=torch.int64, device=x.device)
    for chunk in x.detach().reshape(-1).split(_CHUNK):
        a = chunk.abs().float()
        bad = ~(a < _MAX_EXACT)  # NaN compares False: counted
        a = a.masked_fill(bad, 0.0)
        whole = a.floor()
        fraction = ((a - whole) * _FRACTION).floor()
        total += torch.stack([whole.to(torch.int64).sum(), fraction.to(torch.int64).sum(), bad.sum()])
    return total


def _total(parts: Sequence[int]) -> int:
    """A :func:`fixed_point_sum`'s value in units of 2**-32 (a Python integer: exact)."""
    return int(parts[0]) * int(_FRACTION) + int(parts[1])


def _metric(sums: torch.Tensor) -> float | None:
    """``sum|r - r_prev| / sum|r_prev|`` from the reduced ``[6]`` sums (read on the host, wherever they are: the
    decision is the host's control flow); ``None`` where an element was left out or the previous residual is all
    zeros (the step computes)."""
    diff, prev = sums[:3].tolist(), sums[3:].tolist()
    if diff[2] or prev[2] or _total(prev) == 0:
        return None
    return _total(diff) / _total(prev)  # true division of two integers: correctly rounded, the same everywhere


class CachedBlocks(torch.nn.ModuleList):
    """A transformer's blocks, iterated through the cache call in flight (:meth:`StepCache.call`); with none, every
    block as it is. ``streams``: the keyword arguments of a block's token streams, in the order its output tuple
    returns them (one stream: the block returns a tensor); a block called with positional arguments takes them first,
    in that order."""

    def __init__(self, blocks: Sequence[torch.nn.Module] = (), *, streams: tuple[str, ...] = ("hidden_states",)):
        super().__init__(blocks)
        self.streams = streams
        self._in_flight: _Call | None = None

    def __iter__(self) -> Iterator[Callable[..., Any]]:
        blocks = list(super().__iter__())
        call = self._in_flight
        return iter(blocks) if call is None else call.run(blocks)


def cache_blocks(module: torch.nn.Module, *, streams: tuple[str, ...], name: str = "transformer_blocks"
                 ) -> CachedBlocks:
    """Swap ``module.<name>`` for a :class:`CachedBlocks` over the same blocks (the same state-dict keys); returns it.
    Idempotent."""
    blocks = getattr(module, name)
    if isinstance(blocks, CachedBlocks):
        return blocks
    cached = CachedBlocks(list(blocks), streams=streams)
    setattr(module, name, cached)
    return cached


@dataclass
class _ContextState:
    """One context's cache state on this rank: its own shards of its own passes' tensors."""

    head_output: tuple[torch.Tensor, ...] | None = None
    head_residual: torch.Tensor | None = None
    """The deciding stream's first-block residual at the last step that ran every block."""
    tail: tuple[torch.Tensor, ...] | None = None
    """Every stream's residual of the blocks after the first at that step."""
    factors: tuple[dict[int, torch.Tensor], ...] = ()
    """TaylorSeer: per stream, the last block's output and its divided differences by order."""
    last_update: int | None = None
    dtypes: tuple[torch.dtype, ...] = ()


@dataclass(frozen=True)
class _Held:
    """A context as this rank sees it: who holds its passes, and how many of them this rank runs."""

    context: CacheContext
    holders: tuple[int, ...]
    """The guidance ranks whose share of the step's passes includes some of this context's."""
    rows: int
    """This rank's passes of the context (0: held by other guidance ranks)."""

    @property
    def spread(self) -> bool:
        return len(self.holders) > 1


class StepCache:
    """The step cache of one pass of a plan: one state per guidance context, the trace of its decisions and what it
    saved. Made by the model for every pass (the same on every rank); its calls and :meth:`end_step` run the
    collectives the module docstring lists."""

    def __init__(self, config: CacheConfig, *, state: ParallelState, contexts: Sequence[CacheContext], passes: int,
                 layers: int, decides: int = 0):
        """``passes``: the step's passes spread over the guidance ranks; ``layers``: the transformer's blocks;
        ``decides``: the index (in ``CachedBlocks.streams``) of the stream whose residual decides."""
        if not config.enabled:
            raise ValueError("a StepCache needs a cache: cache='none' runs every block")
        if config.kind == "first_block" and layers < 2:
            raise ValueError(f"cache='first_block' needs at least 2 transformer blocks, this model has {layers}; "
                             "use cache='none'")
        self.config, self.state, self.layers, self.decides = config, state, layers, decides
        shares = pass_shares(passes, state.guidance_size)
        mine = set(shares[state.guidance_rank])
        self._held: dict[str, _Held] = {}
        for context in contexts:
            holders = tuple(g for g, share in enumerate(shares) if set(share) & set(context.passes))
            self._held[context.name] = _Held(context, holders, len(mine & set(context.passes)))
        assert sorted(p for c in contexts for p in c.passes) == list(range(passes)), "contexts partition the passes"
        self._states = {name: _ContextState() for name in self._held}
        self.step = 0
        self.trace: list[Decision] = []
        self._visited: set[str] = set()
        self._step_decisions: dict[str, bool] = {}

    # --- the calls -----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def call(self, blocks: CachedBlocks, context: str, *, valid: int | Callable[[], int]) -> Iterator[None]:
        """The transformer's forward inside this block runs ``context``'s passes held by this rank through the cache;
        ``valid``: this rank's real (unpadded) tokens of the deciding stream, or a function that says it once the
        blocks run (a model that shards the sequence inside its forward)."""
        held = self._held[context]
        assert held.rows, f"guidance rank {self.state.guidance_rank} holds no pass of {context!r}"
        assert context not in self._visited, f"{context!r} was called twice in step {self.step}"
        self._join_before(context)
        assert blocks._in_flight is None, "a cache call is already in flight"
        blocks._in_flight = _Call(self, held, valid=valid, streams=blocks.streams)
        try:
            yield
        finally:
            blocks._in_flight = None
        self._visited.add(context)

    def end_step(self) -> None:
        """The step's calls are done: join every context spread over guidance ranks that this rank held none of (in
        order), and go on to the next step. Every rank calls it once per step, after its calls."""
        self._join_before(None)
        self.step += 1
        self._visited.clear()

    def _join_before(self, context: str | None) -> None:
        """Join, with zeros, the mesh reductions of the contexts before ``context`` (all, for ``None``) that this
        rank holds none of and that a reduction is run for."""
        for name, held in self._held.items():
            if name == context:
                return
            if name in self._visited:
                continue
            assert held.rows == 0, f"{name!r} is held here and was not called before {context!r}"
            self._visited.add(name)
            if held.spread and self._reduces(self.step):
                self._reduce(torch.zeros(6, dtype=torch.int64, device=self.state.device), held)

    def _reduces(self, step: int) -> bool:
        """Whether a step's decision takes a reduction: First-Block Cache's from its second step on."""
        return self.config.kind == "first_block" and step > 0

    def _reduce(self, sums: torch.Tensor, held: _Held) -> torch.Tensor:
        # NOTE(group): the ranks that hold the context and no other: its Ulysses group, or, spread over guidance
        # ranks, the replica's mesh (whose other ranks add zeros). Never a group that spans replicas.
        group = self.state.mesh_group if held.spread else self.state.cp_group
        if group is not None:
            dist.all_reduce(sums, group=group)
        return sums

    # --- what the calls record -----------------------------------------------------------------------------------

    def _record(self, held: _Held, compute: bool, metric: float | None) -> None:
        self.trace.append(Decision(self.step, held.context.name, compute, metric))
        self._step_decisions[held.context.name] = compute

    def step_stats(self) -> CacheStats:
        """What the step just ended saved, the same on every rank (First-Block Cache: a collective over the replica's
        CPU group where the guidance ranks hold different contexts). Every rank calls it once per step, after
        :meth:`end_step`."""
        # 0: not held here; 1: every block ran; 2: the cache was used. Every holder of a context saw the same decision.
        codes = [0 if name not in self._step_decisions else 1 if self._step_decisions[name] else 2
                 for name in self._held]
        if self.config.kind == "taylorseer":  # the schedule: the same decision for every context, known everywhere
            codes = [1 if self.config.computes(self.step - 1) else 2] * len(codes)
        elif any(len(held.holders) < self.state.guidance_size for held in self._held.values()):
            codes = all_reduce_max_ints(codes, state=self.state)
        self._step_decisions.clear()
        assert all(codes), f"a context's decision reached no rank: {codes}"
        skipped_layers = self.layers - 1 if self.config.kind == "first_block" else self.layers
        held = self._held.values()
        saved = sum(skipped_layers * len(h.context.passes) for h, code in zip(held, codes, strict=True) if code == 2)
        skipped = all(code == 2 for code in codes)
        return CacheStats(steps_computed=int(not skipped), steps_skipped=int(skipped), blocks_saved=saved)


@dataclass
class _Call:
    """One call of the transformer through a :class:`StepCache` (``StepCache.call``)."""

    cache: StepCache
    held: _Held
    valid: int | Callable[[], int]
    streams: tuple[str, ...]
    _skip: bool = field(default=False)

    @property
    def _state(self) -> _ContextState:
        return self.cache._states[self.held.context.name]

    def run(self, blocks: list[torch.nn.Module]) -> Iterator[Callable[..., Any]]:
        if self.cache.config.kind == "first_block":
            return self._first_block(blocks)
        return self._taylorseer(blocks)

    def _inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
        """The streams a block is called with: by name, or as its first positional arguments."""
        if args:
            return tuple(args[:len(self.streams)])
        return tuple(kwargs[name] for name in self.streams)

    def _pack(self, outputs: tuple[torch.Tensor, ...]) -> Any:
        return outputs if len(self.streams) > 1 else outputs[0]

    @staticmethod
    def _unpack(output: Any) -> tuple[torch.Tensor, ...]:
        return tuple(output) if isinstance(output, (tuple, list)) else (output,)

    # First-Block Cache: diffusers' FBCHeadBlockHook and FBCBlockHook, the same operations in the same order.

    def _first_block(self, blocks: list[torch.nn.Module]) -> Iterator[Callable[..., Any]]:
        head, *middle, last = blocks

        def head_block(*args: Any, **kwargs: Any) -> Any:
            inputs = self._inputs(args, kwargs)
            output = head(*args, **kwargs)
            outputs = self._unpack(output)
            d = self.cache.decides
            residual = outputs[d] - inputs[d]
            if self._decide(residual):
                self._state.head_output, self._state.head_residual = outputs, residual
                return output
            self._skip = True
            return self._pack(tuple(tail + out for tail, out in zip(self._state.tail, outputs, strict=True)))

        def last_block(*args: Any, **kwargs: Any) -> Any:
            output = last(*args, **kwargs)
            outputs = self._unpack(output)
            self._state.tail = tuple(out - h for out, h in zip(outputs, self._state.head_output, strict=True))
            return output

        yield head_block
        if self._skip:
            if not self._decided_everywhere:
                join_blocks([*middle, last])  # NOTE(sharded-weights): a peer with another context may run them
            return  # the head's output already holds the cached tail: the transformer's loop ends here
        yield from middle
        yield last_block

    @property
    def _decided_everywhere(self) -> bool:
        """Every rank of the replica group takes this call's decision in the same call (its context is held by every
        guidance rank, or there is one): none of them runs blocks this call skips. Otherwise, with weights sharded
        over the replica group (``cp_infer.weights``), the blocks a call skips are joined: their all-gathers run."""
        return len(self.held.holders) == self.cache.state.guidance_size

    def _decide(self, residual: torch.Tensor) -> bool:
        cache, state = self.cache, self._state
        if state.head_residual is None:  # the context's first step (no reduction on any rank: StepCache._reduces)
            cache._record(self.held, True, None)
            return True
        # B_LOCAL, S_LOCAL, C -> the real tokens of every pass this rank holds (padding rows carry no meaning)
        valid = self.valid() if callable(self.valid) else self.valid
        diff = (residual - state.head_residual)[:, :valid]
        prev = state.head_residual[:, :valid]
        sums = cache._reduce(torch.cat([fixed_point_sum(diff), fixed_point_sum(prev)]), self.held)
        metric = _metric(sums)
        compute = metric is None or metric > cache.config.threshold
        cache._record(self.held, compute, metric)
        return compute

    # TaylorSeer: diffusers' TaylorSeerState on the last block (the transformer's output is its prediction).

    def _taylorseer(self, blocks: list[torch.nn.Module]) -> Iterator[Callable[..., Any]]:
        cache, state = self.cache, self._state
        step = cache.step
        if cache.config.computes(step):
            cache._record(self.held, True, None)
            *rest, last = blocks

            def last_block(*args: Any, **kwargs: Any) -> Any:
                output = last(*args, **kwargs)
                self._update(self._unpack(output), step)
                return output

            yield from rest
            yield last_block
            return
        cache._record(self.held, False, None)
        assert state.last_update is not None, "TaylorSeer predicts only after a step that ran every block"
        # NOTE(sharded-weights): the schedule is every context's, so every rank skips the same blocks: none to join.
        yield lambda *args, **kwargs: self._pack(self._predict(step))

    def _update(self, outputs: tuple[torch.Tensor, ...], step: int) -> None:
        """``TaylorSeerState.update``, the factors kept in the outputs' own dtype."""
        state = self._state
        state.dtypes = tuple(o.dtype for o in outputs)
        factors = []
        for i, features in enumerate(outputs):
            new: dict[int, torch.Tensor] = {0: features}
            if state.last_update is not None:
                delta = step - state.last_update
                previous = state.factors[i]
                for j in range(self.cache.config.max_order):
                    prev = previous.get(j)
                    if prev is None or prev.shape != new[j].shape:
                        break
                    new[j + 1] = (new[j] - prev.to(features.dtype)) / delta
            factors.append({order: f.to(features.dtype) for order, f in new.items()})
        state.factors, state.last_update = tuple(factors), step

    def _predict(self, step: int) -> tuple[torch.Tensor, ...]:
        """``TaylorSeerState.predict``: the same operations in the same order (its zeros first: ``0 + -0.0`` is
        ``+0.0``, as there)."""
        state = self._state
        offset = step - state.last_update
        outputs = []
        for dtype, factors in zip(state.dtypes, state.factors, strict=True):
            output = torch.zeros_like(factors[0], dtype=dtype)
            for order in range(len(factors)):
                output = output + factors[order].to(dtype) * ((offset**order) / math.factorial(order))
            outputs.append(output)
        return tuple(outputs)
