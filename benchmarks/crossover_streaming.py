"""Packed or dense per linear: the crossover measured with the weights in cache against read from memory.

Each packed linear runs packed for calls of up to its crossover rows and dense above (models/crossover.py). The
crossover used to be timed on one weight, which stayed in the last-level cache after the first call; it is now
timed over copies of the weight adding up to more than the cache (host.past_the_cache), as a model's step reads
them. For each model this loads the engine once, measures both crossovers for every packed signature (in cache:
a pool of one copy), then alternates them on the same engine (A/B, then B/A):
- the linear products of one step at R rows (every decoder linear called once, as a forward at R tokens does);
- plain greedy decoding: ms per token after the first (64 new tokens, EOS ignored, minus a one-token run's time).

A third variant, `--crossover-file`, runs the crossovers of a cache file measured before (its entries are copied
into the result): what a machine that measured in cache kept, where a near tie went the other way (on the Zen 4
here, the 0.5B's Q5_0 gate|up: 0.144 ms packed against 0.138 ms bf16 at one row, so dense at every count).

    .venv/bin/python benchmarks/crossover_streaming.py
    .venv/bin/python benchmarks/crossover_streaming.py --crossover-file ~/.cache/turbospec/kernels/crossover-...json
    .venv/bin/python benchmarks/crossover_streaming.py --models smollm2-135m --tokens 8 --rounds 1 \\
        --out /tmp/cs_test                                                            # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness import alternating, benchmark_meta, default_out, header_lines, save, table

import turbospec.host
from turbospec import LLM, SamplingParams
from turbospec.data.prompts import load_prompts
from turbospec.models.crossover import crossover_rows, measure

VARIANTS = ("in_cache", "streamed")


def packed_linears(net: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in net.modules()
            if getattr(m, "packed", None) is not None and getattr(m, "weight", None) is not None]


def crossovers(modules: list[torch.nn.Module], earlier: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    """variant -> signature -> crossover rows: in cache and streamed measured now, "file" from an earlier cache."""
    out: dict[str, dict[str, int]] = {v: {} for v in VARIANTS}
    if earlier is not None:
        out["file"] = {m.packed.signature: int(earlier[m.packed.signature]["rows"]) for m in modules}
    default_pool = turbospec.host.STREAM_POOL_BYTES
    for m in modules:
        sig = m.packed.signature
        if sig in out["streamed"]:
            continue
        for variant in VARIANTS:
            turbospec.host.STREAM_POOL_BYTES = 0 if variant == "in_cache" else default_pool  # 0: one copy
            out[variant][sig] = crossover_rows(measure(m.packed, m.weight.data))
    turbospec.host.STREAM_POOL_BYTES = default_pool
    return out


def use(net: torch.nn.Module, modules: list[torch.nn.Module], rows: dict[str, int]) -> None:
    for m in modules:
        m.packed.max_rows = rows[m.packed.signature]
    net._fused = None  # the layers' compiled calls are built again: they keep which row counts run packed


def linears_ms(modules: list[torch.nn.Module], row_counts: list[int], repeats: int = 5) -> dict[int, float]:
    """rows -> ms of calling every linear once with that many rows (the best of `repeats`)."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    with torch.inference_mode():
        for rows in row_counts:
            xs = {m.weight.shape[1]: torch.randn(rows, m.weight.shape[1], generator=gen).bfloat16() for m in modules}
            best = float("inf")
            for _ in range(repeats + 1):
                start = time.perf_counter()
                for m in modules:
                    m(xs[m.weight.shape[1]])
                best = min(best, time.perf_counter() - start)
            out[rows] = best * 1e3
    return out


def decode_ms(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Median over the prompts of (time for 1 + tokens new tokens - time for 1) / tokens, in ms."""
    def run(ids: list[int], n: int) -> float:
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                     use_tqdm=False)
        return time.perf_counter() - start

    return statistics.median((run(ids, tokens + 1) - run(ids, 1)) / tokens * 1e3 for ids in prompts)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(name, dtype="bfloat16", num_threads=args.threads, progress=False, max_model_len=1024,
              enable_prefix_caching=False)
    net = llm.engine.loaded.model
    modules = packed_linears(net)
    rows = crossovers(modules, args.earlier)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True)
               for p in load_prompts(args.prompts, "humaneval")[0]]
    decode_ms(llm, prompts[:1], 4)  # warm-up
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        for variant in alternating(list(rows), i):
            use(net, modules, rows[variant])
            rounds.append({"round": i, "variant": variant, "linears_ms": linears_ms(modules, args.rows),
                           "decode_ms": decode_ms(llm, prompts, args.tokens)})
            print(f"{name} round {i} {variant}: decode {rounds[-1]['decode_ms']:.1f} ms/token, linears "
                  + ", ".join(f"{r} rows {ms:.2f} ms" for r, ms in rounds[-1]["linears_ms"].items()), flush=True)
    use(net, modules, rows["streamed"])
    del llm
    return {"model": name, "crossover": rows, "rounds": rounds}


def summary(result: dict[str, Any], rows: list[int]) -> list[list[Any]]:
    out = []
    for variant in result["crossover"]:
        mine = [r for r in result["rounds"] if r["variant"] == variant]
        rows_ms = [statistics.median(r["linears_ms"][n] for r in mine) for n in rows]
        crossover = sorted(set(result["crossover"][variant].values()))
        name = "earlier file" if variant == "file" else variant.replace("_", " ")
        out.append([result["model"], name, ", ".join(map(str, crossover)),
                    f"{statistics.median(r['decode_ms'] for r in mine):.1f}", *(f"{ms:.2f}" for ms in rows_ms)])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rows", default="1,5,9,16", help="row counts of the linears' timing, comma list")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--crossover-file", help="a crossover cache measured before: its rows as a third variant")
    ap.add_argument("--out", default=str(default_out("crossover_streaming")))
    args = ap.parse_args()
    args.earlier = json.loads(Path(args.crossover_file).expanduser().read_text()) if args.crossover_file else None
    args.rows = [int(r) for r in args.rows.split(",")]
    results = [bench_model(name, args) for name in args.models.split(",")]
    meta = benchmark_meta(args.threads, models=args.models, tokens=args.tokens, prompts=args.prompts,
                          rounds=args.rounds, rows=args.rows,
                          earlier_file={"path": args.crossover_file, "entries": args.earlier} if args.earlier else None)
    lines = ["# Crossover timed in cache or with the weights read from memory", "", *header_lines(meta),
             f"- {args.prompts} HumanEval prompts (chat template), greedy, {args.tokens} new tokens (EOS ignored); "
             f"{args.rounds} rounds per variant, alternating on one engine per model; medians over rounds",
             "- crossover: the row counts up to which the model's packed linears run packed (one per signature)",
             "- linears at R rows: every decoder linear called once with R rows (the weights of a step)",
             *([f"- earlier file: the crossovers of `{args.crossover_file}` (in the JSON's meta), measured in cache "
                "before this change"] if args.earlier else []),
             "- the LM head keeps the crossover the engine loaded with (streamed) in every variant", "",
             *table(["model", "crossover timed", "packed up to rows", "decode ms/token",
                     *(f"linears at {r} rows (ms)" for r in args.rows)],
                    [row for r in results for row in summary(r, args.rows)])]
    save(Path(args.out), meta, results, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
