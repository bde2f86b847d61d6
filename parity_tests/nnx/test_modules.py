"""flax_attn's NNX modules (flax_attn.nnx) against their Linen twins: given the same weights
(moved by flax_attn.nnx.from_linen) both compute the same outputs and gradients (to the inputs
and to every parameter), eagerly and under nnx.jit / jax.jit, float64 and float32; Attention
also through the KV cache (prefill then steps, gradients too); dropout the NNX way (rngs,
deterministic, eval/train, nnx.view)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, traverse_util

import flax_attn as fa
import flax_attn.nnx as fnnx
from conftest import DTYPES, TOL, max_rel_error
from flax_attn.layers.attention import attention_forward

D, N = 16, 4
ATTENTION = {
    "gqa-rope-qknorm-softcap": {"num_kv_heads": 2, "qk_norm": True, "logit_softcap": 3.0, "qkv_bias": True},
    "t5-biases-dropout": {"position": "t5", "t5_num_buckets": 8, "t5_max_distance": 6, "out_bias": True,
                          "dropout": 0.3},
    "alibi-window": {"position": "alibi", "sliding_window": 3, "num_kv_heads": 1},
    "nope-bidirectional": {"position": "none", "causal": False},
    "sinks-layernorm-projection-qv-bias": {"num_kv_heads": 2, "sinks": True, "qk_norm": True, "qk_norm_type": "layer",
                                           "qk_norm_scope": "projection", "qk_norm_bias": True,
                                           "qkv_bias": (True, False, True)},
}


def _floats(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _case(name, dtype):
    """(linen module, inputs, call kwargs): inputs are arrays in call order."""
    r = np.random.default_rng(0)
    x = _floats(r, (2, 6, 4), dtype)
    det = {"deterministic": True}
    if name == "SelfAttention_v1":
        return fa.SelfAttention_v1(4, 3, param_dtype=dtype), (x,), {}
    if name == "SelfAttention_v1-unbatched":
        return fa.SelfAttention_v1(4, 3, param_dtype=dtype), (x[0],), {}
    if name == "SelfAttention_v2":
        return fa.SelfAttention_v2(4, 3, True, param_dtype=dtype), (x,), {}
    if name == "CausalAttention":
        return fa.CausalAttention(4, 3, 6, 0.5, True, param_dtype=dtype), (x,), det
    if name == "MultiHeadAttentionWrapper":
        return fa.MultiHeadAttentionWrapper(4, 3, 6, 0.5, 2, param_dtype=dtype), (x,), det
    if name == "MultiHeadAttention":
        return fa.MultiHeadAttention(4, 6, 6, 0.5, 2, True, param_dtype=dtype), (x,), det
    if name == "TransformerMultiHeadAttention":
        q, kv = _floats(r, (2, 5, 8), dtype), _floats(r, (2, 7, 8), dtype)
        mask = jnp.asarray(r.random((5, 7)) < 0.7).at[:, 0].set(True)
        return fa.TransformerMultiHeadAttention(8, 2, param_dtype=dtype), (q, kv, kv * 0.5, mask), {}
    if name == "LearnedPositionalEmbedding":
        return fa.LearnedPositionalEmbedding(10, 4, param_dtype=dtype), (jnp.array([[0, 3, 9], [1, 1, 2]]),), {}
    if name.startswith("Attention:"):
        config = fa.AttentionConfig(d_model=D, num_heads=N, **ATTENTION[name.split(":")[1]])
        positions = jnp.array([[0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8]])
        return fa.Attention(config, param_dtype=dtype), (_floats(r, (2, 6, D), dtype), positions), det
    raise KeyError(name)


CASES = ["SelfAttention_v1", "SelfAttention_v1-unbatched", "SelfAttention_v2", "CausalAttention",
         "MultiHeadAttentionWrapper", "MultiHeadAttention", "TransformerMultiHeadAttention",
         "LearnedPositionalEmbedding"] + [f"Attention:{c}" for c in ATTENTION]


def _is_float(a):
    return hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)


def _loss_fn(out, cotangents):
    leaves = [a for a in jax.tree_util.tree_leaves(out) if _is_float(a)]
    return sum(jnp.sum(a * c) for a, c in zip(leaves, cotangents))


def _cotangents(out):
    r = np.random.default_rng(1)
    return [jnp.asarray(r.standard_normal(a.shape), a.dtype) for a in jax.tree_util.tree_leaves(out) if _is_float(a)]


def _assert_same(actual, expected, dtype, what):
    a_leaves, e_leaves = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
    assert len(a_leaves) == len(e_leaves) and len(e_leaves) > 0, what
    worst = 0.0
    for a, e in zip(a_leaves, e_leaves):
        assert np.shape(a) == np.shape(e) and np.asarray(a).dtype == np.asarray(e).dtype, what
        if _is_float(e):
            err = max_rel_error(a, e)
            assert err <= TOL[np.dtype(dtype)], f"{what}: {err:.3e}"
            worst = max(worst, err)
        else:
            np.testing.assert_array_equal(a, e, err_msg=what)
    return worst


def _grads_linen(module, variables, inputs, kwargs, float_idx, cot):
    def loss(params, *floats):
        args = list(inputs)
        for i, f in zip(float_idx, floats):
            args[i] = f
        return _loss_fn(module.apply({"params": params}, *args, **kwargs), cot)

    argnums = tuple(range(1 + len(float_idx)))
    return jax.jit(jax.grad(loss, argnums=argnums))(variables["params"], *[inputs[i] for i in float_idx])


def _grads_nnx(model, inputs, kwargs, float_idx, cot):
    def loss(m, *floats):
        args = list(inputs)
        for i, f in zip(float_idx, floats):
            args[i] = f
        return _loss_fn(m(*args, **kwargs), cot)

    argnums = tuple(range(1 + len(float_idx)))
    grads = nnx.jit(nnx.grad(loss, argnums=argnums))(model, *[inputs[i] for i in float_idx])
    return (nnx.to_pure_dict(grads[0]),) + tuple(grads[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_nnx_equals_linen_outputs_and_gradients(name, dtype):
    linen, inputs, kwargs = _case(name, dtype)
    variables = linen.init(jax.random.key(0), *inputs, **kwargs)
    model = fnnx.from_linen(linen, variables)
    assert type(model) is fnnx.nnx_class_of(linen) and type(model).__name__ == type(linen).__name__
    # the same parameter tree, the same arrays
    _assert_same(fnnx.to_linen(model)["params"], variables["params"], dtype, "parameters")
    expected = linen.apply(variables, *inputs, **kwargs)
    eager = _assert_same(model(*inputs, **kwargs), expected, dtype, "eager output")
    jitted = jax.jit(functools.partial(linen.apply, **kwargs))(variables, *inputs)
    nnx_jitted = nnx.jit(lambda m, *a: m(*a, **kwargs))(model, *inputs)
    jit = _assert_same(nnx_jitted, jitted, dtype, "nnx.jit output vs jax.jit output")
    float_idx = [i for i, a in enumerate(inputs) if _is_float(a)]
    cot = _cotangents(expected)
    g_linen = _grads_linen(linen, variables, inputs, kwargs, float_idx, cot)
    g_nnx = _grads_nnx(model, inputs, kwargs, float_idx, cot)
    grads = _assert_same(g_nnx, g_linen, dtype, "gradients (parameters, then float inputs)")
    assert set(traverse_util.flatten_dict(g_nnx[0])) == set(traverse_util.flatten_dict(variables["params"]))
    print(f"{name} {np.dtype(dtype).name}: eager {eager:.1e}, jit {jit:.1e}, gradients {grads:.1e}")


# The Linen layer and its twin share attention_forward: what can differ is how parameters and
# the cache travel, so one config with every parameter kind of a RoPE layer, and T5's table.
CACHE_CONFIGS = {"gqa-rope-window-sinks-per-head-norm": {"num_kv_heads": 2, "sliding_window": 4, "sinks": True,
                                                         "qk_norm": True, "qk_norm_scope": "per_head",
                                                         "qk_norm_zero_centered": True},
                 "t5": {"position": "t5", "t5_num_buckets": 8, "t5_max_distance": 6}}


@pytest.mark.parametrize("name", sorted(CACHE_CONFIGS))
def test_kv_cache_prefill_and_steps_nnx_equals_linen(name):
    dtype = jnp.float64
    config = fa.AttentionConfig(d_model=D, num_heads=N, **CACHE_CONFIGS[name])
    linen = fa.Attention(config, param_dtype=dtype)
    x = _floats(np.random.default_rng(2), (2, 9, D), dtype)
    positions = jnp.broadcast_to(jnp.arange(9), (2, 9))
    variables = linen.init(jax.random.key(0), x, positions)
    model = fnnx.from_linen(linen, variables)
    chunks = [(0, 4), (4, 5), (5, 6), (6, 9)]

    def decode_linen(params, x):
        cache, outs = config.init_cache(batch=2, max_len=12, dtype=dtype), []
        for lo, hi in chunks:
            out, cache = linen.apply({"params": params}, x[:, lo:hi], positions[:, lo:hi], cache=cache)
            outs.append(out)
        return jnp.concatenate(outs, axis=1), cache

    def decode_nnx(m, x):
        cache, outs = config.init_cache(batch=2, max_len=12, dtype=dtype), []
        for lo, hi in chunks:
            out, cache = m(x[:, lo:hi], positions[:, lo:hi], cache=cache)
            outs.append(out)
        return jnp.concatenate(outs, axis=1), cache

    out_l, cache_l = jax.jit(decode_linen)(variables["params"], x)
    out_n, cache_n = nnx.jit(decode_nnx)(model, x)
    _assert_same(out_n, out_l, dtype, "decoded outputs")
    _assert_same(cache_n, cache_l, dtype, "caches")
    assert int(cache_n.length) == 9
    # prefill + steps equal the full pass
    _assert_same(out_n, model(x, positions), dtype, "decoded vs full pass")
    # one step at a time under nnx.jit compiles once
    step = nnx.jit(lambda m, t, p, c: m(t, p, cache=c))
    _, cache = model(x[:, :4], positions[:, :4], cache=config.init_cache(batch=2, max_len=12, dtype=dtype))
    outs = []
    for t in range(4, 9):
        out, cache = step(model, x[:, t:t + 1], positions[:, t:t + 1], cache)
        outs.append(out)
    _assert_same(jnp.concatenate(outs, 1), out_l[:, 4:], dtype, "nnx.jit steps")
    # gradients through prefill and steps
    cot = jnp.asarray(np.random.default_rng(3).standard_normal(out_l.shape), dtype)
    g_l = jax.jit(jax.grad(lambda p, x: jnp.sum(decode_linen(p, x)[0] * cot), argnums=(0, 1)))(variables["params"], x)
    g_n = nnx.jit(nnx.grad(lambda m, x: jnp.sum(decode_nnx(m, x)[0] * cot), argnums=(0, 1)))(model, x)
    _assert_same((nnx.to_pure_dict(g_n[0]), g_n[1]), g_l, dtype, "gradients through the cache")


def test_attention_cross_attention_nnx_equals_linen():
    config = fa.AttentionConfig(d_model=D, num_heads=N, causal=False, position="none")
    linen = fa.Attention(config, param_dtype=jnp.float64)
    r = np.random.default_rng(4)
    x, context = _floats(r, (2, 3, D), jnp.float64), _floats(r, (2, 5, D), jnp.float64)
    variables = linen.init(jax.random.key(0), x, context=context)
    model = fnnx.from_linen(linen, variables)
    _assert_same(nnx.jit(lambda m, x, c: m(x, context=c))(model, x, context),
                 jax.jit(linen.apply)(variables, x, context=context), np.float64, "cross-attention")



def test_context_kv_nnx_equals_linen_and_the_raw_context():
    # Cross-attention keys and values made once by the NNX layer (nnx.jit) equal the Linen
    # layer's; passed as context= they give the raw context's result, in both.
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2, causal=False, qk_norm=True)
    linen = fa.Attention(config, param_dtype=jnp.float64)
    r = np.random.default_rng(6)
    x, context = _floats(r, (2, 3, D), jnp.float64), _floats(r, (2, 5, D), jnp.float64)
    positions, c_positions = jnp.arange(3), jnp.arange(5)
    variables = jax.jit(linen.init)(jax.random.key(0), x, positions, None, context, c_positions)
    model = fnnx.from_linen(linen, variables)
    ckv = nnx.jit(lambda m, c, p: m.context_kv(c, p))(model, context, c_positions)
    ckv_linen = jax.jit(lambda v, c, p: linen.apply(v, c, p, method="context_kv"))(variables, context, c_positions)
    _assert_same(ckv, ckv_linen, np.float64, "ContextKV")
    raw = jax.jit(lambda v, x: linen.apply(v, x, positions, None, context, c_positions))(variables, x)
    _assert_same(nnx.jit(lambda m, x, c: m(x, positions, context=c))(model, x, ckv), raw, np.float64,
                 "NNX with a ContextKV vs Linen with the raw context")

# ---------------------------------------------------------------- dropout, the NNX way

def _dropout_attention():
    config = fa.AttentionConfig(d_model=D, num_heads=N, dropout=0.5)
    x = _floats(np.random.default_rng(5), (2, 6, D), jnp.float64)
    positions = jnp.arange(6)
    return config, x, positions


def test_dropout_uses_the_given_key_in_the_shared_stage():
    config, x, positions = _dropout_attention()
    model = fnnx.Attention(config, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    key = nnx.Rngs(dropout=7).dropout()  # what the call draws from a fresh nnx.Rngs(dropout=7)
    got = model(x, positions, deterministic=False, rngs=nnx.Rngs(dropout=7))
    want = attention_forward(config, fnnx.to_linen(model)["params"], x, positions, dropout_rng=key)
    np.testing.assert_array_equal(got, want)
    no_dropout = model(x, positions, deterministic=True)
    assert (np.asarray(got) != np.asarray(no_dropout)).any()
    np.testing.assert_array_equal(no_dropout, attention_forward(config, fnnx.to_linen(model)["params"], x, positions))
    # a key array works too, and equals the stream's draw
    np.testing.assert_array_equal(model(x, positions, deterministic=False, rngs=key), got)


def test_wrapper_dropout_error_names_the_wrapper():
    model = fnnx.MultiHeadAttentionWrapper(3, 2, 6, 0.1, 2, rngs=nnx.Rngs(0, dropout=1))
    with pytest.raises(ValueError, match=r"MultiHeadAttentionWrapper has dropout=0.1: pass deterministic=True"):
        model(jnp.zeros((1, 2, 3)))


def test_dropout_needs_deterministic_and_follows_eval_train_and_view():
    config, x, positions = _dropout_attention()
    model = fnnx.Attention(config, rngs=nnx.Rngs(0, dropout=1))
    x = x.astype(jnp.float32)
    with pytest.raises(ValueError, match=r"Attention has dropout=0.5: pass deterministic=True .* "
                                         r"rngs=nnx.Rngs\(dropout=key\)"):
        model(x, positions)
    model.eval()
    a, b = model(x, positions), model(x, positions)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, model(x, positions, deterministic=True))
    model.train()
    c, d = model(x, positions), model(x, positions)  # the stored stream advances between calls
    assert (np.asarray(c) != np.asarray(d)).any() and (np.asarray(c) != np.asarray(a)).any()
    viewed = nnx.view(model, deterministic=True)
    np.testing.assert_array_equal(viewed(x, positions), a)
    # the same stream state gives the same masks: two models from the same rngs agree
    m1 = fnnx.Attention(config, rngs=nnx.Rngs(0, dropout=1), deterministic=False)
    m2 = fnnx.Attention(config, rngs=nnx.Rngs(0, dropout=1), deterministic=False)
    np.testing.assert_array_equal(m1(x, positions), m2(x, positions))
    # under nnx.jit the stream advances too
    f = nnx.jit(lambda m, x: m(x, positions))
    assert (np.asarray(f(m1, x)) != np.asarray(f(m1, x))).any()


@pytest.mark.parametrize("name, args", [("CausalAttention", (3, 4, 6, 0.5)), ("MultiHeadAttention", (3, 4, 6, 0.5, 2)),
                                        ("MultiHeadAttentionWrapper", (3, 2, 6, 0.5, 2))])
def test_chapter_dropout_modules(name, args):
    x = _floats(np.random.default_rng(6), (2, 6, 3), jnp.float32)
    model = getattr(fnnx, name)(*args, rngs=nnx.Rngs(0, dropout=3))
    no_dropout = getattr(fnnx, name)(*args[:3], 0.0, *args[4:], rngs=nnx.Rngs(0))
    nnx.update(no_dropout, nnx.state(model, nnx.Param))
    np.testing.assert_array_equal(model(x, deterministic=True), no_dropout(x))
    train = model(x, deterministic=False)
    assert (np.asarray(train) != np.asarray(no_dropout(x))).any()
    # a fresh model from the same rngs draws the same masks
    again = getattr(fnnx, name)(*args, rngs=nnx.Rngs(0, dropout=3))
    np.testing.assert_array_equal(again(x, deterministic=False), train)
    with pytest.raises(ValueError, match="pass deterministic=True"):
        model(x)
    # a key given to the call goes to the shared stage as it is
    if name == "CausalAttention":
        params = fnnx.to_linen(model)["params"]
        from flax_attn.textbook.chapter import causal_attention
        key = jax.random.key(11)
        np.testing.assert_array_equal(model(x, deterministic=False, rngs=key),
                                      causal_attention(3, 6, 0.5, params, x, dropout_rng=key))


def test_dropout_modules_build_without_a_dropout_stream():
    """An nnx.Rngs with no dropout stream (params only) builds the module; its calls that drop
    take the key at the call, and without one say so."""
    config, x, positions = _dropout_attention()
    model = fnnx.Attention(config, deterministic=True, rngs=nnx.Rngs(params=0))
    x = x.astype(jnp.float32)
    model(x, positions)
    with pytest.raises(ValueError, match=r"Attention applies dropout \(deterministic=False\) but has no dropout key"):
        model(x, positions, deterministic=False)
    a = model(x, positions, deterministic=False, rngs=nnx.Rngs(dropout=4))
    np.testing.assert_array_equal(a, model(x, positions, deterministic=False, rngs=nnx.Rngs(dropout=4)))
    for name, args in (("CausalAttention", (3, 4, 6, 0.5)), ("MultiHeadAttention", (3, 4, 6, 0.5, 2)),
                       ("MultiHeadAttentionWrapper", (3, 2, 6, 0.5, 2))):
        getattr(fnnx, name)(*args, rngs=nnx.Rngs(params=0))(jnp.ones((1, 6, 3)), deterministic=True)


def test_wrapper_heads_drop_independently_with_a_key():
    """Heads of equal weights given one key at the call still draw different masks (the key
    is split per head), as they do from a stream."""
    x = _floats(np.random.default_rng(7), (1, 6, 3), jnp.float32)
    model = fnnx.MultiHeadAttentionWrapper(3, 2, 6, 0.5, 3, rngs=nnx.Rngs(0))
    for i in (1, 2):
        nnx.update(getattr(model, f"heads_{i}"), nnx.state(model.heads_0, nnx.Param))
    np.testing.assert_array_equal(model(x, deterministic=True)[..., :2], model(x, deterministic=True)[..., 2:4])
    for rngs in (jax.random.key(5), nnx.Rngs(dropout=5)):
        y = np.asarray(model(x, deterministic=False, rngs=rngs))
        assert not np.array_equal(y[..., 0:2], y[..., 2:4]) and not np.array_equal(y[..., 2:4], y[..., 4:6])
    np.testing.assert_array_equal(model(x, deterministic=False, rngs=jax.random.key(5)),
                                  model(x, deterministic=False, rngs=jax.random.key(5)))


# ---------------------------------------------------------------- conversions

def test_from_linen_forms_and_round_trip():
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2, qk_norm=True)
    linen = fa.Attention(config)
    x = jnp.ones((1, 2, D))
    variables = linen.init(jax.random.key(0), x, jnp.arange(2))
    a = fnnx.from_linen(linen, variables)                                   # a Linen module
    b = fnnx.from_linen(fnnx.Attention, variables, config=config)           # an NNX class
    c = fnnx.from_linen(fnnx.Attention(config, rngs=nnx.Rngs(5)), variables)  # an NNX module, in place
    want = traverse_util.flatten_dict(variables["params"])
    for m in (a, b, c):
        got = traverse_util.flatten_dict(fnnx.to_linen(m)["params"])
        assert set(got) == set(want)
        for p in want:
            assert got[p].dtype == want[p].dtype and np.array_equal(got[p], want[p]), p
    assert fnnx.linen_twin(a) == linen
    with pytest.raises(fa.interop.StateDictError, match=r"parameter q_proj/kernel has dtype int32, expected a "
                                                         r"floating dtype as the module's"):
        fnnx.from_linen(linen, jax.tree.map(lambda v: v.astype(jnp.int32), variables))
    twin = fnnx.nnx_twin(linen, rngs=nnx.Rngs(0))
    assert type(twin) is fnnx.Attention and twin.config == config
    # any NNX module converts: Flax's own
    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    assert set(fnnx.to_linen(lin)["params"]) == {"kernel", "bias"}
    fnnx.from_linen(lin, {"params": {"kernel": jnp.zeros((3, 2)), "bias": jnp.ones(2)}})
    np.testing.assert_array_equal(lin(jnp.ones((1, 3))), jnp.ones((1, 2)))


def test_from_linen_is_strict():
    model = fnnx.MultiHeadAttention(4, 6, 6, 0.0, 2, rngs=nnx.Rngs(0))
    params = fnnx.to_linen(model)["params"]
    bad = {k: dict(v) for k, v in params.items()}
    del bad["W_key"]
    bad["W_value"]["kernel"] = jnp.zeros((6, 4))
    bad["extra"] = {"kernel": jnp.zeros(2)}
    with pytest.raises(fa.StateDictError) as e:
        fnnx.from_linen(model, bad)
    msg = str(e.value)
    for part in ("missing parameter W_key/kernel (expected shape (4, 6))",
                 "unexpected parameter extra/kernel with shape (2,)",
                 "parameter W_value/kernel has shape (6, 4), expected (4, 6)"):
        assert part in msg
    with pytest.raises(TypeError, match="object has no NNX twin"):
        fnnx.nnx_class_of(object)
    with pytest.raises(TypeError, match="from_linen takes an NNX module or class or a flax_attn Linen module"):
        fnnx.from_linen("Attention", params)
    with pytest.raises(TypeError, match="rngs and constructor arguments are for a class or a Linen module"):
        fnnx.from_linen(model, params, rngs=nnx.Rngs(1))


def test_constructors_take_the_linen_fields():
    # every NNX twin is built from its Linen module's fields, and back
    cases = [fa.SelfAttention_v1(3, 2), fa.SelfAttention_v2(3, 2, True), fa.CausalAttention(3, 2, 6, 0.1, True),
             fa.MultiHeadAttentionWrapper(3, 2, 6, 0.1, 3), fa.MultiHeadAttention(4, 6, 5, 0.1, 2, True),
             fa.TransformerMultiHeadAttention(8, 2), fa.LearnedPositionalEmbedding(7, 3),
             fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, position="t5"))]
    for linen in cases:
        model = fnnx.nnx_twin(linen, rngs=nnx.Rngs(0))
        assert fnnx.linen_twin(model) == linen
        template = fa.interop.param_template(linen)
        got = traverse_util.flatten_dict(fnnx.to_linen(model)["params"])
        want = traverse_util.flatten_dict(template)
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}, type(linen).__name__


def test_checkpoint_round_trip_through_the_linen_twin(tmp_path):
    # flax_attn.checkpoint records a Linen module's configuration; an NNX module saves and
    # restores through its Linen twin, bit for bit, and a mismatch is still caught.
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2, position="t5")
    model = fnnx.Attention(config, param_dtype=jnp.float64, rngs=nnx.Rngs(3))
    fa.checkpoint.save(tmp_path, 0, fnnx.linen_twin(model), fnnx.to_linen(model))
    restored = fnnx.from_linen(fnnx.Attention(config, rngs=nnx.Rngs(4)),
                               fa.checkpoint.restore(tmp_path, fnnx.linen_twin(model)))
    want = traverse_util.flatten_dict(fnnx.to_linen(model)["params"])
    got = traverse_util.flatten_dict(fnnx.to_linen(restored)["params"])
    assert set(got) == set(want)
    for p in want:
        assert got[p].dtype == jnp.float64
        np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))
    other = fnnx.Attention(fa.AttentionConfig(d_model=D, num_heads=2, num_kv_heads=2, position="t5"), rngs=nnx.Rngs(0))
    with pytest.raises(fa.checkpoint.CheckpointMismatchError, match="num_heads"):
        fa.checkpoint.restore(tmp_path, fnnx.linen_twin(other))
