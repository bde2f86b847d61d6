"""The benchmark's plumbing for platforms this machine does not have: which implementations the
GPT-2 layer benchmark times on each (every registered one that runs there and serves the call;
the others are listed with their reason). The timing itself runs in test_examples.py's smoke run."""
import jax.numpy as jnp
import pytest

from benchmarks.run import layer_implementations  # the repository root is on sys.path (conftest.py)

SHAPE = (8, 1024, 12, 64)  # B, T, N, H of the GPT-2-small layer


@pytest.mark.parametrize("platform, dtype, timed, declined", [
    ("cpu", jnp.float32, {"xla", "query_blocks", "blockwise"}, {"key_blocks"}),
    ("gpu", jnp.bfloat16, {"xla", "query_blocks", "blockwise", "cudnn", "pallas_triton"}, {"pallas_decode", "key_blocks"}),
    ("gpu", jnp.float32, {"xla", "query_blocks", "blockwise"}, {"cudnn", "pallas_triton", "pallas_decode", "key_blocks"}),
    ("tpu", jnp.bfloat16, {"xla", "query_blocks", "blockwise", "splash"}, {"key_blocks"}),
])
def test_layer_benchmark_times_every_implementation_that_serves_the_call(platform, dtype, timed, declined):
    served, reasons = layer_implementations(*SHAPE, dtype, platform)
    assert set(served) == timed and set(reasons) == declined
    assert all(isinstance(r, str) and r for r in reasons.values())
    if platform == "gpu" and dtype == jnp.bfloat16:
        assert "one query" in reasons["pallas_decode"]
    assert "without key/value lengths" in reasons["key_blocks"]  # a layer's call over the whole sequence


def test_fused_projection_contender_computes_the_module():
    """The benchmark's one-fused-QKV-matmul row times the same function as the module (three
    matmuls): equal outputs on the module's parameters."""
    import jax
    import numpy as np

    import flax_attn as fa
    from benchmarks.run import _Deterministic, _FusedProjections

    mha = fa.MultiHeadAttention(16, 16, 8, 0.0, 4)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    params = _Deterministic(mha).init(jax.random.key(0), x)
    want = _Deterministic(mha).apply(params, x)
    got = _FusedProjections(mha).apply(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
