"""The goodput controller inside the engine: greedy output equal to plain decoding, the choice following
synthetic acceptance, the step-time model learning online, the profile cache and the user-facing options."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from spec_prompts import SPEC_PROMPTS

from turbospec import LLM, SamplingParams
from turbospec.config import SpeculativeConfig
from turbospec.control.acceptance_estimators import NodeRank
from turbospec.control.step_time import LinearPart, StepTimeModel
from turbospec.models.registry import gguf_path
from turbospec.tuning import set_speculation
from turbospec.tuning.profiler import profile_key, profile_path

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPTS = [p for p in SPEC_PROMPTS if "robot" not in p]  # four: the controller tests run several engines
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _llm(**kw) -> LLM:
    return LLM(MODEL, dtype="float32", num_threads=1, progress=False, **kw)


def _model(per_token: float, per_draft_step: float = 0.0) -> StepTimeModel:
    """A known step-time model: 10 ms plus per_token for every batched token (and per draft forward). It is
    never refitted online, so the choice follows it and nothing else."""
    return StepTimeModel({"target": LinearPart(("one", "tokens"), (0.01, per_token)),
                          "draft": LinearPart(("draft_steps",), (per_draft_step,)),
                          "overhead": LinearPart()}, refit_every=10**9)


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [o.outputs[0].token_ids for o in _llm().generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("config", [
    {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft", "model": MODEL},
], ids=["ngram", "draft"])
def test_adaptive_greedy_output_equals_plain_decoding(config, plain):
    llm = _llm(speculative_config=config)
    engine = llm.engine
    assert engine.speculation.mode == "auto"  # the default whenever speculation is configured
    engine.speculation.controller.model = _model(per_token=1e-4)  # speculation nearly free: the controller drafts deeply
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.spec_stats()
    assert stats["num_drafts"] > 0 and stats["mean_k"] > 1.0, stats
    assert engine.blocks.num_free_blocks == engine.kv.num_blocks


def _mean_k(rate: float, model: StepTimeModel) -> float:
    llm = _llm(speculative_config={"method": "ngram", "synthetic_acceptance": rate, "prompt_lookup_min": 1})
    llm.engine.speculation.controller.model = model
    llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    return llm.spec_stats()["mean_k"]


def test_choice_follows_synthetic_acceptance():
    # every batched token costs as much as the 10 ms base: a = 0.95 is worth ~4 drafts, a = 0.05 none
    model = _model(per_token=0.01)
    high, low = _mean_k(0.95, model), _mean_k(0.05, model)
    assert high >= 2.0 and low <= 0.5, (high, low)


def test_steep_cost_turns_speculation_off_and_flat_cost_on():
    assert _mean_k(0.8, _model(per_token=0.2)) == 0.0
    # k is capped by what the lookup finds (often nothing after a synthetic rejection), so not 8 on average
    assert _mean_k(0.8, _model(per_token=1e-5)) >= 0.5


def test_fixed_k_with_synthetic_acceptance_accepts_at_that_rate():
    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "synthetic_acceptance": 1.0,
                                   "prompt_lookup_min": 1})
    llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert llm.spec_stats()["acceptance_rate"] == 1.0
    llm.engine.speculation.synthetic_acceptance = 0.0
    llm.engine.reset_spec_stats()
    llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    stats = llm.spec_stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] == 0


def test_controller_reports_its_choices_and_cost_and_learns_step_time(plain):
    llm = _llm(speculative_config={"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    engine = llm.engine
    wrong = _model(per_token=0.5)  # 50x too slow: online refits must pull predictions toward measurements
    wrong.samples = list(engine.speculation.controller.model.samples)
    wrong.refit_every = 8
    engine.speculation.controller.model = wrong
    engine.speculation.record_history = True
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = llm.spec_stats()
    ctrl = stats["controller"]
    assert stats["policy"] == "auto" and sum(stats["k_histogram"]) > 0
    assert 0 < ctrl["controller_overhead"] < 0.02, ctrl  # the choice costs under 2% of step time
    hist = engine.speculation.history
    assert len(hist) > 20
    first, last = hist[2], hist[-1]
    err = lambda h: abs(h["predicted_s"] - h["measured_s"]) / h["measured_s"]  # noqa: E731
    assert err(last) < err(first)


def test_set_speculation_switches_policies_and_validates():
    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = llm.engine
    assert engine.speculation.mode == 2 and engine.speculation.controller is None
    engine.set_speculation(0)
    llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    assert llm.spec_stats()["num_drafts"] == 0 and llm.spec_stats()["mean_k"] == 0.0
    with pytest.raises(ValueError, match="step-time model"):
        engine.set_speculation("auto")  # the engine measures nothing itself: tuning hands it the model
    set_speculation(engine, "auto", progress=False)  # the cached profile, or a brief one measured now
    assert engine.speculation.controller is not None and engine.speculation.mode == "auto"
    for bad in (-1, "fast", 1.5, True):
        with pytest.raises(ValueError, match="speculation must be"):
            engine.set_speculation(bad)
    with pytest.raises(ValueError, match="no speculative_config"):
        _llm().engine.set_speculation(2)


def test_profile_is_cached_per_model_dtype_threads_and_hardware():
    llm = _llm(speculative_config={"method": "ngram"})
    key = profile_key(llm.engine)
    assert {"model", "dtype", "threads", "hardware", "speculation"} <= set(key)
    path = profile_path(key)
    assert path.is_file()
    cached = StepTimeModel.load(path)
    assert cached is not None and len(cached.samples) > 10
    other = dict(key, threads=str(int(key["threads"]) + 1))
    assert profile_path(other) != path
    # the grid reaches the controller's cap: costs near it are measured, not extrapolated
    from turbospec.tuning.profiler import GRIDS, profile_ks

    assert max(profile_ks(llm.engine, GRIDS["brief"])) == llm.engine.spec.k_limit == 8
    llm.engine.spec.max_speculative_tokens = 12
    assert 12 in profile_ks(llm.engine, GRIDS["brief"]) and profile_path(profile_key(llm.engine)) != path


@pytest.mark.parametrize(("config", "message"), [
    ({"method": "ngram", "num_speculative_tokens": "fast"}, "num_speculative_tokens"),
    ({"method": "ngram", "max_speculative_tokens": 0}, "max_speculative_tokens"),
    ({"method": "ngram", "synthetic_acceptance": 1.5}, "synthetic_acceptance"),
    ({"method": "ngram", "acceptance_estimator": "oracle"}, "unknown acceptance_estimator"),
])
def test_invalid_controller_options_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(config)


def test_cli_profile_writes_the_cache_and_refuses_bad_input(tmp_path):
    env = {**os.environ, "TURBOSPEC_HOME": str(tmp_path)}
    # the model file comes from the normal cache: point at it by path
    model = str(gguf_path(MODEL))
    ok = subprocess.run([sys.executable, "-m", "turbospec.cli", "profile", "--model", model, "--grid", "brief",
                         "--dtype", "float32", "--num-threads", "1", "--speculative-config", '{"method": "ngram"}'],
                        capture_output=True, text=True, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "held-out MRE" in ok.stdout and "R^2" in ok.stdout
    saved = list((tmp_path / "profiles").glob("*.json"))
    assert len(saved) == 1 and json.loads(saved[0].read_text())["samples"]
    bad = subprocess.run([sys.executable, "-m", "turbospec.cli", "profile", "--model", model,
                          "--speculative-config", '{"method": "ngram", "max_speculative_tokens": -2}'],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "max_speculative_tokens" in bad.stderr and "Traceback" not in bad.stderr


def test_a_draft_model_never_verified_is_probed_once_so_its_acceptance_gets_measured():
    # drafting looks too costly at the prior acceptance: without the probe the controller would never draft, and
    # never learn that this draft (the target itself) is always accepted
    llm = _llm(speculative_config={"method": "draft", "model": MODEL})
    engine = llm.engine
    engine.speculation.controller.model = _model(per_token=0.2)
    prior = engine.speculation.controller.estimator.rates("nobody", 1)[0]
    llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stats = llm.spec_stats()
    assert stats["num_drafts"] == 1 and stats["num_accepted_tokens"] == stats["num_draft_tokens"] > 0, stats
    assert engine.speculation.controller.estimator.rates("nobody", 1)[0] > prior  # what a fresh request now starts from
    llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert llm.spec_stats()["num_drafts"] == 1  # once per controller: from then on it decides


def test_only_the_controllers_own_steps_age_its_acceptance_evidence():
    """Steps under a fixed k or none (a policy switched at run time) tell the controller nothing, so its measured
    acceptance must survive them; its own k = 0 steps age it towards the prior (the probe for a shift)."""
    llm = _llm(speculative_config={"method": "draft", "model": MODEL})
    engine = llm.engine
    controller = engine.speculation.controller
    for _ in range(3):
        controller.observe("earlier", 8, 8)
    learned = controller.estimator.rates("fresh", 1)[0]
    assert learned > 0.85
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    set_speculation(engine, 0)
    llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert controller.estimator.rates("fresh", 1)[0] == learned
    set_speculation(engine, "auto")
    controller.model = _model(per_token=1.0)  # a verified token costs a second: k = 0 on every step
    llm.generate(PROMPTS[0], params, use_tqdm=False)
    assert llm.spec_stats()["num_drafts"] == 0
    assert controller.estimator.rates("fresh", 1)[0] < learned - 0.05


def test_profiling_steps_stay_out_of_the_speculation_statistics():
    from turbospec.tuning.profiler import ProfileGrid, profile_engine

    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    before = llm.spec_stats()
    samples = profile_engine(llm.engine, ProfileGrid((1,), (32,), (0, 2), 1), progress=False)
    assert samples and llm.spec_stats() == before


def test_the_profile_measures_the_ks_in_turn_after_an_unrecorded_round(monkeypatch):
    """Every k once per round, so a machine drifting over a point's seconds moves all ks alike; the first round
    unrecorded, since the first step at a new row count pays one-time costs (docs/ARCHITECTURE.md, the profiler)."""
    from turbospec.tuning import profiler
    from turbospec.tuning.profiler import ProfileGrid, profile_engine

    # no step dropped as disturbed (the next test covers that): this tiny model's steps take a few ms, and one of
    # them ran 1.25x its round's other once beside a parallel test worker (make test, 2026-12-03)
    monkeypatch.setattr(profiler, "DISTURBED", float("inf"))
    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    samples = profile_engine(llm.engine, ProfileGrid((1,), (32,), (0, 2, 4), 2), progress=False)
    decodes = [s.features.spec_tokens for s in samples
               if s.features.tokens == s.features.batch + s.features.spec_tokens]
    assert decodes == [0, 2, 4, 0, 2, 4]


def test_a_profile_fits_an_engine_with_just_the_positions_its_steps_take(monkeypatch):
    """Acceptance is synthetic and 0 while profiling, so a request grows one token per step: a grid point needs its
    prompt, its steps and one draft's slots, not k + 1 tokens a step (which refused a k = "auto" engine with
    max_model_len 256 on a machine with no cached profile). Every k is still measured whole, none cut short by
    the engine's length limit."""
    from turbospec.tuning import profiler
    from turbospec.tuning.profiler import ProfileGrid, profile_engine

    monkeypatch.setattr(profiler, "DISTURBED", float("inf"))
    # 32 prompt tokens + (2 ks x 3 rounds + 4) steps + 4 draft slots + 1
    llm = _llm(speculative_config={"method": "ngram", "num_speculative_tokens": 4}, max_model_len=47)
    samples = profile_engine(llm.engine, ProfileGrid((1,), (32,), (0, 4), 2), progress=False)
    decodes = [s.features.spec_tokens for s in samples
               if s.features.tokens == s.features.batch + s.features.spec_tokens]
    assert decodes == [0, 4, 0, 4]
    with pytest.raises(ValueError, match="no profile grid point fits"):
        profile_engine(llm.engine, ProfileGrid((1,), (33,), (0, 4), 2), progress=False)


def test_the_controllers_own_profile_reaches_the_engines_seats(monkeypatch, tmp_path, caplog):
    """At saturation every seat decodes: the profile an engine measures for itself reaches its max_num_seqs, a
    cached one that stops short is measured again, and an engine with fewer seats keeps the larger one."""
    from turbospec.tuning import profiler
    from turbospec.tuning.profiler import ProfileGrid

    monkeypatch.setenv("TURBOSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(profiler, "DISTURBED", float("inf"))
    monkeypatch.setitem(profiler.GRIDS, "brief", ProfileGrid((1, 4), (16,), (0, 2), 1))
    config = {"method": "ngram", "num_speculative_tokens": "auto", "max_speculative_tokens": 2}

    def profiled(seats: int, **kw) -> int:
        llm = _llm(speculative_config=config, max_num_seqs=seats, **kw)
        return llm.engine.speculation.controller.model.max_profiled_batch

    assert profiled(3) == 3  # the grid's batch 1 (its 4 is more than the engine runs), then the engine's 3 seats
    assert profiled(2) == 3  # the cached profile covers 2 seats
    assert "measured batches up to 3" not in caplog.text
    assert profiled(5) == 5  # it stops short of 5: measured again, and saved
    assert "measured batches up to 3, and this engine can be measured up to 5" in caplog.text  # replacing it is said
    assert profiled(4) == 5  # 4 seats need 4: the cached 5 is kept
    assert profiled(8, max_num_batched_tokens=6) == 6  # a step decodes at most its token budget's requests


def test_a_profile_drops_the_steps_another_process_disturbed():
    """Per grid point and k, a round more than 1.25x slower than the fastest is dropped; ordinary jitter and
    every other k's rounds stay, in measuring order. A disturbed k = 0 must not make drafts look cheap, nor a
    disturbed k = 8 make them look dear."""
    from turbospec.control.step_time import StepFeatures, StepSample
    from turbospec.tuning.profiler import drop_disturbed

    def sample(k, ms):
        return k, StepSample(StepFeatures(batch=1, tokens=1 + k, spec_tokens=k), ms / 1e3, 0.0, 0.0)

    recorded = [sample(0, 14.0), sample(8, 15.0), sample(0, 30.0), sample(8, 16.5), sample(0, 15.2),
                sample(8, 31.0)]
    kept = drop_disturbed(recorded)
    assert [(s.features.spec_tokens, round(s.total_s * 1e3, 1)) for s in kept] == [(0, 14.0), (8, 15.0), (8, 16.5),
                                                                                   (0, 15.2)]


def test_tree_drafters_learn_acceptance_per_node_rank_and_time_their_draft(plain):
    """EAGLE's k drafts are its k most confident tree nodes: the controller learns how often each rank is
    accepted (not a chain's per-position rate), and the step samples put the draft layer's time in the draft
    part, per drafting request, where the controller charges it (not in overhead, spread over verified nodes)."""
    from turbospec.tuning.profiler import ProfileGrid, profile_engine

    llm = _llm(speculative_config={"method": "eagle"})
    engine = llm.engine
    estimator = engine.speculation.controller.estimator
    assert isinstance(estimator, NodeRank)
    seen: list[tuple[int, list[int]]] = []
    observe = estimator.observe_nodes
    estimator.observe_nodes = lambda rid, n, ranks: (seen.append((n, ranks)), observe(rid, n, ranks))[1]
    engine.speculation.controller.model = _model(per_token=1e-4)  # verified nodes nearly free: full trees
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert llm.spec_stats()["mean_k"] > 4
    assert seen and all(len(set(r)) == len(r) and all(0 <= x < n for x in r) for n, r in seen)
    # some accepted paths were not the most confident nodes in order (a sibling, or a less likely child)
    assert any(r != list(range(len(r))) for _, r in seen), seen
    samples = profile_engine(engine, ProfileGrid((1, 2), (32,), (0, 2, 8), 1), progress=False)
    drafted = [s for s in samples if s.features.spec_tokens]
    assert drafted and all(s.features.drafting_requests == s.features.batch and s.draft_s > 0 for s in drafted)
    # the trees grew as deep as the drafts needed, no deeper than the layer's depth: one draft pass per level
    depth = engine.speculation.proposer.tree_levels
    assert depth == 4 and {(s.features.draft_steps, s.features.draft_levels) for s in drafted} == {(2, 2), (8, 4)}
    # the draft part is the heads' drafting, not the step's scheduling: a bounded share of the step
    assert all(s.draft_s < 0.8 * s.total_s for s in drafted)
    assert all(s.draft_s == 0 and s.features.drafting_requests == 0 for s in samples if not s.features.spec_tokens)
