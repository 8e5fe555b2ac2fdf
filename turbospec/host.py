"""The machine this process runs on and what is measured on it once: its name, the cache root ($TURBOSPEC_HOME),
the timing rule for kernel choices, and writing the caches (weights, profiles, measured crossovers, searched plans)
when several processes may do it at once (parallel test workers, Ray replicas, two servers starting together).

A leaf: it imports nothing of turbospec's, so every layer (kernels, attention, models, tuning) may use it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def turbospec_home() -> Path:
    """Root of everything turbospec caches: ``$TURBOSPEC_HOME`` or ``~/.cache/turbospec``."""
    return Path(os.environ.get("TURBOSPEC_HOME") or Path.home() / ".cache" / "turbospec")


def hardware_name(device: str) -> str:
    """The accelerator's or CPU's model name: part of every measured-once cache key."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def best_ms(fns: tuple, repeats: int) -> list[float]:
    """The fastest of `repeats` calls of each function, the functions taking turns. The fastest, not the median:
    on a shared machine a call that loses the CPU takes a whole scheduler slice (8 ms), and medians measured while
    another process ran left half the linears of a 0.5B model on the slower kernel, cached for good. The fastest
    call is what the kernel costs; the question asked is which kernel is faster, not how loaded the machine is."""
    for fn in fns:
        fn()  # warm-up: first calls pay for allocation and thread start
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [b * 1e3 for b in best]


# A pool of weight copies this large streams from memory when a timed call runs over all of them: more than the
# last-level cache of the CPUs seen here (32 MiB on the Zen 4, up to 60 MiB on the AMX Xeons).
STREAM_POOL_BYTES = 96 << 20


def past_the_cache(first: T, nbytes: int, clone: Callable[[T], T]) -> list[T]:
    """`first` and copies of it (`clone`) adding up to at least STREAM_POOL_BYTES, for timing a product as a model's
    step runs it: every weight read from memory once. A weight timed alone stays in the cache after the first call, and
    there an unpacked bf16 product beats a packed one that reads a third of the bytes (qwen2.5-coder-0.5b's
    9728 x 896 gate|up on the Zen 4: 0.138 ms bf16 against 0.144 ms Q5_0 records in cache, so it ran bf16 and the
    model decoded at 36.0 ms/token against 18.5 when timed streamed: benchmarks/results/crossover_streaming)."""
    return [first] + [clone(first) for _ in range(max(1, STREAM_POOL_BYTES // max(nbytes, 1)) - 1)]


def replace_atomically(path: Path, write: Callable[[Path], object]) -> None:
    """`write` fills a file of this process's own beside `path`, which then takes its place: a reader never sees
    half a file, two writers never write into one, and a crash leaves no truncated cache behind. The temporary
    name keeps the suffix (np.save would add one otherwise)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.partial{path.suffix}")
    write(tmp)
    tmp.replace(path)


def write_text_atomically(path: Path, text: str) -> None:
    replace_atomically(path, lambda tmp: tmp.write_text(text))


@contextmanager
def exclusive_lock(path: Path) -> Iterator[int]:
    """Held by one process at a time (an advisory lock on `path`, released when the block ends or the process
    dies): for work that reads a cache, adds to it and writes it back, or builds it once for everyone. Yields
    the lock's file descriptor: a child process given it holds the lock until it exits too."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield lock.fileno()


# --- records of cached files: what was written, to know when it no longer is ---------------------------------

NO_RECORD = "no record of it was kept"


def record_path(path: Path) -> Path:
    return path.with_name(path.name + ".record.json")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_file_record(path: Path) -> None:
    """Record a cache file's size, modification time and sha256 beside it, as written."""
    stat = path.stat()
    record = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_of(path)}
    write_text_atomically(record_path(path), json.dumps(record))


def file_record_problem(path: Path, full: bool = False) -> str | None:
    """Why the file at `path` is not what was recorded when it was written, or None when it is. Its size is
    always compared; its sha256 when `full`, or when its modification time moved (a file rewritten in place at
    the same size). NO_RECORD when there is no record (its reader must then judge it)."""
    try:
        record = json.loads(record_path(path).read_text())
        size, mtime_ns, sha256 = int(record["size"]), int(record["mtime_ns"]), str(record["sha256"])
    except FileNotFoundError:
        return NO_RECORD
    except (OSError, ValueError, KeyError, TypeError):
        return f"its record {record_path(path)} is unreadable"
    try:
        stat = path.stat()
    except OSError:
        return "it is missing"
    if stat.st_size != size:
        return f"it has {stat.st_size} bytes, {size} when it was written (truncated or replaced?)"
    if full or stat.st_mtime_ns != mtime_ns:
        if sha256_of(path) != sha256:
            return "its sha256 differs from the one recorded when it was written (corrupted?)"
        if stat.st_mtime_ns != mtime_ns:  # touched, not changed: the fast check holds again
            write_file_record(path)
    return None


def measured_once(kind: str, key: str, measure: Callable[[], dict[str, Any]], read: Callable[[dict[str, Any]], T]) -> T:
    """A measurement made once per machine (whatever `key` names: CPU, threads, torch, build, shape), cached as
    $TURBOSPEC_HOME/kernels/<kind>-<hash of key>.json: `read` of the cached JSON, or, when there is none or `read`
    cannot make sense of it, of what `measure()` returns (saved with the key, for whoever opens the file)."""
    path = turbospec_home() / "kernels" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    try:
        return read(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    data = {"key": key, **measure()}
    write_text_atomically(path, json.dumps(data, indent=1))  # (json writes an infinite float as Infinity)
    return read(data)
