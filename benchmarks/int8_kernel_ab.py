"""Our grouped int8 kernel (turbospec/kernels/grouped_int8.cpp) against an earlier version of it, alternating.

The int8 parts of qwen2.5-coder-1.5b's Q4_K_M file (its Q6_K LM head, down and v projections) run in this
kernel on every decode step. Each variant is built from its own source and measured in its own process (two
builds register the same torch operator, so they cannot share one), A/B/A/B..., so that machine drift between
rounds cannot decide the comparison:
- the operator alone, on the model's int8 shapes, for 1 to 8 activation rows (median of repeated calls);
- a plain greedy decode step of the engine (auto weight format: int4 and int8 packed, bf16 for many rows).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/int8_kernel_ab.py [--baseline REV] [--rounds 3]
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from harness import kernel_ab
from harness.kernel_ab import use_source

SOURCE = Path("turbospec/kernels/grouped_int8.cpp")
SHAPES = [(151936, 1536), (1536, 8960), (256, 1536)]  # LM head, down projection, a v projection's int8 rows
ROWS = (1, 2, 4, 5, 8)
MODEL = "qwen2.5-coder-1.5b"


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def worker(source: str, threads: int, steps: int) -> dict:
    """One variant, in this process: build it from `source`, time the operator and the engine's decode step."""
    import torch

    from turbospec import kernels

    torch.set_num_threads(threads)
    use_source(source)  # this variant's int8 source with the current other kernels

    gen = torch.Generator().manual_seed(0)
    op: dict[str, float] = {}
    for n, k in SHAPES:
        q = torch.randint(-32, 32, (n, k), dtype=torch.int8, generator=gen)
        scale = torch.rand(n, k // kernels.GROUP, generator=gen)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen)
            op[f"{n}x{k} rows {rows}"] = median_ms(lambda: kernels.grouped_int8_mm(x, q, scale), 9 if n > 10**5 else 41)

    from turbospec.bench.timing import decode_step_ms
    from turbospec.config import EngineConfig
    from turbospec.tuning import build_engine

    engine = build_engine(EngineConfig(MODEL, num_threads=threads), progress=False)
    step_ms = decode_step_ms(engine, [200], random.Random(0), steps)
    return {"op_ms": op, "decode_step_ms": {f"{MODEL} plain decode step (engine, auto weights)": step_ms}}


def main() -> None:
    kernel_ab.main(__file__, SOURCE, worker, "Grouped int8 kernel: A/B against an earlier version, alternating "
                   "processes", "eaf8717", "int8_kernel_ab", MODEL)


if __name__ == "__main__":
    main()
