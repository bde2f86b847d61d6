"""examples/sharded.py runs (it sets 8 virtual CPU devices itself) and reaches its own check."""
import pathlib
import subprocess
import sys

import pytest

from conftest import child_env

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "sharded.py"


@pytest.mark.slow
def test_sharded_example_runs():
    result = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "all equal to one device: True" in result.stdout
    assert "one device holds (64, 16)" in result.stdout  # the kernel really is split over 4 devices
