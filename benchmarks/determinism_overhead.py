"""Latency overhead of each deterministic mode over the default mode, shaped like seed 000's table.

For every model and data set: a batch of 8 chat prompts, output cap 256 (every request generates exactly 256
tokens: EOS is ignored, so every mode does the same amount of work), greedy; the mean end-to-end request
latency of each mode, modes interleaved within each repeat, and the overhead % over the default mode (its
latency is the baseline column). Then, per mode, the fraction of needle trials that were deterministic: the
first prompt alone, then at a random position among 1..15 other prompts of the same data set, compared
bitwise (token ids, and log-probs too for batch-invariant) with the alone run.

    python benchmarks/determinism_overhead.py --models smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from turbospec import SamplingParams
from turbospec.bench.machine import machine_info
from turbospec.data.prompts import BenchPrompt, chat_messages, load_mtbench, load_prompts, load_sharegpt
from turbospec.config import EngineConfig
from turbospec.engine import LLMEngine
from turbospec.tuning import build_engine
from turbospec.models.loader import load_model, parse_dtype

DATASETS = ("sharegpt", "humaneval", "mtbench")


def dataset(name: str, n: int) -> list[BenchPrompt]:
    if name == "humaneval":
        return load_prompts(n, "humaneval")[0]
    return load_mtbench(n) if name == "mtbench" else load_sharegpt(n)


def mode_options(mode: str | None) -> dict[str, Any]:
    """A mode name as the table shows it: "llm42:auto" or "llm42:16" set llm42's window too."""
    if mode is None:
        return {"deterministic": None}
    name, _, window = mode.partition(":")
    return {"deterministic": name, **({"verify_window": window if window == "auto" else int(window)} if window else {})}


def run_batch(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list, float]:
    """Outputs in order and the mean end-to-end latency of the batch's requests."""
    start = time.perf_counter()
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[str, Any] = {}
    finish: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id], finish[out.request_id] = out, time.perf_counter()
    return [done[i] for i in ids], sum(finish[i] - start for i in ids) / len(ids)


def signature(out: Any, with_logprobs: bool) -> tuple:
    c = out.outputs[0]
    lps = tuple(tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in c.logprobs) if with_logprobs else ()
    return tuple(c.token_ids), lps


def needle_fraction(engine: LLMEngine, pool: list[list[int]], trials: int, max_tokens: int, exact_logprobs: bool,
                    seed: int) -> float:
    rng = random.Random(seed)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
    alone = signature(run_batch(engine, [pool[0]], [greedy])[0][0], exact_logprobs)
    same = 0
    for _ in range(trials):
        others = [rng.choice(pool[1:]) for _ in range(rng.randint(1, 15))]
        at = rng.randint(0, len(others))
        batch = others[:at] + [pool[0]] + others[at:]
        params = [greedy if i == at else SamplingParams(temperature=0, max_tokens=rng.randint(8, max_tokens))
                  for i in range(len(batch))]
        same += signature(run_batch(engine, batch, params)[0][at], exact_logprobs) == alone
    return same / trials


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    p.add_argument("--modes", default="batch-invariant,llm42,llm42:auto,margin-gate",
                   help="comma-separated; llm42:auto or llm42:16 also set the window")
    p.add_argument("--datasets", default=",".join(DATASETS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--trials", type=int, default=4, help="needle trials per mode and data set")
    p.add_argument("--trial-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--output", default="benchmarks/results/determinism_overhead/determinism_overhead")
    p.add_argument("--append", action="store_true", help="add rows to the output's JSON instead of replacing it")
    args = p.parse_args()
    modes: list[str | None] = [None, *args.modes.split(",")]
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        loaded = load_model(model, parse_dtype("bfloat16"), "cpu", progress=False)
        engines = {m: build_engine(EngineConfig(model, num_threads=args.threads, max_model_len=2048, **mode_options(m)),
                                   loaded=loaded, progress=False) for m in modes}
        tok = loaded.tokenizer
        for name in args.datasets.split(","):
            pool = [tok.apply_chat_template(chat_messages(q)) for q in dataset(name, 16)]
            batch = pool[: args.batch]
            # every request generates exactly the cap in every mode: the modes' outputs differ from the default
            # mode's, and latencies over different output lengths would not compare
            params = [SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)] * len(batch)
            run_batch(engines[None], batch[:1], [SamplingParams(temperature=0, max_tokens=4)])  # warm-up
            latency: dict[str | None, list[float]] = {m: [] for m in modes}
            outputs: dict[str | None, list] = {}
            for engine in engines.values():
                engine.exact.stats = type(engine.exact.stats)()
            for _ in tqdm(range(args.repeats), desc=f"{model} {name}", unit="repeat"):
                for m in modes:  # interleaved: machine noise hits every mode alike
                    outs, mean = run_batch(engines[m], batch, params)
                    latency[m].append(mean)
                    outputs[m] = outs
            base = min(latency[None])
            for m in modes:
                stats = engines[m].determinism_stats()  # of the timed runs only
                kind = mode_options(m)["deterministic"]
                frac = needle_fraction(engines[m], pool, args.trials, args.trial_tokens,
                                       exact_logprobs=kind in ("batch-invariant", "llm42"), seed=1)
                # margin-gate: tokens re-checked; llm42: tokens replayed (every one, by design)
                trigger = stats["trigger_rate"] if kind == "margin-gate" else \
                    stats["replayed_fraction"] if kind == "llm42" else None
                rows.append({"model": model, "dataset": name, "mode": m or "default", "latency_s": min(latency[m]),
                             "latencies_s": latency[m], "overhead_pct": 100 * (min(latency[m]) / base - 1),
                             "baseline_latency_s": base, "deterministic_fraction": frac, "trigger_rate": trigger,
                             "determinism_stats": stats, "ignore_eos": True,
                             "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs[m])})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    earlier = json.loads(out.with_suffix(".json").read_text()) if args.append and out.with_suffix(".json").exists() \
        else {"commands": [], "rows": []}
    fresh = {(r["model"], r["dataset"], r["mode"]) for r in rows}
    rows = [r for r in earlier["rows"] if (r["model"], r["dataset"], r["mode"]) not in fresh] + rows
    result = {"commands": [*earlier["commands"], command], "machine": machine_info(args.threads),
              "config": vars(args), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# Deterministic inference overhead (batch {args.batch}, {args.max_tokens} tokens per request, greedy)",
             "",
             "Overhead: the mode's mean request latency over the default mode's, best of the repeats, modes "
             "interleaved. Deterministic trials: the needle's output alone equals its output in random batches "
             "(token ids; token ids and log-probs for batch-invariant and llm42). Verifier trigger rate: "
             "margin-gate, tokens re-checked on the invariant path; llm42, tokens replayed. Rows from an earlier "
             "command keep their own default-mode baseline (its column).", "",
             *[f"`{c}`  " for c in result["commands"]],
             f"{result['machine']['cpu']}, {args.threads} threads, {result['machine']['date']}, "
             f"commit {result['machine']['commit']}", "",
             "| mode | model | dataset | tokens / request | overhead (%) | default latency (s) | mode latency (s) | "
             "deterministic trials | verifier trigger rate |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        trig = "-" if r["trigger_rate"] is None else f"{100 * r['trigger_rate']:.2f}%"
        length = str(args.max_tokens) if r.get("ignore_eos") else f"<= {args.max_tokens} (EOS honoured)"
        lines.append(f"| {r['mode']} | {r['model']} | {r['dataset']} | {length} | {r['overhead_pct']:.1f} | "
                     f"{r['baseline_latency_s']:.2f} | {r['latency_s']:.2f} | "
                     f"{100 * r['deterministic_fraction']:.0f}% | {trig} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
