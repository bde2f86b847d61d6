"""flax_attention_fn (flax_attn.layers.flax_hook) inside Flax's own layers: in
flax.linen.MultiHeadDotProductAttention and flax.nnx.MultiHeadAttention it gives Flax's numbers
(outputs and gradients to the inputs and every parameter, float64 and float32, under jit) with
causal and padding masks, below and above the blockwise crossover (where it runs on the
blockwise path), extra batch dims, bias, grouped-query heads, Flax's exact dropout (broadcast
or not), ``dtype`` and sown weights; fully masked rows are zeros here (Flax averages); what it
cannot honour raises."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

from conftest import DTYPES, TOL, assert_close
from flax_attn.core import Blockwise, QueryBlocks, XLA
from flax_attn.layers.flax_hook import flax_attention_fn

B, F, HEADS = 2, 32, 4
VALID = np.array([13, 9])  # the second sequence is padded after 9 tokens


@pytest.fixture
def paths(monkeypatch):
    """Counts the implementations that ran (at trace time)."""
    ran = []
    for cls in (Blockwise, QueryBlocks, XLA):
        original = cls.__call__

        def spy(self, *args, _original=original, _name=cls.name, **kwargs):
            ran.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__call__", spy)
    return ran


def _valid(T):
    return jnp.arange(T)[None, :] < jnp.asarray(VALID * T // 16)[:, None]  # (B, T): scales with T


def _mask(kind, T, *, boolean=False):
    dtype = jnp.bool_ if boolean else jnp.float32
    ones, valid = jnp.ones((B, T)), _valid(T)
    if kind == "causal":
        return nn.make_causal_mask(ones, dtype=dtype)
    if kind == "key-padding":        # every query attends to something
        return nn.make_attention_mask(ones, valid, dtype=dtype)
    if kind == "causal+key-padding":
        return nn.combine_masks(nn.make_causal_mask(ones), nn.make_attention_mask(ones, valid), dtype=dtype)
    if kind == "query+key-padding":  # padded queries attend to nothing: compared on valid rows only
        return nn.make_attention_mask(valid, valid, dtype=dtype)
    raise KeyError(kind)


def _rows(kind, T):
    """(B, T, 1) weights of the output rows compared: all, or the valid queries."""
    return _valid(T)[..., None] if kind == "query+key-padding" else jnp.ones((B, T, 1), bool)


def _x(T, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, F)), dtype)


def _cot(T, dtype):
    return jnp.asarray(np.random.default_rng(9).standard_normal((B, T, F)), dtype)


def _check_tree(got, want, dtype, what):
    """Parameter gradients, each within the tolerance. As in torch_ref.compare, a gradient that
    is zero analytically (the key bias: it shifts a whole row of logits) is rounding noise in
    both and is measured against the largest parameter gradient of the same loss."""
    got, want = traverse_util.flatten_dict(got), traverse_util.flatten_dict(want)
    assert set(got) == set(want) and got
    tol = TOL[np.dtype(dtype)]
    scale = max(float(np.max(np.abs(np.asarray(w, np.float64)))) for w in want.values())
    worst = 0.0
    for k in want:
        name = f"{what} {'/'.join(map(str, k))}"
        ref = np.asarray(want[k], np.float64)
        if np.max(np.abs(ref)) <= tol * scale:  # zero analytically
            err = float(np.max(np.abs(np.asarray(got[k], np.float64) - ref)) / scale)
            assert err <= tol, f"{name} (zero): {err:.3e} > {tol:.0e}"
        else:
            err = assert_close(got[k], want[k], dtype, name)
        worst = max(worst, err)
    return worst


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["causal", "key-padding", "causal+key-padding", "query+key-padding"])
@pytest.mark.parametrize("T", [16, 160])
def test_linen_layer(T, kind, dtype, paths):
    flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, param_dtype=dtype)
    ours = nn.MultiHeadDotProductAttention(num_heads=HEADS, param_dtype=dtype, attention_fn=flax_attention_fn)
    x, mask, rows, cot = _x(T, dtype), _mask(kind, T), _rows(kind, T), _cot(T, dtype)
    variables = flax_layer.init(jax.random.key(0), x, mask=mask)

    def loss(layer, params, x):
        y = layer.apply({"params": params}, x, mask=mask)
        return jnp.sum(jnp.where(rows, y * cot, 0)), y

    def run(layer):
        return jax.jit(jax.value_and_grad(functools.partial(loss, layer), argnums=(0, 1), has_aux=True))(
            variables["params"], x)

    (_, y_ref), (gp_ref, gx_ref) = run(flax_layer)
    (_, y), (gp, gx) = run(ours)
    assert paths == ["query_blocks" if T >= 128 else "xla"]  # the automatic choice on CPU
    assert y.dtype == y_ref.dtype == dtype
    errors = (assert_close(jnp.where(rows, y, 0), jnp.where(rows, y_ref, 0), dtype, "output"),
              assert_close(gx, gx_ref, dtype, "d loss / d x"), _check_tree(gp, gp_ref, dtype, "d loss / d"))
    print(f"linen T={T} {kind} {np.dtype(dtype).name}: output {errors[0]:.1e}, gradients {max(errors[1:]):.1e}")
    if kind == "query+key-padding":  # the documented difference: padded queries get zeros here
        pad = ~_valid(T)
        np.testing.assert_array_equal(y[pad], jnp.broadcast_to(variables["params"]["out"]["bias"],
                                                               y[pad].shape))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["causal-mask", "is_causal", "padding+is_causal", "gqa-causal"])
@pytest.mark.parametrize("T", [16, 160])
def test_nnx_layer(T, case, dtype, paths):
    kv_heads = 2 if case == "gqa-causal" else None
    make = lambda fn: nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, num_kv_heads=kv_heads, decode=False,
                                             param_dtype=dtype, attention_fn=fn, rngs=nnx.Rngs(0))
    flax_layer, ours = make(nnx.dot_product_attention), make(flax_attention_fn)
    x, cot = _x(T, dtype, seed=1), _cot(T, dtype)
    mask = None if case == "is_causal" else _mask("causal" if "causal" in case and case != "padding+is_causal"
                                                  else "key-padding", T, boolean=case == "gqa-causal")
    is_causal = case in ("is_causal", "padding+is_causal")
    # Flax's default NNX path (jax.nn.dot_product_attention) takes its softmax in float32 even
    # for float64 inputs; in float64 we compare with Flax's plain path, which sow_weights selects.
    sow = dtype == np.float64

    def loss(m, x):
        y = m(x, mask=mask, is_causal=is_causal, sow_weights=sow)
        return jnp.sum(y * cot), y

    def run(m):
        return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(m, x)

    (_, y_ref), (gp_ref, gx_ref) = run(flax_layer)
    (_, y), (gp, gx) = run(ours)
    if not sow:
        assert paths == ["query_blocks" if T >= 128 else "xla"]
    assert y.dtype == dtype
    errors = (assert_close(y, y_ref, dtype, "output"), assert_close(gx, gx_ref, dtype, "d loss / d x"),
              _check_tree(nnx.to_pure_dict(gp), nnx.to_pure_dict(gp_ref), dtype, "d loss / d"))
    print(f"nnx T={T} {case} {np.dtype(dtype).name}: output {errors[0]:.1e}, gradients {max(errors[1:]):.1e}")
    if sow:  # the weights sown into the module (before dropout) agree too
        w, w_ref = ours.attention_weights[0], flax_layer.attention_weights[0]
        assert w.shape == (B, HEADS, T, T)
        assert_close(w, w_ref, dtype, "sown weights")


@pytest.mark.parametrize("broadcast", [True, False])
def test_dropout_is_flaxs_exactly(broadcast):
    dtype, T = np.float64, 12
    flax_layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, dropout_rate=0.4, broadcast_dropout=broadcast,
                                                 param_dtype=dtype)
    ours = flax_layer.clone(attention_fn=flax_attention_fn)
    x, mask, cot = _x(T, dtype), _mask("causal", T), _cot(T, dtype)
    variables = flax_layer.init(jax.random.key(0), x, mask=mask, deterministic=True)

    def run(layer):
        def loss(params, x):
            y = layer.apply({"params": params}, x, mask=mask, deterministic=False, rngs={"dropout": jax.random.key(4)})
            return jnp.sum(y * cot), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(variables["params"], x)

    (_, y_ref), (gp_ref, gx_ref) = run(flax_layer)
    (_, y), (gp, gx) = run(ours)
    assert_close(y, y_ref, dtype, "output with dropout")
    assert_close(gx, gx_ref, dtype, "d loss / d x with dropout")
    _check_tree(gp, gp_ref, dtype, "d loss / d")
    no_dropout = flax_layer.apply(variables, x, mask=mask, deterministic=True)
    assert (np.abs(np.asarray(y - no_dropout)) > 1e-6).any()
    # NNX's layer draws its key from its rngs: the same stream state gives the same masks
    make = lambda fn: nnx.MultiHeadAttention(num_heads=HEADS, in_features=F, decode=False, dropout_rate=0.4,
                                             broadcast_dropout=broadcast, param_dtype=dtype, attention_fn=fn,
                                             rngs=nnx.Rngs(0, dropout=5))
    m_ref, m = make(nnx.dot_product_attention), make(flax_attention_fn)
    assert_close(m(x, mask=mask, deterministic=False), m_ref(x, mask=mask, deterministic=False), dtype,
                 "nnx output with dropout")


def test_broadcast_dropout_shares_one_mask_over_batch_and_heads():
    T, rate = 8, 0.5
    q = k = jnp.zeros((3, T, 2, 4))                      # uniform weights 1/T before dropout
    v = jnp.broadcast_to(jnp.eye(T)[None, :, None, :], (3, T, 2, T)).astype(jnp.float32)  # out = weights row
    out = flax_attention_fn(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=rate)
    kept = np.asarray(out) != 0                          # (3, T, 2, T): which weights survived
    assert (kept == kept[:1, :, :1]).all() and 0 < kept.mean() < 1
    np.testing.assert_allclose(np.asarray(out)[kept], 1 / T / (1 - rate), rtol=1e-6)
    out = flax_attention_fn(q, k, v, dropout_rng=jax.random.key(0), dropout_rate=rate, broadcast_dropout=False)
    kept = np.asarray(out) != 0
    assert not (kept == kept[:1, :, :1]).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_extra_batch_dims_bias_and_unbatched(dtype):
    r = np.random.default_rng(2)
    f = lambda *s: jnp.asarray(r.standard_normal(s), dtype)
    q, k, v = f(2, 3, 6, 4, 8), f(2, 3, 7, 4, 8), f(2, 3, 7, 4, 5)
    mask = jnp.asarray(r.random((2, 1, 1, 6, 7)) < 0.7).at[..., 0].set(True)  # broadcast over the 2nd batch dim
    bias = f(4, 6, 7)                                                         # fewer dims than the logits
    got = jax.jit(flax_attention_fn)(q, k, v, bias, mask)
    assert got.shape == (2, 3, 6, 4, 5)
    assert_close(got, nn.dot_product_attention(q, k, v, bias, mask), dtype, "extra batch dims")
    assert_close(flax_attention_fn(q[0, 0], k[0, 0], v[0, 0], mask=mask[0, 0]),
                 nn.dot_product_attention(q[0, 0], k[0, 0], v[0, 0], mask=mask[0, 0]), dtype, "unbatched")
    # grouped-query heads, as NNX's dot_product_attention allows (its plain path: a module to sow into)
    kg, vg = k[:, :, :, :2], v[:, :, :, :2]
    ref = nnx.dot_product_attention(q[0], kg[0], vg[0], mask=mask[0], module=nnx.Module())
    assert_close(flax_attention_fn(q[0], kg[0], vg[0], mask=mask[0]), ref, dtype, "grouped-query")


def test_dtype_argument_computes_in_that_dtype():
    r = np.random.default_rng(3)
    q, k, v = (jnp.asarray(r.standard_normal((2, 5, 2, 4)), jnp.float32) for _ in range(3))
    got = flax_attention_fn(q, k, v, dtype=jnp.float64)
    assert got.dtype == jnp.float64
    assert_close(got, nn.dot_product_attention(q, k, v, dtype=jnp.float64), np.float64, "dtype=float64")
    q64 = q.astype(jnp.float64)
    got = flax_attention_fn(q64, k, v)  # promoted, as Flax does
    assert got.dtype == jnp.float64
    assert_close(got, nn.dot_product_attention(q64, k, v), np.float64, "promoted")
    got = flax_attention_fn(q64, k, v, dtype=jnp.float32)
    assert got.dtype == jnp.float32
    assert_close(got, nn.dot_product_attention(q64, k, v, dtype=jnp.float32), np.float32, "dtype=float32")


def test_fully_masked_rows_are_zeros_here_and_an_average_in_flax():
    r = np.random.default_rng(4)
    q, k, v = (jnp.asarray(r.standard_normal((1, 3, 1, 4))) for _ in range(3))
    mask = jnp.array([[[[True, False, False], [False, False, False], [True, True, True]]]])
    ours, flax_out = flax_attention_fn(q, k, v, mask=mask), nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(ours[0, 1], 0.0)
    assert_close(flax_out[0, 1], v[0].mean(axis=0), np.float64, "Flax: the average of the values")
    assert_close(ours[0, ::2], flax_out[0, ::2], np.float64, "rows that attend to something")


def test_what_cannot_be_honoured_raises():
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(NotImplementedError, match="cannot use a custom qk_attn_weights_einsum"):
        flax_attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)
    with pytest.raises(NotImplementedError, match="cannot use a custom einsum_dot_general"):
        flax_attention_fn(q, q, q, einsum_dot_general=jax.lax.dot_general)
    with pytest.raises(ValueError, match="dropout_rate=0.1 with deterministic=False needs dropout_rng"):
        flax_attention_fn(q, q, q, dropout_rate=0.1)
    layout = r"\[batch..., N, T, S\] = \(1, 2, 4, 4\)"
    with pytest.raises(ValueError, match=r"mask of shape \(3, 1, 4, 4\) does not broadcast to " + layout):
        flax_attention_fn(q, q, q, mask=jnp.ones((3, 1, 4, 4), bool))
    with pytest.raises(ValueError, match=r"mask of shape \(3, 4, 4\) does not broadcast to " + layout):  # N=2, not 3
        flax_attention_fn(q, q, q, mask=jnp.ones((3, 4, 4), bool))
    with pytest.raises(ValueError, match=r"bias of shape \(1, 1, 1, 4, 4\) has more dims than " + layout):
        flax_attention_fn(q, q, q, bias=jnp.ones((1, 1, 1, 4, 4)))
    with pytest.raises(TypeError, match="query must be a floating-point array, got dtype int32"):
        flax_attention_fn(q.astype(jnp.int32), q, q)
    with pytest.raises(ValueError, match=r"must share their batch dims: query \(1, 4, 2, 8\), key \(2, 4, 2, 8\)"):
        flax_attention_fn(q, jnp.zeros((2, 4, 2, 8)), jnp.zeros((2, 4, 2, 8)))
    # deterministic=True turns dropout off without a key; force_fp32_for_softmax is accepted (always on)
    np.testing.assert_array_equal(flax_attention_fn(q, q, q, dropout_rate=0.1, deterministic=True,
                                                    force_fp32_for_softmax=True), flax_attention_fn(q, q, q))


def test_a_chosen_implementation_through_partial():
    x, mask = _x(16, np.float64), _mask("causal", 16)
    layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, param_dtype=np.float64)
    blockwise = layer.clone(attention_fn=functools.partial(flax_attention_fn,
                                                           implementation=Blockwise(block_q=8, block_k=8)))
    variables = layer.init(jax.random.key(0), x, mask=mask)
    assert_close(blockwise.apply(variables, x, mask=mask), layer.apply(variables, x, mask=mask), np.float64,
                 "blockwise at 16 tokens")


def test_linen_decode_with_flaxs_own_cache():
    # decode=True: the layer keeps its cache and passes a (B, 1, 1, max_len) float mask per step
    x = _x(6, np.float64)
    outs = {}
    for name, fn in (("flax", nn.dot_product_attention), ("ours", flax_attention_fn)):
        layer = nn.MultiHeadDotProductAttention(num_heads=HEADS, decode=True, param_dtype=np.float64, attention_fn=fn)
        variables = layer.init(jax.random.key(0), x)
        cache, steps = variables["cache"], []
        for t in range(6):
            y, mutated = layer.apply({"params": variables["params"], "cache": cache}, x[:, t:t + 1], mutable=["cache"])
            cache = mutated["cache"]
            steps.append(y)
        outs[name] = jnp.concatenate(steps, axis=1)
    assert_close(outs["ours"], outs["flax"], np.float64, "decoded with Flax's cache")
