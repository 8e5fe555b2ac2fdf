"""Where packed kernels stop paying: measured per weight shape, cached per machine.

For each packed signature (kinds and shapes of its parts) we time the packed product and the dense one on the same
random activations for 1..32 rows, each weight read from memory as in a model's step (one weight timed alone stays
in the cache, where a dense bf16 product can beat a packed one that reads a third of its bytes), and keep the
largest row count up to which packed was faster at every count. Nothing is hard-coded: on a CPU where the int4
kernel loses even at one row, the crossover is 0 and the linear runs dense. Then the prefill sizes (48, 64, 128,
256 rows), largest first: calls from the smallest size from which packed won at every larger one run packed too
(our AMX kernel expands the weights once per call and runs a GEMM: it reads a quarter of the bytes; on CPUs without
AMX the dense bf16 matmul is the slow side). Where packed won at every decode count and every prefill size, the
counts between (33..47) run packed as well: a chat prompt is often that long, and on 2 cores without AVX-512 the
dense product costs several times the packed one there (results/packed_kernels/packed_kernels_zen4_avx2.md: the
17920 x 1536 gate|up at 16 rows 20.8 ms dense, 2.9 ms packed with int8 activations). Measured once per (signature,
dtype, threads, hardware, torch); a 1.5B model's six signatures take a few seconds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..host import best_ms, exclusive_lock, hardware_name, past_the_cache, turbospec_home, write_text_atomically
from .layers import row_linear
from .packed import PackedWeight

ROWS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)  # decode and verification
# A timed pass over a weight's copies takes at most about this long: a call slow enough to need fewer copies is
# compute-bound, in cache or not, and without the cap a slow product (torch's int4 kernel in float32, at 32 rows)
# would run once per copy of a small weight, hundreds of times a pass.
POOL_PASS_S = 0.02
GEMM_ROWS = (48, 64, 128, 256)  # prefill chunks (48: a short chat prompt)


@dataclass(frozen=True)
class Crossover:
    max_rows: int  # packed for calls of up to this many rows
    gemm_rows: int  # ... and for calls of at least this many (0: never)


def measure(packed: PackedWeight, dense: torch.Tensor, row_counts: tuple[int, ...] = ROWS, repeats: int = 5,
            max_losses: int = 2) -> dict[int, tuple[float, float]]:
    """rows -> (packed ms, dense ms) a call, stopping once packed has lost `max_losses` times.

    Decode and verification sizes (up to ROWS[-1]) time each side over copies of its weight adding up to more
    than the last-level cache (host.past_the_cache), so that every call reads its weight from memory as a model's
    step does, as many as a pass of POOL_PASS_S holds; prefill sizes, compute-bound, time one copy."""
    gen = torch.Generator().manual_seed(0)
    out: dict[int, tuple[float, float]] = {}
    losses = 0
    streamed = (past_the_cache(packed, packed.nbytes, PackedWeight.clone),
                past_the_cache(dense, dense.nbytes, torch.Tensor.clone)) if min(row_counts) <= ROWS[-1] else None
    for rows in row_counts:
        x = torch.randn(rows, dense.shape[1], generator=gen).to(dense.dtype)
        packs, denses = [packed], [dense]
        if streamed and rows <= ROWS[-1]:
            one_p, one_d = best_ms((lambda: packed.mm(x), lambda: row_linear(x, dense)), 1)
            packs, denses = streamed[0][:_copies(one_p)], streamed[1][:_copies(one_d)]
        pool_p, pool_d = best_ms((lambda: [w.mm(x) for w in packs], lambda: [row_linear(x, w) for w in denses]),
                                 repeats)  # (the dense path as run)
        p, d = pool_p / len(packs), pool_d / len(denses)
        out[rows] = (p, d)
        losses += p >= d
        if losses >= max_losses:
            break
    return out


def _copies(call_ms: float) -> int:
    """How many copies one timed pass may run, for calls of call_ms each (POOL_PASS_S)."""
    return max(1, int(POOL_PASS_S * 1e3 / max(call_ms, 1e-6)))


def crossover_rows(timings: dict[int, tuple[float, float]]) -> int:
    """The largest row count up to which packed won at every measured count."""
    best = 0
    for rows in sorted(timings):
        p, d = timings[rows]
        if p >= d:
            break
        best = rows
    return best


def gemm_crossover(timings: dict[int, tuple[float, float]], decode_rows: int) -> int:
    """The row count from which calls run packed again: the smallest prefill size from which packed won at every
    larger one (0: it lost at the largest, or none was measured); the first row count above the decode sizes
    when packed also won at all of those (decode_rows, crossover_rows' answer, is the last of them: no dense gap
    between decode and prefill)."""
    start = 0
    for rows in reversed(GEMM_ROWS):
        if rows not in timings or timings[rows][0] >= timings[rows][1]:
            break
        start = rows
    if start == GEMM_ROWS[0] and decode_rows == ROWS[-1]:
        return ROWS[-1] + 1
    return start


class CrossoverCache:
    """signature -> rows, in one JSON file per machine key (under $TURBOSPEC_HOME/kernels)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.data: dict[str, dict] = json.loads(path.read_text())
        except (OSError, ValueError):
            self.data = {}
        self.measured: set[str] = set()  # what this process measured (the rest may be stale copies)

    def get(self, packed: PackedWeight, dense: torch.Tensor) -> Crossover:
        entry = self.data.get(packed.signature)
        if entry is None or "packed_from" not in entry:  # (files from before the 48-row prefill size)
            timings = measure(packed, dense)
            # largest first, one loss ends it: packed runs the prefill sizes from which it wins at every larger one
            timings.update(measure(packed, dense, GEMM_ROWS[::-1], repeats=3, max_losses=1))
            rows = crossover_rows({r: t for r, t in timings.items() if r in ROWS})
            entry = {"rows": rows, "packed_from": gemm_crossover(timings, rows),
                     "ms": {str(r): list(t) for r, t in timings.items()}}
            self.data[packed.signature] = entry
            self.measured.add(packed.signature)
        return Crossover(int(entry["rows"]), int(entry["packed_from"]))

    def save(self) -> None:
        if not self.measured:
            return
        # two processes loading models at once (pytest workers, replicas) each measure their own signatures:
        # under a lock, what this one measured joins what the file holds now (not the copy read at start, which
        # would put back entries another process has since re-measured)
        with exclusive_lock(self.path.with_suffix(".lock")):
            try:
                on_disk = json.loads(self.path.read_text())
            except (OSError, ValueError):
                on_disk = {}
            self.data = {**on_disk, **{k: self.data[k] for k in self.measured}}
            write_text_atomically(self.path, json.dumps(self.data, indent=1, sort_keys=True))
        self.measured.clear()


def cache_path(dtype: torch.dtype) -> Path:
    import hashlib

    from .. import kernels

    kernel = kernels.build_id()  # the int8 fallback, or another version of the kernel, has other timings
    # "best": timings are the fastest of several calls (best_ms); files of medians are measured again.
    # The dense side is our bf16 kernel up to its measured rows, or torch's (TURBOSPEC_NO_BF16_ROWS=1): its own key.
    dense = f"|{kernels.bf16_rows_limit()}" if dtype == torch.bfloat16 else ""  # (other dtypes: keys as before)
    # the records' kernel (AMX, AVX512-BF16, AVX2) is switched per process on one machine: its own key
    records = f"|records-{kernels.records_path()}"
    # "streamed": decode sizes timed with the weights read from memory (files timed in cache are measured again)
    key = (f"{hardware_name('cpu')}|{torch.get_num_threads()}|{torch.__version__}|{dtype}|{kernel}|best{dense}"
           f"{records}|streamed")
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return turbospec_home() / "kernels" / f"crossover-{str(dtype).removeprefix('torch.')}-{digest}.json"
