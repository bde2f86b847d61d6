"""The CPU's model name, as every benchmark names its machine in tables and result files."""
from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def name() -> str:
    """``lscpu``'s model name (e.g. ``AMD EPYC``); ``/proc/cpuinfo``'s where there is no
    ``lscpu``; else the platform's processor string, or ``unknown cpu``."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown cpu"


def slug() -> str:
    """:func:`name` lowercased for file names, spaces to dashes, without (R)/(TM): ``amd-epyc``."""
    return "-".join(name().lower().replace("(r)", "").replace("(tm)", "").split())
