"""One sequence's short-query attention: torch's SDPA against our grouped matmuls, the operator alone and in the
engine (turbospec/attention_choice.py measures the choice per machine; this shows what it buys).

1. The operator, each model's head shape: median ms of SDPA and of the matmuls per query count and context length.
2. Engine steps, one request of random tokens at a few context lengths: decodes (k = 0) and verifications of an
   EAGLE tree, SDPA forced (TURBOSPEC_ATTENTION=sdpa) and the measured choice taking turns round by round.
3. Plain greedy decoding end to end (MT-Bench first turns, HumanEval), each prompt four times (A B B A); how many
   greedy outputs came out the same (the kernels round differently in bf16).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/attention_paths.py [--prompts 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from int8_kernel_ab import median_ms  # (benchmarks/: the script's directory)
from tqdm import tqdm
from harness import alternating, benchmark_meta, default_out, header_lines, save

from turbospec import LLM, SamplingParams, attention_choice
from turbospec.attention_matmul import grouped_matmul_attention
from turbospec.models.model_config import ModelConfig
from turbospec.models.registry import pull

QUERIES = (1, 2, 4, 9, 16)
CONTEXTS = (128, 320, 1000)  # the operator's
STEP_CONTEXTS = (128, 512, 1500)  # the engine steps'
OPERATOR_CALLS = 40

VARIANTS = ("sdpa", "measured")


def operator_rows(model: str, mc: ModelConfig) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    hq, hkv, d = mc.num_heads, mc.num_kv_heads, mc.head_dim
    for length in CONTEXTS:
        for nq in QUERIES:
            q = torch.randn(1, hq, nq, d, generator=gen).to(torch.bfloat16)
            k = torch.randn(1, hkv, length, d, generator=gen).to(torch.bfloat16)
            v = torch.randn(1, hkv, length, d, generator=gen).to(torch.bfloat16)
            mask = torch.ones(1, 1, nq, length, dtype=torch.bool)
            sdpa = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5,
                                                                    enable_gqa=hkv != hq), OPERATOR_CALLS)
            matmul = median_ms(lambda: grouped_matmul_attention(q, k, v, mask, d**-0.5), OPERATOR_CALLS)
            rows.append({"kind": "operator", "model": model, "shape": f"{hq}x{hkv}x{d}", "queries": nq,
                         "context": length, "sdpa_ms": sdpa, "matmul_ms": matmul})
    return rows


def _use(variant: str) -> None:
    os.environ[attention_choice.OVERRIDE] = "sdpa" if variant == "sdpa" else ""
    attention_choice.forget()


def step_rows(args: argparse.Namespace, model: str, llm: LLM) -> list[dict[str, Any]]:
    """Median engine step of one request at each context, decoding (k = 0) and verifying a tree of
    `args.tree_nodes` drafts, the variants taking turns round by round."""
    engine = llm.engine
    rng = random.Random(0)
    rows = []
    for context in STEP_CONTEXTS:
        ids = [rng.randrange(100, engine.model_config.vocab_size) for _ in range(context)]
        rid = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=2048 - context - 1, ignore_eos=True))
        while engine.requests[rid].is_prefilling or engine.requests[rid].num_computed_tokens == 0:
            engine.step()
        times: dict[tuple[str, int], list[float]] = {(v, k): [] for v in VARIANTS for k in (0, args.tree_nodes)}
        for round_ in tqdm(range(args.rounds), desc=f"{model} steps at {context} tokens", unit="round"):
            for variant, k in alternating(list(times), round_):
                _use(variant)
                engine.set_speculation(k)
                engine.step()  # unrecorded: the first step at a new k or kernel
                for _ in range(args.steps):
                    start = time.perf_counter()
                    engine.step()
                    times[(variant, k)].append(time.perf_counter() - start)
        engine.abort_request(rid)
        for k in (0, args.tree_nodes):
            rows.append({"kind": "step", "model": model, "context": context, "k": k,
                         "sdpa_ms": statistics.median(times[("sdpa", k)]) * 1e3,
                         "measured_ms": statistics.median(times[("measured", k)]) * 1e3,
                         "steps": len(times[("sdpa", k)])})
    return rows


def generate_rows(args: argparse.Namespace, model: str, llm: LLM) -> list[dict[str, Any]]:
    """Plain decoding end to end, each prompt run four times: A B B A, the variants' order alternating by prompt.
    Every run generates max_tokens (EOS ignored), so the variants time the same work even where bf16 rounding
    makes their greedy tokens part."""
    from proposer_zoo import datasets

    data = datasets(model, args.prompts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for name, prompts in data.items():
        seconds, tokens = dict.fromkeys(VARIANTS, 0.0), dict.fromkeys(VARIANTS, 0)
        outputs: dict[str, list[list[int]]] = {v: [] for v in VARIANTS}
        for i, ids in enumerate(tqdm(prompts, desc=f"{model} plain {name}", unit="prompt")):
            first, second = alternating(VARIANTS, i)
            for turn, variant in enumerate((first, second, second, first)):
                _use(variant)
                start = time.perf_counter()
                out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
                seconds[variant] += time.perf_counter() - start
                tokens[variant] += len(out)
                if turn < 2:
                    outputs[variant].append(out)
        rows.append({"kind": "generate", "model": model, "set": name, "prompts": len(prompts),
                     **{f"{v}_tok_s": tokens[v] / seconds[v] for v in VARIANTS},
                     "same_outputs": sum(a == b for a, b in zip(*outputs.values()))})
    return rows


def model_rows(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    """The operator at this model's head shape, its engine's steps, and plain decoding end to end."""
    llm = LLM(model, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, max_model_len=2048,
              speculative_config={"method": args.spec_row, "num_speculative_tokens": args.tree_nodes},
              progress=False, enable_prefix_caching=False)
    mc = llm.engine.model_config
    rows = operator_rows(model, mc)
    llm.generate("hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    rows += step_rows(args, model, llm)
    del llm
    plain = LLM(model, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, max_model_len=2048,
                progress=False, enable_prefix_caching=False)
    plain.generate("hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    rows += generate_rows(args, model, plain)
    _use("measured")
    chosen = attention_choice.choice_summary(mc.num_heads, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
    os.environ.pop(attention_choice.OVERRIDE, None)
    return [{**r, "matmul_where": chosen} for r in rows]


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# One sequence's short-query attention: SDPA against our grouped matmuls", "", *header_lines(meta),
             f"- bf16, {meta['threads']} threads; operator: median of 40 calls, one sequence, every key visible; "
             f"steps: {meta['spec_row']} engine, verifications of {meta['tree_nodes']} tree nodes (k), "
             f"{meta['rounds']} rounds of {meta['steps']} steps per variant and k; end to end: greedy, batch 1, at "
             f"{meta['max_tokens']} tokens (EOS ignored), the first {meta['prompts']} MT-Bench first turns and "
             f"HumanEval tasks (as benchmarks/proposer_zoo.py builds them), each run A B B A; SDPA forced and the "
             f"measured choice taking turns",
             "", "## The operator (ms)", "", "| model (q x kv heads x dim) | context | "
             + " | ".join(f"{q} queries: SDPA / matmuls" for q in QUERIES) + " |",
             "|---|---|" + "---|" * len(QUERIES)]
    ops = [r for r in rows if r["kind"] == "operator"]
    for model in dict.fromkeys(r["model"] for r in ops):
        for length in CONTEXTS:
            cells = [f"{r['sdpa_ms']:.3f} / {r['matmul_ms']:.3f}" for r in ops
                     if r["model"] == model and r["context"] == length]
            shape = next(r["shape"] for r in ops if r["model"] == model)
            lines.append(f"| {model} ({shape}) | {length} | " + " | ".join(cells) + " |")
    lines += ["", "## Engine steps, one request (median ms)", "",
              "| model | context | k | SDPA | measured choice | saved | steps each |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "step"):
        lines.append(f"| {r['model']} | {r['context']} | {r['k']} | {r['sdpa_ms']:.1f} | {r['measured_ms']:.1f} | "
                     f"{r['sdpa_ms'] / r['measured_ms']:.2f}x | {r['steps']} |")
    lines += ["", "## Plain decoding end to end (tok/s)", "",
              "| model | set | prompts | SDPA | measured choice | speedup | same greedy outputs |",
              "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["kind"] == "generate"):
        lines.append(f"| {r['model']} | {r['set']} | {r['prompts']} | {r['sdpa_tok_s']:.2f} | "
                     f"{r['measured_tok_s']:.2f} | {r['measured_tok_s'] / r['sdpa_tok_s']:.2f}x | "
                     f"{r['same_outputs']} of {r['prompts']} |")
    lines.append("")
    for model in dict.fromkeys(r["model"] for r in rows):
        where = next(r["matmul_where"] for r in rows if r["model"] == model)
        lines.append(f"- {model}: the measured choice runs the matmuls at (context: query counts) {where}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-1.5b")
    ap.add_argument("--spec-row", default="eagle", help="the speculative row measured beside plain")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree-nodes", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("attention_paths")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows: list[dict[str, Any]] = []
    for model in args.models.split(","):
        pull(model)
        rows += model_rows(args, model)
    meta = benchmark_meta(args.threads, prompts=args.prompts, max_tokens=args.max_tokens, tree_nodes=args.tree_nodes,
                          spec_row=args.spec_row, rounds=args.rounds, steps=args.steps)
    save(Path(args.out), meta, rows, markdown(meta, rows))


if __name__ == "__main__":
    main()
