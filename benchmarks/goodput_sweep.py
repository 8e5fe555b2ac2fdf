"""Serving-style sweep of speculation policies under Poisson load, for the goodput controller (issue 4).

One engine per workload; the speculation policy is switched at run time, so every policy of a workload runs
the same requests (same prompts in the same order, same arrival times at a given rate) on the same engine.
Policies: no-spec, fixed-k (k = 1, 2, 4, 8) and adaptive (the goodput controller, ``"auto"``).

Load: Poisson arrivals at each request rate (the same unit-rate exponential gaps, scaled by 1/rate, so the
rates differ only in scale). Time is a virtual clock: real time, plus the idle time skipped when the engine
has nothing to do and the next arrival is still in the future. An idle engine does not change while it
waits, so latencies (queueing included) are exact, and light load costs no wall time.

Workloads (WORKLOADS):
- a: smollm2-135m with the n-gram proposer; prompts alternate ShareGPT first turns and HumanEval (`mixed`).
- b: qwen2.5-coder-1.5b with the draft model qwen2.5-coder-0.5b; HumanEval prompts.
- c: qwen2.5-coder-1.5b with the committed EAGLE head (trees; k is the number of nodes verified); HumanEval.
- d: qwen2.5-coder-1.5b with the 0.5B draft on a mixed stream: ShareGPT and HumanEval alternating.
Claims per rate: adaptive's mean latency over the best other policy's (with a paired bootstrap interval over the
requests), its p99 over the best other p99, at the lowest rate no-spec's over adaptive's, at the top rate adaptive
against no-spec. Goodput: output tok/s of the requests that finished within 3x their latency alone.
Scenarios (workload a; no-spec, fixed-4, fixed-8, adaptive): a distribution change (HumanEval, then
ShareGPT) at one rate, and a load change (low, high, low rate). Writes ``<out>.json``, ``<out>.md`` and
``<out>_*.png``.

    .venv/bin/python benchmarks/goodput_sweep.py                   # full run, both workloads and scenarios
    .venv/bin/python benchmarks/goodput_sweep.py --workloads a --requests-a 3 --rates-a 0.5,2 --max-tokens-a 16 \\
        --threads 1 --policies no-spec,fixed-2 --no-scenarios --out /tmp/gs_test        # smoke test
    .venv/bin/python benchmarks/goodput_sweep.py --workloads a --requests-a 2 --rates-a 0.5,2 --max-tokens-a 16 \\
        --threads 1 --scenario-requests 2 --out /tmp/gs_scen                           # smoke test, scenarios
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from harness import alternating

from turbospec.tuning import set_speculation
from turbospec import LLM, SamplingParams
from turbospec.bench.machine import machine_info
from turbospec.bench.serve_bench import load_dataset
from turbospec.bench.serve_config import BenchConfig
from turbospec.data.prompts import BenchPrompt, load_mixed, load_prompts, load_sharegpt

POLICIES = ("no-spec", "fixed-1", "fixed-2", "fixed-4", "fixed-8", "adaptive")
SCENARIO_POLICIES = ("no-spec", "fixed-4", "fixed-8", "adaptive")
MAX_K = 8
CLAIM_TOLERANCE = 1.05  # adaptive may be this much slower than the best other policy and still pass
P99_TOLERANCE = 1.10  # ... and its p99 latency this much above the best other p99
LIGHT_LOAD_GAIN = 1.3  # at the lowest rate, no speculation's mean latency over adaptive's should reach this
BOOTSTRAP_SAMPLES = 2000
SLO_SCALE = 3.0  # goodput counts a request's tokens when it finished within this many times its latency alone
HISTORY_KEYS = ("num_decoding", "mean_k", "acceptance", "predicted_s", "measured_s")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- workloads ---------------------------------------------------------------------------------------------


@dataclass
class Workload:
    name: str
    target: str
    speculative_config: dict[str, Any]
    prompts: list[BenchPrompt]
    max_tokens: int
    rates: list[float]
    threads: int


# name: (target, speculative config, data set (`turbospec bench serve --dataset`), default rates (req/s), requests,
# max tokens)
WORKLOADS: dict[str, tuple[str, dict[str, Any], str, str, int, int]] = {
    "a": ("smollm2-135m", {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
          "mixed", "0.1,0.4,0.8,1.6,3.2", 16, 128),
    "b": ("qwen2.5-coder-1.5b", {"method": "draft", "model": "qwen2.5-coder-0.5b"},
          "humaneval", "0.02,0.05,0.1,0.2,0.4", 8, 64),
    # the committed EAGLE head: k is the number of its tree's nodes verified
    "c": ("qwen2.5-coder-1.5b", {"method": "eagle"},
          "humaneval", "0.02,0.05,0.1,0.2,0.4", 8, 64),
    # half code, where the 0.5B draft is accepted, half chat, where it mostly is not
    "d": ("qwen2.5-coder-1.5b", {"method": "draft", "model": "qwen2.5-coder-0.5b"},
          "mixed", "0.02,0.05,0.1,0.2,0.4", 8, 64),
}


def workload_prompts(name: str, n: int) -> list[BenchPrompt]:
    """The workload's first n prompts: those `turbospec bench serve` sends for its data set, so the served sweep
    and this one run the same requests."""
    return load_dataset(BenchConfig(dataset=WORKLOADS[name][2], num_prompts=n))


def controlled(spec: dict[str, Any], max_k: int = MAX_K) -> dict[str, Any]:
    """A workload's speculative config under the goodput controller, drafting at most max_k."""
    return {**spec, "num_speculative_tokens": "auto", "max_speculative_tokens": max_k}


def build_workloads(args: argparse.Namespace) -> list[Workload]:
    out = []
    for name in args.workloads:
        target, spec, _, _, _, _ = WORKLOADS[name]
        config = controlled(spec)
        out.append(Workload(name, target, config, workload_prompts(name, getattr(args, f"requests_{name}")),
                            getattr(args, f"max_tokens_{name}"), getattr(args, f"rates_{name}"),
                            getattr(args, f"threads_{name}") or args.threads))
    return out


def build_llm(w: Workload, args: argparse.Namespace) -> LLM:
    return workload_llm(w.target, w.speculative_config, w.threads, args.max_num_seqs, args.max_model_len)


def workload_llm(target: str, speculative_config: dict[str, Any], threads: int, max_num_seqs: int,
                 max_model_len: int) -> LLM:
    # no prefix caching: every policy replays the same prompts, and a warm cache would favour later runs
    return LLM(target, speculative_config=speculative_config, num_threads=threads, dtype="bfloat16",
               max_num_seqs=max_num_seqs, max_model_len=max_model_len, enable_prefix_caching=False, progress=False)


def chat_ids(llm: LLM, prompts: Sequence[BenchPrompt]) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)
            for p in prompts]


# --- policies ----------------------------------------------------------------------------------------------


def policy_value(policy: str) -> int | str:
    """The engine's speculation setting for a policy name: 0, a fixed k, or "auto"."""
    if policy == "no-spec":
        return 0
    if policy == "adaptive":
        return "auto"
    if policy.startswith("fixed-") and policy[6:].isdigit() and 1 <= int(policy[6:]) <= MAX_K:
        return int(policy[6:])
    raise ValueError(f"unknown policy {policy!r}: expected no-spec, fixed-k (1 <= k <= {MAX_K}) or adaptive")


def apply_policy(engine: Any, policy: str) -> None:
    set_speculation(engine, policy_value(policy))


# --- load generator ----------------------------------------------------------------------------------------


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times of n requests at `rate` req/s; the gaps are the seed's unit-rate gaps scaled by 1/rate."""
    return piecewise_arrivals([(n, rate)], seed)


def piecewise_arrivals(phases: Sequence[tuple[int, float]], seed: int) -> list[float]:
    """Poisson arrivals in phases of (count, rate), each phase continuing from the last arrival."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for count, rate in phases:
        if rate <= 0:
            raise ValueError(f"request rate must be > 0, got {rate}")
        for _ in range(count):
            t += rng.expovariate(1.0) / rate
            out.append(t)
    return out


class VirtualClock:
    """Real monotonic time since start, plus the idle time skipped by jump_to."""

    def __init__(self) -> None:
        self.origin = time.monotonic()
        self.skipped = 0.0

    def now(self) -> float:
        return time.monotonic() - self.origin + self.skipped

    def jump_to(self, t: float) -> None:
        self.skipped += max(0.0, t - self.now())

    def virtual(self, monotonic: float) -> float:
        """A monotonic timestamp taken since the last jump, on the virtual clock."""
        return monotonic - self.origin + self.skipped


@dataclass
class RequestRecord:
    index: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    output_tokens: int = 0

    @property
    def latency(self) -> float:
        assert self.finish is not None
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrival

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "latency": self.latency, "ttft": self.ttft}


_run_counter = 0


def run_poisson(engine: Any, prompts: list[list[int]], arrival_times: list[float], max_tokens: int,
                history_out: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Serve prompts[i] arriving at arrival_times[i] (virtual seconds); one dict per request, in prompt order:
    arrival, first_token, finish (virtual seconds), latency (queueing included), ttft, output_tokens.

    With history_out, the controller's per-step records made during the run are appended to it, their
    "time" moved onto the virtual clock (seconds since the run's start).
    """
    global _run_counter
    _run_counter += 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    order = sorted(range(len(prompts)), key=lambda i: arrival_times[i])
    records: dict[str, RequestRecord] = {}
    history = engine.speculation.history
    seen = len(history)
    clock = VirtualClock()
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock.jump_to(arrival_times[order[nxt]])
        now = clock.now()
        while nxt < len(order) and arrival_times[order[nxt]] <= now:
            i = order[nxt]
            rid = engine.add_request(prompts[i], params, request_id=f"sweep{_run_counter}-{i}")
            records[rid] = RequestRecord(i, arrival_times[i])
            nxt += 1
        outputs = engine.step()
        now = clock.now()
        for out in outputs:
            rec = records[out.request_id]
            rec.output_tokens = len(out.outputs[0].token_ids)
            if rec.first_token is None and rec.output_tokens:
                rec.first_token = now
            if out.finished:
                rec.finish = now
        if history_out is not None:
            history_out += [{"time": clock.virtual(h["time"]), **{k: h.get(k) for k in HISTORY_KEYS}}
                            for h in history[seen:]]
            seen = len(history)
    return [r.as_dict() for r in sorted(records.values(), key=lambda r: r.index)]


@dataclass
class RunResult:
    requests: list[dict[str, Any]]
    spec_stats: dict[str, Any]
    history: list[dict[str, Any]]
    wall_s: float


def run_policy(engine: Any, policy: str, prompts: list[list[int]], arrivals: list[float],
               max_tokens: int) -> RunResult:
    apply_policy(engine, policy)
    engine.reset_spec_stats()  # also clears engine.speculation.history
    recorded: list[dict[str, Any]] = []
    start = time.perf_counter()
    requests = run_poisson(engine, prompts, arrivals, max_tokens, recorded)
    return RunResult(requests, engine.spec_stats_dict(), recorded, time.perf_counter() - start)


def warm_up(engine: Any, prompt: list[int]) -> None:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), request_id="warmup")
    while engine.has_unfinished_requests():
        engine.step()


# --- metrics -----------------------------------------------------------------------------------------------


def summarise(result: RunResult) -> dict[str, Any]:
    reqs = result.requests
    latency = [r["latency"] for r in reqs]
    tokens = sum(r["output_tokens"] for r in reqs)
    span = max(r["finish"] for r in reqs) - min(r["arrival"] for r in reqs)
    stats = result.spec_stats
    drafted = stats.get("num_draft_tokens", 0)
    return {
        "num_requests": len(reqs),
        "mean_latency_s": float(np.mean(latency)),
        "p50_latency_s": float(np.percentile(latency, 50)),
        "p99_latency_s": float(np.percentile(latency, 99)),
        "mean_ttft_s": float(np.mean([r["ttft"] for r in reqs])),
        "output_tokens": tokens,
        "output_throughput_tok_s": tokens / span if span > 0 else 0.0,
        "mean_k": float(stats["mean_k"]),  # mean verify length over decoding request-steps; 0 for no-spec
        "acceptance_rate": stats.get("num_accepted_tokens", 0) / drafted if drafted else None,
        "k_histogram": stats["k_histogram"],
        "controller": stats.get("controller"),  # the adaptive policy's own cost and step-time prediction error
        "wall_s": result.wall_s,
        "virtual_s": span,
    }


def describe(row: dict[str, Any]) -> str:
    acc = "-" if row["acceptance_rate"] is None else f"{row['acceptance_rate']:.2f}"
    return (f"mean {row['mean_latency_s']:.2f} s, p99 {row['p99_latency_s']:.2f} s, "
            f"{row['output_throughput_tok_s']:.1f} tok/s, mean k {row['mean_k']:.2f}, acceptance {acc}, "
            f"wall {row['wall_s']:.1f} s")


# --- sweep and scenarios -----------------------------------------------------------------------------------


def sweep(w: Workload, llm: LLM, policies: Sequence[str], seed: int, repeats: int = 1) -> list[dict[str, Any]]:
    """Every policy at every rate; with repeats > 1 the policies are interleaved (all policies, then all again in
    reverse order) so slow drift of the machine, and whatever a run leaves behind for the next one, hits every
    policy alike; each row is the mean of its runs."""
    engine = llm.engine
    prompts = chat_ids(llm, w.prompts)
    rows = []
    total, done = len(w.rates) * len(policies) * repeats, 0
    for rate in sorted(w.rates):
        arrivals = poisson_arrivals(len(prompts), rate, seed)
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
        for repeat in range(repeats):
            for policy in alternating(policies, repeat):
                done += 1
                result = run_policy(engine, policy, prompts, arrivals, w.max_tokens)
                row = {"workload": w.name, "policy": policy, "request_rate": rate, **summarise(result),
                       "requests": result.requests}
                runs[policy].append(row)
                log(f"[{done}/{total}] {w.name} rate {rate:g} {policy}: {describe(row)}")
        rows += [merge_runs(r) for r in runs.values()]
    return rows


AVERAGED = ("mean_latency_s", "p50_latency_s", "p99_latency_s", "mean_ttft_s", "output_throughput_tok_s", "mean_k")


def merge_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for repeated runs of a policy: the averaged metrics, each run's mean latency, its spread."""
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    for key in AVERAGED:
        row[key] = float(np.mean([r[key] for r in runs]))
    row["mean_latency_runs_s"] = [r["mean_latency_s"] for r in runs]
    lat = row["mean_latency_runs_s"]
    row["mean_latency_spread"] = (max(lat) - min(lat)) / row["mean_latency_s"]
    row["requests"] = [q for r in runs for q in r["requests"]]
    return row


@dataclass
class Scenario:
    name: str
    description: str
    prompts: list[BenchPrompt]
    arrivals: list[float]
    switch_times_s: list[float]
    params: dict[str, Any] = field(default_factory=dict)


def distribution_change(n: int, rate: float, seed: int) -> Scenario:
    prompts = load_prompts(n, "humaneval")[0] + load_sharegpt(n)
    arrivals = poisson_arrivals(len(prompts), rate, seed)
    return Scenario("distribution_change", f"{n} HumanEval prompts, then {n} ShareGPT first turns, "
                    f"Poisson at {rate:g} req/s", prompts, arrivals, [arrivals[n]],
                    {"rate": rate, "phases": ["humaneval", "sharegpt"]})


def load_change(n: int, low: float, high: float, seed: int) -> Scenario:
    prompts = load_mixed(3 * n)
    arrivals = piecewise_arrivals([(n, low), (n, high), (n, low)], seed)
    return Scenario("load_change", f"{n} requests each at {low:g}, {high:g}, {low:g} req/s (workload a prompts)",
                    prompts, arrivals, [arrivals[n], arrivals[2 * n]], {"rates": [low, high, low]})


def run_scenario(sc: Scenario, llm: LLM, max_tokens: int) -> dict[str, Any]:
    engine = llm.engine
    prompts = chat_ids(llm, sc.prompts)
    out: dict[str, Any] = {"description": sc.description, "num_requests": len(prompts),
                           "switch_times_s": sc.switch_times_s, **sc.params, "policies": {}}
    for policy in SCENARIO_POLICIES:
        result = run_policy(engine, policy, prompts, sc.arrivals, max_tokens)
        row = summarise(result)
        entry = {**row, "latencies_s": [r["latency"] for r in result.requests], "requests": result.requests}
        if policy == "adaptive":
            entry["history"] = result.history
        out["policies"][policy] = entry
        log(f"scenario {sc.name} {policy}: {describe(row)}")
    return out


# --- claims ------------------------------------------------------------------------------------------------


def find(rows: list[dict[str, Any]], workload: str, rate: float, policy: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["workload"] == workload and r["request_rate"] == rate
                 and r["policy"] == policy), None)


def common_length_latency(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean latency per policy over the requests whose output length is the same in every run of every policy.

    Speculation is lossless, but bf16 results depend on the batch's shape, so a near-tie can flip a greedy
    token and change an answer's length under one policy; such a request's latency is not comparable."""
    lengths: dict[int, set[int]] = {}
    for row in rows:
        for q in row["requests"]:
            lengths.setdefault(q["index"], set()).add(q["output_tokens"])
    same = {i for i, n in lengths.items() if len(n) == 1}
    out: dict[str, float] = {"count": float(len(same))}
    for row in rows:
        lat = [q["latency"] for q in row["requests"] if q["index"] in same]
        out[row["policy"]] = float(np.mean(lat)) if lat else float("nan")
    return out


def latency_by_request(row: dict[str, Any]) -> dict[int, float]:
    """A row's mean latency per request (over its interleaved runs)."""
    runs: dict[int, list[float]] = {}
    for q in row["requests"]:
        runs.setdefault(q["index"], []).append(q["latency"])
    return {i: float(np.mean(v)) for i, v in runs.items()}


def ratio_ci(num: dict[str, Any], den: dict[str, Any], seed: int = 0) -> tuple[float, float]:
    """95% interval of mean latency(num) / mean latency(den): a paired bootstrap over the requests both served.
    It covers which requests were drawn, not run-to-run machine noise (the runs' spread says that) nor the
    queueing that ties one request's latency to its neighbours' (each bootstrap sample keeps the rate's
    measured latencies as they were)."""
    a, b = latency_by_request(num), latency_by_request(den)
    common = sorted(set(a) & set(b))
    x, y = np.array([a[i] for i in common]), np.array([b[i] for i in common])
    picks = np.random.default_rng(seed).integers(0, len(common), (BOOTSTRAP_SAMPLES, len(common)))
    ratios = x[picks].mean(axis=1) / y[picks].mean(axis=1)
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return float(lo), float(hi)


def claims(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: adaptive's mean latency over the best other policy's at each rate (passes at <= 1.05),
    and at the highest rate whether fixed-8 is slower than no-spec and adaptive is not."""
    out: dict[str, Any] = {}
    for wl in sorted({r["workload"] for r in rows}):
        rates = sorted({r["request_rate"] for r in rows if r["workload"] == wl})
        per_rate = []
        for rate in rates:
            adaptive = find(rows, wl, rate, "adaptive")
            others = [r for r in rows
                      if r["workload"] == wl and r["request_rate"] == rate and r["policy"] != "adaptive"]
            if adaptive is None or not others:
                continue
            best = min(others, key=lambda r: r["mean_latency_s"])
            ratio = adaptive["mean_latency_s"] / best["mean_latency_s"]
            common = common_length_latency([adaptive, *others])
            best_common = min((r["policy"] for r in others), key=lambda p: common[p])
            best_p99 = min(others, key=lambda r: r["p99_latency_s"])
            p99_ratio = adaptive["p99_latency_s"] / best_p99["p99_latency_s"]
            per_rate.append({"rate": rate, "adaptive_mean_latency_s": adaptive["mean_latency_s"],
                             "best_other_policy": best["policy"], "best_other_mean_latency_s": best["mean_latency_s"],
                             "ratio": ratio, "ratio_ci95": ratio_ci(adaptive, best),
                             "within_5pct": ratio <= CLAIM_TOLERANCE,
                             "p99_best_other_policy": best_p99["policy"], "p99_ratio": p99_ratio,
                             "p99_within_10pct": p99_ratio <= P99_TOLERANCE,
                             "common_length_requests": common["count"],
                             "common_length_best_other_policy": best_common,
                             "common_length_ratio": common["adaptive"] / common[best_common]})
        entry: dict[str, Any] = {"adaptive_vs_best_other": per_rate}
        if not per_rate:
            entry["note"] = "adaptive was not run: no claims on it"
        low = rates[0] if rates else None
        low_nospec = find(rows, wl, low, "no-spec") if low is not None else None
        low_adaptive = find(rows, wl, low, "adaptive") if low is not None else None
        if low_nospec is not None and low_adaptive is not None:
            gain = low_nospec["mean_latency_s"] / low_adaptive["mean_latency_s"]
            lo, hi = ratio_ci(low_nospec, low_adaptive)
            entry["lowest_rate"] = {"rate": low, "nospec_over_adaptive": gain, "ci95": (lo, hi),
                                    "reaches_light_load_gain": gain >= LIGHT_LOAD_GAIN}
        top = rates[-1] if rates else None
        nospec = find(rows, wl, top, "no-spec") if top is not None else None
        if nospec is not None:
            high: dict[str, Any] = {"rate": top}
            for policy, key in (("fixed-8", "fixed8"), ("adaptive", "adaptive")):
                row = find(rows, wl, top, policy)
                if row is not None:
                    high[f"{key}_over_nospec"] = row["mean_latency_s"] / nospec["mean_latency_s"]
            if "fixed8_over_nospec" in high:
                high["fixed8_slower_than_nospec"] = high["fixed8_over_nospec"] > 1.0
            if "adaptive_over_nospec" in high:
                high["adaptive_not_slower_than_nospec"] = high["adaptive_over_nospec"] <= 1.0
            entry["highest_rate"] = high
        out[wl] = entry
    return out


# --- report ------------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def passed(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def markdown(report: dict[str, Any]) -> str:
    m, cfg = report["machine"], report["config"]
    lines = [
        "# Goodput sweep: speculation policies under Poisson load", "",
        f"- command: `{report['command']}`",
        f"- machine: {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']}, {m['platform']} (threads per workload below)",
        f"- date: {report['date']}, commit {m['commit']}",
        "- latency: arrival to last token on a virtual clock (queueing included; idle gaps skipped), greedy, "
        "chat template; throughput: output tokens / (last finish - first arrival)", "",
    ]
    for wl, wcfg in cfg["workloads"].items():
        rows = [r for r in report["rows"] if r["workload"] == wl]
        if not rows:  # (--scenarios-only)
            continue
        policies = [p for p in cfg["policies"] if any(r["policy"] == p for r in rows)]
        rates = sorted({r["request_rate"] for r in rows})
        lines += [f"## Workload {wl}: `{wcfg['target']}`, {wcfg['speculative_config']['method']}", "",
                  f"{wcfg['num_requests']} requests ({wcfg['prompts']}), max {wcfg['max_tokens']} new tokens, "
                  f"{wcfg.get('threads', m['threads'])} threads.", "",
                  "Mean latency (s):", "", "| rate (req/s) | " + " | ".join(policies) + " |",
                  "|---|" + "---|" * len(policies)]
        for rate in rates:
            cells = [fmt(r["mean_latency_s"]) if (r := find(rows, wl, rate, p)) else "-" for p in policies]
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
        goodput = slo_goodput(rows, wl)
        if goodput is not None:
            lines += ["", f"Goodput (output tok/s of the requests that finished within {SLO_SCALE:g}x their latency "
                      "alone, i.e. no-spec at the lowest rate):", "",
                      "| rate (req/s) | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
            lines += [f"| {rate:g} | " + " | ".join(fmt(goodput.get((rate, p)), ".1f") for p in policies) + " |"
                      for rate in rates]
        if cfg.get("repeats", 1) > 1:
            lines += ["", f"Each cell is the mean of {cfg['repeats']} interleaved runs; the runs' mean latencies:", ""]
            lines += [f"- rate {r['request_rate']:g} {r['policy']}: "
                      + ", ".join(fmt(x) for x in r["mean_latency_runs_s"])
                      + f" (spread {r['mean_latency_spread'] * 100:.0f}%)"
                      for r in sorted(rows, key=lambda r: (r["request_rate"], policies.index(r["policy"])))]
        lines += ["", "| rate | policy | mean latency (s) | p99 latency (s) | mean TTFT (s) | throughput (tok/s) | "
                  "mean k | acceptance |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: (r["request_rate"], policies.index(r["policy"]))):
            lines.append(f"| {r['request_rate']:g} | {r['policy']} | {fmt(r['mean_latency_s'])} | "
                         f"{fmt(r['p99_latency_s'])} | {fmt(r['mean_ttft_s'])} | "
                         f"{fmt(r['output_throughput_tok_s'], '.1f')} | "
                         f"{fmt(r['mean_k'])} | {fmt(r['acceptance_rate'])} |")
        lines += ["", *claims_markdown(report["claims"].get(wl, {})), ""]
    for name, sc in report["scenarios"].items():
        lines += [f"## Scenario: {name.replace('_', ' ')}", "", f"{sc['description']}; switch at "
                  + ", ".join(f"{t:.1f} s" for t in sc["switch_times_s"]) + " (virtual).", "",
                  "| policy | mean latency (s) | p99 latency (s) | throughput (tok/s) | mean k | acceptance |",
                  "|---|---|---|---|---|---|"]
        for policy, r in sc["policies"].items():
            lines.append(f"| {policy} | {fmt(r['mean_latency_s'])} | {fmt(r['p99_latency_s'])} | "
                         f"{fmt(r['output_throughput_tok_s'], '.1f')} | {fmt(r['mean_k'])} | "
                         f"{fmt(r['acceptance_rate'])} |")
        lines.append("")
    plots = report.get("plots", [])
    if plots:
        lines += ["## Plots", "", *[f"- `{p}`" for p in plots], ""]
    return "\n".join(lines)


def claims_markdown(c: dict[str, Any]) -> list[str]:
    lines = ["Claims:", ""]
    if c.get("note"):
        lines.append(f"- {c['note']}")
    for e in c.get("adaptive_vs_best_other", []):
        lines.append(f"- rate {e['rate']:g}: adaptive / best other ({e['best_other_policy']}) = {e['ratio']:.3f} "
                     f"(95% CI {e['ratio_ci95'][0]:.3f}-{e['ratio_ci95'][1]:.3f}) "
                     f"-> {passed(e['within_5pct'])} (<= {CLAIM_TOLERANCE}); p99 / best other p99 "
                     f"({e['p99_best_other_policy']}) = {e['p99_ratio']:.3f} -> {passed(e['p99_within_10pct'])} "
                     f"(<= {P99_TOLERANCE}); over the "
                     f"{int(e['common_length_requests'])} requests whose output length every policy agrees on: "
                     f"{e['common_length_ratio']:.3f} against {e['common_length_best_other_policy']}")
    low = c.get("lowest_rate")
    if low:
        lines.append(f"- lowest rate {low['rate']:g}: no-spec / adaptive mean latency = {low['nospec_over_adaptive']:.3f} "
                     f"(95% CI {low['ci95'][0]:.3f}-{low['ci95'][1]:.3f}) -> {passed(low['reaches_light_load_gain'])} "
                     f"(>= {LIGHT_LOAD_GAIN})")
    high = c.get("highest_rate")
    if high:
        if "fixed8_slower_than_nospec" in high:
            lines.append(f"- highest rate {high['rate']:g}: fixed-8 / no-spec = {high['fixed8_over_nospec']:.3f}; "
                         f"fixed-8 slower than no-spec: {'yes' if high['fixed8_slower_than_nospec'] else 'NO'}")
        if "adaptive_not_slower_than_nospec" in high:
            lines.append(f"- highest rate {high['rate']:g}: adaptive / no-spec = {high['adaptive_over_nospec']:.3f} "
                         f"-> {passed(high['adaptive_not_slower_than_nospec'])} (adaptive not slower than no-spec)")
    if len(lines) == 2:
        lines.append("- none computable from the policies run")
    return lines


# --- plots -------------------------------------------------------------------------------------------------


def _rate_ticks(ax: Any, rates: list[float]) -> None:
    """Label exactly the measured rates: log-scale minor labels overlap at these ranges."""
    from matplotlib.ticker import FixedLocator, NullFormatter, NullLocator

    ticks = sorted(set(rates))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticklabels([f"{t:g}" for t in ticks])


def slo_goodput(rows: list[dict[str, Any]], wl: str) -> dict[tuple[float, str], float] | None:
    """Output tokens per second of the requests that finished within SLO_SCALE x their own latency alone (no
    speculation at the lowest rate, where requests rarely queue), per (rate, policy); None without that row."""
    ours = [r for r in rows if r["workload"] == wl]
    rates = sorted({r["request_rate"] for r in ours})
    alone = find(ours, wl, rates[0], "no-spec") if rates else None
    if alone is None:
        return None
    limit = {i: SLO_SCALE * lat for i, lat in latency_by_request(alone).items()}
    out = {}
    for r in ours:
        runs = max(1, len(r.get("mean_latency_runs_s", [1])))
        tokens = sum(q["output_tokens"] for q in r["requests"] if q["latency"] <= limit.get(q["index"], 0.0))
        out[(r["request_rate"], r["policy"])] = tokens / runs / r["virtual_s"] if r["virtual_s"] > 0 else 0.0
    return out


def plot_workload(rows: list[dict[str, Any]], wl: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["workload"] == wl]
    goodput = slo_goodput(rows, wl)
    panels: list[tuple[str, Any]] = [("mean latency (s)", lambda r: r["mean_latency_s"]),
                                     ("p99 latency (s)", lambda r: r["p99_latency_s"])]
    if goodput is not None:
        panels.append((f"goodput (tok/s within {SLO_SCALE:g}x latency alone)",
                       lambda r: goodput[(r["request_rate"], r["policy"])]))
    if all(r.get("mean_k") is not None for r in rows):  # (the served sweep cannot see k)
        panels.append(("mean k", lambda r: r["mean_k"]))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), squeeze=False)
    for ax, (label, value) in zip(axes.flat, panels):
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["request_rate"], value(r)) for r in rows if r["policy"] == policy)
            ax.plot(*zip(*pts), marker="o", label=policy, lw=2.5 if policy == "adaptive" else 1.2)
        ax.set(xscale="log", xlabel="request rate (req/s)", ylabel=label, title=f"workload {wl}: {label}")
        _rate_ticks(ax, [r["request_rate"] for r in rows])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cdf(sc: dict[str, Any], name: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, r in sc["policies"].items():
        lat = np.sort(r["latencies_s"])
        ax.step(lat, np.arange(1, len(lat) + 1) / len(lat), where="post", label=policy)
    ax.set(xlabel="latency (s)", ylabel="fraction of requests", title=f"{name.replace('_', ' ')}: latency CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_history(sc: dict[str, Any], name: str, path: Path) -> bool:
    import matplotlib.pyplot as plt

    history = sc["policies"].get("adaptive", {}).get("history")
    if not history:
        return False
    t = np.array([h["time"] for h in history])
    series = [("mean_k", "mean k"), ("acceptance", "acceptance"), ("num_decoding", "decoding requests")]
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 7), sharex=True)
    for ax, (key, label) in zip(axes, series):
        y = np.array([np.nan if h.get(key) is None else h[key] for h in history], dtype=float)
        ax.plot(t, y, lw=0.6, alpha=0.5, marker=".", ms=2)
        if len(y) >= 9:
            ax.plot(t, rolling_mean(y, 9), lw=1.5, label="rolling mean (9 steps)")
            ax.legend(loc="upper right")
        for s in sc["switch_times_s"]:
            ax.axvline(s, color="red", ls="--", lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_title(f"{name.replace('_', ' ')}: adaptive policy over time (switch dashed)")
    axes[-1].set_xlabel("virtual time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def rolling_mean(y: np.ndarray, window: int) -> np.ndarray:
    out = np.full_like(y, np.nan)
    for i in range(len(y)):
        part = y[max(0, i - window + 1): i + 1]
        part = part[~np.isnan(part)]
        out[i] = part.mean() if len(part) else np.nan
    return out


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    swept = [wl for wl in report["config"]["workloads"] if any(r["workload"] == wl for r in report["rows"])]
    for wl in swept:
        path = out.with_name(f"{out.name}_{wl}.png" if len(swept) > 1 else f"{out.name}.png")
        plot_workload(report["rows"], wl, path)
        written.append(path.name)
    for name, sc in report["scenarios"].items():
        path = out.with_name(f"{out.name}_{name}_cdf.png")
        plot_cdf(sc, name, path)
        written.append(path.name)
        path = out.with_name(f"{out.name}_{name}_k.png")
        if plot_history(sc, name, path):
            written.append(path.name)
    return written


# --- main --------------------------------------------------------------------------------------------------


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def str_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", type=str_list, default=["a", "b"], help="comma list of " + ", ".join(WORKLOADS))
    # 2 OpenMP threads on 2 shared cores jitter by 10-20% run to run; 1 thread by ~2%. Per workload, so a small
    # model can trade speed for comparable runs.
    for name, (_, _, _, rates, requests, max_tokens) in WORKLOADS.items():
        ap.add_argument(f"--rates-{name}", type=float_list, default=float_list(rates), help="req/s, comma list")
        ap.add_argument(f"--requests-{name}", type=int, default=requests)
        ap.add_argument(f"--max-tokens-{name}", type=int, default=max_tokens)
        ap.add_argument(f"--threads-{name}", type=int, default=None, help=f"threads for workload {name} (default --threads)")
    ap.add_argument("--policies", type=str_list, default=list(POLICIES), help="comma list of " + ", ".join(POLICIES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scenarios", action=argparse.BooleanOptionalAction, default=True,
                    help="run the distribution- and load-change scenarios on workload a")
    ap.add_argument("--scenarios-only", action="store_true", help="run the scenarios, not the sweep")
    ap.add_argument("--scenario-rate", type=float, default=None, help="req/s; default: the middle rate of a")
    ap.add_argument("--scenario-requests", type=int, default=8, help="requests per scenario phase")
    ap.add_argument("--out", default="benchmarks/results/goodput_sweep/goodput_sweep")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (rate, policy), interleaved; rows average them")
    ap.add_argument("--replot", action="store_true", help="rewrite <out>.md and plots from <out>.json only")
    args = ap.parse_args(argv)
    if args.scenarios_only and (not args.scenarios or "a" not in args.workloads):
        ap.error("--scenarios-only runs workload a's scenarios: it needs workload a and no --no-scenarios")
    for name in args.workloads:
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}: expected one of " + ", ".join(WORKLOADS))
        if not getattr(args, f"rates_{name}") or min(getattr(args, f"rates_{name}")) <= 0:
            ap.error(f"--rates-{name}: give at least one rate, each > 0 req/s")
        for what in ("requests", "max_tokens"):
            if getattr(args, f"{what}_{name}") < 1:
                ap.error(f"--{what.replace('_', '-')}-{name} must be >= 1")
    for policy in args.policies:
        try:
            policy_value(policy)
        except ValueError as exc:
            ap.error(str(exc))
    return args


def workload_config(w: Workload) -> dict[str, Any]:
    kinds = sorted({p.id.split("/", 1)[0] for p in w.prompts})
    return {"target": w.target, "speculative_config": w.speculative_config, "num_requests": len(w.prompts),
            "prompts": " + ".join(kinds), "prompt_ids": [p.id for p in w.prompts], "max_tokens": w.max_tokens,
            "rates": sorted(w.rates), "threads": w.threads}


def run_scenarios(args: argparse.Namespace, w: Workload, llm: LLM) -> dict[str, Any]:
    rates = sorted(w.rates)
    rate = args.scenario_rate or rates[len(rates) // 2]
    n = args.scenario_requests
    scenarios = [distribution_change(n, rate, args.seed), load_change(n, rates[0], rates[-1], args.seed)]
    return {sc.name: run_scenario(sc, llm, w.max_tokens) for sc in scenarios}


def write_report(report: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(report, out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    print(md)
    log(f"wrote {out.with_suffix('.json')}, {out.with_suffix('.md')} and {len(report['plots'])} plots")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:  # claims, tables and plots again from a committed JSON, without running anything
        report = json.loads(Path(args.out).with_suffix(".json").read_text())
        report["claims"] = claims(report["rows"])
        write_report(report, Path(args.out))
        return
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    workloads = build_workloads(args)
    rows: list[dict[str, Any]] = []
    scenarios: dict[str, Any] = {}
    if args.scenarios and "a" not in args.workloads:
        log("scenarios run on workload a only, which is not selected: skipping them")
    for w in workloads:
        log(f"workload {w.name}: {w.target}, {w.speculative_config['method']}, {len(w.prompts)} requests, "
            f"rates {','.join(f'{r:g}' for r in sorted(w.rates))}")
        llm = build_llm(w, args)
        warm_up(llm.engine, chat_ids(llm, w.prompts[:1])[0])
        llm.engine.speculation.record_history = True
        if not args.scenarios_only:
            rows += sweep(w, llm, args.policies, args.seed, args.repeats)
        if args.scenarios and w.name == "a":
            scenarios = run_scenarios(args, w, llm)
        del llm
        gc.collect()
    report = {
        "machine": machine_info(args.threads),
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else " ".join(argv),
        "date": started,
        "config": {"policies": args.policies, "seed": args.seed, "repeats": args.repeats,
                   "max_num_seqs": args.max_num_seqs,
                   "max_model_len": args.max_model_len, "scenario_requests_per_phase": args.scenario_requests,
                   "claim_tolerance": CLAIM_TOLERANCE, "workloads": {w.name: workload_config(w) for w in workloads}},
        "rows": rows,
        "scenarios": scenarios,
        "claims": claims(rows),
    }
    write_report(report, Path(args.out))


if __name__ == "__main__":
    main()
