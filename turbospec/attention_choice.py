"""Which kernel attends one sequence's short query (a decode, a verification window, a draft tree): torch's SDPA or
our two grouped matmuls (`attention._short_query_attention`). Measured per machine, thread count, torch version and
head shape, cached under $TURBOSPEC_HOME/kernels.

Why measured: the faster one depends on the CPU, the query count and the context. On a Xeon (torch 2.13, 2 threads)
SDPA won for one sequence (one decode at 320 tokens: 47 us against 113 us; ad hoc, not a committed run), which is
why a group of one always ran SDPA. On an AMD EPYC (Zen 5, 2 threads) SDPA's flash kernel took 0.38 ms for one
qwen2.5-coder-1.5b query at 320 tokens of context and 1.15 ms at 1,000, where the matmuls took 0.08 and 0.12 ms;
one request's decode step at 1,500 tokens then took 97 ms instead of 155 (1.60x; smollm2-135m 1.55x), while at 128
tokens the two were within the machine's noise (benchmarks/results/attention_paths.md). Groups of several sequences
always run the matmuls. The choice is made once per attention group and step (`AttnGroup.runs_matmuls`).

TURBOSPEC_ATTENTION=sdpa or =matmul fixes the choice (read at each new choice: side-by-side measurements set it,
then call `forget()`).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .cache_files import measured_once

SHORT_QUERY = 16  # at most this many queries per sequence: the matmuls' domain (longer chunks run SDPA)
# context lengths each query count is timed at, 2x apart; a call takes the choice made at the nearest (in ratio).
# Both matter: for smollm2-135m's heads on the Zen 5, SDPA won 2-16 queries at 128 tokens and lost them at 1,000
# (benchmarks/results/attention_paths.md).
PROBE_CONTEXTS = (64, 128, 256, 512, 1024, 2048, 4096)
PROBE_REPEATS = 5
OVERRIDE = "TURBOSPEC_ATTENTION"

# (q heads, kv heads, head dim, dtype, threads, override) -> the (query count, probed context) pairs the matmuls run
_choices: dict[tuple, frozenset[tuple[int, int]]] = {}


def single_sequence_matmul(num_queries: int, context: int, q_heads: int, kv_heads: int, head_dim: int,
                           dtype: torch.dtype) -> bool:
    """Whether one sequence's `num_queries` queries over `context` keys run the grouped matmuls rather than SDPA."""
    if num_queries > SHORT_QUERY:
        return False
    override = os.environ.get(OVERRIDE, "")
    key = (q_heads, kv_heads, head_dim, dtype, torch.get_num_threads(), override)
    if key not in _choices:
        _choices[key] = _choose(q_heads, kv_heads, head_dim, dtype, override)
    return (num_queries, nearest_probe(context)) in _choices[key]


@functools.lru_cache(maxsize=4096)  # asked once per attention group and step
def nearest_probe(context: int) -> int:
    """The probed context length nearest to `context` in ratio."""
    return min(PROBE_CONTEXTS, key=lambda c: abs(math.log(c / max(context, 1))))


def forget() -> None:
    """Drop this process's choices (the cache files stay): the next call decides again."""
    _choices.clear()


def choice_summary(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """Where the matmuls run, as a short string for cache keys (step-time profiles): per probed context, the query
    counts ("64:1 256:1,3-16 ..."), or "none"."""
    parts = []
    for context in PROBE_CONTEXTS:
        counts = [q for q in range(1, SHORT_QUERY + 1)
                  if single_sequence_matmul(q, context, q_heads, kv_heads, head_dim, dtype)]
        if counts:
            parts.append(f"{context}:{_ranges(counts)}")
    return " ".join(parts) or "none"


def _ranges(counts: list[int]) -> str:
    """[1, 3, 4, 5] -> "1,3-5"."""
    runs: list[list[int]] = []
    for q in counts:
        if runs and runs[-1][1] == q - 1:
            runs[-1][1] = q
        else:
            runs.append([q, q])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def matmul_wins(timings: dict[tuple[int, int], tuple[float, float]]) -> frozenset[tuple[int, int]]:
    """The (query count, context) points whose (matmul ms, SDPA ms) favour the matmuls."""
    return frozenset(point for point, (matmul, sdpa) in timings.items() if matmul < sdpa)


def _choose(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            override: str) -> frozenset[tuple[int, int]]:
    if override == "sdpa":
        return frozenset()
    if override == "matmul":
        return frozenset((q, c) for q in range(1, SHORT_QUERY + 1) for c in PROBE_CONTEXTS)
    if override:
        raise ValueError(f"{OVERRIDE}={override!r}: expected 'sdpa', 'matmul' or unset (measured per machine)")
    from .control.profiler import hardware_name  # (lazy: the profiler imports the engine, which imports us)

    key = (f"{hardware_name('cpu')}|{torch.get_num_threads()}|{torch.__version__}|{q_heads}x{kv_heads}x{head_dim}|"
           f"{str(dtype).removeprefix('torch.')}|{PROBE_CONTEXTS}")

    def probe() -> dict[str, object]:
        timings = measure(q_heads, kv_heads, head_dim, dtype)
        return {"matmul": sorted(matmul_wins(timings)), "ms": {f"{q}@{c}": t for (q, c), t in timings.items()}}

    return measured_once("attention", key, probe,
                         lambda cached: frozenset((int(q), int(c)) for q, c in cached["matmul"]))


def measure(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
            contexts: tuple[int, ...] = PROBE_CONTEXTS) -> dict[tuple[int, int], tuple[float, float]]:
    """(query count, context) -> (matmul ms, SDPA ms), each the fastest of PROBE_REPEATS calls
    (models/crossover.best_ms: the fastest, so a call that lost the CPU to another process does not decide)."""
    from .attention import _short_query_attention  # (lazy: attention imports us)
    from .models.crossover import best_ms

    gen = torch.Generator().manual_seed(0)
    scale = head_dim ** -0.5
    timings: dict[tuple[int, int], tuple[float, float]] = {}
    for length in contexts:
        k = torch.randn(1, kv_heads, length, head_dim, generator=gen).to(dtype)
        v = torch.randn(1, kv_heads, length, head_dim, generator=gen).to(dtype)
        for q_len in range(1, SHORT_QUERY + 1):
            q = torch.randn(1, q_heads, q_len, head_dim, generator=gen).to(dtype)
            mask = torch.ones(1, 1, q_len, length, dtype=torch.bool)
            fns: tuple[Callable[[], torch.Tensor], ...] = (
                lambda: _short_query_attention(q, k, v, mask, scale),
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                       enable_gqa=kv_heads != q_heads))
            matmul, sdpa = best_ms(fns, PROBE_REPEATS)
            timings[(q_len, length)] = (matmul, sdpa)
    return timings
