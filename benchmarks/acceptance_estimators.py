"""Choose the goodput controller's acceptance estimator by measured prediction error on recorded traces.

Step 1 records verification traces from real runs with a fixed k = 8, so every position up to the first
rejection is observed. Each trace is (request id, drafts verified, drafts accepted) per request-step, in
engine order. Two traces are recorded:
- n-gram on smollm2-135m, ShareGPT then HumanEval prompts;
- draft qwen2.5-coder-0.5b for qwen2.5-coder-1.5b, HumanEval then MT-Bench.
Step 2 replays each trace through every candidate estimator, in order. Before each verification, the
estimator predicts the number of accepted drafts (its expected value) and the probability of the observed
count. Only then does it see the outcome. Reported per estimator: the mean absolute error of the predicted
accepted count, and the mean negative log-likelihood of the observed counts. Both prompt sets switch
distribution halfway through, so following change is part of the score.

    .venv/bin/python benchmarks/acceptance_estimators.py            # records traces (~6 min here), then replays
    .venv/bin/python benchmarks/acceptance_estimators.py --replay   # replay the committed traces only
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from turbospec import LLM, SamplingParams
from turbospec.bench.machine import machine_info
from turbospec.data.prompts import load_mtbench, load_prompts, load_sharegpt
from turbospec.control.acceptance_estimators import (
    AcceptanceEstimator, FirstPositionBeta, GlobalEMA, PositionBeta, RequestBeta, expected_tokens, make_estimator, outcome_probability,
)

OUT = Path("benchmarks/results/acceptance_estimators/acceptance_estimators")
TRACES = Path("benchmarks/results/acceptance_estimators/acceptance_traces.json")

# name -> factory; the decays are part of the choice, so more than one setting per family is scored
CANDIDATES: dict[str, Any] = {
    "global-ema (fork, alpha 0.15)": lambda: GlobalEMA(alpha=0.15),
    "request-beta (decay 0.6)": lambda: RequestBeta(request_decay=0.6),
    "request-beta (decay 0.8)": lambda: RequestBeta(request_decay=0.8),
    "request-beta (decay 0.9)": lambda: RequestBeta(request_decay=0.9),
    "position-beta (decay 0.2)": lambda: PositionBeta(request_decay=0.2),
    "position-beta (decay 0.3)": lambda: PositionBeta(request_decay=0.3),
    "position-beta (decay 0.4)": lambda: PositionBeta(request_decay=0.4),
    "position-beta (decay 0.5)": lambda: PositionBeta(request_decay=0.5),
    "position-beta (decay 0.6)": lambda: PositionBeta(request_decay=0.6),
    "position-beta (decay 0.7)": lambda: PositionBeta(request_decay=0.7),
    "position-beta (decay 0.8)": lambda: PositionBeta(request_decay=0.8),
    "position-beta (decay 0.9)": lambda: PositionBeta(request_decay=0.9),
    "position-beta (decay 0.95)": lambda: PositionBeta(request_decay=0.95),
    "first-position-beta (decay 0.4)": lambda: FirstPositionBeta(request_decay=0.4),
    "first-position-beta (decay 0.6)": lambda: FirstPositionBeta(request_decay=0.6),
    "first-position-beta (decay 0.8)": lambda: FirstPositionBeta(request_decay=0.8),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def record(target: str, spec: dict[str, Any], prompts: list[str], max_tokens: int, threads: int) -> list[list]:
    llm = LLM(target, speculative_config={**spec, "num_speculative_tokens": 8}, num_threads=threads,
              progress=False)
    llm.engine.speculation.verify_trace = []
    tok = llm.get_tokenizer()
    ids = [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)}
           for p in prompts]
    # half the prompts at a time, in order: the second half is the shifted distribution
    half = len(ids) // 2
    for chunk in (ids[:half], ids[half:]):
        llm.generate(chunk, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=True)
    return [list(e) for e in llm.engine.speculation.verify_trace]


def replay(trace: list[list], make: Any) -> dict[str, float]:
    est: AcceptanceEstimator = make()
    abs_err, nll = 0.0, 0.0
    for rid, k, m in trace:
        rates = est.rates(rid, k)
        abs_err += abs(expected_tokens(rates, k) - 1.0 - m)
        nll -= math.log(max(outcome_probability(rates, k, m), 1e-12))
        est.observe(rid, k, m)
    n = max(len(trace), 1)
    return {"mae_accepted": abs_err / n, "nll": nll / n, "events": len(trace)}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Acceptance estimators on recorded verification traces",
        "",
        f"`{report['command']}` on {report['machine']['cpu']}, {report['date']}. The traces are in",
        f"`{TRACES}`; `--replay` scores them again without recording.",
        "",
        "Each trace is replayed in engine order. Before each verification, the estimator predicts the accepted",
        "count; then it sees the outcome. MAE is the mean absolute error of the predicted accepted count; NLL is",
        "the mean negative log-likelihood of the observed count. Lower is better.",
        "",
        "| estimator | " + " | ".join(f"{t} MAE | {t} NLL" for t in report["traces"]) + " | mean MAE |",
        "|---|" + "---|---|" * len(report["traces"]) + "---|",
    ]
    for name, scores in report["scores"].items():
        cells = " | ".join(f"{scores[t]['mae_accepted']:.3f} | {scores[t]['nll']:.3f}" for t in report["traces"])
        lines.append(f"| {name} | {cells} | {scores['mean_mae']:.3f} |")
    lines += ["", f"Lowest mean MAE: **{report['best']}**. Within 0.5% of it: {', '.join(report['ties'])}.",
              f"The engine's default is `{report['default']}`.",
              "Trace sizes: " + ", ".join(f"{t}: {n} verifications" for t, n in report["trace_sizes"].items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replay", action="store_true", help="only replay the committed traces")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16, help="n-gram trace prompts (the draft trace uses half)")
    args = ap.parse_args(argv)
    if args.replay:
        traces = json.loads(TRACES.read_text())
    else:
        n = args.prompts
        he = [p.text for p in load_prompts(n, "humaneval")[0]]
        log("recording the n-gram trace (smollm2-135m)")
        sharegpt = [p.text for p in load_sharegpt(n // 2)]
        ngram = record("smollm2-135m", {"method": "ngram"}, sharegpt + he[: n // 2], 128, args.threads)
        log("recording the draft trace (qwen2.5-coder-1.5b + 0.5b)")
        mt = [p.text for p in load_mtbench(n // 4)]
        draft = record("qwen2.5-coder-1.5b", {"method": "draft", "model": "qwen2.5-coder-0.5b"},
                       he[: n // 4] + mt, 64, args.threads)
        traces = {"ngram smollm2 ShareGPT->HumanEval": ngram, "draft 1.5B/0.5B HumanEval->MT-Bench": draft}
        TRACES.write_text(json.dumps(traces))
    scores: dict[str, dict[str, Any]] = {}
    for name, make in CANDIDATES.items():
        scores[name] = {t: replay(trace, make) for t, trace in traces.items()}
        scores[name]["mean_mae"] = sum(scores[name][t]["mae_accepted"] for t in traces) / len(traces)
        log(f"{name:30s} " + "  ".join(f"{scores[name][t]['mae_accepted']:.3f}" for t in traces))
    best = min(scores, key=lambda s: scores[s]["mean_mae"])
    ties = [s for s in scores if scores[s]["mean_mae"] <= 1.005 * scores[best]["mean_mae"]]
    default = make_estimator()
    default_name = f"{default.name} (decay {getattr(default, 'request_decay', '-')})"
    report = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d"),
              "machine": machine_info(args.threads), "traces": list(traces),
              "trace_sizes": {t: len(v) for t, v in traces.items()}, "scores": scores, "best": best,
              "ties": ties, "default": default_name}
    OUT.with_suffix(".json").write_text(json.dumps(report, indent=1))
    OUT.with_suffix(".md").write_text(markdown(report))
    log(f"best: {best}; wrote {OUT}.json / .md")


if __name__ == "__main__":
    main()
