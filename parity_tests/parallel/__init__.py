"""Tests of flax_attn.parallel. Each module runs its measurements once in a child process with 8
virtual CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8`` must be set before
JAX starts; the pytest process has already started it with one), which prints them as JSON; the
tests assert on them."""
import json
import os
import subprocess
import sys

from conftest import child_env

DEVICES = 8


def run_child(script: str, *args: str, timeout: int = 900) -> dict:
    """Run ``python script --child args...`` with 8 virtual CPU devices; its last stdout line is JSON."""
    env = child_env(JAX_PLATFORMS="cpu")  # compile-bound like the suite itself (see conftest)
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={DEVICES}"
    proc = subprocess.run([sys.executable, script, "--child", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(script)} child failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
