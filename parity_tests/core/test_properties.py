"""Properties over random shapes, dtypes, masks, implementations and layer variants (hypothesis).

Bounded and derandomized: the same examples every run, within CI's time."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flax_attn as fa
from flax_attn.core import Blockwise

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# Tiny blocks: every block-skipping branch runs on these small problems.
SMALL_BLOCKWISE = Blockwise(block_q=4, block_k=3)


@st.composite
def problems(draw, causal_only=False, order_free=False):
    """A random attention problem: arrays, keyword arguments, and which keys each query may see."""
    B, K, G = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    T = draw(st.integers(1, 10))
    S = T if causal_only else draw(st.integers(1, 10))
    H = draw(st.integers(1, 8))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    N = K * G
    kw, allowed = {}, np.ones((B, N, T, S), bool)
    t_pos, s_pos = np.arange(T) + S - T, np.arange(S)
    if causal_only or (not order_free and draw(st.booleans())):
        kw["is_causal"] = True
        allowed &= s_pos[None, :] <= t_pos[:, None]
    if not order_free and draw(st.booleans()):
        left, right = draw(st.integers(0, 4)), draw(st.integers(0, 4))
        kw["local_window_size"] = (left, right)
        d = t_pos[:, None] - s_pos[None, :]
        allowed &= (d <= left) & (d >= -right)
    if draw(st.booleans()):
        mask = rng.random((B, draw(st.sampled_from([1, N])), T, S)) < 0.7
        kw["mask"] = jnp.asarray(mask)
        allowed &= mask
    if draw(st.booleans()):
        q_seg, k_seg = rng.integers(-1, 2, (B, T)), rng.integers(-1, 2, (B, S))
        if causal_only:
            k_seg = q_seg
        kw["query_segment_ids"], kw["key_segment_ids"] = jnp.asarray(q_seg), jnp.asarray(k_seg)
        allowed &= ((q_seg[:, :, None] == k_seg[:, None, :]) & (k_seg[:, None, :] >= 0))[:, None]
    if not order_free and not causal_only and draw(st.booleans()):
        lengths = rng.integers(0, S + 1, B).astype(np.int32)
        kw["key_value_seq_lengths"] = jnp.asarray(lengths)
        allowed &= (s_pos[None, :] < lengths[:, None])[:, None, None, :]
    q = rng.standard_normal((B, T, N, H)).astype(dtype)
    k = rng.standard_normal((B, S, K, H)).astype(dtype)
    v = rng.standard_normal((B, S, K, H)).astype(dtype)
    impl = draw(st.sampled_from(["xla", SMALL_BLOCKWISE]))
    return {"q": q, "k": k, "v": v, "kw": kw, "allowed": allowed, "impl": impl, "dtype": dtype}


def attend(p, q=None, k=None, v=None, jit=True):
    """The problem's attention on its arrays (or on the q, k, v given); jitted, by ``p['jitted']``
    where the problem carries one (see :func:`jitted`)."""
    q, k, v = (p[n] if x is None else x for n, x in (("q", q), ("k", k), ("v", v)))
    f = lambda q, k, v: fa.dot_product_attention(q, k, v, implementation=p["impl"], **p["kw"])
    if jit:
        f = p.get("jitted") or jax.jit(f)
    return np.asarray(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))


def jitted(p):
    """``p`` with one jitted function of its attention, so that calls on other arrays of the same
    shapes run one compiled program instead of compiling the same one again."""
    return dict(p, jitted=jax.jit(lambda q, k, v: fa.dot_product_attention(q, k, v, implementation=p["impl"],
                                                                              **p["kw"])))


TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


@SETTINGS
@given(problems())
def test_weights_are_distributions_where_any_key_is_allowed(p):
    # With V = the identity (one value per key), the output is the weight matrix itself.
    B, S, K = p["k"].shape[:3]
    eye = np.broadcast_to(np.eye(S, dtype=p["dtype"])[None, :, None, :], (B, S, K, S))
    weights = np.moveaxis(attend(p, v=eye), 1, 2)  # (B, T, N, S) -> (B, N, T, S)
    tol = TOL[np.dtype(p["dtype"])]
    assert (weights >= -tol).all()
    assert (np.abs(weights[~p["allowed"]]) <= tol).all()
    sums = weights.sum(-1)
    any_allowed = p["allowed"].any(-1)
    np.testing.assert_allclose(sums[any_allowed], 1.0, atol=10 * tol)
    np.testing.assert_array_equal(sums[~any_allowed], 0.0)


@SETTINGS
@given(problems(order_free=True), st.randoms(use_true_random=False))
def test_non_causal_attention_is_equivariant_to_permuting_keys_and_values(p, random):
    S = p["k"].shape[1]
    perm = np.array(random.sample(range(S), S))
    permuted = dict(p, kw=dict(p["kw"]))
    if "mask" in p["kw"]:
        permuted["kw"]["mask"] = p["kw"]["mask"][..., perm]
    if "key_segment_ids" in p["kw"]:
        permuted["kw"]["key_segment_ids"] = p["kw"]["key_segment_ids"][:, perm]
    out = attend(permuted, k=p["k"][:, perm], v=p["v"][:, perm])
    ref = attend(p)
    scale = max(np.abs(ref).max(), 1e-30)
    assert np.abs(out - ref).max() <= TOL[np.dtype(p["dtype"])] * scale


@SETTINGS
@given(problems(causal_only=True), st.integers(0, 9))
def test_causal_outputs_do_not_depend_on_future_tokens(p, t0):
    p = jitted(p)  # both calls below: the same shapes, one program
    T = p["q"].shape[1]
    t0 = t0 % T
    rng = np.random.default_rng(t0)
    k, v = p["k"].copy(), p["v"].copy()
    k[:, t0 + 1:] = rng.standard_normal(k[:, t0 + 1:].shape)
    v[:, t0 + 1:] = rng.standard_normal(v[:, t0 + 1:].shape)
    np.testing.assert_array_equal(attend(p, k=k, v=v)[:, : t0 + 1], attend(p)[:, : t0 + 1])


@SETTINGS
@given(problems())
def test_batch_items_are_independent(p):
    out = attend(p)
    for b in range(out.shape[0]):
        item = dict(p, kw={n: (x[b:b + 1] if hasattr(x, "shape") and x.ndim and x.shape[0] == out.shape[0] else x)
                           for n, x in p["kw"].items()})
        alone = attend(item, q=p["q"][b:b + 1], k=p["k"][b:b + 1], v=p["v"][b:b + 1])
        scale = max(np.abs(out[b]).max(), 1e-30)
        assert np.abs(alone[0] - out[b]).max() <= TOL[np.dtype(p["dtype"])] * scale


@settings(SETTINGS, max_examples=8)
@given(problems())
def test_jit_equals_eager(p):
    eager, jitted = attend(p, jit=False), attend(p)
    scale = max(np.abs(eager).max(), 1e-30)
    assert np.abs(jitted - eager).max() <= TOL[np.dtype(p["dtype"])] * scale


@st.composite
def layers(draw):
    num_kv = draw(st.sampled_from([1, 2, 4]))
    config = fa.AttentionConfig(
        d_model=16, num_heads=4, num_kv_heads=num_kv,
        position=draw(st.sampled_from(["rope", "alibi", "t5", "none"])),
        rope_layout=draw(st.sampled_from(["rotate_half", "interleaved"])),
        sliding_window=draw(st.sampled_from([None, 1, 3])),
        qk_norm=draw(st.booleans()), logit_softcap=draw(st.sampled_from([None, 5.0])),
        t5_num_buckets=8, t5_max_distance=6,
    )
    T = draw(st.integers(1, 9))
    B = draw(st.integers(1, 3))
    return fa.Attention(config, implementation=draw(st.sampled_from(["xla", SMALL_BLOCKWISE]))), B, T, draw(st.integers(0, 99))


@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(layers())
def test_layer_is_causal_and_batch_items_independent(case):
    layer, B, T, seed = case
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((B, T, 16)))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = jax.jit(layer.init)(jax.random.key(seed), x, positions)
    apply = jax.jit(layer.apply)
    out = np.asarray(apply(params, x, positions))
    t0 = seed % T
    edited = x.at[:, t0 + 1:].set(jnp.asarray(rng.standard_normal((B, T - t0 - 1, 16))))
    np.testing.assert_array_equal(np.asarray(apply(params, edited, positions))[:, : t0 + 1], out[:, : t0 + 1])
    for b in range(B):
        alone = np.asarray(apply(params, x[b:b + 1], positions[b:b + 1]))
        assert np.abs(alone[0] - out[b]).max() <= 1e-12 * np.abs(out[b]).max()
