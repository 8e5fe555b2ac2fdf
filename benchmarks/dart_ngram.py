"""How much DART's n-gram term adds: tau of the committed DART draft at several n-gram weights, same prompts.

The DART proposer (turbospec/proposers/dart_proposer.py) scores a tree node by the draft's log-probability at its
position plus `ngram_weight` x the n-gram log-probability of its token after its parent's. Weight 0 is the draft
alone. One engine, float32 (so every variant's output is plain decoding's, token for token), greedy, 8-node trees,
the first N MT-Bench first turns and HumanEval tasks (as benchmarks/proposer_zoo.py builds them); the weight is
changed between passes over the same prompts. A last pass at the default weight zeroes the mask entries' learned
offsets (every mask then starts from the last entry's input, as the first position does): what the trained masks
add over the n-gram search alone. tau (tokens per verification) does not depend on the machine's
speed; tokens/s is given too, but the passes run one after another, so read it with the machine's drift in mind.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/dart_ngram.py [--model smollm2-135m --prompts 6]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from harness import benchmark_meta, default_out, header_lines, run_sets, save, stats  # noqa: E402
from proposer_zoo import datasets  # noqa: E402

from turbospec import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per data set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--weights", default="0,0.25,0.5,1.0")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("dart_ngram")))
    args = ap.parse_args()
    data = datasets(args.model, args.prompts)
    llm = LLM(args.model, dtype="float32", num_threads=args.threads, max_model_len=1024, progress=False,
              enable_prefix_caching=False, speculative_config={"method": "dart", "num_speculative_tokens": 8})
    plain = LLM(args.model, dtype="float32", num_threads=args.threads, max_model_len=1024, progress=False,
                enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    want = {name: [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                                   use_tqdm=False)]
            for name, prompts in data.items()}
    rows: list[dict[str, Any]] = []
    proposer = llm.engine.speculation.proposer
    variants = [(float(w), False) for w in args.weights.split(",")] + [(proposer.ngram_weight, True)]
    for weight, zero_masks in variants:
        proposer.ngram_weight = weight
        if zero_masks:
            with torch.no_grad():
                proposer.dart.mask.zero_()
        sets = run_sets({f"weight {weight}": llm}, data, params)[f"weight {weight}"]
        rows.append({"ngram_weight": weight, "zero_masks": zero_masks,
                     "sets": {name: {"tau": s["tau"] or 0.0, "tok_s": stats.tok_s(s["tokens"], s["seconds"]),
                                     "acceptance_by_position": s["acceptance_by_position"],
                                     "equals_plain": s["outputs"] == want[name]}
                              for name, s in sets.items()}})
    meta = benchmark_meta(args.threads, model=args.model, prompts=args.prompts, max_tokens=args.max_tokens)
    lines = ["# DART's n-gram term: tau by n-gram weight (the committed draft, same prompts)", "",
             *header_lines(meta),
             f"- {args.model}, float32, greedy, 8-node trees, {args.prompts} MT-Bench first turns and {args.prompts} "
             f"HumanEval tasks, at most {args.max_tokens} tokens; weight 0 is the draft's probabilities alone", "",
             "| n-gram weight | MT-Bench tau | accepted at positions 1-4 | tok/s | HumanEval tau | accepted at "
             "positions 1-4 | tok/s | = plain |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for name in ("mt-bench", "humaneval"):
            s = row["sets"][name]
            cells += [f"{s['tau']:.2f}", " / ".join(f"{a:.2f}" for a in s["acceptance_by_position"][:4]),
                      f"{s['tok_s']:.1f}"]
        same = all(s["equals_plain"] for s in row["sets"].values())
        label = f"{row['ngram_weight']}{', mask offsets zeroed' if row['zero_masks'] else ''}"
        lines.append(f"| {label} | {' | '.join(cells)} | {'yes' if same else 'no'} |")
    save(Path(args.out), meta, rows, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
