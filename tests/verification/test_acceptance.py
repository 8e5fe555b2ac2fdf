"""Acceptance policies (verification/lossy.py): the criteria against direct formulas, relaxed verification against a
brute-force reference, AdaSD's adaptive thresholds, validation, and end-to-end runs on smollm2-135m with a
perturbed copy of itself as the draft (a real draft/target pair that disagrees often enough to exercise every
rule): lossless policies reproduce plain greedy decoding, typical acceptance keeps only tokens its rule allows
(checked against HF transformers' distribution), and every lossy answer says so."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from turbospec import LLM, SamplingParams
from turbospec.config import EngineConfig, SpeculativeConfig
from turbospec.verification.chain import verify
from turbospec.verification.lossy import AdaptiveThresholds, entropy, js_distance, relax_drafts, typical_accepts

MODEL = "smollm2-135m"
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The three primary colours are", "Question: what is 17 * 3?\nAnswer:"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def _random_probs(rows: int, vocab: int, seed: int, sharp: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * sharp).softmax(dim=-1)


# --- criteria ---------------------------------------------------------------------------------------------------

def test_entropy_and_js_distance_match_their_formulas():
    p, q = _random_probs(6, 50, 1).double(), _random_probs(6, 50, 2).double()
    assert torch.allclose(entropy(p).double(), -(p * p.log()).sum(-1), atol=1e-5)
    assert math.isclose(float(entropy(torch.full((1, 64), 1 / 64))), math.log(64), rel_tol=1e-5)
    m = 0.5 * (p + q)
    kl = lambda a, b: (a * (a / b).log()).sum(-1)
    reference = (0.5 * (kl(p, m) + kl(q, m)) / math.log(2)).sqrt()
    assert torch.allclose(js_distance(p, q).double(), reference, atol=1e-5)
    assert float(js_distance(p[:1], p[:1])) < 1e-3  # identical distributions
    disjoint_p, disjoint_q = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert math.isclose(float(js_distance(disjoint_p, disjoint_q)), 1.0, rel_tol=1e-5)  # the distance's maximum


def test_typical_acceptance_is_medusas_rule():
    p = _random_probs(200, 30, 3, sharp=1.5)
    tokens = torch.randint(0, 30, (200,), generator=torch.Generator().manual_seed(4))
    got = typical_accepts(p, tokens, eps=0.09, delta=0.3)
    for row in range(200):
        h = -(p[row] * p[row].log()).sum()
        want = p[row, tokens[row]] > min(0.09, 0.3 * math.exp(-float(h)))
        assert bool(got[row]) == bool(want)
    assert 0 < int(got.sum()) < 200  # both outcomes occur, so the comparison above is not vacuous


# --- relaxed verification ---------------------------------------------------------------------------------------

def test_greedy_relaxed_verification_matches_a_brute_force_reference():
    rng = np.random.default_rng(5)
    for trial in range(50):
        ks = [int(k) for k in rng.integers(0, 5, size=3)]
        probs = _random_probs(sum(k + 1 for k in ks), 12, 100 + trial, sharp=3.0)
        starts = list(np.cumsum([0] + [k + 1 for k in ks])[:-1])
        argmax = probs.argmax(-1).tolist()
        # drafts equal the argmax half the time, so that every branch is reached
        drafts = [[argmax[s + j] if rng.random() < 0.5 else int(rng.integers(12)) for j in range(k)]
                  for s, k in zip(starts, ks)]
        relaxed = [bool(rng.random() < 0.3) for k in ks for _ in range(k)]
        out = verify(probs, starts, drafts, [None] * 3, [None] * 3, torch.tensor(relaxed, dtype=torch.bool))
        pos = 0
        for i, (s, d) in enumerate(zip(starts, drafts)):
            n = 0
            while n < len(d) and (d[n] == argmax[s + n] or relaxed[pos + n]):
                n += 1
            assert out.num_accepted[i] == n
            assert out.tokens[i] == d[:n] + [argmax[s + n]]  # the correction is the target's own token
            assert out.exact_accepted[pos: pos + len(d)] == [t == argmax[s + j] for j, t in enumerate(d)]
            pos += len(d)


def test_sampled_relaxation_only_adds_accepted_tokens():
    """Same generator state, same uniforms: relaxed flags can only lengthen the accepted prefix."""
    for trial in range(40):
        probs = _random_probs(5, 20, 200 + trial)
        q = _random_probs(4, 20, 300 + trial)
        drafts = [[int(torch.multinomial(q[j], 1, generator=torch.Generator().manual_seed(trial * 7 + j)))
                   for j in range(4)]]
        relaxed = torch.tensor([trial % 2 == 0, False, True, trial % 3 == 0])
        exact = verify(probs, [0], drafts, [q], [torch.Generator().manual_seed(trial)])
        lossy = verify(probs, [0], drafts, [q], [torch.Generator().manual_seed(trial)], relaxed)
        assert lossy.num_accepted[0] >= exact.num_accepted[0]
        assert lossy.exact_accepted == exact.exact_accepted


def test_relax_drafts_reads_each_policy_rule():
    probs = _random_probs(8, 16, 9, sharp=1.0)
    soft = _random_probs(3, 16, 10, sharp=1.0)
    thresholds = AdaptiveThresholds.fresh()
    thresholds.observe_verification([0.5], [True])  # JS threshold 0.5
    drafts = [[1, 2, 3], [4, 5, 6]]
    flags, distances = relax_drafts(["typical", "adasd-verification"], [0, 4], drafts, probs, [None, soft],
                                    thresholds, 0.09, 0.3)
    assert flags[:3].tolist() == typical_accepts(probs[0:3], torch.tensor([1, 2, 3])).tolist()
    d = js_distance(probs[4:7], soft)
    assert flags[3:].tolist() == (d < 0.5).tolist()
    assert all(math.isnan(x) for x in distances[:3]) and np.allclose(distances[3:], d.tolist())
    flags, _ = relax_drafts(["exact", "adasd-generation"], [0, 4], drafts, probs, [None, soft], thresholds)
    assert not flags.any()  # lossless policies relax nothing


def test_adaptive_thresholds_follow_what_verification_saw():
    t = AdaptiveThresholds.fresh()
    # nothing seen: nothing relaxed, nothing cut, an unseen entropy says 0.5
    assert t.js_threshold == 0.0 and t.entropy_threshold == math.inf and t.cost_ratio is None
    assert t.acceptance_at(3.0) == 0.5 and t.keep_drafting(9.0, 5, 0.2, 1.0) == pytest.approx(0.1)
    t.observe_verification([0.1, 0.3, 0.9], [True, True, False])  # only agreements set the JS threshold
    assert math.isclose(t.js_threshold, 0.2)

    t.observe_costs(draft_step_s=1.0, target_step_s=4.0)  # a draft step costs a quarter of a target step
    t.observe_generation([0.1] * 98, [True] * 98)  # sure drafts were accepted
    t.observe_generation([4.2] * 8, [False] * 8)  # unsure ones were not
    assert t.cost_ratio == 0.25
    assert t.acceptance_at(0.15) == pytest.approx(99 / 100) and t.acceptance_at(4.4) == pytest.approx(1 / 10)
    # after one sure token (expected 1 accepted, goodput (1 + 1) / (1 + 0.25) = 1.6 tokens per target step):
    assert t.keep_drafting(0.1, 1, 1.0, 1.0) == pytest.approx(0.99)  # 0.99 / 0.25 = 3.96 pays
    assert t.keep_drafting(4.2, 1, 1.0, 1.0) is None  # 0.1 / 0.25 = 0.4 does not
    assert t.keep_drafting(4.2, 0, 1.0, 0.0) == pytest.approx(0.1)  # the first draft token is always kept
    assert t.entropy_threshold == pytest.approx(4.2)  # unseen bins (0.5 each) still pay; the 4.2-4.3 nat bin does not
    for _ in range(99):  # drafting got much cheaper (running means): the cut moves away
        t.observe_costs(draft_step_s=0.0)
    assert t.keep_drafting(4.2, 1, 1.0, 1.0) is not None


def test_the_confidence_stop_keeps_the_unsure_token_and_stops_before_the_next_forward():
    t = AdaptiveThresholds.fresh()
    # nothing measured yet: a draft model drafts to its cap, each token's survival at the unseen bins' 0.5
    assert t.draft_more(9.0, 0, 1.0, 0.0) == (0.5, 0.5, True)
    t.observe_costs(draft_step_s=1.0, target_step_s=4.0)  # r = 0.25
    t.observe_generation([0.1] * 98, [True] * 98)  # acceptance 0.99 in the 0.1-0.2 nat bin
    t.observe_generation([4.2] * 8, [False] * 8)  # 0.1 in the 4.2-4.3 bin
    # a sure first token: survival 0.99, expected 0.99; the next forward's gain 0.99 x 0.99 = 0.98 per 0.25 of a
    # target step beats the draft so far, (1 + 0.99) / (1 + 0.25) = 1.59 tokens per target step
    survival, expected, more = t.draft_more(0.1, 0, 1.0, 0.0)
    assert (survival, expected, more) == (pytest.approx(0.99), pytest.approx(0.99), True)
    # an unsure second token is kept (its forward is paid): survival 0.099, and the next forward's gain
    # 0.099 x 0.1 / 0.25 = 0.04 does not beat (1 + 1.089) / (1 + 2 x 0.25) = 1.39
    survival, expected, more = t.draft_more(4.2, 1, survival, expected)
    assert (survival, expected, more) == (pytest.approx(0.099), pytest.approx(1.089), False)
    # AdaSD's rule, by contrast, drops that token (the first is always kept)
    assert t.keep_drafting(4.2, 1, 0.99, 0.99) is None
    free = AdaptiveThresholds.fresh()
    free.observe_costs(draft_step_s=0.0, target_step_s=1.0)  # a draft step too quick to measure: never a stop
    assert free.draft_more(4.2, 3, 0.01, 2.0)[2] and free.keep_drafting(4.2, 3, 0.01, 2.0) is not None


# --- validation -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("config", "message"), [
    ({"method": "ngram", "acceptance": "lossy"}, "unknown acceptance policy"),
    ({"method": "ngram", "acceptance": "adasd"}, "needs speculative method 'draft'"),
    ({"method": "ngram", "acceptance": "typical", "typical_epsilon": 0}, "typical_epsilon must be"),
    ({"method": "ngram", "acceptance": "typical", "typical_delta": 1.5}, "typical_delta must be"),
])
def test_bad_acceptance_configs_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)


def test_lossy_acceptance_and_a_deterministic_mode_are_refused_together():
    with pytest.raises(ValueError, match="lossy"):
        EngineConfig(MODEL, deterministic="llm42", speculative_config={"method": "ngram", "acceptance": "typical"})
    EngineConfig(MODEL, deterministic="llm42", speculative_config={"method": "draft", "model": MODEL,
                                                                    "acceptance": "adasd-generation"})  # lossless


# --- end to end -------------------------------------------------------------------------------------------------

# small KV caches: this module holds several engines (and an HF model) at once
SMALL = {"dtype": "float32", "num_threads": 1, "progress": False, "max_model_len": 256, "kv_cache_memory_gib": 0.25}


def _llm(acceptance: str, k: int | str = 4) -> LLM:
    spec = {"method": "draft", "model": MODEL, "num_speculative_tokens": k, "acceptance": acceptance}
    llm = LLM(MODEL, **SMALL, enable_prefix_caching=False, speculative_config=spec)
    # The draft is the target with noise on two layers: same vocabulary, and it disagrees often
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in llm.engine.speculation.proposer.model.model.named_parameters():
            if "layers.2." in name or "layers.5." in name:
                p.add_(torch.randn(p.shape, generator=g) * p.std() * 0.15)
    return llm


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    llm = LLM(MODEL, **SMALL)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_lossless_policies_reproduce_plain_greedy_decoding(plain):
    exact = _llm("exact")
    assert [o.outputs[0].token_ids for o in exact.generate(PROMPTS, GREEDY, use_tqdm=False)] == plain
    stats = exact.spec_stats()
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]  # the perturbed draft does disagree

    gen_only = _llm("adasd-generation")
    # The draft is as slow as the target here, so a second draft token pays only if nearly sure; start the
    # table saying that unsure tokens are rejected, so that the stop rule fires from the first steps
    gen_only.engine.speculation.thresholds.observe_generation([0.1] * 20 + [3.0] * 20, [True] * 20 + [False] * 20)
    outs = gen_only.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(o.acceptance == "adasd-generation" and o.lossless and o.relaxed_tokens == 0 for o in outs)
    stats = gen_only.spec_stats()
    histogram = stats["k_histogram"]
    assert sum(histogram[:4]) > 0  # some drafts were cut short of k = 4 by the entropy rule
    assert stats["adaptive_thresholds"]["entropy_observations"] > 2


@pytest.mark.slow
def test_auto_mode_ends_drafts_where_the_draft_turns_unsure_and_stays_lossless(plain):
    from turbospec.control.step_time import LinearPart, StepTimeModel

    stopping = _llm("exact", k="auto")
    engine = stopping.engine
    assert engine.spec.draft_stop == "confidence" and engine.speculation.confidence_stop()
    # drafting nearly free, so the controller lets every request draft (up to the cap of 8) and the stop decides
    # how far; the table starts saying that unsure tokens are rejected, so the stop fires from the first steps
    engine.speculation.controller.model = StepTimeModel({"target": LinearPart(("one", "tokens"), (0.01, 1e-4)),
                                             "draft": LinearPart(("draft_steps",), (1e-4,)),
                                             "overhead": LinearPart()}, refit_every=10**9)
    engine.speculation.thresholds.observe_generation([0.1] * 20 + [3.0] * 20, [True] * 20 + [False] * 20)
    # the draft here is the target itself (as slow); make its measured step look nearly free against the
    # target's (running means: these outweigh the steps the test measures), so only unsure tokens end a draft
    for _ in range(2000):
        engine.speculation.thresholds.observe_costs(draft_step_s=1e-4, target_step_s=1.0)
    # one request at a time: a lone request the controller lets draft may go to the cap (widen_lone_request)
    outs = [stopping.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(o.lossless and o.relaxed_tokens == 0 for o in outs)
    histogram = stopping.spec_stats()["k_histogram"]
    assert sum(histogram[1:8]) > 0 and len(histogram) == 9 and histogram[8] > 0  # cut short, and drafted to 8
    before = sum(engine.speculation.thresholds.seen_by_entropy)
    assert before > 40  # verification fed the table
    # a fixed k is drafted in full whatever the draft's confidence
    engine.set_speculation(4)
    stopping.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert sum(engine.speculation.thresholds.seen_by_entropy) == before


@pytest.mark.slow
def test_typical_acceptance_keeps_only_tokens_its_rule_allows(plain):
    from transformers import AutoModelForCausalLM

    from turbospec.models.registry import pull

    llm = _llm("typical")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.acceptance == "typical" and not o.lossless for o in outs)
    assert sum(o.relaxed_tokens for o in outs) > 0
    assert [o.outputs[0].token_ids for o in outs] != plain  # lossy: the answers moved
    path = pull(MODEL, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = llm.engine.tokenizer
    off_argmax = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = tokenizer.encode(prompt)
        full = torch.tensor([ids + out.outputs[0].token_ids])
        with torch.no_grad():
            probs = hf(full).logits[0, len(ids) - 1: -1].float().softmax(-1)
        toks = torch.tensor(out.outputs[0].token_ids)
        argmax = probs.argmax(-1) == toks
        # the rule, with a little slack for float differences between the two implementations
        h = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        p_x = probs.gather(1, toks.unsqueeze(1)).squeeze(1)
        allowed = p_x > torch.clamp(0.3 * torch.exp(-h), max=0.09) - 1e-3
        assert bool((argmax | allowed).all()), prompt
        off_argmax += int((~argmax).sum())
    assert off_argmax > 0


@pytest.mark.slow
def test_adasd_relaxes_by_js_distance_and_adapts():
    llm = _llm("adasd")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.spec_stats()
    thresholds = stats["adaptive_thresholds"]
    assert thresholds["js_observations"] > 0 and 0 < thresholds["js_threshold"] < 1
    assert all(o.acceptance == "adasd" and not o.lossless for o in outs)
    assert stats["num_relaxed_tokens"] == sum(o.relaxed_tokens for o in outs)


@pytest.mark.slow
def test_a_request_picks_its_own_policy_and_bad_ones_are_refused():
    llm = _llm("exact")
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], GREEDY, acceptance="typical")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[rid].acceptance == "typical" and not done[rid].lossless
    with pytest.raises(ValueError, match="unknown acceptance policy"):
        engine.add_request(PROMPTS[0], GREEDY, acceptance="sloppy")
    with pytest.raises(ValueError, match="lossy and this request is deterministic"):
        engine.add_request(PROMPTS[0], GREEDY, acceptance="adasd", deterministic="llm42")
    plain_engine = LLM(MODEL, **SMALL).engine
    with pytest.raises(ValueError, match="needs speculative decoding"):
        plain_engine.add_request(PROMPTS[0], GREEDY, acceptance="typical")
    ngram = LLM(MODEL, **SMALL, speculative_config={"method": "ngram", "num_speculative_tokens": 2}).engine
    with pytest.raises(ValueError, match="needs speculative method 'draft'"):
        ngram.add_request(PROMPTS[0], GREEDY, acceptance="adasd-verification")
