"""What a disturbed step-time profile does to the goodput controller, and what dropping disturbed steps changes.

A brief profile is measured twice on one engine: on a quiet machine, and with a bursty co-runner (a process busy
for 0.15 s of every 0.4 s, like a test or a tokenizer job sharing the cores). Each profile is fitted twice from
the same samples: every recorded step kept (profiler version 8), and the steps more than 1.25x slower than the
fastest round of their grid point and k dropped (version 9, `tuning/profiler.py` drop_disturbed). Per fit: the
price of a batch-1 step with k verified nodes over a decode, and what the adaptive row then does on HumanEval
(always measured on the quiet machine): tokens/s, tau, mean k. Plain and fixed-k rows on the same engine are the
reference, measured before and after the adaptive ones.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/profile_disturbance.py
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from harness import benchmark_meta, default_out, header_lines, save

from turbospec.tuning import set_speculation
from turbospec import LLM, SamplingParams
from turbospec.bench.humaneval import answer_prefix, load_humaneval
from turbospec.bench.humaneval import chat_messages as humaneval_messages
from turbospec.tuning import profiler
from turbospec.control.step_time import StepFeatures, StepSample, StepTimeModel

# busy for 0.15 s, asleep for 0.25 s, until killed
CO_RUNNER = ("import time\nwhile True:\n    t = time.time()\n    while time.time() - t < 0.15: pass\n"
             "    time.sleep(0.25)\n")


def measure_profile(llm: LLM, bursty: bool) -> tuple[list[StepSample], list[StepSample]]:
    """One brief profile: (every recorded step, the steps drop_disturbed keeps), from the same run."""
    groups: list[list[tuple[int, StepSample]]] = []
    original = profiler.drop_disturbed

    def keep_all(recorded: list[tuple[int, StepSample]]) -> list[StepSample]:
        groups.append(recorded)
        return [s for _, s in recorded]

    co_runner = subprocess.Popen([sys.executable, "-c", CO_RUNNER]) if bursty else None
    profiler.drop_disturbed = keep_all
    try:
        samples = profiler.profile_engine(llm.engine, profiler.GRIDS["brief"], progress=False)
    finally:
        profiler.drop_disturbed = original
        if co_runner is not None:
            co_runner.kill()
            co_runner.wait()
    dropped = {id(s) for g in groups for _, s in g} - {id(s) for g in groups for s in original(g)}
    return samples, [s for s in samples if id(s) not in dropped]


def batch1_prices(model: StepTimeModel, levels: int, ks: range, context: int = 300) -> list[float]:
    """Predicted batch-1 step time with k verified nodes (and the tree's drafting), over a decode's."""
    base = StepFeatures()
    base.add(context, 1)
    base.gathered_slots()
    cost = model.spec_cost(base, levels)
    per_request = model.per_drafting_request_s()
    return [(cost(k, k, k * context) + (per_request if k else 0.0)) / cost(0, 0, 0) for k in ks]


def run_humaneval(llm: LLM, prompts: list[list[int]], mode: int | str, max_tokens: int) -> dict[str, Any]:
    set_speculation(llm.engine, mode)
    llm.engine.reset_spec_stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start, tokens = time.perf_counter(), 0
    for ids in prompts:
        tokens += len(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids)
    seconds = time.perf_counter() - start
    stats = llm.spec_stats()
    return {"mode": mode, "tok_s": tokens / seconds, "tau": stats.get("mean_accepted_length") or None,
            "mean_k": stats.get("mean_k") or 0.0}


def markdown(meta: dict[str, Any], result: dict[str, Any]) -> str:
    ks = result["ks"]
    lines = ["# A disturbed step-time profile and the goodput controller", "", *header_lines(meta),
             f"- {meta['model']}, {meta['method']} ({meta['max_k']} nodes at most), bf16, greedy, batch 1; brief "
             f"profiles; adaptive and reference rows on the first {meta['prompts']} HumanEval tasks (at most "
             f"{meta['max_tokens']} tokens), on the quiet machine; co-runner: busy 0.15 s of every 0.4 s", "",
             "| profile measured | fit on | steps kept | " + " | ".join(f"k={k}" for k in ks)
             + " | adaptive tok/s | tau | mean k |",
             "|---|---|---|" + "---|" * len(ks) + "---|---|---|"]
    for arm in result["arms"]:
        a = arm["adaptive"]
        lines.append(f"| {arm['condition']} | {arm['fit']} | {arm['kept']} of {arm['recorded']} | "
                     + " | ".join(f"{p:.2f}" for p in arm["prices"])
                     + f" | {a['tok_s']:.2f} | {a['tau'] or 0:.2f} | {a['mean_k']:.2f} |")
    lines += ["", "Prices: predicted batch-1 step time with k verified nodes over a decode's. Reference rows on the "
              "same engine (before / after the adaptive ones):", ""]
    for ref in result["reference"]:
        tau = f", tau {ref['tau']:.2f}" if ref["tau"] else ""
        name = "plain" if ref["mode"] == 0 else f"fixed {ref['mode']} nodes"
        lines.append(f"- {name}: {ref['tok_s']:.2f} tok/s{tau}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="dart")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=str(default_out("profile_disturbance")))
    args = ap.parse_args()
    llm = LLM(args.model, dtype="bfloat16", weight_format="bf16", max_model_len=1024, progress=False,
              enable_prefix_caching=False,
              speculative_config={"method": args.method, "num_speculative_tokens": args.max_k})
    tok = llm.engine.tokenizer
    prompts = [tok.apply_chat_template(humaneval_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
               for t in load_humaneval(args.prompts)]
    run_humaneval(llm, prompts[:1], 0, 4)  # warm-up
    reference = [run_humaneval(llm, prompts, mode, args.max_tokens) for mode in (0, args.max_k)]
    key = profiler.profile_key(llm.engine)
    levels = llm.engine.speculation.proposer.tree_levels
    ks = range(0, args.max_k + 1, 2)
    arms = []
    original_load = profiler.load_or_profile
    try:
        for condition in tqdm(("quiet", "bursty co-runner"), desc="profiles", unit="profile"):
            everything, kept = measure_profile(llm, bursty=condition != "quiet")
            for fit, samples in (("every step (v8)", everything), ("disturbed dropped (v9)", kept)):
                model = StepTimeModel.fit(samples, key)
                prices = batch1_prices(model, levels, ks)  # before serving refits its level online
                profiler.load_or_profile = lambda engine, progress=True, m=model: m
                llm.engine.speculation.controller = None  # a fresh controller (and estimator) on this fit
                adaptive = run_humaneval(llm, prompts, "auto", args.max_tokens)
                arms.append({"condition": condition, "fit": fit, "recorded": len(everything), "kept": len(samples),
                             "prices": prices, "adaptive": adaptive})
    finally:
        profiler.load_or_profile = original_load
    reference += [run_humaneval(llm, prompts, mode, args.max_tokens) for mode in (0, args.max_k)]
    meta = benchmark_meta(torch.get_num_threads(), model=args.model, method=args.method, max_k=args.max_k,
                          prompts=args.prompts, max_tokens=args.max_tokens)
    result = {"ks": list(ks), "arms": arms, "reference": reference}
    save(Path(args.out), meta, [result], markdown(meta, result))


if __name__ == "__main__":
    main()
