"""Dropout in the chapter's modules (flax_attn.textbook.chapter): deterministic=True is exactly
no dropout, dropout needs deterministic and a key, and torch_ref's CausalAttention follows the
same inverted-dropout rule (statistically: torch's RNG cannot be matched). The dropout function
itself: test_dropout.py."""
import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr


def _binomial_bounds(n, p, sigmas=6.0):
    sd = np.sqrt(n * p * (1 - p))
    return n * p - sigmas * sd, n * p + sigmas * sd


def _setup(module_cls, args, rate):
    m = module_cls(*args[:3], rate, *args[3:])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 6, args[0])), jnp.float32)
    v = m.init(jax.random.key(0), x, deterministic=True)
    return m, v, x


@pytest.mark.parametrize("cls, args", [(fa.CausalAttention, (3, 4, 6)), (fa.MultiHeadAttention, (3, 4, 6, 2)),
                                       (fa.MultiHeadAttentionWrapper, (3, 2, 6, 2))])
def test_modules_deterministic_equals_no_dropout_bitwise(cls, args):
    m, v, x = _setup(cls, args, 0.5)
    m0 = cls(*args[:3], 0.0, *args[3:])
    np.testing.assert_array_equal(m.apply(v, x, deterministic=True), m0.apply(v, x))
    train = m.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
    assert (np.asarray(train) != np.asarray(m0.apply(v, x))).any()
    np.testing.assert_array_equal(train, m.apply(v, x, deterministic=False, rngs={"dropout": jax.random.key(3)}))


def test_modules_require_deterministic_and_a_key():
    m, v, x = _setup(fa.MultiHeadAttention, (3, 4, 6, 2), 0.1)
    with pytest.raises(ValueError, match="pass deterministic=True"):
        m.apply(v, x)
    with pytest.raises(flax.errors.InvalidRngError):
        m.apply(v, x, deterministic=False)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        fa.MultiHeadAttention(3, 4, 6, 1.0, 2).init(jax.random.key(0), x, deterministic=True)


def test_torch_ref_dropout_follows_the_same_rule():
    torch.manual_seed(0)
    ca = tr.CausalAttention(3, 4, 50, 0.5)
    ca.train()
    x = torch.randn(8, 50, 3)
    # Capture the weights after dropout through a hook on the dropout layer.
    seen = {}
    ca.dropout.register_forward_hook(lambda mod, inp, out: seen.update(before=inp[0], after=out))
    ca(x)
    before, after = seen["before"].detach().numpy(), seen["after"].detach().numpy()
    allowed = before > 0
    dropped = int((after[allowed] == 0).sum())
    lo, hi = _binomial_bounds(int(allowed.sum()), 0.5)
    assert lo <= dropped <= hi
    np.testing.assert_allclose(after[after != 0], 2 * before[after != 0], rtol=1e-6)
