"""Conformance: every attention implementation that runs here, held to one float64 reference.

Each registered implementation available on this platform (on CPU: ``xla``, ``query_blocks``
and ``blockwise``), plus the blockwise path with tiny blocks (7 x 6 everywhere, 8 x 4 in the
feature cases, so that every block-skipping branch runs on small shapes), the query blocks of 16 and JAX's Pallas kernels in interpret mode (section 7), is
compared with :func:`reference`, a dense and obviously correct attention written below in
float64 from the documented rules: outputs and gradients with respect to query, key, value and
bias, by max relative error ``max|a - b| / max|b|``.
Tolerances: float64 1e-12; float32 1e-5; bfloat16 2**-7 (outputs) and 3 * 2**-8 (gradients);
the reference runs in float64 on the inputs rounded to the dtype under test. Rows that may
attend to nothing must be exactly zero with exactly zero query gradients, and keys no query
may attend to must get exactly zero key/value gradients.

Sections: 1. mask and bias broadcast shapes; 2. masking features (GQA/MQA, causal, windows,
segments, lengths, positions, soft-cap, bias with mask, fully masked rows) and mask
descriptions; 3. dtypes; 4. transformations; 5. the defects being fixed, one test each;
6. a toy implementation, registered, run through a subset, unregistered; 7. the Pallas kernels
(float32/bfloat16 cases they serve; they decline float64, so sections 1-5 skip for them).

Compile time, not run time, is what a case costs (a blockwise forward + backward takes
seconds to compile), so each case packs several features, the cases of one test run as one
program per implementation, and the float64 reference results are computed once and shared.
An implementation other than ``xla`` and ``blockwise`` may decline a call (``ValueError:
implementation='...' does not support ...``): that test is skipped for it.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn.core import Blockwise, PallasDecode, PallasTriton, QueryBlocks, Splash, registry
from flax_attn.core import mask as mask_lib

# The function under test: the public entry point.
attention = fa.dot_product_attention

BF16 = jnp.bfloat16
# dtype -> (output tolerance, gradient tolerance)
TOL = {
    np.dtype(np.float64): (1e-12, 1e-12),
    np.dtype(np.float32): (1e-5, 1e-5),
    np.dtype(BF16): (2 * 2.0 ** -8, 3 * 2.0 ** -8),
}
DTYPE_IDS = {np.dtype(np.float64): "f64", np.dtype(np.float32): "f32", np.dtype(BF16): "bf16"}


# ============================================================================ implementations


# JAX's Pallas kernels through Pallas' interpreter, with the smallest blocks each allows: they
# run on any backend, so every platform holds them to the reference.
INTERPRETED = (
    ("splash-interpret", Splash(interpret=True)),                                          # blocks of 128
    ("pallas_triton-interpret", PallasTriton(interpret=True, block_q=16, block_k=16, block_bwd=16)),
    ("pallas_decode-interpret", PallasDecode(interpret=True, block_k=16, k_splits=2)),
)


# The blockwise path again with tiny blocks, so that on these small shapes every query and key
# block kind runs (empty, full, partial; padded last blocks; T > S): 7 x 6 blocks, dividing no
# length, in every test; 8 x 4 (query blocks a multiple of the key blocks) in test_features only.
TINY_BLOCKS = (7, 6)
TINY_BLOCKS_FEATURES = (8, 4)


def _implementations(tiny_blocks=(TINY_BLOCKS,)):
    """(id, implementation) for every registered implementation that runs on this platform
    (``registry.available()``), the blockwise path again with each of ``tiny_blocks``, and
    each Pallas kernel in interpret mode; the query blocks again with blocks of 16 (2 or 3 blocks,
    the last one short, on the small shapes; 8 at 128 tokens: the loop is unrolled, so its
    compile time grows with the blocks) and two units a step with grouped queries too."""
    found = [(impl.name, impl) for impl in registry.available()]
    for name, impl in list(found):
        if isinstance(impl, Blockwise):
            for bq, bk in tiny_blocks:
                found.append((f"{name}-{bq}-{bk}", dataclasses.replace(impl, block_q=bq, block_k=bk)))
        if isinstance(impl, QueryBlocks) and tiny_blocks == (TINY_BLOCKS,):
            found.append((f"{name}-16", dataclasses.replace(impl, block_q=16, min_units=2)))
    return found + list(INTERPRETED)


IMPLS = _implementations()
FEATURE_IMPLS = IMPLS + [(n, i) for n, i in _implementations((TINY_BLOCKS_FEATURES,)) if n not in dict(IMPLS)]


def _params(impls):
    """pytest parameters; the variants (tiny blocks, interpreted kernels) marked slow."""
    registered = {impl.name for impl in registry.available()}
    return [pytest.param(impl, id=name, marks=() if name in registered else pytest.mark.slow)
            for name, impl in impls]


IMPL_PARAMS = _params(IMPLS)
FEATURE_IMPL_PARAMS = _params(FEATURE_IMPLS)


# Serve every call of this suite (no dropout, no returned weights): a refusal is a failure.
MUST_SERVE = ("xla", "blockwise", "query_blocks")


def declined(impl, error) -> Optional[str]:
    """The reason when ``error`` is ``impl`` declining a call it may decline (its ``supports``
    said why, e.g. cuDNN and float64), else None."""
    name = getattr(impl, "name", impl)
    if impl is None or name in MUST_SERVE or not isinstance(error, ValueError):
        return None
    return str(error) if f"implementation='{name}' does not support " in str(error) else None


def skip_declined(test):
    """Skip the test where its implementation declines the call (see :func:`declined`)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except ValueError as e:
            reason = declined(kwargs.get("impl"), e)
            if reason:
                pytest.skip(reason)
            raise
    return wrapper


def impl_name(impl) -> str:
    if impl is None or isinstance(impl, str):
        return impl or "auto"
    return next((n for n, i in FEATURE_IMPLS if i is impl), impl.name)


# ============================================================================ the reference


def reference_mask(B, N, T, S, *, mask=None, is_causal=False, local_window_size=None, query_seq_lengths=None,
                   key_value_seq_lengths=None, query_positions=None, key_positions=None,
                   query_segment_ids=None, key_segment_ids=None, **_) -> np.ndarray:
    """The full boolean ``(B, N, T, S)`` mask, True = may attend, rule by rule in explicit loops."""
    allowed = np.ones((B, N, T, S), bool)
    if mask is not None:
        allowed &= np.broadcast_to(np.asarray(mask, bool), (B, N, T, S))  # numpy broadcasting from the right
    q_pos = np.arange(T) + S - T if query_positions is None else np.asarray(query_positions)
    k_pos = np.arange(S) if key_positions is None else np.asarray(key_positions)
    q_pos, k_pos = np.broadcast_to(q_pos, (B, T)), np.broadcast_to(k_pos, (B, S))
    if local_window_size is not None:
        left, right = ((local_window_size, local_window_size) if np.ndim(local_window_size) == 0
                       else local_window_size)
    q_seg = None if query_segment_ids is None else np.broadcast_to(query_segment_ids, (B, T))
    k_seg = None if key_segment_ids is None else np.broadcast_to(key_segment_ids, (B, S))
    for b in range(B):
        for t in range(T):
            for s in range(S):
                ok = True
                d = q_pos[b, t] - k_pos[b, s]
                if is_causal and d < 0:
                    ok = False
                if local_window_size is not None and not -right <= d <= left:
                    ok = False
                if query_seq_lengths is not None and t >= query_seq_lengths[b]:
                    ok = False
                if key_value_seq_lengths is not None and s >= key_value_seq_lengths[b]:
                    ok = False
                if q_seg is not None and (q_seg[b, t] != k_seg[b, s] or q_seg[b, t] < 0 or k_seg[b, s] < 0):
                    ok = False
                if not ok:
                    allowed[b, :, t, s] = False
    return allowed


def reference(q, k, v, bias, allowed, *, scale=None, logit_softcap=None, return_residual=False):
    """Dense attention in float64: GQA by repeating keys, softmax over allowed keys (a row with
    none gives zeros and zero gradients), ``lse`` ``(B, T, N)`` with -inf for such rows."""
    B, T, N, H = q.shape
    G = N // k.shape[2]
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scale = 1.0 / np.sqrt(H) if scale is None else scale
    hi = jax.lax.Precision.HIGHEST
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * scale
    if logit_softcap is not None:
        logits = logit_softcap * jnp.tanh(logits / logit_softcap)
    if bias is not None:
        logits = logits + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    some = allowed.any(-1, keepdims=True)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(allowed, logits, -jnp.inf), -1, keepdims=True))
    m = jnp.where(some, m, 0.0)
    e = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits, m) - m), 0.0)
    total = jnp.sum(e, -1, keepdims=True)
    weights = e / jnp.where(some, total, 1.0)
    out = jnp.einsum("bnts,bsnh->btnh", weights, v, precision=hi)
    if not return_residual:
        return out
    lse = jnp.where(some, m + jnp.log(jnp.where(some, total, 1.0)), -jnp.inf)[..., 0]
    return out, jnp.transpose(lse, (0, 2, 1))


# ============================================================================ cases


@dataclasses.dataclass(eq=False)
class Case:
    """One call: shapes ``(B, T, S, N, K, H, Hv)``, keyword arguments (numpy arrays) and the
    bias shape; inputs are drawn from a seed derived from the name."""

    name: str
    shape: tuple = (2, 13, 19, 4, 2, 8, 8)
    kw: dict = dataclasses.field(default_factory=dict)
    bias: Optional[tuple] = None
    dtype: Any = np.float64
    via: str = "keywords"  # or "description": the masking keywords as one flax_attn.core.mask description

    @property
    def dims(self):
        B, T, S, N, K, H, Hv = self.shape
        return dict(B=B, T=T, S=S, N=N, K=K, H=H, Hv=Hv)

    def rng(self):
        return np.random.default_rng(zlib.crc32(self.name.encode()))

    def inputs(self, dtype=None):
        """q, k, v, bias (or None), cotangent: float64 numpy arrays, rounded to ``dtype``."""
        dtype = np.dtype(dtype or self.dtype)
        B, T, S, N, K, H, Hv = self.shape
        rng = self.rng()
        r = lambda *s: rng.standard_normal(s)
        raw = [r(B, T, N, H), r(B, S, K, H), r(B, S, K, Hv),
               None if self.bias is None else r(*self.bias), r(B, T, N, Hv)]
        return [None if x is None else x.astype(dtype).astype(np.float64) for x in raw]

    @functools.cached_property
    def _allowed(self):
        d = self.dims
        return reference_mask(d["B"], d["N"], d["T"], d["S"], **self.kw)

    def allowed(self):
        return self._allowed


def as_description(kw):
    """The masking keywords as one ``flax_attn.core.mask`` description, and the rest."""
    kw = dict(kw)
    parts = []
    if kw.pop("is_causal", False):
        parts.append(mask_lib.causal())
    w = kw.pop("local_window_size", None)
    if w is not None:
        parts.append(mask_lib.window(w) if np.ndim(w) == 0 else mask_lib.window(*w))
    qp, kp = kw.pop("query_positions", None), kw.pop("key_positions", None)
    if qp is not None:
        parts.append(mask_lib.positions(qp, kp))
    qs, ks = kw.pop("query_segment_ids", None), kw.pop("key_segment_ids", None)
    if qs is not None:
        parts.append(mask_lib.segments(qs, ks))
    ql, kl = kw.pop("query_seq_lengths", None), kw.pop("key_value_seq_lengths", None)
    if ql is not None or kl is not None:
        parts.append(mask_lib.lengths(ql, kl))
    if kw.get("mask") is not None:
        parts.append(mask_lib.dense(kw.pop("mask")))
    kw["mask"] = functools.reduce(operator.and_, parts) if parts else None
    return kw


def attention_fn(impl, kw, *, via="keywords", **extra):
    """``f(q, k, v, bias=None)`` calling the implementation under test with the case's keywords."""
    kw = dict(as_description(kw) if via == "description" else kw)
    mask = kw.pop("mask", None)

    def f(q, k, v, bias=None):
        return attention(q, k, v, bias, mask, implementation=impl, **kw, **extra)
    return f


def reference_fn(case, **extra):
    allowed = case.allowed()
    kw = {k: case.kw[k] for k in ("scale", "logit_softcap") if k in case.kw}

    def f(q, k, v, bias=None):
        return reference(q, k, v, bias, allowed, **kw, **extra)
    return f


def value_and_vjp(f, args, cot):
    out, pullback = jax.vjp(f, *args)
    return out, pullback(cot.astype(out.dtype))


# ============================================================================ comparison


def rel_error(actual, expected) -> float:
    """max|a - b| / max|b| (max|a - b| where b is all zero); inf on a shape mismatch or NaN."""
    a, b = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    if not np.isfinite(a).all():
        return float("inf")
    scale = np.max(np.abs(b))
    diff = np.max(np.abs(a - b))
    return float(diff / scale) if scale > 0 else float(diff)


GRAD_NAMES = ("dq", "dk", "dv", "dbias")


def compare(what, out, grads, ref_out, ref_grads, dtype, allowed=None, K=None):
    """Failure messages (empty if all is well): output and each gradient within the dtype's
    tolerance; the structural zeros (empty rows, keys nobody sees) exact.

    A bias that is constant along the keys (its S dim is 1) has an analytically zero gradient
    (softmax ignores shifts), so both sides hold rounding noise there: that gradient's error is
    measured against the largest query/key/value gradient of the same loss instead."""
    dtype = np.dtype(dtype)
    tol_out, tol_grad = TOL[dtype]
    bad = []
    if np.dtype(out.dtype) != dtype:
        bad.append(f"{what}: output dtype {out.dtype}, expected {dtype}")
    err = rel_error(out, ref_out)
    if not err <= tol_out:
        bad.append(f"{what}: output error {err:.3e} > {tol_out:.1e}")
    for name, g, rg in zip(GRAD_NAMES, grads, ref_grads):
        if name == "dbias" and np.shape(rg)[-1] == 1 and np.shape(ref_grads[1])[1] > 1:
            scale = max(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0) for x in ref_grads[:3])
            err = rel_error(g, rg) if np.shape(g) != np.shape(rg) else float(
                np.max(np.abs(np.asarray(g, np.float64) - np.asarray(rg, np.float64))) / scale)
            name = "dbias (analytically zero)"
        else:
            err = rel_error(g, rg)
        if not err <= tol_grad:
            bad.append(f"{what}: {name} error {err:.3e} > {tol_grad:.1e}")
    if allowed is not None:
        bad += structural_zeros(what, out, grads, allowed, K)
    return bad


def structural_zeros(what, out, grads, allowed, K):
    """Rows with nothing to attend: output and dq exactly 0; keys no query may attend: dk, dv 0."""
    bad = []
    B, N, T, S = allowed.shape
    empty_rows = np.transpose(~allowed.any(-1), (0, 2, 1))  # (B, T, N)
    for name, x in (("output", out), ("dq", grads[0])):
        x = np.asarray(x, np.float64)
        if empty_rows.any() and np.any(x[empty_rows] != 0):
            bad.append(f"{what}: {name} not exactly zero on rows that attend to nothing")
    dead = np.transpose(~allowed.reshape(B, K, N // K, T, S).any((2, 3)), (0, 2, 1))  # (B, S, K)
    for name, x in (("dk", grads[1]), ("dv", grads[2])):
        x = np.asarray(x, np.float64)
        if dead.any() and np.any(x[dead] != 0):
            bad.append(f"{what}: {name} not exactly zero on keys no query may attend to")
    return bad


_REFERENCES = {}


def cached(key, compute):
    """``compute()`` once per key: reference results are shared by every implementation."""
    if key not in _REFERENCES:
        _REFERENCES[key] = compute()
    return _REFERENCES[key]


def reference_results(cases):
    """The reference's outputs and gradients for each case, computed once (the missing ones in
    one program) and shared by every implementation."""
    missing = [c for c in cases if ("vjp", c.name) not in _REFERENCES]
    if missing:
        args = {}
        for case in missing:
            q, k, v, bias, cot = case.inputs()
            args[case.name] = ([x for x in (q, k, v, bias) if x is not None], cot)
        program = lambda a: {c.name: value_and_vjp(reference_fn(c), *a[c.name]) for c in missing}
        _REFERENCES.update({("vjp", name): r for name, r in jax.jit(program)(args).items()})
    return {c.name: _REFERENCES[("vjp", c.name)] for c in cases}


def case_args(case):
    """Inputs and cotangent of a case in its dtype."""
    q, k, v, bias, cot = case.inputs()
    return [x.astype(case.dtype) for x in (q, k, v, bias) if x is not None], cot.astype(case.dtype)


def check_cases(impl, cases):
    """Outputs and all gradients of several cases from one program (one compile), each against
    the reference; a case that fails while tracing is reported and the others still run."""
    failures, declines = [], []
    args = {case.name: case_args(case) for case in cases}

    def program(all_args):
        results = {}
        for case in cases:
            try:
                results[case.name] = value_and_vjp(attention_fn(impl, case.kw, via=case.via), *all_args[case.name])
            except Exception as e:  # noqa: BLE001 - reported per case below
                if declined(impl, e):
                    declines.append(f"{case.name}: {e}")
                else:
                    failures.append(f"{case.name}: {type(e).__name__}: {e}")
        return results

    try:
        results = jax.jit(program)(args)
    except Exception as e:  # noqa: BLE001 - a failure while compiling or running takes every case down
        return failures + [f"{', '.join(c.name for c in cases)}: {type(e).__name__}: {e}"], declines
    references = reference_results(cases)
    for case in cases:
        if case.name in results:
            out, grads = results[case.name]
            ref_out, ref_grads = references[case.name]
            failures += compare(case.name, out, grads, ref_out, ref_grads, case.dtype, case.allowed(),
                                case.dims["K"])
    return failures, declines


def assert_conforms(impl, cases):
    cases = cases if isinstance(cases, (list, tuple)) else [cases]
    failures, declines = check_cases(impl, cases)
    assert not failures, f"{impl_name(impl)}:\n  " + "\n  ".join(failures)
    if len(declines) == len(cases):
        pytest.skip("; ".join(declines))


# ============================================================================ 1. broadcasting


def _dims_id(shape, full):
    """(2, 1, 13, 1) against (B, N, T, S) -> 'B1T1'."""
    return "".join(letter if d == f and f != 1 else "1" for letter, d, f in zip("BNTS", shape, full))


def broadcast_cases():
    """All 16 ways of writing 1 for (B, N, T, S), for a boolean mask and (complemented) for a
    bias in the same call; causal and T > S on every other combination. T, S are not multiples
    of any block size and exceed the largest tiny block."""
    cases = []
    for bits in range(16):
        flip = bits % 2 == 1
        B, N, K, H = 2, 4, 2, 8
        T, S = (19, 13) if flip else (13, 19)
        full = (B, N, T, S)
        m_shape = tuple(f if (bits >> (3 - i)) & 1 else 1 for i, f in enumerate(full))
        b_shape = tuple(f if not (bits >> (3 - i)) & 1 else 1 for i, f in enumerate(full))
        name = f"mask={_dims_id(m_shape, full)}-bias={_dims_id(b_shape, full)}" + ("-causal-T>S" if flip else "")
        rng = np.random.default_rng(bits)
        m = rng.random(m_shape) < 0.7
        if m.size == 1:
            m[...] = True
        cases.append(Case(name, (B, T, S, N, K, H, H), dict(mask=m, is_causal=flip), bias=b_shape))
    return cases


BROADCAST_CASES = broadcast_cases()


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_mask_and_bias_broadcast_shapes(impl):
    """Every 4-D broadcast shape of a mask and of a bias (bias gradient in its own shape)."""
    assert len({c.name for c in BROADCAST_CASES}) == 16
    assert_conforms(impl, BROADCAST_CASES)


# ============================================================================ 2. features


def _packed_ids(lengths, total, rng):
    """Segment ids of packed sequences of the given lengths, then padding (-1) up to ``total``."""
    ids = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)] + [np.full(total - sum(lengths), -1)])
    return ids.astype(np.int32)


def feature_cases():
    """Each case packs several features (compile time, not run time, is what a case costs)."""
    rng = np.random.default_rng(42)
    cases = []
    add = lambda *a, **k: cases.append(Case(*a, **k))
    # GQA; causal with T < S; packed segments (B, T)/(B, S) with negative padding ids; mask (S,)
    qs = np.stack([_packed_ids([5, 6, 2], 16, rng), _packed_ids([9, 3], 16, rng)])
    ks = np.stack([_packed_ids([7, 9, 2], 21, rng), _packed_ids([12, 4], 21, rng)])
    add("gqa-causal-T<S-segments-mask(S)", (2, 16, 21, 4, 2, 8, 8),
        dict(is_causal=True, query_segment_ids=qs, key_segment_ids=ks, mask=rng.random(21) < 0.8))
    # MQA; causal with T > S (the first T - S queries see nothing); lengths with a batch item
    # without keys and one without queries; bias (T, S); float32
    add("mqa-causal-T>S-lengths-bias(T,S)-f32", (3, 23, 11, 4, 1, 8, 8),
        dict(is_causal=True, query_seq_lengths=np.array([23, 17, 0], np.int32),
             key_value_seq_lengths=np.array([9, 0, 11], np.int32)), bias=(23, 11), dtype=np.float32)
    # two-sided window; soft-cap and an explicit scale; Hv != H; mask (1, S)
    add("window(3,2)-softcap-scale-Hv=6-mask(1,S)", (2, 13, 19, 4, 2, 8, 6),
        dict(local_window_size=(3, 2), logit_softcap=1.5, scale=0.9, mask=rng.random((1, 19)) < 0.8))
    # window (0, 0): only the key at the query's own position; MQA, T > S; mask (N, T, S)
    add("window(0,0)-mqa-T>S-mask(N,T,S)", (2, 19, 13, 4, 1, 8, 8),
        dict(local_window_size=(0, 0), mask=rng.random((4, 19, 13)) < 0.9))
    # causal + an int window (w means (w, w)); explicit positions, non-monotonic with offsets,
    # (B, T) queries and (S,) keys; mask (T, S)
    qp = np.stack([rng.permutation(13) + 100, rng.permutation(13) + 95]).astype(np.int32)
    kp = (rng.permutation(19) + 92).astype(np.int32)
    add("causal+window(4)-positions-shuffled-offset-mask(T,S)", (2, 13, 19, 4, 2, 8, 8),
        dict(is_causal=True, local_window_size=4, query_positions=qp, key_positions=kp,
             mask=rng.random((13, 19)) < 0.85))
    # segment ids (T,)/(S,) with a window and a bias + mask; bfloat16
    add("segments(T,)-window(5,1)-bias-mask-bf16", (2, 14, 18, 4, 2, 8, 8),
        dict(local_window_size=(5, 1), query_segment_ids=_packed_ids([3, 7, 3], 14, rng),
             key_segment_ids=_packed_ids([4, 8, 4], 18, rng), mask=rng.random((2, 1, 14, 18)) < 0.8),
        bias=(2, 4, 14, 18), dtype=BF16)
    # whole rows masked out (some heads, a whole batch item), with a bias: zeros, zero gradients
    m = rng.random((2, 4, 13, 19)) < 0.8
    m[0, 1, [2, 7, 12]] = False
    m[0, :, 5] = False
    m[1] = False
    add("fully-masked-rows-bias(1,N,T,S)", (2, 13, 19, 4, 2, 8, 8), dict(mask=m), bias=(1, 4, 13, 19))
    cases.append(everything_case())
    return {c.name: c for c in cases}


def everything_case(name="everything", dtype=np.float64):
    rng = np.random.default_rng(7)
    B, T, S = 2, 15, 21
    qs = np.stack([_packed_ids([6, 7], T, rng), _packed_ids([10], T, rng)])
    ks = np.stack([_packed_ids([9, 10], S, rng), _packed_ids([14], S, rng)])
    kw = dict(is_causal=True, local_window_size=(6, 0), query_segment_ids=qs, key_segment_ids=ks,
              query_seq_lengths=np.array([T, 9], np.int32), key_value_seq_lengths=np.array([17, S], np.int32),
              query_positions=np.arange(T, dtype=np.int32) + 3, key_positions=np.arange(S, dtype=np.int32),
              mask=rng.random((B, 1, T, S)) < 0.85, logit_softcap=2.0)
    return Case(name, (B, T, S, 4, 2, 8, 8), kw, bias=(1, 4, T, S), dtype=dtype)


FEATURES = feature_cases()


@pytest.mark.parametrize("impl", FEATURE_IMPL_PARAMS)
def test_features(impl):
    """GQA/MQA, causal with T < S and T > S, windows (incl. (0, 0) and with causal), packed
    segments, lengths (incl. 0), shuffled positions with offsets, soft-cap, bias with mask,
    fully masked rows, rank-reduced masks, float64/float32/bfloat16: outputs, gradients and
    exact structural zeros. One program; the failure message names each failing case."""
    assert_conforms(impl, list(FEATURES.values()))


DESCRIPTION_CASES = [dataclasses.replace(everything_case(), name="everything-as-description", via="description")]


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_mask_description_equals_keywords(impl):
    """``mask=causal() & window(..) & positions(..) & segments(..) & lengths(..) & dense(..)``
    means exactly what the corresponding keywords mean (the 'everything' case)."""
    assert_conforms(impl, DESCRIPTION_CASES)


# ============================================================================ 3. dtypes

DTYPE_CASES = [everything_case("everything-f32", np.float32), everything_case("everything-bf16", BF16)]


@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_dtypes(impl):
    """The 'everything' case in float32 and bfloat16 (float64: test_features, where other cases
    run in float32 and bfloat16 too): outputs in the input dtype, errors against float64 on the
    rounded inputs within the dtype's tolerance."""
    assert_conforms(impl, DTYPE_CASES)


# ============================================================================ 4. transformations


def transform_case():
    """Masked, multi-block for the tiny blocks: causal, key lengths, a window, a bias."""
    return Case("transform", (2, 11, 17, 4, 2, 4, 4),
                dict(is_causal=True, local_window_size=(7, 0), key_value_seq_lengths=np.array([17, 12], np.int32)),
                bias=(2, 1, 11, 17))


def tiny_case():
    """Small enough for Jacobians and Hessians, still more than one tiny block."""
    return Case("tiny", (1, 9, 10, 2, 1, 3, 3),
                dict(is_causal=True, key_value_seq_lengths=np.array([9], np.int32)), bias=(1, 1, 9, 10))


def _args(case):
    """float64 inputs (q, k, v and bias if any) and cotangent."""
    q, k, v, bias, cot = case.inputs()
    return [x for x in (q, k, v, bias) if x is not None], cot


def _loss(f, cot):
    return lambda *a: jnp.sum(f(*a) * cot)


def _grad_of_grad(f, cot):
    inner = jax.grad(_loss(f, cot), argnums=0)
    return jax.grad(lambda *a: jnp.sum(inner(*a) ** 2), argnums=(0, 1, 2, 3))


def _vmapped(f, a, c):
    """vjp of ``jax.vmap(f)`` over a new leading axis of size 2 (every input batched)."""
    return value_and_vjp(jax.vmap(f), [jnp.stack([x, 0.5 * x[::-1] + 0.1]) for x in a], jnp.stack([c, -c]))


TRANSFORMS = {
    # name: (case builder, evaluation of a function f on args a with cotangent c: a pytree)
    "eager": (transform_case, lambda f, a, c: value_and_vjp(f, a, c)),
    "jit+vmap+checkpoint": (transform_case, lambda f, a, c: jax.jit(lambda *a: {
        "jit": value_and_vjp(f, a, c), "vmap": _vmapped(f, a, c),
        "checkpoint": value_and_vjp(jax.checkpoint(f), a, c)})(*a)),
    "grad-of-grad": (transform_case, lambda f, a, c: jax.jit(_grad_of_grad(f, c))(*a)),
    "hessian": (tiny_case, lambda f, a, c: jax.jit(jax.hessian(lambda q: _loss(f, c)(q, *a[1:])))(a[0])),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_transformations(impl, transform):
    """The same transformation of the implementation and of the reference agree (float64):
    outputs and vjps eagerly, under jax.jit, jax.vmap and jax.checkpoint; grad of grad; the
    Hessian of a scalar loss in the queries. jax.jvp and jax.jacfwd: test_defect_b_forward_mode."""
    build, apply = TRANSFORMS[transform]
    case = build()
    args, cot = _args(case)
    got = apply(attention_fn(impl, case.kw), args, cot)
    # the reference under the same transformation ('eager': jitted, which changes nothing but time)
    ref_apply = (lambda f, a, c: jax.jit(lambda *a: value_and_vjp(f, a, c))(*a)) if transform == "eager" else apply
    want = cached(("transform", transform), lambda: ref_apply(reference_fn(case), args, cot))
    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(got))
    ref_leaves = jax.tree_util.tree_leaves(want)
    assert len(leaves) == len(ref_leaves) > 0
    bad = [f"{jax.tree_util.keystr(p)}: {rel_error(a, b):.3e}" for p, a, b in zip(paths, leaves, ref_leaves)
           if not rel_error(a, b) <= 1e-12]
    assert not bad, f"{transform}: errors above 1e-12: {bad}"


# ============================================================================ 5. defects


AUTO_AND_IMPLS = [pytest.param(None, id="auto")] + IMPL_PARAMS


def defect_a_cases():
    B, T, N, K, H = 2, 128, 4, 2, 8
    rng = np.random.default_rng(5)
    pad = rng.random((B, 1, 1, T)) < 0.8
    return [
        Case("mask(B,1,1,S)-bias(1,N,1,S)", (B, T, T, N, K, H, H), dict(mask=pad), bias=(1, N, 1, T)),
        Case("mask(S,)-bias(B,1,T,1)", (B, T, T, N, K, H, H), dict(mask=pad[0, 0, 0]), bias=(B, 1, T, 1)),
        Case("bias(B,1,1,S)-causal", (B, T, T, N, K, H, H), dict(is_causal=True), bias=(B, 1, 1, T)),
    ]


DEFECT_A_CASES = defect_a_cases()


@pytest.mark.parametrize("impl", AUTO_AND_IMPLS)
def test_defect_a_key_padding_mask_and_broadcast_bias_at_128(impl):
    """(a) Key-padding masks (B,1,1,S) and (S,), biases (B,1,1,S), (1,N,1,S), (B,1,T,1) at
    T = S = 128, where the automatic choice on CPU leaves the plain path (for query blocks)."""
    assert_conforms(impl, DEFECT_A_CASES)


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_b_forward_mode(impl):
    """(b) jax.jvp (tangents in query, key, value and bias; masked, multi-block) and jax.jacfwd
    (tiny shapes) agree with the reference's, from one program."""
    case, tiny = transform_case(), tiny_case()
    args, _ = _args(case)
    tiny_args, _ = _args(tiny)
    rng = np.random.default_rng(11)
    tangents = [rng.standard_normal(x.shape) for x in args]
    argnums = (0, 1, 2, 3)

    def program(f, f_tiny):
        return jax.jit(lambda a, t, ta: (jax.jvp(f, a, t), jax.jacfwd(f_tiny, argnums=argnums)(*ta)))

    (primal, tangent), jac = program(attention_fn(impl, case.kw), attention_fn(impl, tiny.kw))(
        args, tangents, tiny_args)
    (ref_primal, ref_tangent), ref_jac = cached("forward-mode", lambda: program(reference_fn(case), reference_fn(tiny))(
        args, tangents, tiny_args))
    errors = {"jvp primal": rel_error(primal, ref_primal), "jvp tangent": rel_error(tangent, ref_tangent)}
    errors.update({f"jacfwd w.r.t. {n[1:]}": rel_error(a, b) for n, a, b in zip(GRAD_NAMES, jac, ref_jac)})
    bad = {k: f"{e:.3e}" for k, e in errors.items() if not e <= 1e-12}
    assert not bad, f"errors above 1e-12: {bad}"


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_c_grad_of_grad_at_128(impl):
    """(c) Grad of grad with the default positions (causal) at T = S = 128."""
    case = Case("grad-of-grad-128", (1, 128, 128, 2, 1, 4, 4), dict(is_causal=True))
    args, cot = _args(case)
    args = args[:3]
    inner = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * cot), argnums=0)
    outer = lambda f: jax.grad(lambda *a: jnp.sum(inner(f)(*a) ** 2), argnums=(0, 1, 2))
    got = jax.jit(outer(attention_fn(impl, case.kw)))(*args)
    want = cached("grad-of-grad-128", lambda: jax.jit(outer(reference_fn(case)))(*args))
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert rel_error(a, b) <= 1e-12, f"d/d{name[1:]} |dq|^2: {rel_error(a, b):.3e}"


def residual_cases():
    B, T, N, K, H = 2, 16, 4, 2, 8
    kw = dict(is_causal=True, key_value_seq_lengths=np.array([16, 9], np.int32),
              query_seq_lengths=np.array([16, 12], np.int32))
    return [Case(f"residual-{DTYPE_IDS[np.dtype(d)]}", (B, T, T, N, K, H, H), kw, bias=(1, N, T, T), dtype=d)
            for d in (np.float64, BF16)]


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_d_return_residual(impl):
    """(d) ``return_residual=True`` gives ``(out, lse)``, lse ``(B, T, N)`` in float32 or wider,
    for float64 and bfloat16 inputs: equal to the reference's lse (-inf exactly on the rows with
    nothing to attend) and to jax.nn.dot_product_attention's residual on the other rows."""
    cases = residual_cases()
    args = {c.name: [x.astype(c.dtype) for x in c.inputs()[:4]] for c in cases}
    fns = {c.name: attention_fn(impl, c.kw, return_residual=True) for c in cases}
    results = jax.jit(lambda a: {n: fns[n](*a[n]) for n in fns})(args)
    bad = []
    for c in cases:
        out, lse = results[c.name]
        ref_out, ref_lse = cached(c.name, lambda: jax.jit(reference_fn(c, return_residual=True))(*c.inputs()[:4]))
        B, T, S, N = c.shape[:4]
        if lse.shape != (B, T, N):
            bad.append(f"{c.name}: lse shape {lse.shape} != {(B, T, N)}")
            continue
        if np.dtype(lse.dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
            bad.append(f"{c.name}: lse dtype {lse.dtype} is not float32 or wider")
        if not rel_error(out, ref_out) <= TOL[np.dtype(c.dtype)][0]:
            bad.append(f"{c.name}: output error {rel_error(out, ref_out):.3e}")
        lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse)
        empty = np.isneginf(ref_lse)
        assert empty.any() and not empty.all()
        if not np.array_equal(np.isneginf(lse), empty):
            bad.append(f"{c.name}: lse is -inf where the reference's is not, or the reverse, at (b, t, n) "
                       f"{np.argwhere(np.isneginf(lse) != empty)[:4].tolist()}")
        tol = 1e-12 if c.dtype == np.float64 else 1e-5  # bfloat16 inputs: float32 logits
        if not rel_error(lse[~empty], ref_lse[~empty]) <= tol:
            bad.append(f"{c.name}: lse error {rel_error(lse[~empty], ref_lse[~empty]):.3e} > {tol:.0e}")
        # jax.nn computes logits in float32 whatever the input dtype and returns the residual of
        # bfloat16 inputs rounded to bfloat16: its accuracy bounds the comparison
        _, nn_lse = cached(f"jax.nn-{c.name}", lambda: jax.nn.dot_product_attention(
            *args[c.name], is_causal=True, implementation="xla",
            key_value_seq_lengths=c.kw["key_value_seq_lengths"], return_residual=True))
        nn_tol = 1e-5 if c.dtype == np.float64 else TOL[np.dtype(BF16)][0]
        err = rel_error(lse[~empty], np.asarray(nn_lse, np.float64)[~empty])
        if not err <= nn_tol:
            bad.append(f"{c.name}: lse differs from jax.nn's by {err:.3e} > {nn_tol:.0e}")
    assert not bad, bad


RANK_PROMOTION_CASES = [
    Case("causal+lengths", kw=dict(is_causal=True, query_seq_lengths=np.array([13, 6], np.int32),
                                   key_value_seq_lengths=np.array([10, 19], np.int32))),
    Case("window+lengths", kw=dict(local_window_size=(4, 1), key_value_seq_lengths=np.array([10, 19], np.int32))),
    Case("causal+segments", kw=dict(is_causal=True, query_segment_ids=np.repeat([[0, 1], [0, 0]], [6, 7], axis=1),
                                    key_segment_ids=np.repeat([[0, 1], [0, -1]], [9, 10], axis=1))),
]


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_e_rank_promotion_raise(impl):
    """(e) Under ``jax.numpy_rank_promotion('raise')`` causal + lengths, window + lengths and
    causal + segments run forward (equal to the reference) and their backward pass traces (rank
    promotion is decided while tracing; the gradients of these rules are checked elsewhere)."""
    fns = {c.name: attention_fn(impl, c.kw) for c in RANK_PROMOTION_CASES}
    args = {c.name: case_args(c) for c in RANK_PROMOTION_CASES}
    bad = []
    with jax.numpy_rank_promotion("raise"):
        for c in RANK_PROMOTION_CASES:
            try:
                jax.eval_shape(lambda a, cot: value_and_vjp(fns[c.name], a, cot), *args[c.name])
            except Exception as e:  # noqa: BLE001 - reported below
                if declined(impl, e):
                    raise
                bad.append(f"{c.name} (backward): {type(e).__name__}: {e}")
        outs = jax.jit(lambda a: {n: fns[n](*a[n][0]) for n in fns})(args)
    references = reference_results(RANK_PROMOTION_CASES)
    bad += [f"{n}: output error {rel_error(outs[n], references[n][0]):.3e}" for n in outs
            if not rel_error(outs[n], references[n][0]) <= 1e-12]
    assert not bad, bad


@pytest.mark.parametrize("what", ["bias", "causal"])
@pytest.mark.parametrize("impl", IMPL_PARAMS)
def test_defect_f_export_with_symbolic_batch(impl, what):
    """(f) ``jax.export`` of the jitted function with a symbolic batch dimension, with a bias or
    with is_causal; the exported function run at batch 3 equals the reference. The plain path
    must serve it; another implementation may instead refuse with a ValueError saying what it
    does not support."""
    T, S, N, K, H = 7, 9, 4, 2, 8
    b, = jax.export.symbolic_shape("b")
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.float64)
    specs = [spec(b, T, N, H), spec(b, S, K, H), spec(b, S, K, H)]
    if what == "bias":
        specs.append(spec(b, 1, T, S))
        case = Case("export-bias", (3, T, S, N, K, H, H), {}, bias=(3, 1, T, S))
    else:
        case = Case("export-causal", (3, T, S, N, K, H, H), dict(is_causal=True))
    f = attention_fn(impl, case.kw)
    try:
        exported = jax.export.export(jax.jit(f))(*specs)
    except ValueError as e:  # an implementation other than the plain path may decline, saying why
        if impl.name == "xla" or f"implementation='{impl.name}' does not support" not in str(e):
            raise
        pytest.skip(str(e))
    q, k, v, bias, _ = case.inputs()
    args = [jnp.asarray(x) for x in (q, k, v, bias) if x is not None]
    got = exported.call(*args)
    assert rel_error(got, cached(case.name, lambda: jax.jit(reference_fn(case))(*args))) <= 1e-12


@pytest.mark.parametrize("bounds", [(), ("t <= 16", "s <= 16")], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("impl", [pytest.param(None, id="auto")] + IMPL_PARAMS)
def test_defect_f_export_with_symbolic_lengths(impl, bounds):
    """(f) ``jax.export`` of a function's value and gradients with the batch and both lengths
    symbolic (causal, grouped queries, a bias, soft-capping): unbounded, and bounded by
    constraints below every size threshold of the paths (which they then decide by). Run at
    B, T, S = 3, 7, 9 it equals the reference. The automatic choice and the plain path must serve
    it; another implementation may refuse with a ValueError saying what it does not support."""
    N, K, H = 4, 2, 8
    b, t, s = jax.export.symbolic_shape("b, t, s", constraints=bounds)
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float64)
    case = Case("export-lengths", (3, 7, 9, N, K, H, H), dict(is_causal=True, logit_softcap=3.0), bias=(1, N, 7, 9))
    f = attention_fn(impl, case.kw)
    program = jax.jit(lambda q, k, v, bias, cot: value_and_vjp(f, (q, k, v, bias), cot))
    try:
        exported = jax.export.export(program)(spec(b, t, N, H), spec(b, s, K, H), spec(b, s, K, H), spec(1, N, t, s),
                                              spec(b, t, N, H))
    except ValueError as e:
        name = getattr(impl, "name", None)
        if name in (None, "xla") or f"implementation='{name}' does not support" not in str(e):
            raise
        pytest.skip(str(e))
    q, k, v, bias, cot = case.inputs()
    out, grads = exported.call(q, k, v, bias, cot)
    want_out, want_grads = reference_results([case])[case.name]
    errors = [rel_error(out, want_out)] + [rel_error(g, w) for g, w in zip(grads, want_grads)]
    assert max(errors) <= 1e-12, errors


@pytest.mark.parametrize("empty", ["T=0", "S=0"])
@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_g_empty_lengths(impl, empty):
    """(g) T = 0 or S = 0: an empty output (T = 0) or zeros (S = 0) with zero gradients, or a
    ValueError that names the empty argument."""
    B, N, K, H = 2, 4, 2, 8
    T, S = (0, 7) if empty == "T=0" else (5, 0)
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(s)) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)))
    f = attention_fn(impl, dict(is_causal=True))
    try:
        out, grads = jax.jit(lambda *a: value_and_vjp(f, a, jnp.ones((B, T, N, H))))(q, k, v, bias)
        _, lse = jax.jit(attention_fn(impl, {}, return_residual=True))(q, k, v, bias)
    except ValueError as e:
        if declined(impl, e):
            raise
        named = "query" if T == 0 else "key"
        assert named in str(e), f"the ValueError does not name the empty argument ({named}): {e}"
        return
    assert out.shape == (B, T, N, H) and out.dtype == q.dtype
    assert not np.any(np.asarray(out)), "S = 0: every query attends to nothing, so the output is zeros"
    assert lse.shape == (B, T, N) and np.all(np.isneginf(np.asarray(lse)))
    for g, x in zip(grads, (q, k, v, bias)):
        assert g.shape == x.shape and not np.any(np.asarray(g))


def _poisoned(x, where, value):
    x = np.array(x)
    x[where] = value
    return x


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_h_nan_in_padding_never_leaks(impl):
    """(h) NaN/Inf in keys/values blocked for every query (by key_value_seq_lengths or a negative
    key segment id) and in queries past query_seq_lengths: outputs and gradients are finite and
    equal to those of the clean inputs, which equal the reference."""
    B, T, S, N, K, H = 2, 13, 19, 4, 2, 8
    kv_len, q_len = np.array([19, 11], np.int32), np.array([9, 13], np.int32)
    k_seg = np.zeros((B, S), np.int32)
    k_seg[0, [3, 4, 15]] = -1
    case = Case("nan-padding", (B, T, S, N, K, H, H),
                dict(is_causal=True, key_value_seq_lengths=kv_len, query_seq_lengths=q_len,
                     query_segment_ids=np.zeros((B, T), np.int32), key_segment_ids=k_seg), bias=(1, N, T, S))
    q, k, v, bias, cot = case.inputs()
    kpad = (np.arange(S)[None, :] >= kv_len[:, None]) | (k_seg < 0)     # (B, S)
    qpad = np.arange(T)[None, :] >= q_len[:, None]                      # (B, T)
    dirty = [_poisoned(q, qpad, np.nan), _poisoned(_poisoned(k, kpad, np.nan), (0, 15), np.inf),
             _poisoned(v, kpad, -np.inf), bias]
    run = jax.jit(lambda *a: value_and_vjp(attention_fn(impl, case.kw), a, jnp.asarray(cot)))
    clean_out, clean_grads = run(*map(jnp.asarray, (q, k, v, bias)))
    out, grads = run(*map(jnp.asarray, dirty))
    for name, a, b in zip(("output",) + GRAD_NAMES, [out, *grads], [clean_out, *clean_grads]):
        assert np.isfinite(np.asarray(a)).all(), f"{name} is not finite"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} differs from the clean run")
    want = cached(case.name, lambda: jax.jit(lambda *a: value_and_vjp(reference_fn(case), a, cot))(q, k, v, bias))
    bad = compare("clean", clean_out, clean_grads, want[0], want[1], np.float64, case.allowed(), K)
    assert not bad, bad


EXTREME_SEEDS = range(6)


def _extreme_case(seed):
    """float32 inputs whose largest logit is ~6e4 (queries scaled up). Keys come in pairs that
    differ by ~1e-4, so each row spreads its weight over a pair whose logits differ by O(1):
    gradients of order one rather than the rounding noise of one-hot rows."""
    B, T, S, N, K, H = 2, 19, 24, 4, 2, 8
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H))
    k = rng.standard_normal((B, S // 2, K, H)).repeat(2, axis=1)
    k = k + 1e-4 * rng.standard_normal(k.shape)
    v, cot = rng.standard_normal((B, S, K, H)), rng.standard_normal((B, T, N, H))
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(k, N // K, axis=2)) / np.sqrt(H)
    q = q * 6e4 / np.abs(logits).max()
    q, k, v, cot = (x.astype(np.float32) for x in (q, k, v, cot))
    return (q, k, v), cot


def _extreme_errors(impl):
    """Worst relative error over the seeds of the output and each gradient. In this regime a
    gradient is a difference of two nearly equal terms, so one float32 rounding of one logit
    (ulp(6e4) = 0.004) shows up 1e4-fold: a single case measures the luck of its roundings (the
    plain path and the blockwise one trade places from seed to seed), the worst over several
    measures the method."""
    kw = dict(is_causal=True)
    allowed = reference_mask(2, 4, 19, 24, **kw)
    ref = jax.jit(lambda a, c: value_and_vjp(lambda *x: reference(*x, None, allowed), a, c))
    got = jax.jit(lambda a, c: value_and_vjp(attention_fn(impl, kw), a, c))
    worst = None
    for seed in EXTREME_SEEDS:
        args, cot = _extreme_case(seed)
        want = ref(tuple(x.astype(np.float64) for x in args), cot.astype(np.float64))
        have = got(args, cot)
        errors = [rel_error(a, b) for a, b in zip([have[0], *have[1]], [want[0], *want[1]])]
        worst = errors if worst is None else [max(w, e) for w, e in zip(worst, errors)]
    return worst


@pytest.mark.parametrize("impl", IMPL_PARAMS)
@skip_declined
def test_defect_i_extreme_logits_float32(impl):
    """(i) Logits up to ~6e4 in float32: each gradient's worst error over six cases is at most
    three times the plain path's worst (against the float64 reference on the same float32
    inputs), or within float32's 1e-5. (Recomputing weights from the log-sum-exp, as the
    blockwise path once did, made them 10-15 times worse.) The factor is the plain path's own
    spread between equally valid roundings: its weights written as ``e * (1 / Z)`` and as
    ``e / Z`` give a worst dq error of 2.0e-3 and 6.4e-3 over these six cases."""
    plain = cached("extreme-xla", lambda: _extreme_errors("xla"))
    mine = _extreme_errors(impl)
    report = {n: f"{m:.2e} (xla {p:.2e})" for n, m, p in zip(("output",) + GRAD_NAMES, mine, plain)}
    bad = [n for n, m, p in zip(GRAD_NAMES, mine[1:], plain[1:]) if not (m <= 3 * p or m <= 1e-5)]
    assert not bad, f"gradients {bad} less accurate than three times the plain path's: {report}"


@pytest.mark.parametrize("impl", AUTO_AND_IMPLS)
@skip_declined
def test_defect_j_reverse_mode_of_vmap_over_mask_arrays(impl):
    """(j) jax.vjp of jax.vmap(f) where the vmapped axis carries each example's key lengths,
    segment ids and positions (batched mask arrays, not just batched q, k, v), equal to the
    reference's vjp per example. The blockwise path's tangent pass switches on them."""
    V, B, T, S, N, K, H = 2, 2, 12, 12, 4, 2, 4
    rng = np.random.default_rng(17)
    q, k, v = (rng.standard_normal(shape) for shape in ((V, B, T, N, H), (V, B, S, K, H), (V, B, S, K, H)))
    cot = rng.standard_normal((V, B, T, N, H))
    lengths = np.array([[12, 7], [3, 12]], np.int32)                                # (V, B)
    segments = np.stack([np.repeat([[0, 1], [2, 2]], [5, 7], axis=1),
                         np.repeat([[4, 4], [0, 1]], [9, 3], axis=1)]).astype(np.int32)  # (V, B, S)
    positions = np.stack([np.broadcast_to(np.arange(S), (B, S)),
                          np.broadcast_to(np.arange(S) + 3, (B, S))]).astype(np.int32)    # shifted in the 2nd

    def f(q, k, v, kl, seg, pos):
        return attention(q, k, v, is_causal=True, key_value_seq_lengths=kl, query_segment_ids=seg,
                         key_segment_ids=seg, query_positions=pos, key_positions=pos, implementation=impl)

    out, pullback = jax.vjp(lambda q, k, v: jax.vmap(f)(q, k, v, lengths, segments, positions), q, k, v)
    got = (out, *pullback(cot))
    per_example = []
    for i in range(V):
        allowed = reference_mask(B, N, T, S, is_causal=True, key_value_seq_lengths=lengths[i],
                                 query_segment_ids=segments[i], key_segment_ids=segments[i],
                                 query_positions=positions[i], key_positions=positions[i])
        o, back = jax.vjp(lambda q, k, v: reference(q, k, v, None, allowed), q[i], k[i], v[i])
        per_example.append((o, *back(cot[i])))
    want = [np.stack(xs) for xs in zip(*per_example)]
    errors = {name: rel_error(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
    assert all(e <= 1e-12 for e in errors.values()), errors


def defect_k_cases():
    """Positions up to 2**31 - 2 apart (int32): a causal rule has no lower limit, so a query
    sees every earlier key however far back; a window's limits still hold."""
    B, T, S, N, K, H = 2, 5, 6, 4, 2, 8
    q_pos = np.array([[0, 3, 300_000_000, 2**30 + 2, 2**31 - 2]] * B, np.int32)
    k_pos = np.array([[0, 1, 2, 299_999_990, 2**30, 2**31 - 3]] * B, np.int32)
    pos = dict(query_positions=q_pos, key_positions=k_pos)
    return [Case("far-causal", (B, T, S, N, K, H, H), dict(is_causal=True, **pos)),
            Case("far-window", (B, T, S, N, K, H, H), dict(is_causal=True, local_window_size=(10, 0), **pos))]


DEFECT_K_CASES = defect_k_cases()


@pytest.mark.parametrize("impl", AUTO_AND_IMPLS)
@skip_declined
def test_defect_k_positions_far_apart(impl):
    """(k) Causal and windowed rules over positions up to 2**31 - 2 apart equal the reference
    (before: a query more than 2**28 after a key could not see it)."""
    assert_conforms(impl, DEFECT_K_CASES)


# ============================================================================ 6. a toy implementation


@dataclasses.dataclass(frozen=True)
class Toy(registry.Implementation):
    """A dense implementation written from the Call's description alone: what a new
    implementation would be, registered for one test."""

    name: str = "toy"

    def supports(self, call):
        if call.return_weights:
            return "return_weights (the toy has none)"
        if call.dropout_rate > 0:
            return "dropout (the toy has none)"
        return None

    def runs_on(self, platform):
        return True

    def preferred(self, call):
        return False  # never taken by the automatic choice

    def __call__(self, call, query, key, value, dropout_rng):
        acc = call.acc_dtype
        G = call.G
        k, v = jnp.repeat(key, G, axis=2), jnp.repeat(value, G, axis=2)
        s = jnp.einsum("btnh,bsnh->bnts", query.astype(acc), k.astype(acc), precision=call.precision) * call.scale
        if call.softcap is not None:
            s = call.softcap * jnp.tanh(s / call.softcap)
        if call.mask.bias is not None:
            s = s + call.mask.bias.astype(acc)
        allowed = call.mask.dense_mask()
        allowed = jnp.ones(s.shape, bool) if allowed is None else jnp.broadcast_to(allowed, s.shape)
        some = allowed.any(-1, keepdims=True)
        m = jax.lax.stop_gradient(jnp.where(some, jnp.max(jnp.where(allowed, s, -jnp.inf), -1, keepdims=True), 0))
        e = jnp.where(allowed, jnp.exp(jnp.where(allowed, s, m) - m), 0)
        total = e.sum(-1, keepdims=True)
        out = jnp.einsum("bnts,bsnh->btnh", e / jnp.where(some, total, 1), v.astype(acc), precision=call.precision)
        lse = jnp.where(some, m + jnp.log(jnp.where(some, total, 1)), -jnp.inf)[..., 0].transpose(0, 2, 1)
        return registry.Result(out=out.astype(query.dtype), lse=lse if call.return_residual else None)


def test_toy_implementation_registered_run_and_unregistered():
    """A toy implementation, registered: reachable by name and as an object, held to the
    reference on a subset of the suite (broadcasting, features, mask descriptions, residual),
    its refusals reported; once unregistered, naming it is an error."""
    toy = registry.register(Toy())
    try:
        assert "toy" in registry.names() and toy in registry.available()
        subset = [BROADCAST_CASES[5], BROADCAST_CASES[10], FEATURES["mqa-causal-T>S-lengths-bias(T,S)-f32"],
                  FEATURES["fully-masked-rows-bias(1,N,T,S)"], *DESCRIPTION_CASES]
        assert_conforms("toy", subset)     # by name
        assert_conforms(toy, DTYPE_CASES)  # as an object
        everything = FEATURES["everything"]
        q, k, v, bias, _ = everything.inputs()
        out, lse = jax.jit(attention_fn("toy", everything.kw, return_residual=True))(q, k, v, bias)
        ref_out, ref_lse = jax.jit(reference_fn(everything, return_residual=True))(q, k, v, bias)
        assert rel_error(out, ref_out) <= 1e-12
        empty = np.isneginf(np.asarray(ref_lse))
        np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), empty)
        assert rel_error(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty]) <= 1e-12
        with pytest.raises(ValueError, match=r"implementation='toy' does not support return_weights"):
            attention(q, k, v, return_weights=True, implementation="toy")
    finally:
        registry.unregister("toy")
    assert "toy" not in registry.names()
    with pytest.raises(ValueError, match="toy"):
        attention(q, k, v, implementation="toy")


def test_every_platform_implementation_is_under_test():
    """The parametrisation covers the registry: on CPU, xla, query_blocks and blockwise (and tiny blocks), and
    every registered Pallas kernel in interpret mode on every platform."""
    names = [n for n, _ in IMPLS]
    assert "xla" in names
    if jax.default_backend() == "cpu":
        assert {"xla", "query_blocks", "query_blocks-16", "blockwise", "blockwise-7-6"} <= set(names)
        assert {n for n, _ in FEATURE_IMPLS} - set(names) == {"blockwise-8-4"}
    pallas = {impl.name for impl in registry.implementations() if hasattr(impl, "interpret")}
    assert pallas == {"splash", "pallas_triton", "pallas_decode"} == {i.name for _, i in INTERPRETED}
    assert all(i.interpret for _, i in INTERPRETED)


# ============================================================================ 7. Pallas kernels
#
# The kernels accumulate in float32 and tile their sequences, so they decline the float64
# cases above; these cases are float32 and bfloat16, each served by at least one kernel, with
# lengths that are not multiples of the blocks. Each kernel runs every case in one program and
# must serve exactly the cases listed for it (declining the others with a reason).

PALLAS_PARAMS = [pytest.param(impl, id=name, marks=pytest.mark.slow) for name, impl in INTERPRETED]


def pallas_cases():
    rng = np.random.default_rng(17)
    seg = np.stack([_packed_ids([9, 11, 7], 32, rng), _packed_ids([20, 8], 32, rng)])
    q_seg = np.stack([_packed_ids([7, 9], 24, rng), _packed_ids([24], 24, rng)])
    k_seg = np.stack([_packed_ids([15, 20], 40, rng), _packed_ids([36], 40, rng)])
    return [
        # GQA; causal with T < S (aligned at the end); Hv != H
        Case("causal-gqa-T<S-Hv=6-f32", (2, 20, 37, 4, 2, 8, 6), dict(is_causal=True), dtype=np.float32),
        # MQA; one segment-id array for queries and keys with padding (-1); query lengths
        Case("segments-mqa-qlengths-f32", (2, 32, 32, 4, 1, 8, 8),
             dict(query_segment_ids=seg, key_segment_ids=seg, query_seq_lengths=np.array([32, 21], np.int32)),
             dtype=np.float32),
        # causal window, soft-cap, scale, key lengths (one of 0), query and key segments differing
        Case("window(5,0)-softcap-kvlengths-segments-f32", (2, 24, 40, 4, 2, 8, 8),
             dict(is_causal=True, local_window_size=(5, 0), logit_softcap=2.0, scale=0.7,
                  key_value_seq_lengths=np.array([33, 0], np.int32), query_segment_ids=q_seg,
                  key_segment_ids=k_seg), dtype=np.float32),
        # two-sided window with T > S: the first queries see nothing
        Case("window(3,2)-T>S-f32", (2, 30, 20, 4, 2, 8, 8), dict(local_window_size=(3, 2)), dtype=np.float32),
        Case("causal-gqa-bf16", (2, 16, 16, 4, 2, 16, 16), dict(is_causal=True), dtype=BF16),
        # one decoding step: key lengths (one of 0), query lengths (one of 0)
        Case("decode-causal-lengths-f32", (3, 1, 37, 4, 2, 8, 8),
             dict(is_causal=True, key_value_seq_lengths=np.array([37, 5, 0], np.int32),
                  query_seq_lengths=np.array([1, 1, 0], np.int32)), dtype=np.float32),
        Case("decode-window(9,0)-mqa-bf16", (2, 1, 40, 4, 1, 8, 8), dict(local_window_size=(9, 0)), dtype=BF16),
    ]


PALLAS_CASES = pallas_cases()

# what each kernel serves of PALLAS_CASES (the rest it must decline, saying why)
PALLAS_SERVES = {
    "splash": {c.name for c in PALLAS_CASES},
    "pallas_triton": {"causal-gqa-T<S-Hv=6-f32", "segments-mqa-qlengths-f32", "causal-gqa-bf16"},
    "pallas_decode": {"decode-causal-lengths-f32", "decode-window(9,0)-mqa-bf16"},
}


@pytest.mark.parametrize("impl", PALLAS_PARAMS)
def test_pallas_kernels(impl):
    """Each Pallas kernel in interpret mode, on the cases it serves: outputs and gradients
    against the float64 reference within the dtype's tolerance, exact zeros on rows that attend
    to nothing and on keys nobody sees; the other cases declined with a reason."""
    failures, declines = check_cases(impl, PALLAS_CASES)
    assert not failures, f"{impl_name(impl)}:\n  " + "\n  ".join(failures)
    declined_names = {d.split(": implementation=")[0] for d in declines}
    served = {c.name for c in PALLAS_CASES} - declined_names
    assert served == PALLAS_SERVES[impl.name], declines


def pallas_transform_case(impl):
    if isinstance(impl, PallasDecode):
        return Case("pallas-transform-decode", (2, 1, 21, 4, 2, 8, 8),
                    dict(is_causal=True, key_value_seq_lengths=np.array([21, 9], np.int32)), dtype=np.float32)
    return Case("pallas-transform", (2, 16, 21, 4, 2, 8, 8), dict(is_causal=True), dtype=np.float32)


def _vmap_and_checkpoint(f, a, c):
    """vjps of ``jax.vmap(f)`` and of ``jax.checkpoint(f)``, one jitted program (the plain jitted
    vjp is test_pallas_kernels')."""
    return jax.jit(lambda *a: {"vmap": _vmapped(f, a, c), "checkpoint": value_and_vjp(jax.checkpoint(f), a, c)})(*a)


@pytest.mark.parametrize("impl", PALLAS_PARAMS)
def test_pallas_transformations(impl):
    """jax.vmap and jax.checkpoint of each kernel under jax.jit agree with the reference
    (float32, outputs and vjps); forward mode (jax.jvp) raises JAX's custom_vjp error and
    second derivatives raise, as documented (never a wrong number)."""
    case = pallas_transform_case(impl)
    args, cot = case_args(case)
    f = attention_fn(impl, case.kw)
    got = _vmap_and_checkpoint(f, args, cot)
    ref_args = [x.astype(np.float64) for x in args]
    want = cached(("pallas-transform", case.name), lambda: _vmap_and_checkpoint(
        reference_fn(case), ref_args, cot.astype(np.float64)))
    paths, leaves = zip(*jax.tree_util.tree_leaves_with_path(got))
    ref_leaves = jax.tree_util.tree_leaves(want)
    assert len(leaves) == len(ref_leaves) > 0
    bad = [f"{jax.tree_util.keystr(p)}: {rel_error(a, b):.3e}" for p, a, b in zip(paths, leaves, ref_leaves)
           if not rel_error(a, b) <= 1e-5]
    assert not bad, f"errors above 1e-5: {bad}"
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(f, tuple(args), tuple(args))
    inner = jax.grad(lambda q, *rest: jnp.sum(f(q, *rest) * cot))
    second = f"implementation='{impl.name}' has no second derivatives"
    with pytest.raises(NotImplementedError, match=second):  # flax_attn's message, not one from inside Pallas
        jax.eval_shape(jax.grad(lambda *a: jnp.sum(inner(*a) ** 2), argnums=(0, 1, 2)), *args)
    with pytest.raises(NotImplementedError, match=second):
        jax.eval_shape(jax.hessian(lambda q: jnp.sum(f(q, *args[1:]) * cot)), args[0])


@pytest.mark.slow
def test_pallas_return_residual():
    """``return_residual=True`` through each kernel (forward): the log-sum-exp equals the
    reference's, -inf exactly on the rows that attend to nothing. Splash and Triton cannot
    differentiate with residuals: a derivative raises flax_attn's NotImplementedError saying
    so; the decoding kernel's backward pass (the plain path's) serves it, gradients of the lse
    included."""
    bad = []
    for name, impl in INTERPRETED:
        case = next(c for c in PALLAS_CASES if c.name in PALLAS_SERVES[impl.name] and c.dtype == np.float32
                    and "lengths" in c.name)
        args, _ = case_args(case)
        out, lse = jax.jit(attention_fn(impl, case.kw, return_residual=True))(*args)
        ref_out, ref_lse = cached(("residual", case.name), lambda: jax.jit(reference_fn(case, return_residual=True))(
            *[x.astype(np.float64) for x in args]))
        lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse)
        empty = np.isneginf(ref_lse)
        assert empty.any() and not empty.all(), case.name
        if not np.array_equal(np.isneginf(lse), empty):
            bad.append(f"{name}: lse is -inf elsewhere than the reference's")
        for what, err in (("output", rel_error(out, ref_out)), ("lse", rel_error(lse[~empty], ref_lse[~empty]))):
            if not err <= 1e-5:
                bad.append(f"{name} on {case.name}: {what} error {err:.3e}")
        # a loss of the output and of the finite lse: both cotangents reach the kernel's derivative
        loss = lambda f: lambda *a: (lambda o, l: jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0)))(*f(*a))
        grad = lambda f, a: jax.grad(loss(f), argnums=(0, 1, 2))(*a)
        if impl.residual_forward_only:
            with pytest.raises(NotImplementedError, match=f"implementation='{impl.name}' gives the log-sum-exp "
                                                          f"\\(return_residual=True\\) forward only"):
                jax.eval_shape(lambda *a: grad(attention_fn(impl, case.kw, return_residual=True), a), *args)
            continue
        got = jax.jit(lambda *a: grad(attention_fn(impl, case.kw, return_residual=True), a))(*args)
        want = jax.jit(lambda *a: grad(reference_fn(case, return_residual=True), a))(*[x.astype(np.float64) for x in args])
        for i, (g, w) in enumerate(zip(got, want)):
            if not rel_error(g, w) <= 1e-5:
                bad.append(f"{name} on {case.name}: gradient {i} error {rel_error(g, w):.3e}")
    assert not bad, bad


# ============================================================================ 8. natively on a GPU
#
# On an NVIDIA GPU, every implementation that runs there (cuDNN, the Pallas kernels compiled
# for the device, and the pure-JAX paths) at the block sizes it runs with by default, on
# bfloat16 calls of the sizes layers make: lengths that are not multiples of any block, 64- and
# 128-dim heads, GQA/MQA, T < S, segments, lengths, a bias, one decoding step. Outputs and
# gradients against the float64 reference (bfloat16 tolerances), exact zeros where nothing is
# attended; each implementation serves exactly the cases listed and declines the rest with a
# reason. Skipped where JAX has no GPU.

ON_GPU = pytest.mark.skipif(jax.default_backend() != "gpu", reason="native GPU kernels need an NVIDIA GPU; none here")


def gpu_cases():
    rng = np.random.default_rng(23)
    seg = np.stack([_packed_ids([100, 90, 66], 256, rng), _packed_ids([200, 40], 256, rng)])
    return [
        Case("gpu-causal-mha-bf16", (2, 384, 384, 8, 8, 64, 64), dict(is_causal=True), dtype=BF16),
        Case("gpu-causal-gqa-T<S-H128-bf16", (2, 200, 520, 8, 2, 128, 128), dict(is_causal=True), dtype=BF16),
        Case("gpu-segments-qlengths-mqa-bf16", (2, 256, 256, 4, 1, 64, 64),
             dict(query_segment_ids=seg, key_segment_ids=seg, query_seq_lengths=np.array([256, 170], np.int32)),
             dtype=BF16),
        Case("gpu-bias-bf16", (2, 160, 160, 4, 4, 64, 64), dict(), bias=(1, 4, 160, 160), dtype=BF16),
        Case("gpu-window-softcap-bf16", (2, 300, 300, 8, 4, 64, 64),
             dict(is_causal=True, local_window_size=(127, 0), logit_softcap=30.0), dtype=BF16),
        Case("gpu-decode-kvlengths-gqa-bf16", (4, 1, 1000, 8, 2, 128, 128),
             dict(is_causal=True, key_value_seq_lengths=np.array([1000, 517, 3, 64], np.int32)), dtype=BF16),
        Case("gpu-decode-window-mqa-bf16", (2, 1, 700, 8, 1, 64, 64), dict(local_window_size=(255, 0)), dtype=BF16),
    ]


GPU_CASES = gpu_cases()
_ALL_GPU = {c.name for c in GPU_CASES}
# what each implementation serves of GPU_CASES natively (the rest it must decline, saying why)
GPU_SERVES = {
    "xla": _ALL_GPU,
    "blockwise": _ALL_GPU,
    "query_blocks": _ALL_GPU,
    "key_blocks": {"gpu-decode-kvlengths-gqa-bf16"},
    "cudnn": {"gpu-causal-mha-bf16", "gpu-bias-bf16"},
    "pallas_triton": {"gpu-causal-mha-bf16", "gpu-causal-gqa-T<S-H128-bf16", "gpu-segments-qlengths-mqa-bf16"},
    "pallas_decode": {"gpu-decode-kvlengths-gqa-bf16", "gpu-decode-window-mqa-bf16"},
}
assert all(v <= _ALL_GPU for v in GPU_SERVES.values())


@ON_GPU
@pytest.mark.parametrize("name", sorted(GPU_SERVES))
def test_native_on_gpu(name):
    """Each implementation that runs on the GPU, natively, on the cases it serves: outputs and
    gradients against the float64 reference; the other cases declined with a reason."""
    assert name in {impl.name for impl in registry.available("gpu")}
    impl = registry.get(name)
    failures, declines = check_cases(impl, GPU_CASES)
    assert not failures, f"{name}:\n  " + "\n  ".join(failures)
    served = _ALL_GPU - {d.split(": implementation=")[0] for d in declines}
    assert served == GPU_SERVES[name], declines


@ON_GPU
def test_automatic_choice_on_this_gpu():
    """The automatic choice on the device: the decoding kernel for one query, cuDNN or Triton where
    they serve, the plain path otherwise; and what it runs conforms."""
    chosen = {}
    for case in GPU_CASES:
        q, k, v, bias, _ = case.inputs()
        call = fa.core.call.describe(jnp.asarray(q, BF16), jnp.asarray(k, BF16), jnp.asarray(v, BF16),
                                     None if bias is None else jnp.asarray(bias, BF16),
                                     **case.kw)
        chosen[case.name] = registry.choose(call).name
    assert chosen == {
        "gpu-causal-mha-bf16": "cudnn",
        "gpu-causal-gqa-T<S-H128-bf16": "pallas_triton",
        "gpu-segments-qlengths-mqa-bf16": "pallas_triton",
        "gpu-bias-bf16": "cudnn",
        "gpu-window-softcap-bf16": "xla",
        "gpu-decode-kvlengths-gqa-bf16": "pallas_decode",
        "gpu-decode-window-mqa-bf16": "pallas_decode",
    }, chosen
    failures, declines = check_cases(None, GPU_CASES)
    assert not failures and not declines, failures + declines
