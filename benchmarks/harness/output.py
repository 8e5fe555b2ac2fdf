"""Where results go and how they are written: benchmarks/results/<benchmark>/<name>.json (meta + rows) and .md
(a short table), the machine in the JSON's meta, never in the file name (benchmarks/latest.py indexes them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent.parent / "results"


def default_out(benchmark: str, name: str | None = None) -> Path:
    """The output stem of a benchmark's result: benchmarks/results/<benchmark>/<name or benchmark>."""
    return RESULTS / benchmark / (name or benchmark)


def save(out: Path | str, meta: dict[str, Any], rows: list[dict[str, Any]], table: str) -> None:
    """OUT.json ({"meta", "rows"}) and OUT.md (`table`), the folder made; prints the table and drops the
    OUT.partial.json a resumable run kept."""
    from turbospec.bench.machine import save_results

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_results(out, meta, rows, table)


def table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A markdown table's lines: the header, the rule and one line per row (cells as given, str() of each)."""
    return [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}",
            *(f"| {' | '.join(map(str, r))} |" for r in rows)]


class Partial:
    """The rows a stopped run saved in OUT.partial.json, so it can go on (`--resume`) losing one row at most."""

    def __init__(self, out: Path | str, resume: bool = True) -> None:
        self.path = Path(out).with_suffix(".partial.json")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(self.path.read_text()) if resume and self.path.exists() else []
        self.rows: list[dict[str, Any]] = data["rows"] if isinstance(data, dict) else data

    def save(self, meta: dict[str, Any] | None = None) -> None:
        self.path.write_text(json.dumps(self.rows if meta is None else {"meta": meta, "rows": self.rows}))
