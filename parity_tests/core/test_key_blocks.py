"""Key blocks (``implementation='key_blocks'``): the key blocks up to the longest row's key/value
length, skipped past it at run time; with keys lying as a 'BKSH' cache's, one plain pass
when more than half of them are in use.

The conformance suite holds it to the float64 reference wherever a call has lengths or a
boolean mask over the keys (by blocks there, one block on its small shapes: lengths not declared
finite leave no plain-pass branch); here the lengths are short, so the blocks run, on small
blocks (4 keys: several blocks, the last one short), against the plain path in float64:
outputs, log-sum-exp, gradients, forward mode and vmap; garbage past the lengths zeroed block
by block; the choice for chunks over a cache. And a decoding loop over a KV cache (a prompt,
chunks, single tokens): the layer gives the core its filled length, and the steps agree with
the plain path.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn.core import KeyBlocks, native, registry, tuning
from flax_attn.core.key_blocks import keys_in_use
from flax_attn.core import mask as M
from flax_attn.core.call import describe
from conftest import assert_close

B, T, N, K, S, H = 3, 2, 4, 2, 22, 8
BLOCKS = KeyBlocks(block_k=4)


def _inputs(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal(shape).astype(dtype))
               for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    bias = jnp.asarray(rng.standard_normal((B, N, T, S)).astype(dtype))
    return q, k, v, bias


# rows use 9, 0 and 5 of the 22 keys (the longest under half: the blocks run); the queries sit
# at the end of each row's keys, as when decoding
LENGTHS = np.array([9, 0, 5], np.int32)
Q_POS = np.stack([np.arange(T) + max(n - T, 0) for n in LENGTHS]).astype(np.int32)
K_POS = np.tile(np.arange(S, dtype=np.int32), (B, 1))
FEATURES = {
    "lengths": dict(),
    "causal-positions": dict(is_causal=True, query_positions=Q_POS, key_positions=K_POS),
    "window-softcap-sinks": dict(is_causal=True, local_window_size=(3, 0), query_positions=Q_POS,
                                 key_positions=K_POS, logit_softcap=2.0, sinks=jnp.linspace(-1.0, 1.0, N)),
    "segments-bias": dict(query_segment_ids=np.array([[0, 1], [0, 0], [1, 1]], np.int32),
                          key_segment_ids=np.tile((np.arange(S) % 3 == 0).astype(np.int32), (B, 1)), bias=True),
    "score_mod": dict(score_mod=lambda s, b, h, qi, ki: s - 0.1 * h * (qi - ki)),
}


@pytest.fixture(params=[False, True], ids=["matmul", "block-diagonal"])
def avx512(request, monkeypatch):
    """Keys as given are read by block-diagonal queries on a CPU with AVX-512, by matmuls over
    regrouped blocks without it: both forms, whatever this machine has."""
    monkeypatch.setattr(tuning, "has_avx512", lambda: request.param)
    return request.param


@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
def test_blocks_equal_the_plain_path_with_gradients(feature, avx512):
    q, k, v, bias = _inputs()
    kw = dict(FEATURES[feature])
    use_bias = kw.pop("bias", False)

    def f(impl):
        def run(q, k, v, bias):
            out, lse = fa.dot_product_attention(q, k, v, bias if use_bias else None, key_value_seq_lengths=LENGTHS,
                                                return_residual=True, implementation=impl, **kw)
            return out, jnp.where(jnp.isfinite(lse), lse, 0.0)
        return run

    got, want = f(BLOCKS)(q, k, v, bias), f("xla")(q, k, v, bias)
    for g, w, what in zip(got, want, ("out", "lse")):
        assert_close(g, w, np.float64, f"{feature} {what}")
    np.testing.assert_array_equal(got[0][1], 0.0)  # the row with no keys: zeros
    loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a)[0] * jnp.cos(jnp.arange(H)))
    grads = jax.grad(loss(BLOCKS), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w, what in zip(grads, jax.grad(loss("xla"), argnums=(0, 1, 2, 3))(q, k, v, bias), "qkvb"):
        assert_close(g, w, np.float64, f"{feature} d{what}")
    np.testing.assert_array_equal(grads[1][:, 9:], 0.0)  # keys past every length get no gradient


@pytest.mark.parametrize("stored", [None, "BKSH"])
def test_forward_mode_vmap_and_both_branches(stored, avx512):
    """Forward mode and vmap, with keys as given (by matmuls, blocks all the way: the last block
    of 4 is cut back to keys 18..21; by block-diagonal queries, blocks then one pass over all
    the keys past half of them) and declared to lie as a 'BKSH' cache's (blocks, then the plain
    pass past half the keys). The choice is a cond, whose both branches run under vmap."""
    q, k, v, _ = _inputs(1)
    # lengths declared finite past them (a cache's): with NaN possible there the plain pass
    # would need the keys zeroed first, so the blocks would run all the way
    run = lambda impl, n: lambda q, k, v: fa.dot_product_attention(  # noqa: E731
        q, k, v, mask=M.lengths(key_value_seq_lengths=n, finite_past_lengths=True), implementation=impl)
    tangents = tuple(jnp.ones_like(x) for x in (q, k, v))
    with tuning.keys_stored(stored):
        for lengths in (LENGTHS, np.array([20, 3, 22], np.int32)):  # under half of the 22 keys; past half
            got = jax.jvp(run(BLOCKS, lengths), (q, k, v), tangents)
            want = jax.jvp(run("xla", lengths), (q, k, v), tangents)
            for g, w in zip(got, want):
                assert_close(g, w, np.float64, f"jvp, lengths {lengths}")
        # vmapped over a stack of calls with their own lengths
        stack = np.stack([LENGTHS, np.array([20, 3, 22], np.int32)])
        many = lambda impl: jax.vmap(lambda n: run(impl, n)(q, k, v))(stack)
        assert_close(many(BLOCKS), many("xla"), np.float64, "vmap")


def test_under_jit_the_lengths_are_run_time_values():
    q, k, v, _ = _inputs(2, np.float32)
    traced = []

    def run(q, k, v, n):
        traced.append(n.shape)
        return fa.dot_product_attention(q, k, v, key_value_seq_lengths=n, implementation=BLOCKS)

    step = jax.jit(run)
    for lengths in (np.array([1, 2, 3]), np.array([8, 4, 11]), np.array([22, 22, 22])):
        want = fa.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
        assert_close(step(q, k, v, jnp.asarray(lengths, jnp.int32)), want, np.float32, f"lengths {lengths}")
    assert len(traced) == 1  # one trace, so one program, for every fill


def test_finite_past_lengths_skips_the_zeroing_and_nan_needs_it():
    q, k, v, _ = _inputs(3)
    k_nan = k.at[:, 12:].set(jnp.nan)
    lengths = np.array([9, 2, 12], np.int32)
    want = fa.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="xla")
    # the default lengths rule zeroes what lies past the lengths: NaN there never leaks
    got = fa.dot_product_attention(q, k_nan, v, key_value_seq_lengths=lengths, implementation=BLOCKS)
    assert_close(got, want, np.float64, "NaN past the lengths")
    # finite_past_lengths promises finite values there (a cache's zeros): the same result, no zeroing pass
    finite = M.lengths(key_value_seq_lengths=lengths, finite_past_lengths=True)
    for impl in (BLOCKS, "xla", "blockwise"):
        got = fa.dot_product_attention(q, k, v, mask=finite, implementation=impl)
        assert_close(got, want, np.float64, f"finite_past_lengths, {impl}")
    call = describe(q, k, v, mask=finite)
    assert call.mask.key_visible() is None and describe(q, k, v, key_value_seq_lengths=lengths).mask.key_visible() is not None


@pytest.mark.parametrize("form", ["blocks", "one-row-summed"])
@pytest.mark.parametrize("stored", [None, "BKSH"])
def test_nan_past_the_lengths_is_zeroed_block_by_block(form, stored, avx512):
    """Garbage past the lengths and under negative key segment ids (NaN, Inf) in keys and
    values: the key blocks zero what they read of it in each visited block (matmuls over
    regrouped blocks, block-diagonal queries, or products summed in place), so outputs and
    gradients equal those of clean inputs, which equal the plain path's; and no zeroing pass
    over all the keys runs before them (a read and a write of the whole cache)."""
    rng = np.random.default_rng(7)
    summed = form == "one-row-summed"  # one query row per unit: a query head per key/value head, one token
    rows, heads = (1, K) if summed else (T, N)
    q = jnp.asarray(rng.standard_normal((B, rows, heads, H)))
    k, v = (rng.standard_normal((B, S, K, H)) for _ in range(2))
    seg = np.zeros((B, S), np.int32)
    seg[0, 3] = -1  # a blocked key inside row 0's length
    blocked = (np.arange(S)[None] >= LENGTHS[:, None]) | (seg < 0)
    dirty_k, dirty_v = k.copy(), v.copy()
    dirty_k[blocked], dirty_v[blocked] = np.nan, np.inf
    kw = dict(key_value_seq_lengths=LENGTHS, key_segment_ids=seg, query_segment_ids=np.zeros((B, rows), np.int32))
    f = lambda impl: lambda q, k, v: fa.dot_product_attention(q, k, v, implementation=impl, **kw)  # noqa: E731
    loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a) * jnp.cos(jnp.arange(H)))  # noqa: E731
    run = lambda *a: (f(BLOCKS)(*a), jax.grad(loss(BLOCKS), argnums=(0, 1, 2))(*a))  # noqa: E731
    with tuning.keys_stored(stored), tuning.compiled_with(tuning.YNNPACK_OFF if summed else {}):
        clean = jax.jit(run)(q, jnp.asarray(k), jnp.asarray(v))
        dirty = jax.jit(run)(q, jnp.asarray(dirty_k), jnp.asarray(dirty_v))
        jaxpr = jax.make_jaxpr(f(BLOCKS))(q, jnp.asarray(k), jnp.asarray(v))
    whole = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name in ("select_n", "select")
             and any(getattr(x.aval, "shape", None) == k.shape for x in e.invars)]
    assert not whole, "the keys or values were zeroed whole before the blocks"
    dots = sum(e.primitive.name == "dot_general" for e in _equations(jaxpr.jaxpr))
    assert (dots == 0) == summed, f"{dots} matmuls: the {form} form did not run"
    for what, a, b in zip(("out", "dq", "dk", "dv"), (dirty[0], *dirty[1]), (clean[0], *clean[1])):
        assert np.isfinite(np.asarray(a)).all(), f"{what} is not finite"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} differs from the clean run")
    assert_close(clean[0], f("xla")(q, jnp.asarray(k), jnp.asarray(v)), np.float64, "clean output")
    for g, w, what in zip(clean[1], jax.grad(loss("xla"), argnums=(0, 1, 2))(q, jnp.asarray(k), jnp.asarray(v)), "qkv"):
        assert_close(g, w, np.float64, f"d{what}")


def test_automatic_choice_and_refusals(monkeypatch):
    """The choices among the pure-JAX paths (on a CPU where the compiled kernel runs, it takes
    the float32 calls it serves first, decoding steps included: tested in test_native.py)."""
    monkeypatch.setattr(native, "unavailable", lambda isa=None: "this CPU (the kernel needs AVX-512, or AVX2 with FMA)")

    def call(S, T=1, platform="cpu", lengths=True, **kw):
        q = jax.ShapeDtypeStruct((8, T, 12, 64), jnp.float32)
        k = jax.ShapeDtypeStruct((8, S, 12, 64), jnp.float32)
        n = np.full((8,), 100, np.int32) if lengths else None
        return describe(q, k, k, key_value_seq_lengths=n, platform=platform, **kw)

    assert registry.choose(call(8192)).name == "key_blocks"   # 64 blocks of 128 keys over 96 units
    assert registry.choose(call(8192, T=16)).name == "key_blocks"
    # more queries than a decoding step: taken over a KV cache (declared by the layer) of at
    # least 4 times as many slots (a chunk of a prompt), not over other keys (cross-attention,
    # self-attention: query blocks or the plain path)
    assert registry.choose(call(8192, T=17)).name != "key_blocks"
    with tuning.keys_stored("BKSH"):
        assert registry.choose(call(8192, T=17)).name == "key_blocks"
        assert registry.choose(call(8192, T=2048)).name == "key_blocks"
        assert registry.choose(call(8192, T=2049)).name != "key_blocks"
        assert registry.choose(call(1024, T=1024)).name != "key_blocks"
    # self-attention with key lengths: not key blocks
    assert registry.choose(describe(*(jax.ShapeDtypeStruct((8, 1024, 12, 64), jnp.float32),) * 3, platform="cpu",
                                    key_value_seq_lengths=np.full((8,), 100, np.int32))).name == "query_blocks"
    with tuning.keys_stored("BSKH"):
        assert KeyBlocks().preferred(call(8192, T=17)) and not KeyBlocks(keys_per_query=1024).preferred(call(8192, T=17))
    # multi-query attention, 128 heads over one latent key (absorbed MLA): 128 rows, one query
    mqa = describe(jax.ShapeDtypeStruct((2, 1, 128, 576), jnp.float32), jax.ShapeDtypeStruct((2, 8192, 1, 576), jnp.float32),
                   jax.ShapeDtypeStruct((2, 8192, 1, 576), jnp.float32), key_value_seq_lengths=np.full((2,), 100, np.int32),
                   platform="cpu")
    assert registry.choose(mqa).name == "key_blocks"
    assert registry.choose(call(256)).name == "xla"             # one block: the plain pass
    assert registry.choose(call(8192, lengths=False)).name != "key_blocks"   # nothing bounds the keys in use
    assert registry.choose(call(8192, platform="gpu")).name != "key_blocks"
    assert KeyBlocks()._block_k(call(8192)) == 128              # 96 units x 128 keys x (64 + 64) x 4 bytes = 6 MiB
    assert KeyBlocks(block_k=64)._block_k(call(8192)) == 64
    with pytest.raises(ValueError, match="key_blocks' does not support calls without key/value lengths"):
        fa.dot_product_attention(*_inputs()[:3], implementation="key_blocks")
    with pytest.raises(ValueError, match="KeyBlocks block_k"):
        KeyBlocks(block_k=0)
    with pytest.raises(ValueError, match="KeyBlocks keys_per_query"):
        KeyBlocks(keys_per_query=0)


@pytest.mark.parametrize("shape", ["(B,1,1,S)", "(S,)", "(B,N,T,S)"])
def test_a_boolean_mask_over_the_keys_bounds_the_blocks(shape, avx512):
    """A boolean mask with a key axis and no lengths (a padding mask over a cache, as Flax's
    decoding builds): its last allowed key bounds the blocks visited, garbage under its
    all-False columns (NaN, Inf) is zeroed block by block, and outputs and gradients equal
    the plain path's on clean inputs. The automatic choice takes the key blocks for a decoding
    step over a large cache with such a mask."""
    q, k, v, _ = _inputs(3)
    rng = np.random.default_rng(8)
    cols = np.arange(S)[None, None, None, :] < LENGTHS[:, None, None, None]  # (B, 1, 1, S)
    mask = {"(B,1,1,S)": cols, "(S,)": np.arange(S) < 7,
            "(B,N,T,S)": cols & (rng.random((B, N, T, S)) < 0.7)}[shape]
    blocked = ~np.broadcast_to(mask, (B, N, T, S)).any(axis=(1, 2))  # (B, S): no query may use them
    dirty_k, dirty_v = np.array(k), np.array(v)
    dirty_k[blocked], dirty_v[blocked] = np.nan, -np.inf
    f = lambda impl: lambda q, k, v: fa.dot_product_attention(q, k, v, mask=mask, implementation=impl)  # noqa: E731
    loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a) * jnp.cos(jnp.arange(H)))  # noqa: E731
    run = jax.jit(lambda *a: (f(BLOCKS)(*a), jax.grad(loss(BLOCKS), argnums=(0, 1, 2))(*a)))
    clean, dirty = run(q, k, v), run(q, jnp.asarray(dirty_k), jnp.asarray(dirty_v))
    for what, a, b in zip(("out", "dq", "dk", "dv"), (dirty[0], *dirty[1]), (clean[0], *clean[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what} differs from the clean run")
    assert_close(clean[0], f("xla")(q, k, v), np.float64, "out")
    for g, w, what in zip(clean[1], jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v), "qkv"):
        assert_close(g, w, np.float64, f"d{what}")
    # the blocks stop after the last key some query may use
    want = int(np.max(np.nonzero(~blocked.all(axis=0))[0])) + 1
    assert int(keys_in_use(describe(q, k, v, mask=mask).mask, S)) == want
    assert int(keys_in_use(describe(q, k, v, mask=np.zeros(S, bool)).mask, S)) == 0
    step = describe(jax.ShapeDtypeStruct((8, 1, 12, 64), jnp.float32), *(jax.ShapeDtypeStruct((8, 8192, 12, 64), jnp.float32),) * 2,
                    mask=np.ones((8, 1, 1, 8192), bool), platform="cpu")
    assert registry.choose(step).name == "key_blocks"


def test_no_plain_pass_past_max_queries():
    """Past ``max_queries`` query tokens the blocks run at any fill: the plain pass over all the
    keys would hold logits for every query against every key at once. Both give the plain
    path's result."""
    q, k, v, _ = _inputs(2)
    finite = M.lengths(key_value_seq_lengths=np.array([20, 3, 22], np.int32), finite_past_lengths=True)
    run = lambda impl: lambda q, k, v: fa.dot_product_attention(q, k, v, mask=finite, implementation=impl)  # noqa: E731
    with tuning.keys_stored("BKSH"):
        dots = {n: sum(e.primitive.name == "dot_general" for e in _equations(jax.make_jaxpr(run(KeyBlocks(block_k=4, max_queries=n)))(q, k, v).jaxpr))
                for n in (T, T - 1)}
        assert dots == {T: 4, T - 1: 2}, dots  # the blocks' two matmuls, and the plain pass's two up to max_queries
        for n in (T, T - 1):
            assert_close(run(KeyBlocks(block_k=4, max_queries=n))(q, k, v), run("xla")(q, k, v), np.float64, f"max_queries {n}")


@pytest.mark.parametrize("l2, block", [(1 << 20, 512), (512 << 10, 256), (2 << 20, 1024)])
def test_default_key_block_follows_the_l2_cache(monkeypatch, l2, block):
    """Batch 1, 12 heads of 64: a block of c keys and values is 12 * c * 128 * 4 bytes, and the
    default is the largest power of two whose block fits three L2 caches."""
    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: l2)
    q = jax.ShapeDtypeStruct((1, 1, 12, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 8192, 12, 64), jnp.float32)
    call = describe(q, k, k, key_value_seq_lengths=np.full((1,), 100, np.int32), platform="cpu")
    assert KeyBlocks()._block_k(call) == block


def test_a_decoding_loop_over_a_large_cache_follows_the_plain_path():
    """A layer decoding into a cache of 64 slots, a prompt of 3 tokens, chunks of 5, then one
    token a step: the core gets the filled length, and key blocks of 8 (one-token steps: the
    blocks while at most 32 slots are filled, then the plain pass; chunks: the blocks, their
    segment ids blocking the unwritten slots) give the plain path's outputs at every step; so do
    key blocks taking no plain pass for chunks past ``max_queries`` tokens."""
    config = fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=2, position="rope")
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 40, 16)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(40), (2, 40))
    params = fa.Attention(config).init(jax.random.key(0), x[:, :4], positions[:, :4])
    outs = {}
    edges = [0, 3, 8, 13, 18, 23] + list(range(24, 41))
    for impl in (KeyBlocks(block_k=8), KeyBlocks(block_k=8, max_queries=2), "xla"):
        layer = fa.Attention(config, implementation=impl)
        step = jax.jit(lambda cache, x, positions: layer.apply(params, x, positions, cache=cache))
        cache, pieces = layer.init_cache(2, 64), []
        for a, b in zip(edges[:-1], edges[1:]):
            out, cache = step(cache, x[:, a:b], positions[:, a:b])
            pieces.append(out)
        outs[str(impl)] = jnp.concatenate(pieces, axis=1)
    *blocks, plain = outs.values()
    for got in blocks:
        assert_close(got, plain, np.float32, "key blocks vs plain, per step")
    assert_close(plain, fa.Attention(config).apply(params, x, positions), np.float32, "decode vs the full pass")



@pytest.mark.parametrize("layout", ["BSKH", "BKSH"])
def test_a_cache_of_either_layout_is_cut_into_blocks_where_it_lies(layout, avx512):
    """Decoding into a cache of 60 slots by key blocks of 8 (60 is no multiple of 8: the last
    block is cut back to slots 52..59, the slots it shares with the one before blocked), up to a
    full cache: the steps give the plain path's outputs. A 'BKSH' cache (declared by the layer)
    takes the plain pass past half the slots. A 'BSKH' cache is never transposed whole: by
    matmuls it goes by blocks all the way, each block regrouped as it is cut; by block-diagonal
    queries (a CPU with AVX-512) its blocks are read as cut, ``(B, 8, K*H)``, and past half the
    slots the whole cache in one pass, ``(B, 60, K*H)``, where it lies."""
    config = fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=2, position="rope")
    L = 60
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, L, 16)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(L), (2, L))
    params = fa.Attention(config).init(jax.random.key(0), x[:, :4], positions[:, :4])
    outs = {}
    for impl in (KeyBlocks(block_k=8), "xla"):
        layer = fa.Attention(config, implementation=impl)
        apply = lambda cache, x, positions: layer.apply(params, x, positions, cache=cache)  # noqa: E731
        step = jax.jit(apply)
        cache = layer.init_cache(2, L, layout=layout)
        out, cache = step(cache, x[:, :3], positions[:, :3])
        pieces = [out]
        for t in range(3, L):
            out, cache = step(cache, x[:, t:t + 1], positions[:, t:t + 1])
            pieces.append(out)
        outs[str(impl)] = jnp.concatenate(pieces, axis=1)
        if impl != "xla":
            jaxpr = jax.make_jaxpr(apply)(cache, x[:, :1], positions[:, :1]).jaxpr
            whole = [e for e in _equations(jaxpr) if e.primitive.name == "transpose"
                     and L in e.invars[0].aval.shape]
            assert bool(whole) == (layout == "BKSH"), whole  # BKSH: its (B*K, S, H) regrouped in place
            read = {e.invars[1].aval.shape for e in _equations(jaxpr) if e.primitive.name == "dot_general"}
            diagonal = layout == "BSKH" and avx512
            assert ({(2, 8, 2 * 4), (2, L, 2 * 4)} <= read) == diagonal, read
    blocks, plain = outs.values()
    assert_close(blocks, plain, np.float32, f"{layout}: key blocks vs plain, per step")
    assert_close(plain, fa.Attention(config).apply(params, x, positions), np.float32, "decode vs the full pass")


def test_block_diagonal_queries_only_while_their_columns_are_few(monkeypatch):
    """Block-diagonal queries do K times the multiplications: on a CPU with AVX-512 keys as
    given take them while K * G * T <= DIAGONAL_MAX_COLUMNS (16 heads of one token here), and
    the regrouped blocks' matmuls past that (two tokens); both equal the plain path."""
    from flax_attn.core import numerics
    monkeypatch.setattr(tuning, "has_avx512", lambda: True)
    rng = np.random.default_rng(7)
    k, v = (jnp.asarray(rng.standard_normal((1, 64, 16, 8)), jnp.float32) for _ in range(2))
    for T, diagonal in ((1, True), (2, False)):
        assert (16 * T <= numerics.DIAGONAL_MAX_COLUMNS) == diagonal
        q = jnp.asarray(rng.standard_normal((1, T, 16, 8)), jnp.float32)
        run = lambda impl: lambda q, k, v: fa.dot_product_attention(  # noqa: E731
            q, k, v, key_value_seq_lengths=np.array([20], np.int32), implementation=impl)
        read = {e.invars[1].aval.shape for e in _equations(jax.make_jaxpr(run(KeyBlocks(block_k=8)))(q, k, v).jaxpr)
                if e.primitive.name == "dot_general"}
        assert ((1, 8, 16 * 8) in read) == diagonal, (T, read)
        assert_close(run(KeyBlocks(block_k=8))(q, k, v), run("xla")(q, k, v), np.float32, f"T={T}")


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (loops, conds, calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)

# a KV cache's lengths: the slots past them hold zeros, so the plain pass needs no zeroing first
FINITE = M.lengths(key_value_seq_lengths=LENGTHS, finite_past_lengths=True)
ONE_ROW = {
    "lengths": dict(),
    "causal-window-softcap": dict(is_causal=True, local_window_size=(3, 0), query_positions=Q_POS[:, -1:],
                                  key_positions=K_POS, logit_softcap=2.0),
}


@pytest.mark.parametrize("stored", [None, "BKSH"])
@pytest.mark.parametrize("feature", list(ONE_ROW), ids=list(ONE_ROW))
def test_one_row_units_sum_in_place_when_compiled_without_ynnpack(feature, stored):
    """One query row per (batch row, key/value head) unit (multi-head decoding), traced for a
    program without YNNPACK's fusions (tuning.compiled_with): the blocks' logits and weighted
    values are summed products, not matmuls, over each block as cut ((B, c, K, H) keys as given)
    or regrouped in place (keys declared to lie as a 'BKSH' cache's); outputs, log-sum-exp and
    gradients are the plain path's (float64). Traced without the declaration, the blocks keep
    their matmuls."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, 1, K, H)))
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H))) for _ in range(2))

    def f(impl):
        def run(q, k, v):
            out, lse = fa.dot_product_attention(q, k, v, mask=FINITE, return_residual=True,
                                                implementation=impl, **ONE_ROW[feature])
            return out, jnp.where(jnp.isfinite(lse), lse, 0.0)
        return run

    loss = lambda impl: lambda *a: jnp.sum(f(impl)(*a)[0] * jnp.cos(jnp.arange(H)))  # noqa: E731
    dots = lambda: str(jax.make_jaxpr(f(BLOCKS))(q, k, v)).count("dot_general")  # noqa: E731
    with tuning.keys_stored(stored):
        matmul_dots = dots()
        with tuning.compiled_with(tuning.YNNPACK_OFF):
            summed_dots = dots()
            assert summed_dots == (2 if stored else 0)  # a 'BKSH' cache's plain-pass branch keeps its matmuls
            assert matmul_dots > summed_dots
            got = jax.jit(f(BLOCKS))(q, k, v)
            grads = jax.jit(jax.grad(loss(BLOCKS), argnums=(0, 1, 2)))(q, k, v)
    assert not tuning.ynnpack_fusions_off()  # the declaration ends with its block
    for g, w, what in zip(got, f("xla")(q, k, v), ("out", "lse")):
        assert_close(g, w, np.float64, f"{feature} {what}")
    for g, w, what in zip(grads, jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v), "qkv"):
        assert_close(g, w, np.float64, f"{feature} d{what}")
