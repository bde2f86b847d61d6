"""ALiBi (flax_attn.positional.alibi): slopes by hand and against MPT's recipe, the bias literal."""
import jax.numpy as jnp
import numpy as np

import flax_attn as fa
import torch_ref as tr

tm = tr.modern


def test_alibi_slopes_by_hand():
    np.testing.assert_array_equal(fa.alibi_slopes(8), [2.0 ** -k for k in range(1, 9)])
    np.testing.assert_array_equal(fa.alibi_slopes(4), [2.0 ** -k for k in (2, 4, 6, 8)])
    np.testing.assert_array_equal(fa.alibi_slopes(1), [2.0 ** -8])
    # 12 heads: the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other slope of 16).
    np.testing.assert_allclose(fa.alibi_slopes(12), [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)],
                               rtol=1e-15)


def test_alibi_slopes_agree_with_mpt_recipe():
    for n in range(1, 65):
        np.testing.assert_allclose(fa.alibi_slopes(n), tm.alibi_slopes(n).numpy(), rtol=1e-15, err_msg=str(n))


def test_alibi_bias_literal():
    bias = fa.alibi_bias(np.array([0.5, 0.25]), jnp.arange(3), jnp.arange(3))
    np.testing.assert_allclose(bias[0], -0.5 * np.abs(np.subtract.outer(np.arange(3), np.arange(3))))
    np.testing.assert_allclose(bias[1, 2], [-0.5, -0.25, 0.0])
