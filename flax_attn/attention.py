"""The attention function under every flax_attn module.

    out = softmax(scale * Q K^T + bias, masked) V

One function, :func:`dot_product_attention`, computes it for every variant: multi-head,
grouped-query and multi-query (K key/value heads shared by N query heads), causal,
sliding-window, padded, packed, cross-attention and cached decoding. It follows the
calling convention of ``jax.nn.dot_product_attention`` and adds what that one lacks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn import masks as masks_lib
from flax_attn.blockwise import blockwise_attention

Array = Any
PrecisionLike = Any

IMPLEMENTATIONS = ("xla", "blockwise", "cudnn")
# On CPU the blockwise path is chosen once both lengths reach this. Measured on a 2-core AVX-512
# CPU, causal, 64-dim heads, forward / forward+backward speed-up of blockwise over the plain path:
# 8192 tokens in 8 x 12 heads: 0.71x / 0.77x at 32 tokens a sequence, 1.23x / 1.06x at 64,
# 1.97x / 1.44x at 128; one sequence of 8 heads (under half a millisecond either way): 0.78x /
# 0.90x at 64, 0.83x / 1.07x at 128. 128 is where blockwise wins or nearly ties in every case.
BLOCKWISE_MIN_LENGTH = 128


def masked_softmax(logits, mask=None, axis: int = -1):
    """Softmax over ``axis`` where ``mask`` is False (or the logit is ``-inf``) contributes nothing.

    A row in which nothing may be attended to returns zeros, and its gradient is zero: never
    NaN (a NaN logit still propagates). Computed in ``logits.dtype``.
    """
    _checks.check_floating("logits", logits)
    allowed = logits != -jnp.inf
    if mask is not None:
        _checks.check_bool("mask", mask)
        _checks.check_broadcast("mask", mask, _checks.shape_of(logits), "logits' shape")
        allowed = allowed & mask
    # Blocked entries get the most negative finite value: exp underflows to 0 beside any allowed
    # entry, and a row with none gives a finite uniform row, multiplied by 0 below.
    weights = jax.nn.softmax(jnp.where(allowed, logits, jnp.finfo(logits.dtype).min), axis=axis)
    return weights * jnp.any(allowed, axis=axis, keepdims=True).astype(weights.dtype)


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


def _check_positions(name: str, positions, batch: int, length: int):
    if positions is None:
        return None
    _checks.check_integer(name, positions)
    shape = _checks.shape_of(positions)
    if shape not in ((length,), (batch, length), (1, length)):
        raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {shape}")
    return jnp.asarray(positions, jnp.int32)


def _check_lengths(name: str, lengths, batch: int):
    if lengths is None:
        return None
    _checks.check_integer(name, lengths)
    if _checks.shape_of(lengths) != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {_checks.shape_of(lengths)}")
    return jnp.asarray(lengths, jnp.int32)


def _grouped(x, num_kv_heads: int, group: int):
    """(b, n, T, S) with n in {1, N} -> (b, K|1, G|1, T, S) to match grouped logits."""
    b, n, t, s = x.shape
    if n == 1:
        return x[:, :, None]
    return x.reshape(b, num_kv_heads, group, t, s)


@dataclasses.dataclass(frozen=True)
class _Request:
    """What a call asks for: enough to decide which implementations can serve it."""

    dtype: Any
    T: int
    S: int
    H: int
    Hv: int
    dropout: bool
    weights: bool
    softcap: bool
    mask: bool
    positions: bool
    segments: bool
    lengths: bool
    window: bool
    causal: bool


def unsupported(implementation: str, r: _Request) -> Optional[str]:
    """Why ``implementation`` cannot serve request ``r``, or None if it can."""
    if implementation == "xla":
        return None
    if r.dropout:
        return "dropout (use implementation='xla' or None)"
    if r.weights:
        return "return_weights (use implementation='xla' or None)"
    if implementation == "blockwise":
        return None
    # cudnn, through jax.nn.dot_product_attention
    if jax.default_backend() != "gpu":
        return f"the '{jax.default_backend()}' backend (cuDNN needs an NVIDIA GPU)"
    if np.dtype(r.dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return f"dtype {np.dtype(r.dtype)} (cuDNN takes bfloat16 or float16)"
    if r.H != r.Hv or r.H % 8 or r.H > 128:
        return f"head dims H={r.H}, Hv={r.Hv} (cuDNN needs H == Hv, a multiple of 8, at most 128)"
    for flag, what in ((r.softcap, "logit_softcap"), (r.mask, "a boolean mask"), (r.positions, "explicit positions"),
                       (r.segments, "segment ids"), (r.lengths, "sequence lengths"), (r.window, "local_window_size")):
        if flag:
            return what
    if r.causal and r.T != r.S:
        return f"causal attention with T={r.T} != S={r.S} (cuDNN aligns the mask differently)"
    return None


def choose_implementation(r: _Request) -> str:
    """The fastest implementation that serves ``r`` on this platform.

    cuDNN on NVIDIA GPUs where it applies; on CPU the blockwise path once both lengths reach
    ``BLOCKWISE_MIN_LENGTH`` (the measured crossover); the plain XLA path otherwise (it serves
    every request). On GPUs without cuDNN's support the plain path is chosen: the blockwise
    path is tuned for CPUs (one head at a time), though it runs anywhere.
    """
    if jax.default_backend() == "gpu" and unsupported("cudnn", r) is None:
        return "cudnn"
    if jax.default_backend() == "cpu" and unsupported("blockwise", r) is None and min(r.T, r.S) >= BLOCKWISE_MIN_LENGTH:
        return "blockwise"
    return "xla"


def _attention_xla(query, key, value, bias, mask, *, scale, logit_softcap, dropout_rate,
                   dropout_rng, precision, return_weights):
    """Reference path: materialises the (B, N, T, S) logits. Inputs already validated, 4-D.

    Grouped-query attention without repeating keys: the G query heads of each key/value head
    are folded into its query axis, ``BKRH,BSKH->BKRS`` with R = G*T (MHA: G = 1, MQA: K = 1).
    """
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    acc = jnp.promote_types(query.dtype, jnp.float32)
    q = query.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
    logits = jnp.einsum("BKRH,BSKH->BKRS", q, key, precision=precision, preferred_element_type=acc)
    logits = logits.reshape(B, K, G, T, S) * jnp.asarray(scale, acc)
    if logit_softcap is not None:
        cap = jnp.asarray(logit_softcap, acc)
        logits = cap * jnp.tanh(logits / cap)
    if bias is not None:
        logits = logits + _grouped(bias, K, G).astype(acc)
    weights = masked_softmax(logits, None if mask is None else _grouped(mask, K, G))
    if dropout_rate > 0.0:
        weights = dropout(weights, dropout_rate, dropout_rng)
    out = jnp.einsum("BKRS,BSKH->BKRH", weights.astype(value.dtype).reshape(B, K, G * T, S), value,
                     precision=precision, preferred_element_type=acc)
    out = out.reshape(B, K, G, T, -1).transpose(0, 3, 1, 2, 4).reshape(B, T, N, value.shape[-1])
    out = out.astype(query.dtype)
    if return_weights:
        return out, weights.reshape(B, N, T, S).astype(query.dtype)
    return out


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
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
    precision: PrecisionLike = None,
    implementation: Optional[str] = None,
):
    r"""Scaled dot-product attention for every head:

    .. math::  \mathrm{out} = \mathrm{softmax}(s \cdot QK^T \text{ [soft-capped]} + \mathrm{bias}
               \text{ [masked]})\, V,\qquad s = 1/\sqrt{H} \text{ unless given.}

    Args:
      query: ``(B, T, N, H)`` or unbatched ``(T, N, H)``.
      key: ``(B, S, K, H)`` or ``(S, K, H)``. ``K`` must divide ``N``: ``K == N`` is multi-head
        attention, ``1 < K < N`` grouped-query, ``K == 1`` multi-query; one code path.
      value: ``(B, S, K, Hv)`` or ``(S, K, Hv)``; ``Hv`` may differ from ``H``.
      bias: additive, floating, broadcastable to ``(B, N, T, S)`` (ALiBi, T5 relative bias).
      mask: boolean, True = may attend, broadcastable to ``(B, N, T, S)``.
      scale: multiplies the logits; default ``1/sqrt(H)``.
      is_causal: a query may attend to keys at its own position or earlier.
      query_seq_lengths: ``(B,)`` int; queries at index >= length attend to nothing (zeros out).
      key_value_seq_lengths: ``(B,)`` int; keys at index >= length are blocked.
      local_window_size: ``w`` or ``(left, right)``: a query at position p may attend to keys
        at positions ``p - left .. p + right`` (``left + 1 + right`` keys, the
        ``jax.nn.dot_product_attention`` convention; ``w`` means ``(w, w)``). A causal sliding
        window of W keys including the current one (Mistral) is ``(W - 1, 0)`` with
        ``is_causal=True``.
      query_positions, key_positions: ``(T,)``/``(B, T)`` and ``(S,)``/``(B, S)`` int positions
        used by ``is_causal`` and ``local_window_size``. Default: keys at ``0..S-1`` and queries
        at the *last* T of them (query t at ``t + S - T``), as when decoding with a cache.
      query_segment_ids, key_segment_ids: int ids of packed sequences, shapes as positions;
        attention never crosses segments. Give both or neither.
      logit_softcap: ``c``: logits become ``c * tanh(logits / c)`` before bias and mask.
      dropout_rate: dropout on the attention weights (inverted scaling), in [0, 1).
      dropout_rng: PRNG key; required when ``dropout_rate > 0`` and not ``deterministic``.
      deterministic: disable dropout.
      return_weights: also return the attention weights ``(B, N, T, S)`` (after dropout).
      precision: passed to both matmuls (``jax.lax.Precision`` or a string like 'highest').
      implementation: ``'xla'``: the plain path, materialises the ``(B, N, T, S)`` logits, serves
        everything. ``'blockwise'``: flash-style, memory linear in the length, skips blocks a
        causal or window mask removes (no dropout, no weights). ``'cudnn'``: cuDNN flash
        attention through ``jax.nn.dot_product_attention`` on NVIDIA GPUs (bfloat16/float16,
        H a multiple of 8 up to 128, causal or no mask, bias allowed). ``None``: the fastest
        one that serves the request on this platform (see :func:`choose_implementation`).
        Naming one that cannot serve the request raises ``ValueError`` saying why.

    Returns:
      ``(B, T, N, Hv)`` (``(T, N, Hv)`` if unbatched) in ``query.dtype``; with
      ``return_weights``, ``(out, weights)``.

    Notes:
      A query row that may attend to nothing returns zeros with zero gradients, never NaN
      (``jax.nn.dot_product_attention`` returns the average of the values there instead).
      Logits and softmax are computed in at least float32, whatever the input dtype.
      With ``T != S`` the causal mask is aligned to the end of the keys (see
      ``query_positions``); ``jax.nn.dot_product_attention`` aligns it to the start.
    """
    _checks.check_rank("query", query, (3, 4), "BTNH or TNH")
    unbatched = np.ndim(query) == 3
    _checks.check_rank("key", key, np.ndim(query), "BSKH" if not unbatched else "SKH")
    _checks.check_rank("value", value, np.ndim(query), "BSKH" if not unbatched else "SKH")
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_floating(name, x)
    dtypes = {name: _checks.dtype_of(x) for name, x in (("query", query), ("key", key), ("value", value))}
    if len(set(dtypes.values())) > 1:
        raise TypeError("query, key and value must have one dtype, got "
                        + ", ".join(f"{n} {d}" for n, d in dtypes.items()))
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    B, T, N, H = _checks.shape_of(query)
    kB, S, K, kH = _checks.shape_of(key)
    if kB != B or _checks.shape_of(value)[:3] != (B, S, K):
        raise ValueError(
            f"query, key and value must agree on batch, and key and value on length and heads: "
            f"query {_checks.shape_of(query)}, key {_checks.shape_of(key)}, value {_checks.shape_of(value)}"
        )
    if kH != H:
        raise ValueError(f"query and key head dims differ: query {(B, T, N, H)}, key {(kB, S, K, kH)}")
    _checks.check_divides("number of query heads N", N, "number of key/value heads K", K)
    target = (B, N, T, S)
    if bias is not None:
        _checks.check_floating("bias", bias)
        bias = jnp.asarray(bias).reshape(_checks.check_broadcast("bias", bias, target, "(B, N, T, S)"))
    if mask is not None:
        _checks.check_bool("mask", mask)
        mask = jnp.asarray(mask).reshape(_checks.check_broadcast("mask", mask, target, "(B, N, T, S)"))
    query_seq_lengths = _check_lengths("query_seq_lengths", query_seq_lengths, B)
    key_value_seq_lengths = _check_lengths("key_value_seq_lengths", key_value_seq_lengths, B)
    window = masks_lib.normalize_window(local_window_size)
    query_positions = _check_positions("query_positions", query_positions, B, T)
    key_positions = _check_positions("key_positions", key_positions, B, S)
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("query_segment_ids and key_segment_ids must be given together")
    query_segment_ids = _check_positions("query_segment_ids", query_segment_ids, B, T)
    key_segment_ids = _check_positions("key_segment_ids", key_segment_ids, B, S)
    if scale is None:
        scale = 1.0 / math.sqrt(H)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python number, got {scale!r}")
    if logit_softcap is not None and not (isinstance(logit_softcap, (int, float)) and logit_softcap > 0):
        raise ValueError(f"logit_softcap must be a positive number, got {logit_softcap!r}")
    _checks.check_rate("dropout_rate", dropout_rate)
    if deterministic:
        dropout_rate = 0.0
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng (or deterministic=True)")
    if implementation is not None:
        _checks.check_one_of("implementation", implementation, IMPLEMENTATIONS)
    request = _Request(
        dtype=_checks.dtype_of(query), T=T, S=S, H=H, Hv=_checks.shape_of(value)[-1],
        dropout=dropout_rate > 0.0, weights=return_weights, softcap=logit_softcap is not None,
        mask=mask is not None, positions=query_positions is not None or key_positions is not None,
        segments=query_segment_ids is not None, lengths=query_seq_lengths is not None or key_value_seq_lengths is not None,
        window=window is not None, causal=is_causal,
    )
    if implementation is None:
        implementation = choose_implementation(request)
    else:
        problem = unsupported(implementation, request)
        if problem:
            raise ValueError(f"implementation='{implementation}' does not support {problem}")

    if implementation == "blockwise":
        out = blockwise_attention(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, window=window,
            query_positions=None if query_positions is None else query_positions.reshape(-1, T),
            key_positions=None if key_positions is None else key_positions.reshape(-1, S),
            query_segment_ids=None if query_segment_ids is None else query_segment_ids.reshape(-1, T),
            key_segment_ids=None if key_segment_ids is None else key_segment_ids.reshape(-1, S),
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            logit_softcap=logit_softcap, precision=precision,
        )
        return out[0] if unbatched else out
    if implementation == "cudnn":
        out = jax.nn.dot_product_attention(query, key, value, bias, is_causal=is_causal, scale=scale,
                                           implementation="cudnn")
        return out[0] if unbatched else out

    default_q, default_k = masks_lib.default_positions(T, S)
    q_pos = default_q if query_positions is None else query_positions
    k_pos = default_k if key_positions is None else key_positions
    structural = masks_lib.combine_masks(
        masks_lib.causal_mask(q_pos, k_pos) if is_causal else None,
        masks_lib.window_mask(q_pos, k_pos, window) if window is not None else None,
        masks_lib.length_mask(T, S, query_seq_lengths, key_value_seq_lengths),
        None if query_segment_ids is None else masks_lib.segment_mask(query_segment_ids, key_segment_ids),
    )
    if structural is not None:
        structural = structural.reshape((-1, 1, T, S))  # (B|1, 1, T, S): the same for all heads
    full_mask = masks_lib.combine_masks(mask, structural)

    result = _attention_xla(
        query, key, value, bias, full_mask, scale=scale, logit_softcap=logit_softcap,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, precision=precision,
        return_weights=return_weights,
    )
    if unbatched:
        return (result[0][0], result[1][0]) if return_weights else result[0]
    return result


def scaled_dot_product_attention(Q, K, V, mask=None, *, precision: PrecisionLike = None):
    r"""The Transformer notes' function: ``softmax(Q K^T / sqrt(d_k)) V`` over the last two axes.

    Args:
      Q: ``(..., T, d_k)``.
      K: ``(..., S, d_k)``, the same leading dimensions as ``Q``.
      V: ``(..., S, d_v)``.
      mask: boolean, True = may attend, broadcastable to ``(..., T, S)``.

    Returns:
      ``(output, weights)``: ``(..., T, d_v)`` and ``(..., T, S)``.

    The original blocks with ``-1e9`` where ``mask == 0``, so a fully blocked row gets the
    uniform average of the values; here it gets zeros (see ``dot_product_attention``).
    Its mask is 0/1 floats; pass ``mask.astype(bool)``.
    """
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        _checks.check_rank(name, x, tuple(range(2, 9)), "(..., length, dim)")
        _checks.check_floating(name, x)
    lead, (T, dk) = _checks.shape_of(Q)[:-2], _checks.shape_of(Q)[-2:]
    S = _checks.shape_of(K)[-2]
    if (_checks.shape_of(K)[:-2] != lead or _checks.shape_of(V)[:-2] != lead
            or _checks.shape_of(K)[-1] != dk or _checks.shape_of(V)[-2] != S):
        raise ValueError(
            f"Q (..., T, d_k), K (..., S, d_k) and V (..., S, d_v) must share leading dims, d_k and S: "
            f"got Q {_checks.shape_of(Q)}, K {_checks.shape_of(K)}, V {_checks.shape_of(V)}"
        )
    if mask is not None:
        _checks.check_bool("mask", mask)
        _checks.check_broadcast("mask", mask, lead + (T, S), "(..., T, S)")
        mask = jnp.broadcast_to(mask, lead + (T, S)).reshape(-1, 1, T, S)
    flat = lambda x: jnp.reshape(x, (-1,) + _checks.shape_of(x)[-2:])[:, :, None, :]
    out, weights = dot_product_attention(
        flat(Q), flat(K), flat(V), mask=mask, return_weights=True, precision=precision
    )
    return out[:, :, 0, :].reshape(lead + (T, -1)), weights[:, 0].reshape(lead + (T, S))
