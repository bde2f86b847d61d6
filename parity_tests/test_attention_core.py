"""The functional core: masks against literal matrices, the zero-safe softmax, agreement with
jax.nn.dot_product_attention where the two accept the same arguments."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn import masks
from conftest import assert_close


def test_causal_mask_literal():
    np.testing.assert_array_equal(fa.create_causal_mask(3), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    q, k = masks.default_positions(2, 4)  # queries are the last two of four positions
    np.testing.assert_array_equal(masks.causal_mask(q, k), [[1, 1, 1, 0], [1, 1, 1, 1]])


def test_window_mask_literal():
    p = jnp.arange(5)
    np.testing.assert_array_equal(masks.window_mask(p, p, (1, 0)),
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(masks.window_mask(p, p, 1),
                                  [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])


def test_segment_and_length_masks_literal():
    seg = jnp.array([0, 0, 1, 1, 1])
    np.testing.assert_array_equal(masks.segment_mask(seg, seg),
                                  [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(masks.length_mask(2, 3, jnp.array([1]), jnp.array([2])), [[[1, 1, 0], [0, 0, 0]]])
    np.testing.assert_array_equal(masks.padding_mask(jnp.array([2, 0]), 3), [[1, 1, 0], [0, 0, 0]])


def test_masked_softmax_fully_masked_rows_give_zeros_and_zero_gradients():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4)))
    mask = jnp.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    w = fa.masked_softmax(logits, mask)
    np.testing.assert_array_equal(w[1], 0.0)
    np.testing.assert_allclose(w.sum(-1), [1, 0, 1], rtol=1e-12)
    g = jax.grad(lambda l: jnp.sum(fa.masked_softmax(l, mask) * jnp.arange(4.0)))(logits)
    assert np.isfinite(g).all()
    np.testing.assert_array_equal(g[1], 0.0)
    np.testing.assert_array_equal(g[0, 2:], 0.0)
    # All -inf logits (an additive mask) behave the same.
    np.testing.assert_array_equal(fa.masked_softmax(jnp.full((2,), -jnp.inf)), 0.0)


def _qkv(B=2, T=6, S=6, N=4, K=4, H=8, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((B, T, N, H)), dtype),
            jnp.asarray(rng.standard_normal((B, S, K, H)), dtype),
            jnp.asarray(rng.standard_normal((B, S, K, H)), dtype))


@pytest.mark.parametrize("kwargs", [
    {},
    {"is_causal": True},
    {"local_window_size": (2, 1)},
    {"local_window_size": 2, "is_causal": True},
    {"key_value_seq_lengths": np.array([3, 6], np.int32)},
    {"query_seq_lengths": np.array([4, 1], np.int32), "key_value_seq_lengths": np.array([2, 6], np.int32)},
    {"scale": 0.3},
])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_agrees_with_jax_nn(kwargs, heads):
    # jax.nn computes its softmax in float32 even for float64 inputs, so compare in float32.
    q, k, v = _qkv(N=heads[0], K=heads[1], dtype=np.float32)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, heads[0], 6, 6)), jnp.float32)
    mask = jnp.asarray(np.random.default_rng(2).random((2, 1, 6, 6)) < 0.7).at[..., 0].set(True)
    ours = fa.dot_product_attention(q, k, v, bias, mask, **kwargs)
    theirs = jax.nn.dot_product_attention(q, k, v, bias, mask, **kwargs)
    assert_close(ours, theirs, np.float32, str(kwargs))


def test_causal_with_fewer_queries_is_aligned_to_the_end():
    # Ours: query t sits at key position t + S - T (decoding with a cache).
    # jax.nn aligns to the start; the two agree once its mask is given explicitly.
    q, k, v = _qkv(T=3, S=7, dtype=np.float32)
    ours = fa.dot_product_attention(q, k, v, is_causal=True)
    explicit = jnp.asarray(np.tril(np.ones((3, 7)), 7 - 3), bool)
    assert_close(ours, jax.nn.dot_product_attention(q, k, v, mask=explicit), np.float32, "end-aligned")
    start_aligned = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert np.abs(np.asarray(start_aligned - ours)).max() > 1e-3


def test_fully_masked_rows_differ_from_jax_nn_by_design():
    q, k, v = _qkv(dtype=np.float32)
    mask = jnp.ones((1, 1, 6, 6), bool).at[0, 0, 2].set(False)  # query 2 may attend to nothing
    ours = fa.dot_product_attention(q, k, v, mask=mask)
    theirs = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(ours[:, 2], 0.0)
    assert_close(theirs[:, 2], v.mean(1), np.float32, "jax.nn: the average of the values")
    assert_close(ours[:, [0, 1, 3, 4, 5]], theirs[:, [0, 1, 3, 4, 5]], np.float32, "other rows")


def test_weights_unbatched_and_value_dim():
    q, k, v = _qkv(B=1, T=4, S=5, N=2, K=1)
    v = v[..., :3]  # Hv = 3 != H = 8
    out, w = fa.dot_product_attention(q, k, v, return_weights=True)
    assert out.shape == (1, 4, 2, 3) and w.shape == (1, 2, 4, 5)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bskh->btnh", w, v), rtol=1e-12)
    out_unbatched = fa.dot_product_attention(q[0], k[0], v[0])
    np.testing.assert_array_equal(out_unbatched, out[0])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_output_dtype_is_input_dtype(dtype):
    q, k, v = (x.astype(dtype) for x in _qkv())
    out, w = fa.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    assert out.dtype == dtype and w.dtype == dtype
