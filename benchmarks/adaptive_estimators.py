"""The adaptive controller with each chain acceptance estimator, against a fixed draft length, side by side.

Every row (the fixed k and `"auto"` with each estimator of control/acceptance_estimators.py) is loaded at once and they take
turns prompt by prompt, the order alternating (benchmarks/proposer_zoo.py's runner), on MT-Bench first turns and
HumanEval. Per row and set: tok/s, its ratio to the fixed row, tau, the mean k chosen and its histogram. The
question it answers: which estimator keeps adaptive at least as fast as the best fixed length
(benchmarks/acceptance_estimators.py scores the estimators' predictions on replayed traces; this scores the
decisions they lead to). `--draft-stops confidence,none` also measures each auto row without the draft's own
confidence stop (SpeculativeConfig.draft_stop).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/adaptive_estimators.py [--prompts 10]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from proposer_zoo import DRAFTS, datasets, run_turbospec  # (benchmarks/: the script's directory)
from harness import benchmark_meta, default_out, header_lines, save

from turbospec.config import DRAFT_STOPS
from turbospec.control.acceptance_estimators import ESTIMATORS

CHAIN_ESTIMATORS = ("position-beta", "first-position-beta", "request-beta")


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Adaptive speculation per acceptance estimator against fixed k = {meta['k']}", "", *header_lines(meta),
             f"- {meta['model']} bf16 with the {meta['draft']} draft model, greedy, batch 1, at most "
             f"{meta['max_tokens']} tokens, the first {meta['prompts']} MT-Bench first turns and HumanEval tasks; "
             f"every row loaded together, taking turns prompt by prompt", "",
             "| row | set | tok/s | x fixed | tau | mean k | k histogram (k = 0, 1, ...) |",
             "|---|---|---|---|---|---|---|"]
    fixed = rows[0]
    for r in rows:
        for name, s in r["sets"].items():
            rate = s["tokens"] / s["seconds"]
            base = fixed["sets"][name]["tokens"] / fixed["sets"][name]["seconds"]
            lines.append(f"| {r['row']} | {name} | {rate:.2f} | {rate / base:.3f}x | {s['tau']:.2f} | "
                         f"{s['mean_k']:.2f} | {s['k_histogram']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(DRAFTS))
    ap.add_argument("--k", type=int, default=4, help="the fixed row's draft length")
    ap.add_argument("--estimators", default=",".join(CHAIN_ESTIMATORS))
    ap.add_argument("--draft-stops", default="confidence",
                    help="comma-separated draft_stop values, each estimator's auto row measured with each "
                         "(confidence: the draft ends where it turns unsure, the default; none: k as chosen)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("adaptive_estimators")))
    ap.set_defaults(dtype="bfloat16", weight_format="bf16", max_model_len=2048)  # (proposer_zoo's runner reads them)
    args = ap.parse_args()
    estimators = [e for e in args.estimators.split(",") if e]
    if unknown := set(estimators) - set(ESTIMATORS):
        ap.error(f"--estimators: unknown {sorted(unknown)}: choose from {', '.join(ESTIMATORS)}")
    draft = {"method": "draft", "model": DRAFTS[args.model]}
    specs: dict[str, dict[str, Any] | None] = {f"fixed k = {args.k}": {**draft, "num_speculative_tokens": args.k}}
    stops = [v for v in args.draft_stops.split(",") if v]
    if unknown := set(stops) - set(DRAFT_STOPS):
        ap.error(f"--draft-stops: unknown {sorted(unknown)}: choose from {', '.join(DRAFT_STOPS)}")
    for name in estimators:
        for stop in stops:
            row = f"auto, {name}" + ("" if stop == "confidence" else f", draft_stop {stop}")
            specs[row] = {**draft, "num_speculative_tokens": "auto", "acceptance_estimator": name, "draft_stop": stop}
    rows = run_turbospec(args, args.model, specs, datasets(args.model, args.prompts))
    meta = benchmark_meta(args.threads, model=args.model, draft=DRAFTS[args.model], k=args.k, prompts=args.prompts,
                          max_tokens=args.max_tokens)
    save(Path(args.out), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
