"""Writing the caches under $TURBOSPEC_HOME (weights, profiles, measured crossovers, searched plans) when several
processes may do it at once: parallel test workers, Ray replicas, two servers starting together."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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
def exclusive_lock(path: Path) -> Iterator[None]:
    """Held by one process at a time (an advisory lock on `path`, released when the block ends or the process
    dies): for work that reads a cache, adds to it and writes it back, or builds it once for everyone."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def measured_once(kind: str, key: str, measure: Callable[[], dict[str, Any]], read: Callable[[dict[str, Any]], T]) -> T:
    """A measurement made once per machine (whatever `key` names: CPU, threads, torch, build, shape), cached as
    $TURBOSPEC_HOME/kernels/<kind>-<hash of key>.json: `read` of the cached JSON, or, when there is none or `read`
    cannot make sense of it, of what `measure()` returns (saved with the key, for whoever opens the file)."""
    from .models.registry import turbospec_home  # (lazy: the registry writes through this module)

    path = turbospec_home() / "kernels" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    try:
        return read(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    data = {"key": key, **measure()}
    write_text_atomically(path, json.dumps(data, indent=1))  # (json writes an infinite float as Infinity)
    return read(data)
