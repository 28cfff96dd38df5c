"""Ulysses attention and the collectives, on real gloo process groups of 1, 2, 3 and 4 ranks.

Every case compares against full-sequence ``scaled_dot_product_attention`` computed in one process on the
unpadded sequence. Inputs are fresh random draws; the seed is printed on failure.

Tolerances: fp32 results differ from the reference only by summation order inside SDPA (the exchange
moves bits unchanged), so 1e-5 is ample. bf16 runs SDPA in bf16 on both sides; the error is then a few
bf16 ulps of values of order 1: atol/rtol 2e-2 (bf16 has 8 mantissa bits, ulp(1) = 7.8e-3).
"""

import random

import pytest
import torch

from cp_infer import (
    ShardPlan,
    all_reduce_max_int,
    broadcast_object,
    gather_sequence,
    ulysses_attention,
    warmup,
)

from ..worker_groups import group_per_world
from ._ulysses_common import HEAD_DIM, WORLDS, reference_sdpa

group = group_per_world(WORLDS)


def _random_key_mask(gen, batch, length):
    mask = torch.rand(batch, length, generator=gen) < 0.7
    mask[torch.arange(batch), torch.randint(length, (batch,), generator=gen)] = True  # no empty row
    return mask


def _attention_cases(state, seed, lengths, heads_list):
    """Forward and backward for every case; asserts inside the rank so a traceback names the case."""
    gen = torch.Generator().manual_seed(seed)  # identical full inputs on every rank
    n, r = state.cp_size, state.cp_rank
    report = []
    for length in lengths:
        for heads in heads_list:
            for masked in (False, True):
                for dtype in (torch.float32, torch.bfloat16):
                    case = f"L={length} H={heads} masked={masked} {dtype} world={n}"
                    batch = 2
                    full = [torch.randn(batch, length, heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(3)]
                    key_mask = _random_key_mask(gen, batch, length) if masked else None
                    grad_out = torch.randn(batch, length, heads, HEAD_DIM, generator=gen).to(dtype)
                    plan = ShardPlan(orig_len=length, world=n)
                    local = [plan.shard(t, r).requires_grad_(True) for t in full]
                    out = ulysses_attention(*local, plan=plan, group=state.cp_group, key_mask=key_mask)
                    assert out.shape == local[0].shape, case
                    assert out.is_contiguous(), case  # dense: the next Linear takes its usual GEMM path
                    assert torch.isfinite(out).all(), case
                    out.backward(plan.shard(grad_out, r))  # zero upstream gradient on padding rows

                    ref_in = [t.detach().clone().requires_grad_(True) for t in full]
                    ref = reference_sdpa(*ref_in, key_mask)
                    ref.backward(grad_out)
                    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
                    start, stop = plan.token_range(r)
                    valid = stop - start
                    torch.testing.assert_close(out[:, :valid], ref[:, start:stop], **tol,
                                               msg=lambda m, case=case: f"{case}: {m}")
                    for name, t_local, t_ref in zip("qkv", local, ref_in, strict=False):
                        torch.testing.assert_close(t_local.grad[:, :valid], t_ref.grad[:, start:stop], **tol,
                                                   msg=lambda m, name=name, case=case: f"{case} d{name}: {m}")
                        # Padding never leaks: padded keys/values receive exactly zero gradient.
                        if name in "kv":
                            assert torch.count_nonzero(t_local.grad[:, valid:]) == 0, f"{case} d{name} padding"
                    report.append((case, (out[:, :valid].float() - ref[:, start:stop].float()).abs().max().item()
                                   if valid else 0.0))
    return report


def test_attention_matches_full_sequence_sdpa(group):
    seed = random.randrange(2**31)
    n = group.world
    lengths = sorted({1, max(n - 1, 1), 97, 1000})
    heads = [4, 6]  # 4 does not divide 3, 6 does not divide 4: both exercise head padding
    reports = group.run(_attention_cases, seed, lengths, heads, timeout=300)
    assert len(reports[0]) == len(lengths) * len(heads) * 4, f"seed={seed}"


def _padding_would_change_result(state, seed):
    """Guard that the test above can fail: letting padded keys into attention changes the output."""
    gen = torch.Generator().manual_seed(seed)
    length, n, _r = 97, state.cp_size, state.cp_rank
    full = [torch.randn(1, length, 4, HEAD_DIM, generator=gen) + 1.0 for _ in range(3)]
    plan = ShardPlan(orig_len=length, world=n)
    ref = reference_sdpa(*full, None)
    # Attention over the padded sequence, as the original module did (padding after projection = bias != 0).
    padded = [plan.pad(t) for t in full]
    padded[1][:, length:] = 0.5
    leaky = reference_sdpa(*padded, None)[:, :length]
    return plan.num_pad > 0 and not torch.allclose(leaky, ref, atol=1e-3)


def test_padding_leak_is_detectable(group):
    if 97 % group.world == 0:
        pytest.skip("97 tokens divide this world: no padding")
    assert all(group.run(_padding_would_change_result, random.randrange(2**31)))


def _gather_cases(state, seed):
    gen = torch.Generator().manual_seed(seed)
    n, r = state.cp_size, state.cp_rank
    for length in sorted({1, max(n - 1, 1), 97}):
        full = torch.randn(2, 3, length, 5, generator=gen)
        plan = ShardPlan(orig_len=length, world=n)
        local = plan.shard(full, r, dim=2).requires_grad_(True)
        out = gather_sequence(local, plan=plan, group=state.cp_group, dim=2)
        torch.testing.assert_close(out, full, rtol=0, atol=0)
        upstream = torch.randn(out.shape, generator=gen)
        out.backward(upstream)
        torch.testing.assert_close(local.grad, plan.shard(upstream, r, dim=2), rtol=0, atol=0)
    return True


def test_gather_sequence_trims_and_differentiates(group):
    assert all(group.run(_gather_cases, random.randrange(2**31)))


def _control_plane(state):
    warmup(state)
    obj = broadcast_object({"job": "x", "rank": state.rank} if state.rank == 0 else None, state=state)
    return obj, all_reduce_max_int(state.rank * 10, state=state)


def test_warmup_broadcast_and_status_agreement(group):
    results = group.run(_control_plane)
    assert all(obj == {"job": "x", "rank": 0} for obj, _ in results)
    assert all(m == (group.world - 1) * 10 for _, m in results)


def _bad_calls(state):
    plan = ShardPlan(orig_len=10, world=state.cp_size + 1)
    x = torch.randn(1, plan.local_len, 4, 8)
    with pytest.raises(ValueError, match=f"plan is for {state.cp_size + 1} ranks but the group has {state.cp_size}"):
        ulysses_attention(x, x, x, plan=plan, group=state.cp_group)
    plan = ShardPlan(orig_len=10, world=state.cp_size)
    x = torch.randn(1, plan.local_len, 4, 8)
    with pytest.raises(ValueError, match="key_mask must be a bool tensor"):
        ulysses_attention(x, x, x, plan=plan, group=state.cp_group, key_mask=torch.ones(1, 10))
    return True


def test_bad_calls_raise_clear_errors(group):
    assert all(group.run(_bad_calls))


def _workspace_cases(state, seed):
    """Inference calls (kept buffers, fresh buffers, q/k/v producers) equal full-sequence SDPA, agree bit for bit with
    one another, and an earlier output is never clobbered by a later call."""
    from cp_infer import ExchangeWorkspace

    gen = torch.Generator().manual_seed(seed)
    n, r = state.cp_size, state.cp_rank
    workspace = ExchangeWorkspace()
    # batch 1: q, k and v are views of the receive buffer; batch 2: they are gathered into the send buffer
    for length, heads, batch in ((97, 4, 1), (1000, 6, 2), (97, 4, 2), (1000, 6, 1)):
        plan = ShardPlan(orig_len=length, world=n)
        start, stop = plan.token_range(r)
        full = [[torch.randn(batch, length, heads, HEAD_DIM, generator=gen) for _ in range(3)] for _ in range(2)]
        first, second = ([plan.shard(t, r) for t in f] for f in full)
        with torch.no_grad():
            out1 = ulysses_attention(*first, plan=plan, group=state.cp_group, workspace=workspace)
            kept = out1.clone()
            producers = [(lambda t=t: t.clone()) for t in second]
            out2 = ulysses_attention(*producers, plan=plan, group=state.cp_group, workspace=workspace)
            torch.testing.assert_close(out1, kept, rtol=0, atol=0)  # the second call did not overwrite the first
            torch.testing.assert_close(out1, ulysses_attention(*first, plan=plan, group=state.cp_group),
                                       rtol=0, atol=0)
            torch.testing.assert_close(out2, ulysses_attention(*second, plan=plan, group=state.cp_group),
                                       rtol=0, atol=0)
        for out, f in ((out1, full[0]), (out2, full[1])):
            torch.testing.assert_close(out[:, : stop - start], reference_sdpa(*f, None)[:, start:stop],
                                       atol=1e-5, rtol=1e-5)
    return True


def test_workspace_reuse_is_exact(group):
    assert all(group.run(_workspace_cases, random.randrange(2**31)))
