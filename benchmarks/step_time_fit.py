"""How well a cached step-time profile's fitted model predicts its own decode steps, per batch size and k.

Reads a profile JSON (as `turbospec profile` writes it; the ones the goodput sweep used are committed under
benchmarks/results/profiles/) and prints, for decode steps of one context band, the median measured step time
next to the model's prediction for the same steps. Nothing runs on the model: this is arithmetic on samples.

    .venv/bin/python benchmarks/step_time_fit.py benchmarks/results/profiles/smollm2-135m-ngram-bf16-t1.json
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from turbospec.control.step_time import StepTimeModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("--context", type=int, default=512, help="per-request context band centre (tokens)")
    args = ap.parse_args()
    model = StepTimeModel.load(args.profile)
    if model is None:
        raise SystemExit(f"{args.profile}: not a step-time profile")
    cells: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for s in model.samples:
        f = s.features
        first_draft = f.draft_tokens > f.spec_tokens + f.batch  # includes a prompt catch-up: not a steady step
        if f.tokens != f.batch + f.spec_tokens or first_draft or abs(f.kv / f.batch - args.context) > args.context / 2:
            continue
        cells[(f.batch, f.spec_tokens // f.batch)].append((s.total_s, model.predict(f)))
    print(f"{args.profile.name}: decode steps at ~{args.context} tokens of context; median ms, measured / predicted")
    print("| batch | k | measured | predicted |\n|---|---|---|---|")
    for (b, k), pairs in sorted(cells.items()):
        measured = statistics.median(m for m, _ in pairs) * 1000
        predicted = statistics.median(p for _, p in pairs) * 1000
        print(f"| {b} | {k} | {measured:.0f} | {predicted:.0f} |")


if __name__ == "__main__":
    main()
