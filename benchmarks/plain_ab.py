"""Plain greedy decoding, turbospec against HF transformers, alternating in one process (A/B/A/B...), so that
machine noise between runs cannot decide the comparison. Tokens/s include prefill.

    .venv/bin/python benchmarks/plain_ab.py [--model qwen2.5-coder-1.5b --dtype bfloat16 --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from harness import alternating, benchmark_meta, default_out, header_lines, load_hf, save, table

from turbospec import LLM, SamplingParams
from turbospec.data.prompts import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("plain_ab")))
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, progress=False, max_model_len=1024,
              enable_prefix_caching=False)
    prompt, _ = load_prompts(1, "humaneval")
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt[0].text}])
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    hf = load_hf(args.model, args.dtype)
    x = torch.tensor([ids])

    def ours() -> float:
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return args.tokens / (time.perf_counter() - start)

    def theirs() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens,
                        min_new_tokens=args.tokens, do_sample=False)
        return args.tokens / (time.perf_counter() - start)

    engines = {"turbospec_tok_s": ours, "hf_tok_s": theirs}
    ours(), theirs()  # warm-up
    rounds = []
    for i in range(args.rounds):  # A/B, then B/A: neither always runs first
        rounds.append({key: engines[key]() for key in alternating(list(engines), i)})
        print(f"turbospec {rounds[-1]['turbospec_tok_s']:.2f} tok/s, HF {rounds[-1]['hf_tok_s']:.2f} tok/s", flush=True)
    meta = benchmark_meta(args.threads, model=args.model, dtype=args.dtype, prompt_tokens=len(ids),
                          new_tokens=args.tokens)
    lines = ["# Plain decoding A/B, alternating in one process", "", *header_lines(meta),
             f"- {args.model} {args.dtype}, one HumanEval prompt ({len(ids)} tokens), {args.tokens} new tokens "
             "(EOS ignored), greedy; tok/s include prefill", "",
             *table(["round", "turbospec tok/s", "HF tok/s", "ratio"],
                    [[i, f"{r['turbospec_tok_s']:.2f}", f"{r['hf_tok_s']:.2f}",
                      f"{r['turbospec_tok_s'] / r['hf_tok_s']:.2f}"] for i, r in enumerate(rounds)])]
    save(Path(args.out), meta, rounds, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
