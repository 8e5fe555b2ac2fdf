"""Our AVX2 records kernel (turbospec/kernels/records_avx2.cpp: float32 activations, the `auto` weight format on CPUs
without AVX-512) against an earlier version of it, alternating.

On such CPUs every packed linear of a GGUF model runs in this kernel on every step: qwen2.5-coder-1.5b's Q4_K
parts as int4 records, its Q6_K LM head and down projections as int6 records. Each variant is built from its own
source (with its own revision's headers) and measured in its own process, A/B/A/B..., so that machine drift between
rounds cannot decide the comparison:
- the operator alone on the model's largest int4 and int6 shapes, for the row counts of a decode step (1) and of
  verification windows (3, 5, 9), the weights evicted from the caches before every call, as a decode step reads them,
  and (where they fit the last-level cache) left in the caches, the kernel's arithmetic alone;
- a plain greedy decode step of the engine (auto weights).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/avx2_records_ab.py [--baseline REV] [--rounds 3]

The default baseline, 1a03e69, is a tried and reverted variant (int6 values through vpshufb, as int4's):
results/avx2_records_ab/avx2_records_ab_zen3_int6_shuffle.md.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from harness import kernel_ab
from harness.kernel_ab import use_source
from harness.weights_from_memory import SHAPES, eviction_buffer, median_ms

ROOT = Path(__file__).resolve().parent
SOURCE = Path("turbospec/kernels/records_avx2.cpp")
ROWS = (1, 3, 5, 9)
MODEL = "qwen2.5-coder-1.5b"
IN_CACHE_BYTES = 24 * 2**20  # weights this small are also timed left in the caches (no flush)


def worker(source: str, threads: int, steps: int) -> dict:
    """One variant, in this process: build it from `source`, time the operator and the engine's decode step."""
    import torch

    from turbospec import kernels
    from turbospec.models import gguf_blocks
    from turbospec.models.packed import AmxInt4Part, AmxInt6Part

    sys.path.insert(0, str(ROOT.parent / "tests" / "models"))
    from test_weight_formats import random_blocks  # valid random GGUF blocks

    torch.set_num_threads(threads)
    use_source(source)  # this variant's records source with the current other kernels
    if kernels.records_path() != "avx2":
        raise SystemExit(f"avx2_records_ab.py: the records run on the {kernels.records_path()!r} path here, not "
                         "AVX2 (TURBOSPEC_CPU_PATH=avx2 forces it on a wider CPU)")
    flush = eviction_buffer()
    gen = torch.Generator().manual_seed(0)
    op: dict[str, float] = {}
    for name, (type_name, n, k) in SHAPES.items():
        groups = gguf_blocks.decode(random_blocks(type_name, n, k), type_name, n, k)
        part = AmxInt4Part.from_groups(groups) if type_name == "Q4_K" else AmxInt6Part.from_groups(groups)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=gen).bfloat16()
            op[f"{name}, {rows} rows"] = median_ms(lambda: part.mm(x), 9, flush)
            if part.nbytes <= IN_CACHE_BYTES:  # the kernel's arithmetic alone, the floor of its time from memory
                op[f"{name}, {rows} rows, in cache"] = median_ms(lambda: part.mm(x), 9, None)

    from turbospec.bench.timing import decode_step_ms
    from turbospec.config import EngineConfig
    from turbospec.tuning import build_engine

    engine = build_engine(EngineConfig(MODEL, num_threads=threads), progress=False)
    step_ms = decode_step_ms(engine, [200], random.Random(0), steps)
    return {"op_ms": op, "decode_step_ms": {f"{MODEL} plain decode step (engine, auto weights)": step_ms}}


def main() -> None:
    kernel_ab.main(__file__, SOURCE, worker, "AVX2 records kernel (float32 activations): A/B against an earlier "
                   "version, alternating processes", "1a03e69", "avx2_records_ab", MODEL,
                   notes=("- ops: weights evicted from the caches before each call (in cache: left there by the call "
                          "before); median of 9 calls",))


if __name__ == "__main__":
    main()
