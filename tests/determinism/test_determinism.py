"""Batch-invariant mode: the ops compute each row independently of its batch, and the engine gives a request
bitwise the same tokens and log-probs whatever it is batched with, however its prompt is chunked or cached,
and with or without speculation. A negative test shows that the default mode does differ, so the needle
tests can fail."""

from __future__ import annotations

import random

import pytest
import torch

from turbospec import LLM, SamplingParams
from turbospec.determinism.batch_invariant import invariant_attention, invariant_linear

MODEL = "smollm2-135m"
NEEDLE = "The sky is blue because"
FILLERS = [
    "def quicksort(items):",
    "The history of the Roman Empire begins",
    "1, 1, 2, 3, 5, 8,",
    "Write a poem about autumn leaves falling on a quiet river in the early morning light, "
    "with the mist rising slowly over the water and birds calling from the trees on both banks.",
    "SELECT * FROM orders WHERE",
    "Translate to French: good morning, how are you today?",
    "A list of prime numbers: 2, 3, 5, 7,",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old clockmaker who",
]


# --- the ops ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (3000, 960)])
def test_invariant_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    x = torch.randn(130, shape[1], generator=gen).to(dtype)
    alone = invariant_linear(x[:1], weight)
    for rows in [2, 3, 7, 11, 12, 16, 17, 33, 64, 100, 130]:
        out = invariant_linear(x[:rows], weight)
        assert torch.equal(out[:1], alone), rows
        # and the same row anywhere in the batch
        moved = torch.cat([x[1:rows], x[:1]])
        assert torch.equal(invariant_linear(moved, weight)[-1:], alone), rows
    assert torch.allclose(alone.float(), (x[:1].double() @ weight.double().T).float(), rtol=2e-2, atol=2e-2)


def _reference_attention(q, k, v, mask, scale):  # float64, dense
    b, hq, nq, d = q.shape
    rep = hq // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ vv).to(q.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_attention_depends_only_on_the_query_and_its_context(dtype: torch.dtype) -> None:
    """A query row of a 40-token prefill chunk equals the same query decoded alone and the same query in a group
    with a longer sequence; all match a float64 reference."""
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, ctx = 6, 2, 32, 150
    keys = torch.randn(1, hkv, ctx, d, generator=gen).to(dtype)
    values = torch.randn(1, hkv, ctx, d, generator=gen).to(dtype)
    queries = torch.randn(1, hq, 40, d, generator=gen).to(dtype)  # positions 110..149
    pos = torch.arange(110, 150)
    causal = (torch.arange(ctx)[None, :] <= pos[:, None])[None, None]
    chunk = invariant_attention(queries, keys, values, causal, 0.2)
    assert torch.allclose(chunk.float(), _reference_attention(queries, keys, values, causal, 0.2).float(),
                          atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    for j in (0, 17, 39):  # decode-style: one query over exactly its own context
        length = 111 + j
        alone = invariant_attention(queries[:, :, j:j + 1], keys[:, :, :length], values[:, :, :length],
                                    torch.ones(1, 1, 1, length, dtype=torch.bool), 0.2)
        assert torch.equal(alone[:, :, 0], chunk[:, :, j]), j
    # grouped with a longer sequence: padded keys and queries must change nothing
    longer_k = torch.randn(1, hkv, 300, d, generator=gen).to(dtype)
    group_k = torch.cat([torch.nn.functional.pad(keys, (0, 0, 0, 150)), longer_k])
    group_v = torch.cat([torch.nn.functional.pad(values, (0, 0, 0, 150)), longer_k])
    group_q = torch.cat([queries[:, :, :3], torch.randn(1, hq, 3, d, generator=gen).to(dtype)])
    group_mask = torch.zeros(2, 1, 3, 300, dtype=torch.bool)
    group_mask[0, 0, :, :ctx] = causal[0, 0, :3]
    group_mask[1] = True
    grouped = invariant_attention(group_q, group_k, group_v, group_mask, 0.2)
    assert torch.equal(grouped[:1], chunk[:, :, :3])


# --- the engine ------------------------------------------------------------------------------------------------

def _llm(mode: str | None, **options) -> LLM:
    return LLM(MODEL, dtype="bfloat16", num_threads=1, max_model_len=512, progress=False, deterministic=mode,
               **options)


def _needle_runs(llm: LLM, params: SamplingParams, trials: int, seed: int = 0) -> list[tuple]:
    """The needle alone, then at a random position among 1..16 fillers of mixed lengths, `trials` times."""
    rng = random.Random(seed)
    results = []
    for trial in range(trials + 1):
        others = [] if trial == 0 else [rng.choice(FILLERS) for _ in range(rng.randint(1, 16))]
        at = rng.randint(0, len(others))
        batch = others[:at] + [NEEDLE] + others[at:]
        outs = llm.generate(batch, [params if i == at else SamplingParams(temperature=0, max_tokens=rng.randint(4, 30))
                                    for i in range(len(batch))], use_tqdm=False)
        c = outs[at].outputs[0]
        results.append((tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                                                   for step in c.logprobs)))
    return results


GREEDY = SamplingParams(temperature=0, max_tokens=24, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, logprobs=3, ignore_eos=True)


@pytest.fixture(scope="module")
def invariant() -> LLM:
    return _llm("batch-invariant")


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_needle_is_bitwise_identical_in_any_batch(invariant: LLM, params: SamplingParams) -> None:
    runs = _needle_runs(invariant, params, trials=6)
    assert len(set(runs)) == 1, [r[0] for r in runs]


@pytest.mark.slow
def test_default_mode_does_differ_somewhere() -> None:
    """The needle test can fail: without the mode, batching changes the needle's log-probs."""
    runs = _needle_runs(_llm(None), GREEDY, trials=6)
    assert len(set(runs)) > 1


@pytest.mark.slow
def test_chunked_prefill_prefix_cache_and_speculation_change_nothing(invariant: LLM,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    want = _needle_runs(invariant, GREEDY, trials=0)[0]
    again = _needle_runs(invariant, GREEDY, trials=0)[0]  # the prompt now comes from the prefix cache
    assert again == want
    monkeypatch.setattr("turbospec.engine.load_model", lambda *args, **kwargs: invariant.engine.loaded)
    chunked = _llm("batch-invariant", max_num_batched_tokens=5, enable_prefix_caching=False)
    assert _needle_runs(chunked, GREEDY, trials=0)[0] == want
    configs = [{"method": "ngram", "num_speculative_tokens": 1}, {"method": "ngram", "num_speculative_tokens": 4},
               {"method": "ngram"},  # the goodput controller picks k per request and step
               {"method": "draft", "model": MODEL, "num_speculative_tokens": 3},
               {"method": "layer-skip", "skip_layers": [3, 9, 15, 21], "num_speculative_tokens": 3},
               {"method": "lookahead", "num_speculative_tokens": 4},
               # trained drafts (heads/): chains here, since deterministic requests never get trees
               {"method": "hydra", "num_speculative_tokens": 4}, {"method": "eagle", "num_speculative_tokens": 4},
               {"method": "dart", "num_speculative_tokens": 4}]
    for config in configs:
        spec = _llm("batch-invariant", speculative_config=config)
        assert set(_needle_runs(spec, GREEDY, trials=1)) == {want}, config  # alone, then in a random batch
        if "num_speculative_tokens" in config:  # the controller may rightly choose k = 0 throughout
            assert spec.spec_stats()["num_draft_tokens"] > 0, config


@pytest.mark.slow
def test_layercast_is_float32_compute_over_bf16_weights(invariant: LLM) -> None:
    """LayerCast must equal, bit for bit, a float32 model whose weights are the bf16 values: the weights are
    only widened, everything else (activations, KV, attention) runs in float32."""
    import copy
    from dataclasses import replace

    from turbospec.config import EngineConfig
    from turbospec.tuning import build_engine

    bf16 = invariant.engine.loaded
    widened = replace(bf16, model=copy.deepcopy(bf16.model).float())
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    outs = {}
    for name, dtype, mode, loaded in (("layercast", "bfloat16", "layercast", bf16),
                                      ("float32", "float32", None, widened)):
        engine = build_engine(EngineConfig(MODEL, dtype=dtype, num_threads=1, max_model_len=512, deterministic=mode),
                              loaded=loaded, progress=False)
        engine.add_request(NEEDLE, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[name] = out.outputs[0]
        assert engine.kv.layers[0][0].dtype == torch.float32
    assert outs["layercast"].token_ids == outs["float32"].token_ids
    assert [{t: lp.logprob for t, lp in s.items()} for s in outs["layercast"].logprobs] == \
        [{t: lp.logprob for t, lp in s.items()} for s in outs["float32"].logprobs]
    assert next(bf16.model.parameters()).dtype == torch.bfloat16  # the shared weights were not widened


# --- llm42 and margin-gate --------------------------------------------------------------------------------------

def _sibling(invariant: LLM, mode: str | None, **options) -> LLM:
    """An LLM over the invariant fixture's weights (no second load) in another mode."""
    from unittest import mock

    with mock.patch("turbospec.engine.load_model", lambda *args, **kwargs: invariant.engine.loaded):
        return _llm(mode, **options)


@pytest.fixture(scope="module")
def reference(invariant: LLM) -> dict[str, tuple]:
    """The batch-invariant needle output (token ids and log-probs), greedy and seeded."""
    return {"greedy": _needle_runs(invariant, GREEDY, trials=0)[0], "seeded": _needle_runs(invariant, SEEDED, 0)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_llm42_equals_batch_invariant_in_any_batch(invariant: LLM, reference: dict[str, tuple],
                                                   params: SamplingParams) -> None:
    """Fast decoding plus replayed windows gives the batch-invariant tokens and log-probs bit for bit, alone and
    in batches; a small window makes replays cut the output (rollbacks) so the repair path is exercised."""
    want = reference["greedy" if params is GREEDY else "seeded"]
    for window in (8, 64):
        llm = _sibling(invariant, "llm42", verify_window=window)
        runs = _needle_runs(llm, params, trials=2)
        assert set(runs) == {want}, window
        stats = llm.engine.determinism_stats()
        # every token is checked but those an invariant step made over exact context (the first after prefill)
        assert stats["replays"] > 0 and 0 < stats["replayed_tokens"] < stats["fast_tokens"], stats
        if window == 8:
            assert stats["rollbacks"] > 0, stats  # fast tokens were wrong and got replaced


@pytest.mark.slow
def test_llm42_with_chunked_prefill_prefix_cache_and_speculation(invariant: LLM, reference: dict[str, tuple]) -> None:
    want = reference["greedy"]
    chunked = _sibling(invariant, "llm42", max_num_batched_tokens=5, verify_window=16)
    assert _needle_runs(chunked, GREEDY, trials=1) == [want, want]
    assert _needle_runs(chunked, GREEDY, trials=0)[0] == want  # prompt blocks from the prefix cache
    for config in ({"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 4},
                   {"method": "draft", "model": MODEL, "num_speculative_tokens": 3}):
        spec = _sibling(invariant, "llm42", speculative_config=config, verify_window=16)
        assert set(_needle_runs(spec, GREEDY, trials=1)) == {want}, config


@pytest.mark.slow
def test_llm42_streams_only_verified_text(invariant: LLM) -> None:
    """Deltas are sent only once a window is replayed: their concatenation is the final text, and no delta is
    ever taken back (a stop string inside a replayed window still cuts correctly)."""
    engine = _sibling(invariant, "llm42", verify_window=8).engine
    params = SamplingParams(temperature=0, max_tokens=40, stop=["."])
    engine.add_request(NEEDLE, params, request_id="r")
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.delta_text)
            if out.finished:
                final = out.outputs[0]
    assert final is not None and "".join(deltas) == final.text
    plain = invariant.generate(NEEDLE, params, use_tqdm=False)[0].outputs[0]
    assert (final.text, final.token_ids, final.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)


@pytest.mark.slow
def test_margin_gate_tokens_are_deterministic_and_triggers_are_counted(invariant: LLM,
                                                                       reference: dict[str, tuple]) -> None:
    """With the threshold calibrated for this model, the needle's tokens are the same in every batch (and equal
    the batch-invariant ones); only low-margin tokens are re-checked, so the trigger rate is between 0 and 1."""
    from turbospec.tuning.margin_calibration import calibrate

    probe = _sibling(invariant, None)
    calibration = calibrate(probe.engine, num_prompts=6, max_tokens=32, progress=False)
    assert calibration.tokens == 6 * 32 and calibration.threshold == pytest.approx(2.0 * calibration.max_drift)
    assert calibration.max_flip_margin < calibration.threshold  # every flip seen would have been re-checked
    for params, name in ((GREEDY, "greedy"), (SEEDED, "seeded")):
        gate = _sibling(invariant, "margin-gate", margin_threshold=calibration.threshold)
        tokens = {r[0] for r in _needle_runs(gate, params, trials=4)}
        assert tokens == {reference[name][0]}, name
        stats = gate.engine.determinism_stats()
        assert 0 < stats["rechecks"] < stats["fast_tokens"] and 0 < stats["trigger_rate"] < 1, stats
    # threshold 0 re-checks nothing: fast decoding after an invariant prefill
    off = _sibling(invariant, "margin-gate", margin_threshold=0.0)
    off.generate([NEEDLE, *FILLERS[:3]], GREEDY, use_tqdm=False)
    assert off.engine.determinism_stats()["rechecks"] == 0 and off.engine.determinism_stats()["fast_tokens"] > 0


@pytest.mark.slow
def test_per_request_modes_on_a_default_engine(invariant: LLM, reference: dict[str, tuple]) -> None:
    """A request may ask for llm42 on an engine running the default mode; the requests around it stay fast."""
    engine = _sibling(invariant, None).engine
    rng = random.Random(3)
    for _ in range(2):
        others = [engine.add_request(rng.choice(FILLERS), SamplingParams(temperature=0, max_tokens=rng.randint(4, 20)))
                  for _ in range(rng.randint(2, 8))]
        needle = engine.add_request(NEEDLE, GREEDY, deterministic="llm42")
        assert engine.requests[needle].determinism == "llm42" and engine.requests[others[0]].determinism is None
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        c = done[needle].outputs[0]
        assert (tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in s.items())) for s in c.logprobs)) \
            == reference["greedy"]
    with pytest.raises(ValueError, match="engine-wide"):
        engine.add_request(NEEDLE, GREEDY, deterministic="batch-invariant")
    with pytest.raises(ValueError, match="unknown deterministic mode"):
        engine.add_request(NEEDLE, GREEDY, deterministic="exact")
    assert invariant.engine.request_determinism("llm42") == "batch-invariant"  # already the strongest mode
