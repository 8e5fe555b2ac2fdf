"""Which kernel attends a sequence's short query (a decode, a verification window, a draft tree): torch's SDPA, our
two grouped matmuls (`attention_matmul.grouped_matmul_attention`) or our fused kernel that reads the paged cache in
place (`kernels/short_attention.cpp`). Measured per machine, thread count, torch version, kernel build and head
shape, cached under $TURBOSPEC_HOME/kernels.

Why measured: the faster one depends on the CPU, the query count and the context
(benchmarks/results/attention_paths/attention_paths.md for SDPA against the matmuls). SDPA and the matmuls are timed with the gather of the context's keys and values that
they need before they run, the fused kernel without (it reads the cache slots itself). Groups of several sequences
run the fused kernel where it won for one sequence at that query count and context, else the matmuls. The choice is
made once per attention group and step (`AttnGroup.kernel`).

TURBOSPEC_ATTENTION=sdpa, =matmul or =fused fixes the choice (read at each new choice: side-by-side measurements
set it, then call `forget()`); fused applies only where the kernel runs (built, bf16 or float32, head dim a multiple
of 16).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .attention_matmul import grouped_matmul_attention
from .host import best_ms, hardware_name, measured_once

SHORT_QUERY = 16  # at most this many queries per sequence: the short-query kernels' domain (longer chunks run SDPA)
# context lengths each query count is timed at, 2x apart; a call takes the choice made at the nearest (in ratio).
# For smollm2-135m's heads on the Zen 5, SDPA won 2-16 queries at 128 tokens and lost them at 1,000
# (benchmarks/results/attention_paths/attention_paths.md).
PROBE_CONTEXTS = (64, 128, 256, 512, 1024, 2048, 4096)
PROBE_REPEATS = 5
OVERRIDE = "TURBOSPEC_ATTENTION"
KERNELS = ("sdpa", "matmul", "fused")  # a tie goes to the earlier one

# (q heads, kv heads, head dim, dtype, threads, override) -> (query count, probed context) -> kernel
_choices: dict[tuple, dict[tuple[int, int], str]] = {}


def fused_runs(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether our fused kernel can attend these heads here: built, and a shape and dtype it takes."""
    from . import kernels

    return (head_dim % 16 == 0 and head_dim <= 512 and dtype in (torch.bfloat16, torch.float32)
            and kernels.load() is not None)


def short_query_kernel(num_queries: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> str:
    """Which kernel ("sdpa", "matmul" or "fused") attends one sequence's `num_queries` queries over `context` keys."""
    if num_queries > SHORT_QUERY:
        return "sdpa"
    override = os.environ.get(OVERRIDE, "")
    key = (q_heads, kv_heads, head_dim, dtype, torch.get_num_threads(), override)
    if key not in _choices:
        _choices[key] = _choose(q_heads, kv_heads, head_dim, dtype, override)
    return _choices[key][(num_queries, nearest_probe(context))]


def single_sequence_matmul(num_queries: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                           dtype: torch.dtype) -> bool:
    """Whether one sequence's `num_queries` queries over `context` keys run the grouped matmuls."""
    return short_query_kernel(num_queries, context, q_heads, kv_heads, head_dim, dtype) == "matmul"


@functools.lru_cache(maxsize=4096)  # asked once per attention group and step
def nearest_probe(context: int) -> int:
    """The probed context length nearest to `context` in ratio."""
    return min(PROBE_CONTEXTS, key=lambda c: abs(math.log(c / max(context, 1))))


def forget() -> None:
    """Drop this process's choices (the cache files stay): the next call decides again."""
    _choices.clear()


def choice_summary(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """Where our kernels run instead of SDPA, as a short string for cache keys (step-time profiles): per kernel and
    probed context, the query counts ("matmul 64:1 256:1,3-16; fused 64:2-16 ..."), or "none"."""
    kernels = []
    for name in KERNELS[1:]:
        parts = []
        for context in PROBE_CONTEXTS:
            counts = [q for q in range(1, SHORT_QUERY + 1)
                      if short_query_kernel(q, context, q_heads, kv_heads, head_dim, dtype) == name]
            if counts:
                parts.append(f"{context}:{_ranges(counts)}")
        if parts:
            kernels.append(f"{name} " + " ".join(parts))
    return "; ".join(kernels) or "none"


def _ranges(counts: list[int]) -> str:
    """[1, 3, 4, 5] -> "1,3-5"."""
    runs: list[list[int]] = []
    for q in counts:
        if runs and runs[-1][1] == q - 1:
            runs[-1][1] = q
        else:
            runs.append([q, q])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def winners(timings: dict[tuple[int, int], tuple[float, ...]]) -> dict[tuple[int, int], str]:
    """The kernel with the least time at each (query count, context) point; times in `KERNELS` order (a kernel not
    measured is infinite), a tie to the earlier kernel."""
    return {point: KERNELS[min(range(len(times)), key=lambda i: (times[i], i))] for point, times in timings.items()}


def _choose(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, override: str) -> dict[tuple[int, int], str]:
    points = [(q, c) for q in range(1, SHORT_QUERY + 1) for c in PROBE_CONTEXTS]
    if override in KERNELS:
        chosen = "matmul" if override == "fused" and not fused_runs(head_dim, dtype) else override
        return {point: chosen for point in points}
    if override:
        raise ValueError(f"{OVERRIDE}={override!r}: expected 'sdpa', 'matmul', 'fused' or unset (measured per machine)")
    from . import kernels

    key = (f"{hardware_name('cpu')}|{torch.get_num_threads()}|{torch.__version__}|{kernels.build_id()}|"
           f"{q_heads}x{kv_heads}x{head_dim}|{str(dtype).removeprefix('torch.')}|{PROBE_CONTEXTS}")

    def probe() -> dict[str, object]:
        timings = measure(q_heads, kv_heads, head_dim, dtype)
        return {"winners": {f"{q}@{c}": name for (q, c), name in winners(timings).items()},
                "ms": {f"{q}@{c}": list(t) for (q, c), t in timings.items()}, "kernels": list(KERNELS)}

    def parse(cached: dict) -> dict[tuple[int, int], str]:
        chosen = {tuple(int(n) for n in point.split("@")): name for point, name in cached["winners"].items()}
        if set(chosen) != set(points) or not set(chosen.values()) <= set(KERNELS):
            raise ValueError("another set of probe points or kernels")
        return chosen  # type: ignore[return-value]

    return measured_once("attention", key, probe, parse)


def measure(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            contexts: tuple[int, ...] = PROBE_CONTEXTS) -> dict[tuple[int, int], tuple[float, float, float]]:
    """(query count, context) -> (SDPA ms, matmul ms, fused ms: infinite where it cannot run), each the fastest of
    PROBE_REPEATS calls (host.best_ms: the fastest, so a call that lost the CPU to another process does not
    decide). The context sits in a paged cache twice its size, every other slot, as a sequence's blocks may."""

    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    fused = fused_runs(head_dim, dtype)
    timings: dict[tuple[int, int], tuple[float, float, float]] = {}
    for length in contexts:
        k_cache = torch.randn(2 * length, kv_heads, head_dim, generator=gen).to(dtype)
        v_cache = torch.randn(2 * length, kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.arange(0, 2 * length, 2)[None]

        def gathered(cache: torch.Tensor) -> torch.Tensor:
            return cache.index_select(0, slots[0]).view(1, length, kv_heads, head_dim).transpose(1, 2)

        for q_len in range(1, SHORT_QUERY + 1):
            q = torch.randn(1, q_len, q_heads, head_dim, generator=gen).to(dtype)
            mask = torch.ones(1, q_len, length, dtype=torch.bool)
            fns: tuple[Callable[[], torch.Tensor], ...] = (
                lambda: F.scaled_dot_product_attention(q.transpose(1, 2), gathered(k_cache), gathered(v_cache),
                                                       attn_mask=mask[:, None], scale=scale,
                                                       enable_gqa=kv_heads != q_heads),
                lambda: grouped_matmul_attention(q.transpose(1, 2), gathered(k_cache), gathered(v_cache), mask[:, None],
                                               scale))
            if fused:
                fns += (lambda: torch.ops.turbospec.short_query_attention(q, k_cache, v_cache, slots, mask, scale),)
            times = best_ms(fns, PROBE_REPEATS)
            timings[(q_len, length)] = (times[0], times[1], times[2] if fused else float("inf"))
    return timings
