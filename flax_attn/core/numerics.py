"""The numerics every implementation shares: the logit pipeline, the grouped-query fold, the
masked softmax and dropout. Written once here; implementations differ only in how they loop.

Logit pipeline (in at least float32): ``s = scale * q.k``; soft-cap ``s = c * tanh(s / c)``;
``s = s + bias``; ``s = score_mod(s, b, n, q_idx, k_idx)`` if given; blocked pairs (the mask,
``mask_mod`` included) take no part in the softmax; sinks join its denominator
(:func:`apply_sinks`).
"""
from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import ad_checkpoint

from flax_attn import _checks
from flax_attn.core import tuning

Array = Any


def finish_logits(call, raw, bias=None):
    """Scale, soft-cap and bias raw dot products ``q.k`` (already in ``call.acc_dtype``).

    ``call`` is anything with ``scale`` and ``softcap``. When it is a whole
    :class:`~flax_attn.core.call.Call` whose mask description holds a ``score_mod``, ``raw``
    must be all of the call's logits, ``(B, K, G, T, S)`` or ``(B, N, T, S)``, and the score_mod
    is applied too (:meth:`~flax_attn.core.mask.Mask.scores`); implementations that work block
    by block pass something else (their own static facts) and call
    :meth:`~flax_attn.core.mask.Mask.block_scores` on each block.
    """
    s = raw * jnp.asarray(call.scale, raw.dtype)
    if call.softcap is not None:
        cap = jnp.asarray(call.softcap, raw.dtype)
        s = cap * jnp.tanh(s / cap)
    if bias is not None:
        s = s + bias.astype(raw.dtype)
    mask = getattr(call, "mask", None)
    if getattr(mask, "score_mod", None) is not None:
        s = mask.scores(s)
    return s


def scale_is_exact(scale: float, dtype) -> bool:
    """Whether multiplying the queries by ``scale`` is exact, so that ``(scale q) . k`` equals
    ``scale (q . k)`` bit for bit: a power of two, in a format whose exponent range reaches
    float32's (float32, float64, bfloat16; not float16, whose small queries would lose bits below
    its subnormal limit)."""
    mantissa, _ = math.frexp(scale)
    return mantissa == 0.5 and int(jnp.finfo(dtype).minexp) <= -126


def apply_sinks(sinks, out, lse, weights=None):
    r"""Attention sinks (gpt-oss): a per-head logit that joins every softmax denominator and
    carries no value,

    .. math::  \mathrm{out}' = \mathrm{out}\,\sigma(\mathrm{lse} - \mathrm{sink}),\qquad
               \mathrm{lse}' = \log(e^{\mathrm{lse}} + e^{\mathrm{sink}}),

    exact, since every weight is divided by ``1 + e^(sink - lse)``. Computed in float32 or wider.

    Args:
      sinks: ``(N,)`` floating.
      out: ``(B, T, N, Hv)``: attention without sinks.
      lse: ``(B, T, N)``: log-sum-exp of the allowed logits (``-inf`` where nothing is allowed).
      weights: optional ``(B, N, T, S)`` attention weights without sinks.

    Returns:
      ``(out', lse', weights')`` in the dtypes given (``weights'`` None if ``weights`` is): a
      query that may attend to nothing keeps zeros, and its ``lse'`` is the sink.
    """
    acc = jnp.promote_types(jnp.promote_types(lse.dtype, jnp.float32), jnp.asarray(sinks).dtype)
    sink = jnp.asarray(sinks).astype(acc)
    lse = lse.astype(acc)
    factor = jax.nn.sigmoid(lse - sink)                       # (B, T, N); 0 where lse = -inf
    new_out = (out.astype(acc) * factor[..., None]).astype(out.dtype)
    new_weights = None
    if weights is not None:
        new_weights = (weights.astype(acc) * jnp.swapaxes(factor, 1, 2)[..., None]).astype(weights.dtype)
    return new_out, jnp.logaddexp(lse, sink), new_weights


def group_queries(query, K: int):
    """``(B, T, N, H)`` -> ``(B, K, G, T, H)``: the G query heads that share key/value head k.

    Writing grouped-query attention this way makes MHA (G = 1) and MQA (K = 1) the same code.
    """
    B, T, N, H = query.shape
    return query.reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)


def ungroup(x):
    """``(B, K, G, T, Hv)`` -> ``(B, T, N, Hv)``."""
    B, K, G, T, Hv = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, Hv)


def group_heads(x, K: int):
    """A ``(B|1, N|1, T|1, S|1)`` mask or bias -> ``(B|1, K|1, G|1, T|1, S|1)``."""
    b, n, t, s = x.shape
    return x[:, :, None] if n == 1 else x.reshape(b, K, n // K, t, s)


def _softmax_terms(logits, allowed, axis: int = -1, name=None):
    """What a masked softmax is built from: ``(e, inv, lse)``, with ``e = exp(filled - m)``
    (blocked entries exactly 0), ``inv = 1 / total`` in a row with an allowed entry above
    ``-inf`` (``total != 0``) and 0 in any other, and the log-sum-exp (``-inf`` in such a row).
    The row maxima ``m`` and sums ``total`` are named ``name`` under differentiation, if given.

    Blocked entries become ``-inf``, so ``exp`` gives exactly 0 beside the row's maximum (whose
    own term is 1, so ``total >= 1`` in a row with any allowed finite entry); a row with nothing
    allowed takes ``m = 0`` and gives ``e = 0``, ``total = 0``. No division or logarithm sees a
    zero sum, so reverse mode has no ``0 * inf`` to make NaN of.
    """
    filled = logits if allowed is None else jnp.where(allowed, logits, -jnp.inf)
    m = jnp.max(filled, axis=axis, keepdims=True)
    m = jax.lax.stop_gradient(jnp.where(m == -jnp.inf, 0, m))
    if name is not None:
        m = ad_checkpoint.checkpoint_name(m, name)
    e = jnp.exp(filled - m)
    total = jnp.sum(e, axis=axis, keepdims=True)
    if name is not None:
        total = ad_checkpoint.checkpoint_name(total, name)
    some = total != 0  # a NaN sum counts as some: NaN reaches the weights and the log-sum-exp
    safe = jnp.where(some, total, 1)
    inv = jnp.where(some, 1 / safe, 0)
    lse = jnp.where(some, m + jnp.log(safe), -jnp.inf)
    return e, inv, jnp.squeeze(lse, axis)


def softmax_parts(logits, allowed=None, axis: int = -1):
    """Softmax over ``axis`` where ``allowed`` (and the logit is not ``-inf``), and the log-sum-exp.

    Returns ``(weights, lse)``: a row with nothing allowed has weights 0 (gradient 0, never
    NaN) and ``lse = -inf``.
    """
    e, inv, lse = _softmax_terms(logits, allowed, axis)
    return e * inv, lse


SOFTMAX_STATS = "flax_attn_softmax_stats"
"""The name (``jax.ad_checkpoint.checkpoint_name``) of :func:`softmax_values`' row maxima and
row sums under differentiation: a ``jax.checkpoint`` policy that saves it
(``jax.checkpoint_policies.save_only_these_names(SOFTMAX_STATS)``) keeps two numbers per row and
recomputes the weights from the logits in one pass."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def softmax_values(logits, allowed, values, precision=None, platform=None):
    """The weighted values and the log-sum-exp of a masked softmax:
    ``(softmax_parts(logits, allowed)[0] @ values, lse)``.

    Args:
      logits: ``(..., R, S)`` in the accumulation dtype (float32 or wider).
      allowed: None or a boolean array broadcastable to ``logits``.
      values: ``(..., S, Hv)``; the weights are cast to its dtype for the matmul.
      precision: the matmul's precision.
      platform: where it runs ('cpu' takes the matmul forms that are fast on CPU, see below).

    Returns:
      ``out (..., R, Hv)`` in ``logits.dtype`` and ``lse (..., R)``, as :func:`softmax_parts`
      (a row with nothing allowed: zeros and ``-inf``).

    Its derivative (a custom JVP, so forward mode and every order stay JAX's) is written with
    the weights ``P = exp(s - m) / Z`` from the row maxima ``m`` and sums ``Z``, named
    :data:`SOFTMAX_STATS`; its transpose is ``ds = P * (dP - rowsum(P * dP))``, three passes
    over the logits where differentiating the softmax itself takes about seven. ``P`` comes from
    ``m`` and ``Z`` rather than from ``exp(s - lse)``: at logits near 6e4 in float32 ``s - lse``
    loses the low bits that ``s - m`` keeps. On CPU, from :data:`KEYS_MAJOR_TANGENT_MIN` rows
    and keys on, the values' tangent enters through :func:`keys_major_product`, so that
    reverse mode computes the values' gradient as ``(dout^T P)^T``.

    The rows are normalised after the matmul, ``(exp(s - m) @ values) / Z``: one pass over the
    ``(R, Hv)`` outputs instead of one over the ``(R, S)`` weights (GPT-2-small's causal core in
    query blocks, 8 x 12 heads x 1024 tokens, float32, a 2-core AMD EPYC: forward 0.144 ->
    0.138 s, forward+backward 0.575 -> 0.562 s, medians of runs in turns in one process).
    """
    e, inv, lse = _softmax_terms(logits, allowed)
    return weighted_values(e, values, precision, logits.dtype) * inv, lse


@softmax_values.defjvp
def _softmax_values_jvp(precision, platform, primals, tangents):
    logits, allowed, values = primals
    d_logits, _, d_values = tangents
    e, inv, lse = _softmax_terms(logits, allowed, name=SOFTMAX_STATS)
    out = weighted_values(e, values, precision, logits.dtype) * inv
    weights = e * inv
    ok = logits != -jnp.inf  # a tangent at a blocked or -inf logit takes no part, even if not finite
    if allowed is not None:
        ok = ok & allowed
    # d out = dP v + P dv, dP = P * (ds - rowsum(P * ds)); d lse = rowsum(P * ds)
    pds = weights * jnp.where(ok, d_logits, 0)
    d_lse = jnp.sum(pds, axis=-1, keepdims=True)
    if _tangent_keys_major(weights, platform):
        values_term = keys_major_product(weights, d_values, precision, logits.dtype, rows_out=True)
    else:
        values_term = weighted_values(weights, d_values, precision, logits.dtype)
    d_out = weighted_values(pds - weights * d_lse, values, precision, logits.dtype) + values_term
    return (out, lse), (d_out, d_lse[..., 0])


KEYS_MAJOR_TANGENT_MIN = 256
"""On CPU, a logits array ``(..., R, S)`` with at least this many rows and keys takes the
keys-major tangent forms of :func:`key_logits` and :func:`softmax_values`."""


def _tangent_keys_major(logits, platform) -> bool:
    R, S = logits.shape[-2:]
    large = _checks.decided(lambda: R >= KEYS_MAJOR_TANGENT_MIN and S >= KEYS_MAJOR_TANGENT_MIN)
    return platform == "cpu" and bool(large)


def keys_major_product(rows, keys_tangent, precision, acc, rows_out):
    """A tangent term that is a batched matmul of a primal's ``rows (..., R, X)`` with a
    keys-major tangent ``(..., S, Y)``, written so that reverse mode computes the tangent's
    gradient ``(..., S, Y)`` as ``(A^T B)^T`` with ``A^T`` a small transposed copy: the form
    XLA's CPU compiler gives to its fast (YNNPACK) matmul. Written the plain way (``A^T B``
    with ``A`` read down its columns) reverse mode got XLA's generic matmul, which took 2.5x
    the CPU time (one query block's key gradient, 4 units of 128 x 1,024 logits and 64-dim
    heads, a 2-core AMD EPYC: 2.5 ms of CPU time against 1.0). Taken from
    :data:`KEYS_MAJOR_TANGENT_MIN` rows and keys on: GPT-2-small's causal core in query blocks
    of 256 (8 x 12 heads, 1024 tokens) forward+backward 0.57 -> 0.49 s, 12 query heads over 6
    key/value heads in blocks of 128 0.48 -> 0.44 s; with 128 rows (multi-head blocks of 128)
    no faster, and on the plain path's small logits (127 tokens) 10-20% slower.

    ``rows_out=True``: the weights ``rows (R, S)`` times the values' tangent ``(S, Hv)`` ->
    ``(R, Hv)``. ``rows_out=False``: the queries ``rows (R, H)`` times the keys' tangent
    ``(S, H)`` (contracted over H) -> the logits' tangent ``(R, S)``. Both transposes are kept
    apart by barriers (XLA would fold them back into the matmul).
    """
    bar = jax.lax.optimization_barrier
    tangent_t = bar(jnp.swapaxes(keys_tangent, -1, -2))  # (..., Y, S)
    if rows_out:  # (Hv, S) . (R, S) -> (Hv, R): the values' cotangent comes out as (dout^T P)
        product = jnp.einsum("...hs,...rs->...hr", tangent_t, rows.astype(keys_tangent.dtype),
                             precision=precision, preferred_element_type=acc)
        return jnp.swapaxes(bar(product), -1, -2)
    # (H, R) . (H, S) -> (R, S): the keys' cotangent comes out as (q^T ds)
    return jnp.einsum("...hr,...hs->...rs", bar(jnp.swapaxes(rows, -1, -2)), tangent_t,
                      precision=precision, preferred_element_type=acc)


FEW_ROWS = 16
FEW_ROWS_MIN_KEYS = 1024
"""From 2 to :data:`FEW_ROWS` query rows per unit over at least this many keys, the plain
path's logits on CPU are computed keys-major (:func:`key_logits`)."""


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def key_logits(queries, keys, precision, acc, platform=None):
    """``queries (U, R, H) . keys (U, S, H)`` -> raw logits ``(U, R, S)`` in ``acc``: the logit
    matmul of the plain path and of the query blocks.

    On CPU, with 2 to :data:`FEW_ROWS` rows over at least :data:`FEW_ROWS_MIN_KEYS` keys (a
    grouped-query decoding step), the product is computed keys-major, ``(U, S, R)``, and then
    transposed (the barrier keeps XLA from folding the transpose back into the matmul). On a
    2-core AMD EPYC, alone: 48 units of 8,192 keys of 64, 2 rows: 14.9 -> 6.8 ms (the keys read
    at 15 GB/s); 8 units of 576-wide keys, 16 rows: 16.8 -> 10.1 ms; at 128 rows (compute-bound)
    the two forms are even. The grouped-query attention of one decoding token (12 query heads
    of 64 over 2, 4 or 6 key/value heads, batch 1 and 8), in turns with PyTorch in one process:
    10-37% faster with 8,192 keys, 8-48% with 1,202.

    Its derivative (a custom JVP) is the matmul's; on CPU, from :data:`KEYS_MAJOR_TANGENT_MIN`
    rows and keys on, the keys' tangent enters through :func:`keys_major_product`, so that
    reverse mode computes the keys' gradient as ``(q^T ds)^T``.
    """
    R, S = queries.shape[-2], keys.shape[-2]
    if platform == "cpu" and _checks.decided(lambda: 1 < R <= FEW_ROWS and S >= FEW_ROWS_MIN_KEYS):
        t = jnp.einsum("USH,URH->USR", keys, queries, precision=precision, preferred_element_type=acc)
        return jnp.swapaxes(jax.lax.optimization_barrier(t), -1, -2)
    return jnp.einsum("URH,USH->URS", queries, keys, precision=precision, preferred_element_type=acc)


@key_logits.defjvp
def _key_logits_jvp(precision, acc, platform, primals, tangents):
    queries, keys = primals
    d_queries, d_keys = tangents
    out = key_logits(queries, keys, precision, acc, platform)
    d_out = key_logits(d_queries, keys, precision, acc, platform)
    if _tangent_keys_major(out, platform):
        d_out = d_out + keys_major_product(queries, d_keys, precision, acc, rows_out=False)
    else:
        d_out = d_out + key_logits(queries, d_keys, precision, acc, platform)
    return out, d_out


DIAGONAL_MAX_COLUMNS = 16
"""Block-diagonal queries (:func:`reads_heads_in_place`) while key/value heads x query rows per
head (``K * G * T``) are at most this: they do K times the multiplications."""


def keys_in_units_order(K: int) -> bool:
    """Whether ``(B, S, K, H)`` keys lie in ``(B*K, S, H)`` order: one key/value head, or
    declared so (a ``'BKSH'`` cache, :func:`flax_attn.core.tuning.keys_stored`)."""
    return K == 1 or tuning.keys_stored_as() == "BKSH"


def reads_heads_in_place(call) -> bool:
    """Whether keys and values given as ``(B, S, K, H)`` are read where they lie, as ``(B, S,
    K*H)`` rows against block-diagonal queries (:func:`diagonal_queries`), instead of regrouped
    into ``(B*K, S, H)`` first: on a CPU with AVX-512, with more than one key/value head that
    is not declared to lie in that order (:func:`flax_attn.core.tuning.keys_stored`), while
    ``K * G * T <= DIAGONAL_MAX_COLUMNS`` (a decoding step).

    The regrouping is a transposed copy of all the keys and values at every call. The plain
    path's attention of one token in 12 heads of 64, float32, 2-core AMD EPYC of family 26, in
    turns: batch 1 over 8,192 keys 15.9 -> 3.1 ms, batch 8 over 1,024 keys 16.6 -> 3.7 ms. A
    non-finite key in one head's columns makes every head's logit at its slot NaN (0 x inf),
    where the regrouped matmuls keep it to its own head; values are not mixed (each unit's
    columns are taken, not summed). On a 2-core Intel Xeon of family 6, model 207, a decoding
    step of a 768-wide, 12-head layer with a ``'BSKH'`` cache, in turns in one process,
    regrouped / read in place: batch 8 after 1,024 tokens 17.8 / 12.6 ms, batch 1 after 8,192
    14.5 / 6.96 ms. Not measured on CPUs without AVX-512, which regroup."""
    return (call.platform == "cpu" and not keys_in_units_order(call.K) and tuning.keys_stored_as() != "blocks"
            and _checks.decided(lambda: call.K * call.G * call.T <= DIAGONAL_MAX_COLUMNS) and tuning.has_avx512())


def diagonal_queries(queries):
    """``(B, K, R, H)`` -> ``(B, K*R, K*H)``: row ``k*R + r`` holds unit (b, k)'s query row r in
    columns ``k*H .. k*H + H - 1`` and zeros elsewhere, so that one matmul with keys ``(B, S,
    K*H)`` gives every unit's logits (:func:`diagonal_logits`)."""
    B, K, R, H = queries.shape
    eye = jnp.eye(K, dtype=queries.dtype)
    return (queries[:, :, :, None, :] * eye[None, :, None, :, None]).reshape(B, K * R, K * H)


def diagonal_logits(diagonal, keys, precision, acc):
    """Block-diagonal queries ``(B, K*R, K*H)`` . keys ``(B, S, K*H)`` -> raw logits ``(B, K*R,
    S)`` in ``acc``, unit (b, k)'s rows at ``k*R ..``."""
    return jnp.einsum("bnd,bsd->bns", diagonal, keys, precision=precision, preferred_element_type=acc)


def diagonal_values(weights, values, K: int, precision, acc):
    """Weights ``(B, K*R, S)`` (rows as :func:`diagonal_logits`) @ values ``(B, S, K*Hv)`` ->
    ``(B, K, R, Hv)`` in ``acc``: one matmul over every head's columns, of which each unit keeps
    its own."""
    B, KR, S = weights.shape
    every = jnp.einsum("bns,bsd->bnd", weights.astype(values.dtype), values, precision=precision,
                       preferred_element_type=acc)
    every = every.reshape(B, K, KR // K, K, values.shape[-1] // K)
    return jnp.stack([every[:, k, :, k] for k in range(K)], axis=1)


ONE_ROW_PAD_KEYS = 4096
"""From this many keys on, a one-row values' matmul runs beside a row of zeros on the CPUs of
:func:`flax_attn.core.tuning.values_matvec_as_two_rows` (:func:`weighted_values`)."""


def weighted_values(weights, values, precision, acc, platform=None):
    """``weights (..., R, S) @ values (..., S, Hv)`` in ``acc``, the weights cast to the values'
    dtype: the values' matmul of the plain path and of :func:`softmax_values`.

    On a CPU where :func:`flax_attn.core.tuning.values_matvec_as_two_rows` holds (AMD's, with
    AVX-512) a single row (``R = 1``: one query per key/value head, a multi-head decoding step)
    over at least :data:`ONE_ROW_PAD_KEYS` keys is computed beside a row of zeros. XLA compiles a
    one-row batched matmul to a matrix-vector kernel and a two-row one to its general matmul,
    and which reads the values faster depends on the CPU (96 units of 8,370 keys of 64,
    float32, 2-core AMD EPYCs, the values read at): family 26, AVX-512: one row 13-15 GB/s,
    two rows 23; family 25, AVX2 only: one row 17.7 GB/s, two rows 8.8 (in turns in one
    process; 12 units: 18.3 against 10.2); Intel's family 6, model 207 (AVX-512): one row 23.4
    GB/s, two rows 11.3 (8,320 keys, each product cold). A decoding step of a 768-wide, 12-head
    layer over 8,192 cached tokens on family 26, in two A/B runs in turns: 34.9 -> 30.7 and
    36.6 -> 32.8 ms at batch 8, 4.7 -> 4.0 and 5.7 -> 5.7 ms at batch 1. With fewer keys the
    two-row kernel is no faster (96 units of 1,202 keys alone: 1.49 -> 1.86 ms), so the key
    blocks (128 to 512 keys a block) keep the one-row matmul.
    """
    weights = weights.astype(values.dtype)
    one_row = (platform == "cpu" and _checks.dim_is(weights.shape[-2], (1,))
               and _checks.decided(lambda: weights.shape[-1] >= ONE_ROW_PAD_KEYS)
               and tuning.values_matvec_as_two_rows())
    if one_row:
        weights = jnp.concatenate([weights, jnp.zeros_like(weights)], axis=-2)
    out = jnp.einsum("...rk,...kh->...rh", weights, values, precision=precision, preferred_element_type=acc)
    return out[..., :1, :] if one_row else out


def masked_softmax(logits, mask=None, axis: int = -1):
    """Softmax over ``axis`` where ``mask`` is False (or the logit is ``-inf``) contributes nothing.

    A row in which nothing may be attended to returns zeros, and its gradient is zero: never
    NaN (a NaN logit still propagates). Computed in ``logits.dtype``.
    """
    _checks.check_floating("logits", logits)
    if mask is not None:
        _checks.check_bool("mask", mask)
        _checks.check_broadcast("mask", mask, _checks.shape_of(logits), "logits' shape")
        mask = jnp.broadcast_to(mask, jnp.shape(logits))
    return softmax_parts(logits, mask, axis)[0]


def dropout(x, rate: float, rng) -> Array:
    """Inverted dropout: zero each entry with probability ``rate``, scale the rest by 1/(1-rate).

    A pure function of ``rng``: the same key gives the same mask. ``rate`` must be in [0, 1);
    ``rate == 0`` returns ``x`` unchanged.
    """
    _checks.check_rate("dropout rate", rate)
    if rate == 0.0:
        return x
    if rng is None:
        raise ValueError("dropout with rate > 0 needs a PRNG key (got rng=None)")
    keep = jax.random.bernoulli(rng, 1.0 - rate, jnp.shape(x))
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros_like(x))
