"""ALiBi (flax_attn.positional.alibi): slopes by hand and against MPT's recipe, the bias literal."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import assert_close, run_parity

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


def test_alibi_bias_follows_the_slopes_dtype():
    # 3, 5 and 6 heads still have power-of-two slopes (3: 2^-4, 2^-8, 2^-2); 12 and 24 heads do
    # not (12: 2^-0.5, 2^-1.5, ...): those lose digits in float32 (9e-9 relative in the layer).
    slopes = fa.alibi_slopes(3)
    pos = jnp.arange(4)
    assert fa.alibi_bias(slopes, pos, pos).dtype == jnp.float64  # x64 is on in this suite
    assert fa.alibi_bias(slopes.astype(np.float32), pos, pos).dtype == jnp.float32
    assert fa.alibi_bias(slopes, pos, pos, dtype=jnp.float32).dtype == jnp.float32
    slopes = fa.alibi_slopes(12)  # 2^-0.5 etc.
    exact = -slopes[:, None, None] * np.abs(np.subtract.outer(np.arange(4), np.arange(4)))[None]
    assert_close(fa.alibi_bias(slopes, pos, pos), exact, np.float64, "float64 bias")
    np.testing.assert_array_equal(fa.alibi_bias(slopes, pos, pos), exact)


@pytest.mark.parametrize("heads", [3, 5, 6, 12, 24])
@pytest.mark.parametrize("causal", [True, False])
def test_alibi_layer_parity_float64_heads_not_a_power_of_two(heads, causal):
    # The layer in float64 against its torch twin at 1e-12, head counts that are not powers of two
    # (12 and 24 also have slopes that are not: a float32 bias gave 9e-9 at 12 heads).
    torch.manual_seed(heads)
    layer = fa.Attention(fa.AttentionConfig(d_model=2 * heads, num_heads=heads, position="alibi", causal=causal))
    rng = np.random.default_rng(heads)
    x = rng.standard_normal((2, 7, 2 * heads))
    positions = np.arange(7)[None] + np.array([[0], [40]])  # large offsets make the slope error visible
    run_parity(tr.twin(layer), layer, (x, positions), np.float64, flax_kwargs={"deterministic": True})
