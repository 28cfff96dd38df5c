"""What both adapters share of the engine's step cache (``cp_infer.step_cache``): a pass's cache from its request,
and a transformer call through it.

Invariants:
- A pass's cache is made in its ``prepare`` (``pass_cache``), so every request, window and stage starts afresh; a
  request with ``cache="none"`` has none, and its transformer runs exactly as uncached.
- A model's contexts are diffusers' pipelines' ``cache_context`` names, their passes the step's passes in the order
  the guidance ranks share them (``cp_infer.mesh.pass_shares``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

from cp_infer.request import GenerationRequest
from cp_infer.shard import ShardPlan
from cp_infer.state import ParallelState
from cp_infer.step_cache import CacheConfig, CacheContext, CachedBlocks, CacheStats, StepCache

__all__ = ["PASS_CONTEXTS", "cached_call", "pass_cache", "pass_cache_stats", "pass_contexts"]

PASS_CONTEXTS = ("cond", "uncond")
"""The contexts of pipelines that run CFG's passes one call each (``WanPipeline``, ``HeliosPipeline``), in pass
order: ``PASS_CONTEXTS[p]`` is pass ``p``'s."""


def pass_contexts(passes: int) -> tuple[CacheContext, ...]:
    """A step of ``passes`` such calls (1: the conditional alone; 2: with CFG's unconditional) as cache contexts, a
    pass each."""
    return tuple(CacheContext(name, (p,)) for p, name in enumerate(PASS_CONTEXTS[:passes]))


def pass_cache(request: GenerationRequest, *, state: ParallelState, contexts: Sequence[CacheContext], layers: int,
               decides: int = 0) -> StepCache | None:
    """The step cache of one pass of ``request`` (resolved), ``None`` for ``cache="none"``."""
    config = CacheConfig.from_options(request.options)
    if not config.enabled:
        return None
    passes = sum(len(c.passes) for c in contexts)
    return StepCache(config, state=state, contexts=contexts, passes=passes, layers=layers, decides=decides)


@contextlib.contextmanager
def cached_call(cache: StepCache | None, blocks: CachedBlocks, context: str, plan: ShardPlan | None, rank: int,
                *, valid: Callable[[], int] | None = None) -> Iterator[None]:
    """The transformer call inside this block through ``cache`` (none: as it is), deciding from the real tokens of
    ``plan``'s stream on ``rank``; or, for a model that shards the blocks' sequence inside its forward, of what
    ``valid`` says once the blocks run."""
    if cache is None:
        yield
        return
    with cache.call(blocks, context, valid=plan.valid_len(rank) if valid is None else valid):
        yield


def pass_cache_stats(cache: StepCache | None) -> CacheStats | None:
    """``DenoiseModel.cache_stats``: what the step just ended saved (``None``: the pass has no cache)."""
    return None if cache is None else cache.step_stats()
