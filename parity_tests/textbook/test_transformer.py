"""The Transformer notes (seed 001): scaled_dot_product_attention, MultiHeadAttention(d_model,
num_heads), create_causal_mask (flax_attn.textbook.transformer). Their positional_encoding is in
parity_tests/positional/test_sinusoidal.py.

The notes print no numbers, so their examples' expected values are derived here by hand with
Python's math module, independently of both packages. Then parity, outputs and gradients.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, assert_close, run_function_parity, run_parity


def softmax_rows(rows):
    out = []
    for row in rows:
        e = [math.exp(v) for v in row]
        out.append([v / sum(e) for v in e])
    return out


def matmul(a, b):
    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]


def by_hand_attention(Q, K, V, mask=None):
    d_k = len(Q[0])
    scores = [[sum(q * k for q, k in zip(qr, kr)) / math.sqrt(d_k) for kr in K] for qr in Q]
    if mask is not None:
        scores = [[s if m else -1e9 for s, m in zip(sr, mr)] for sr, mr in zip(scores, mask)]
    weights = softmax_rows(scores)
    return matmul(weights, V), weights


def test_first_example_without_mask():
    Q = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    V = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    out, weights = by_hand_attention(Q, Q, V)
    # Scores / sqrt(4): rows [1, 0, .5], [0, 1, .5], [.5, .5, 1].
    np.testing.assert_allclose(weights[0], np.exp([1, 0, .5]) / np.exp([1, 0, .5]).sum(), rtol=1e-12)
    q, v = np.array([Q], np.float32), np.array([V], np.float32)
    t_out, t_w = tr.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(q), torch.from_numpy(v))
    f_out, f_w = fa.scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(q), jnp.asarray(v))
    for name, o, w in (("torch_ref", t_out.numpy(), t_w.numpy()), ("flax_attn", f_out, f_w)):
        assert o.shape == (1, 3, 2) and w.shape == (1, 3, 3), name
        assert_close(o[0], out, np.float32, name)
        assert_close(w[0], weights, np.float32, name)


def test_causal_example():
    Q = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]
    V = [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]
    tril = [[j <= i for j in range(4)] for i in range(4)]
    out, weights = by_hand_attention(Q, Q, V, tril)
    assert weights[0] == [1.0, 0.0, 0.0, 0.0]
    assert out[0] == [1.0, 1.0]  # the first token sees only itself
    np.testing.assert_array_equal(tr.create_causal_mask(4).numpy(), np.tril(np.ones((4, 4))))
    np.testing.assert_array_equal(fa.create_causal_mask(4), np.tril(np.ones((4, 4))).astype(bool))
    q, v = np.array([Q], np.float32), np.array([V], np.float32)
    t_out, t_w = tr.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(q), torch.from_numpy(v),
                                                 tr.create_causal_mask(4))
    f_out, f_w = fa.scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(q), jnp.asarray(v),
                                                 fa.create_causal_mask(4))
    for name, o, w in (("torch_ref", t_out.numpy(), t_w.numpy()), ("flax_attn", f_out, f_w)):
        assert_close(o[0], out, np.float32, name)
        assert_close(w[0], weights, np.float32, name)
        assert np.all(np.asarray(w)[0][np.triu_indices(4, 1)] == 0), name


def test_multi_head_attention_example_seed_42():
    torch.manual_seed(42)
    mha = tr.TransformerMultiHeadAttention(d_model=4, num_heads=2)
    X = np.array([[[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]], np.float32)
    with torch.no_grad():
        t_out, t_w = mha(*(torch.from_numpy(X),) * 3)
    assert tuple(t_out.shape) == (1, 3, 4) and tuple(t_w.shape) == (1, 2, 3, 3)
    m = fa.TransformerMultiHeadAttention(4, 2)
    v = fa.from_torch_state_dict(m, tr.state_dict_to_numpy(mha.state_dict()))
    f_out, f_w = m.apply(v, *(jnp.asarray(X),) * 3)
    assert_close(f_out, t_out.numpy(), np.float32, "output")
    assert_close(f_w, t_w.numpy(), np.float32, "weights")
    np.testing.assert_allclose(np.asarray(f_w).sum(-1), 1.0, rtol=1e-6)


def _masks(kind, batch, heads, T, S):
    rng = np.random.default_rng(T * 100 + S)
    if kind is None:
        return None
    if kind == "causal":
        return np.tril(np.ones((T, S)), S - T)  # queries are the last T of S positions
    if kind == "padding":  # (B, 1, 1, S): per-sequence key lengths >= 1
        lengths = rng.integers(1, S + 1, size=batch)
        return (np.arange(S)[None, None, None, :] < lengths[:, None, None, None]).astype(np.float64)
    if kind == "random":  # (B, N, T, S) with at least one key per query
        m = rng.random((batch, heads, T, S)) < 0.6
        m[..., 0] = True
        return m.astype(np.float64)
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", [None, "causal", "padding", "random"])
@pytest.mark.parametrize("batch, T, S", [(1, 1, 1), (2, 5, 5), (3, 4, 7)])
def test_multi_head_attention_parity(batch, T, S, mask_kind, dtype):
    torch.manual_seed(batch + T + S)
    d_model, heads = 12, 3
    rng = np.random.default_rng(batch)
    q, k, v = (rng.standard_normal((batch, n, d_model)) for n in (T, S, S))
    mask = _masks(mask_kind, batch, heads, T, S)
    run_parity(
        tr.TransformerMultiHeadAttention(d_model, heads), fa.TransformerMultiHeadAttention(d_model, heads),
        (q, k, v), dtype,
        torch_call_kwargs={} if mask is None else {"mask": torch.from_numpy(mask)},
        flax_kwargs={} if mask is None else {"mask": jnp.asarray(mask.astype(bool))},
        eager=(batch, T, S) == (2, 5, 5),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [((2, 5, 4), (2, 5, 4), (2, 5, 4)),
                                    ((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5)),  # [B, N, T, d], d_v != d_k
                                    ((1, 4), (3, 4), (3, 2))])
@pytest.mark.parametrize("with_mask", [False, True])
def test_scaled_dot_product_attention_parity(shapes, with_mask, dtype):
    rng = np.random.default_rng(len(shapes[0]))
    Q, K, V = (rng.standard_normal(s) for s in shapes)
    T, S = shapes[0][-2], shapes[1][-2]
    mask = np.tril(np.ones((T, S)), S - T) if with_mask else None
    run_function_parity(
        lambda q, k, v: tr.scaled_dot_product_attention(q, k, v, None if mask is None else torch.from_numpy(mask)),
        lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, None if mask is None else jnp.asarray(mask, bool)),
        (Q, K, V), dtype, eager=with_mask,
    )


def test_fully_masked_rows_each_implementation():
    """A query that may attend to nothing: what each implementation returns.

    torch_ref's Transformer-notes function blocks with -1e9: a uniform average of the values.
    torch_ref's chapter modules block with -inf: NaN. flax_attn: zeros, with zero gradients.
    """
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((1, 3, 4)) for _ in range(3))
    mask = np.ones((3, 3))
    mask[1] = 0  # query 1 may attend to nothing
    t_out, _ = tr.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (Q, K, V)), torch.from_numpy(mask))
    np.testing.assert_allclose(t_out[0, 1].numpy(), V[0].mean(0), rtol=1e-12)  # uniform average

    scores = torch.from_numpy(Q @ K.transpose(0, 2, 1))
    nan_weights = torch.softmax(scores.masked_fill(torch.from_numpy(mask == 0), -torch.inf), dim=-1)
    assert torch.isnan(nan_weights[0, 1]).all()  # the chapter's -inf fill
    assert not torch.isnan(nan_weights[0, 0]).any()

    f = lambda q, k, v: fa.scaled_dot_product_attention(q, k, v, jnp.asarray(mask, bool))
    f_out, f_w = f(*(jnp.asarray(a) for a in (Q, K, V)))
    np.testing.assert_array_equal(f_out[0, 1], 0.0)
    np.testing.assert_array_equal(f_w[0, 1], 0.0)
    grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0] ** 2) + jnp.sum(f(q, k, v)[1] ** 2), argnums=(0, 1, 2))(
        *(jnp.asarray(a) for a in (Q, K, V)))
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(grads[0][0, 1], 0.0)  # nothing flows into the blocked query
    # Rows with something to attend to still agree with torch.
    assert_close(f_out[0, [0, 2]], t_out.numpy()[0, [0, 2]], np.float64, "unblocked rows")
