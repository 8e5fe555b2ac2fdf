"""Our bf16 matmul (turbospec/kernels/bf16_rows.cpp) against torch's, first alone on qwen2.5-coder-1.5b's shapes,
then in the engine: the same model with it and without it (TURBOSPEC_NO_BF16_ROWS=1), each mode in its own
process (the switch is read once per process), the modes alternating round by round. On a CPU with AVX512_BF16 a
third mode runs our AVX2 path instead of the `vdpbf16ps` one (TURBOSPEC_NO_DPBF16=1), and the operator table gets
its column too.

Per mode and HumanEval prompt (chat template, prompt pre-filled in a code fence, greedy): the prefill (ms, a
one-token generation), then plain decoding and our EAGLE head at fixed tree sizes, in turn (tok/s including
prefill, as benchmarks/proposer_zoo.py counts them), and, with our kernel only, the goodput controller choosing
the tree size (without it the controller's first profile alone takes ~10 minutes of slow bf16 prefills).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bf16_rows.py [--prompts 3 --tokens 96 --rounds 1 --out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import alternating, benchmark_meta, default_out, header_lines, save

MODEL = "qwen2.5-coder-1.5b"
SHAPES = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]  # qkv, o, gate|up, down, head
ROWS = (1, 2, 4, 5, 9, 16, 64, 256)
TREES = (4, 8)  # EAGLE tree nodes in the fixed rows


def operator_rows(dpbf16: bool) -> list[dict[str, Any]]:
    """ours vs torch per shape and row count: the fastest of several calls, taking turns."""
    from turbospec import kernels
    from turbospec.host import best_ms

    if kernels.load() is None or not torch.ops.turbospec.bf16_rows_available():
        raise SystemExit(f"our bf16 kernel cannot run here: {kernels.failure() or 'no AVX2 + FMA'}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        for m in ROWS:
            if n * m > 151936 * 16:  # the head at prefill sizes: seconds per call, not a call the engine makes
                continue
            x = torch.randn(m, k, generator=gen).bfloat16()
            fns = [lambda: kernels.bf16_rows_mm(x, w), lambda: F.linear(x, w)]
            if dpbf16:
                fns.append(lambda: kernels.bf16_rows_mm(x, w, widened=True))
            ours, theirs, *avx2 = best_ms(tuple(fns), 3)
            rows.append({"shape": f"{n}x{k}", "rows": m, "ours_ms": ours, "torch_ms": theirs,
                         **({"ours_avx2_ms": avx2[0]} if avx2 else {})})
            print(f"{n}x{k} rows {m}: ours {ours:.2f} ms, torch {theirs:.2f} ms"
                  + (f", our AVX2 path {avx2[0]:.2f} ms" if avx2 else ""), flush=True)
    return rows


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One mode, in this process: the engine's prefill, plain and EAGLE rows on the same prompts, in turn."""
    from turbospec import LLM, SamplingParams
    from turbospec.tuning import set_speculation
    from turbospec.bench.humaneval import answer_prefix, chat_messages, load_humaneval

    ours = os.environ.get("TURBOSPEC_NO_BF16_ROWS") != "1"
    mode = "torch" if not ours else "ours (AVX2 path)" if os.environ.get("TURBOSPEC_NO_DPBF16") else "ours"
    llm = LLM(MODEL, dtype="bfloat16", weight_format="bf16", num_threads=args.threads, max_model_len=1024,
              progress=False, enable_prefix_caching=False,
              speculative_config={"method": "eagle", "num_speculative_tokens": max(TREES)})
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(chat_messages(t)) + tok.encode(answer_prefix(t), add_special_tokens=False)
               for t in load_humaneval(args.prompts)]
    # the controller on the default path only: another path needs a step-time profile of its own (minutes)
    variants: list[int | str] = [0, *TREES] + (["auto"] if mode == "ours" else [])
    engine = llm.engine
    engine.set_speculation(0)
    llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    if mode == "ours":  # the controller's step-time profile (cached per machine) before anything is timed
        set_speculation(engine, "auto")
        llm.generate({"prompt_token_ids": prompts[0][:16]}, SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.tokens)
    result: dict[str, Any] = {"mode": mode, "prefill_ms": [], "prompt_tokens": [],
                              "variants": {str(v): {"tokens": 0, "seconds": 0.0, "accepted": 0.0, "outputs": []}
                                           for v in variants}}
    for i, ids in enumerate(prompts):
        engine.set_speculation(0)
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        result["prefill_ms"].append((time.perf_counter() - start) * 1e3)
        result["prompt_tokens"].append(len(ids))
        for v in alternating(variants, i):
            engine.set_speculation(v)
            engine.reset_spec_stats()
            start = time.perf_counter()
            out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
            row = result["variants"][str(v)]
            row["seconds"] += time.perf_counter() - start
            row["tokens"] += len(out)
            row["accepted"] += llm.spec_stats().get("mean_accepted_length") or 0.0
            row["outputs"].append(list(out))
        print(f"{result['mode']} prompt {i}: " + ", ".join(
            f"{v} {r['tokens'] / r['seconds']:.2f} tok/s" for v, r in result["variants"].items()), file=sys.stderr,
            flush=True)
    return result


def markdown(meta: dict[str, Any], ops: list[dict[str, Any]], runs: list[dict[str, Any]]) -> str:

    lines = ["# Our bf16 matmul (kernels/bf16_rows.cpp) against torch's", "",
             *header_lines(meta), "",
             "## The operator alone (fastest of 3 calls, ms)", "",
             "| shape (out x in) | " + " | ".join(f"{m} rows" for m in ROWS) + " |",
             "|---|" + "---|" * len(ROWS)]
    for shape in dict.fromkeys(r["shape"] for r in ops):
        cells = {r["rows"]: r for r in ops if r["shape"] == shape}
        lines.append(f"| {shape} | " + " | ".join(
            f"{cells[m]['ours_ms']:.2f} vs {cells[m]['torch_ms']:.2f}"
        + (f" ({cells[m]['ours_avx2_ms']:.2f})" if "ours_avx2_ms" in cells[m] else "") if m in cells else "-"
        for m in ROWS) + " |")
    avx2 = any("ours_avx2_ms" in r for r in ops)
    lines += ["", "(ours vs torch" + (", and in brackets our AVX2 path: this CPU has AVX512_BF16, so ours is the "
              "`vdpbf16ps` path)" if avx2 else ")"), "",
              f"## The engine: {MODEL}, bf16, HumanEval, greedy, batch 1, at most "
              f"{meta['tokens']} tokens, first {meta['prompts']} prompts", "",
              "| round | matmul | prefill ms (mean) | plain tok/s | " + " | ".join(
                  f"EAGLE {k} nodes tok/s (x plain, tau)" for k in TREES) + " | EAGLE auto tok/s (x plain, tau) |",
              "|---|---|---|---|" + "---|" * (len(TREES) + 1)]
    for run in runs:
        v = run["variants"]
        plain = v["0"]["tokens"] / v["0"]["seconds"]
        cells = []
        for key in [*map(str, TREES), "auto"]:
            if key not in v:
                cells.append("not run")
                continue
            rate = v[key]["tokens"] / v[key]["seconds"]
            cells.append(f"{rate:.2f} ({rate / plain:.2f}x, {v[key]['accepted'] / meta['prompts']:.2f})")
        lines.append(f"| {run['round']} | {run['mode']} | {sum(run['prefill_ms']) / len(run['prefill_ms']):.0f} | "
                     f"{plain:.2f} | " + " | ".join(cells) + " |")
    same = all(r["variants"][k]["outputs"] == r["variants"]["0"]["outputs"] for r in runs for k in r["variants"])
    lines += ["", f"Every row's greedy output equal to plain decoding's: {same}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("bf16_rows")))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return

    torch.set_num_threads(args.threads)
    from turbospec import kernels

    dpbf16 = kernels.bf16_rows_path() == "dpbf16"
    ops = operator_rows(dpbf16)
    runs = []
    for round_ in range(args.rounds):
        modes = ("ours", "torch") + (("avx2",) if dpbf16 else ())
        for mode in alternating(modes, round_):
            env = {**os.environ, "TURBOSPEC_NO_BF16_ROWS": "1" if mode == "torch" else "0"}
            env.pop("TURBOSPEC_NO_DPBF16", None)
            if mode == "avx2":
                env["TURBOSPEC_NO_DPBF16"] = "1"
            cmd = [sys.executable, __file__, "--worker", "--prompts", str(args.prompts), "--tokens", str(args.tokens),
                   "--threads", str(args.threads)]
            proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            runs.append({"round": round_, **json.loads(line.removeprefix("RESULT "))})
    meta = benchmark_meta(args.threads, model=MODEL, prompts=args.prompts, tokens=args.tokens)
    save(Path(args.out), meta, [{"operator": ops}, *runs], markdown(meta, ops, runs))


if __name__ == "__main__":
    main()
