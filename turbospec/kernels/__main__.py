"""`python -m turbospec.kernels`: build the compiled kernel once (`make setup` runs it); never fails."""

import logging
import sys

from . import _flags, amx_available, bf16_rows_limit, bf16_rows_path, failure, load

logging.basicConfig(level=logging.INFO, format="%(message)s")
built = load(verbose="-v" in sys.argv) is not None
# the int8 kernel is built with AVX-512 where torch reports it, else as its portable loop (AVX2 CPUs, ARM)
simd = "AVX-512" if "-mavx512f" in _flags() else "portable"
amx = "; AMX kernels in use" if amx_available() else f"; no AMX here: torch's int4 and our {simd} int8 kernel in use"
fallback = f"pure-torch fallback in use ({failure()})"
print("turbospec kernels: " + ("grouped int8 kernel built" + amx if built else fallback))
if built:  # measured here once for the default thread count (others measure on first use, about a second)
    limit = bf16_rows_limit()
    rows = "every row count" if limit == float("inf") else f"up to {limit:g} rows" if limit else "no row count"
    path = "AVX512_BF16" if bf16_rows_path() == "dpbf16" else "AVX2"
    print(f"turbospec kernels: our bf16 matmul (bf16_rows.cpp, {path} path) runs bf16 linears for {rows} "
          "(measured against torch's)")
