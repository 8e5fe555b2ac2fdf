"""Two or more trained draft files of one method, side by side: is a retrained head faster than the one it replaces?

A head's held-out accuracy (its file's `extra`) is measured on teacher-forced answers; what a user gets is tokens
per second with the tree the proposer grows from it. This loads plain decoding and one engine per file together,
and lets them take turns prompt by prompt (proposer_zoo.py's side-by-side runner), so the drift of a shared machine
falls on every row alike. Same prompts and settings as the zoo: single stream, greedy, chat template, bf16, the
first N MT-Bench first turns and HumanEval tasks.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/head_ab.py --heads OLD.safetensors,NEW.safetensors --prompts 10
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from proposer_zoo import datasets, run_turbospec, summarise  # (benchmarks/: the script's directory)

from turbospec.bench.machine import benchmark_meta, header_lines, save_results
from turbospec.spec.heads import file_sha256

SETS = ("mt-bench", "humaneval")


def row_name(path: Path) -> str:
    """A row per file: its name and the start of its sha256 (two files of one name are told apart)."""
    return f"{path.name} ({file_sha256(path)[:8]})"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Draft files side by side: speed over plain decoding, taking turns prompt by prompt", "",
             *header_lines(meta),
             f"- {meta['model']}, {meta['method']}, {meta['tree_nodes']} tree nodes, bf16, greedy, batch 1, at most "
             f"{meta['max_tokens']} tokens; the first {meta['prompts']} MT-Bench first turns and HumanEval tasks", "",
             "| row | MT-Bench tok/s | speedup | after 1st token | tau | HumanEval tok/s | speedup | after 1st token "
             "| tau | = plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for name in SETS:
            s = r["sets"][name]
            cells += [f"{s['tok_s']:.2f}", f"{s['speedup']:.2f}x", f"{s.get('after_first_speedup', 1.0):.2f}x",
                      f"{s['tau']:.2f}" if s.get("tau") else "-"]
        same = min(s["matches_plain"] for s in r["sets"].values())
        lines.append(f"| {r['row']} | {' | '.join(cells)} | {same:.2f} |")
    heads = [r for r in rows if r["row"] != "plain"]
    for new in heads[1:]:
        ratios = ", ".join(f"{n} {new['sets'][n]['tok_s'] / heads[0]['sets'][n]['tok_s']:.3f}x" for n in SETS)
        lines.append(f"\n- {new['row']} over {heads[0]['row']}: {ratios}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--method", default="eagle", choices=["medusa", "hydra", "eagle"])
    ap.add_argument("--heads", required=True, help="comma-separated draft files of --method, the first the baseline")
    ap.add_argument("--prompts", type=int, default=10, help="per data set")
    ap.add_argument("--tree-nodes", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="benchmarks/results/head_ab")
    args = ap.parse_args()
    paths = [Path(p) for p in args.heads.split(",") if p]
    if len(paths) < 2:
        ap.error(f"--heads: give at least two files to compare, got {len(paths)}")
    if missing := [str(p) for p in paths if not p.is_file()]:
        ap.error(f"--heads: no such file: {', '.join(missing)}")
    names = [row_name(p) for p in paths]
    if len(set(names)) < len(names):
        ap.error("--heads: the same file twice")
    # what run_turbospec reads from the zoo's arguments
    args.dtype, args.weight_format, args.max_model_len = "bfloat16", "bf16", 1024
    specs: dict[str, dict[str, Any] | None] = {"plain": None}
    for name, path in zip(names, paths):
        specs[name] = {"method": args.method, "num_speculative_tokens": args.tree_nodes, "heads": str(path)}
    rows = run_turbospec(args, args.model, specs, datasets(args.model, args.prompts))
    summarise(rows)
    meta = benchmark_meta(args.threads, model=args.model, method=args.method, tree_nodes=args.tree_nodes,
                          max_tokens=args.max_tokens, prompts=args.prompts,
                          heads={n: file_sha256(p) for n, p in zip(names, paths)})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_results(out, meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
