"""Numerics at the edges, for every implementation: queries that may attend to nothing, huge
logits in bfloat16 and float16, the precision of the low-precision paths against float64."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from torch_ref.compare import max_rel_error
from flax_attn.core import Blockwise

# Tiny blocks, so that every block-skipping branch runs. cuDNN: parity_tests/core/test_registry.py, on a GPU
IMPLEMENTATIONS = ["xla", Blockwise(block_q=8, block_k=8)]
LOW = {"bfloat16": (jnp.bfloat16, 2.0 ** -8), "float16": (jnp.float16, 2.0 ** -11)}  # unit roundoff u




def _qkv(dtype, B=2, T=12, S=12, N=2, K=2, H=8, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H))]


# Each case blocks every key for some queries, in its own way; `blocked` lists them as (batch, query).
BLOCKING = {
    "mask": ({"mask": jnp.ones((2, 1, 12, 12), bool).at[0, :, 4].set(False)}, [(0, 4)]),
    "causal, more queries than keys": ({"is_causal": True}, "first"),   # T = 12 > S = 9 below
    "window": ({"is_causal": True, "local_window_size": (2, 0),
                "query_positions": jnp.arange(12).at[5].set(40), "key_positions": jnp.arange(12)}, [(0, 5), (1, 5)]),
    "padding": ({"key_value_seq_lengths": jnp.array([12, 0], jnp.int32)}, [(1, t) for t in range(12)]),
    "segments": ({"query_segment_ids": jnp.array([[0] * 6 + [1] * 6, [0] * 11 + [-1]]),
                  "key_segment_ids": jnp.array([[0] * 12, [0] * 12])}, [(0, t) for t in range(6, 12)] + [(1, 11)]),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["xla", "blockwise"])
@pytest.mark.parametrize("case", sorted(BLOCKING))
def test_queries_that_see_nothing_return_zeros_with_zero_gradients(case, impl, dtype):
    kwargs, blocked = BLOCKING[case]
    S = 9 if blocked == "first" else 12
    if blocked == "first":
        blocked = [(b, t) for b in range(2) for t in range(3)]  # queries 0-2 sit before every key
    q, k, v = _qkv(jnp.dtype(dtype), S=S)
    f = lambda q, k, v: fa.dot_product_attention(q, k, v, implementation=impl, **kwargs)
    out = f(q, k, v)
    assert out.dtype == q.dtype
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32) * jnp.arange(8.0))
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for x in (out, dq, dk, dv):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    for b, t in blocked:
        np.testing.assert_array_equal(np.asarray(out[b, t], np.float32), 0.0)
        np.testing.assert_array_equal(np.asarray(dq[b, t], np.float32), 0.0)
    others = np.ones(out.shape[:2], bool)
    others[tuple(zip(*blocked))] = False
    assert np.abs(np.asarray(out, np.float32)[others]).max() > 0  # the rest is not zeroed


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["xla", "blockwise"])
@pytest.mark.parametrize("dtype", sorted(LOW))
def test_logits_of_magnitude_1e4_stay_finite(dtype, impl):
    dt, u = LOW[dtype]
    rng = np.random.default_rng(1)
    # H = 64 entries of +-12.5 and keys equal to the queries: q_t.k_t = 64 * 12.5^2 = 1e4 (scale 1),
    # the other logits anywhere in [-1e4, 1e4].
    q = jnp.asarray(12.5 * np.sign(rng.standard_normal((1, 16, 2, 64))), dt)
    k = q
    v = jnp.asarray(rng.standard_normal((1, 16, 2, 64)), dt)
    f = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True, scale=1.0, implementation=impl)
    logits = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k.astype(jnp.float32))
    assert float(jnp.abs(logits).max()) == 1e4
    out = f(q, k, v)
    grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert out.dtype == dt
    for x in (out, *grads):
        assert np.isfinite(np.asarray(x, np.float32)).all()
    # Softmax accumulates in float32: the result matches float64 on the same inputs.
    ref = fa.dot_product_attention(*(x.astype(jnp.float64) for x in (q, k, v)), is_causal=True, scale=1.0,
                                   implementation="xla")
    assert max_rel_error(out, ref) <= 2 * u


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, ids=["xla", "blockwise"])
@pytest.mark.parametrize("dtype", sorted(LOW))
def test_low_precision_paths_against_float64(dtype, impl):
    """The documented precision: against float64 computed from the same rounded inputs, outputs
    within 2 units of roundoff u (the weights and the result are each rounded once), gradients
    within 3 u (one more rounding, of the softmax's gradient). Measured on a 2-core CPU: outputs
    0.65-1.13 u, gradients 0.97-1.41 u (README, "Numeric guarantees")."""
    dt, u = LOW[dtype]
    for seed in range(3):
        q, k, v = _qkv(dt, T=40, S=40, N=4, K=2, H=32, seed=seed)
        cot = jnp.asarray(np.random.default_rng(seed + 10).standard_normal(q.shape), jnp.float32)
        f = lambda q, k, v, impl=impl: fa.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        g = lambda *a, f=f: jax.grad(lambda *b: jnp.sum(f(*b).astype(cot.dtype) * cot.astype(b[0].dtype)),
                                     argnums=(0, 1, 2))(*a)
        wide = [x.astype(jnp.float64) for x in (q, k, v)]
        ref = fa.dot_product_attention(*wide, is_causal=True, implementation="xla")
        ref_grads = jax.grad(lambda *b: jnp.sum(fa.dot_product_attention(*b, is_causal=True, implementation="xla")
                                                * cot.astype(jnp.float64)), argnums=(0, 1, 2))(*wide)
        assert max_rel_error(f(q, k, v), ref) <= 2 * u
        for got, want in zip(g(q, k, v), ref_grads):
            assert got.dtype == dt
            assert max_rel_error(got, want) <= 3 * u


def test_apply_sinks_by_hand():
    from flax_attn.core.numerics import apply_sinks
    out = jnp.array([[[[2.0, -4.0]], [[0.0, 0.0]]]])                     # (B, T, N, Hv) = (1, 2, 1, 2)
    lse = jnp.array([[[np.log(3.0)], [-np.inf]]])                         # row 1 attends to nothing
    weights = jnp.array([[[[1 / 3, 2 / 3], [0.0, 0.0]]]])                 # (B, N, T, S)
    new_out, new_lse, new_w = apply_sinks(jnp.array([0.0]), out, lse, weights)
    # e^lse = 3 beside e^sink = 1: every weight shrinks by 3/4
    np.testing.assert_allclose(new_out, [[[[1.5, -3.0]], [[0.0, 0.0]]]], rtol=1e-15)
    np.testing.assert_allclose(new_w, [[[[0.25, 0.5], [0.0, 0.0]]]], rtol=1e-15)
    np.testing.assert_allclose(new_lse, [[[np.log(4.0)], [0.0]]], rtol=1e-15)
    g = jax.grad(lambda s: jnp.sum(apply_sinks(s, out, lse)[0]))(jnp.array([0.0]))
    # d/ds of 3/(3 + e^s) * (2 - 4) at s = 0: -(-2) * 3/16; the empty row adds nothing (no NaN)
    np.testing.assert_allclose(g, [2 * 3 / 16], rtol=1e-15)


def _softmax_values_case(platform=None, rows=5, keys=7):
    from flax_attn.core.numerics import softmax_values
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((2, rows, keys)) * 3)
    logits = logits.at[0, 1, 2].set(-jnp.inf)                          # a -inf logit takes no part
    allowed = jnp.asarray(rng.random((2, rows, keys)) < 0.7).at[1, 3].set(False)  # row (1, 3) sees nothing
    values = jnp.asarray(rng.standard_normal((2, keys, 4)))
    plain = lambda s, v: (jnp.einsum("crk,ckh->crh", fa.core.numerics.softmax_parts(s, allowed)[0], v),
                          fa.core.numerics.softmax_parts(s, allowed)[1])
    custom = lambda s, v: softmax_values(s, allowed, v, None, platform)
    return rng, (logits, values), plain, custom


@pytest.mark.parametrize("platform, size", [(None, 7), ("cpu", 7), ("gpu", 256), ("cpu", 256)])
def test_softmax_values_derivatives_equal_the_softmaxs(platform, size):
    """softmax_values' hand-written derivative against JAX's derivative of the softmax itself
    (float64): outputs, jvp, vjp and a second order, with a -inf logit and a row that sees
    nothing (zeros, zero gradients); on CPU with KEYS_MAJOR_TANGENT_MIN rows and keys the
    values' tangent takes its keys-major form (barriers in the reverse-mode program), else not."""
    from flax_attn.core.numerics import KEYS_MAJOR_TANGENT_MIN
    rows = 5 if size < KEYS_MAJOR_TANGENT_MIN else size
    rng, args, plain, custom = _softmax_values_case(platform, rows, size)
    ones = (jnp.ones((2, rows, 4)), jnp.ones((2, rows)))
    vjp_program = str(jax.make_jaxpr(lambda *a: jax.vjp(custom, *a)[1](ones))(*args))
    assert ("optimization_barrier" in vjp_program) == (platform == "cpu" and size >= KEYS_MAJOR_TANGENT_MIN)
    tangents = tuple(jnp.asarray(rng.standard_normal(a.shape)).at[0, 1, 2].set(0.0) if i == 0 else
                     jnp.asarray(rng.standard_normal(a.shape)) for i, a in enumerate(args))
    out_ct = (jnp.asarray(rng.standard_normal((2, rows, 4))), jnp.asarray(rng.standard_normal((2, rows))).at[1, 3].set(0.0))
    for name, got, want in (
            ("outputs", custom(*args), plain(*args)),
            ("jvp", jax.jvp(custom, args, tangents)[1], jax.jvp(plain, args, tangents)[1]),
            ("vjp", jax.vjp(custom, *args)[1](out_ct), jax.vjp(plain, *args)[1](out_ct)),
            ("second order", jax.jvp(lambda *a: jax.vjp(custom, *a)[1](out_ct), args, tangents)[1],
             jax.jvp(lambda *a: jax.vjp(plain, *a)[1](out_ct), args, tangents)[1])):
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert np.isfinite(np.where(np.isneginf(w), 0, g)).all(), name
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12, err_msg=name)
    d_logits, d_values = jax.vjp(custom, *args)[1](out_ct)
    np.testing.assert_array_equal(d_logits[1, 3], 0.0)
    np.testing.assert_array_equal(d_logits[0, 1, 2], 0.0)


def test_a_nan_or_inf_logit_is_not_hidden():
    """A NaN or +inf logit makes its row's weights, output and log-sum-exp NaN (it is not taken
    for a row that sees nothing, whose zeros and -inf are for rows with no allowed logit)."""
    from flax_attn.core.numerics import softmax_parts, softmax_values
    logits = jnp.zeros((3, 4)).at[0, 1].set(jnp.nan).at[1, 2].set(jnp.inf)
    values = jnp.ones((4, 2))
    weights, lse = softmax_parts(logits)
    out, lse2 = softmax_values(logits, None, values)
    for got in (weights, lse, out, lse2):
        assert np.isnan(np.asarray(got)[:2]).all(), got
        assert np.isfinite(np.asarray(got)[2]).all(), got


@pytest.mark.parametrize("two_rows", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_weighted_values_is_the_matmul(rows, platform, two_rows, monkeypatch):
    """weighted_values (one row computed beside a row of zeros on the CPUs where
    tuning.values_matvec_as_two_rows holds) is the batched matmul, outputs and gradients,
    whatever the platform and CPU it is told."""
    from flax_attn.core import tuning
    from flax_attn.core.numerics import weighted_values
    monkeypatch.setattr(tuning, "values_matvec_as_two_rows", lambda: two_rows)
    padded = "concatenate" in str(jax.make_jaxpr(lambda w, v: weighted_values(w, v, None, jnp.float64, platform))(
        jnp.ones((4, rows, fa.core.numerics.ONE_ROW_PAD_KEYS)), jnp.ones((4, fa.core.numerics.ONE_ROW_PAD_KEYS, 3))))
    assert padded == (platform == "cpu" and rows == 1 and two_rows)
    rng = np.random.default_rng(5)
    S = fa.core.numerics.ONE_ROW_PAD_KEYS  # the shortest key axis that takes the two-row form on CPU
    w, v = jnp.asarray(rng.random((4, rows, S))), jnp.asarray(rng.standard_normal((4, S, 3)))
    got = lambda w, v: weighted_values(w, v, None, jnp.float64, platform)
    want = lambda w, v: jnp.einsum("urs,ush->urh", w, v)
    assert got(w, v).shape == (4, rows, 3)
    assert max_rel_error(got(w, v), want(w, v)) < 1e-12  # the suite's float64 tolerance
    ct = jnp.asarray(rng.standard_normal((4, rows, 3)))
    for g, e in zip(jax.vjp(got, w, v)[1](ct), jax.vjp(want, w, v)[1](ct)):
        assert max_rel_error(g, e) < 1e-12


def test_values_matvec_as_two_rows_on_amd_with_avx512_only():
    """The two-row form of a long one-row values' matmul follows the CPU's vendor and vector
    width, read from /proc/cpuinfo's text: AMD with AVX-512 (families 25 and 26), not AMD with
    AVX2 alone, not Intel (measured slower there), not an unreadable cpuinfo."""
    from flax_attn.core import tuning
    amd = "vendor_id\t: AuthenticAMD\ncpu family\t: {}\nflags\t\t: fpu sse2 avx2 {}\n"
    assert tuning._values_matvec_as_two_rows(amd.format(26, "avx512f"))
    assert tuning._values_matvec_as_two_rows(amd.format(25, "avx512f avx512bw"))
    assert not tuning._values_matvec_as_two_rows(amd.format(25, ""))
    assert not tuning._values_matvec_as_two_rows(amd.replace("AuthenticAMD", "GenuineIntel").format(6, "avx512f"))
    assert not tuning._values_matvec_as_two_rows("")


HEADS_IN_PLACE = {  # (T, N, K): whether a CPU with AVX-512 reads (B, S, K, H) keys in place
    "mha-1-token": ((1, 6, 3), True),
    "gqa-2-tokens": ((2, 8, 2), True),          # K * G * T = 2 * 4 * 2 = 16
    "gqa-3-tokens": ((3, 8, 2), False),         # 24 columns: K times the multiplications is too many
    "mqa": ((1, 4, 1), False),                  # one key/value head: already in units order
}


@pytest.mark.parametrize("case", list(HEADS_IN_PLACE), ids=list(HEADS_IN_PLACE))
@pytest.mark.parametrize("stored", [None, "BKSH"])
@pytest.mark.parametrize("avx512", [True, False])
def test_plain_path_reads_heads_in_place_on_avx512(case, stored, avx512, monkeypatch):
    """The plain path reads (B, S, K, H) keys and values where they lie, as (B, S, K*H) rows
    against block-diagonal queries, on a CPU with AVX-512 while K * G * T <= 16 and the keys
    are not declared to lie as a 'BKSH' cache's (then it regroups them, reading that order in
    place). Either way: outputs, log-sum-exp, weights and gradients of the regrouped form
    (float64), under a padding mask, a bias and a softcap."""
    from flax_attn.core import tuning
    (T, N, K), diagonal = HEADS_IN_PLACE[case]
    monkeypatch.setattr(tuning, "has_avx512", lambda: avx512)
    rng = np.random.default_rng(8)
    B, S, H = 2, 24, 4
    q = jnp.asarray(rng.standard_normal((B, T, N, H)))
    k, v = (jnp.asarray(rng.standard_normal((B, S, K, H))) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((B, N, T, S)))
    kw = dict(key_value_seq_lengths=np.array([24, 9], np.int32), logit_softcap=3.0, implementation="xla")

    def run(q, k, v, bias):
        with tuning.keys_stored(stored):
            out, lse, w = fa.dot_product_attention(q, k, v, bias, return_residual=True, return_weights=True, **kw)
        return out, jnp.where(jnp.isfinite(lse), lse, 0.0), w

    def regrouped(q, k, v, bias):
        with monkeypatch.context() as m:
            m.setattr(tuning, "has_avx512", lambda: False)
            return run(q, k, v, bias)

    reads = {e.invars[1].aval.shape for e in jax.make_jaxpr(run)(q, k, v, bias).jaxpr.eqns
             if e.primitive.name == "dot_general"}
    if K > 1:  # with one key/value head (B, S, H) is both orders
        assert ((B, S, K * H) in reads) == (diagonal and avx512 and stored is None), reads
    for got, want, what in zip(run(q, k, v, bias), regrouped(q, k, v, bias), ("out", "lse", "weights")):
        assert max_rel_error(got, want) < 1e-12, what
    loss = lambda f: lambda *a: jnp.sum(f(*a)[0] * jnp.cos(jnp.arange(H)))  # noqa: E731
    grads = jax.grad(loss(run), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for g, w, what in zip(grads, jax.grad(loss(regrouped), argnums=(0, 1, 2, 3))(q, k, v, bias), "qkvb"):
        assert max_rel_error(g, w) < 1e-12, f"d{what}"


@pytest.mark.parametrize("rows", [1, 3, 17, 256])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_key_logits_is_the_matmul(rows, platform):
    """key_logits (keys-major then transposed, for 2..FEW_ROWS rows on CPU; its keys' tangent
    keys-major on CPU) is the batched matmul: outputs, reverse and forward mode and a second
    order, whatever the platform it is told."""
    from flax_attn.core.numerics import FEW_ROWS, FEW_ROWS_MIN_KEYS, KEYS_MAJOR_TANGENT_MIN, key_logits
    rng = np.random.default_rng(6)
    S = FEW_ROWS_MIN_KEYS  # the shortest key axis that takes the keys-major form on CPU
    q, k = jnp.asarray(rng.standard_normal((4, rows, 5))), jnp.asarray(rng.standard_normal((4, S, 5)))
    got = lambda q, k: key_logits(q, k, None, jnp.float64, platform)
    want = lambda q, k: jnp.einsum("urh,ush->urs", q, k)
    jaxpr = str(jax.make_jaxpr(got)(q, k))
    assert ("optimization_barrier" in jaxpr) == (platform == "cpu" and 1 < rows <= FEW_ROWS)
    if rows > FEW_ROWS:  # reverse mode on CPU from 256 rows: the keys' gradient as (q^T ds)^T, behind barriers
        vjp_program = str(jax.make_jaxpr(lambda q, k: jax.vjp(got, q, k)[1](jnp.ones((4, rows, S))))(q, k))
        assert ("optimization_barrier" in vjp_program) == (platform == "cpu" and rows >= KEYS_MAJOR_TANGENT_MIN)
    assert got(q, k).shape == (4, rows, S)
    assert max_rel_error(got(q, k), want(q, k)) < 1e-12
    ct = jnp.asarray(rng.standard_normal((4, rows, S)))
    for g, e in zip(jax.vjp(got, q, k)[1](ct), jax.vjp(want, q, k)[1](ct)):
        assert max_rel_error(g, e) < 1e-12
    tangents = (jnp.asarray(rng.standard_normal(q.shape)), jnp.asarray(rng.standard_normal(k.shape)))
    assert max_rel_error(jax.jvp(got, (q, k), tangents)[1], jax.jvp(want, (q, k), tangents)[1]) < 1e-12
    second = lambda f: jax.jvp(lambda q, k: jax.vjp(f, q, k)[1](ct), (q, k), tangents)[1]
    for g, e in zip(second(got), second(want)):
        assert max_rel_error(g, e) < 1e-12


def test_softmax_values_checkpoint_keeps_row_statistics():
    """Under jax.checkpoint with the SOFTMAX_STATS policy, reverse mode recomputes the weights
    from the kept row maxima and sums: one max over the logits in the whole gradient program
    (the forward's), against two when nothing is kept."""
    from flax_attn.core.numerics import SOFTMAX_STATS
    _, args, _, custom = _softmax_values_case()
    loss = lambda s, v: jnp.sum(custom(s, v)[0] ** 2)

    def maxima(policy):
        jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1)))(*args)
        return str(jaxpr).count("reduce_max")

    assert maxima(jax.checkpoint_policies.save_only_these_names(SOFTMAX_STATS)) == 1
    assert maxima(None) == 2
