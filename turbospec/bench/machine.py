"""What every committed benchmark result records about where it ran."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from typing import Any

import torch

from ..control.profiler import hardware_name


def machine_info(threads: int, device: str = "cpu") -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"platform": platform.platform(), "cpu": hardware_name("cpu"), "device": hardware_name(device),
            "cpus": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
