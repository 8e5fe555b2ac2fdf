"""Layer-skip self-speculation: the skipped-set search scores what the live draft would see, the plan is cached
and reused, and bad sets are refused. (Greedy equality with plain decoding, preemption and the batch-invariant
bitwise check are in test_spec.py and test_determinism.py next to the other proposers.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from turbospec import LLM, SamplingParams
from turbospec.kv.block_manager import BlockManager
from turbospec.kv.kv_cache import KVCache
from turbospec.proposers.layer_skip import LayerSkipProposer, SkippingModel
from turbospec.runner import ModelRunner, SeqInput
from turbospec.tuning.layer_search import LayerSkipPlan, _Scorer, expected_speedup, load_or_search, plan_path

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, dtype="float32", num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False)


def test_expected_speedup_formula():
    # a = 0.8, c = 0.5: k = 1 gives 1.8 / 1.5 = 1.2; k = 2 gives 2.44 / 2 = 1.22; k = 3 gives 2.952 / 2.5 = 1.18
    gain, k = expected_speedup(0.8, 0.5)
    assert k == 2 and gain == pytest.approx(2.44 / 2.0)
    assert expected_speedup(0.1, 0.9)[0] < 1  # drafting that cannot pay is ranked, not hidden


def test_scorer_sees_the_full_models_kv_like_the_live_draft(llm):
    """Each scored position must predict what a real draft step would: the full model's K/V before it, the
    skipped model's own K/V for its own position."""
    engine = llm.engine
    tok = engine.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. Then the fox")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    answer = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    ids = prompt + answer
    skip = [2, 5, 9, 14, 20, 25]
    scorer = _Scorer(engine, [(ids, len(prompt))])
    # the scorer's rows, recomputed by hand below
    model = engine.loaded.model
    kv = KVCache.allocate(engine.model_config, 8, 16, engine.dtype, "cpu")
    blocks = BlockManager(8, 16, enable_prefix_caching=False)
    full = ModelRunner(model, kv, blocks, "cpu")
    draft = ModelRunner(SkippingModel(model, [i for i in range(len(model.layers)) if i not in skip]), kv, blocks, "cpu")
    hits = 0
    for j in range(len(prompt) - 1, len(ids) - 1):
        blocks.allocate("x", ids[: j + 1], j + 1)
        if j:
            full.run([SeqInput("x", ids[:j], 0, 0)])  # full K/V for positions 0..j-1
        logits = draft.run([SeqInput("x", [ids[j]], j, 1)]).logits  # the draft's step at position j
        hits += int(logits.argmax(-1).item() == ids[j + 1])
        blocks.free("x")
    assert scorer.agreement(skip) == pytest.approx(hits / len(answer))
    assert scorer.agreement([]) == 1.0  # float32: the full model predicts its own greedy answer exactly
    assert 0 < scorer.agreement(skip) < 1


def test_search_is_cached_and_reused(llm, tmp_path, monkeypatch):
    from turbospec.tuning.layer_search import search_skip_layers

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    calls = []

    def small_search(engine, progress=True):
        calls.append(1)
        return search_skip_layers(engine, num_prompts=2, max_tokens=8, max_skip_fraction=0.1, candidates_per_round=2,
                                  progress=False)

    monkeypatch.setattr("turbospec.tuning.layer_search.search_skip_layers", small_search)
    plan = load_or_search(llm.engine, progress=False)
    assert calls == [1] and plan_path(llm.engine).exists()
    assert plan.num_layers == 30 and 1 <= len(plan.skip) <= 3 and 0 not in plan.skip and 29 not in plan.skip
    # every single inner layer was scored, then up to 3 rounds of 2 candidates
    assert len(plan.trials) == 28 + 2 * 3
    best = max(plan.trials, key=lambda t: t["expected_speedup"])
    assert plan.skip == best["skip"] and plan.expected_speedup == best["expected_speedup"]
    assert 0 < plan.cost_fraction < 1
    again = load_or_search(llm.engine, progress=False)
    assert calls == [1] and again == LayerSkipPlan.load(plan_path(llm.engine))
    # an engine built without skip_layers uses the cached set
    spec = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False,
               speculative_config={"method": "layer-skip", "num_speculative_tokens": 2})
    assert isinstance(spec.engine.speculation.proposer, LayerSkipProposer) and spec.engine.speculation.proposer.skip == plan.skip
    assert calls == [1]


def test_layer_skip_drafts_leave_no_draft_kv_behind(llm):
    """After generating with layer-skip drafts, the target's cache holds the full model's K/V at every accepted
    position: a prefix-cache hit on the finished sequence gives the same next-token logits as a fresh prefill."""
    spec = LLM(MODEL, dtype="float32", num_threads=1, max_model_len=256, kv_cache_memory_gib=0.1, progress=False,
               speculative_config={"method": "layer-skip", "skip_layers": [3, 7, 11, 15, 19, 23],
                                   "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = spec.generate(["List five colours of the rainbow:"], params, use_tqdm=False)[0]
    assert spec.spec_stats()["num_accepted_tokens"] > 0
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    cached = spec.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                           use_tqdm=False)[0]
    assert cached.metrics.num_cached_tokens >= 32
    fresh = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                         use_tqdm=False)[0]
    a, b = cached.outputs[0].logprobs[0], fresh.outputs[0].logprobs[0]
    assert a.keys() == b.keys()
    assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)


def test_bad_skip_sets_are_refused():
    with pytest.raises(ValueError, match=r"skip_layers \[30\] out of range: the model has layers 0..29"):
        LLM(MODEL, dtype="float32", num_threads=1, max_model_len=128, kv_cache_memory_gib=0.05, progress=False,
            speculative_config={"method": "layer-skip", "skip_layers": [3, 30]})
    with pytest.raises(ValueError, match="names every layer"):
        LLM(MODEL, dtype="float32", num_threads=1, max_model_len=128, kv_cache_memory_gib=0.05, progress=False,
            speculative_config={"method": "layer-skip", "skip_layers": list(range(30))})


@pytest.mark.parametrize("flags, message", [(["--max-skip-fraction", "1.5"], "--max-skip-fraction must be in (0, 1)"),
                                            (["--num-prompts", "0"], "--num-prompts must be >= 1")])
def test_cli_search_layers_refuses_bad_flags(flags, message):
    run = subprocess.run([sys.executable, "-m", "turbospec.cli", "search-layers", "--model", MODEL, *flags],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr, run.stderr
