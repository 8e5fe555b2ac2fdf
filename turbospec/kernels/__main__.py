"""`python -m turbospec.kernels`: build the compiled kernel once (`make setup` runs it); never fails."""

import logging
import sys

from . import _flags, bf16_rows_limit, bf16_rows_path, failure, load, records_path

logging.basicConfig(level=logging.INFO, format="%(message)s")
built = load(verbose="-v" in sys.argv) is not None
# the int8 kernel is built with AVX-512 where torch reports it, else as its portable loop (AVX2 CPUs, ARM)
simd = "AVX-512" if "-mavx512f" in _flags() else "portable"
records = {"amx": "; AMX kernels in use for packed weights",
           "dpbf16": "; no AMX here: our AVX512-BF16 kernels (records_dpbf16.cpp) in use for packed weights",
           "avx2": "; neither AMX nor AVX512-BF16 here: our AVX2 kernels (records_avx2.cpp) "
                   "in use for packed weights",
           "": f"; neither AMX nor AVX2 here: torch's int4 and our {simd} int8 kernel in use for packed weights"}
amx = records[records_path()]
fallback = f"pure-torch fallback in use ({failure()})"
print("turbospec kernels: " + ("grouped int8 kernel built" + amx if built else fallback))
if built:  # measured here once for the default thread count (others measure on first use, about a second)
    limit = bf16_rows_limit()
    rows = "every row count" if limit == float("inf") else f"up to {limit:g} rows" if limit else "no row count"
    path = "AVX512_BF16" if bf16_rows_path() == "dpbf16" else "AVX2"
    print(f"turbospec kernels: our bf16 matmul (bf16_rows.cpp, {path} path) runs bf16 linears for {rows} "
          "(measured against torch's)")
