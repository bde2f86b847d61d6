"""The blockwise implementation held to the reference (the plain XLA path): outputs and
gradients, float64 <= 1e-12 and float32 <= 1e-5, over masks, windows, GQA, padding, segments,
positions, bias and soft-cap. Tiny block sizes make every block-skipping branch run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from flax_attn.core import Blockwise
from conftest import DTYPES, assert_close, run_parity

SMALL = Blockwise(block_q=8, block_k=8)


def _case(name, B=2, T=37, S=37, N=4, K=2, H=8, Hv=8, seed=0):
    """Arrays and keyword arguments for one feature combination."""
    rng = np.random.default_rng(seed)
    a = lambda *shape: rng.standard_normal(shape)
    q, k, v = a(B, T, N, H), a(B, S, K, H), a(B, S, K, Hv)
    bias, kw = None, {}
    seg_q = np.repeat([[0, 1], [1, -1]], [T // 2, T - T // 2], axis=1)
    seg_k = np.repeat([[0, 1], [1, -1]], [S // 2, S - S // 2], axis=1)
    if name == "causal":
        kw = {"is_causal": True}
    elif name == "window-causal":
        kw = {"is_causal": True, "local_window_size": (5, 0)}
    elif name == "window-two-sided":
        kw = {"local_window_size": (3, 9)}
    elif name == "lengths":
        kw = {"is_causal": True, "query_seq_lengths": np.array([T, T // 3], np.int32),
              "key_value_seq_lengths": np.array([S // 2, 0], np.int32)}
    elif name == "segments":
        kw = {"is_causal": True, "query_segment_ids": seg_q, "key_segment_ids": seg_k}
    elif name == "positions":  # decoding: 3 queries at positions 12..14 against 20 cached slots
        kw = {"is_causal": True, "query_positions": np.tile(np.arange(12, 12 + T), (B, 1)),
              "key_positions": np.tile(np.arange(S), (B, 1)), "local_window_size": (8, 0)}
    elif name == "mask-bias-softcap":
        m = rng.random((B, 1, T, S)) < 0.6
        kw = {"is_causal": True, "logit_softcap": 2.0, "mask": m}
        bias = a(1, N, T, S)
    elif name != "none":
        raise ValueError(name)
    return q, k, v, bias, kw


FEATURES = ["none", "causal", "window-causal", "window-two-sided", "lengths", "segments", "positions",
            "mask-bias-softcap"]
SHAPES = {"T=S": (37, 37), "T<S": (20, 45), "T>S": (45, 20)}


def _results(impl, q, k, v, bias, kw, dtype):
    """Output and gradients (q, k, v and bias if any) from one jitted program. A dense mask is
    an argument of the program, as the arrays are, not a constant folded into it: XLA evaluates
    a (2, 1, 512, 512) constant's broadcasts and block reductions element by element while it
    compiles (13 of test_undifferentiated_calls_take_the_forward_tiles' 15 s); the values and
    the program's operations on them are the same either way."""
    cast = lambda x: None if x is None else jnp.asarray(x, dtype)
    kw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in kw.items()}
    mask = kw.pop("mask", None)
    f = lambda q, k, v, b, m: fa.dot_product_attention(q, k, v, b, m, implementation=impl, **kw)
    args = (cast(q), cast(k), cast(v), cast(bias), mask)
    cot = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape[:3] + v.shape[-1:]), dtype)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)
    grad = jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=argnums)
    return jax.jit(lambda *a: (f(*a), grad(*a)))(*args)


# The plain path's results, shared by the tests that hold a blockwise configuration to the same
# case (the key: feature, T, S, heads, dtype): the same program on the same inputs.
_REFERENCES = {}


def _check_blockwise(feature, shape, heads, dtype, impl=SMALL):
    T, S = SHAPES[shape] if feature != "positions" else (3, 20)
    q, k, v, bias, kw = _case(feature, T=T, S=S, N=heads[0], K=heads[1])
    key = (feature, T, S, heads, np.dtype(dtype))
    if key not in _REFERENCES:
        _REFERENCES[key] = _results("xla", q, k, v, bias, kw, dtype)
    ref_out, ref_grads = _REFERENCES[key]
    out, grads = _results(impl, q, k, v, bias, kw, dtype)
    assert out.dtype == dtype
    assert_close(out, ref_out, dtype, "output")
    for name, g, rg in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        assert_close(g, rg, dtype, name)


HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# Every feature with every shape, and every pair of (feature, heads) and (shape, heads), in 24
# cases instead of the 72 of the full product (the heads turn with the shape and the feature).
# Other block shapes and dtypes: the conformance suite crosses the blockwise path with the
# features again, against its float64 reference, with blocks of 7 x 6 everywhere and 8 x 4
# (query blocks a multiple of the key blocks) in its feature cases, in float32 and bfloat16 too.
PAIRWISE = [pytest.param(feature, shape, HEADS[h], id=f"{feature}-{shape}-{h}")
            for i, feature in enumerate(FEATURES) for j, shape in enumerate(sorted(SHAPES))
            for h in [list(HEADS)[(i + j) % len(HEADS)]]]


@pytest.mark.parametrize("feature, shape, heads", PAIRWISE)
def test_blockwise_equals_reference(feature, shape, heads):
    _check_blockwise(feature, shape, heads, np.float64)


def test_blockwise_value_dim_and_unbatched():
    q, k, v, _, kw = _case("causal", H=8, Hv=5)
    # each call one compiled program (not op by op): the same shapes reach the implementations
    run = lambda impl: jax.jit(lambda *a: fa.dot_product_attention(*a, is_causal=True, implementation=impl))  # noqa: E731
    for args in ((q, k, v), (q[0], k[0], v[0])):
        ref = run("xla")(*map(jnp.asarray, args))
        out = run(SMALL)(*map(jnp.asarray, args))
        assert out.shape == ref.shape
        assert_close(out, ref, np.float64, "Hv != H")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_blockwise_fully_masked_rows_are_zero_with_zero_gradients(dtype):
    q, k, v, _, _ = _case("none", T=20, S=20)
    mask = np.ones((1, 1, 20, 20), bool)
    mask[..., 3, :] = False  # query 3 may attend to nothing
    mask[..., 11:, :] = False
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    f = lambda q, k, v: fa.dot_product_attention(q, k, v, mask=jnp.asarray(mask), implementation=SMALL)
    out = f(*args)
    np.testing.assert_array_equal(np.asarray(out[:, 3], np.float32), 0.0)
    np.testing.assert_array_equal(np.asarray(out[:, 11:], np.float32), 0.0)
    dq, dk, dv = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))(*args)
    for g in (dq, dk, dv):
        assert np.isfinite(np.asarray(g, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(dq[:, 3], np.float32), 0.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [{"num_kv_heads": 2, "sliding_window": 3}, {"position": "alibi"},
                                 {"position": "t5", "causal": False, "t5_num_buckets": 8, "t5_max_distance": 6},
                                 {"qk_norm": True, "logit_softcap": 2.0, "rope_layout": "interleaved"}])
def test_blockwise_layer_matches_torch(cfg, dtype):
    config = fa.AttentionConfig(d_model=16, num_heads=4, **cfg)
    torch.manual_seed(0)
    x = np.random.default_rng(0).standard_normal((2, 19, 16))
    positions = np.tile(np.arange(19), (2, 1))
    run_parity(tr.twin(fa.Attention(config)), fa.Attention(config, implementation=SMALL),
               (x, positions), dtype, flax_kwargs={"deterministic": True})


@pytest.mark.parametrize("dtype", DTYPES)
def test_blockwise_chapter_layer_matches_torch(dtype):
    torch.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((2, 21, 6))
    run_parity(tr.MultiHeadAttention(6, 12, 32, 0.0, 3), fa.MultiHeadAttention(6, 12, 32, 0.0, 3, implementation=SMALL),
               (x,), dtype, flax_kwargs={"deterministic": True})


def test_memory_grows_linearly_for_blockwise_quadratically_for_xla():
    # XLA's own accounting of the compiled forward+backward's temporary buffers (no timing).
    def temp_bytes(impl, T):
        q = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)
        f = lambda q, k, v: jnp.sum(fa.dot_product_attention(q, k, v, is_causal=True, implementation=impl) ** 2)
        compiled = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(q, q, q).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    bw = temp_bytes("blockwise", 4096) / temp_bytes("blockwise", 2048)
    xla = temp_bytes("xla", 4096) / temp_bytes("xla", 2048)
    assert bw < 2.5, f"blockwise temporary memory grew {bw:.2f}x when the length doubled"
    assert xla > 3.5, f"the plain path grew only {xla:.2f}x"




# Units (batch row, key/value head) computed together and in independent loops: the block kind
# is then the one of the whole chunk, so rules that differ between batch rows (lengths,
# segments, a per-row mask) make a block partial for some units and empty or full for others.
CHUNKED = Blockwise(block_q=8, block_k=8, unit_chunk=2, streams=2)
ALL_UNITS = Blockwise(block_q=8, block_k=8, unit_chunk=4)  # B*K = 4: every unit in one step, as on a GPU


@pytest.mark.parametrize("impl", [CHUNKED, ALL_UNITS], ids=["chunks-of-2-streams-2", "all-units"])
@pytest.mark.parametrize("feature", ["causal", "lengths", "segments", "mask-bias-softcap"])
def test_blockwise_units_in_chunks_and_streams_equal_reference(feature, impl):
    _check_blockwise(feature, "T<S", (4, 2), np.float64, impl)


def test_default_unit_chunk_is_one_on_cpu_and_the_batch_and_heads_on_accelerators(monkeypatch):
    """One (batch row, key/value head) unit a step on CPU; on a GPU or TPU as many as keep a
    step's logits within ACCELERATOR_STEP_BYTES (128 MiB: 128 units of 512 x 512 float32)."""
    from flax_attn.core import tuning
    from flax_attn.core.blockwise import _Spec
    from flax_attn.core.call import describe

    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 1 << 20)  # tiles of 512 x 512 below
    shapes = lambda B, N, K: (jax.ShapeDtypeStruct((B, 4096, N, 64), jnp.float32),
                              jax.ShapeDtypeStruct((B, 4096, K, 64), jnp.float32),
                              jax.ShapeDtypeStruct((B, 4096, K, 64), jnp.float32))
    chunk = lambda platform, B, N, K, impl=Blockwise(): _Spec.of(
        describe(*shapes(B, N, K), is_causal=True, platform=platform), impl).chunk
    assert chunk("cpu", 8, 12, 12) == 1
    assert chunk("gpu", 8, 12, 12) == chunk("tpu", 8, 12, 12) == 96    # every unit: 96 MiB of logits
    assert chunk("gpu", 3, 5, 5) == 15
    assert chunk("gpu", 64, 32, 32) == 128                              # 2,048 units: 128 a step
    assert chunk("gpu", 64, 32, 32, Blockwise(unit_chunk=2)) == 2       # a given chunk is kept
    spec = _Spec.of(describe(*shapes(64, 32, 32), is_causal=True, platform="gpu"), Blockwise())
    assert (spec.bq, spec.bk) == (512, 512)
    # a call that is not differentiated: tiles of 1,024 (4 MiB of logits a unit), 32 of 96 units a step
    call = describe(*shapes(8, 12, 12), is_causal=True, platform="gpu")
    forward = _Spec.of(call, Blockwise()).undifferentiated(call, Blockwise())
    assert (forward.bq, forward.bk, forward.chunk) == (1024, 1024, 32)


def test_blockwise_chunk_not_dividing_units_and_forward_mode():
    # B*K = 3 units: a chunk of 2 does not divide them (one unit at a time is used instead), and
    # 3 streams of one unit each; the rows have different key lengths.
    q, k, v, _, _ = _case("none", B=3, T=20, S=20, N=2, K=1)
    lengths = jnp.asarray([20, 9, 3], jnp.int32)
    impl = Blockwise(block_q=8, block_k=8, unit_chunk=2, streams=3)
    f = lambda impl: lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=lengths,
                                                              implementation=impl)
    args = tuple(map(jnp.asarray, (q, k, v)))
    tangents = tuple(jnp.asarray(np.random.default_rng(3).standard_normal(x.shape)) for x in args)
    jvp = lambda impl: jax.jit(lambda a, t: jax.jvp(f(impl), a, t))(args, tangents)  # noqa: E731 (one program each)
    ref = jvp("xla")
    out = jvp(impl)
    assert_close(out[0], ref[0], np.float64, "output")
    assert_close(out[1], ref[1], np.float64, "jvp")


@pytest.mark.parametrize("feature", FEATURES)
def test_keys_major_key_tangent_equals_reference(monkeypatch, feature):
    """On CPU, tiles from KEYS_MAJOR_MIN_TILE on write the keys' tangent term keys-major (reverse
    mode's key gradient as (q^T ds)^T): made to apply to tiles of 8 here, float64 outputs,
    gradients and forward-mode tangents against the reference; the reverse program loses the
    form's barriers where the tiles are below the threshold."""
    from flax_attn.core import blockwise

    monkeypatch.setattr(blockwise, "KEYS_MAJOR_MIN_TILE", 8)
    _check_blockwise(feature, "T<S", (4, 2), np.float64, SMALL)
    q, k, v, bias, kw = _case(feature, T=20, S=45)
    kw = {key: (jnp.asarray(val) if isinstance(val, np.ndarray) else val) for key, val in kw.items()}
    mask = kw.pop("mask", None)
    f = lambda impl: lambda q, k, v: fa.dot_product_attention(q, k, v, bias, mask, implementation=impl, **kw)
    args = tuple(map(jnp.asarray, (q, k, v)))
    tangents = tuple(jnp.asarray(np.random.default_rng(3).standard_normal(x.shape)) for x in args)
    ref, out = jax.jvp(f("xla"), args, tangents), jax.jvp(f(SMALL), args, tangents)
    assert_close(out[0], ref[0], np.float64, "output")
    assert_close(out[1], ref[1], np.float64, "jvp")
    reverse = lambda impl: jax.jit(jax.grad(lambda *a: jnp.sum(f(impl)(*a)), argnums=(0, 1, 2))).lower(*args).as_text()
    barriers = reverse(SMALL).count("optimization_barrier")  # jax.checkpoint's own are there either way
    monkeypatch.setattr(blockwise, "KEYS_MAJOR_MIN_TILE", 9)
    assert reverse(SMALL).count("optimization_barrier") < barriers


@pytest.mark.parametrize("field", ["block_q", "block_k", "unit_chunk", "streams"])
def test_blockwise_rejects_bad_knobs(field):
    with pytest.raises(ValueError, match=f"Blockwise {field} must be a positive integer, got 0"):
        Blockwise(**{field: 0})


def test_block_sizes_fit_the_cache():
    from flax_attn.core import tuning

    assert tuning._parse_size("1024K") == 1 << 20 and tuning._parse_size("2M") == 2 << 20
    assert tuning._parse_size("48K\n") == 48 << 10 and tuning._parse_size("?") is None
    # 64-dim float32 heads: 256 x 256 needs 4 (2*256*256 + 256*64) + 4 (3*256*64) = 768 KiB
    assert tuning.working_set_bytes(256, 256, 64, 64, 4) == 768 * 1024
    assert tuning.block_sizes(64, 64, 4, cache_bytes=1 << 20) == (256, 256)
    assert tuning.block_sizes(64, 64, 4, cache_bytes=768 * 1024 - 1) == (128, 128)
    assert tuning.block_sizes(64, 64, 4, cache_bytes=4 << 20) == (512, 512)
    assert tuning.block_sizes(64, 64, 4, cache_bytes=1024) == (64, 64)   # nothing fits: the smallest
    assert tuning.block_sizes(128, 128, 2, cache_bytes=1 << 20) == (256, 256)
    assert tuning.l2_cache_bytes() > 0
    # by default half the L2 is spent on the tile: 128 x 128 (256 KiB) for 64-dim float32 heads on 1 MiB
    tuning.l2_cache_bytes.cache_clear()
    real = tuning.l2_cache_bytes
    try:
        tuning.l2_cache_bytes = lambda: 1 << 20
        assert tuning.block_sizes(64, 64, 4) == (128, 128)
        tuning.l2_cache_bytes = lambda: 2 << 20
        assert tuning.block_sizes(64, 64, 4) == (256, 256)
    finally:
        tuning.l2_cache_bytes = real


@pytest.mark.parametrize("T, S, G, itemsize, tiles", [
    (8192, 8192, 1, 4, (512, 512)),    # 4 * 512 * 512 = 1 MiB of logits: within two 1 MiB L2s
    (8192, 8192, 6, 4, (256, 256)),    # 6 query heads a unit: 1.5 MiB at 256, 6 MiB at 512
    (8192, 8192, 1, 8, (512, 512)),    # float64: 2 MiB
    (8192, 8192, 2, 8, (256, 256)),
    (300, 5000, 1, 4, (300, 512)),     # up to the tile: one block, no padding
    (600, 1000, 1, 4, (128, 512)),     # 512 or 256 would pad 600 by more than an eighth; 1000 -> 1024
    (100, 100, 64, 4, (64, 64)),       # nothing fits: the smallest tile, padded as it must be
])
def test_blockwise_tiles(monkeypatch, T, S, G, itemsize, tiles):
    from flax_attn.core import tuning

    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 1 << 20)
    assert tuning.blockwise_tiles(T, S, G, itemsize) == tiles
    assert tuning.blockwise_tiles(T, S, G, itemsize, cache_bytes=2 << 20) == tiles


def test_blockwise_takes_its_tiles_unless_given(monkeypatch):
    from flax_attn.core import tuning
    from flax_attn.core.blockwise import _Spec
    from flax_attn.core.call import describe

    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 1 << 20)
    q = jax.ShapeDtypeStruct((1, 2048, 12, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 2048, 2, 64), jnp.float32)
    call = describe(q, q, q, is_causal=True, platform="cpu")
    assert (_Spec.of(call, Blockwise()).bq, _Spec.of(call, Blockwise()).bk) == (512, 512)
    grouped = describe(q, k, k, is_causal=True, platform="cpu")
    assert (_Spec.of(grouped, Blockwise()).bq, _Spec.of(grouped, Blockwise()).bk) == (256, 256)
    given = _Spec.of(call, Blockwise(block_q=64, block_k=4096))
    assert (given.bq, given.bk) == (64, 2048)   # given tiles win, within the lengths


@pytest.mark.parametrize("feature", ["causal", "window-two-sided", "segments", "mask-bias-softcap"])
def test_undifferentiated_calls_take_the_forward_tiles(monkeypatch, feature):
    """A call that is not differentiated runs on the larger forward tiles
    (tuning.blockwise_forward_tiles) where they pad the lengths alike; derivatives keep the
    training tiles. Both held to the reference, float64."""
    from flax_attn.core import tuning
    from flax_attn.core.blockwise import _Spec
    from flax_attn.core.call import describe

    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 32 << 10)  # float64, 2 query heads a unit: 64 / 128 tiles
    spec_of = lambda T, impl=Blockwise(): _Spec.of(describe(*_shapes(T), is_causal=True, platform="cpu"), impl)
    undiff = lambda T, impl=Blockwise(): spec_of(T, impl).undifferentiated(
        describe(*_shapes(T), is_causal=True, platform="cpu"), impl)
    assert (spec_of(512).bq, spec_of(512).bk) == (64, 64)
    assert (undiff(512).bq, undiff(512).bk) == (128, 128)
    assert undiff(256) == spec_of(256)  # fewer than four forward tiles: a causal mask would skip less
    assert tuning.blockwise_forward_tiles(256, 256, 2, 8) == tuning.blockwise_tiles(256, 256, 2, 8) == (64, 64)
    assert tuning.blockwise_forward_tiles(512, 512, 2, 8) == (128, 128)
    assert (undiff(576).bq, spec_of(576).bq) == (64, 64)  # tiles of 128 would pad 576 to 640, of 64 not at all
    given = Blockwise(block_q=64)
    assert undiff(512, given) == spec_of(512, given)  # a given tile is kept
    q, k, v, bias, kw = _case(feature, T=512, S=512, N=4, K=2)
    ref_out, ref_grads = _results("xla", q, k, v, bias, kw, np.float64)
    out, grads = _results(Blockwise(), q, k, v, bias, kw, np.float64)
    assert_close(out, ref_out, np.float64, "output")
    for name, g, rg in zip(["dq", "dk", "dv", "dbias"], grads, ref_grads):
        assert_close(g, rg, np.float64, name)


def _shapes(T, N=4, K=2, H=8):
    return (jax.ShapeDtypeStruct((2, T, N, H), jnp.float64), jax.ShapeDtypeStruct((2, T, K, H), jnp.float64),
            jax.ShapeDtypeStruct((2, T, K, H), jnp.float64))


def test_power_of_two_scale_is_applied_to_the_queries_only_where_exact():
    from flax_attn.core.numerics import scale_is_exact as exact

    assert exact(0.125, jnp.float32) and exact(0.125, jnp.bfloat16) and exact(2.0, jnp.float64)
    assert not exact(0.125, jnp.float16)   # small float16 queries would lose bits
    assert not exact(128 ** -0.5, jnp.float32) and not exact(-0.125, jnp.float32)
    assert not exact(0.0, jnp.float32)


def test_power_of_two_scale_gives_the_same_logits_bit_for_bit(monkeypatch):
    # scale 1/8 folded into the queries against scale 1/8 applied to q.k: outputs, lse and
    # gradients equal bit for bit
    from flax_attn.core import numerics

    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 40, 2, 8)) * 4, jnp.float32) for _ in range(3))

    def run(q, k, v):
        out, lse = fa.dot_product_attention(q, k, v, scale=0.125, is_causal=True, return_residual=True,
                                            implementation=Blockwise(block_q=16, block_k=16))
        return out, lse

    def loss(q, k, v):
        out, lse = run(q, k, v)
        return jnp.sum(out * v[:, :, :, ::-1]), (out, lse)

    both = lambda: jax.tree_util.tree_leaves(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v))
    folded = both()
    monkeypatch.setattr(numerics, "scale_is_exact", lambda scale, dtype: False)
    unfolded = both()
    assert len(folded) == 6
    for a, b in zip(folded, unfolded):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
