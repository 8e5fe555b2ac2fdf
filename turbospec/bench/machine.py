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

from .. import cpu_path
from ..host import hardware_name

# the vector units that decide our kernels' paths (kernels/): results from CPUs of one model name differ by them
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    """The CPU's model name, family and vector units: "AMD EPYC (family 26; avx2, avx512f, avx512_bf16)". Cloud
    CPUs often share a model name across generations (Zen 2, 4 and 5 all read "AMD EPYC"). Under a forced CPU path
    the units are those the path uses, and the line says it: "AMD EPYC (family 25; avx2) [TURBOSPEC_CPU_PATH=avx2]"."""
    family, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu family" and not family:
                family = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        return hardware_name("cpu")
    units = ", ".join(f for f in CPU_FLAGS if f in cpu_path.flags_in_use(flags))
    details = "; ".join(x for x in (f"family {family}" if family else "", units) if x)
    forced = "" if cpu_path.requested() == "auto" else f" [{cpu_path.VARIABLE}={cpu_path.requested()}]"
    return (f"{hardware_name('cpu')} ({details})" if details else hardware_name("cpu")) + forced


def source_commit() -> str:
    """HEAD's short hash, marked when tracked files differ from it (a result measured on uncommitted code)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD")
    return f"{commit} + uncommitted changes" if commit and git("status", "--porcelain", "--untracked-files=no") \
        else commit


def machine_info(threads: int, device: str = "cpu") -> dict[str, Any]:
    commit = source_commit()
    return {"platform": platform.platform(), "cpu": cpu_description(), "device": hardware_name(device),
            "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def benchmark_meta(threads: int, **extra: Any) -> dict[str, Any]:
    """The header every committed benchmark result starts with: command, machine, torch, date, commit."""
    where = machine_info(threads)
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": f"{where['cpu']}, {where['cpus']} CPUs", "threads": threads, "torch": where["torch"],
            "date": where["date"], "commit": where["commit"], **extra}


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The markdown lines a committed result opens with: the command, the machine, the date and commit."""
    return [f"- command: `{meta['command']}`", f"- machine: {meta['machine']}, {meta['threads']} threads, torch "
            f"{meta['torch']}", f"- date: {meta['date']}, commit {meta['commit']}"]


def save_results(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]], table: str) -> None:
    """OUT.json (meta + rows) and OUT.md (the table); drops the OUT.partial.json a resumable run kept."""
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table)
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    print(table)
