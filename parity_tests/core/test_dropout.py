"""Dropout on attention weights (flax_attn.dropout, dot_product_attention's dropout_rate):
inverted scaling by 1/(1-p), with explicit keys, a function of its key alone. torch's RNG cannot
be matched, so the rate and the scaling are tested statistically, and exactness where dropout
is off. The chapter modules' deterministic flag: textbook/test_chapter_dropout.py.

(The attention core's test: it belongs in parity_tests/core/.)
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
from conftest import child_env


def _binomial_bounds(n, p, sigmas=6.0):
    sd = np.sqrt(n * p * (1 - p))
    return n * p - sigmas * sd, n * p + sigmas * sd


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_rate_and_inverted_scaling(rate):
    x = jnp.ones((1000, 1000), jnp.float32)
    y = np.asarray(fa.dropout(x, rate, jax.random.key(0)))
    dropped = int((y == 0).sum())
    lo, hi = _binomial_bounds(x.size, rate)
    assert lo <= dropped <= hi, f"{dropped} dropped of {x.size}, expected {rate * x.size:.0f} +- 6 sd"
    kept = y[y != 0]
    np.testing.assert_array_equal(kept, np.float32(1.0) / np.float32(1.0 - rate))
    # Unbiased: the mean stays 1 within 6 standard errors.
    se = np.sqrt(rate / (1 - rate) / x.size)
    assert abs(y.mean() - 1.0) < 6 * se


def test_same_key_same_mask_and_different_keys_differ():
    x = jnp.ones((64, 64))
    a, b = fa.dropout(x, 0.5, jax.random.key(1)), fa.dropout(x, 0.5, jax.random.key(1))
    c = fa.dropout(x, 0.5, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert (np.asarray(a) != np.asarray(c)).any()


def test_rate_zero_is_exact_and_bad_rates_raise():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 5)))
    assert fa.dropout(x, 0.0, None) is x
    for rate in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\)"):
            fa.dropout(x, rate, jax.random.key(0))
    with pytest.raises(ValueError, match="needs a PRNG key"):
        fa.dropout(x, 0.5, None)


def _setup(module_cls, args, rate):
    m = module_cls(*args[:3], rate, *args[3:])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, args[0])), jnp.float32)
    v = m.init(jax.random.key(0), x, deterministic=True)
    return m, v, x


def test_attention_weights_dropout_rate_and_scaling():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 64, 2, 8)), jnp.float32) for _ in range(3))
    _, w = fa.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    _, wd = fa.dot_product_attention(q, k, v, is_causal=True, return_weights=True,
                                     dropout_rate=0.25, dropout_rng=jax.random.key(5))
    w, wd = np.asarray(w), np.asarray(wd)
    allowed = w > 0
    dropped = int((wd[allowed] == 0).sum())
    lo, hi = _binomial_bounds(int(allowed.sum()), 0.25)
    assert lo <= dropped <= hi
    kept = wd != 0
    np.testing.assert_allclose(wd[kept], w[kept] / 0.75, rtol=1e-6)
    assert (wd[~allowed] == 0).all()  # blocked entries stay blocked


DROPOUT_IN_A_FRESH_PROCESS = """
import hashlib, random, sys
import numpy as np, torch
seed = int(sys.argv[1])
np.random.seed(seed); random.seed(seed); torch.manual_seed(seed)   # global states that must not matter
import jax, jax.numpy as jnp
import flax_attn as fa
x = jnp.ones((64, 64))
m = fa.MultiHeadAttention(4, 4, 8, 0.5, 2)
v = m.init(jax.random.key(0), jnp.ones((2, 8, 4)), deterministic=True)
a = fa.dropout(x, 0.5, jax.random.key(7))
b = m.apply(v, jnp.ones((2, 8, 4)), deterministic=False, rngs={"dropout": jax.random.key(7)})
print(hashlib.sha256(np.asarray(a).tobytes() + np.asarray(b).tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_dropout_is_a_function_of_its_key_alone_across_processes():
    import subprocess
    import sys

    digests = {subprocess.run([sys.executable, "-c", DROPOUT_IN_A_FRESH_PROCESS, str(seed)], capture_output=True,
                              text=True, check=True, env=child_env()).stdout.strip() for seed in (1, 12345)}
    assert len(digests) == 1 and len(digests.pop()) == 64


def test_dropout_leaves_global_random_state_alone():
    np_state, torch_state = np.random.get_state()[1].copy(), torch.random.get_rng_state().clone()
    fa.dropout(jnp.ones((8, 8)), 0.5, jax.random.key(0))
    m, v, x = _setup(fa.CausalAttention, (3, 4, 6), 0.5)
    m.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
    np.testing.assert_array_equal(np.random.get_state()[1], np_state)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
