"""The examples run and reach their own checks (each exits non-zero when its check fails)."""
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
@pytest.mark.parametrize("script, expect", [
    ("chapter_walkthrough.py", "22 of 22 printed numbers reproduced."),
    ("tiny_decoder.py", "same tokens: True"),
    ("nnx_decoder.py", "same tokens: True"),
    ("hf_checkpoint.py", "checkpoint round trip: OK"),
])
def test_example_runs(script, expect):
    result = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert expect in result.stdout


@pytest.mark.slow
def test_benchmark_suite_runs(tmp_path):
    # Tiny sizes, one repeat: checks that the suite runs and writes its files. No timing is judged.
    root = EXAMPLES.parent
    result = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".png"]
    assert "KV-cache decoding" in result.stdout
    assert "KV-cache decode step" in result.stdout  # against PyTorch eager (benchmarks.decode)
    assert "Absorbed multi-head latent attention decode step" in result.stdout  # benchmarks.decode_mla
