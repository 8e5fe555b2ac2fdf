"""Which vector instructions the CPU kernels may use: all this CPU has (the default), or a narrower set forced with
TURBOSPEC_CPU_PATH, to measure on one machine what a CPU without AVX-512 runs.

    TURBOSPEC_CPU_PATH=auto     everything this CPU offers (AMX, AVX512-BF16 / VNNI, AVX2)
    TURBOSPEC_CPU_PATH=avx512   the AVX-512 kernels, no AMX (refused on a CPU without AVX-512 F/BW)
    TURBOSPEC_CPU_PATH=avx2     as on an AVX2 + FMA CPU: none of our AVX-512 / AMX kernels, and torch's own kernels
                                dispatched for AVX2 (ATEN_CPU_CAPABILITY=avx2, oneDNN's DNNL_MAX_CPU_ISA=AVX2); only loops the compiler cloned
                                per CPU (the portable attention loop, target_clones) still pick their AVX-512 clone

It is read when turbospec is imported, before torch is: it works through the switches each kernel already reads
(TURBOSPEC_NO_AMX, TURBOSPEC_NO_DPBF16, TURBOSPEC_NO_VNNI, TURBOSPEC_NO_AVX512), torch's ATEN_CPU_CAPABILITY and
oneDNN's DNNL_MAX_CPU_ISA, so it must be in the
environment when the process starts. A path this CPU lacks, or an unknown value, is an error (`problem()`), which
the CLI reports with exit code 2 before any model loads.

No torch import here: the CLI asks before it loads anything.
"""

from __future__ import annotations

import os
from pathlib import Path

PATHS = ("auto", "avx512", "avx2")
VARIABLE = "TURBOSPEC_CPU_PATH"
# the CPU flags (as /proc/cpuinfo names them) each forced path needs
NEEDS = {"avx512": ("avx512f", "avx512bw", "avx2", "fma"), "avx2": ("avx2", "fma")}
# what each forced path switches off: the switches the kernels read
SWITCHES = {"avx512": {"TURBOSPEC_NO_AMX": "1"},
            "avx2": {"TURBOSPEC_NO_AMX": "1", "TURBOSPEC_NO_DPBF16": "1", "TURBOSPEC_NO_VNNI": "1",
                     "TURBOSPEC_NO_AVX512": "1", "ATEN_CPU_CAPABILITY": "avx2",
                     # torch's bf16 / float matmuls go through oneDNN, which picks its own instructions
                     "DNNL_MAX_CPU_ISA": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def requested() -> str:
    return os.environ.get(VARIABLE, "auto").strip().lower() or "auto"


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags, or None where /proc/cpuinfo does not list them (not Linux on x86)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def flags_in_use(flags: set[str]) -> set[str]:
    """The CPU flags the requested path leaves in use (a forced path hides the wider units it switches off): what a
    benchmark's machine line says it ran on, so a forced run is filed under the class it imitates."""
    hidden = {"avx2": ("avx512", "amx"), "avx512": ("amx",)}.get(requested(), ())
    return {f for f in flags if not f.startswith(hidden)} if hidden else flags


def problem(path: str | None = None, flags: set[str] | None = None) -> str | None:
    """Why the requested path cannot run here (an unknown value, or a CPU lacking its instructions), else None."""
    path = requested() if path is None else path
    if path not in PATHS:
        return f"{VARIABLE}={path!r} is not a CPU path: expected one of {', '.join(PATHS)}"
    if path == "auto":
        return None
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return f"{VARIABLE}={path} needs an x86 CPU whose features Linux lists in /proc/cpuinfo"
    missing = [f for f in NEEDS[path] if f not in flags]
    if missing:
        return f"{VARIABLE}={path}: this CPU lacks {', '.join(missing)}; use {VARIABLE}=auto (or avx2 where it has AVX2)"
    return None


def apply() -> None:
    """Set the kernels' switches for a forced path (nothing for auto or for a path that cannot run: the CLI and
    the engine report that). Called when turbospec is imported."""
    path = requested()
    if path in SWITCHES and problem(path) is None:
        for name, value in SWITCHES[path].items():
            os.environ.setdefault(name, value)


def no_avx2_line(flags: set[str] | None = None) -> str | None:
    """One line for a CPU without AVX2 + FMA (or whose features are unknown): what runs instead; None otherwise."""
    flags = cpu_flags() if flags is None else flags
    if flags is not None and {"avx2", "fma"} <= flags:
        return None
    return ("this CPU has no AVX2 + FMA (or does not list its features): packed weights and bf16 linears run "
            "torch's portable kernels, slower than our vector kernels")
