"""Plain greedy decoding, turbospec against HF transformers, alternating in one process (A/B/A/B...), so that
machine noise between runs cannot decide the comparison. Tokens/s include prefill.

    .venv/bin/python benchmarks/plain_ab.py [--model qwen2.5-coder-1.5b --dtype bfloat16 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from turbospec import LLM, SamplingParams
from turbospec.data.prompts import load_prompts
from turbospec.models.registry import gguf_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default="benchmarks/results/plain_ab")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, progress=False, max_model_len=1024,
              enable_prefix_caching=False)
    prompt, _ = load_prompts(1, "humaneval")
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": prompt[0].text}])
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    path = gguf_path(args.model)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, args.dtype))
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

    ours(), theirs()  # warm-up
    rounds = [{"turbospec_tok_s": ours(), "hf_tok_s": theirs()} for _ in range(args.rounds)]
    for r in rounds:
        print(f"turbospec {r['turbospec_tok_s']:.2f} tok/s, HF {r['hf_tok_s']:.2f} tok/s", flush=True)
    meta = {"command": f"benchmarks/plain_ab.py --model {args.model} --dtype {args.dtype}", "threads": args.threads,
            "prompt_tokens": len(ids), "new_tokens": args.tokens, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rounds": rounds}, indent=1))
    lines = ["# Plain decoding A/B, alternating in one process", "", f"- {meta}", "",
             "| round | turbospec tok/s | HF tok/s | ratio |", "|---|---|---|---|"]
    lines += [f"| {i} | {r['turbospec_tok_s']:.2f} | {r['hf_tok_s']:.2f} | {r['turbospec_tok_s'] / r['hf_tok_s']:.2f} |"
              for i, r in enumerate(rounds)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
