"""Our short-query attention kernel (turbospec/kernels/short_attention.cpp) against an earlier version of it.

Every decode and verification step runs it once per layer. Each variant is built from its own source and measured
in its own process, rounds alternating (harness/kernel_ab.py):
- the operator alone at two models' head shapes (qwen2.5-coder-1.5b: 12 query heads on 2 KV heads of 128;
  smollm2-135m: 9 on 3 of 64), for 1, 5, 9 and 16 queries (a decode, verifications of k = 4, 8 and 15) over 128,
  512 and 1500 keys, each call on its own layer's cache (as many as the model has layers, so the keys come from
  memory as in a step): median ms per call;
- plain greedy decode steps of the engine at 200 and 1500 tokens of context.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/attention_kernel_ab.py [--baseline REV] [--rounds 3]
"""

from __future__ import annotations

import math
import random
from pathlib import Path

from harness import kernel_ab
from harness.kernel_ab import use_source
from int8_kernel_ab import median_ms

SOURCE = Path("turbospec/kernels/short_attention.cpp")
SHAPES = {"qwen2.5-coder-1.5b": (12, 2, 128, 28), "smollm2-135m": (9, 3, 64, 30)}  # q heads, kv heads, dim, layers
QUERIES = (1, 5, 9, 16)
CONTEXTS = (128, 512, 1500)
STEP_CONTEXTS = (200, 1500)
MODEL = "qwen2.5-coder-1.5b"


def worker(source: str, threads: int, steps: int) -> dict:
    """One variant, in this process: build it from `source`, time the operator and the engine's decode steps."""
    import torch

    torch.set_num_threads(threads)
    use_source(source)  # this variant's attention source with the current other kernels
    op = torch.ops.turbospec.short_query_attention
    gen = torch.Generator().manual_seed(0)
    timings: dict[str, float] = {}
    for model, (q_heads, kv_heads, dim, layers) in SHAPES.items():
        slots_total = max(CONTEXTS)
        caches = [(torch.randn(slots_total, kv_heads, dim, generator=gen).bfloat16(),
                   torch.randn(slots_total, kv_heads, dim, generator=gen).bfloat16()) for _ in range(layers)]
        for length in CONTEXTS:
            slots = torch.arange(length).view(1, length)
            for num_q in QUERIES:
                q = torch.randn(1, num_q, q_heads, dim, generator=gen).bfloat16()
                mask = torch.ones(num_q, length, dtype=torch.bool).tril(length - num_q).view(1, num_q, length)

                def all_layers() -> None:
                    for k, v in caches:
                        op(q, k, v, slots, mask, 1 / math.sqrt(dim))

                per_call = median_ms(all_layers, 7) / layers
                timings[f"{model} shape, {num_q} queries x {length} keys (per call)"] = per_call

    from turbospec.bench.timing import decode_step_ms
    from turbospec.config import EngineConfig
    from turbospec.tuning import build_engine

    engine = build_engine(EngineConfig(MODEL, num_threads=threads), progress=False)
    decode = {f"{MODEL} plain decode step at {n} tokens (engine)": decode_step_ms(engine, [n], random.Random(0), steps)
              for n in STEP_CONTEXTS}
    return {"op_ms": timings, "decode_step_ms": decode}


def main() -> None:
    kernel_ab.main(__file__, SOURCE, worker, "Short-query attention kernel: A/B against an earlier version, alternating "
                   "processes", "d311f63", "attention_kernel_ab", MODEL,
                   ("- bf16 caches; causal masks over the last queries; the operator times are per call (one layer)",))


if __name__ == "__main__":
    main()
