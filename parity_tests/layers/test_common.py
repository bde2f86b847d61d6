"""The layers' shared projection (flax_attn.layers.common.dense): on CPU, from NT_MIN_ROWS rows
on, it reads its kernel transposed; every form is x @ kernel + bias, in outputs and in
reverse and forward mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from flax_attn.layers.common import NT_MIN_ROWS, dense


@pytest.mark.parametrize("rows", [3, NT_MIN_ROWS])
def test_dense_is_the_matmul(rows):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, rows // 2 if rows > 3 else rows, 5)))
    p = {"kernel": jnp.asarray(rng.standard_normal((5, 3))), "bias": jnp.asarray(rng.standard_normal(3))}
    want = lambda p, x: x @ p["kernel"] + p["bias"]  # noqa: E731
    transposed = "optimization_barrier" in str(jax.make_jaxpr(lambda p, x: dense(p, x))(p, x))
    assert transposed == (jax.default_backend() == "cpu" and rows >= NT_MIN_ROWS)
    assert_close(dense(p, x), want(p, x), np.float64, "dense")
    ct = jnp.asarray(rng.standard_normal(x.shape[:-1] + (3,)))
    for got, exp, name in zip(jax.vjp(dense, p, x)[1](ct), jax.vjp(want, p, x)[1](ct), ("params", "x")):
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(exp)):
            assert_close(g, e, np.float64, f"reverse mode, {name}")
    tangents = (jax.tree.map(jnp.ones_like, p), jnp.ones_like(x))
    assert_close(jax.jvp(dense, (p, x), tangents)[1], jax.jvp(want, (p, x), tangents)[1], np.float64, "forward mode")
