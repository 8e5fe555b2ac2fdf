"""How well a step-time profile's fit predicts its own decode steps, per batch size and k: the fit the profile was
saved with next to a refit of the same samples by the current fitting code (control/step_time.py).

Reads a profile JSON (as `turbospec profile` writes it; the ones results cite are committed under
benchmarks/results/profiles/) and prints, for decode steps of one context band, the median measured step time
next to both models' predictions for the same steps, and each model's forms with their held-out error. Nothing
runs on the model: this is arithmetic on samples.

    .venv/bin/python benchmarks/step_time_fit.py benchmarks/results/profiles/smollm2-135m-ngram-bf16-t1.json
    .venv/bin/python benchmarks/step_time_fit.py \\
        benchmarks/results/profiles/qwen2.5-coder-1.5b-eagle-bf16-t2-zen5.json \\
        --context 150 --out benchmarks/results/step_time_fit/step_time_fit_qwen_eagle_zen5
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any
from harness import benchmark_meta, header_lines, save

from turbospec.control.step_time import StepTimeModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--context", type=int, default=512, help="per-request context band centre (tokens)")
    ap.add_argument("--out", type=Path, default=None, help="also write OUT.json and OUT.md")
    args = ap.parse_args()
    saved = StepTimeModel.load(args.profile)
    if saved is None:
        raise SystemExit(f"{args.profile}: not a step-time profile")
    refit = StepTimeModel.fit(saved.samples, saved.key)
    cells: dict[tuple[int, int], list[tuple[float, float, float]]] = defaultdict(list)
    for s in saved.samples:
        f = s.features
        first_draft = f.draft_tokens > f.spec_tokens + f.batch  # includes a prompt catch-up: not a steady step
        if f.tokens != f.batch + f.spec_tokens or first_draft or abs(f.kv / f.batch - args.context) > args.context / 2:
            continue
        cells[(f.batch, f.spec_tokens // f.batch)].append((s.total_s, saved.predict(f), refit.predict(f)))
    rows = [{"batch": b, "k": k, **{name: statistics.median(t[i] for t in triples) * 1000
                                    for i, name in enumerate(("measured_ms", "saved_fit_ms", "refit_ms"))}}
            for (b, k), triples in sorted(cells.items())]
    meta = benchmark_meta(int(saved.key.get("threads", 0)), profile=str(args.profile), context=args.context,
                          saved_forms=[r.line() for r in saved.reports], refit_forms=[r.line() for r in refit.reports])
    table = markdown(meta, rows)
    if args.out:
        save(args.out, meta, rows, table)
    else:
        print(table)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Step-time fit of `{Path(meta['profile']).name}`: saved fit and current refit", "",
             *header_lines(meta),
             f"- decode steps at ~{meta['context']} tokens of context per request; median ms over the profile's "
             "samples, measured and as each model predicts them (arithmetic on the samples, no model run)", "",
             "Forms, saved:", "", *[f"    {line}" for line in meta["saved_forms"]], "",
             "Forms, refitted now:", "", *[f"    {line}" for line in meta["refit_forms"]], "",
             "| batch | k | measured | saved fit | refit |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['k']} | {r['measured_ms']:.1f} | {r['saved_fit_ms']:.1f} | {r['refit_ms']:.1f} |"
              for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
