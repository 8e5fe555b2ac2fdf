"""End-to-end engine behaviour on a real registry model (smollm2-135m, float32, CPU).

One LLM is shared by the module; tests that need other engine options (chunked prefill, a tiny KV cache)
build their own. Everything runs with one thread: the CI / dev machines have two cores at most.
"""

from __future__ import annotations

import math

import pytest

from turbospec import LLM, SamplingParams
from turbospec.kv.kv_cache import KVCache
from turbospec.models.loader import parse_dtype

MODEL = "smollm2-135m"
# A 512-token context keeps the default KV cache at ~0.7 GiB instead of 4 GiB (6 s of zero-filling).
COMMON = dict(dtype="float32", num_threads=1, progress=False)
MAX_MODEL_LEN = 512


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, max_model_len=MAX_MODEL_LEN, **COMMON)


def llm_sharing_weights(base: LLM, monkeypatch: pytest.MonkeyPatch, **options) -> LLM:
    """A second LLM with other engine options that reuses base's loaded weights (saves a reload)."""
    monkeypatch.setattr("turbospec.engine.load_model", lambda *args, **kwargs: base.engine.loaded)
    return LLM(MODEL, **COMMON, **options)


def assert_idle(llm: LLM) -> None:
    """No request left anywhere and every KV block back in the free pool."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.requests == {}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# ------------------------------------------------------------------------------------------- stop conditions
@pytest.mark.slow
def test_max_tokens_is_honoured(llm: LLM) -> None:
    out = llm.generate("1, 2, 3, 4,", greedy(7), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "length"
    assert c.stop_reason is None
    assert len(c.token_ids) == 7
    assert out.finished
    assert_idle(llm)


@pytest.mark.slow
def test_ignore_eos_generates_exactly_max_tokens(llm: LLM) -> None:
    chat = [{"role": "user", "content": "What is 2+2? Answer with a number only."}]
    n = 16
    early = llm.chat(chat, greedy(n), use_tqdm=False)[0].outputs[0]
    # Precondition: without ignore_eos this prompt ends on EOS before max_tokens.
    assert early.finish_reason == "stop" and early.stop_reason is None
    assert len(early.token_ids) < n
    eos = llm.get_tokenizer().eos_token_ids
    assert early.token_ids[-1] in eos

    full = llm.chat(chat, greedy(n, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert full.finish_reason == "length"
    assert len(full.token_ids) == n
    # Up to the EOS the two runs are the same greedy sequence.
    assert full.token_ids[: len(early.token_ids)] == early.token_ids
    # EOS is a special token: it never shows up in the text.
    assert "<|im_end|>" not in full.text


@pytest.mark.slow
def test_stop_string(llm: LLM) -> None:
    prompt = "1, 2, 3, 4,"
    free = llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0]
    assert " 7" in free.text, free.text  # precondition: the counting goes on past 7

    out = llm.generate(prompt, greedy(16, stop=" 7"), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == " 7"
    assert " 7" not in out.text
    assert out.text == free.text[: free.text.index(" 7")]
    # generation stopped at the token that completed the stop string
    assert len(out.token_ids) < len(free.token_ids)
    assert out.token_ids == free.token_ids[: len(out.token_ids)]

    kept = llm.generate(prompt, greedy(16, stop=[" 7", "never"], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.finish_reason == "stop"
    assert kept.stop_reason == " 7"
    assert kept.text == free.text[: free.text.index(" 7") + 2]
    assert kept.text.endswith(" 7")
    assert kept.token_ids == out.token_ids
    assert_idle(llm)


@pytest.mark.slow
def test_streamed_deltas_never_send_text_a_stop_string_removes(llm: LLM) -> None:
    """Counting emits " 6", ",", " " and then "7": the lone " " must not be streamed before the stop string
    " 7" completes and cuts it."""
    engine = llm.engine
    final_text = llm.generate("1, 2, 3, 4,", greedy(16, stop=" 7"), use_tqdm=False)[0].outputs[0].text
    engine.add_request("1, 2, 3, 4,", greedy(16, stop=" 7"))
    streamed = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            streamed += o.delta_text
            assert final_text.startswith(streamed)  # a prefix of the final text at every step
    assert streamed == final_text
    assert_idle(llm)


@pytest.mark.slow
def test_stop_token_ids(llm: LLM) -> None:
    prompt = "The capital of France is"
    free = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[2]
    assert free.token_ids.index(stop_tok) == 2, "precondition: the 3rd greedy token does not occur earlier"
    tok = llm.get_tokenizer()
    assert tok.decode([stop_tok]) != ""  # precondition: a token with visible text

    out = llm.generate(prompt, greedy(12, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    assert out.token_ids == free.token_ids[:3]  # the stop token itself is the last token, as in vLLM
    assert out.text == tok.decode(free.token_ids[:2])  # ... but its text is not shown
    kept = llm.generate(prompt, greedy(12, stop_token_ids=[stop_tok], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == tok.decode(free.token_ids[:3])
    assert_idle(llm)


# ------------------------------------------------------------------------------------------------- logprobs
@pytest.mark.slow
def test_logprobs(llm: LLM) -> None:
    out = llm.generate("The capital of France is", greedy(8, logprobs=3), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 8
    total = 0.0
    for tok, step in zip(out.token_ids, out.logprobs):
        assert tok in step
        alts = sorted((lp for lp in step.values() if lp.rank is not None), key=lambda lp: lp.rank)
        assert [lp.rank for lp in alts] == [1, 2, 3]
        values = [lp.logprob for lp in alts]
        assert values == sorted(values, reverse=True)
        assert all(lp.logprob <= 0 for lp in step.values())
        assert all(math.isfinite(lp.logprob) for lp in step.values())
        # greedy picks the argmax: the chosen token is the rank-1 alternative, so the dict has 3 entries
        assert step[tok].rank == 1
        assert len(step) == 3
        assert step[tok].logprob == pytest.approx(values[0], abs=1e-6)
        total += step[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert out.cumulative_logprob < 0

    plain = llm.generate("The capital of France is", greedy(8), use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert plain.token_ids == out.token_ids


# ---------------------------------------------------------------------------------------- sampling / seeds
@pytest.mark.slow
def test_n_completions_are_indexed_and_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12)
    first = llm.generate("Once upon a time", params, use_tqdm=False)
    assert len(first) == 1
    outs = first[0].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    assert all(c.finished and 1 <= len(c.token_ids) <= 12 for c in outs)
    assert len({tuple(c.token_ids) for c in outs}) > 1, "the 3 completions use different seeds"

    second = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs
    assert [c.index for c in second] == [0, 1, 2]
    assert [c.token_ids for c in second] == [c.token_ids for c in outs]
    assert [c.text for c in second] == [c.text for c in outs]
    assert_idle(llm)


@pytest.mark.slow
def test_seeded_request_is_independent_of_its_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = "My favourite animal is"
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids

    others = [
        "Hi",
        "The quick brown fox jumps over the lazy dog and then",
        "def fibonacci(n):",
        "In 1492, Columbus sailed across the Atlantic Ocean. He was looking for a new route to India, but",
        "Water boils at",
    ]
    prompts = others[:2] + [prompt] + others[2:]
    params = [SamplingParams(temperature=1.0, max_tokens=m) for m in (5, 20, 9, 3, 12)]
    params.insert(2, seeded)
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    assert len(alone) == 16
    assert_idle(llm)


# ------------------------------------------------------------------------------------ scheduling features
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when the German goldsmith Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden screw press adapted from the ones used for making wine. "
    "Within fifty years printing shops had opened in more than two hundred European cities, and"
)


@pytest.mark.slow
def test_chunked_prefill_matches_default_engine(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = llm.get_tokenizer().encode(LONG_PROMPT)
    assert 50 <= len(ids) <= 70
    expected = llm.generate(LONG_PROMPT, greedy(12), use_tqdm=False)[0].outputs[0].token_ids

    small = llm_sharing_weights(llm, monkeypatch, max_model_len=128, max_num_batched_tokens=8)
    engine = small.engine
    rid = engine.add_request(LONG_PROMPT, greedy(12))
    steps_before_first_token = 0
    streamed_text, streamed_ids = "", []
    final = None
    while engine.has_unfinished_requests():
        outs = engine.step()
        assert engine.last_step.num_batched_tokens <= 8
        if not streamed_ids and not any(o.delta_token_ids for o in outs):
            steps_before_first_token += 1
        for o in outs:
            streamed_text += o.delta_text
            streamed_ids += o.delta_token_ids
            if o.finished:
                final = o
    assert final is not None and final.request_id == rid
    # the prompt really was prefilled in chunks of 8 tokens
    assert steps_before_first_token == math.ceil(len(ids) / 8) - 1
    assert final.outputs[0].token_ids == expected
    # the streamed deltas add up to the final output
    assert streamed_ids == expected
    assert streamed_text == final.outputs[0].text
    assert_idle(small)


PREEMPT_PROMPTS = [  # 34 to 44 tokens each
    "Here is a short story about an old dragon who lived alone in a dark cave high in the snowy mountains above a "
    "small, quiet village of farmers and shepherds. Every single winter, when the first snow fell, the dragon",
    "The following is a recipe for a simple, warming tomato soup that can easily be prepared in less than thirty "
    "minutes with ingredients that are found in most ordinary kitchens. First of all,",
    "Photosynthesis is the biological process by which green plants, algae and some kinds of bacteria convert the "
    "energy of sunlight into chemical energy that is stored in sugars. During this process",
    "A good night of sleep matters a great deal for long-term health: adults who regularly sleep less than seven "
    "hours a night have a clearly higher risk of several serious diseases, including",
    "Python is a popular, general-purpose programming language that is known for its readable syntax, its friendly "
    "community and its very large standard library. One of its most useful features is",
    "The Roman Empire was one of the largest and most powerful empires in ancient history, stretching from the cold "
    "island of Britain in the north to the deserts of Egypt in the south. Its capital city,",
]


@pytest.mark.slow
def test_preemption_recomputes_and_matches(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = llm.get_tokenizer()
    lens = [len(tok.encode(p)) for p in PREEMPT_PROMPTS]
    assert all(32 <= n <= 48 for n in lens), lens
    params = greedy(40, ignore_eos=True)
    roomy = token_ids(llm.generate(PREEMPT_PROMPTS, params, use_tqdm=False))

    block_size = 16
    per_block = KVCache.bytes_per_block(llm.engine.model_config, block_size, parse_dtype("float32"))
    gib = 12.5 * per_block / 2**30  # room for 12 blocks: 2 of the 6 sequences at full length
    tiny = llm_sharing_weights(llm, monkeypatch, max_model_len=128, block_size=block_size, kv_cache_memory_gib=gib)
    assert tiny.engine.blocks.num_blocks == 12
    outs = tiny.generate(PREEMPT_PROMPTS, params, use_tqdm=False)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert [len(t) for t in token_ids(outs)] == [40] * 6
    assert sum(o.metrics.num_preemptions for o in outs) == tiny.engine.scheduler.num_preemptions
    assert token_ids(outs) == roomy
    assert_idle(tiny)


@pytest.mark.slow
def test_prefix_caching_reuses_full_blocks(llm: LLM) -> None:
    prompt = (
        "Prefix caching test. A lighthouse keeper on a remote island writes in his journal every evening. "
        "He notes the weather, the ships that passed, the birds that landed on the rocks and the state of "
        "the great lamp. One stormy night in November he writes that"
    )
    n = len(llm.get_tokenizer().encode(prompt))
    bs = llm.engine.config.block_size
    assert n > 3 * bs
    first = llm.generate(prompt, greedy(10), use_tqdm=False)[0]
    second = llm.generate(prompt, greedy(10), use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    cached = second.metrics.num_cached_tokens
    assert cached > 0
    assert cached % bs == 0
    assert cached <= n - 1  # at least one prompt token is always computed
    assert cached >= (n - 1) // bs * bs
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_idle(llm)


@pytest.mark.slow
def test_abort_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    # ignore_eos: this chat-tuned model may well end a plain prompt on EOS right away
    rid = engine.add_request("Tell me a long story about a cat.", greedy(50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.has_unfinished_requests()
    assert engine.blocks.has_seq(rid)
    out = engine.abort_request(rid)
    assert out is not None
    assert out.request_id == rid
    assert out.finished
    assert out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 2  # one sampled token per step
    assert not engine.blocks.has_seq(rid)
    assert_idle(llm)
    assert engine.step() == []
    assert engine.abort_request(rid) is None  # a second abort is a no-op


@pytest.mark.slow
def test_batch_agreement(llm: LLM) -> None:
    prompts = [
        "Hello",
        "The weather today is",
        "Five fun facts about octopuses:",
        "Write a Python function that returns the square of a number.",
        "Once upon a time, in a kingdom far away, there lived a princess who",
        "Q: What is the boiling point of water at sea level? A:",
        "The three primary colours are red, blue and",
        "In mathematics, a prime number is a natural number greater than 1 that is not a product of two "
        "smaller natural numbers. The first few primes are",
    ]
    params = greedy(24, ignore_eos=True)
    alone = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = token_ids(llm.generate(prompts, params, use_tqdm=False))
    rate = sum(a == b for a, b in zip(alone, together)) / len(prompts)
    print(f"batch agreement: {rate:.2f}")
    assert rate >= 0.75
    assert_idle(llm)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.slow
def test_bad_prompts_raise_value_error(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=str(vocab)):
        llm.generate([1, 2, vocab], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=r"token ids"):
        llm.generate([-1], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("Hello there", greedy(MAX_MODEL_LEN), use_tqdm=False)
    with pytest.raises(ValueError, match=r"2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [greedy(2), greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="content"):
        llm.chat([{"role": "user"}], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="content"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "text": "hi"}]], greedy(2),
                 use_tqdm=False)
    # a bad prompt late in a batch must not leave the earlier, already queued ones behind
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", "also fine", ""], greedy(4), use_tqdm=False)
    assert_idle(llm)
    # and the engine still works afterwards
    assert len(llm.generate("fine", greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_bad_engine_options_raise_value_error() -> None:
    # All of these fail before any weights are loaded.
    with pytest.raises(ValueError, match="foo"):
        LLM(MODEL, foo=1)
    with pytest.raises(ValueError, match="int7"):
        LLM(MODEL, dtype="int7", num_threads=1)
    with pytest.raises(ValueError, match="smollm2-135m") as info:
        LLM("no-such-model", dtype="float32", num_threads=1, progress=False)
    assert "no-such-model" in str(info.value)
    assert "qwen2.5-coder-0.5b" in str(info.value)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
