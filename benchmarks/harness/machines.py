"""Machine classes: which of our kernel paths a result ran on, read from the machine line a result records.

A result's `meta["machine"]` (turbospec/bench/machine.py's cpu_description) names the CPU and, since 2026-12-03,
its family and vector units: "AMD EPYC (family 26; avx2, avx512f, avx512_bf16), 2 CPUs". Cloud CPUs share model
names across generations, so the class comes from the vector units, not the name. Imports nothing of ours (the
results index, benchmarks/latest.py, reads old results without loading torch).
"""

from __future__ import annotations

import re

AMX = "AMX Xeon"
AVX512 = "AVX-512 Zen"
AVX2 = "AVX2"
UNRECORDED = "not recorded"
CLASSES = (AMX, AVX512, AVX2, UNRECORDED)  # LATEST.md's column order

_UNITS = re.compile(r"\((?:family (\d+))?;?\s*([a-z0-9_, ]*)\)")


def vector_units(machine: str) -> tuple[str | None, set[str]]:
    """(CPU family, vector units) from a machine line; (None, empty) where the line predates them."""
    match = _UNITS.search(machine or "")
    if not match:
        return None, set()
    return match.group(1), {u.strip() for u in match.group(2).split(",") if u.strip()}


def machine_class(machine: str) -> str:
    """AMX Xeon, AVX-512 Zen or AVX2 from the recorded vector units; "not recorded" where the line has none."""
    _, units = vector_units(machine)
    if "amx_bf16" in units:
        return AMX
    if "avx512f" in units:
        return AVX512
    if "avx2" in units:
        return AVX2
    return UNRECORDED
