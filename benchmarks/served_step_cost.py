"""What a verified draft of k tokens costs in served steps, next to what the goodput controller's step-time profile
predicts for the same steps.

One request at a time (HumanEval prompts, chat template, code fence pre-filled), greedy, the draft length fixed
per step and the lengths taken in turn (rounds, alternating order) so a drifting machine moves them alike. For each
k: the median measured step (target + draft + overhead, as the engine samples it) and the median of the profile
model's predictions for those same steps. The profile is the cached one for this engine (made on first use, as
`"num_speculative_tokens": "auto"` does); fixed-k steps do not refit it.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/served_step_cost.py [--model qwen2.5-coder-1.5b --method dart]
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from typing import Any

from tqdm import tqdm
from harness import alternating, benchmark_meta, default_out, header_lines, save

from turbospec import LLM, SamplingParams
from turbospec.bench.humaneval import answer_prefix, chat_messages, load_humaneval
from turbospec.tuning.profiler import profile_key, profile_path

KS = (0, 1, 2, 4, 6, 8)


def measure(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    """Rows per k, and the profile's cache file name (its key): what the predictions came from."""
    ks = args.ks
    llm = LLM(args.model, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, max_model_len=1024,
              progress=False, enable_prefix_caching=False,
              speculative_config={"method": args.method, "num_speculative_tokens": "auto",
                                  "max_speculative_tokens": max(ks)})
    engine = llm.engine
    llm.generate("hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # loads or makes the profile
    model = engine.speculation.controller.model
    engine.sample_steps = True
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(chat_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
               for t in load_humaneval(args.prompts)]
    seen: dict[int, list[tuple[float, float]]] = {k: [] for k in ks}  # (measured, predicted) seconds
    for i, ids in enumerate(tqdm(prompts, desc="prompts")):
        rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=600, ignore_eos=True))
        engine.set_speculation(0)
        while engine.requests[rid].is_prefilling or engine.requests[rid].num_computed_tokens == 0:
            engine.step()
        for round_ in range(args.rounds):
            for k in alternating(ks, i + round_):
                engine.set_speculation(k)
                for _ in range(args.steps):
                    engine.step()
                    s = engine.last_sample
                    if s is not None and s.features.batch == 1 and s.features.tokens == 1 + k:
                        seen[k].append((s.total_s, model.predict(s.features)))
        engine.abort_request(rid)
    rows = [{"k": k, "steps": len(v), "measured_ms": statistics.median(m for m, _ in v) * 1e3,
             "predicted_ms": statistics.median(p for _, p in v) * 1e3} for k, v in seen.items()]
    return rows, profile_path(profile_key(engine)).name


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    lines = ["# Served step time by draft length, measured and as the step-time profile predicts it", "",
             *header_lines(meta),
             f"- {meta['model']} bf16, {meta['method']} drafts, one request, HumanEval prompts 1-{meta['prompts']}, "
             f"{meta['rounds']} rounds of {meta['steps']} steps per k per prompt; medians"
             + (f"; profile `{meta['profile']}`" if meta.get("profile") else ""), "",
             "| k | steps | measured ms | over k = 0 | predicted ms | over k = 0 |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['k']} | {r['steps']} | {r['measured_ms']:.1f} | "
                     f"{r['measured_ms'] - base['measured_ms']:+.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['predicted_ms'] - base['predicted_ms']:+.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="dart")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--ks", default=",".join(map(str, KS)), help="draft lengths, comma-separated, 0 first")
    ap.add_argument("--out", default=str(default_out("served_step_cost")))
    args = ap.parse_args()
    args.ks = tuple(int(k) for k in args.ks.split(","))
    if args.ks[0] != 0 or min(args.ks) < 0:
        ap.error(f"--ks: draft lengths >= 0, the first 0 (the rows are read against it), got {args.ks}")
    rows, profile = measure(args)
    meta = benchmark_meta(args.threads, model=args.model, method=args.method, prompts=args.prompts,
                          rounds=args.rounds, steps=args.steps, profile=profile)
    save(Path(args.out), meta, rows, markdown(meta, rows))  # (it prints the table)


if __name__ == "__main__":
    main()
