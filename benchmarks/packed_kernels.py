"""Packed-weight kernels by row count, on qwen2.5-coder-1.5b's shapes: our kernel over the tile-order records (AMX,
AVX512-BF16 dot products on CPUs without AMX, or AVX2 FMAs on CPUs without AVX-512: `kernels.records_path()`) and
its int8-activation variant (auto-q8act) against torch's int4 kernel for Q4_K / our int8 kernel for Q6_K (what runs
where none does) and dense bf16 (oneDNN), next to the machine's streaming read bandwidth. Under
TURBOSPEC_CPU_PATH=avx2 it measures the AVX2 path on a wider CPU (the machine line says so).

Why: decode runs one row per request, verification k + 1 rows, a batch one row per request, prefill hundreds;
a packed format pays only if it stays cheap across those counts. Weights are GGUF blocks of random values in the
model's block types (the kernels' speed does not depend on the values) and are evicted from the caches before
every call (a 512 MiB read, which leaves no dirty lines to write back), so each call reads them from memory, as a decode step does (the 1.5B model's
weights do not fit the caches). Median of --repeats calls.

    .venv/bin/python benchmarks/packed_kernels.py [--repeats 7 --threads 2 --rows 1,2,4,9,16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests" / "models"))

from harness import benchmark_meta, default_out, save  # noqa: E402
from harness.weights_from_memory import SHAPES, eviction_buffer, median_ms  # noqa: E402
from test_weight_formats import random_blocks  # noqa: E402  (valid random GGUF blocks)

from turbospec import kernels  # noqa: E402
from turbospec.models import gguf_blocks  # noqa: E402
from turbospec.models.packed import AmxInt4Part, AmxInt6Part, Int4Part, Int8Part  # noqa: E402

BANDWIDTH_GIB = 1.0

ROWS = (1, 2, 3, 4, 6, 8, 9, 12, 16, 32, 64, 256)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (default %(default)s)")
    ap.add_argument("--out", default=str(default_out("packed_kernels")))
    args = ap.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    if not row_counts or min(row_counts) < 1 or 1 not in row_counts:
        ap.error(f"--rows {args.rows!r}: positive row counts including 1 (the GB/s column is the one-row call's)")
    path = kernels.records_path()
    if not path:
        sys.exit("packed_kernels.py: this CPU (or build) runs none of our records kernels (AMX, AVX512-BF16, AVX2); "
                 "nothing to compare")

    torch.set_num_threads(args.threads)
    cache = last_level_cache_bytes()
    flush = eviction_buffer()
    big = torch.ones(int(BANDWIDTH_GIB * 2**30) // 4)
    stream_ms = min(median_ms(big.sum, 3, flush) for _ in range(3))
    bandwidth = big.nbytes / stream_ms / 1e6
    del big
    tqdm.write(f"streaming read (float32 tensor.sum() over {BANDWIDTH_GIB:g} GiB): {bandwidth:.1f} GB/s")
    rows_out: list[dict[str, Any]] = []
    for name, (type_name, n, k) in tqdm(SHAPES.items(), desc="shapes"):
        groups = gguf_blocks.decode(random_blocks(type_name, n, k), type_name, n, k)
        int4 = type_name == "Q4_K"
        amx = AmxInt4Part.from_groups(groups) if int4 else AmxInt6Part.from_groups(groups)
        # the same records with int8 activations (weight format auto-q8act), where the CPU has AVX512-VNNI or AVX2
        q8 = kernels.record_op(amx.kind, int8_activations=True) if kernels.q8_records_available() else None
        other = Int4Part.from_groups(groups, torch.bfloat16) if int4 else Int8Part.from_groups(groups, torch.bfloat16)
        dense = torch.from_numpy(groups.dequantize()).to(torch.bfloat16)
        del groups
        fits = cache is not None and amx.nbytes <= cache
        for rows in tqdm(row_counts, desc=name, leave=False):
            x = torch.randn(rows, k).to(torch.bfloat16)
            row = {"shape": name, "rows": rows, "records_ms": median_ms(lambda: amx.mm(x), args.repeats, flush),
                   "q8act_ms": median_ms(lambda: q8(x, amx.data), args.repeats, flush) if q8 else None,
                   # in cache: only where the weights fit it (else the call reads from memory again)
                   "records_cached_ms": median_ms(lambda: amx.mm(x), args.repeats, None) if fits else None,
                   "q8act_cached_ms": median_ms(lambda: q8(x, amx.data), args.repeats, None) if q8 and fits else None,
                   "no_amx_ms": median_ms(lambda: other.mm(x), args.repeats, flush),
                   "dense_bf16_ms": median_ms(lambda: F.linear(x, dense), args.repeats, flush),
                   "records_bytes": amx.nbytes, "no_amx_bytes": other.nbytes, "dense_bytes": dense.nbytes}
            rows_out.append(row)
            tqdm.write(f"{name} rows {rows}: records ({path}) {row['records_ms']:.2f} ms, torch int4 / our int8 "
                       f"{row['no_amx_ms']:.2f} ms, "
                       f"dense bf16 {row['dense_bf16_ms']:.2f} ms")
    meta = benchmark_meta(args.threads, repeats=args.repeats, records_path=path, read_gb_per_s=bandwidth,
                          last_level_cache_bytes=cache)
    save(Path(args.out), meta, rows_out, markdown(meta, rows_out))


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size as Linux reports it (None where it does not)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=None)


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    path = {"amx": "AMX", "dpbf16": "AVX512-BF16", "avx2": "AVX2 FMA"}[meta["records_path"]]
    q8_kernel = "AVX2 vpmaddubsw" if meta["records_path"] == "avx2" else "AVX512-VNNI"
    cache = meta.get("last_level_cache_bytes")
    cache_text = f"{cache / 2**20:.0f} MiB" if cache else "not reported here"
    lines = ["# Packed-weight kernels by row count (qwen2.5-coder-1.5b shapes)", "",
             f"- {meta['command']}", f"- {meta['machine']}, {meta['threads']} threads, torch {meta['torch']}, "
             f"{meta['date']}, commit {meta['commit']}",
             "- weights evicted from the caches before every call (read from memory, as in decode); median of "
             f"{meta['repeats']} calls; ms per call (GB/s of its weight bytes at one row); x 1 row: the records "
             "kernel's time over its one-row time",
             f"- streaming read bandwidth of this machine (float32 tensor.sum() over 1 GiB): "
             f"{meta['read_gb_per_s']:.1f} GB/s",
             "- int8 activations: the same records with the activations quantised to int8 (weight format "
             f"auto-q8act, {q8_kernel}; lossy, never the default)",
             "- in cache: the same call with its weights left in the caches by the call before, the kernel's "
             "arithmetic alone, so the floor of its time from memory (in brackets: over the one-row call from "
             f"memory); only where the weights fit the last-level cache ({cache_text}), else -", "",
             f"| shape | rows | records ({path}, ours) | x 1 row | in cache | int8 activations (ours) | x 1 row | "
             "in cache | torch int4 / our int8 | dense bf16 | records / dense |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    one = {r["shape"]: r["records_ms"] for r in rows if r["rows"] == 1}
    one_q8 = {r["shape"]: r.get("q8act_ms") for r in rows if r["rows"] == 1}
    for r in rows:
        def cell(ms: float, nbytes: int) -> str:
            return f"{ms:.2f} ({nbytes / ms / 1e6:.1f} GB/s)" if r["rows"] == 1 else f"{ms:.2f}"

        def cached(ms: float | None, one_row: float) -> str:
            return f"{ms:.2f} ({ms / one_row:.2f}x)" if ms is not None else "-"

        q8 = r.get("q8act_ms")
        q8_cells = (f"{cell(q8, r['records_bytes'])} | {q8 / one_q8[r['shape']]:.2f} | "
                    f"{cached(r.get('q8act_cached_ms'), one_q8[r['shape']])}" if q8 else "- | - | -")
        lines.append(f"| {r['shape']} | {r['rows']} | {cell(r['records_ms'], r['records_bytes'])} | "
                     f"{r['records_ms'] / one[r['shape']]:.2f} | {cached(r.get('records_cached_ms'), one[r['shape']])} | "
                     f"{q8_cells} | {cell(r['no_amx_ms'], r['no_amx_bytes'])} | "
                     f"{cell(r['dense_bf16_ms'], r['dense_bytes'])} | {r['records_ms'] / r['dense_bf16_ms']:.2f} |")
    lines += ["", "Bytes per weight: records int4 0.625, int6 0.875; torch int4 0.625, our int8 1.25; bf16 2.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
