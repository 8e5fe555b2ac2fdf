"""Structured outputs through the engine on a real model (smollm2-135m, float32 so greedy ties do not move with
the batch): answers that parse and validate with speculation off, n-gram, a draft model and EAGLE, the same
tokens with and without speculation (the mask makes verification lossless for the constrained distribution),
constrained and free requests in one batch, and the endings: length, and a dead end that fails its request alone."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from turbospec import LLM, SamplingParams
from turbospec.structured.params import StructuredOutputsParams

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
CONFIG = {"dtype": "float32", "num_threads": 1, "max_model_len": 512, "progress": False}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "age", "colors"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a person named Ann who is 31 and likes red and blue, as JSON.",
    "Give me a JSON record for Bob, aged 45, whose favourite colour is green.",
    "Return JSON about a child called Mia (7 years old) who loves every colour.",
]
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "draft": {"method": "draft", "model": MODEL, "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
}


def chats(llm: LLM, params: SamplingParams, prompts: list[str] = PROMPTS) -> list[str]:
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def plain() -> Iterator[LLM]:
    yield LLM(MODEL, **CONFIG)


def schema_params(max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=PERSON))


@pytest.mark.parametrize("method", list(SPECS))
def test_json_schema_answers_validate_and_match_plain_decoding(plain: LLM, method: str) -> None:
    expected = chats(plain, schema_params())
    for text in expected:
        jsonschema.validate(json.loads(text), PERSON)
    llm = LLM(MODEL, speculative_config=SPECS[method], **CONFIG)
    assert chats(llm, schema_params()) == expected
    stats = llm.spec_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_forced_tokens"] > 0
    assert stats["grammar_seconds"] > 0


def test_drafts_the_grammar_refuses_are_cut_and_counted() -> None:
    # n-gram lookup drafts the prompt's "1234", whose 4 the grammar refuses (the fourth digit must be 9)
    llm = LLM(MODEL, speculative_config=SPECS["ngram"], **CONFIG)
    prompt = "Code: 1234. Code: 1234. Code: 1234. Code:"
    pattern = r" [0-9]{3}9\."
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=pattern))
    text = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(pattern, text), text
    stats = llm.spec_stats()
    assert text == " 1239." and stats["num_grammar_cuts"] == 1 and stats["num_grammar_cut_tokens"] == 1
    assert stats["num_accepted_tokens"] == 3  # what was left of the draft was verified and kept


@pytest.mark.parametrize("ask, check", [
    (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    (StructuredOutputsParams(choice=["yes", "no"]), lambda t: t in ("yes", "no")),
    (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutputsParams(grammar='root ::= "The answer is " [0-9]+ "."'),
     lambda t: re.fullmatch(r"The answer is [0-9]+\.", t)),
])
def test_each_kind_of_ask(plain: LLM, ask: StructuredOutputsParams, check) -> None:
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=ask)
    out = plain.chat([{"role": "user", "content": "What is 12 times 12? Answer briefly."}], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
    assert check(out.outputs[0].text), out.outputs[0].text


def test_sampled_answers_stay_in_the_grammar(plain: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=120, n=1,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    for text in chats(plain, params):
        jsonschema.validate(json.loads(text), PERSON)


def test_constrained_and_free_requests_share_a_batch(plain: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = chats(plain, free, PROMPTS[:1])
    engine = plain.engine
    ids = [engine.add_request(engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]), params)
           for p, params in [(PROMPTS[0], free), (PROMPTS[1], schema_params())]]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].text
    assert done[ids[0]] == alone[0]
    jsonschema.validate(json.loads(done[ids[1]]), PERSON)


def test_a_grammar_that_cannot_finish_ends_with_length(plain: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="a{50}"))
    out = plain.generate(["Write fifty a's:"], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and set(out.text) <= {"a"}


def test_a_dead_end_fails_its_request_and_the_batch_goes_on(plain: LLM) -> None:
    engine = plain.engine
    good = engine.add_request("Say hi.", SamplingParams(temperature=0, max_tokens=8))
    bad = engine.add_request("Say hi.", SamplingParams(temperature=0, max_tokens=8,
                                                       structured_outputs=StructuredOutputsParams(regex="ab")))
    grammar = engine.requests[bad].grammar
    assert grammar is not None
    grammar.matcher.consume_token(engine.tokenizer.encode("zzz", add_special_tokens=False)[0])  # -> error state
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[bad].outputs[0].finish_reason == "error" and "dead end" in finished[bad].error
    assert finished[good].outputs[0].finish_reason in ("stop", "length")


def test_refused_combinations(plain: LLM) -> None:
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(json_object=True))
    with pytest.raises(ValueError, match="llm42"):
        plain.engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)),
                                 deterministic="llm42")
    with pytest.raises(ValueError, match="unclosed group"):
        plain.engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))
