"""Ring attention: the block merge (one process, no process group) and Ulysses x ring attention on real gloo groups
of (U, R) = (2, 2), (1, 2), (1, 3), (1, 4), against full-sequence SDPA in one process.

Tolerances: fp32 throughout. A block's output and log-sum-exp come from the same kernel as the reference, and the
merge re-weights them in fp32: the difference is summation order and one exp/log round trip, a few fp32 ulps of
values of order 1, so 1e-5 is ample (the Ulysses tests use the same bound).
"""

import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from cp_infer import MeshLayout, ShardPlan, ulysses_attention
from cp_infer.ring import BlockMerge, RingGroup, attention_lse

from ..worker_groups import SharedGroup
from ._ulysses_common import HEAD_DIM, reference_sdpa

TOL = dict(atol=1e-5, rtol=1e-5)


def _bhsd(gen, batch, heads, length):
    return torch.randn(batch, heads, length, HEAD_DIM, generator=gen)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-flash", "fp32-matmul"])
def test_blocks_merged_by_lse_equal_full_attention(fused):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = _bhsd(gen, 2, 3, 9), _bhsd(gen, 2, 3, 23), _bhsd(gen, 2, 3, 23)
    ref = F.scaled_dot_product_attention(q, k, v)
    ref_lse = torch.logsumexp((q @ k.transpose(-1, -2)) * HEAD_DIM ** -0.5, dim=-1)
    merge = BlockMerge(q)
    for lo, hi in ((0, 5), (5, 6), (6, 23)):  # uneven blocks, one of a single key
        merge.add(*attention_lse(q, k[:, :, lo:hi], v[:, :, lo:hi], fused=fused))
    torch.testing.assert_close(merge.result(), ref, **TOL)
    torch.testing.assert_close(merge.lse, ref_lse, **TOL)


def test_masked_block_contributes_nothing_and_no_nan():
    """A block whose keys are all masked (on one batch row) adds nothing; the sigmoid form of the merge would give
    NaN there. CPU flash attention's lse of 0 for such a row is overridden (else the row would get weight)."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = _bhsd(gen, 2, 2, 4), _bhsd(gen, 2, 2, 10), _bhsd(gen, 2, 2, 10)
    mask = torch.rand(2, 10, generator=gen) < 0.6
    mask[:, 0] = True
    mask[1, 5:] = False  # batch row 1: the second block has no key to attend
    ref = reference_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)
    merge = BlockMerge(q)
    for lo, hi in ((0, 5), (5, 10)):
        out, lse = attention_lse(q, k[:, :, lo:hi], v[:, :, lo:hi], key_mask=mask[:, lo:hi])
        if lo == 5:
            assert torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
        merge.add(out, lse)
    torch.testing.assert_close(merge.result(), ref, **TOL)
    assert torch.isfinite(merge.result()).all()


def test_no_key_at_all_gives_zero_not_nan():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    q, k, v = _bhsd(gen, 1, 2, 3), _bhsd(gen, 1, 2, 4), _bhsd(gen, 1, 2, 4)
    merge = BlockMerge(q)
    assert torch.equal(merge.result(), torch.zeros_like(q))  # no block merged
    merge.add(*attention_lse(q, k, v, key_mask=torch.zeros(1, 4, dtype=torch.bool)))
    assert torch.equal(merge.result(), torch.zeros_like(q))
    assert torch.isneginf(merge.lse).all()


def test_a_fused_kernel_is_used_only_once_it_gives_the_matmuls_result(monkeypatch, caplog):
    """``fused_lse_ok`` (the gate of the CUDA kernels' log-sum-exp, checked once per device, dtype and head size): a
    kernel that is missing (this CPU build has no CUDA kernels), that fails, or whose log-sum-exp is wrong (left
    padded to 32 queries, or off by a constant) is refused with one warning; one that agrees is taken."""
    import cp_infer.ring as ring

    cpu = torch.device("cpu")

    def from_cpu_flash(pad: int = 0, shift: float = 0.0):
        def kernel(q, k, v, scale):
            out, lse = attention_lse(q, k, v, scale=scale, fused=True)
            return out, torch.nn.functional.pad(lse, (0, pad)) + shift
        return kernel

    def failing(q, k, v, scale):
        raise RuntimeError("no kernel image is available for execution on the device")

    for kernel, expected in ((None, False), (failing, False), (from_cpu_flash(pad=13), False),
                             (from_cpu_flash(shift=0.5), False), (from_cpu_flash(), True)):
        monkeypatch.setattr(ring, "_FUSED_OK", {})
        if kernel is not None:
            monkeypatch.setattr(ring, "_cuda_lse", kernel)
        caplog.clear()
        assert ring.fused_lse_ok(cpu, torch.float32, 16) is expected, kernel
        assert ring.fused_lse_ok(cpu, torch.float32, 16) is expected  # answered from the cache
        warnings = [r for r in caplog.records if "no fused kernel gives the log-sum-exp" in r.getMessage()]
        assert len(warnings) == (0 if expected else 1), [r.getMessage() for r in caplog.records]


def test_sigmoid_merge_is_nan_on_an_empty_block():
    """Why the max/exp form: the sigmoid form used elsewhere turns a block with no key (lse -inf) merged into a
    running lse of -inf into NaN, where ours gives what the other blocks say."""
    lse_running = torch.tensor([float("-inf")])
    lse_block = torch.tensor([float("-inf")])
    assert torch.isnan(torch.sigmoid(lse_block - lse_running)).all()
    merge = BlockMerge(torch.zeros(1, 1, 1, 2))
    merge.add(torch.ones(1, 1, 1, 2), lse_block.view(1, 1, 1))
    merge.add(torch.full((1, 1, 1, 2), 3.0), torch.zeros(1, 1, 1))
    assert torch.equal(merge.result(), torch.full((1, 1, 1, 2), 3.0))


# ------------------------------------------------------------------------------------------------- multi-rank

LAYOUTS = [(2, 2), (1, 2), (1, 3), (1, 4)]  # (Ulysses, ring)


@pytest.fixture(scope="module")
def ring_group():
    """One 4-rank group, Ulysses 2 x ring 2 as ``init_parallel`` builds it; the other layouts are made from its
    ranks in the test (a group per layout would pay a start-up each)."""
    return SharedGroup(4, ulysses=2, ring=2)


def _layout_groups(state, ulysses, ring):
    """``(sequence rank, Ulysses group, RingGroup)`` of this rank in a layout over the first ``ulysses x ring``
    ranks (the state's own for its layout), or ``None`` off it. Every rank creates every group, in order."""
    if (ulysses, ring) == (state.ulysses_size, state.ring_size):
        return state.cp_rank, state.attention_group, state.ring
    layout = MeshLayout(world=ulysses * ring, ulysses=ulysses, ring=ring)
    mine = None
    ulysses_groups = [dist.new_group(list(ranks)) if ulysses > 1 else None for ranks in layout.ulysses_groups()]
    for ranks in layout.ring_groups():
        group = dist.new_group(list(ranks))
        if state.rank in ranks:
            seq = state.rank
            mine = (seq, ulysses_groups[seq // ulysses], RingGroup(group=group, rank=ranks.index(seq), size=ring))
    return mine


def _ring_cases(state, seed, ulysses, ring_size):
    gen = torch.Generator().manual_seed(seed)  # identical full inputs on every rank
    assert state.ring is not None and state.ring_size * state.ulysses_size == state.cp_size
    mine = _layout_groups(state, ulysses, ring_size)
    if mine is None:
        return None
    r, group, ring = mine
    n = ulysses * ring_size
    # 1 and n - 2 leave whole ring blocks of padding (U=1, R=3: 2 tokens over 3 ranks); 97 is uneven
    lengths = sorted({1, max(n - 2, 1), n + 1, 97})
    cases = 0
    with torch.inference_mode():
        for length in lengths:
            for heads in (3, 4):  # 3 does not divide U=2: a padded head
                for cross in (False, True):
                    case = f"L={length} H={heads} cross={cross} U={ulysses} R={ring_size}"
                    batch = 2
                    kv_length = 13 if cross else length
                    q = torch.randn(batch, length, heads, HEAD_DIM, generator=gen)
                    k, v = (torch.randn(batch, kv_length, heads, HEAD_DIM, generator=gen) for _ in range(2))
                    key_mask = None
                    if cross:
                        key_mask = torch.rand(batch, kv_length, generator=gen) < 0.5
                        key_mask[:, 0] = True
                        key_mask[1, 4:] = False  # row 1 attends only the first ring block's keys
                    plan, kv_plan = ShardPlan(orig_len=length, world=n), ShardPlan(orig_len=kv_length, world=n)
                    out = ulysses_attention(plan.shard(q, r), kv_plan.shard(k, r), kv_plan.shard(v, r), plan=plan,
                                            kv_plan=kv_plan if cross else None, key_mask=key_mask,
                                            group=group, ring=ring)
                    assert out.shape == (batch, plan.local_len, heads, HEAD_DIM), case
                    assert torch.isfinite(out).all(), case
                    ref = reference_sdpa(q, k, v, key_mask)
                    start, stop = plan.token_range(r)
                    torch.testing.assert_close(out[:, :stop - start], ref[:, start:stop], **TOL,
                                               msg=lambda m, case=case: f"{case}: {m}")
                    cases += 1
    return cases


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda ur: f"U{ur[0]}xR{ur[1]}")
def test_ring_attention_matches_full_sequence_sdpa(ring_group, layout):
    seed = random.randrange(2**31)
    counts = ring_group.run(_ring_cases, seed, *layout, timeout=120)
    ranks = layout[0] * layout[1]
    assert counts[0] > 0 and len(set(counts[:ranks])) == 1 and counts[ranks:] == [None] * (4 - ranks), f"seed={seed}"


def _ring_refuses_autograd(state):
    plan = ShardPlan(orig_len=5, world=state.cp_size)
    x = torch.randn(1, plan.local_len, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="inference only"):
        ulysses_attention(x, x, x, plan=plan, group=state.attention_group, ring=state.ring)
    wrong = ShardPlan(orig_len=5, world=state.ulysses_size)
    if state.ulysses_size != state.cp_size:
        with torch.no_grad(), pytest.raises(ValueError, match="ring of"):
            ulysses_attention(x, x, x, plan=wrong, group=state.attention_group, ring=state.ring)
    return True


def test_ring_attention_refuses_autograd_and_a_plan_for_the_wrong_world(ring_group):
    assert all(ring_group.run(_ring_refuses_autograd))
