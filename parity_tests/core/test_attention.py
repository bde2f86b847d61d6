"""dot_product_attention: the zero-safe softmax, agreement with jax.nn.dot_product_attention where
the two accept the same arguments. (Mask literals: test_mask.py; every implementation under every
mask and transformation: test_conformance.py.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from conftest import assert_close


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


# Variants checked by brute force (the same variants inside the Attention layer:
# layers/test_attention.py).

@pytest.mark.parametrize("window", [1, 2, 5, 10])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window_against_a_brute_force_loop(window, causal):
    # Mistral's convention: a causal window of W admits W keys, the current one included;
    # bidirectional, W on each side (2W - 1 keys). In local_window_size terms: (W-1, 0) or (W-1, W-1).
    T, H = 10, 4
    rng = np.random.default_rng(window)
    q, k, v = (rng.standard_normal((1, T, 1, H)) for _ in range(3))
    out, weights = fa.dot_product_attention(*(jnp.asarray(a) for a in (q, k, v)), is_causal=causal,
                                            local_window_size=(window - 1, 0 if causal else window - 1),
                                            return_weights=True)
    for t in range(T):
        admitted = [s for s in range(T) if (0 <= t - s < window if causal else abs(t - s) < window)]
        assert len(admitted) == (min(window, t + 1) if causal else min(T, t + window) - max(0, t - window + 1))
        scores = np.array([q[0, t, 0] @ k[0, s, 0] / np.sqrt(H) for s in admitted])
        w = np.exp(scores - scores.max())
        w /= w.sum()
        expected = np.zeros(T)
        expected[admitted] = w
        np.testing.assert_allclose(weights[0, 0, t], expected, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(out[0, t, 0], w @ v[0, admitted, 0], rtol=1e-12)


def test_padding_by_lengths_equals_unpadded_runs():
    rng = np.random.default_rng(7)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 6, 2, 4))) for _ in range(3))
    lengths = jnp.array([6, 3], jnp.int32)
    padded = fa.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths)
    alone = fa.dot_product_attention(q[1:, :3], k[1:, :3], v[1:, :3], is_causal=True)
    assert_close(padded[1, :3], alone[0], np.float64, "padded row")
    np.testing.assert_array_equal(padded[1, 3:], 0.0)  # padding queries attend to nothing


def test_grouped_query_with_k_equal_n_is_multi_head_attention():
    rng = np.random.default_rng(8)
    q, k, v = (rng.standard_normal((2, 5, 4, 3)) for _ in range(3))
    out = fa.dot_product_attention(*(jnp.asarray(a) for a in (q, k, v)), is_causal=True)
    for n in range(4):  # each head is ordinary single-head attention
        s = q[:, :, n] @ k[:, :, n].transpose(0, 2, 1) / np.sqrt(3)
        s = np.where(np.tril(np.ones((5, 5), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        np.testing.assert_allclose(out[:, :, n], w @ v[:, :, n], rtol=1e-12)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_equals_multi_head_with_repeated_heads(kv_heads):
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((2, 5, 4, 3)))
    k, v = (jnp.asarray(rng.standard_normal((2, 5, kv_heads, 3))) for _ in range(2))
    gqa = fa.dot_product_attention(q, k, v, is_causal=True)
    rep = lambda a: jnp.repeat(a, 4 // kv_heads, axis=2)
    assert_close(gqa, fa.dot_product_attention(q, rep(k), rep(v), is_causal=True), np.float64, "GQA vs MHA")


def test_logit_softcap_literal():
    # One query, two keys with scores 10 and 0 (H = 1, scale 1): capped at c = 5 they become
    # 5 tanh(2) and 0, so the first weight is sigmoid(5 tanh(2)).
    q, k, v = jnp.array([[[[10.0]]]]), jnp.array([[[[1.0]], [[0.0]]]]), jnp.array([[[[1.0]], [[0.0]]]])
    out = fa.dot_product_attention(q, k, v, scale=1.0, logit_softcap=5.0)
    np.testing.assert_allclose(out[0, 0, 0, 0], 1 / (1 + np.exp(-5 * np.tanh(2.0))), rtol=1e-12)


@pytest.mark.parametrize("impl", ["xla", fa.core.Blockwise(block_q=4, block_k=4)], ids=["xla", "blockwise"])
def test_sinks_shrink_weights_and_keep_empty_rows_zero(impl):
    q, k, v = _qkv(N=4, K=2)
    sinks = jnp.array([-1.0, 0.0, 1.0, 30.0])                             # the last head's sink dominates
    lengths = np.array([6, 2], np.int32)
    f = lambda q, s: fa.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths, sinks=s,
                                              return_residual=True, implementation=impl)
    out, lse = f(q, sinks)
    plain, plain_lse = fa.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                return_residual=True, implementation=impl)
    np.testing.assert_array_equal(out[1, 2:], 0.0)                        # queries past the length: zeros
    np.testing.assert_allclose(lse, jnp.logaddexp(plain_lse, sinks), rtol=1e-12)
    np.testing.assert_allclose(lse[1, 2:], np.broadcast_to(sinks, (4, 4)), rtol=1e-15)
    np.testing.assert_allclose(out, plain * jax.nn.sigmoid(plain_lse - sinks)[..., None], rtol=1e-12, atol=1e-300)
    assert np.abs(out[..., 3, :]).max() < 1e-10                           # e^-30 of the values
    g_q, g_s = jax.grad(lambda q, s: jnp.sum(f(q, s)[0] ** 2), (0, 1))(q, sinks)
    assert np.isfinite(g_q).all() and np.isfinite(g_s).all()
    np.testing.assert_array_equal(g_q[1, 2:], 0.0)


def test_sinks_with_weights():
    q, k, v = _qkv()
    sinks = jnp.array([0.5, -0.5, 2.0, 0.0])
    out, w, lse = fa.dot_product_attention(q, k, v, is_causal=True, sinks=sinks, return_weights=True,
                                           return_residual=True)
    # the weights and the sink's share make 1; out is the weighted sum of the values
    np.testing.assert_allclose(w.sum(-1) + jnp.exp(sinks[None, :, None] - jnp.swapaxes(lse, 1, 2)), 1.0, rtol=1e-13)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", w, v), rtol=1e-12)


@pytest.mark.parametrize("shape", [(0, 5, 2, 4), (2, 0, 2, 4)])
def test_empty_batch_or_queries_give_empty_outputs_and_gradients(shape):
    """No sequences (B == 0) or no queries (T == 0): an empty output of the right shape, and
    empty gradients, on the default path and through a layer."""
    q = jnp.ones(shape)
    out = fa.dot_product_attention(q, q, q, is_causal=True)
    assert out.shape == shape
    assert jax.grad(lambda q: fa.dot_product_attention(q, q, q).sum())(q).shape == shape
    layer = fa.CausalAttention(3, 2, 5, 0.0)
    x = jnp.ones(shape[:2] + (3,))
    assert layer.apply(layer.init(jax.random.key(0), x), x).shape == shape[:2] + (2,)


def test_numpy_float64_inputs_take_jaxs_dtype_when_x64_is_off():
    """With ``jax_enable_x64`` off, NumPy float64 inputs are float32 to JAX, as to
    ``jax.nn.dot_product_attention``: no dtype mismatch when only the query is traced (a
    gradient with respect to it alone), no warnings about float64 requested inside, and the
    same result as float32 arrays."""
    import warnings

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 6, 2, 8)) for _ in range(3))
    bias, sinks = rng.standard_normal((1, 2, 6, 6)), rng.standard_normal(2)
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        as_f32 = [jnp.asarray(a, jnp.float32) for a in (q, k, v, bias)]
        for impl in (None, "xla", "blockwise"):
            kw = dict(is_causal=True, sinks=sinks, implementation=impl)
            out = fa.dot_product_attention(q, k, v, bias, **kw)
            assert out.dtype == jnp.float32
            np.testing.assert_array_equal(out, fa.dot_product_attention(*as_f32, **kw))
            grad = jax.grad(lambda q_: fa.dot_product_attention(q_, k, v, bias, **kw).sum())(jnp.asarray(q))
            want = jax.grad(lambda q_: fa.dot_product_attention(q_, *as_f32[1:], **kw).sum())(as_f32[0])
            np.testing.assert_array_equal(grad, want)


@pytest.mark.parametrize("impl", [None, "xla", "blockwise", "query_blocks"])
def test_a_closed_over_mask_is_read_at_run_time_not_folded_by_the_compiler(impl):
    """A mask and a bias that a jitted function closes over (NumPy data, a concrete JAX array)
    are constants of the program. The reductions over the mask (which keys and queries any pair
    reaches) must stay in the compiled program, as they do for a mask passed as an argument:
    left to XLA's constant folder, they were evaluated element by element at compile time
    (seconds for a mask of a million pairs). The results equal the argument form's."""
    rng = np.random.default_rng(0)
    T = 40
    q, k, v = (jnp.asarray(rng.standard_normal((1, T, 2, 8)), jnp.float32) for _ in range(3))
    mask = rng.random((T, T)) < 0.9
    mask[3] = False  # a row that attends to nothing
    bias = rng.standard_normal((2, T, T)).astype(np.float32)
    given = jax.jit(lambda q, k, v, b, m: fa.dot_product_attention(q, k, v, b, m, implementation=impl))
    want = given(q, k, v, bias, mask)
    for m, b in ((mask, bias), (jnp.asarray(mask), jnp.asarray(bias))):
        closed = jax.jit(lambda q, k, v: fa.dot_product_attention(q, k, v, b, m, implementation=impl))
        hlo = closed.lower(q, k, v).compile().as_text()
        assert "reduce_or" in hlo, "the reductions over the closed-over mask were folded at compile time"
        np.testing.assert_array_equal(closed(q, k, v), want)
