"""Ragged paged attention against a dense per-sequence reference."""

from __future__ import annotations

import math

import pytest
import torch

from turbospec.attention import build_metadata, paged_attention
from turbospec.attention_groups import GROUP_BREAK_SLOTS, gathered_slots, plan_groups

HQ, HKV, D, BS = 4, 2, 8, 4


def _reference(q, keys, values, q_positions, window=None, tree=None):
    """Dense attention of one sequence: q [Q, HQ, D] at positions q_positions over keys [L, HKV, D]."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1)
    v = values.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    key_pos = torch.arange(keys.shape[0])
    allowed = key_pos[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_positions[:, None] - window
    if tree is not None:
        n = tree.shape[0]
        allowed[:, -n:] = tree
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _setup(query_lens, context_lens, seed=0, head_dim=D):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(c / BS) for c in context_lens) + 3
    perm = torch.randperm(num_blocks, generator=gen)  # scattered, non-contiguous blocks
    k_cache = torch.randn(num_blocks * BS, HKV, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks * BS, HKV, head_dim, generator=gen)
    tables, used = [], 0
    for c in context_lens:
        nb = math.ceil(c / BS)
        blocks = perm[used: used + nb]
        used += nb
        tables.append((blocks[:, None] * BS + torch.arange(BS)).reshape(-1)[:c])
    total = sum(query_lens)
    q = torch.randn(total, HQ, head_dim, generator=gen)
    k = torch.randn(total, HKV, head_dim, generator=gen)
    v = torch.randn(total, HKV, head_dim, generator=gen)
    return q, k, v, k_cache, v_cache, tables


@pytest.mark.parametrize("window", [None, 5])
def test_ragged_batch_matches_dense_reference(window):
    # a decode, a 3-token verification window, a first prefill chunk, a later prefill chunk
    query_lens = [1, 3, 20, 17]
    context_lens = [9, 14, 20, 30]
    q, k, v, k_cache, v_cache, tables = _setup(query_lens, context_lens)
    meta = build_metadata(query_lens, context_lens, tables)
    assert len(meta.groups) == 3  # the two short queries share one padded group; each long chunk has its own
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D), sliding_window=window)
    start = 0
    for ql, cl, slots in zip(query_lens, context_lens, tables):
        # the new tokens' K/V were written into their slots
        torch.testing.assert_close(k_cache[slots[cl - ql:cl]], k[start:start + ql])
        ref = _reference(q[start:start + ql], k_cache[slots], v_cache[slots], torch.arange(cl - ql, cl), window)
        torch.testing.assert_close(out[start:start + ql], ref, rtol=1e-5, atol=1e-5)
        start += ql


def test_far_apart_contexts_get_their_own_groups_and_match_the_reference():
    # decodes and a verification window at 600 and at ~20 tokens: padding the short ones to 600 would read 30x
    # the slots they need, so they form a second group; the split changes nothing in the outputs
    query_lens = [1, 1, 3, 1, 1]
    context_lens = [600, 20, 25, 590, 18]
    assert plan_groups(query_lens, context_lens) == [[0, 3], [1, 2, 4]]
    assert gathered_slots(query_lens, context_lens) == 2 * 600 + 3 * 25
    assert gathered_slots([1, 1], [600, 599 - GROUP_BREAK_SLOTS]) == 600 + 599 - GROUP_BREAK_SLOTS  # past it: two
    assert gathered_slots([1, 1], [600, 600 - GROUP_BREAK_SLOTS]) == 2 * 600  # at the break: one group
    q, k, v, k_cache, v_cache, tables = _setup(query_lens, context_lens, seed=3)
    meta = build_metadata(query_lens, context_lens, tables)
    assert [g.kv_slots.shape for g in meta.groups] == [(2, 600), (3, 25)]
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D))
    start = 0
    for ql, cl, slots in zip(query_lens, context_lens, tables):
        ref = _reference(q[start:start + ql], k_cache[slots], v_cache[slots], torch.arange(cl - ql, cl))
        torch.testing.assert_close(out[start:start + ql], ref, rtol=1e-5, atol=1e-5)
        start += ql


def test_tree_mask_replaces_causal_mask_among_new_tokens():
    # 4 draft nodes: root 0 with children 1 and 2; node 3 child of 1
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    query_lens, context_lens = [4, 1], [10, 6]
    q, k, v, k_cache, v_cache, tables = _setup(query_lens, context_lens, seed=1)
    meta = build_metadata(query_lens, context_lens, tables, tree_masks=[tree, None])
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D))
    ref = _reference(q[:4], k_cache[tables[0]], v_cache[tables[0]], torch.arange(6, 10), tree=tree)
    torch.testing.assert_close(out[:4], ref, rtol=1e-5, atol=1e-5)
    # node 2 must not see node 1: changing node 1's value leaves node 2's output unchanged
    v_cache2 = v_cache.clone()
    k2 = k.clone()
    v2 = v.clone()
    v2[1] += 10.0
    out2 = paged_attention(q, k2, v2, k_cache.clone(), v_cache2, meta, scale=1 / math.sqrt(D))
    torch.testing.assert_close(out2[2], out[2])
    assert not torch.allclose(out2[3], out[3])


def test_padding_rows_never_leak_into_other_sequences():
    query_lens, context_lens = [1, 5], [3, 8]
    q, k, v, k_cache, v_cache, tables = _setup(query_lens, context_lens, seed=2)
    meta = build_metadata(query_lens, context_lens, tables)
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D))
    assert torch.isfinite(out).all()
    alone = build_metadata([1], [3], [tables[0]])
    out_alone = paged_attention(q[:1], k[:1], v[:1], k_cache, v_cache, alone, scale=1 / math.sqrt(D))
    torch.testing.assert_close(out[:1], out_alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_matches_the_reference_on_every_kind_of_short_query(monkeypatch, dtype):
    """Decodes, verification windows, a draft tree, a sliding window and padded groups of several sequences, read
    from scattered cache slots by our fused kernel (kernels/short_attention.cpp), against the dense reference."""
    from turbospec import attention_choice, kernels

    if kernels.load() is None:
        pytest.skip(f"our kernels are not built here: {kernels.failure()}")
    monkeypatch.setenv(attention_choice.OVERRIDE, "fused")
    attention_choice.forget()
    calls = []
    fused = torch.ops.turbospec.short_query_attention
    monkeypatch.setattr(torch.ops.turbospec, "short_query_attention", lambda *a: calls.append(1) or fused(*a),
                        raising=False)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    head_dim = 32
    for window in (None, 5):
        query_lens, context_lens = [1, 3, 4, 1, 16], [9, 14, 12, 40, 37]
        q, k, v, k_cache, v_cache, tables = _setup(query_lens, context_lens, seed=6, head_dim=head_dim)
        q, k, v, k_cache, v_cache = (t.to(dtype) for t in (q, k, v, k_cache, v_cache))
        meta = build_metadata(query_lens, context_lens, tables, tree_masks=[None, None, tree, None, None])
        assert max(g.kv_slots.shape[0] for g in meta.groups) > 1  # sequences padded into one group
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(head_dim), sliding_window=window)
        start = 0
        for ql, cl, slots, t in zip(query_lens, context_lens, tables, [None, None, tree, None, None]):
            ref = _reference(q[start:start + ql].float(), k_cache[slots].float(), v_cache[slots].float(),
                             torch.arange(cl - ql, cl), window, tree=t)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[start:start + ql].float(), ref, rtol=tol, atol=tol)
            start += ql
    assert len(calls) == 2 * len(meta.groups)  # every group of both steps ran the fused kernel
    attention_choice.forget()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_kernel_matches_the_reference_at_every_head_dim(dtype):
    """The kernel's register-blocked paths (head dims 32, 64, 128, 256) and its loop (48), with 1 to 16 queries
    sharing a KV head 6 ways, key counts around its blocks of 16, scattered slots and random masks."""
    from turbospec import kernels

    if kernels.load() is None:
        pytest.skip(f"our kernels are not built here: {kernels.failure()}")
    gen = torch.Generator().manual_seed(3)
    batch, slots_total, q_heads, kv_heads = 2, 256, 12, 2
    for dim in (32, 48, 64, 128, 256):
        for num_q, length in ((1, 15), (1, 17), (9, 40), (16, 33)):
            k_cache, v_cache = (torch.randn(slots_total, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
            slots = torch.stack([torch.randperm(slots_total, generator=gen)[:length] for _ in range(batch)])
            mask = torch.rand(batch, num_q, length, generator=gen) > 0.3
            mask[..., 0] = True  # every query sees at least one key, as a real one sees itself
            q = torch.randn(batch, num_q, q_heads, dim, generator=gen).to(dtype)
            out = torch.ops.turbospec.short_query_attention(q, k_cache, v_cache, slots, mask, 1 / math.sqrt(dim))
            k, v = (c[slots].float().repeat_interleave(q_heads // kv_heads, 2) for c in (k_cache, v_cache))
            scores = torch.einsum("bqhd,blhd->bhql", q.float(), k) / math.sqrt(dim)
            probs = scores.masked_fill(~mask[:, None], float("-inf")).softmax(-1)
            ref = torch.einsum("bhql,blhd->bqhd", probs, v)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol, msg=f"head dim {dim}, {num_q} queries")


def test_a_slot_no_query_attends_never_reaches_the_output():
    """Padding points at slot 0, which another request may own: whatever it holds (here NaN and inf, as a request
    whose activations overflowed would leave), a query that masks it out must not see it (0 x NaN is NaN)."""
    from turbospec import kernels

    if kernels.load() is None:
        pytest.skip(f"our kernels are not built here: {kernels.failure()}")
    gen = torch.Generator().manual_seed(4)
    for dim in (48, 128):  # the loop and a register-blocked path
        k_cache, v_cache = (torch.randn(64, 2, dim, generator=gen).bfloat16() for _ in range(2))
        k_cache[0], v_cache[0] = float("inf"), float("nan")
        slots = torch.cat([torch.arange(1, 21), torch.zeros(12, dtype=torch.long)]).view(1, 32)  # 12 padded
        mask = torch.zeros(1, 5, 32, dtype=torch.bool)
        mask[:, :, :20] = torch.ones(5, 20, dtype=torch.bool).tril(15)  # a 5-query verification window
        q = torch.randn(1, 5, 12, dim, generator=gen).bfloat16()
        out = torch.ops.turbospec.short_query_attention(q, k_cache, v_cache, slots, mask, 1 / math.sqrt(dim))
        alone = torch.ops.turbospec.short_query_attention(q, k_cache, v_cache, slots[:, :20], mask[:, :, :20],
                                                          1 / math.sqrt(dim))
        assert torch.isfinite(out).all(), f"head dim {dim}: a masked slot's NaN reached the output"
        torch.testing.assert_close(out, alone, rtol=0, atol=0)
