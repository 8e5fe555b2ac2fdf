"""Our own compiled CPU kernels, built on first use with torch's extension builder: the grouped int8 matmul
(AVX-512), the AMX products for grouped int4 / int8 weights (`amx_grouped.cpp`, used where the CPU has AMX), the
same records' products with AVX512-BF16 (`records_dpbf16.cpp`) or, on CPUs with only AVX2, with float32 FMAs
(`records_avx2.cpp`; with int8 activations for auto-q8act: `records_avx2_q8.cpp`),
fused bf16 RMSNorm / rotary operators (`fused_ops.cpp`, used by models/layers.py) and a bf16 matmul that reads
the weights once for a few rows (`bf16_rows.cpp`: AVX2, or AVX512_BF16's `vdpbf16ps` where the CPU has it; used by
layers.row_linear where it measures faster than torch's), and a whole decoder layer in one call for decode-sized steps
on packed records (`decoder_layer.cpp`, used by models/fused_layers.py).

The build needs a C++ compiler and ninja; it is cached in `turbospec/kernels/_build`, and `make setup`
runs it once (`python -m turbospec.kernels`). When it cannot be built (no compiler, another OS) or
`TURBOSPEC_NO_KERNELS=1` is set, `grouped_int8_mm` falls back to pure torch: dequantise, then matmul.
The fallback computes the same values, only slower, so nothing depends on the build succeeding.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from .. import cpu_path
from ..host import best_ms, hardware_name, measured_once, past_the_cache, turbospec_home

log = logging.getLogger("turbospec.kernels")

SOURCES = [Path(__file__).with_name(name)
           for name in ("grouped_int8.cpp", "amx_grouped.cpp", "records_dpbf16.cpp", "records_avx2.cpp",
                        "records_avx2_q8.cpp", "short_attention.cpp", "fused_ops.cpp", "bf16_rows.cpp",
                        "decoder_layer.cpp")]
HEADERS = [Path(__file__).with_name("records.h")]  # included by the sources: part of the build's identity
GROUP = 16
_module: Any = None
_failure: str | None = None


def _digest() -> str:
    """The build's identity: its source, flags, torch and the CPU capability it was compiled for."""
    capability = torch.backends.cpu.get_cpu_capability()
    sources = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    return hashlib.sha256(sources + f"{torch.__version__}:{capability}:{_flags()}".encode()).hexdigest()[:12]


def _build_dir() -> Path:
    """Next to the source when writable (one build per checkout, whatever TURBOSPEC_HOME a process uses),
    else under $TURBOSPEC_HOME/kernels."""

    here = SOURCES[0].parent
    local = here / "_build"
    root = local if os.access(here, os.W_OK) else turbospec_home() / "kernels"
    return root / f"grouped_int8-{_digest()}"


def build_id() -> str:
    """Which kernel runs: the compiled build's digest, or 'fallback'. Part of the keys of what is measured with
    it (crossover rows, step-time profiles), so a changed kernel is measured again."""
    return _digest() if load() is not None else "fallback"


def _flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]  # OpenMP: at::parallel_for shares torch's thread pool (torch ships libgomp)
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        flags.append("-mavx512f")  # the C++ has a portable loop for other CPUs
    return flags


def load(verbose: bool = False) -> Any:
    """The compiled operators (`torch.ops.turbospec`), building them if needed; None (with the reason in
    `failure()`) when unavailable."""
    global _module, _failure
    if _module is not None or _failure is not None:
        return _module
    if os.environ.get("TURBOSPEC_NO_KERNELS") == "1":
        _failure = "disabled by TURBOSPEC_NO_KERNELS=1"
        return None
    try:
        from torch.utils.cpp_extension import load as build

        bin_dir = str(Path(sys.executable).parent)  # the venv's ninja, when PATH does not have it
        if shutil.which("ninja") is None and bin_dir not in os.environ.get("PATH", ""):
            os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
        directory = _build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        # a library of torch operators (turbospec::grouped_int8_mm, amx_int4_mm, ...), loaded into torch.ops
        build("turbospec_grouped_int8", [str(path) for path in SOURCES], extra_cflags=_flags(),
              extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=verbose, is_python_module=False)
        _module = torch.ops.turbospec
        note = cpu_path.no_avx2_line()
        if note is not None:
            log.warning("%s", note)
    except Exception as exc:  # any build problem means: use the fallback
        _failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        log.warning("compiled int8 kernel unavailable (%s); using the pure-torch fallback", _failure)
    return _module


def failure() -> str | None:
    return _failure


def grouped_int8_mm_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale per 16 inputs)^T in float32, by dequantising: the fallback and the tests' reference."""
    w = q.float() * scale.repeat_interleave(GROUP, dim=1)
    return x.float() @ w.t()


def grouped_int8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [M, N] = x [M, K] @ (q [N, K] int8 * scale [N, K / 16] float32)^T."""
    module = load()
    if module is None:
        return grouped_int8_mm_reference(x, q, scale)
    return module.grouped_int8_mm(x, q, scale)


def amx_available() -> bool:
    """Whether the AMX products can run: kernels built, a CPU (and Linux) offering AMX-BF16 tiles, and not
    switched off with TURBOSPEC_NO_AMX=1 (for side-by-side measurements)."""
    if os.environ.get("TURBOSPEC_NO_AMX") == "1":
        return False
    module = load()
    return module is not None and bool(module.amx_available())


def dpbf16_records_available() -> bool:
    """Whether the tile-order records run on AVX512-BF16 without AMX (`records_dpbf16.cpp`): kernels built, a CPU
    with AVX512-BF16, and not switched off with TURBOSPEC_NO_DPBF16=1."""
    module = load()
    return module is not None and bool(module.dpbf16_records_available())


def avx2_records_available() -> bool:
    """Whether the tile-order records run on AVX2 + FMA + F16C (`records_avx2.cpp`, and `records_avx2_q8.cpp` for
    auto-q8act): kernels built, a CPU with them, and not switched off with TURBOSPEC_NO_AVX2_RECORDS=1."""
    module = load()
    return module is not None and bool(module.avx2_records_available())


def records_path() -> str:
    """Which kernel runs the tile-order records (the parts `models.packed` calls amx-int4 / -int6 / -int8): "amx",
    "dpbf16" (AVX512-BF16 dot products, on CPUs without AMX), "avx2" (float32 FMAs, on CPUs with neither), or ""
    (none: torch's int4 and our int8 kernel hold the packed weights instead)."""
    global _records_path
    if _records_path is None:
        _records_path = ("amx" if amx_available() else "dpbf16" if dpbf16_records_available()
                         else "avx2" if avx2_records_available() else "")
    return _records_path


_records_path: str | None = None


def q8_records_available() -> bool:
    """Whether the records' int8-activation kernel (weight format auto-q8act) runs: kernels built, AVX512-VNNI, or
    the AVX2 records path (`records_avx2_q8.cpp`, the same values)."""
    module = load()
    return module is not None and (bool(module.q8_records_available()) or records_path() == "avx2")


def record_op(kind: str, int8_activations: bool = False) -> Any:
    """The operator for `kind` (amx-int4, amx-int6, amx-int8: the parts in `models.packed`): op(x, data) is
    bf16 x [M, K] @ W^T for W in that kind's record layout, in bf16, on the path `records_path()` names (or, with
    `int8_activations`, the activations quantised to int8: AVX512-VNNI products, or AVX2's on the AVX2 path). Where
    no path runs, a stand-in that says so when called (a part's layout still works without them)."""
    path = records_path()
    if int8_activations:
        path = "avx2q8" if path == "avx2" else "q8"
    if not path:
        def unavailable(*_: Any) -> torch.Tensor:
            raise RuntimeError(f"{kind} parts need the compiled AMX, AVX512-BF16 or AVX2 kernels, which are unavailable "
                               f"here: {_failure or 'this CPU has neither'}")

        return unavailable
    return getattr(torch.ops.turbospec, kind.replace("amx", path).replace("-", "_") + "_mm")


def fused_ops() -> Any:
    """`torch.ops.turbospec` when the fused bf16 operators (rms_norm, add_rms_norm, rotary) can run, else None
    (kernels not built, or switched off with TURBOSPEC_NO_FUSED=1 for side-by-side measurements)."""
    return None if _NO_FUSED else load()


_NO_FUSED = os.environ.get("TURBOSPEC_NO_FUSED") == "1"  # read once: the layers ask on every call

# bf16 linears: our kernel or torch's, decided by timing both on two probe shapes (an attention-sized and an
# MLP-down-sized linear of a ~1B model) at decode, verification and prefill row counts
BF16_PROBE_SHAPES = ((2048, 1536), (1536, 4096))  # (out, in)
BF16_PROBE_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)
# Up to this many rows a probe streams its weight from memory, as a model's decode and verification steps do:
# each timed call runs the product over copies of the weight (host.past_the_cache). One 6 MB weight stays in
# cache, where torch's packed product is at its best: on an AMD EPYC
# with AVX512_BF16 (2026-12-03) the cached probe stopped our kernel at 8 rows (ad hoc; streamed: 16-24), while on
# the model's weights it was 2-3x faster than torch's from 4 to 16 rows (benchmarks/results/bf16_rows/bf16_rows_avx512bf16.md),
# so a 9-row verification ran torch's.
BF16_STREAMED_ROWS = 32
_bf16_limits: dict[int, float] = {}  # torch threads -> rows limit, for this process


def bf16_rows_limit() -> float:
    """Up to how many rows a bf16 linear runs our kernel (`bf16_rows.cpp`) instead of torch's: the largest count
    up to which ours was faster at every count measured, infinity when it won at all of them (then longer prefill
    chunks run it too: its cost grows linearly past 64 rows, like torch's), 0 where it cannot run or
    TURBOSPEC_NO_BF16_ROWS=1 (for side-by-side measurements). Measured once per machine, torch thread count and
    build (about a second), cached under $TURBOSPEC_HOME/kernels."""
    threads = torch.get_num_threads()
    if threads not in _bf16_limits:
        _bf16_limits[threads] = _measure_bf16_limit(threads)
    return _bf16_limits[threads]


def _measure_bf16_limit(threads: int) -> float:
    if (os.environ.get("TURBOSPEC_NO_BF16_ROWS") == "1" or load() is None
            or not torch.ops.turbospec.bf16_rows_available()):
        return 0.0

    key = f"{hardware_name('cpu')}|{threads}|{torch.__version__}|{build_id()}{bf16_rows_key_suffix()}"
    return measured_once("bf16-rows", key, _probe_bf16_limit, lambda cached: float(cached["limit"]))


def _probe_bf16_limit() -> dict[str, object]:
    """{"limit": rows, "ms": {"<shape>:<rows>": [ours, torch's]}}, timed at this process's thread count."""

    gen = torch.Generator().manual_seed(0)
    limit, timings = float("inf"), {}
    for out_features, in_features in BF16_PROBE_SHAPES:
        w = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
        streamed = past_the_cache(w, w.nbytes, torch.Tensor.clone)
        for i, rows in enumerate(BF16_PROBE_ROWS):
            if rows > limit:
                break
            x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
            pool = streamed if rows <= BF16_STREAMED_ROWS else [w]  # (prefill sizes: compute-bound, one copy)
            ours, theirs = best_ms((lambda: [bf16_rows_mm(x, v) for v in pool],
                                    lambda: [torch.nn.functional.linear(x, v) for v in pool]), 5)
            timings[f"{out_features}x{in_features}:{rows}"] = [ours, theirs]
            if ours >= theirs:
                limit = BF16_PROBE_ROWS[i - 1] if i else 0  # the last count it won at, on every shape so far
    log.info("bf16 linears of up to %s rows run our kernel (bf16_rows.cpp), measured faster than torch's",
             "any number of" if limit == float("inf") else f"{limit:g}")
    return {"limit": limit, "ms": timings}


def bf16_rows_path() -> str:
    """Which path of `bf16_rows.cpp` this process runs: "dpbf16" (AVX512_BF16), "avx2", or "" (none)."""
    if load() is None or not torch.ops.turbospec.bf16_rows_available():
        return ""
    return "dpbf16" if torch.ops.turbospec.bf16_rows_dpbf16() else "avx2"


def bf16_rows_key_suffix() -> str:
    """For the cache keys of what the kernel's speed decides (this limit, step-time profiles): the AVX512_BF16
    path keys them apart (TURBOSPEC_NO_DPBF16 switches paths on one machine); AVX2 keys stay as they were."""
    return "|dpbf16" if bf16_rows_path() == "dpbf16" else ""


def _bf16_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """bf16 on the CPU, at least one input, weight rows of adjacent values (a slice of a wider weight's inputs is
    fine, no copy per call), nothing to differentiate (the operator has no backward)."""
    grads = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.shape[-1] > 0 and weight.dim() == 2 and weight.stride(1) == 1 and not grads)


def bf16_rows_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether x @ weight^T should run `bf16_rows_mm`: operands it takes, no more rows than `bf16_rows_limit()`."""
    if not _bf16_operands(x, weight, bias):
        return False
    limit = bf16_rows_limit()  # 0: unavailable here (even an empty call must not reach the missing operator)
    return limit > 0 and x.numel() // max(x.shape[-1], 1) <= limit


def bf16_rows_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the batch-invariant mode runs `bf16_rows_mm` for this product: on CPUs whose best vector unit is
    AVX2 (no AVX-512, so no bf16 arithmetic for torch either: on one such EPYC ours measured 5.2-8.4x torch's from
    9 rows up), for operands it takes. The choice is the CPU's, not a timing's: a timing is per thread count,
    and tensor-parallel ranks (fewer threads each) must choose what a single process chooses, or invariant bits
    would differ between tensor-parallel sizes. Every call of the mode then takes it whatever its rows; its rows
    are independent of each other and of the thread count by construction, so no padding or chunking is needed
    (determinism/batch_invariant.py)."""
    return _bf16_operands(x, weight, bias) and _invariant_choice()


def _invariant_choice() -> bool:
    global _invariant_cpu
    if _invariant_cpu is None:
        _invariant_cpu = (os.environ.get("TURBOSPEC_NO_BF16_ROWS") != "1" and load() is not None
                          and torch.backends.cpu.get_cpu_capability() == "AVX2"
                          and bool(torch.ops.turbospec.bf16_rows_available()))
    return _invariant_cpu


_invariant_cpu: bool | None = None


def bf16_rows_mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 widened: bool = False) -> torch.Tensor:
    """bf16 x [..., K] @ weight [N, K]^T (+ bias), float32 sums rounded to bf16 once; each row's result does not
    depend on the other rows of the call. Needs the compiled kernels on an AVX2 + FMA CPU. On a CPU with
    AVX512_BF16 it runs `vdpbf16ps` (`bf16_rows_dpbf16()`), unless `widened` (the AVX2 path, for tests) or
    TURBOSPEC_NO_DPBF16 is set (read once per process, for side-by-side measurements)."""
    flat = x.reshape(-1, x.shape[-1])
    return torch.ops.turbospec.bf16_rows_mm(flat, weight, bias, widened).reshape(*x.shape[:-1], weight.shape[0])
