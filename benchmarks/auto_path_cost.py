"""What the goodput controller's own work costs per step, against no speculation on the same engine.

For each workload of benchmarks/goodput_sweep.py and each batch size B, B requests arrive at once and run to the
end (greedy, the same prompts), under no-spec and adaptive (``"auto"``) in turn on one engine, rounds
interleaved. Each engine step is split by timers wrapped around its phases: the draft budget (the controller's
choice, and an n-gram proposer's lookups), the proposer, the forward pass, verification, the commit, building
the step sample and the step-time model's online update. It answers two questions of the goodput issue:

- the controller's time as a share of the step at batch 32 (the target is 1%);
- whether adaptive is slower than no speculation when it drafts nothing (at saturation), and by what.

Writes ``<out>.json`` and ``<out>.md``.

    .venv/bin/python benchmarks/auto_path_cost.py                                   # a, b and c at 1, 8, 32
    .venv/bin/python benchmarks/auto_path_cost.py --workloads a --batches 2 --rounds 1 --max-tokens 8 \\
        --out /tmp/apc_test                                                          # smoke test
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from goodput_sweep import WORKLOADS, apply_policy, chat_ids, controlled, warm_up, workload_llm, workload_prompts
from harness import benchmark_meta, default_out, header_lines, save, table
from tqdm import tqdm

from turbospec import SamplingParams
from turbospec import engine as engine_module

POLICIES = ("no-spec", "adaptive")
# the phases of LLMEngine.step timed apart; "choice" is Speculation.budget, called inside the scheduler's pass
PHASES = ("choice", "propose", "forward", "verify", "commit", "step_sample", "online_fit")


class PhaseTimer:
    """Wall time per phase of engine.step, by wrapping the engine's own parts (instance attributes only)."""

    def __init__(self, engine: Any) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        spec = engine.speculation
        self._wrap(spec, "budget", "choice")
        self._wrap(spec, "propose", "propose")
        self._wrap(engine.runner, "execute", "forward")
        self._wrap(engine.verifier, "verify", "verify")
        self._wrap(engine, "_commit", "commit")
        self._wrap(spec, "learn_step_time", "online_fit")
        self._step_features = engine_module.step_features  # a module function: put back by close()
        engine_module.step_features = self._timed(self._step_features, "step_sample")

    def close(self) -> None:
        engine_module.step_features = self._step_features

    def _timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
        return timed

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        setattr(owner, name, self._timed(getattr(owner, name), phase))


def run_batch(engine: Any, timer: PhaseTimer, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, Any]:
    """All prompts at once, to the end: wall time, steps, the time per phase, and the speculation statistics."""
    timer.seconds.clear()
    engine.reset_spec_stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"{tag}-{i}")
    steps, start = 0, time.perf_counter()
    controller = engine.speculation.controller
    # steps with no prompt left to prefill: their wall time, the budget callback's and the controller's own choice's
    decode = {"steps": 0, "wall_s": 0.0, "choice_s": 0.0, "choose_s": 0.0}
    while engine.has_unfinished_requests():
        only_decodes = not engine.scheduler.waiting and not any(r.is_prefilling for r in engine.scheduler.running)
        step_start, choice_before = time.perf_counter(), timer.seconds.get("choice", 0.0)
        choose_before = controller.stats.controller_s
        engine.step()
        steps += 1
        if only_decodes:
            decode["steps"] += 1
            decode["wall_s"] += time.perf_counter() - step_start
            decode["choice_s"] += timer.seconds.get("choice", 0.0) - choice_before
            decode["choose_s"] += controller.stats.controller_s - choose_before
    wall = time.perf_counter() - start
    stats = engine.spec_stats_dict()
    return {"wall_s": wall, "steps": steps, "phases_s": {p: timer.seconds.get(p, 0.0) for p in PHASES},
            "decode_steps": decode, "mean_k": stats.get("mean_k", 0.0), "num_drafts": stats.get("num_drafts", 0)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One (workload, batch): adaptive's wall over no-spec's (mean of the rounds' paired ratios, and their
    spread), and adaptive's controller phases per step and as a share of its wall time."""
    by = {p: [r for r in runs if r["policy"] == p] for p in POLICIES}
    ratios = [a["wall_s"] / n["wall_s"] for a, n in zip(by["adaptive"], by["no-spec"])]
    adaptive = by["adaptive"]
    wall = sum(r["wall_s"] for r in adaptive)
    steps = sum(r["steps"] for r in adaptive)
    own = {p: sum(r["phases_s"][p] for r in adaptive) for p in ("choice", "step_sample", "online_fit")}
    decode_wall = sum(r["decode_steps"]["wall_s"] for r in adaptive)
    decode_steps = sum(r["decode_steps"]["steps"] for r in adaptive)
    return {
        "no_spec_s": statistics.mean(r["wall_s"] for r in by["no-spec"]),
        "adaptive_s": statistics.mean(r["wall_s"] for r in adaptive),
        "ratio": statistics.mean(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "step_ms": 1e3 * wall / steps,
        "decode_step_ms": 1e3 * decode_wall / decode_steps if decode_steps else None,
        "choice_ms": 1e3 * own["choice"] / steps,
        # the target's measure: the choice's share of the steps where every request decodes (the whole batch);
        # "choose" is the controller's own part of it (GoodputController.choose), without the n-gram lookups
        "decode_choice_share": (sum(r["decode_steps"]["choice_s"] for r in adaptive) / decode_wall
                                if decode_wall else None),
        "decode_choose_share": (sum(r["decode_steps"]["choose_s"] for r in adaptive) / decode_wall
                                if decode_wall else None),
        "choice_share": own["choice"] / wall,
        "controller_share": sum(own.values()) / wall,
        "mean_k": statistics.mean(r["mean_k"] for r in adaptive),
    }


def measure(name: str, args: argparse.Namespace, bar: tqdm) -> list[dict[str, Any]]:
    target, spec, *_ = WORKLOADS[name]
    llm = workload_llm(target, controlled(spec, args.max_k), args.threads, max(args.batches), args.max_model_len)
    engine = llm.engine
    prompts = chat_ids(llm, workload_prompts(name, max(args.batches)))
    warm_up(engine, prompts[0])
    apply_policy(engine, "adaptive")  # the controller (a cached or brief profile) before any timing
    timer = PhaseTimer(engine)
    try:
        rows = measure_batches(name, target, spec["method"], engine, timer, prompts, args, bar)
    finally:
        timer.close()
    del llm
    gc.collect()
    return rows


def measure_batches(name: str, target: str, method: str, engine: Any, timer: PhaseTimer, prompts: list[list[int]],
                    args: argparse.Namespace, bar: tqdm) -> list[dict[str, Any]]:
    rows = []
    for batch in args.batches:
        runs = []
        for round_ in range(args.rounds):
            for policy in POLICIES if round_ % 2 == 0 else POLICIES[::-1]:
                apply_policy(engine, policy)
                run = run_batch(engine, timer, prompts[:batch], args.max_tokens, f"{name}{batch}-{round_}-{policy}")
                runs.append({"policy": policy, "round": round_, **run})
                bar.update()
        rows.append({"workload": name, "target": target, "method": method, "batch": batch,
                     "runs": runs, **summarise(runs)})
        bar.write(f"{name} batch {batch}: adaptive / no-spec {rows[-1]['ratio']:.3f}, "
                  f"choice {rows[-1]['choice_ms']:.2f} ms a step ({100 * rows[-1]['choice_share']:.2f}%; "
                  f"{100 * (rows[-1]['decode_choice_share'] or 0):.2f}% of the decode-only steps)")
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# The goodput controller's own cost per step", "", *header_lines(meta),
             f"- B requests at once, {meta['max_tokens']} tokens each (ignore_eos), greedy; no-spec and adaptive "
             f"interleaved on one engine, {meta['rounds']} rounds; draft cap k = {meta['max_k']}",
             "- ratio: adaptive's wall time over no-spec's (mean of the rounds' paired ratios, [min, max]); choice: "
             "Speculation.budget per step (the controller, and an n-gram proposer's lookups); choice % of decode "
             "steps: its share of the steps where every request decodes (no prompt left to prefill), and of that the "
             "controller's own choice (GoodputController.choose, without lookups); controller: "
             "choice, step sample and online fit, as a share of adaptive's whole wall time",
             "- every request has the same length and they start together, so the last one sets the wall time: drafts "
             "that finish some requests early buy nothing here, while their verification slows every step. The "
             "rows where adaptive drafted nothing (mean k 0) are the measure of the auto path's own cost; the others "
             "are no verdict on the choice (goodput_sweep.py is, with each request's own latency)", ""]
    lines += table(["workload", "batch", "no-spec s", "adaptive s", "ratio [min, max]", "step ms",
                    "decode step ms", "choice ms", "choice % of decode steps", "choose % of decode steps",
                    "controller %", "mean k"],
                   [[f"{r['workload']} ({r['target']}, {r['method']})", r["batch"], f"{r['no_spec_s']:.2f}",
                     f"{r['adaptive_s']:.2f}", f"{r['ratio']:.3f} [{r['ratio_min']:.3f}, {r['ratio_max']:.3f}]",
                     f"{r['step_ms']:.1f}", fmt(r["decode_step_ms"], 1), f"{r['choice_ms']:.2f}",
                     fmt(r["decode_choice_share"], 2, 100), fmt(r["decode_choose_share"], 2, 100),
                     f"{100 * r['controller_share']:.2f}", f"{r['mean_k']:.2f}"] for r in rows])
    return "\n".join(lines) + "\n"


def fmt(x: float | None, digits: int, scale: float = 1.0) -> str:
    return "-" if x is None else f"{scale * x:.{digits}f}"


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="a,b,c", help="comma list of " + ", ".join(WORKLOADS))
    ap.add_argument("--batches", type=positive_ints, default=[1, 8, 32], help="requests at once, e.g. 1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per batch (>= 1)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-k", type=int, default=8, help="the controller's draft cap")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=str(default_out("auto_path_cost")))
    args = ap.parse_args(argv)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown or not args.workloads:
        ap.error(f"unknown workloads {unknown}: expected some of " + ", ".join(WORKLOADS))
    for name in ("rounds", "max_tokens", "max_k", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    meta = benchmark_meta(args.threads, workloads=args.workloads, batches=args.batches, rounds=args.rounds,
                          max_tokens=args.max_tokens, max_k=args.max_k)
    rows: list[dict[str, Any]] = []
    with tqdm(total=len(args.workloads) * len(args.batches) * args.rounds * len(POLICIES), unit="run") as bar:
        for name in args.workloads:
            rows += measure(name, args, bar)
    save(Path(args.out), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
