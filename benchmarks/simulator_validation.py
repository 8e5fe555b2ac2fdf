"""Does ``turbospec simulate`` predict real serving? Measure, then simulate the very same traffic.

    PYTHONPATH=$PWD python benchmarks/simulator_validation.py            # ~35 min on 2 CPU cores

On smollm2-135m (CPU, the engine's default options but one thread, n-gram speculation with k = 4):
1. the step-time profile the engine would use (its profile key), reused from the cache or measured
   (`turbospec profile --grid full` equivalent);
2. before each rate and once after the last, a calibration run on its own prompts: two requests served one at
   a time (single-decode steps), then a burst that measures the engine's capacity (the first places the three
   rates) and large batches, then 12 requests at half the capacity (one prompt's prefill among decodes).
   The two calibrations around a rate refit the profile as the engine refits it online (the machine's speed
   drifts by 20% within minutes here: bracketing estimates it from both sides), and give the per-step
   serving overhead the profile does not see (the serving loop around ``engine.step()``); nothing of the
   validation runs is used to calibrate;
3. real serving at three rates (25%, 50% and 75% of that capacity: at 90% a step-time error of a few percent
   moves the queueing delay by tens of percent, and served steps on this shared machine drift by more than
   that while a run lasts), each rate three times (`--repeats`: up the rates, down, up again), every run on its own
   ShareGPT prompts,
   through the server's own ``AsyncEngine`` (its engine thread and event loop, as ``turbospec serve`` runs
   it, without the HTTP layer) with Poisson arrivals from ``bench serve``'s generator; it records every
   request's arrival, first token and finish, its prompt and output lengths, and the acceptance trace
   (``engine.speculation.verify_trace``, plus a (request, 0, 0) record for each decoding step that verified nothing);
4. the simulator on the same arrivals, lengths and acceptance trace, with the profile and the calibrated
   overhead; predicted vs measured mean / p99 of E2EL and TTFT per rate, over all of its runs' requests,
   next to how far the rate's own measured runs differ (the machine's reproducibility).

Writes benchmarks/results/simulator_validation/simulator_validation.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from turbospec.data.prompts import load_sharegpt
from turbospec.data.arrivals import arrival_offsets
from turbospec.bench.serve_report import summarize
from turbospec.config import EngineConfig
from turbospec.tuning.profiler import GRIDS, build_model, load_or_profile, profile_key, profile_path
from turbospec.control.step_time import StepFeatures, StepSample, StepTimeModel
from turbospec.engine import LLMEngine
from turbospec.tuning import build_engine
from turbospec.sampling_params import SamplingParams
from turbospec.server.async_engine import AsyncEngine
from turbospec.sim.draft_outcomes import TraceRecord, TraceReplay, rates_from_trace
from turbospec.sim.replica import SpecPolicy
from turbospec.sim.simulator import Deployment, simulate
from turbospec.sim.step_cost import StepCost, StepOverhead, mean_level
from turbospec.sim.workload import SimRequest

MODEL = "smollm2-135m"
K = 4
SPEC = {"method": "ngram", "num_speculative_tokens": K}
MAX_TOKENS = 128
RESULTS = Path(__file__).resolve().parent / "results"
TARGET = 0.15
BRACKETED = "replay, bracketed"
UNLEVELLED = "replay, bracketed, no mean level"


# --- measuring -----------------------------------------------------------------------------------------------


@dataclass
class StepLog:
    """Per served step: features, time inside engine.step(), and the whole loop iteration (for the overhead)."""

    features: list[dict[str, int]] = field(default_factory=list)
    parts: list[tuple[float, float, float]] = field(default_factory=list)  # the engine's target / draft / overhead
    engine_s: list[float] = field(default_factory=list)
    loop_s: list[float | None] = field(default_factory=list)  # None after an idle wait


@dataclass
class ServedRun:
    rate: float
    requests: list[SimRequest]  # measured lengths, scheduled arrivals
    ttft_s: list[float]
    e2el_s: list[float]
    trace: list[TraceRecord]
    steps: StepLog
    wall_s: float


class Recorder:
    """The AsyncEngine's step observer (engine thread): step timings and the per-step acceptance records."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps = StepLog()
        self.trace: list[TraceRecord] = []
        self._seen_trace = 0
        self._last_step = engine.last_step
        self._last_t: float | None = None
        self._started: set[str] = set()

    def __call__(self, engine: LLMEngine, outputs: list[Any]) -> None:
        now = time.perf_counter()
        stepped = engine.last_step is not self._last_step
        if stepped:
            self._last_step = engine.last_step
            assert engine.last_step is not None and engine.last_sample is not None
            sample = engine.last_sample
            self.steps.features.append(asdict(sample.features))
            self.steps.parts.append((sample.target_s, sample.draft_s, sample.overhead_s))
            self.steps.engine_s.append(engine.last_step.seconds)
            self.steps.loop_s.append(None if self._last_t is None else now - self._last_t)
            trace = engine.speculation.verify_trace or []
            new = trace[self._seen_trace:]
            self._seen_trace = len(trace)
            verified = {rid for rid, _, _ in new}
            self.trace.extend(new)
            for out in outputs:  # a decoding step that verified no draft is a (request, 0, 0) record
                if out.delta_token_ids and out.request_id in self._started and out.request_id not in verified:
                    self.trace.append((out.request_id, 0, 0))
                if out.delta_token_ids:
                    self._started.add(out.request_id)
        # the next iteration is back to back only if the engine still has work (else it waits for commands)
        self._last_t = now if engine.has_unfinished_requests() else None


async def _serve(engine: LLMEngine, prompts: list[tuple[str, list[int]]], offsets: np.ndarray
                 ) -> tuple[list[float], list[float], list[int], Recorder, float]:
    recorder = Recorder(engine)
    engine.speculation.verify_trace = []
    engine.sample_steps = True  # builds StepFeatures every step (microseconds), for the overhead fit
    server = AsyncEngine(engine, max_pending=1024, on_step=recorder)
    server.start()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    origin = time.perf_counter()

    async def one(rid: str, ids: list[int], offset: float) -> tuple[float, float, int]:
        await asyncio.sleep(max(0.0, origin + offset - time.perf_counter()))
        sent = origin + offset
        first, tokens = None, 0
        async for out in server.generate(rid, ids, params):
            if out.delta_token_ids and first is None:
                first = time.perf_counter() - sent
            tokens += len(out.delta_token_ids)
        assert first is not None
        return first, time.perf_counter() - sent, tokens

    try:
        results = await asyncio.gather(*(one(rid, ids, o) for (rid, ids), o in zip(prompts, offsets)))
    finally:
        await server.stop()
        engine.speculation.verify_trace = None
        engine.sample_steps = False
    return ([r[0] for r in results], [r[1] for r in results], [r[2] for r in results], recorder,
            time.perf_counter() - origin)


def serve(engine: LLMEngine, prompts: list[tuple[str, list[int]]], rate: float, seed: int) -> ServedRun:
    offsets = arrival_offsets(len(prompts), rate, 1.0, np.random.default_rng(seed))
    ttft, e2el, tokens, rec, wall = asyncio.run(_serve(engine, prompts, offsets))
    requests = [SimRequest(rid, float(o), len(ids), n) for (rid, ids), o, n in zip(prompts, offsets, tokens)]
    return ServedRun(rate, requests, ttft, e2el, rec.trace, rec.steps, wall)


# --- calibration and simulation --------------------------------------------------------------------------------


def step_features(row: dict[str, int]) -> StepFeatures:
    """A logged step's features; fields a later version dropped are ignored, so old results re-simulate."""
    return StepFeatures(**{k: v for k, v in row.items() if k in StepFeatures.__dataclass_fields__})


def samples_of(steps: dict[str, list]) -> list[StepSample]:
    return [StepSample(step_features(f), *p) for f, p in zip(steps["features"], steps["parts"])]


def loop_overhead(steps: dict[str, list], level: float = 1.0) -> StepOverhead:
    """The serving loop's mean time around engine.step() as a per-step overhead, and the model's mean level."""
    loop = [(lp - e) for e, lp in zip(steps["engine_s"], steps["loop_s"]) if lp is not None]
    return StepOverhead(per_step_s=float(np.mean(loop)) if loop else 0.0, scale=level)


def refit(steps: dict[str, list], model: StepTimeModel, level: bool = True) -> tuple[StepTimeModel, StepOverhead]:
    """The engine's own online learning (StepTimeModel.observe / refit: profile plus recent steps, the profile's
    weight falling as steps arrive), fed with a calibration run's steps; plus the serving loop's mean time
    around engine.step() as a per-step overhead, and (`level`) the factor that makes the refitted model right
    on average over the calibration's steps (sim/step_cost.mean_level: the fit minimises relative error, a
    latency is a sum). The profile was measured on a machine shared with others, at other moments: this moves
    it to how the machine runs now, without seeing the run it predicts."""
    # a window as long as the calibration, so a bracketing pair (before and after the run) counts both halves
    fitted = dataclasses.replace(StepTimeModel.from_json(model.to_json()),
                                 window=max(StepTimeModel.window, len(steps["features"])))
    samples = samples_of(steps)
    for sample in samples:
        fitted.observe(sample)
    fitted.refit()
    return fitted, loop_overhead(steps, mean_level(fitted, samples) if level else 1.0)


def oracle(steps: dict[str, list]) -> tuple[StepTimeModel, StepOverhead]:
    """DIAGNOSTIC, not a prediction: a step-time model fitted (the engine's form selection) on the measured
    run's own steps, at its mean level. Simulating with it isolates what the simulator gets wrong besides step
    times (batching, queueing, acceptance) from what the profile gets wrong."""
    samples = samples_of(steps)
    fitted = StepTimeModel.fit(samples)
    return fitted, loop_overhead(steps, mean_level(fitted, samples))


def fit_overhead(steps: dict[str, list], model: StepTimeModel) -> tuple[StepOverhead, dict[str, float]]:
    """How served steps differ from the profile, from a calibration run's back-to-back steps: served loop
    iteration = scale x predicted + per-step seconds (least squares). The scale absorbs a machine slower than
    when it was profiled (other tenants); the constant absorbs the serving loop. Also splits the difference
    into profile error (engine.step() vs prediction) and loop overhead (iteration vs engine.step())."""
    rows = [(step_features(f), e, loop) for f, e, loop in zip(steps["features"], steps["engine_s"], steps["loop_s"])
            if loop is not None]
    pred = np.array([model.predict(f) for f, _, _ in rows])
    loop = np.array([r[2] for r in rows])
    eng = np.array([r[1] for r in rows])
    (scale, per_step), *_ = np.linalg.lstsq(np.stack([pred, np.ones_like(pred)], 1), loop, rcond=None)
    detail = {"steps": len(rows), "mean_loop_s": float(loop.mean()), "mean_engine_step_s": float(eng.mean()),
              "mean_predicted_s": float(pred.mean()), "profile_error_s": float((eng - pred).mean()),
              "loop_overhead_s": float((loop - eng).mean())}
    return StepOverhead(per_step_s=float(per_step), scale=float(scale)), detail


def predict(run: dict[str, Any], cost: StepCost, replay: bool, seed: int = 0) -> dict[str, Any]:
    trace = [tuple(r) for r in run["trace"]]
    fallback = rates_from_trace(trace)
    acceptance = TraceReplay(trace, fallback) if replay else fallback
    requests = [SimRequest(**q) for q in run["requests"]]
    result = simulate(requests, cost, acceptance, Deployment(policy=SpecPolicy("fixed", K), seed=seed))
    by_id = {t.request_id: t for t in result.times}
    times = [by_id[q.request_id] for q in requests]  # in the run's request order, to pool with other runs
    return {**result.summary, "ttft_s": [t.ttft_s for t in times], "e2el_s": [t.e2el_s for t in times]}


def measured_summary(run: dict[str, Any]) -> dict[str, Any]:
    reqs, ttft, e2el = run["requests"], run["ttft_s"], run["e2el_s"]
    return {"ttft_ms": summarize([t * 1e3 for t in ttft]), "e2el_ms": summarize([t * 1e3 for t in e2el]),
            "tpot_ms": summarize([(e - t) * 1e3 / (r["output_tokens"] - 1) for r, t, e in zip(reqs, ttft, e2el)
                                  if r["output_tokens"] > 1]),
            "output_throughput": sum(r["output_tokens"] for r in reqs) / run["wall_s"]}


def predictions(data: dict[str, Any], model: StepTimeModel) -> list[dict[str, Any]]:
    """Per rate: the measured summary and the simulator's, each rate's overhead from the calibration run
    made just before it (its own prompts), never from the run itself."""
    rows = []
    for run in data["runs"]:
        overhead, detail = fit_overhead(run["calibration_steps"], model)
        refitted = StepCost(*refit(run["calibration_steps"], model))
        sims = {}
        if "calibration_after_steps" in run:  # runs saved before the bracketing have only the calibration before
            both = merged_steps([StepLog(**run["calibration_steps"]), StepLog(**run["calibration_after_steps"])])
            sims[BRACKETED] = predict(run, StepCost(*refit(both, model)), True)
            # the primary prediction until 2026-12-01: the fit's own (relative-error) level, no mean correction
            sims[UNLEVELLED] = predict(run, StepCost(*refit(both, model, level=False)), True)
        sims |= {"replay, refit": predict(run, refitted, True),
                "rates, refit": predict(run, refitted, False),
                "replay, scaled": predict(run, StepCost(model, overhead), True),
                "replay, profile only": predict(run, StepCost(model), True)}
        diagnostic_level = None
        if "diagnostic_steps" in run:
            fitted, level = oracle(run["diagnostic_steps"])
            diagnostic_level = level.scale
            sims["replay, oracle step times (diagnostic)"] = predict(run, StepCost(fitted, level), True)
        rows.append({"rate": run["rate"], "fraction": run["fraction"], "repeat": run.get("repeat", 0),
                     "load": run["load"],
                     "calibration": {"overhead": asdict(overhead), **detail}, "measured": measured_summary(run),
                     "diagnostic_level": diagnostic_level,
                     "predicted": sims, "num_requests": len(run["requests"]), "wall_s": run["wall_s"],
                     "acceptance": asdict(rates_from_trace([tuple(r) for r in run["trace"]]))})
    return rows


def latency(ttft_s: list[float], e2el_s: list[float]) -> dict[str, dict[str, float | None]]:
    return {"ttft_ms": summarize([t * 1e3 for t in ttft_s]), "e2el_ms": summarize([t * 1e3 for t in e2el_s])}


def pooled(data: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate, every run of it together: measured and predicted latencies over all their requests, and each
    run's own measured numbers (how far a measurement repeats)."""
    out = []
    for fraction in dict.fromkeys(r["fraction"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["fraction"] == fraction]
        runs = [data["runs"][i] for i in idx]
        measured = latency(sum((r["ttft_s"] for r in runs), []), sum((r["e2el_s"] for r in runs), []))
        predicted = {name: latency(sum((rows[i]["predicted"][name]["ttft_s"] for i in idx), []),
                                   sum((rows[i]["predicted"][name]["e2el_s"] for i in idx), []))
                     for name in rows[idx[0]]["predicted"]}
        out.append({"fraction": fraction, "rates": [rows[i]["rate"] for i in idx],
                    "num_requests": sum(len(r["requests"]) for r in runs), "measured": measured,
                    "per_run_measured": [latency(r["ttft_s"], r["e2el_s"]) for r in runs], "predicted": predicted})
    return out


# --- the run ---------------------------------------------------------------------------------------------------


def wait_for_quiet(limit_s: float = 600.0) -> list[float]:
    """Other engineers share the cores: wait (up to limit_s) for the 1-minute load average to drop below 1."""
    start = time.time()
    load = list(os.getloadavg())
    while load[0] > 1.0 and time.time() - start < limit_s:
        print(f"load average {load[0]:.2f} > 1.0: waiting", flush=True)
        time.sleep(30)
        load = list(os.getloadavg())
    return load


def merged_steps(logs: list[StepLog]) -> dict[str, list]:
    """Several runs' step logs, in order, as one (each run's first step has no loop time: it followed a wait)."""
    merged = StepLog()
    for log in logs:
        for name in ("features", "parts", "engine_s", "loop_s"):
            getattr(merged, name).extend(getattr(log, name))
    return asdict(merged)


def tokenized(engine: LLMEngine, n: int, skip: int, tag: str) -> list[tuple[str, list[int]]]:
    prompts = load_sharegpt(n, skip=skip)
    return [(f"{tag}/{p.id}", engine.tokenizer.apply_chat_template([{"role": "user", "content": p.text}]))
            for p in prompts]


def as_json(run: ServedRun) -> dict[str, Any]:
    return {"rate": run.rate, "requests": [asdict(q) for q in run.requests], "ttft_s": run.ttft_s,
            "e2el_s": run.e2el_s, "trace": run.trace, "wall_s": run.wall_s}


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], StepTimeModel]:
    load_before = wait_for_quiet(args.max_wait)
    engine = build_engine(EngineConfig(MODEL, speculative_config=SPEC, num_threads=args.num_threads), progress=False)
    key = profile_key(engine)
    had_profile = profile_path(key).exists() and not args.reprofile
    model = build_model(engine, GRIDS["full"], progress=False) if args.reprofile else \
        load_or_profile(engine, progress=False, grid="full")
    print(f"profile {profile_path(key)} ({'cached' if had_profile else 'measured now'}, {len(model.samples)} steps)")
    n, c = args.num_requests, args.calibration_requests
    serve(engine, tokenized(engine, 4, 0, "warmup"), math.inf, args.seed)  # one-off costs (allocations, caches)
    runs: list[dict[str, Any]] = []
    capacity = 0.0
    fractions = [float(f) for f in args.fractions.split(",")]
    # the rates in order, then in reverse order, and so on: a drift over the session hits the runs of a
    # rate from both ends, and their spread measures how far one measurement repeats on this machine
    schedule = [f for r in range(args.repeats) for f in (fractions if r % 2 == 0 else fractions[::-1])]
    s = args.sequential_requests
    skip = 4  # ShareGPT prompts used so far: every served request has its own prompt (no prefix-cache hits)

    def prompts(count: int, tag: str) -> list[tuple[str, list[int]]]:
        nonlocal skip
        skip += count
        return tokenized(engine, count, skip - count, tag)

    def calibrate(i: int) -> dict[str, list]:
        """A few requests one at a time (served single decodes ran 15-35% over the profile's, which a burst never
        shows), then a burst (large batches), then a few at half the capacity (steps where one prompt's prefill
        chunk rides with decodes, as in serving: a burst's prefill steps are many prompts at once)."""
        alone = [serve(engine, [prompt], math.inf, args.seed) for prompt in prompts(s, f"alone{i}")]
        calib = serve(engine, prompts(c, f"calibration{i}"), math.inf, args.seed)
        nonlocal capacity
        if i == 0:  # capacity: requests per second finished in the first burst, at full batch
            capacity = len(calib.requests) / max(calib.e2el_s)
            print(f"capacity {capacity:.2f} req/s", flush=True)
        logs = [r.steps for r in alone] + [calib.steps]
        if args.paced_requests:
            logs.append(serve(engine, prompts(args.paced_requests, f"paced{i}"), 0.5 * capacity,
                              args.seed + 1000 + i).steps)
        return merged_steps(logs)

    # a calibration before every run and one after the last: each run is bracketed by two, so the machine's
    # speed while it ran (other tenants drift it by 20% within minutes here) is estimated from both sides
    before = calibrate(0)
    for i, fraction in enumerate(schedule):
        rate = round(fraction * capacity, 3)
        load = list(os.getloadavg())
        run = serve(engine, prompts(n, f"rate{i}"), rate, args.seed + 1 + i)
        load.append(os.getloadavg()[0])
        after = calibrate(i + 1)
        runs.append({**as_json(run), "fraction": fraction, "repeat": schedule[:i].count(fraction),
                     "load": [load[0], load[-1]], "calibration_steps": before, "calibration_after_steps": after,
                     "diagnostic_steps": asdict(run.steps)})  # to explain errors afterwards; never fitted on
        print(f"rate {rate} done (load {load[0]:.2f} -> {load[-1]:.2f})", flush=True)
        before = after
    data = {
        "command": "PYTHONPATH=$PWD python benchmarks/simulator_validation.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "machine": machine(),
        "load_average_before": load_before, "model": MODEL, "speculative_config": SPEC, "max_tokens": MAX_TOKENS,
        "engine": {"max_num_seqs": engine.config.max_num_seqs,
                   "max_num_batched_tokens": engine.config.max_num_batched_tokens, "threads": engine.config.threads},
        "profile": {"path": str(profile_path(key)), "key": key, "cached": had_profile,
                    "fits": [r.line() for r in model.reports]},
        "capacity_req_s": capacity, "target_relative_error": TARGET, "runs": runs,
    }
    return data, model


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=60, help="requests per validation rate")
    p.add_argument("--calibration-requests", type=int, default=16, help="requests per calibration burst")
    p.add_argument("--sequential-requests", type=int, default=2,
                   help="requests served one at a time at the start of each calibration (single-decode steps)")
    p.add_argument("--paced-requests", type=int, default=12,
                   help="requests at half the capacity at the end of each calibration (0: none)")
    p.add_argument("--fractions", default="0.25,0.5,0.75", help="rates as fractions of the measured capacity")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs per rate (each on its own prompts; the schedule goes up the rates, down, up...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wait", type=float, default=600.0, help="seconds to wait for a quiet machine first")
    p.add_argument("--num-threads", type=int, default=1,
                   help="engine threads (default 1: on a shared 2-core machine, 2 OpenMP threads slow down many "
                        "times whenever another process takes a core; see docs/ARCHITECTURE.md, Threads)")
    p.add_argument("--reprofile", action="store_true",
                   help="measure the profile again (turbospec profile --grid full) even if one is cached")
    p.add_argument("--resimulate", default=None, metavar="JSON",
                   help="skip measuring: simulate the runs saved in this results file again (same profile)")
    p.add_argument("--out", default=str(RESULTS / "simulator_validation" / "simulator_validation"))
    args = p.parse_args()
    if args.repeats < 1 or args.num_requests < 1 or args.calibration_requests < 1 or args.paced_requests < 0:
        p.error("--repeats, --num-requests and --calibration-requests must be at least 1, --paced-requests at "
                "least 0")
    t0 = time.time()
    if args.resimulate:
        data = expand_steps(json.loads(Path(args.resimulate).read_text()))
        model = StepTimeModel.load(Path(data["profile"]["path"]))
        if model is None:
            raise SystemExit(f"the profile {data['profile']['path']} is gone: measure again")
    else:
        data, model = measure(args)
        data["measure_seconds"] = time.time() - t0
    data["rates"] = predictions(data, model)
    data["pooled"] = pooled(data, data["rates"])
    for row in data["rates"]:
        m, s = row["measured"]["e2el_ms"], row["predicted"][BRACKETED if BRACKETED in row["predicted"] else
                                                            "replay, refit"]["e2el_ms"]
        print(f"{_label(row)}: E2EL mean {m['mean']:.0f} vs {s['mean']:.0f} ms, p99 {m['p99']:.0f} vs "
              f"{s['p99']:.0f}", flush=True)
    write(data, Path(args.out))
    return 0


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "commit": commit}


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def _rounded(value: Any) -> Any:
    """Floats to microseconds (or 6 decimals), so the step logs stay a reasonable file."""
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


STEP_LOGS = ("calibration_steps", "calibration_after_steps", "diagnostic_steps")


def _columns(rows: list[dict[str, int]]) -> dict[str, list[int]]:
    return {name: [r[name] for r in rows] for name in (rows[0] if rows else {})}


def _rows(features: dict[str, list[int]] | list[dict[str, int]]) -> list[dict[str, int]]:
    if isinstance(features, list):  # a file saved before the columns: one dict per step already
        return features
    return [dict(zip(features, values)) for values in zip(*features.values())]


def _with_features(data: dict[str, Any], convert: Any) -> dict[str, Any]:
    runs = [{**run, **{log: {**run[log], "features": convert(run[log]["features"])} for log in STEP_LOGS
                       if log in run}} for run in data["runs"]]
    return {**data, "runs": runs}


def compact_steps(data: dict[str, Any]) -> dict[str, Any]:
    """The step logs' features stored column by column (each name once, not once per step): what keeps a
    three-repeat result file to a few MB. `expand_steps` undoes it."""
    return _with_features(data, _columns)


def expand_steps(data: dict[str, Any]) -> dict[str, Any]:
    return _with_features(data, _rows)


def _label(row: dict[str, Any]) -> str:
    return f"rate {row['rate']}" + (f", run {row['repeat'] + 1}" if "repeat" in row else "")


def write(result: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(_rounded(compact_steps(result)), separators=(",", ":")))
    profile = Path(result["profile"]["path"])
    if profile.exists():  # the profile the predictions used, kept with them (it lives in a per-user cache)
        shutil.copyfile(profile, out.with_name(out.name + "_profile.json"))
    primary = BRACKETED if BRACKETED in result["rates"][0]["predicted"] else "replay, refit"
    lines = [f"# Simulator validation: {result['model']}, n-gram k = {K}, CPU", "",
             f"`{result['command']}` on {result['date']}, {result['machine']['cpu']} ({result['machine']['cores']} "
             f"cores shared with other users; engine threads {result['engine']['threads']}), load average before "
             f"{result['load_average_before'][0]:.2f}. Profile: `{Path(result['profile']['path']).name}` "
             f"({'cached' if result['profile']['cached'] else 'measured in this run'}). Capacity from the first "
             f"calibration burst: {result['capacity_req_s']:.2f} req/s; rates at "
             + ", ".join(f"{f:.0%}" for f in dict.fromkeys(r["fraction"] for r in result["rates"])) + " of it, "
             f"{result['rates'][0]['num_requests']} ShareGPT requests each (own prompts), max_tokens "
             f"{result['max_tokens']}, greedy.", "",
             f"Predicted ({primary}: each request's recorded acceptance; the profile refitted, as the engine refits "
             "it online, on the steps of the calibration runs (two requests one at a time, a burst, then requests "
             "at half the capacity, on other prompts) made just before and just after the rate, scaled to its mean "
             "level on those steps (sim/step_cost.mean_level), plus the serving loop's time around engine.step()) "
             "vs measured; error = predicted / measured - 1; target |error| <= 15%. 'no mean level' is the same "
             "without that scale; 'replay, refit' uses the calibration before the rate only. Other predictions: "
             "'rates' draws acceptance from "
             "per-position rates instead of replaying; 'scaled' keeps the profile and fits a speed factor and "
             "per-step seconds on the calibration run; 'profile only' uses the profile as measured; 'oracle "
             "step times' is a DIAGNOSTIC, not a prediction: step times fitted on the measured run's own steps, "
             "to separate the step-time "
             "model's error from the rest of the simulator's.", "",
             "| rate (req/s) | load avg (start -> end) | metric | measured ms | predicted ms | error |",
             "|---|---|---|---|---|---|"]
    pools = result.get("pooled") or []
    if pools and len(pools) < len(result["rates"]):  # several runs per rate: the pooled comparison leads
        lines[-2:] = [f"Each rate was run {len(result['rates']) // len(pools)} times (rates going up, then down, "
                      "each run on its own prompts and bracketed by calibrations); measured and predicted are "
                      "over all of a rate's requests together. 'Runs' gives each run's own measured number, and "
                      "'repeat' how far the last differs from the first: the machine's own reproducibility, "
                      "against which the 15% target should be read.", "",
                      "| rate (req/s) | metric | measured ms | predicted ms | error | runs (measured ms) | repeat |",
                      "|---|---|---|---|---|---|---|"]
        for pool in pools:
            m, pr = pool["measured"], pool["predicted"][primary]
            for metric in ("e2el_ms", "ttft_ms"):
                for stat in ("mean", "p99"):
                    e = _err(pr[metric][stat], m[metric][stat])
                    each = [r[metric][stat] for r in pool["per_run_measured"]]
                    lines.append(f"| {pool['rates'][0]} | {metric[:-3].upper()} {stat} | {m[metric][stat]:.0f} | "
                                 f"{pr[metric][stat]:.0f} | {e * 100:+.1f}%{'' if abs(e) <= TARGET else ' **miss**'} "
                                 f"| {' / '.join(f'{v:.0f}' for v in each)} | {_err(each[-1], each[0]) * 100:+.0f}% |")
        lines += ["", "Each run on its own (rate, run, load average start -> end: E2EL mean / p99, TTFT mean / p99 "
                  "error of the same prediction):", ""]
        for row in result["rates"]:
            m, pr = row["measured"], row["predicted"][primary]
            load = f"load {row['load'][0]:.2f} -> {row['load'][1]:.2f}"
            errors = " / ".join(f"{_err(pr[x][st], m[x][st]) * 100:+.0f}%"
                                for x in ("e2el_ms", "ttft_ms") for st in ("mean", "p99"))
            lines.append(f"- {row['rate']}, run {row['repeat'] + 1}, {load}: {errors}")
    else:
        for row in result["rates"]:
            m, pr = row["measured"], row["predicted"][primary]
            for metric in ("e2el_ms", "ttft_ms"):
                for stat in ("mean", "p99"):
                    e = _err(pr[metric][stat], m[metric][stat])
                    flag = "" if abs(e) <= TARGET else " **miss**"
                    lines.append(f"| {row['rate']} | {row['load'][0]:.2f} -> {row['load'][1]:.2f} | "
                                 f"{metric[:-3].upper()} {stat} | {m[metric][stat]:.0f} | {pr[metric][stat]:.0f} | "
                                 f"{e * 100:+.1f}%{flag} |")
    lines += ["", "All predictions, E2EL mean / p99 and TTFT mean / p99 error:", ""]
    for row in result["rates"]:
        m = row["measured"]
        parts = [f"{name}: " + " / ".join(f"{_err(s[x][st], m[x][st]) * 100:+.0f}%"
                                          for x in ("e2el_ms", "ttft_ms") for st in ("mean", "p99"))
                 for name, s in row["predicted"].items()]
        lines.append(f"- {_label(row)}: " + "; ".join(parts))
    lines += ["", "Calibration detail per rate (mean served loop / engine.step() / profile prediction, s):", ""]
    for row in result["rates"]:
        c = row["calibration"]
        lines.append(f"- {_label(row)}: {c['mean_loop_s']:.3f} / {c['mean_engine_step_s']:.3f} / "
                     f"{c['mean_predicted_s']:.3f} over {c['steps']} steps; 'scaled' fit: "
                     f"x{c['overhead']['scale']:.2f} {c['overhead']['per_step_s'] * 1e3:+.1f} ms")
    levels = [(row, row.get("diagnostic_level")) for row in result["rates"] if row.get("diagnostic_level")]
    if levels:
        lines += ["", "Where the fit sits (diagnostic): a model fitted on each run's own steps, minimising relative "
                  "error as the engine does; mean level = their measured / predicted total seconds:", ""]
        lines += [f"- {_label(row)}: mean level {level:.3f} (the fit alone is {1 / level - 1:+.1%})"
                  for row, level in levels]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    # one point per rate: its runs pooled when it was run several times
    points = [(p["rates"][0], p["measured"], p["predicted"][primary]) for p in pools] or \
        [(r["rate"], r["measured"], r["predicted"][primary]) for r in result["rates"]]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("e2el_ms", "ttft_ms")):
        for stat, style in (("mean", "o"), ("p99", "s")):
            ax.plot([x for x, _, _ in points], [m[metric][stat] for _, m, _ in points], style + "-",
                    label=f"measured {stat}")
            ax.plot([x for x, _, _ in points], [pr[metric][stat] for _, _, pr in points], style + "--",
                    label=f"simulated {stat}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(metric.replace("_ms", " (ms)").upper())
        ax.legend()
    fig.suptitle(f"turbospec simulate vs measured serving: {result['model']} (CPU)")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
