"""The attention function under every flax_attn module.

    out = softmax(score_mod(scale * Q K^T [soft-capped] + bias), masked [, sinks]) V

:func:`dot_product_attention` validates its arguments into one description of the call
(:mod:`flax_attn.core.call`, with the mask description of :mod:`flax_attn.core.mask`), chooses
an implementation from the registry (:mod:`flax_attn.core.registry`) and runs it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flax_attn import _checks
from flax_attn.core import numerics, registry, tuning
from flax_attn.core.call import describe
from flax_attn.core.mask import Mask

PrecisionLike = Any


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask: Union[None, Any, Mask] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    query_positions=None,
    key_positions=None,
    query_segment_ids=None,
    key_segment_ids=None,
    logit_softcap: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng=None,
    deterministic: bool = False,
    return_weights: bool = False,
    return_residual: bool = False,
    precision: PrecisionLike = None,
    implementation: Union[None, str, registry.Implementation] = None,
    score_mod: Optional[Callable[..., Any]] = None,
    sinks=None,
):
    r"""Scaled dot-product attention for every head:

    .. math::  \mathrm{out} = \mathrm{softmax}(f(s \cdot QK^T \text{ [soft-capped]} + \mathrm{bias})
               \text{ [masked, sinks]})\, V,\qquad s = 1/\sqrt{H} \text{ unless given,}

    with ``f`` the ``score_mod`` (identity unless given).

    Args:
      query: ``(B, T, N, H)`` or unbatched ``(T, N, H)``.
      key: ``(B, S, K, H)`` or ``(S, K, H)``. ``K`` must divide ``N``: ``K == N`` is multi-head
        attention, ``1 < K < N`` grouped-query, ``K == 1`` multi-query; one code path.
      value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``; ``Hv`` may differ from ``H``.
      bias: additive, floating, broadcastable to ``(B, N, T, S)`` (ALiBi, T5 relative bias).
      mask: boolean, True = may attend, broadcastable to ``(B, N, T, S)``; or a mask
        description from :mod:`flax_attn.core.mask` (``causal() & segments(q, k) & ...``),
        combined with the keyword rules below.
      scale: multiplies the logits; default ``1/sqrt(H)``.
      is_causal: a query may attend to keys at its own position or earlier.
      query_seq_lengths: ``(B,)`` int in ``[0, T]``; queries at index >= length attend to nothing
        (zeros out).
      key_value_seq_lengths: ``(B,)`` int in ``[0, S]``; keys at index >= length are blocked.
        Lengths readable at the call (NumPy, or JAX arrays on CPU) outside their range raise
        ``ValueError``; traced ones are not checked.
      local_window_size: ``w`` or ``(left, right)``: a query at position p may attend to keys
        at positions ``p - left .. p + right`` (``left + 1 + right`` keys, the
        ``jax.nn.dot_product_attention`` convention; ``w`` means ``(w, w)``). A causal sliding
        window of W keys including the current one (Mistral) is ``(W - 1, 0)`` with
        ``is_causal=True``.
      query_positions, key_positions: ``(T,)``/``(B, T)`` and ``(S,)``/``(B, S)`` int positions
        used by ``is_causal`` and ``local_window_size``. Default: keys at ``0..S-1`` and queries
        at the *last* T of them (query t at ``t + S - T``), as when decoding with a cache.
      query_segment_ids, key_segment_ids: int ids of packed sequences, shapes as positions;
        attention never crosses segments; a negative id is padding. Give both or neither.
      logit_softcap: ``c``: logits become ``c * tanh(logits / c)`` before bias and mask.
      dropout_rate: dropout on the attention weights (inverted scaling), in [0, 1).
      dropout_rng: PRNG key; required when ``dropout_rate > 0`` and not ``deterministic``.
      deterministic: disable dropout.
      return_weights: also return the attention weights ``(B, N, T, S)`` (after dropout).
      return_residual: also return the log-sum-exp of the logits over the allowed keys,
        ``(B, T, N)`` in float32 (or wider), as ``jax.nn.dot_product_attention`` does; ``-inf``
        for a query that attends to nothing.
      precision: passed to every matmul (``jax.lax.Precision`` or a string like 'highest').
      implementation: a registered name (``'xla'``, ``'blockwise'``, ``'cudnn'``, ...), an
        implementation object (``flax_attn.core.Blockwise(block_q=256)``), or ``None`` for the
        fastest registered one that serves the call on this platform (with positions given
        as arrays, possibly two, one chosen at run time by the positions: see
        :func:`shifted_default_positions`). Naming one that cannot serve the call raises
        ``ValueError`` saying why.
      score_mod: ``score_mod(score, b, n, q_idx, k_idx) -> score``, PyTorch FlexAttention's
        score modification: applied to every logit after scale, soft-cap and bias and before
        the mask (a masked pair stays masked, whatever its score). Written for scalars and
        evaluated elementwise, block by block: ``score`` in the accumulation dtype, ``b`` the
        batch row, ``n`` the query head, ``q_idx``/``k_idx`` the positions the mask uses
        (``query_positions``/``key_positions`` when given), all int32; only positions that
        exist are passed (padded blocks repeat the last). Gradients reach the arrays it closes
        over (e.g. a learned bias table); like PyTorch's, they need the rule finite at masked
        pairs too (a NaN there gives NaN gradients through the mask). User mask rules go in ``mask``:
        ``flax_attn.core.mask.mask_mod(fn) & causal()``.
      sinks: ``(N,)`` floating, attention sinks (gpt-oss): a learned logit per query head that
        joins the softmax denominator of every query and carries no value. The returned
        log-sum-exp then includes it (a query that attends to nothing returns zeros and the
        sink as its lse). Applied from the log-sum-exp, so every implementation that returns
        it serves sinks.

    Returns:
      ``out`` ``(B, T, N, Hv)`` (``(T, N, Hv)`` if unbatched) in ``query.dtype``; with
      ``return_weights`` and/or ``return_residual``, a tuple ``(out, weights, lse)`` of those
      asked for, in that order.

    Notes:
      A query row that may attend to nothing returns zeros with zero gradients, never NaN
      (``jax.nn.dot_product_attention`` returns the average of the values there instead).
      Keys and queries blocked outright (by lengths, negative segment ids or an all-False
      column/row of ``mask``) never contaminate the result, even if they hold NaN or Inf.
      Logits and softmax are computed in at least float32, whatever the input dtype.
      With ``T != S`` the causal mask is aligned to the end of the keys (see
      ``query_positions``); ``jax.nn.dot_product_attention`` aligns it to the start.
      Empty inputs (``B == 0``, ``T == 0`` or ``S == 0``) give an empty output or zeros.
    """
    _checks.check_rank("query", query, (3, 4), "BTNH or TNH")
    query, key, value = (x if isinstance(x, jax.Array) else jnp.asarray(x) for x in (query, key, value))  # JAX's dtypes
    unbatched = np.ndim(query) == 3
    if unbatched:
        _checks.check_rank("key", key, 3, "SKH")
        _checks.check_rank("value", value, 3, "SKH")
        query, key, value = query[None], key[None], value[None]
    call = describe(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                    query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
                    local_window_size=local_window_size, query_positions=query_positions,
                    key_positions=key_positions, query_segment_ids=query_segment_ids,
                    key_segment_ids=key_segment_ids, logit_softcap=logit_softcap, dropout_rate=dropout_rate,
                    dropout_rng=dropout_rng, deterministic=deterministic, return_weights=return_weights,
                    return_residual=return_residual, precision=precision, score_mod=score_mod, sinks=sinks)
    impl = registry.resolve(implementation, call)
    if call.B == 0 or call.T == 0 or call.S == 0:
        result = _empty(call)
    else:
        result = _run(impl, implementation is None, call, query, key, value, dropout_rng)
    if call.sinks is not None:
        out, lse, weights = numerics.apply_sinks(call.sinks, result.out, result.lse, result.weights)
        result = registry.Result(out=out, lse=lse, weights=weights)
    outputs = [result.out] + [x for x, asked in ((result.weights, return_weights), (result.lse, return_residual))
                              if asked]
    if unbatched:
        outputs = [x[0] for x in outputs]
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _run(impl, automatic: bool, call, query, key, value, dropout_rng) -> registry.Result:
    """``impl`` on the call; for the automatic choice, when positions are given as arrays and
    the same call over default positions would choose another implementation (query blocks on
    CPU, which find each block's keys at trace time), that one wherever the positions are the
    default ones shifted (:func:`shifted_default_positions`), chosen at run time."""
    run = lambda impl, call: impl(call, *_drop_invisible(call, query, key, value, impl.zeroes_blocked_keys),  # noqa: E731
                                  dropout_rng)
    m = call.mask
    if (not automatic or (m.q_positions is None and m.k_positions is None) or not (m.uses_positions or m.chunk)
            or m.mask_mods or m.score_mod is not None  # a user's rule may read the positions themselves
            or tuning.keys_stored_as() is not None):
        # Over a KV cache (a layer declares its layout) the slots not yet written hold position
        # 0, so only a full cache could take the other branch, and the conditional would cost
        # every step a copy of the cache (a transposed one for 'BKSH': a decoding step of batch
        # 8 over 1,024 tokens, 768 wide, took 78 ms against 13 ms without it on a 2-core Intel
        # Xeon of family 6, model 207).
        return run(impl, call)
    by_index = dataclasses.replace(call, mask=dataclasses.replace(m, q_positions=None, k_positions=None))
    fast = registry.choose(by_index)
    if fast == impl:
        return run(impl, call)
    fields = lambda r: (r.out, r.lse, r.weights)  # noqa: E731
    out, lse, weights = lax.cond(shifted_default_positions(m, call.T, call.S),
                                 lambda: fields(run(fast, by_index)), lambda: fields(run(impl, call)))
    return registry.Result(out=out, lse=lse, weights=weights)


def shifted_default_positions(mask: Mask, T: int, S: int):
    """Whether ``mask``'s rules over its positions are its rules over the default ones (keys at
    ``0..S-1``, queries at the last T of them): True (a boolean scalar) when in every row the
    positions are the default ones plus one offset for queries and keys alike (a multiple of
    ``mask.chunk`` with a chunk rule); a missing side counts as default."""
    offset = lambda p, n, first: None if p is None else p - (first + jnp.arange(n, dtype=p.dtype))  # noqa: E731
    q, k = offset(mask.q_positions, T, S - T), offset(mask.k_positions, S, 0)
    zero = jnp.zeros((1, 1), jnp.int32)
    q, k = (zero if q is None else q), (zero if k is None else k)
    same = jnp.all(q == q[:, :1]) & jnp.all(k == k[:, :1]) & jnp.all(q[:, :1] == k[:, :1])
    if mask.chunk is not None:
        same = same & jnp.all(k[:, :1] % mask.chunk == 0)
    return same


def _drop_invisible(call, query, key, value, keys_zeroed_by_impl: bool = False):
    """Zero the keys, values and queries that no pair may use, so that garbage there (NaN, Inf
    in padding) cannot leak through ``0 * NaN``; their gradients are zero. Keys and values are
    left to an implementation that zeroes what it reads itself (``keys_zeroed_by_impl``,
    :attr:`flax_attn.core.registry.Implementation.zeroes_blocked_keys`)."""
    keys, queries = call.mask.key_visible(), call.mask.query_visible()
    if keys is not None and not keys_zeroed_by_impl:
        keep = keys[:, :, None, None]
        key, value = jnp.where(keep, key, 0), jnp.where(keep, value, 0)
    if queries is not None:
        query = jnp.where(queries[:, :, None, None], query, 0)
    return query, key, value


def _empty(call) -> registry.Result:
    """B == 0, T == 0 or S == 0: nothing to attend to; every output is empty or zero."""
    B, T, N, S = call.B, call.T, call.N, call.S
    return registry.Result(out=jnp.zeros((B, T, N, call.Hv), call.dtype),
                           lse=jnp.full((B, T, N), -jnp.inf, call.acc_dtype),
                           weights=jnp.zeros((B, N, T, S), call.dtype))
