"""The deployment simulator (turbospec/sim): hand-computed latencies, queueing theory, speculation step counts,
batching limits, the controller's choice, routing and the CLI. No model runs; step times are synthetic."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from turbospec.cli import main
from turbospec.control.controller import base_step
from turbospec.control.step_time import LinearPart, StepFeatures, StepSample, StepTimeModel
from turbospec.sim.draft_outcomes import Outcome, PositionRates, TextRuns, TraceReplay, rates_from_trace
from turbospec.sim.replica import Replica, SpecPolicy
from turbospec.sim.simulator import Deployment, simulate
from turbospec.sim.step_cost import (H200, LLAMA3_8B, RooflineAssumptions, StepCost, StepOverhead, mean_level,
                                     roofline_model)
from turbospec.sim.workload import SimRequest, fixed_lengths, with_arrivals


def model(one: float = 0.0, tokens: float = 0.0) -> StepTimeModel:
    """Step time = one + tokens x (batched tokens), in seconds."""
    return StepTimeModel({"target": LinearPart(("one", "tokens"), (one, tokens))})


def constant(seconds: float) -> StepCost:
    return StepCost(model(one=seconds))


def spaced(n: int, prompt: int, output: int, gap: float = 100.0) -> list[SimRequest]:
    return [SimRequest(f"r{i}", i * gap, prompt, output) for i in range(n)]


# --- exact values ----------------------------------------------------------------------------------------------


def test_one_request_at_a_time_matches_hand_computed_latencies():
    c = 0.01
    res = simulate(spaced(3, prompt=10, output=5), constant(c), None)
    for t in res.times:  # one prefill step (which emits the first token), then four decode steps
        assert t.ttft_s == pytest.approx(c, abs=1e-12)
        assert t.e2el_s == pytest.approx(5 * c, abs=1e-12)
        assert t.tpot_s == pytest.approx(c, abs=1e-12)
    assert res.summary["e2el_ms"]["p99"] == pytest.approx(50.0)


def test_chunked_prefill_takes_one_step_per_budget_of_prompt():
    c = 0.02
    res = simulate(spaced(1, prompt=1000, output=3), constant(c), None, Deployment(max_num_batched_tokens=512))
    t = res.times[0]
    assert t.ttft_s == pytest.approx(2 * c)  # 512 + 488 prompt tokens
    assert t.e2el_s == pytest.approx(4 * c)


def test_step_time_follows_the_profile_and_the_overhead():
    cost = StepCost(model(one=0.01, tokens=0.001), StepOverhead(per_step_s=0.002, per_request_s=0.0005))
    res = simulate(spaced(1, prompt=100, output=2), cost, None)
    prefill = 0.01 + 0.001 * 100 + 0.002 + 0.0005
    decode = 0.01 + 0.001 * 1 + 0.002 + 0.0005
    assert res.times[0].ttft_s == pytest.approx(prefill)
    assert res.times[0].e2el_s == pytest.approx(prefill + decode)


def test_mean_level_makes_a_relative_error_fit_right_on_average():
    # steps of 1-16 tokens at 10 ms + 1 ms/token, every tenth one slowed 3x (another tenant): right-skewed noise
    rng = np.random.default_rng(0)
    samples = []
    for i in range(400):
        f = StepFeatures(batch=1, tokens=int(rng.integers(1, 17)), kv=100, attn=100)
        samples.append(StepSample(f, (0.010 + 0.001 * f.tokens) * (3.0 if i % 10 == 0 else 1.0), 0.0, 0.0))
    fitted = StepTimeModel.fit(samples)
    measured = sum(s.total_s for s in samples)
    predicted = sum(fitted.predict(s.features) for s in samples)
    assert predicted < 0.9 * measured  # the relative-error fit follows the typical step, not the mean
    level = mean_level(fitted, samples)
    assert level * predicted == pytest.approx(measured, rel=1e-9)
    exact = [StepSample(s.features, 0.010 + 0.001 * s.features.tokens, 0.0, 0.0) for s in samples]
    assert mean_level(StepTimeModel.fit(exact), exact) == pytest.approx(1.0, abs=1e-6)  # no noise, no correction
    assert mean_level(fitted, []) == 1.0


def test_md1_queue_matches_the_analytic_mean_wait():
    """One seat, one-token outputs: each request is one step of S seconds, so the replica is an M/D/1 queue and
    the mean wait before service is rho S / (2 (1 - rho))."""
    service, rho, n = 0.01, 0.6, 40000
    requests = with_arrivals(fixed_lengths(n, 8, 1), rate=rho / service, seed=3)
    res = simulate(requests, constant(service), None, Deployment(max_num_seqs=1))
    mean_wait = float(np.mean([t.ttft_s for t in res.times])) - service
    assert mean_wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.05)


# --- speculation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rate", "steps"), [(1.0, 1 + 4), (0.0, 1 + 20)])
def test_acceptance_one_and_zero_give_the_expected_step_counts(rate, steps):
    # 21 tokens: the prefill emits one; at full acceptance each k=4 step emits 5, so 20 more take 4 steps
    res = simulate(spaced(1, prompt=10, output=21), constant(0.01), PositionRates((rate,)),
                   Deployment(policy=SpecPolicy("fixed", 4)), record_steps=True)
    assert res.replicas[0].num_steps == steps
    assert res.times[0].e2el_s == pytest.approx(steps * 0.01)
    assert all(k <= 4 for s in res.replicas[0].steps for k in s.ks)


def test_no_proposal_means_no_drafts_verified():
    res = simulate(spaced(1, prompt=10, output=11), constant(0.01), PositionRates((1.0,), proposal_share=0.0),
                   Deployment(policy=SpecPolicy("fixed", 4)), record_steps=True)
    assert res.replicas[0].num_steps == 11
    assert all(s.features.spec_tokens == 0 for s in res.replicas[0].steps)


def test_trace_replay_uses_each_requests_records_in_order():
    # request a: a decode step with 4 of 4 accepted, then one with none accepted, then one with no drafts
    records = [("a", 4, 4), ("a", 4, 0), ("a", 0, 0)]
    replay = TraceReplay(records, PositionRates((0.0,)))
    rng = np.random.default_rng(0)
    assert [replay.draw("a", 4, rng) for _ in range(3)] == [Outcome(4, 4), Outcome(4, 0), Outcome(0, 0)]
    assert replay.draw("a", 4, rng) == Outcome(4, 0)  # records used up: the fallback
    assert replay.replayed == 3 and replay.drawn == 1
    # 1 (prefill) + 5 + 1 + 1 tokens = 8: exactly the recorded request's four outputs
    res = simulate([SimRequest("a", 0.0, 10, 8)], constant(0.01), TraceReplay(records, PositionRates((0.0,))),
                   Deployment(policy=SpecPolicy("fixed", 4)))
    assert res.replicas[0].num_steps == 4


def test_text_runs_replay_the_run_at_each_answer_position():
    runs = TextRuns({"a": [9, 5, 4, 3, 2, 1, 0, 0, 0, 0]}, {"a": [0.1] * 10})
    rng = np.random.default_rng(0)
    assert runs.draw("a", 4, rng, position=1) == Outcome(4, 4, (0.1,) * 4)
    assert runs.draw("a", 4, rng, position=4) == Outcome(4, 2, (0.1,) * 4)
    assert runs.draw("a", 0, rng, position=4) == Outcome(0, 0)
    # 10 tokens: prefill 1, then at position 1 k = 4 accepts 4 (5 tokens), at 6 the run is 0 (1 token), and so on
    res = simulate([SimRequest("a", 0.0, 10, 10)], constant(0.01), TextRuns({"a": [9, 5, 4, 3, 2, 1, 0, 0, 0, 0]}),
                   Deployment(policy=SpecPolicy("fixed", 4, free_proposals=False)), record_steps=True)
    assert [s.ks for s in res.replicas[0].steps] == [[], [4], [3], [2], [1], [0]]  # capped by the tokens left


def test_the_confidence_stop_ends_a_replayed_draft_at_the_unsure_token():
    sure, unsure = 0.1, 4.2
    runs = TextRuns({"a": [8] * 40}, {"a": ([sure] * 3 + [unsure]) * 10})
    policy = SpecPolicy("auto", 8, free_proposals=False, confidence_stop=True)
    replica = Replica(StepCost(model(one=0.05, tokens=0.0001)), runs, policy, 1, 512)
    assert replica.thresholds is not None
    replica.thresholds.observe_costs(draft_step_s=1.0, target_step_s=4.0)
    replica.thresholds.observe_generation([sure] * 98 + [unsure] * 8, [True] * 98 + [False] * 8)
    # from position 1: sure, sure, unsure -> the unsure token (the third) is kept and the draft ends there
    outcome = runs.draw("a", 8, np.random.default_rng(0), position=1)
    assert replica._stop(outcome, 8) == 3
    with pytest.raises(ValueError, match="confidence stop applies to a draft model"):
        SpecPolicy("fixed", 4, free_proposals=False, confidence_stop=True)


def test_rates_from_a_trace():
    est = rates_from_trace([("a", 4, 4), ("a", 4, 0), ("b", 0, 0), ("b", 2, 1)])
    # position 1 tried 3x, kept 2x; position 2 tried 2x (4/4 and 2/1), kept 1x; positions 3, 4 tried once, kept
    assert est.rates == pytest.approx((2 / 3, 1 / 2, 1.0, 1.0))
    assert est.proposal_share == pytest.approx(3 / 4)


# --- batching ----------------------------------------------------------------------------------------------------


def test_batches_respect_max_num_seqs_and_the_token_budget():
    requests = [SimRequest(f"r{i}", 0.001 * i, 300, 20) for i in range(40)]
    d = Deployment(max_num_seqs=8, max_num_batched_tokens=256, policy=SpecPolicy("fixed", 3))
    res = simulate(requests, StepCost(model(0.01, 0.0001)), PositionRates((0.7,)), d, record_steps=True)
    steps = res.replicas[0].steps
    assert max(s.features.batch for s in steps) == 8
    assert max(s.features.tokens for s in steps) == 256  # prompts are chunked to fill the budget exactly
    assert all(s.features.tokens <= 256 for s in steps)
    assert any(s.features.spec_tokens for s in steps)
    assert len(res.times) == 40


# --- the controller ----------------------------------------------------------------------------------------------


def test_base_step_counts_decodes_then_the_prefill_that_fits():
    """Shared by the engine and the simulator: two decodes (contexts 10 and 20), then prompts within budget 8."""
    f, spare = base_step([10, 20], [(0, 5), (2, 100)], budget=8)
    # decodes: 1 token each; prompt 1: 5 tokens (ctx 5); prompt 2: the 1 token left (ctx 3)
    assert (f.batch, f.tokens, f.kv, f.attn) == (4, 8, 10 + 20 + 5 + 3, 10 + 20 + 25 + 3)
    assert spare == 0
    assert base_step([10], [], budget=8)[1] == 7


def _auto_steps(step_model: StepTimeModel, rate: float) -> list[int]:
    """Draft lengths chosen in pure decode steps. (A step that also prefills makes drafts nearly free next to its
    prompt tokens; the engine's controller speculates there too.)"""
    res = simulate(spaced(4, prompt=20, output=40, gap=0.0), StepCost(step_model), PositionRates((rate,)),
                   Deployment(policy=SpecPolicy("auto", 6)), record_steps=True)
    decode = [s for s in res.replicas[0].steps if s.features.tokens == s.features.batch + s.features.spec_tokens]
    assert len(decode) > 5
    return [k for s in decode for k in s.ks]


def test_controller_picks_k0_when_verification_is_expensive():
    ks = _auto_steps(model(one=0.001, tokens=0.05), rate=0.6)  # every verified token costs 50x the step
    assert ks and all(k == 0 for k in ks)


def test_controller_speculates_when_verification_is_cheap():
    ks = _auto_steps(model(one=0.05, tokens=0.0001), rate=0.9)
    assert max(ks) >= 3


# --- replicas ----------------------------------------------------------------------------------------------------


def test_round_robin_spreads_requests_evenly_and_more_replicas_cut_latency():
    requests = with_arrivals(fixed_lengths(400, 64, 32), rate=30.0, seed=1)
    cost = StepCost(model(0.01, 0.0002))
    one = simulate(requests, cost, None, Deployment(replicas=1))
    four = simulate(requests, cost, None, Deployment(replicas=4))
    assert [r["requests"] for r in four.per_replica()] == [100] * 4
    assert four.summary["e2el_ms"]["p99"] < one.summary["e2el_ms"]["p99"]


def test_fewest_tokens_routes_around_a_long_request():
    requests = [SimRequest("long", 0.0, 400, 2000)] + [SimRequest(f"s{i}", 0.01 * (i + 1), 20, 10) for i in range(9)]
    res = simulate(requests, constant(0.01), None, Deployment(replicas=2, router="fewest-tokens"))
    where = {t.request_id: t.replica for t in res.times}
    assert all(where[f"s{i}"] != where["long"] for i in range(9))
    assert [r.outstanding_tokens for r in res.replicas] == [0, 0]  # the running count ends where it started


# --- rooflines -----------------------------------------------------------------------------------------------


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    a = RooflineAssumptions()
    m = roofline_model(LLAMA3_8B, H200, a)
    weights_s = LLAMA3_8B.params * 2 / (H200.hbm_bytes_per_s * a.bandwidth_efficiency)
    decode = StepFeatures(batch=1, tokens=1, kv=0, attn=0)
    assert m.predict(decode) == pytest.approx(weights_s + a.step_overhead_s + a.per_request_s)
    prefill = StepFeatures(batch=1, tokens=4096, kv=0, attn=0)
    compute_s = 2 * LLAMA3_8B.params * 4096 / (H200.dense_flops * a.compute_efficiency)
    assert m.predict(prefill) == pytest.approx(compute_s + a.step_overhead_s + a.per_request_s, rel=0.01)


# --- command line ----------------------------------------------------------------------------------------------


@pytest.fixture
def profile_file(tmp_path):
    """A small profile json in the format `turbospec profile` writes."""
    path = tmp_path / "profile.json"
    StepTimeModel({"target": LinearPart(("one", "tokens"), (0.02, 0.0005)),
                   "overhead": LinearPart(("one", "batch"), (0.001, 0.0001))},
                  key={"model": "fixture", "dtype": "bfloat16", "threads": "1"}).save(path)
    return path


def test_cli_simulates_with_a_profile_file(profile_file, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([["x", 4, 2], ["x", 4, 4], ["y", 0, 0]]))
    rc = main(["simulate", "--profile", str(profile_file), "--dataset", "fixed", "--num-prompts", "50",
               "--request-rate", "2,4", "--replicas", "1,2", "--speculation", "auto", "--acceptance-trace", str(trace),
               "--output", str(tmp_path / "out")])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.count("| 2.0 |") == 2 and out.count("| 4.0 |") == 2
    saved = json.loads((tmp_path / "out.json").read_text())
    assert [r["replicas"] for r in saved["results"]] == [1, 2, 1, 2]


@pytest.mark.parametrize(("argv", "needle"), [
    (["--roofline", "gpt-9"], "--roofline must be one of"),
    (["--roofline", "Llama-3-8B", "--replicas", "0"], "--replicas"),
    (["--roofline", "Llama-3-8B", "--speculation", "-1", "--acceptance-rates", "0.5"], "--speculation"),
    (["--roofline", "Llama-3-8B", "--speculation", "2"], "--acceptance-trace or --acceptance-rates"),
    (["--roofline", "Llama-3-8B", "--acceptance-rates", "0.5,1.5", "--speculation", "2"], "acceptance rates"),
    (["--roofline", "Llama-3-8B", "--dataset", "alpaca"], "--dataset must be one of"),
    (["--roofline", "Llama-3-8B", "--request-rate", "0"], "--request-rate"),
    (["--roofline", "Llama-3-8B", "--router", "random"], "--router must be one of"),
    (["--dataset", "fixed"], "give exactly one of --profile"),
])
def test_cli_bad_input_exits_2_with_what_is_allowed(argv, needle, capsys):
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("turbospec: error:") and needle in err[0], err


def test_cli_bad_input_exit_code_from_the_process():
    done = subprocess.run([sys.executable, "-m", "turbospec.cli", "simulate", "--profile", "/nonexistent.json"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "not a step-time profile" in done.stderr


def test_cli_replays_a_recorded_run(profile_file, tmp_path, capsys):
    """--requests with --replay: the recorded request's own outcomes, so its steps are known exactly."""
    (tmp_path / "run.json").write_text(json.dumps({"requests": [
        {"request_id": "a", "arrival_s": 0.0, "prompt_tokens": 10, "output_tokens": 8}]}))
    # as recorded: 4 of 4 accepted, then only 1 draft fits before the last token (rejected), then no draft
    (tmp_path / "trace.json").write_text(json.dumps({"trace": [["a", 4, 4], ["a", 1, 0], ["a", 0, 0]]}))
    rc = main(["simulate", "--profile", str(profile_file), "--requests", str(tmp_path / "run.json"),
               "--speculation", "4", "--acceptance-trace", str(tmp_path / "trace.json"), "--replay",
               "--output", str(tmp_path / "out")])
    assert rc == 0
    saved = json.loads((tmp_path / "out.json").read_text())["results"][0]
    assert saved["completed"] == 1
    # steps: prefill (10 tokens), then decodes verifying 4, 1 and 0 drafts; each 0.02 + 0.0005 x tokens + 0.0011
    steps = [10, 5, 2, 1]
    assert saved["e2el_ms"]["mean"] == pytest.approx(sum(0.02 + 0.0005 * t + 0.0011 for t in steps) * 1e3)
