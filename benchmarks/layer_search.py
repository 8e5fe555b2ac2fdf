"""The layer-skip search's scorer, before and after it drafted only the answer positions, then the whole search.

Before (commit ef1df71's `_Scorer`, loaded from git): each trial ran the skipped model over every position of
each prompt + answer and kept the answer positions' logits. Now only the positions whose next token is an answer
token run (the prompt's are never scored, and every query reads the full model's K/V, not the draft's). Both
scorers get the same sequences (the target's greedy answers to the search's held-out prompts) and score the same
skipped sets in turns; their agreements must match (argmax over the same positions), and the time per trial is
the median of the turns. Then the search as `turbospec search-layers` runs it (wall time, trials, the plan),
saved where the layer-skip proposer looks for it, as that command does.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/layer_search.py [--model qwen2.5-coder-1.5b --rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from harness import alternating, benchmark_meta, default_out, save

BEFORE = "ef1df71"  # the last commit whose scorer ran every position


def scorer_before() -> ModuleType:
    """turbospec/spec/layer_search.py (now tuning/layer_search.py) as of BEFORE, imported inside the package (its relative imports work)."""
    source = subprocess.run(["git", "show", f"{BEFORE}:turbospec/spec/layer_search.py"], capture_output=True,
                            text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "layer_search_before.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location("turbospec.spec.layer_search_before", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up there
        spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="turns of each scorer per skipped set")
    parser.add_argument("--out", default=str(default_out("layer_search")))
    args = parser.parse_args()

    from turbospec.config import EngineConfig
    from turbospec.tuning import build_engine
    from turbospec.spec import layer_search

    torch.set_num_threads(args.threads)
    engine = build_engine(EngineConfig(args.model, dtype=args.dtype, num_threads=args.threads, kv_cache_memory_gib=0.25),
                       progress=False)
    n = len(engine.loaded.model.layers)
    sequences, _ = layer_search.answered_prompts(engine, 8, 48)  # the search's defaults
    scorers = {"before": scorer_before()._Scorer(engine, sequences), "now": layer_search._Scorer(engine, sequences)}
    positions = {"before": sum(len(ids) - 1 for ids, _ in sequences),
                 "now": sum(len(ids) - plen for ids, plen in sequences)}
    skip_sets = [[], [n // 2], list(range(n // 3, n // 3 + n // 4))]
    rows: list[dict[str, Any]] = []
    for skip in skip_sets:
        times: dict[str, list[float]] = {"before": [], "now": []}
        agreements: dict[str, set[float]] = {"before": set(), "now": set()}
        for round_ in range(args.rounds):
            for name in alternating(("before", "now"), round_):
                start = time.perf_counter()
                agreements[name].add(scorers[name].agreement(skip))
                times[name].append(time.perf_counter() - start)
        # each scorer gives one value every turn; the two may differ only where a kernel choice depends on the
        # number of rows in a call (the table shows both)
        assert all(len(values) == 1 for values in agreements.values()), (skip, agreements)
        agreement = {name: values.pop() for name, values in agreements.items()}
        row = {"skip": skip, **{f"{k}_s": round(statistics.median(v), 3) for k, v in times.items()},
               **{f"{k}_agreement": round(a, 4) for k, a in agreement.items()}}
        row["speedup"] = round(row["before_s"] / row["now_s"], 2)
        rows.append(row)
        print(row)

    start = time.perf_counter()
    plan = layer_search.search_skip_layers(engine)
    plan.save(layer_search.plan_path(engine))
    search = {"seconds": round(time.perf_counter() - start, 1), "trials": len(plan.trials), "skip": plan.skip,
              "agreement": plan.agreement, "cost_fraction": plan.cost_fraction, "best_k": plan.best_k,
              "expected_speedup": plan.expected_speedup}
    meta = benchmark_meta(args.threads, model=args.model, dtype=args.dtype, prompts=len(sequences), answer_tokens=48,
                          positions=positions, before=BEFORE)
    save(Path(args.out), meta, [*rows, {"search": search}], markdown(meta, rows, search))


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]], search: dict[str, Any]) -> str:
    pos = meta["positions"]
    lines = [f"# The layer-skip search's scorer: every position ({meta['before']}) vs answer positions only", "",
             f"`{meta['command']}` on {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, "
             f"{meta['date']}, commit {meta['commit']}.", "",
             f"{meta['model']} ({meta['dtype']}), {meta['prompts']} held-out prompts answered greedily, "
             f"{meta['answer_tokens']} answer tokens each: the draft runs {pos['before']} positions per trial "
             f"before, {pos['now']} now. Median of the turns.", "",
             "| skipped layers | before s/trial | now s/trial | speedup | agreement before | agreement now |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['skip'] or 'none'} | {r['before_s']} | {r['now_s']} | {r['speedup']}x | "
                     f"{r['before_agreement']} | {r['now_agreement']} |")
    lines += ["", f"The whole search now (`search_skip_layers` with its defaults, saved): {search['seconds']} s, "
                  f"{search['trials']} trials; plan: skip {search['skip']}, agreement {search['agreement']}, "
                  f"cost {search['cost_fraction']} of a step, k {search['best_k']}, expected "
                  f"{search['expected_speedup']}x.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
