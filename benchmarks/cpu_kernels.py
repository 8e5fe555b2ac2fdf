"""Micro-benchmarks behind two design choices (docs/ARCHITECTURE.md):
1. bf16 GEMV bandwidth (F.linear at 1 row) against a streaming read (tensor.sum()): why single-stream decode
   sits above the bandwidth bound.
2. Decode-shape attention: torch SDPA in bf16 and fp32 against the grouped-matmul path turbospec uses.
3. Gathering a context from the paged KV cache: advanced indexing against index_select.

    .venv/bin/python benchmarks/cpu_kernels.py [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import benchmark_meta, default_out, header_lines, save, table

from turbospec.attention_matmul import grouped_matmul_attention


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=str(default_out("cpu_kernels")))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    res: dict[str, float] = {}

    stream = torch.randn(256 * 2**20)  # 1 GiB float32
    res["stream_read_gb_s"] = stream.numel() * 4 / min(timed(stream.sum, 1) for _ in range(5)) / 1e9
    del stream
    w = torch.randn(8960, 1536).to(torch.bfloat16)
    x = torch.randn(1, 1536).to(torch.bfloat16)
    nbytes = w.numel() * 2
    res["bf16_linear_1row_gb_s"] = nbytes / timed(lambda: F.linear(x, w), 40) / 1e9
    res["bf16_mv_gb_s"] = nbytes / timed(lambda: torch.mv(w, x[0]), 40) / 1e9
    x16 = torch.randn(16, 1536).to(torch.bfloat16)
    res["bf16_linear_16rows_over_1row"] = timed(lambda: F.linear(x16, w), 40) / timed(lambda: F.linear(x, w), 40)

    b, hq, hkv, d, length = 16, 12, 2, 128, 200
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(b, hq, 1, d, dtype=dtype)
        k = torch.randn(b, hkv, length, d, dtype=dtype)
        v = torch.randn(b, hkv, length, d, dtype=dtype)
        mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
        name = str(dtype).removeprefix("torch.")
        res[f"decode_sdpa_{name}_ms"] = 1e3 * timed(
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), 50)
        res[f"decode_grouped_matmul_{name}_ms"] = 1e3 * timed(
            lambda: grouped_matmul_attention(q, k, v, mask, d**-0.5), 50)

    cache = torch.randn(100_000, 2, 128).to(torch.bfloat16)  # a layer's K slots
    slots = torch.randint(0, 100_000, (16, 250))
    res["kv_gather_advanced_index_ms"] = 1e3 * timed(lambda: cache[slots], 50)
    res["kv_gather_index_select_ms"] = 1e3 * timed(lambda: cache.index_select(0, slots.reshape(-1)), 50)

    meta = benchmark_meta(args.threads)
    lines = ["# CPU kernel micro-benchmarks", "", *header_lines(meta), "",
             *table(["measurement", "value"], [[k, f"{v:.2f}"] for k, v in res.items()])]
    save(Path(args.out), meta, [res], "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
