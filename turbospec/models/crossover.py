"""Where packed kernels stop paying: measured per weight shape, cached per machine.

For each packed signature (kinds and shapes of its parts) we time the packed product and the dense one on
the same random activations for 1..32 rows, and keep the largest row count up to which packed was faster
at every count. Nothing is hard-coded: on a CPU where the int4 kernel loses even at one row, the crossover
is 0 and the linear runs dense. Measured once per (signature, dtype, threads, hardware, torch); a 1.5B
model's six signatures take a few seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .packed import PackedWeight

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pay for allocation and thread start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(packed: PackedWeight, dense: torch.Tensor, repeats: int = 5) -> dict[int, tuple[float, float]]:
    """rows -> (packed ms, dense ms), stopping two counts after packed first loses."""
    gen = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    losses = 0
    for rows in ROWS:
        x = torch.randn(rows, dense.shape[1], generator=gen).to(dense.dtype)
        p = median_ms(lambda: packed.mm(x), repeats)
        d = median_ms(lambda: F.linear(x, dense), repeats)
        out[rows] = (p, d)
        losses += p >= d
        if losses >= 2:
            break
    return out


def crossover_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The largest row count up to which packed won at every measured count."""
    best = 0
    for rows in sorted(timings):
        p, d = timings[rows]
        if p >= d:
            break
        best = rows
    return best


class CrossoverCache:
    """signature -> rows, in one JSON file per machine key (under $TURBOSPEC_HOME/kernels)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.data: dict[str, dict] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.dirty = False

    def rows(self, packed: PackedWeight, dense: torch.Tensor) -> int:
        entry = self.data.get(packed.signature)
        if entry is None:
            timings = measure(packed, dense)
            entry = {"rows": crossover_rows(timings), "ms": {str(r): list(t) for r, t in timings.items()}}
            self.data[packed.signature] = entry
            self.dirty = True
        return int(entry["rows"])

    def save(self) -> None:
        if self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.partial")  # two loads at once: own files
            tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
            tmp.rename(self.path)
            self.dirty = False


def cache_path(dtype: torch.dtype) -> Path:
    import hashlib

    from .. import kernels
    from ..control.profiler import hardware_name  # here: the profiler imports the engine, which imports us
    from .registry import turbospec_home

    kernel = kernels.build_id()  # the int8 fallback, or another version of the kernel, has other timings
    key = f"{hardware_name('cpu')}|{torch.get_num_threads()}|{torch.__version__}|{dtype}|{kernel}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return turbospec_home() / "kernels" / f"crossover-{str(dtype).removeprefix('torch.')}-{digest}.json"
