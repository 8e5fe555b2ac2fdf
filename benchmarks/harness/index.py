"""What each committed result says about itself: date, machine, machine class and command, read from its JSON.

Results written through the harness hold them in `meta` (harness/provenance.py); older ones put them in
`metadata` (engine_throughput), at the top level (goodput_sweep, simulator_*) or in `machine` dicts
(machine_info: serve_compare, determinism_overhead). Files that hold no run (recorded traces, step-time profiles,
one server run of serve_compare) are not results. Imports nothing of ours and no torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .machines import UNRECORDED, machine_class
from .output import RESULTS

MACHINES = RESULTS / "MACHINES.tsv"  # classes of results whose metadata predates the vector units
_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})(?:[ T](\d{2}:\d{2}))?")


@dataclass
class Result:
    path: Path  # the .json
    benchmark: str  # its folder
    date: str  # "YYYY-MM-DD HH:MM" (time where recorded), sortable
    machine: str
    machine_class: str
    class_source: str  # "recorded", or MACHINES.tsv's reason
    command: str
    data: dict[str, Any]

    @property
    def markdown(self) -> Path:
        return self.path.with_suffix(".md")


def provenance(data: dict[str, Any]) -> tuple[str, str, str] | None:
    """(date, machine, command) of a result's JSON, or None where it holds no run's provenance."""
    meta = data.get("meta") if isinstance(data.get("meta"), dict) else data.get("metadata")
    if isinstance(meta, dict) and "date" in meta:
        machine = meta.get("machine") or meta.get("cpu_model") or ""
        return str(meta["date"]), machine, str(meta.get("command", ""))
    machine = data.get("machine")
    if isinstance(machine, dict) or "commands" in data or ("command" in data and "date" in data):
        cpu = machine.get("cpu", "") if isinstance(machine, dict) else str(machine or "")
        date = data.get("date") or (machine.get("date") if isinstance(machine, dict) else "") or ""
        command = data.get("command") or " && ".join(data.get("commands") or [])
        return str(date), cpu, str(command)
    return None


def known_classes(path: Path = MACHINES) -> dict[str, tuple[str, str]]:
    """MACHINES.tsv: result path under results/ -> (class, why)."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip() and not line.startswith("#"):
            name, cls, why = line.split("\t", 2)
            out[name] = (cls, why)
    return out


def results(root: Path = RESULTS, include_archive: bool = False) -> list[Result]:
    """Every result under root/<benchmark>/ (archive/ only if asked), oldest first."""
    known = known_classes(root / MACHINES.name)
    found = []
    paths = [*root.glob("*/*.json"), *(root.glob("*/archive/*.json") if include_archive else [])]
    for path in sorted(paths):  # (deeper files, e.g. serve_compare_runs/, are parts of a result)
        rel = path.relative_to(root)
        if path.name.endswith(".partial.json"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        got = provenance(data) if isinstance(data, dict) else None
        if got is None:
            continue
        date, machine, command = got
        match = _DATE.search(date)
        date = " ".join(x for x in match.groups() if x) if match else ""
        cls, source = machine_class(machine), "recorded"
        if cls == UNRECORDED and rel.as_posix() in known:
            cls, source = known[rel.as_posix()]
        found.append(Result(path, rel.parts[0], date, machine, cls, source, command, data))
    return sorted(found, key=lambda r: r.date)
