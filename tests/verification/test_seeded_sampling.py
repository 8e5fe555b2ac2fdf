"""A seeded request samples the same tokens whatever it is batched with and however many drafts the goodput
controller lets it verify: every token position draws its noise from (seed, position), the target samples with it,
drafts are accepted by equality with that sample, and a draft model drafts with the same noise (so its drafts
still match where the two models agree). Float32, where the logits themselves do not move with the batch here."""

from __future__ import annotations

import pytest
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams

SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=40, ignore_eos=True)
OTHERS = [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=24 + 4 * i, ignore_eos=True) for i in range(7)]
PROMPT = "Repeat after me: the cat sat on the mat. the cat sat on the mat. the cat"

PROPOSERS = {
    "none": None,
    "ngram": {"method": "ngram"},
    "lookahead": {"method": "lookahead"},
    "draft": {"method": "draft", "model": "smollm2-135m"},
    "eagle": {"method": "eagle"},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROPOSERS))
def test_a_seeded_request_samples_the_same_tokens_in_any_batch(name: str) -> None:
    llm = LLM("smollm2-135m", dtype="float32", num_threads=1, max_model_len=512, progress=False,
              speculative_config=PROPOSERS[name])
    alone = llm.generate([PROMPT], SEEDED, use_tqdm=False)[0].outputs[0].token_ids
    for others in (1, 3, 7):
        prompts = [PROMPT] + [SPEC_PROMPTS[i % len(SPEC_PROMPTS)] for i in range(others)]
        outs = llm.generate(prompts, [SEEDED] + OTHERS[:others], use_tqdm=False)
        assert outs[0].outputs[0].token_ids == alone, f"beside {others} other requests"
    if PROPOSERS[name] is not None:
        stats = llm.spec_stats()
        assert stats["num_drafts"] > 0 and stats["num_accepted_tokens"] > 0  # drafts were made, and kept


def test_seeded_sampled_requests_verify_chains_by_position() -> None:
    from turbospec.models.tokenizer import ByteTokenizer, IncrementalDetokenizer
    from turbospec.request import Request

    def request(**params) -> Request:
        return Request("r", [1, 2], SamplingParams(**params), IncrementalDetokenizer(ByteTokenizer(256)), None)

    assert request(temperature=0.8, seed=3).samples_by_position
    assert not request(temperature=0.8, seed=3).accepts_trees  # positional samples verify one path
    assert not request(temperature=0.8).samples_by_position  # unseeded: its generator's stream, trees allowed
    assert request(temperature=0.8).accepts_trees
    assert not request(temperature=0, seed=3).samples_by_position  # greedy needs no noise
