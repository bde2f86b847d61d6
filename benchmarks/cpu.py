"""The CPU every benchmark names in its tables and result files.

A model name alone does not tell CPU kinds apart under a hypervisor: two generations of AMD's
server parts both report ``AMD EPYC``, with different caches and matmul rates. So the kind
is the model name with the x86 family and model numbers and the per-core L2 size beside it,
and the result files carry the family and model in their names.
"""
from __future__ import annotations

import platform
import subprocess
from typing import Optional

from flax_attn.core import tuning


def name() -> str:
    """``lscpu``'s model name (e.g. ``AMD EPYC``); ``/proc/cpuinfo``'s where there is no
    ``lscpu``; else the platform's processor string, or ``unknown cpu``."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name:"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        pass
    return tuning.cpu_field("model name") or platform.processor() or "unknown cpu"


def family_model() -> Optional[tuple[int, int]]:
    """The x86 ``(cpu family, model)`` numbers from /proc/cpuinfo, e.g. ``(26, 2)``; None where
    they are not published (not Linux, not x86)."""
    try:
        return int(tuning.cpu_field("cpu family")), int(tuning.cpu_field("model"))
    except (TypeError, ValueError):
        return None


def kind() -> str:
    """:func:`name` with the family, model and per-core L2 size, as the tables print the machine:
    ``AMD EPYC (family 26, model 2, L2 1 MiB/core)``."""
    numbers = family_model()
    parts = ([f"family {numbers[0]}", f"model {numbers[1]}"] if numbers else []) + [
        f"L2 {tuning.l2_cache_bytes() / 2**20:g} MiB/core"]
    return f"{name()} ({', '.join(parts)})"


def last_level_cache_bytes() -> int:
    """The largest CPU cache of CPU 0 (the L3 on the CPUs measured) in bytes, from Linux sysfs;
    32 MiB where it cannot be read."""
    return max(tuning.cache_bytes().values(), default=32 << 20)


def slug() -> str:
    """:func:`name` lowercased for file names, spaces to dashes, without (R)/(TM), and the family
    and model where known: ``amd-epyc-family26-model2``."""
    base = "-".join(name().lower().replace("(r)", "").replace("(tm)", "").split())
    numbers = family_model()
    return base + (f"-family{numbers[0]}-model{numbers[1]}" if numbers else "")


# Variables that change which instructions or threads the contenders use: a run under any of
# them (e.g. every framework held to AVX2 on an AVX-512 machine) is not the machine's own.
ENVIRONMENT = ("FLAX_ATTN_CPU_ISA", "XLA_FLAGS", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS",
               "OMP_WAIT_POLICY")


def environment() -> dict:
    """The :data:`ENVIRONMENT` variables set in this process, by name (empty where none is)."""
    import os

    return {k: os.environ[k] for k in ENVIRONMENT if os.environ.get(k)}


def environment_text(env: dict) -> str:
    """``'; NAME=value'`` for each of a result file's ``environment`` entries, for a table's title."""
    return "".join(f"; {k}={v}" for k, v in env.items())
