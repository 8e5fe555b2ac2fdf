"""Tensor parallelism on this machine: the same CPU cores as one process with all threads, or as ranks.

Rows (one model, dense bf16 weights, greedy, chat template, one run; every row in its own process):
- tp1-t{T}: one process, T threads (all cores);
- tp2-t{T/2}: two ranks over gloo, T/2 threads each (the same cores);
- tp1-t{T/2}: one process with one rank's threads (what a rank alone would do);
- invariant-grouped / invariant-ungrouped: the batch-invariant mode with attention-out and MLP-down computed as
  per-KV-group partial products added in order (what makes invariant outputs equal across TP sizes) against one
  product (the earlier invariant path), to price that change.
Workloads: single stream (MT-Bench first turns, one at a time) and a batch of 8 prompts at once.

    .venv/bin/python benchmarks/tensor_parallel.py                     # about 10 minutes here
    .venv/bin/python benchmarks/tensor_parallel.py --model smollm2-135m --max-tokens 16 --out /tmp/tp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import benchmark_meta, default_out, save
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent


def rows_for(threads: int) -> list[dict[str, Any]]:
    half = max(1, threads // 2)
    return [
        {"row": f"tp1-t{threads}", "tp": 1, "threads": threads},
        {"row": f"tp2-t{half}", "tp": 2, "threads": half},
        {"row": f"tp1-t{half}", "tp": 1, "threads": half},
        {"row": "invariant-grouped", "tp": 1, "threads": threads, "deterministic": "batch-invariant"},
        {"row": "invariant-ungrouped", "tp": 1, "threads": threads, "deterministic": "batch-invariant",
         "ungrouped": True},
    ]


def run_row(job: dict[str, Any]) -> dict[str, Any]:
    from turbospec import LLM, SamplingParams

    llm = LLM(job["model"], weight_format="bf16", num_threads=job["threads"], tensor_parallel_size=job["tp"],
              deterministic=job.get("deterministic"), progress=False)
    if job.get("ungrouped"):  # the invariant path as it was: one product per linear
        for layer in llm.engine.loaded.model.layers:
            layer.attn.o.group_width = layer.mlp.down.group_width = 0
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    out: dict[str, Any] = {"row": job["row"]}
    start = time.perf_counter()
    for p in prompts[: job["single"]]:
        llm.generate([p], params, use_tqdm=False)
    out["single_tok_s"] = job["single"] * job["max_tokens"] / (time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate(prompts[:8], params, use_tqdm=False)
    out["batch8_tok_s"] = 8 * job["max_tokens"] / (time.perf_counter() - start)
    llm.engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--single", type=int, default=3, help="prompts decoded one at a time")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=default_out("tensor_parallel"))
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        job = json.loads(args.child.read_text())
        args.child.with_suffix(".out").write_text(json.dumps(run_row(job)))
        return

    from turbospec.data.prompts import load_mtbench
    from turbospec.models.loader import load_model

    tok = load_model(args.model, "bfloat16", progress=False, weight_format="bf16").tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}]) for p in load_mtbench(8)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for spec in tqdm(rows_for(args.threads), desc="rows"):
            job = {**spec, "model": args.model, "max_tokens": args.max_tokens, "single": args.single,
                   "prompts": prompts}
            path = Path(tmp) / f"{spec['row']}.json"
            path.write_text(json.dumps(job))
            subprocess.run([sys.executable, __file__, "--child", str(path)], check=True)
            rows.append({**spec, **json.loads(path.with_suffix(".out").read_text())})
    meta = benchmark_meta(args.threads, model=args.model, max_tokens=args.max_tokens,
                          load_average=os.getloadavg()[0])
    save(args.out, meta, rows, markdown(meta, rows))


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Tensor parallelism on {meta['machine']}", "",
             f"`{meta['command']}`, {meta['date']}, commit {meta['commit']}, torch {meta['torch']}. {meta['model']}, "
             f"dense bf16, greedy, {meta['max_tokens']} tokens per answer (EOS ignored), MT-Bench first turns with "
             "the chat template.", "",
             "| row | ranks x threads | deterministic | single stream tok/s | batch 8 tok/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['row']} | {r['tp']} x {r['threads']} | {r.get('deterministic') or '-'} | "
                     f"{r['single_tok_s']:.2f} | {r['batch8_tok_s']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
