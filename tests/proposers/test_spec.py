"""Speculative decoding inside the engine: lossless greedy output, KV rollback, mixed batches, preemption,
aborts, statistics and config validation. The verifier's exact distributions are tested in test_verifier."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams
from turbospec.config import SpeculativeConfig
from turbospec.kv.kv_cache import KVCache

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPTS = SPEC_PROMPTS
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
SELF_DRAFT = {"method": "draft", "model": MODEL, "num_speculative_tokens": 3}
LAYER_SKIP = {"method": "layer-skip", "skip_layers": [4, 8, 12, 16, 20], "num_speculative_tokens": 3}
LOOKAHEAD = {"method": "lookahead", "num_speculative_tokens": 6}
# a draft vocabulary far smaller than the answers' tokens: drafts outside it (or in the prompt) are exercised
CUT_DRAFT = {**SELF_DRAFT, "draft_vocab_size": 256}
CUT_LAYER_SKIP = {**LAYER_SKIP, "draft_vocab_size": 256}
# the draft's weights rounded to 4 bits (lossy for the draft only): greedy output must not move
INT4_DRAFT = {**SELF_DRAFT, "quantization": "int4"}


def _llm(**kw) -> LLM:
    # a small KV cache: several engines (and a draft model's cache) are alive at once in this module
    kw.setdefault("kv_cache_memory_gib", 0.5)
    return LLM(MODEL, dtype="float32", num_threads=1, progress=False, **kw)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _llm().generate(PROMPTS, GREEDY, use_tqdm=False)]


def _agreement(outs, ref) -> float:
    return sum(o.outputs[0].token_ids == r for o, r in zip(outs, ref)) / len(ref)


def _assert_no_leaks(llm: LLM) -> None:
    engine = llm.engine
    assert engine.blocks.num_free_blocks == engine.kv.num_blocks
    proposer_blocks = getattr(engine.speculation.proposer, "blocks", None)
    if proposer_blocks is not None:
        assert proposer_blocks.num_free_blocks == proposer_blocks.num_blocks
        assert not engine.speculation.proposer.computed and not engine.speculation.proposer.pending


@pytest.mark.parametrize("config", [NGRAM, SELF_DRAFT, LAYER_SKIP, LOOKAHEAD, CUT_DRAFT, CUT_LAYER_SKIP, INT4_DRAFT],
                         ids=["ngram", "draft", "layer-skip", "lookahead", "draft-cut-vocab", "layer-skip-cut-vocab",
                              "draft-requantized-int4"])
def test_greedy_speculation_reproduces_plain_decoding(config, plain):
    llm = _llm(speculative_config=config)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    rate = _agreement(outs, plain)
    stats = llm.spec_stats()
    print(f"{config['method']}: agreement with plain greedy {rate:.2f}, tau {stats['mean_accepted_length']:.2f}")
    assert rate == 1.0
    assert stats["num_drafts"] > 0 and stats["num_draft_tokens"] >= stats["num_accepted_tokens"] > 0
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    _assert_no_leaks(llm)


def test_a_model_drafting_for_itself_is_accepted_almost_always():
    llm = _llm(speculative_config=SELF_DRAFT)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.spec_stats()
    assert stats["acceptance_rate"] >= 0.95, stats
    assert stats["mean_accepted_length"] >= 3.8  # k = 3 plus the bonus token


def test_mixed_batch_with_prefill_chunks_next_to_verification(plain):
    # An 8-token budget forces prompts to prefill in chunks while earlier requests already verify drafts.
    llm = _llm(speculative_config=NGRAM, max_num_batched_tokens=8)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _agreement(outs, plain) == 1.0
    _assert_no_leaks(llm)


@pytest.mark.parametrize("config", [SELF_DRAFT, LAYER_SKIP, LOOKAHEAD], ids=["draft", "layer-skip", "lookahead"])
def test_preemption_while_speculating_loses_nothing(config, plain):
    probe = _llm()
    per_block = KVCache.bytes_per_block(probe.engine.model_config, 16, probe.engine.dtype)
    del probe
    # 11 blocks of 16 tokens: not enough for five ~60-token sequences with 3 drafts each at once
    llm = _llm(speculative_config=config, kv_cache_memory_gib=11 * per_block / 2**30, max_model_len=128)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _agreement(outs, plain) == 1.0
    _assert_no_leaks(llm)


def test_abort_while_speculating_frees_target_and_draft_blocks():
    llm = _llm(speculative_config=SELF_DRAFT)
    engine = llm.engine
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=64))
    other = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=8))
    for _ in range(3):
        engine.step()
    assert engine.speculation.proposer.blocks.num_free_blocks < engine.speculation.proposer.blocks.num_blocks
    out = engine.abort_request(rid)
    assert out is not None and out.outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert other not in engine.requests
    _assert_no_leaks(llm)


def test_sampled_speculation_is_seeded_and_in_vocabulary():
    llm = _llm(speculative_config=SELF_DRAFT)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24, ignore_eos=True)
    first = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    assert all(len(o.outputs[0].token_ids) == 24 for o in first)
    _assert_no_leaks(llm)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "medusa2"}, "unknown speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft"}, "needs a draft model"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min (4) must be <="),
        ({"method": "ngram", "typo": 1}, "unknown speculative config key"),
        ("{not json", "not valid JSON"),
        ({"method": "ngram", "skip_layers": [3]}, "skip_layers only applies to method 'layer-skip'"),
        ({"method": "layer-skip", "skip_layers": [3, -1]}, "skip_layers must be a list of layer indices"),
        ({"method": "layer-skip", "skip_layers": "3,4"}, "skip_layers must be a list of layer indices"),
        ({"method": "lookahead", "lookahead_ngram": 1}, "lookahead_ngram must be >= 2"),
        ({"method": "lookahead", "lookahead_window": 0}, "lookahead_window must be an integer >= 1"),
        ({"method": "draft", "model": "m", "draft_vocab_size": -1}, "draft_vocab_size must be"),
        ({"method": "draft", "model": "m", "draft_vocab_size": "all"}, "draft_vocab_size must be"),
        ({"method": "ngram", "draft_vocab_size": 4096}, "draft_vocab_size only applies to methods draft, layer-skip"),
        ({"method": "draft", "model": "m", "quantization": "int8"}, "quantization must be null"),
        ({"method": "layer-skip", "quantization": "int4"}, "quantization applies to a separate draft model"),
        ({"method": "draft", "model": "m", "draft_stop": "entropy"}, "draft_stop must be one of confidence, none"),
    ],
)
def test_invalid_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.parse(config)


def test_draft_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="different vocabulary"):
        _llm(speculative_config={"method": "draft", "model": "gemma3-270m"})


def test_cli_reports_stats_and_refuses_bad_configs():
    base = [sys.executable, "-m", "turbospec.cli", "generate", "--model", MODEL, "--prompt", "1, 2, 3, 4, 5, 6,",
            "--max-tokens", "12", "--dtype", "float32", "--num-threads", "1", "--json"]
    ok = subprocess.run(base + ["--speculative-config", json.dumps(NGRAM)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    stats = json.loads(ok.stdout)["stats"]
    assert {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"} <= set(stats)
    bad = subprocess.run(base + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "num_speculative_tokens" in bad.stderr and "Traceback" not in bad.stderr
    lossy = subprocess.run(base + ["--speculative-config", '{"method": "ngram", "acceptance": "adasd"}'],
                           capture_output=True, text=True)
    assert lossy.returncode == 2 and "needs speculative method 'draft'" in lossy.stderr
    assert "Traceback" not in lossy.stderr
