"""Our own compiled CPU kernels, built on first use with torch's extension builder: the grouped int8 matmul
(AVX-512), the AMX products for grouped int4 / int8 weights (`amx_grouped.cpp`, used where the CPU has AMX) and
fused bf16 RMSNorm / rotary operators (`fused_ops.cpp`, used by models/layers.py).

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

log = logging.getLogger("turbospec.kernels")

SOURCES = [Path(__file__).with_name(name) for name in ("grouped_int8.cpp", "amx_grouped.cpp", "fused_ops.cpp")]
GROUP = 16
_module: Any = None
_failure: str | None = None


def _digest() -> str:
    """The build's identity: its source, flags, torch and the CPU capability it was compiled for."""
    capability = torch.backends.cpu.get_cpu_capability()
    sources = b"".join(path.read_bytes() for path in SOURCES)
    return hashlib.sha256(sources + f"{torch.__version__}:{capability}:{_flags()}".encode()).hexdigest()[:12]


def _build_dir() -> Path:
    """Next to the source when writable (one build per checkout, whatever TURBOSPEC_HOME a process uses),
    else under $TURBOSPEC_HOME/kernels."""
    from ..models.registry import turbospec_home

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


def amx_op(kind: str) -> Any:
    """The operator for `kind` (amx-int4, amx-int6, amx-int8: the parts in `models.packed`): op(x, data) is
    bf16 x [M, K] @ W^T for W in that kind's record layout, in bf16. Runs only where `amx_available()`; where the
    kernels could not be built, a stand-in that says so when called (a part's layout still works without them)."""
    if load() is None:
        def unavailable(*_: Any) -> torch.Tensor:
            raise RuntimeError(f"{kind} parts need the compiled kernels, which are unavailable: {_failure}")

        return unavailable
    return getattr(torch.ops.turbospec, kind.replace("-", "_") + "_mm")


def fused_ops() -> Any:
    """`torch.ops.turbospec` when the fused bf16 operators (rms_norm, add_rms_norm, rotary) can run, else None
    (kernels not built, or switched off with TURBOSPEC_NO_FUSED=1 for side-by-side measurements)."""
    return None if _NO_FUSED else load()


_NO_FUSED = os.environ.get("TURBOSPEC_NO_FUSED") == "1"  # read once: the layers ask on every call
