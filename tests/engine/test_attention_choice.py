"""The measured choice between SDPA, the grouped matmuls and our fused kernel for one sequence's short query."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.engine.test_attention import HKV, HQ, D, _reference, _setup
from turbospec import attention, attention_choice, kernels
from turbospec.attention import build_metadata, paged_attention
from turbospec.attention_choice import (OVERRIDE, PROBE_CONTEXTS, SHORT_QUERY, choice_summary, fused_runs,
                                        nearest_probe, short_query_kernel, single_sequence_matmul, winners)


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    monkeypatch.delenv(OVERRIDE, raising=False)
    attention_choice.forget()
    yield
    attention_choice.forget()


def test_the_faster_kernel_wins_per_query_count_and_context():
    inf = float("inf")  # the fused kernel where it cannot run
    timings = {(1, 256): (0.72, 0.10, 0.03), (2, 256): (0.08, 0.09, inf), (9, 64): (0.05, 0.08, 0.06),
               (9, 1024): (0.58, 0.21, 0.30), (16, 256): (0.15, 0.15, 0.15)}  # (SDPA, matmul, fused) ms
    assert winners(timings) == {(1, 256): "fused", (2, 256): "sdpa", (9, 64): "sdpa", (9, 1024): "matmul",
                                (16, 256): "sdpa"}  # a tie keeps the earlier kernel


def test_a_call_takes_the_choice_made_at_the_nearest_probed_context():
    assert PROBE_CONTEXTS == (64, 128, 256, 512, 1024, 2048, 4096)
    assert [nearest_probe(n) for n in (1, 90, 91, 136, 700, 800, 3000, 100_000)] == [64, 64, 128, 128, 512, 1024,
                                                                                     4096, 4096]


@pytest.mark.parametrize("override", ["sdpa", "matmul"])
def test_a_single_sequence_gets_the_same_attention_from_either_kernel(monkeypatch, override):
    # a 5-node draft tree and a decode, each the only sequence of its step, against the dense reference (head dim 8:
    # the fused kernel takes multiples of 16, tests/engine/test_attention.py runs it)
    monkeypatch.setenv(OVERRIDE, override)
    ran = []
    grouped = attention.grouped_matmul_attention
    monkeypatch.setattr(attention, "grouped_matmul_attention", lambda *a: ran.append(1) or grouped(*a))
    tree = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]],
                        dtype=torch.bool)
    for query_lens, context_lens, masks in (([5], [23], [tree]), ([1], [40], None)):
        q, k, v, k_cache, v_cache, tables = _setup(query_lens, context_lens, seed=4)
        meta = build_metadata(query_lens, context_lens, tables, tree_masks=masks)
        assert single_sequence_matmul(query_lens[0], context_lens[0], HQ, HKV, D, q.dtype) == (override == "matmul")
        out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D))
        ql, cl = query_lens[0], context_lens[0]
        ref = _reference(q, k_cache[tables[0]], v_cache[tables[0]], torch.arange(cl - ql, cl),
                         tree=masks[0] if masks else None)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(ran) == (2 if override == "matmul" else 0)  # the chosen kernel is the one that ran


def test_a_step_decides_once_per_group_for_all_its_layers(monkeypatch):
    asked = []
    decide = attention.short_query_kernel
    monkeypatch.setattr(attention, "short_query_kernel", lambda *a: asked.append(a) or decide(*a))
    q, k, v, k_cache, v_cache, tables = _setup([1], [40], seed=5)
    meta = build_metadata([1], [40], tables)
    first = paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D))
    for _ in range(3):  # the step's other layers
        torch.testing.assert_close(paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(D)), first)
    assert len(asked) == 1
    paged_attention(q, k, v, k_cache, v_cache, build_metadata([1], [40], tables), scale=1 / math.sqrt(D))
    assert len(asked) == 2  # the next step's metadata asks again


def test_the_choice_is_measured_once_and_cached_per_machine(monkeypatch, tmp_path):
    calls = []

    def fake_measure(*shape):  # the matmuls win up to 3 queries, and at 1,024 tokens of context also 9; the fused
        calls.append(shape)  # kernel at 16 queries from 2,048 tokens on
        return {(q, c): ((0.5, 0.1, 0.3) if q <= 3 or (q == 9 and c == 1024) else
                         (0.5, 0.3, 0.1) if q == 16 and c >= 2048 else (0.1, 0.5, 0.3))
                for q in range(1, SHORT_QUERY + 1) for c in PROBE_CONTEXTS}

    monkeypatch.setattr(attention_choice, "measure", fake_measure)
    assert choice_summary(HQ, HKV, D, torch.bfloat16) == ("matmul 64:1-3 128:1-3 256:1-3 512:1-3 1024:1-3,9 "
                                                          "2048:1-3 4096:1-3; fused 2048:16 4096:16")
    assert short_query_kernel(16, 3000, HQ, HKV, D, torch.bfloat16) == "fused"
    assert not single_sequence_matmul(SHORT_QUERY + 1, 1024, HQ, HKV, D, torch.bfloat16)  # long chunks: SDPA
    assert len(calls) == 1  # one measurement for every query count and context of this shape in this process
    [cached] = (tmp_path / "kernels").glob("attention-*.json")
    assert json.loads(cached.read_text())["winners"]["2@64"] == "matmul"
    attention_choice.forget()  # a new process reads the file instead of measuring again
    bf16 = torch.bfloat16
    assert single_sequence_matmul(2, 300, HQ, HKV, D, bf16) and not single_sequence_matmul(4, 300, HQ, HKV, D, bf16)
    assert single_sequence_matmul(9, 900, HQ, HKV, D, bf16) and not single_sequence_matmul(9, 1500, HQ, HKV, D, bf16)
    assert len(calls) == 1
    assert choice_summary(HQ, HKV, D, torch.float32).startswith("matmul 64:1-3 ") and len(calls) == 2  # another dtype
    cached.write_text('{"key": "an older layout", "matmul": 3}')  # unreadable as a choice: measured again
    attention_choice.forget()
    assert single_sequence_matmul(2, 300, HQ, HKV, D, bf16) and len(calls) == 3
    assert json.loads(cached.read_text())["winners"]["2@64"] == "matmul"


@pytest.mark.parametrize("head_dim", [D, 16])
def test_the_measurement_times_every_kernel_that_runs_at_every_short_query_count(head_dim):
    timings = attention_choice.measure(HQ, HKV, head_dim, torch.float32, contexts=(32, 64))
    assert sorted(timings) == [(q, c) for q in range(1, SHORT_QUERY + 1) for c in (32, 64)]
    fused = fused_runs(head_dim, torch.float32)
    assert fused == (head_dim == 16 and kernels.load() is not None)  # the kernel takes head dims in 16s
    for sdpa, matmul, ours in timings.values():
        assert sdpa > 0 and matmul > 0 and (0 < ours < math.inf if fused else ours == math.inf)


def test_a_wrong_override_says_what_is_allowed(monkeypatch):
    monkeypatch.setenv(OVERRIDE, "flash")
    with pytest.raises(ValueError, match="'sdpa', 'matmul', 'fused' or unset"):
        single_sequence_matmul(1, 64, HQ, HKV, D, torch.float32)
