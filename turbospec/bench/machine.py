"""What every committed benchmark result records about where it ran."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..control.profiler import hardware_name


def machine_info(threads: int, device: str = "cpu") -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"platform": platform.platform(), "cpu": hardware_name("cpu"), "device": hardware_name(device),
            "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def benchmark_meta(threads: int, **extra: Any) -> dict[str, Any]:
    """The header every committed benchmark result starts with: command, machine, torch, date, commit."""
    where = machine_info(threads)
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{where['cpu']}, {where['cpus']} CPUs", "threads": threads, "torch": where["torch"],
            "date": where["date"], "commit": where["commit"], **extra}


def save_results(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]], table: str) -> None:
    """OUT.json (meta + rows) and OUT.md (the table); drops the OUT.partial.json a resumable run kept."""
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(table)
