"""The benchmark's plumbing for platforms this machine does not have: which implementations the
GPT-2 layer benchmark times on each (every registered one that runs there and serves the call;
the others are listed with their reason). The timing itself runs in test_examples.py's smoke run."""
import pathlib
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # benchmarks/ is not installed
from benchmarks.run import layer_implementations  # noqa: E402

SHAPE = (8, 1024, 12, 64)  # B, T, N, H of the GPT-2-small layer


@pytest.mark.parametrize("platform, dtype, timed, declined", [
    ("cpu", jnp.float32, {"xla", "query_blocks", "blockwise"}, set()),
    ("gpu", jnp.bfloat16, {"xla", "query_blocks", "blockwise", "cudnn", "pallas_triton"}, {"pallas_decode"}),
    ("gpu", jnp.float32, {"xla", "query_blocks", "blockwise"}, {"cudnn", "pallas_triton", "pallas_decode"}),
    ("tpu", jnp.bfloat16, {"xla", "query_blocks", "blockwise", "splash"}, set()),
])
def test_layer_benchmark_times_every_implementation_that_serves_the_call(platform, dtype, timed, declined):
    served, reasons = layer_implementations(*SHAPE, dtype, platform)
    assert set(served) == timed and set(reasons) == declined
    assert all(isinstance(r, str) and r for r in reasons.values())
    if platform == "gpu" and dtype == jnp.bfloat16:
        assert "one query" in reasons["pallas_decode"]
