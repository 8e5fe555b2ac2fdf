"""The provenance header every result starts with: command, machine (CPU name, family, vector units and class),
torch, date and git commit. One source: turbospec/bench/machine.py; this adds the machine class
(harness/machines.py) that benchmarks/latest.py groups results by."""

from __future__ import annotations

from typing import Any

from .machines import machine_class


def benchmark_meta(threads: int, **extra: Any) -> dict[str, Any]:
    """turbospec.bench.machine.benchmark_meta (command, machine, threads, torch, date, commit, `extra`) and
    `machine_class`."""
    from turbospec.bench.machine import benchmark_meta as meta

    out = meta(threads, **extra)
    out["machine_class"] = machine_class(out["machine"])
    return out


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The markdown lines a result opens with: the command, the machine, the date and commit."""
    from turbospec.bench.machine import header_lines as lines

    return lines(meta)
