"""Cross-sequence Ulysses attention (queries of one sharded sequence over keys of another), on real gloo process
groups of 1, 2, 3 and 4 ranks.

Every case compares against ``scaled_dot_product_attention`` computed in one process over the two unpadded
sequences: q and kv lengths that do not divide the group size, a kv sequence shorter than the group (some ranks
hold only padding), heads that need padding, a key mask, batch 1 and 2; through autograd, without a workspace,
with one workspace shared by every call, and with q/k/v handed over as producers. Padding rows of the shards are
filled with large random values, not zeros, so a padded key that took part would change the result.

Tolerance: fp32, and the exchange moves bits unchanged; the results differ from the reference only by summation
order inside SDPA (another head grouping and layout), a few ulps: 1e-5 is ample.
"""

import random

import pytest
import torch

from cp_infer import ExchangeWorkspace, ShardPlan, ulysses_attention

from ..worker_groups import group_per_world
from ._ulysses_common import HEAD_DIM, WORLDS, reference_sdpa

TOL = dict(atol=1e-5, rtol=1e-5)
MODES = ("autograd", "fresh", "workspace", "producers")


group = group_per_world(WORLDS)


def _shard_with_garbage(plan, full, rank, gen):
    """This rank's shard with its padding rows (if any) set to large random values."""
    local = plan.shard(full, rank)
    valid = plan.valid_len(rank)
    local[:, valid:] = 10 * torch.randn(local[:, valid:].shape, generator=gen)
    return local


def _cross_cases(state, seed, length_pairs):
    gen = torch.Generator().manual_seed(seed)  # identical full inputs on every rank
    n, r = state.cp_size, state.cp_rank
    garbage = torch.Generator().manual_seed(seed + 1 + r)  # padding fill: its own stream, rank-dependent sizes
    workspace = ExchangeWorkspace()  # one for every case: grows, shrinks never, serves every shape
    kept = []  # earlier outputs of workspace calls, checked again at the end: never clobbered
    cases = 0
    for q_len, kv_len in length_pairs:
        for heads in (4, 6):  # 4 does not divide 3, 6 does not divide 4: head padding
            for batch in (1, 2):
                for masked in (False, True):
                    for mode in MODES:
                        case = f"Lq={q_len} Lkv={kv_len} H={heads} B={batch} masked={masked} {mode} world={n}"
                        q_full = torch.randn(batch, q_len, heads, HEAD_DIM, generator=gen)
                        k_full, v_full = (torch.randn(batch, kv_len, heads, HEAD_DIM, generator=gen) for _ in "kv")
                        key_mask = None
                        if masked:
                            key_mask = torch.rand(batch, kv_len, generator=gen) < 0.7
                            key_mask[:, torch.randint(kv_len, (1,), generator=gen)] = True  # no empty row
                        plan, kv_plan = ShardPlan(q_len, n), ShardPlan(kv_len, n)
                        local = [_shard_with_garbage(p, t, r, garbage)
                                 for p, t in ((plan, q_full), (kv_plan, k_full), (kv_plan, v_full))]
                        kwargs = dict(plan=plan, kv_plan=kv_plan, group=state.cp_group, key_mask=key_mask)
                        ref_in = [t.clone().requires_grad_(mode == "autograd") for t in (q_full, k_full, v_full)]
                        ref = reference_sdpa(*ref_in, key_mask)
                        start, stop = plan.token_range(r)
                        valid = stop - start
                        if mode == "autograd":
                            local = [t.requires_grad_(True) for t in local]
                            out = ulysses_attention(*local, **kwargs)
                            grad_out = torch.randn(ref.shape, generator=gen)
                            out.backward(plan.shard(grad_out, r))  # zero upstream gradient on padding rows
                            ref.backward(grad_out)
                        else:
                            with torch.no_grad():
                                inputs = [(lambda t=t: t.clone()) for t in local] if mode == "producers" else local
                                ws = workspace if mode in ("workspace", "producers") else None
                                out = ulysses_attention(*inputs, **kwargs, workspace=ws)
                            if ws is not None:
                                kept.append((case, out, out.clone()))
                        assert out.shape == local[0].shape, case
                        assert out.is_contiguous(), case  # dense: the next Linear takes its usual GEMM path
                        assert torch.isfinite(out).all(), case
                        torch.testing.assert_close(out[:, :valid], ref[:, start:stop].detach(), **TOL,
                                                   msg=lambda m, case=case: f"{case}: {m}")
                        if mode == "autograd":
                            for name, t_local, t_ref, p in zip("qkv", local, ref_in, (plan, kv_plan, kv_plan),
                                                               strict=True):
                                a, b = p.token_range(r)
                                torch.testing.assert_close(t_local.grad[:, : b - a], t_ref.grad[:, a:b], **TOL,
                                                           msg=lambda m, name=name, case=case: f"{case} d{name}: {m}")
                                # Padded keys/values are never attended: exactly zero gradient.
                                if name in "kv":
                                    assert torch.count_nonzero(t_local.grad[:, b - a:]) == 0, f"{case} d{name} pad"
                        cases += 1
    for case, out, copy in kept:
        torch.testing.assert_close(out, copy, rtol=0, atol=0, msg=lambda m, case=case: f"{case} clobbered: {m}")
    return cases


def test_cross_attention_matches_single_process_sdpa(group):
    seed = random.randrange(2**31)
    n = group.world
    # kv shorter than the group (n - 1 tokens; 1 at n=1), q shorter, and both lengths not dividing n
    pairs = [(97, 13), (13, 97), (97, max(n - 1, 1)), (1, 97)]
    cases = group.run(_cross_cases, seed, pairs, timeout=300)
    assert cases == [len(pairs) * 2 * 2 * 2 * len(MODES)] * n, f"seed={seed}"


def _mixed_workspace(state, seed):
    """One workspace alternating between a self-attention and a cross-attention of other lengths, as a layer of an
    audio-video model does: every call equals the same call without a workspace, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    n, r = state.cp_size, state.cp_rank
    workspace = ExchangeWorkspace()
    video, audio = ShardPlan(101, n), ShardPlan(7, n)
    for _ in range(2):
        for q_plan, kv_plan in ((video, video), (video, audio), (audio, video), (audio, audio)):
            q, k, v = (p.shard(torch.randn(2, p.orig_len, 6, HEAD_DIM, generator=gen), r)
                       for p in (q_plan, kv_plan, kv_plan))
            with torch.no_grad():
                got = ulysses_attention(q, k, v, plan=q_plan, kv_plan=kv_plan, group=state.cp_group,
                                        workspace=workspace)
                fresh = ulysses_attention(q, k, v, plan=q_plan, kv_plan=kv_plan, group=state.cp_group)
            torch.testing.assert_close(got, fresh, rtol=0, atol=0)
    # Buffers made under inference_mode cannot be written outside it: the workspace replaces them, no error.
    q, k, v = (video.shard(torch.randn(1, video.orig_len, 6, HEAD_DIM, generator=gen), r) for _ in "qkv")
    with torch.inference_mode():
        inside = ulysses_attention(q, k, v, plan=video, group=state.cp_group, workspace=workspace)
    with torch.no_grad():
        outside = ulysses_attention(q, k, v, plan=video, group=state.cp_group, workspace=workspace)
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)
    return workspace.nbytes


def test_one_workspace_serves_self_and_cross_calls(group):
    sizes = group.run(_mixed_workspace, random.randrange(2**31))
    assert all(s > 0 for s in sizes) if group.world > 1 else all(s == 0 for s in sizes)


def _bad_cross_calls(state):
    n = state.cp_size
    plan, kv_plan = ShardPlan(10, n), ShardPlan(5, n)
    q = torch.randn(1, plan.local_len, 4, 8)
    kv = torch.randn(1, kv_plan.local_len, 4, 8)
    with pytest.raises(ValueError, match=f"kv_plan is for {n + 1} ranks but the group has {n}"):
        ulysses_attention(q, kv, kv, plan=plan, kv_plan=ShardPlan(5, n + 1), group=state.cp_group)
    with pytest.raises(ValueError, match=r"k must be \[B, kv_plan.local_len="):
        ulysses_attention(q, q, q, plan=plan, kv_plan=kv_plan, group=state.cp_group)
    with pytest.raises(ValueError, match=r"key_mask must be a bool tensor of shape \(B, S\)=\(1, 5\)"):
        ulysses_attention(q, kv, kv, plan=plan, kv_plan=kv_plan, group=state.cp_group,
                          key_mask=torch.ones(1, 10, dtype=torch.bool))
    return True


def test_bad_cross_calls_raise_clear_errors(group):
    assert all(group.run(_bad_cross_calls))
