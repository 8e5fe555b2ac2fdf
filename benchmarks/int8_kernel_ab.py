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

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import alternating, benchmark_meta, default_out, header_lines, save

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
    # this variant's int8 source with the current other kernels; the build directory is keyed by the sources' hash
    kernels.SOURCES = [Path(source), *(p for p in kernels.SOURCES if p.name != SOURCE.name)]
    if kernels.load() is None:
        raise SystemExit(f"kernel build failed: {kernels.failure()}")

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
    return {"op_ms": op, "decode_step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default="eaf8717", help="git revision whose kernel source is the A side")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=24, help="decode steps timed per round")
    ap.add_argument("--out", default=str(default_out("int8_kernel_ab")))
    ap.add_argument("--worker", metavar="SOURCE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.steps)))
        return
    old = subprocess.run(["git", "show", f"{args.baseline}:{SOURCE}"], capture_output=True, text=True, check=True)
    tmp = Path(tempfile.mkdtemp(prefix="int8_ab_")) / "grouped_int8.cpp"
    tmp.write_text(old.stdout)
    variants = {f"baseline ({args.baseline})": str(tmp), "current": str(SOURCE.resolve())}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in alternating(list(variants), r):
            source = variants[name]
            out = subprocess.run([sys.executable, __file__, "--worker", source, "--threads", str(args.threads),
                                  "--steps", str(args.steps)], capture_output=True, text=True, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: decode step {results[name][-1]['decode_step_ms']:.1f} ms", flush=True)
    meta = benchmark_meta(args.threads, model=MODEL, baseline=args.baseline, rounds=args.rounds)
    base, cur = results.values()

    def med(runs: list[dict], key: str) -> float:
        return statistics.median(run["op_ms"][key] if key != "decode" else run["decode_step_ms"] for run in runs)

    lines = ["# Grouped int8 kernel: A/B against an earlier version, alternating processes", "", *header_lines(meta),
             f"- medians over {args.rounds} alternating rounds (the order reversed every round); op times are each "
             "round's median of repeated calls",
             "", "| measurement | baseline ms | current ms | baseline / current |", "|---|---|---|---|"]
    for key in [*base[0]["op_ms"], "decode"]:
        b, c = med(base, key), med(cur, key)
        label = key if key != "decode" else f"{MODEL} plain decode step (engine, auto weights)"
        lines.append(f"| {label} | {b:.2f} | {c:.2f} | {b / c:.2f}x |")
    save(Path(args.out), meta, [results], "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
