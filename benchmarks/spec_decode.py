"""Spec-Bench style single-stream speculative decoding benchmark, turbospec beside HF transformers.

Batch 1, greedy, chat template, on the first MT-Bench turns and on HumanEval prompts (subsets: the
counts are in the output). Each row reports the following, all from one run:
- tokens/s: generated tokens over wall time, prefill included;
- the speedup over plain decoding of the same engine;
- tau, the tokens emitted per verification step;
- the acceptance at each draft position;
- the share of prompts whose output equals plain decoding.

    .venv/bin/python benchmarks/spec_decode.py                     # full run (about 25 min here)
    .venv/bin/python benchmarks/spec_decode.py --humaneval 1 --mtbench 1 --max-tokens 8 --ks 2 --skip-hf
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

from harness import benchmark_meta, default_out, header_lines, hf_run_set, load_hf, run_sets, save, stats, warm_up

from turbospec import LLM, SamplingParams
from turbospec.data.prompts import BenchPrompt, load_mtbench, load_prompts
from turbospec.models.registry import gguf_path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_turbospec(args: argparse.Namespace, name: str, spec: dict[str, Any] | None,
                  datasets: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    llm = LLM(args.target, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len,
              speculative_config=spec, progress=False, enable_prefix_caching=False)
    warm_up(llm, datasets[next(iter(datasets))][0])
    sets = run_sets({name: llm}, datasets, SamplingParams(temperature=0, max_tokens=args.max_tokens))[name]
    rows = [{"engine": "turbospec", "method": name, "dataset": dataset, "tokens": s["tokens"], "seconds": s["seconds"],
             "tok_s": stats.tok_s(s["tokens"], s["seconds"]), "tau": s["tau"] or 1.0,  # plain: one token a step
             "acceptance_by_position": s["acceptance_by_position"], "outputs": s["outputs"]}
            for dataset, s in sets.items()]
    del llm
    gc.collect()
    return rows


def run_hf(args: argparse.Namespace, datasets: dict[str, list[list[int]]]) -> list[dict[str, Any]]:
    log("loading HF target and draft")
    target, draft = load_hf(args.target, args.dtype), load_hf(args.draft, args.dtype)
    variants = {"plain": {}, f"assisted ({args.draft})": {"assistant_model": draft},
                f"prompt lookup k={args.hf_pld_k}": {"prompt_lookup_num_tokens": args.hf_pld_k}}
    eos = [gguf_eos(args.target)]
    rows = []
    for name, extra in variants.items():
        for dataset, prompts in datasets.items():
            s = hf_run_set(target, prompts, args.max_tokens, eos, desc=f"HF {name} {dataset}", **extra)
            rows.append({"engine": "hf", "method": name, "dataset": dataset, "tokens": s["tokens"],
                         "seconds": s["seconds"], "tok_s": stats.tok_s(s["tokens"], s["seconds"]),
                         "outputs": s["outputs"]})
    del target, draft
    gc.collect()
    return rows


def gguf_eos(name: str) -> int:
    from turbospec.models.loader import load_model  # noqa: F401  (cheap path below avoids loading weights)
    import gguf

    reader = gguf.GGUFReader(str(gguf_path(name)))
    return int(reader.fields["tokenizer.ggml.eos_token_id"].contents())


def chat_ids(target: str, prompts: list[BenchPrompt]) -> list[list[int]]:
    from turbospec.models.loader import load_model

    tok = load_model(target, "bfloat16", progress=False).tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": p.text}]) for p in prompts]


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in rows:
        plain = next(p for p in rows if p["engine"] == r["engine"] and p["method"] == "plain" and p["dataset"] == r["dataset"])
        r["speedup"] = r["tok_s"] / plain["tok_s"]
        r["matches_plain"] = stats.matches(r["outputs"], plain["outputs"])
    return rows


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Speculative decoding, single stream (Spec-Bench protocol)", "",
        *header_lines(meta),
        f"- target `{meta['target']}` {meta['dtype']}, draft `{meta['draft']}`; greedy, chat template, "
        f"max {meta['max_tokens']} new tokens; {meta['counts']}", "",
        "| dataset | engine | method | tok/s | speedup | tau | acceptance by position | = plain |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = " ".join(f"{a:.2f}" for a in r.get("acceptance_by_position", [])) or "-"
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        lines.append(f"| {r['dataset']} | {r['engine']} | {r['method']} | {r['tok_s']:.2f} | {r['speedup']:.2f}x | "
                     f"{tau} | {acc} | {r['matches_plain']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--humaneval", type=int, default=5, help="HumanEval prompts (first N)")
    ap.add_argument("--mtbench", type=int, default=5, help="MT-Bench first turns (first N questions)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hf-pld-k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=str(default_out("spec_decode")))
    args = ap.parse_args()

    humaneval, _ = load_prompts(args.humaneval, "humaneval")
    datasets = {"humaneval": chat_ids(args.target, humaneval),
                "mtbench": chat_ids(args.target, load_mtbench(args.mtbench))}
    configs: list[tuple[str, dict[str, Any] | None]] = [("plain", None)]
    configs += [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3}) for k in args.ks]
    configs += [(f"draft k={k}", {"method": "draft", "model": args.draft, "num_speculative_tokens": k}) for k in args.ks]
    rows: list[dict[str, Any]] = []
    for name, spec in configs:
        log(f"turbospec {name}")
        rows += run_turbospec(args, name, spec, datasets)
    if not args.skip_hf:
        rows += run_hf(args, datasets)
    rows = summarise(rows)
    meta = benchmark_meta(args.threads, target=args.target, draft=args.draft, dtype=args.dtype,
                          max_tokens=args.max_tokens,
                          counts=f"{args.humaneval} HumanEval prompts, {args.mtbench} MT-Bench first turns")
    save(Path(args.out), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
