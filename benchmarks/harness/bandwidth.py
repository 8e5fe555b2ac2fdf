"""The machine's streaming read bandwidth: what a decode step that reads every weight once is bounded by."""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

GB = 1e9


def measure_bandwidth(gib: float = 1.0, trials: int = 5) -> dict[str, Any]:
    """Read bandwidth: time ``t.sum()`` over a float32 tensor of `gib` GiB, best of `trials` (after a warm-up)."""
    n = int(gib * 2**30) // 4
    t = torch.ones(n, dtype=torch.float32)  # ones, not empty: touch every page before timing
    t.sum()
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - start)
    nbytes = t.numel() * t.element_size()
    del t
    gc.collect()
    best = min(times)
    return {"method": "float32 tensor.sum() read", "bytes": nbytes, "trials_s": times, "best_s": best,
            "gb_per_s": nbytes / best / GB, "threads": torch.get_num_threads()}
