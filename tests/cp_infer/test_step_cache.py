"""The step cache's decisions: fixed-point sums, TaylorSeer's schedule, and one decision trace on every layout.

The multi-rank cases run a toy transformer whose blocks are per token and elementwise (a multiply and adds: each
element one IEEE operation, whatever the shard), so a rank's block outputs are exactly the rows of one process's, and
the traces, metrics and outputs can be compared bit for bit: what differs between layouts is only how the sums are
split and reduced, which is what the fixed-point sums make exact. Garbage (large random values, different on every
rank) is written into every padding row.
"""

from __future__ import annotations

import random

import pytest
import torch

from cp_infer import ShardPlan, pass_shares, single_process_state
from cp_infer.step_cache import CacheConfig, CacheContext, StepCache, cache_blocks, fixed_point_sum

from ..worker_groups import SharedGroup

CHANNELS, LAYERS, STEPS = 6, 4, 9
TOKENS = {"hidden_states": 19, "audio_hidden_states": 7}  # per stream; divides none of 2, 3, 4
# LTX-Video's one context, LTX-2's three (CFG's pair, then STG, then modality isolation)
ONE = (CacheContext("cond_uncond", (0, 1)),)
THREE = (CacheContext("cond_uncond", (0, 1)), CacheContext("uncond_stg", (2,)), CacheContext("uncond_modality", (3,)))


def test_fixed_point_sum_is_exact_and_split_free(monkeypatch):
    from cp_infer import step_cache

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    x = torch.randn(3, 101, 5, generator=gen) * torch.logspace(-6, 3, 5)
    whole = fixed_point_sum(x)
    monkeypatch.setattr(step_cache, "_CHUNK", 7)  # taken a chunk at a time: the same integers
    assert torch.equal(fixed_point_sum(x[:, :50]) + fixed_point_sum(x[:, 50:]), whole)
    assert torch.equal(fixed_point_sum(x), whole)
    for _ in range(5):  # any split, any order of adding the parts: the same integers
        cuts = sorted(torch.randint(0, x.numel(), (4,), generator=gen).tolist())
        pieces = torch.tensor_split(x.flatten()[torch.randperm(x.numel(), generator=gen)], cuts)
        assert torch.equal(sum(fixed_point_sum(p) for p in reversed(pieces)), whole)
    value = (int(whole[0]) * 2**32 + int(whole[1])) / 2**32
    exact = x.double().abs().sum().item()
    assert int(whole[2]) == 0 and abs(value - exact) <= x.numel() * 2**-32 + 1e-9 * exact
    assert fixed_point_sum(torch.tensor([1.0, float("nan"), float("inf"), 2.0**31, -3.5]))[2] == 3
    assert torch.equal(fixed_point_sum(torch.tensor([-2.25, 2.25], dtype=torch.bfloat16)),
                       torch.tensor([4, 2**31, 0]))


def test_taylorseer_schedule_is_diffusers():
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook, TaylorSeerState

    for interval, before in [(5, 3), (1, 1), (2, 4), (3, 1)]:
        hook = TaylorSeerCacheHook(cache_interval=interval, disable_cache_before_step=before,
                                   taylor_factors_dtype=torch.float32, state_manager=None)
        state = TaylorSeerState()
        hook.state_manager = type("M", (), {"get_state": lambda self, state=state: state})()
        config = CacheConfig("taylorseer", cache_interval=interval, disable_cache_before_step=before)
        assert [config.computes(i) for i in range(20)] == [hook._measure_should_compute()[0] for _ in range(20)]


def test_config_refuses_what_it_cannot_do():
    for bad in (dict(kind="teacache"), dict(threshold=-1.0), dict(threshold=float("nan")),
                dict(disable_cache_before_step=0), dict(cache_interval=0), dict(max_order=-1)):
        with pytest.raises(ValueError, match="cache|interval|step|order"):
            CacheConfig(**bad)
    with pytest.raises(ValueError, match="at least 2 transformer blocks"):
        StepCache(CacheConfig("first_block"), state=single_process_state(), contexts=ONE, passes=2, layers=1)
    assert CacheConfig.from_options({"cache": "first_block", "cache_threshold": 0.2, "other": 1}) == \
        CacheConfig("first_block", threshold=0.2)


class _Block(torch.nn.Module):
    """Per token and elementwise (see the module docstring); two streams, the second optional."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(2, CHANNELS, generator=gen) * 0.6 - 0.3)
        self.b = torch.nn.Parameter(torch.randn(2, CHANNELS, generator=gen) * 0.1)

    def forward(self, hidden_states, audio_hidden_states=None, temb=None):
        video = hidden_states + (hidden_states * hidden_states * self.w[0] + self.b[0]) * temb
        if audio_hidden_states is None:
            return video
        return video, audio_hidden_states + (audio_hidden_states * self.w[1] + self.b[1]) * temb


class _Toy(torch.nn.Module):
    def __init__(self, seed: int, streams: tuple[str, ...]):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.transformer_blocks = torch.nn.ModuleList(_Block(gen) for _ in range(LAYERS))
        self.streams = streams
        cache_blocks(self, streams=streams)

    def forward(self, temb, **streams):
        for block in self.transformer_blocks:
            out = block(**streams, temb=temb)
            streams = dict(zip(self.streams, out if isinstance(out, tuple) else (out,), strict=True))
        return streams


@torch.inference_mode()
def _run(state, seed, config, contexts, streams):
    """Every step's input drawn whole (the same on every rank), each rank's rows and shard taken, garbage in its
    padding rows; returns the trace, what it saved and every call's output (real rows, with their pass index)."""
    torch.manual_seed(1000 + state.rank)  # garbage differs between ranks
    model = _Toy(seed, streams)
    passes = sum(len(c.passes) for c in contexts)
    cache = StepCache(config, state=state, contexts=contexts, passes=passes, layers=LAYERS)
    plans = {name: ShardPlan(orig_len=TOKENS[name], world=state.cp_size) for name in streams}
    gen = torch.Generator().manual_seed(seed)
    base = {name: torch.randn(passes, TOKENS[name], CHANNELS, generator=gen) for name in streams}
    mine = set(pass_shares(passes, state.guidance_size)[state.guidance_rank])
    outputs, stats = {}, []
    for step in range(STEPS):
        # The input drifts by a step-dependent amount: some steps' residuals change little, some much.
        drift = 0.02 * (1 + step % 4) * torch.randn(1, generator=gen)
        for context in contexts:
            rows = [p for p in context.passes if p in mine]
            if not rows:
                continue
            local = {}
            for name in streams:
                x = plans[name].shard(base[name][rows] * (1 + drift), state.cp_rank)
                x[:, plans[name].valid_len(state.cp_rank):] = 1e4 * torch.randn_like(x[:, plans[name].valid_len(
                    state.cp_rank):])
                local[name] = x
            with cache.call(model.transformer_blocks, context.name, valid=plans[streams[0]].valid_len(state.cp_rank)):
                out = model(torch.tensor(0.5 + 0.05 * step), **local)
            for name in streams:
                for k, p in enumerate(rows):
                    valid = plans[name].valid_len(state.cp_rank)
                    outputs[(step, p, name, state.cp_rank)] = out[name][k, :valid].clone()
        cache.end_step()
        stats.append(cache.step_stats())
    return cache.trace, stats, outputs


def _reference(seed, config, contexts, streams):
    return _run(single_process_state(), seed, config, contexts, streams)


def _merge(results, world_plan):
    """Every rank's trace entries (each context's holders agree) and outputs (each real row once)."""
    traces, outputs = {}, {}
    for trace, _, out in results:
        for d in trace:
            assert traces.setdefault((d.step, d.context), d) == d, "holders of a context disagree"
        outputs.update(out)
    return sorted(traces.values(), key=lambda d: (d.step, d.context)), outputs


def _whole(outputs, plans_world):
    """Per (step, pass, stream): the shards' real rows in rank order, concatenated."""
    joined = {}
    for (step, p, name, rank) in sorted(outputs, key=lambda k: k[3]):
        joined.setdefault((step, p, name), []).append(outputs[(step, p, name, rank)])
    return {k: torch.cat(v) for k, v in joined.items()}


CASES = [
    ("first_block", ONE, ("hidden_states",)),
    ("first_block", THREE, ("hidden_states", "audio_hidden_states")),
    ("taylorseer", THREE, ("hidden_states", "audio_hidden_states")),
]


def _check_layout(group: SharedGroup):
    seed = random.randrange(2**31)
    for kind, contexts, streams in CASES:
        # A threshold between the metrics' range of values: some steps skip, some compute.
        config = CacheConfig(kind, threshold=0.35, cache_interval=3, disable_cache_before_step=2, max_order=2)
        ref_trace, ref_stats, ref_out = _reference(seed, config, contexts, streams)
        assert {d.compute for d in ref_trace} == {True, False}, f"seed={seed} {kind}: no mix of decisions"
        results = group.run(_run, seed, config, contexts, streams, timeout=60)
        trace, outputs = _merge(results, group.world)
        assert trace == sorted(ref_trace, key=lambda d: (d.step, d.context)), f"seed={seed} {kind}"
        assert all(r[1] == ref_stats for r in results), f"seed={seed} {kind}: stats differ"
        got, expected = _whole(outputs, group.world), _whole(ref_out, 1)
        assert got.keys() == expected.keys()
        for key in expected:
            assert torch.equal(got[key], expected[key]), f"seed={seed} {kind} {key}"


@pytest.mark.parametrize("world,guidance", [(3, None), (4, 4)], ids=["U3", "G4"])
def test_every_layout_decides_as_one_rank(world, guidance):
    """U=3: uneven shards, every context reduced over the Ulysses group; G=4: CFG's pair spread over two guidance
    ranks (reduced over the mesh, where the two ranks that hold none of it join with zeros; with one context, also
    the two ranks that hold no pass at all), STG's and modality's passes each on one rank, the step's totals agreed
    over the mesh. (G=2 x U=2, both at once, runs on the real models: ``tests/models/test_*_cache.py``.)"""
    group = SharedGroup(world, guidance)
    _check_layout(group)
