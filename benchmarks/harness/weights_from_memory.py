"""Timing a product whose weights are read from memory, as a decode step reads them: the weights are evicted from
the caches before each call by reading a buffer larger than them (no dirty lines to write back)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

# qwen2.5-coder-1.5b's largest packed linears of each GGUF block type, name: (GGUF type, out features, in features)
SHAPES = {
    "gate|up Q4_K": ("Q4_K", 17920, 1536),
    "down Q6_K": ("Q6_K", 1536, 8960),
    "LM head Q6_K": ("Q6_K", 151936, 1536),
}


def eviction_buffer() -> torch.Tensor:
    """512 MiB of float32, far beyond any last-level cache here: `.sum()` evicts what the caches held."""
    return torch.ones(2**27)


def median_ms(fn: Callable[[], Any], repeats: int, flush: torch.Tensor | None) -> float:
    """Median time of `fn` after one warm-up call; with `flush` (an eviction_buffer), the weights evicted before
    each call, else left in the caches by the call before (the kernel's arithmetic alone, where they fit)."""
    fn()
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.sum()  # evict the weights: the call reads them from memory
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3
