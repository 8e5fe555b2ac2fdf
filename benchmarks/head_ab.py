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

from proposer_zoo import after_first_lines, datasets, run_turbospec, summarise  # (benchmarks/: the script's directory)
from harness import benchmark_meta, default_out, header_lines, save

from turbospec.proposers.heads import file_sha256, read_head_file

SETS = ("mt-bench", "humaneval")


def training_report(path: Path, method: str) -> dict[str, Any]:
    """What the file's training measured: held-out top-1 per draft step on its own split, and the same split read
    by the file it was fine-tuned from (a split drawn afresh may hold answers that trained that file). Raises
    ValueError for a file that holds no draft of `method`."""
    extra = read_head_file(path, method)[2]
    keys = ("heldout_top1_accuracy", "train_positions", "eval_positions", "seconds", "train_seconds", "data")
    report: dict[str, Any] = {k: extra[k] for k in keys if k in extra}
    if isinstance(init := extra.get("init"), dict):
        report["init"] = {k: init[k] for k in ("sha256", "heldout_top1_accuracy") if k in init}
    return report


def _top1(accuracy: list[float] | None) -> str:
    return " / ".join(f"{a:.2f}" for a in accuracy) if accuracy else "-"


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Draft files side by side: speed over plain decoding, taking turns prompt by prompt", "",
             *header_lines(meta),
             f"- {meta['model']}, {meta['method']}, {meta['tree_nodes']} tree nodes, bf16, greedy, batch 1, at most "
             f"{meta['max_tokens']} tokens; the first {meta['prompts']} MT-Bench first turns and HumanEval tasks", "",
             "| row | MT-Bench tok/s | speedup | tau | HumanEval tok/s | speedup | tau | = plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = []
        for name in SETS:
            s = r["sets"][name]
            cells += [f"{s['tok_s']:.2f}", f"{s['speedup']:.2f}x", f"{s['tau']:.2f}" if s.get("tau") else "-"]
        same = min(s["matches_plain"] for s in r["sets"].values())
        lines.append(f"| {r['row']} | {' | '.join(cells)} | {same:.2f} |")
    lines += ["", *after_first_lines(rows)]
    heads = [r for r in rows if r["row"] != "plain"]
    for new in heads[1:]:
        ratios = ", ".join(f"{n} {new['sets'][n]['tok_s'] / heads[0]['sets'][n]['tok_s']:.3f}x" for n in SETS)
        lines.append(f"- {new['row']} over {heads[0]['row']}: {ratios}")
    lines += ["", "What each file's training reported (its `extra`; held-out top-1 per draft step on the file's own "
              "split, which differs between files):", "",
              "| file | training positions | held-out top-1 | the file it started from, on the same split "
              "| seconds in all |",
              "|---|---|---|---|---|"]
    for name, report in meta["training"].items():
        init = report.get("init", {})
        started = f"{init['sha256'][:8]}: {_top1(init.get('heldout_top1_accuracy'))}" if init else "-"
        lines.append(f"| {name} | {report.get('train_positions', '-')} | "
                     f"{_top1(report.get('heldout_top1_accuracy'))} | {started} | {report.get('seconds', '-')} |")
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
    ap.add_argument("--out", default=str(default_out("head_ab")))
    ap.set_defaults(dtype="bfloat16", weight_format="bf16", max_model_len=1024)  # (proposer_zoo's runner reads them)
    args = ap.parse_args()
    paths = [Path(p) for p in args.heads.split(",") if p]
    if len(paths) < 2:
        ap.error(f"--heads: give at least two files to compare, got {len(paths)}")
    if missing := [str(p) for p in paths if not p.is_file()]:
        ap.error(f"--heads: no such file: {', '.join(missing)}")
    shas = [file_sha256(p) for p in paths]
    if len(set(shas)) < len(shas):
        ap.error("--heads: the same file twice (two files with the same contents)")
    try:
        reports = [training_report(p, args.method) for p in paths]
    except ValueError as e:
        ap.error(f"--heads: {e}")
    names = [f"{p.name} ({sha[:8]})" for p, sha in zip(paths, shas)]  # two files of one name are told apart
    specs: dict[str, dict[str, Any] | None] = {"plain": None}
    for name, path in zip(names, paths):
        specs[name] = {"method": args.method, "num_speculative_tokens": args.tree_nodes, "heads": str(path)}
    rows = run_turbospec(args, args.model, specs, datasets(args.model, args.prompts))
    summarise(rows)
    meta = benchmark_meta(args.threads, model=args.model, method=args.method, tree_nodes=args.tree_nodes,
                          max_tokens=args.max_tokens, prompts=args.prompts,
                          heads=dict(zip(names, shas)), training=dict(zip(names, reports)))
    save(Path(args.out), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
