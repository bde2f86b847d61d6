"""User-defined attention (score_mod / mask_mod), attention sinks and chunked attention.

Parity against ``torch_ref.flex`` (FlexAttention's semantics with all scores materialised,
gpt-oss's sink column, Llama 4's chunked mask) for every implementation registered on CPU,
outputs and gradients (to q, k, v, the sinks and a learned table a score_mod closes over);
then each feature written both ways (as score_mod/mask_mod and built in) and equal.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref.flex as tflex
from conftest import DTYPES, assert_close, run_function_parity
from flax_attn.core import Blockwise
from flax_attn.core import mask as masks
from flax_attn.positional.alibi import alibi_bias, alibi_slopes
from flax_attn.positional.t5 import relative_position_bucket, t5_bias

B, T, N, K, H = 2, 12, 4, 2, 8      # 12 tokens in 8 x 8 blocks: whole, partial and padded blocks
BLOCKWISE = Blockwise(block_q=8, block_k=8)
IMPLS = [pytest.param("xla", id="xla"), pytest.param(BLOCKWISE, id="blockwise")]


def _qkv(seed=0, T=T, S=T):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, T, N, H)), rng.standard_normal((B, S, K, H)),
            rng.standard_normal((B, S, K, H)))


# ---------------------------------------------------------------------- parity with torch_ref.flex


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_and_chunked_parity(dtype, impl):
    """gpt-oss sinks on Llama 4's chunked causal mask (chunks of 4 by position, row 1 starting
    mid-chunk), one query of row 0 blocked outright: it returns zeros."""
    q, k, v = _qkv()
    sinks = np.random.default_rng(1).standard_normal(N) * 2
    pos = np.stack([np.arange(T), np.arange(T) + 3]).astype(np.int32)
    blocked = np.ones((B, 1, T, T), bool)
    blocked[0, :, 3] = False

    def jax_fn(q, k, v, s, p, m):
        rules = masks.causal() & masks.chunked(4) & masks.positions(p, p) & masks.dense(m)
        return fa.dot_product_attention(q, k, v, mask=rules, sinks=s, implementation=impl)

    def torch_fn(q, k, v, s, p, m):
        return tflex.attention_with_sinks(q, k, v, s, allowed=tflex.chunked_causal_mask(p, p, 4)[:, None] & m)[0]

    run_function_parity(torch_fn, jax_fn, [q, k, v, sinks, pos, blocked], dtype)
    out = jax_fn(*(jnp.asarray(x, dtype) for x in (q, k, v, sinks)), jnp.asarray(pos), jnp.asarray(blocked))
    np.testing.assert_array_equal(out[0, 3], 0.0)


def _jax_mods(table, docs):
    """A learned relative-position table per head, scaled per head (a nonlinear use of n), and
    a document mask over ids the mask_mod closes over."""
    score_mod = lambda s, b, n, qi, ki: s * (1.0 + 0.25 * n) + table[jnp.clip(qi - ki, 0, 7), n]
    mask_mod = lambda b, n, qi, ki: docs[b, qi] == docs[b, ki]
    return score_mod, mask_mod


def _torch_mods(table, docs):
    score_mod = lambda s, b, n, qi, ki: s * (1.0 + 0.25 * n) + table[(qi - ki).clamp(0, 7), n]
    mask_mod = lambda b, n, qi, ki: (docs[b, qi] == docs[b, ki]) & (ki <= qi)
    return score_mod, mask_mod


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_mod_and_mask_mod_parity(dtype, impl):
    """A learned table and packed documents, causal, 7 queries at positions 5..11 of 12 keys."""
    q, k, v = _qkv(3, T=7, S=T)
    table = np.random.default_rng(4).standard_normal((8, N))
    docs = np.array([[0] * 5 + [1] * 7, [0] * 9 + [2] * 3], np.int32)  # packed documents
    qp, kp = np.arange(5, 12, dtype=np.int32), np.arange(12, dtype=np.int32)

    def jax_fn(q, k, v, table, docs):
        score_mod, mask_mod = _jax_mods(table, docs)
        return fa.dot_product_attention(q, k, v, mask=masks.mask_mod(mask_mod) & masks.causal(),
                                        query_positions=qp, key_positions=kp, score_mod=score_mod,
                                        implementation=impl)

    def torch_fn(q, k, v, table, docs):
        score_mod, mask_mod = _torch_mods(table, docs.long())
        return tflex.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                    query_positions=torch.from_numpy(qp), key_positions=torch.from_numpy(kp))[0]

    run_function_parity(torch_fn, jax_fn, [q, k, v, table, docs], dtype)


# ---------------------------------------------------------------------- each feature both ways


def _both_ways(f_mod, f_builtin, params):
    """Outputs and gradients (w.r.t. every array in ``params``) of two spellings, float64, jitted."""
    shape = jax.eval_shape(f_builtin, *params).shape
    cot = jnp.asarray(np.random.default_rng(9).standard_normal(shape))

    def value_and_vjp(f):
        out, vjp = jax.vjp(f, *params)
        return out, vjp(cot)

    (out_mod, g_mod), (out_builtin, g_builtin) = jax.jit(lambda: (value_and_vjp(f_mod), value_and_vjp(f_builtin)))()
    assert_close(out_mod, out_builtin, np.float64, "outputs")
    for i, (a, b) in enumerate(zip(g_mod, g_builtin)):
        assert_close(a, b, np.float64, f"gradient {i}")


@pytest.mark.parametrize("impl", IMPLS)
def test_sinks_both_ways(impl):
    """A sink is a key at position -1 with a zero value whose score a score_mod replaces."""
    q, k, v = (jnp.asarray(x) for x in _qkv(10))
    sinks = jnp.asarray(np.random.default_rng(11).standard_normal(N))
    qp, kp = jnp.arange(T, dtype=jnp.int32), jnp.arange(-1, T, dtype=jnp.int32)

    def as_score_mod(q, k, v, sinks):
        k1 = jnp.pad(k, ((0, 0), (1, 0), (0, 0), (0, 0)))   # the sink's key and value: zeros
        v1 = jnp.pad(v, ((0, 0), (1, 0), (0, 0), (0, 0)))
        mod = lambda s, b, n, qi, ki: jnp.where(ki == -1, sinks[n], s)
        return fa.dot_product_attention(q, k1, v1, is_causal=True, query_positions=qp, key_positions=kp,
                                        score_mod=mod, implementation=impl)

    builtin = lambda q, k, v, sinks: fa.dot_product_attention(q, k, v, is_causal=True, sinks=sinks,
                                                             implementation=impl)
    _both_ways(as_score_mod, builtin, (q, k, v, sinks))


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_both_ways(impl):
    q, k, v = (jnp.asarray(x) for x in _qkv(12))
    as_mask_mod = lambda q, k, v: fa.dot_product_attention(
        q, k, v, mask=masks.mask_mod(lambda b, n, qi, ki: (qi // 5 == ki // 5) & (ki <= qi)), implementation=impl)
    builtin = lambda q, k, v: fa.dot_product_attention(q, k, v, mask=masks.causal() & masks.chunked(5),
                                                       implementation=impl)
    _both_ways(as_mask_mod, builtin, (q, k, v))


@pytest.mark.parametrize("impl", IMPLS)
def test_alibi_both_ways(impl):
    q, k, v = (jnp.asarray(x) for x in _qkv(13))
    slopes = jnp.asarray(alibi_slopes(N))
    p = jnp.arange(T, dtype=jnp.int32)
    as_score_mod = lambda q, k, v, m: fa.dot_product_attention(
        q, k, v, is_causal=True, score_mod=lambda s, b, n, qi, ki: s - m[n] * jnp.abs(qi - ki), implementation=impl)
    builtin = lambda q, k, v, m: fa.dot_product_attention(q, k, v, alibi_bias(m, p, p), is_causal=True,
                                                          implementation=impl)
    _both_ways(as_score_mod, builtin, (q, k, v, slopes))


@pytest.mark.parametrize("impl", IMPLS)
def test_t5_both_ways(impl):
    q, k, v = (jnp.asarray(x) for x in _qkv(14))
    table = jnp.asarray(np.random.default_rng(15).standard_normal((32, N)))
    p = jnp.arange(T, dtype=jnp.int32) * 3        # spread positions so that the log buckets are used

    def as_score_mod(q, k, v, table):
        mod = lambda s, b, n, qi, ki: s + table[relative_position_bucket(ki - qi, num_buckets=32, max_distance=20), n]
        return fa.dot_product_attention(q, k, v, query_positions=p, key_positions=p, score_mod=mod,
                                        implementation=impl)

    builtin = lambda q, k, v, table: fa.dot_product_attention(
        q, k, v, t5_bias(table, p, p, max_distance=20), query_positions=p, key_positions=p, implementation=impl)
    _both_ways(as_score_mod, builtin, (q, k, v, table))


# ---------------------------------------------------------------------- transformations


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_jit_and_forward_mode_through_closures(impl):
    """vmap over the arrays the functions close over (eagerly and under jit) equals a loop (on
    the plain path); forward mode agrees with reverse mode."""
    q, k, v = (jnp.asarray(x) for x in _qkv(16))
    tables = jnp.asarray(np.random.default_rng(17).standard_normal((2, 8, N)))
    docs = jnp.asarray(np.random.default_rng(18).integers(0, 2, (2, B, T)), jnp.int32)

    def f(table, docs, q, impl=impl):
        score_mod, mask_mod = _jax_mods(table, docs)
        return fa.dot_product_attention(q, k, v, mask=masks.mask_mod(mask_mod) & masks.causal(),
                                        score_mod=score_mod, implementation=impl)

    loop = jnp.stack([f(tables[i], docs[i], q, "xla") for i in range(2)])
    assert_close(jax.vmap(f, (0, 0, None))(tables, docs, q), loop, np.float64, "eager vmap")
    assert_close(jax.jit(jax.vmap(f, (0, 0, None)))(tables, docs, q), loop, np.float64, "jit of vmap")
    dq = jnp.asarray(np.random.default_rng(19).standard_normal(q.shape))
    dt = jnp.asarray(np.random.default_rng(20).standard_normal(tables[0].shape))

    @jax.jit
    def both(t, q):
        tangent = jax.jvp(lambda t, q: f(t, docs[0], q), (t, q), (dt, dq))[1]
        g_t, g_q = jax.grad(lambda t, q: jnp.sum(f(t, docs[0], q) * tangent), (0, 1))(t, q)
        return jnp.sum(tangent * tangent), jnp.sum(g_t * dt) + jnp.sum(g_q * dq)

    # <J (dt, dq), J (dt, dq)> two ways: forward mode, and reverse mode applied to the tangent
    forward, reverse = both(tables[0], q)
    np.testing.assert_allclose(forward, reverse, rtol=1e-12)


# ---------------------------------------------------------------------- errors


def test_bad_arguments_name_themselves():
    q, k, v = (jnp.asarray(x) for x in _qkv())
    with pytest.raises(ValueError, match=r"sinks must have shape \(N,\) = \(4,\).*got \(2,\)"):
        fa.dot_product_attention(q, k, v, sinks=jnp.zeros(2))
    with pytest.raises(TypeError, match="sinks must be a floating-point array"):
        fa.dot_product_attention(q, k, v, sinks=jnp.zeros(N, jnp.int32))
    with pytest.raises(TypeError, match="mask_mod must return a boolean"):
        fa.dot_product_attention(q, k, v, mask=masks.mask_mod(lambda b, n, qi, ki: qi - ki))
    with pytest.raises(TypeError, match="mask_mod must be a function"):
        masks.mask_mod(jnp.ones((T, T), bool))
    with pytest.raises(TypeError, match=r"score_mod must take \(score, b, n, q_idx, k_idx\)"):
        fa.dot_product_attention(q, k, v, score_mod=lambda s, qi, ki: s)
    with pytest.raises(ValueError, match="score_mod must return one value"):
        fa.dot_product_attention(q, k, v, score_mod=lambda s, b, n, qi, ki: jnp.stack([s, s]))
    with pytest.raises(ValueError, match="chunk_size"):
        masks.chunked(0)
    with pytest.raises(ValueError, match="both mask descriptions give chunks, of 4 and 8"):
        masks.chunked(4) & masks.chunked(8)


def test_rules_see_only_positions_that_exist():
    """Blocks padded past T / S hand a user rule the last real position, not positions past the
    end: a score_mod undefined there (sqrt(S - 1 - k)) keeps finite derivatives on every path,
    equal to the plain path's, whatever the block sizes."""
    B, T, S, N, K, H = 1, 13, 19, 2, 1, 8
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(shape)) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))

    def loss(a, impl):
        rule = lambda s, b, n, qi, ki: s + a * jnp.sqrt((S - 1 - ki).astype(s.dtype))
        return fa.dot_product_attention(q, k, v, score_mod=rule, implementation=impl).sum()

    want_grad = jax.grad(loss)(0.3, "xla")
    want_tangent = jax.jvp(lambda a: loss(a, "xla"), (0.3,), (1.0,))[1]
    assert np.isfinite(want_grad)
    for impl in (Blockwise(block_q=8, block_k=8), Blockwise(block_q=4, block_k=4),
                 fa.core.QueryBlocks(block_q=4)):
        np.testing.assert_allclose(jax.grad(loss)(0.3, impl), want_grad, rtol=1e-12, err_msg=str(impl))
        np.testing.assert_allclose(jax.jvp(lambda a: loss(a, impl), (0.3,), (1.0,))[1], want_tangent,
                                   rtol=1e-12, err_msg=str(impl))
