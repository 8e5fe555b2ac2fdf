"""Grouping decodes by context length (turbospec/attention_groups.py) against one padded group for all.

Two parts, one run:
1. the kernel's cost per attention call and per padded cache slot: one layer's paged_attention (the model's
   head shapes, bf16) for one decode at several context lengths, fitted as c0 + c1 x slots. The break-even
   c0 / c1 is how many padded slots an extra group call is worth (GROUP_BREAK_SLOTS);
2. the engine: decode steps of real requests with distinct prompts, batch compositions from uniform to skewed,
   with the planned groups and with one group (GROUP_BREAK_SLOTS set past any context, the earlier
   behaviour), alternated so both see the same machine.

    .venv/bin/python benchmarks/attention_groups.py            # about 3 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from harness import alternating, benchmark_meta, default_out, save

from turbospec import attention_groups
from turbospec.attention import build_metadata, paged_attention
from turbospec.bench.timing import decode_step_ms
from turbospec.config import EngineConfig
from turbospec.engine import LLMEngine
from turbospec.tuning import build_engine

COMPOSITIONS = {  # name -> context lengths of the decoding requests
    "16 x 500": [500] * 16,
    "16 mixed 50-950": [50 + 60 * i for i in range(16)],
    "1 x 950 + 15 x 50": [950] + [50] * 15,
    "8 x 1000 + 8 x 100": [1000] * 8 + [100] * 8,
}


def kernel_cost(engine: LLMEngine, repeats: int) -> dict[str, float]:
    cfg = engine.model_config
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = engine.dtype
    lengths = [64, 256, 512, 1024, 2048]
    slots = max(lengths) + 16
    k_cache = torch.randn(slots, hkv, d, dtype=dtype)
    v_cache = torch.randn(slots, hkv, d, dtype=dtype)
    times = []
    for length in lengths:
        table = torch.randperm(slots)[:length]
        meta = build_metadata([1], [length], [table])
        q, k, v = torch.randn(1, hq, d, dtype=dtype), torch.randn(1, hkv, d, dtype=dtype), torch.randn(1, hkv, d,
                                                                                                        dtype=dtype)
        for _ in range(20):
            paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(d))
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(50):
                paged_attention(q, k, v, k_cache, v_cache, meta, scale=1 / math.sqrt(d))
            samples.append((time.perf_counter() - start) / 50)
        times.append(statistics.median(samples))
    c1, c0 = np.polyfit(lengths, times, 1)
    return {"lengths": lengths, "seconds": times, "per_call_us": c0 * 1e6, "per_slot_ns": c1 * 1e9,
            "break_even_slots": c0 / c1}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="alternations of planned / one group per composition")
    p.add_argument("--steps", type=int, default=10, help="decode steps measured per composition and round")
    p.add_argument("--out", default=str(default_out("attention_groups")))
    args = p.parse_args()
    engine = build_engine(EngineConfig(args.model, num_threads=args.threads, weight_format="bf16"), progress=False)
    kernel = kernel_cost(engine, repeats=5)
    print(f"per call {kernel['per_call_us']:.1f} us, per slot {kernel['per_slot_ns']:.1f} ns: "
          f"break-even {kernel['break_even_slots']:.0f} slots", flush=True)
    planned_break = attention_groups.GROUP_BREAK_SLOTS
    rng = random.Random(0)
    results: dict[str, dict[str, list[float]]] = {n: {"planned": [], "one group": []} for n in COMPOSITIONS}
    bar = tqdm(total=args.rounds * len(COMPOSITIONS) * 2, desc="decode steps", unit="run")
    for round_ in range(args.rounds):
        for name, contexts in COMPOSITIONS.items():
            for mode, brk in alternating((("planned", planned_break), ("one group", sys.maxsize)), round_):
                attention_groups.GROUP_BREAK_SLOTS = brk
                results[name][mode].append(decode_step_ms(engine, contexts, rng, args.steps))
                bar.update(1)
    bar.close()
    attention_groups.GROUP_BREAK_SLOTS = planned_break
    rows = []
    for name, contexts in COMPOSITIONS.items():
        planned, one = (statistics.median(results[name][m]) for m in ("planned", "one group"))
        groups = attention_groups.plan_groups([1] * len(contexts), contexts)
        rows.append({"composition": name, "groups": len(groups), "slots_planned":
                     attention_groups.gathered_slots([1] * len(contexts), contexts),
                     "slots_one_group": len(contexts) * max(contexts), "slots_needed": sum(contexts),
                     "planned_ms": planned, "one_group_ms": one, "speedup": one / planned, "runs": results[name]})
    meta = benchmark_meta(args.threads, model=args.model, dtype="bfloat16", kernel=kernel,
                          group_break_slots=planned_break)
    table = "\n".join([
        f"# Attention groups by context length: {args.model}, bf16, {args.threads} thread(s)", "",
        f"`{meta['command']}` on {meta['date']}, {meta['machine']}, commit {meta['commit']}.", "",
        f"One layer's attention for one decode: {kernel['per_call_us']:.0f} us per call + "
        f"{kernel['per_slot_ns']:.1f} ns per cache slot (fit over contexts {kernel['lengths']}), so an extra group "
        f"call is worth {kernel['break_even_slots']:.0f} padded slots; GROUP_BREAK_SLOTS = {planned_break}.", "",
        f"Decode step (median of {args.steps - 2} steps x {args.rounds} alternated rounds, distinct prompts):", "",
        "| decoding contexts | groups | slots read (planned / one group / needed) | planned ms | one group ms | "
        "speedup |",
        "|---|---|---|---|---|---|",
        *[f"| {r['composition']} | {r['groups']} | {r['slots_planned']} / {r['slots_one_group']} / "
          f"{r['slots_needed']} | {r['planned_ms']:.1f} | {r['one_group_ms']:.1f} | {r['speedup']:.2f}x |"
          for r in rows], ""])
    save(Path(args.out), meta, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
