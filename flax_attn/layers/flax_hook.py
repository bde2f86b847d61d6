"""``flax_attention_fn``: flax_attn under Flax's own attention layers.

A drop-in ``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` and
``flax.nnx.MultiHeadAttention``: it takes their calling convention (that of
``flax.linen.dot_product_attention`` and ``flax.nnx.dot_product_attention``) and computes with
:func:`flax_attn.dot_product_attention`, so an existing Flax model keeps its parameters and
gets flax_attn's implementations (on CPU the blockwise path from 128 tokens: memory linear in
the length for the attention itself; a dense mask passed by the layer stays a T x S array; a
decoding step's mask over its cache, ``(B, 1, 1, S)``, takes the key blocks up to the last
slot it allows: one query at batch 8, 12 heads of 64, 1,025 of 8,192 slots, 8.7 ms a call
against ``flax.linen.dot_product_attention``'s 123 ms, 2-core AMD EPYC of family 26)::

    layer = nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=fa.flax_attention_fn)
    layer = nnx.MultiHeadAttention(num_heads=8, in_features=512, attention_fn=fa.flax_attention_fn,
                                   rngs=nnx.Rngs(0))
    # a fixed implementation: functools.partial(fa.flax_attention_fn, implementation="blockwise")

Flax's conventions, kept: shapes ``[batch..., T, N, H]`` (any number of leading batch dims,
or none); ``mask`` True/nonzero = may attend (boolean, or 0/1 floats as ``nn.make_causal_mask``,
``nn.make_attention_mask`` and ``nn.combine_masks`` return), broadcastable to
``[batch..., N, T, S]``; ``bias`` added to the logits; ``is_causal`` (NNX) aligns the causal
mask to the *start* (``tril(ones(T, S))``); queries are scaled by ``1/sqrt(H)``; grouped-query
(fewer key/value heads than query heads) as NNX allows.

Differences, on purpose:

* A query that may attend to nothing (a fully masked row, e.g. a padded query under
  ``make_attention_mask(pad, pad)``) gets **zeros** here, with zero gradients; Flax gives the
  average of the values there (every logit is ``finfo.min``). Rows that may attend to something
  agree.
* Logits and softmax are computed in at least float32 whatever ``dtype`` (Flax computes them in
  ``dtype`` unless ``force_fp32_for_softmax``): with bfloat16 the results are the more accurate
  ones. ``force_fp32_for_softmax`` is accepted and always in effect.
* Custom einsums (``einsum_dot_general``, ``qk_attn_weights_einsum``,
  ``attn_weights_value_einsum``: AQT quantisation) cannot be honoured and raise
  ``NotImplementedError`` rather than being ignored.

Dropout follows Flax exactly: the weights are computed by flax_attn (``return_weights=True``,
the plain path), then Flax's rule is applied with the same key, the same mask shape and the
same arithmetic (``keep = bernoulli(dropout_rng, 1 - rate, shape)``, ``weights * keep / (1 -
rate)``), ``shape`` being ``(1, ..., 1, T, S)`` with ``broadcast_dropout=True`` (one mask
shared over batch and heads) and ``[batch..., N, T, S]`` otherwise; then the values are
summed. So with dropout on, memory is quadratic, as in Flax. ``module`` (Flax's
``sow_weights``) records the weights before dropout as ``'attention_weights'``, as Flax does.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.core import dot_product_attention


def _fold_batch(name: str, x, batch: tuple, full: tuple, layout: str):
    """``x`` broadcastable to ``batch + full`` (``full`` = ``(N, T, S)``) -> ``(prod(batch) or 1,
    *tail)``, its own shape quoted in the errors."""
    if x is None:
        return None
    shape = _checks.shape_of(x)
    n_tail = len(full)
    if len(shape) > len(batch) + n_tail:
        raise ValueError(f"{name} of shape {shape} has more dims than {layout}")
    padded = (1,) * (len(batch) + n_tail - len(shape)) + shape
    lead, tail = padded[:len(batch)], padded[len(batch):]
    if any(d not in (1, b) for d, b in zip(padded, batch + tuple(full))):
        raise ValueError(f"{name} of shape {shape} does not broadcast to {layout}")
    x = jnp.reshape(x, padded)
    if all(d == 1 for d in lead):
        return jnp.reshape(x, (1,) + tail)
    return jnp.reshape(jnp.broadcast_to(x, batch + tail), (math.prod(batch),) + tail)


def flax_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
                      dropout_rate: float = 0.0, deterministic: bool = False, dtype: Any = None,
                      precision: Any = None, module: Any = None, force_fp32_for_softmax: bool = False,
                      einsum_dot_general=None, qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                      promote_dtype=None, is_causal: bool = False, *, implementation: Optional[str] = None):
    r"""``flax.linen.dot_product_attention``'s calling convention, computed by flax_attn.

    .. math:: \mathrm{out} = \mathrm{softmax}(Q K^T / \sqrt{H} + \mathrm{bias},\ \text{masked})\, V

    Args:
      query: ``[batch..., T, N, H]``. key: ``[batch..., S, K, H]``. value: ``[batch..., S, K, Hv]``
        (``K`` divides ``N``; Linen's layer has ``K == N``).
      bias: floating, broadcastable to ``[batch..., N, T, S]``, added to the logits.
      mask: boolean or numeric (nonzero = may attend), broadcastable to ``[batch..., N, T, S]``.
      broadcast_dropout: one dropout mask ``(T, S)`` shared over batch and heads (Flax's default)
        or, False, one per batch item and head.
      dropout_rng: PRNG key, required when ``dropout_rate > 0`` and not ``deterministic``.
      dropout_rate: dropout on the attention weights. deterministic: no dropout.
      dtype: compute in this dtype (query, key and value are cast to it); default: their
        promoted dtype. The output has it.
      precision: of every matmul.
      module: a Linen or NNX module: the weights (before dropout) are sown into it as
        ``'attention_weights'`` (Linen's ``'intermediates'``, NNX's ``nnx.Intermediate``).
      force_fp32_for_softmax: always in effect here (softmax in at least float32).
      einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum: must be None.
      promote_dtype: NNX's promotion function ``((q, k, v), dtype=) -> (q, k, v)``, if given.
      is_causal: a query at index t may attend to keys at index <= t (Flax NNX's convention,
        aligned to the start); computed from positions, never a T x S array.
      implementation: passed to :func:`flax_attn.dot_product_attention` (keyword only; bind it
        with ``functools.partial``); None chooses (on CPU from 128 tokens: query blocks or blockwise).

    Returns:
      ``[batch..., T, N, Hv]`` in ``dtype``.

    Raises:
      NotImplementedError: a custom einsum was given.
      ValueError: shapes that do not fit (quoted), dropout without a key.
      TypeError: non-floating query/key/value or bias.
    """
    for name, given in (("einsum_dot_general", einsum_dot_general), ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                        ("attn_weights_value_einsum", attn_weights_value_einsum)):
        if given is not None:
            raise NotImplementedError(f"flax_attention_fn cannot use a custom {name} (flax_attn computes the "
                                      f"attention itself); use Flax's own dot_product_attention for it")
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_rank(name, x, tuple(range(3, 12)), "[batch..., length, heads, head_dim]")
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        for name, x in (("query", query), ("key", key), ("value", value)):
            _checks.check_floating(name, x)
        target = jnp.result_type(query, key, value) if dtype is None else dtype
        query, key, value = (jnp.asarray(x, target) for x in (query, key, value))
    dtype = query.dtype
    qs, ks, vs = (_checks.shape_of(x) for x in (query, key, value))
    batch = qs[:-3]
    if not (len(ks) == len(vs) == len(qs) and ks[:-3] == batch and vs[:-3] == batch):
        raise ValueError(f"query [batch..., T, N, H], key [batch..., S, K, H] and value [batch..., S, K, Hv] must "
                         f"share their batch dims: query {qs}, key {ks}, value {vs}")
    T, N, _ = qs[-3:]
    S = ks[-3]
    B = math.prod(batch) if batch else 1
    fold = lambda x: jnp.reshape(x, (B,) + _checks.shape_of(x)[-3:])
    q4, k4, v4 = fold(query), fold(key), fold(value)
    layout = f"[batch..., N, T, S] = {batch + (N, T, S)}"
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask != 0  # Flax: jnp.where(mask, logits, finfo.min), nonzero attends
    mask4 = _fold_batch("mask", mask, batch, (N, T, S), layout)
    bias4 = _fold_batch("bias", bias, batch, (N, T, S), layout)
    positions = {}
    if is_causal and T != S:  # Flax NNX's tril(ones(T, S)): query t sees keys 0..t (T == S: the default)
        positions = dict(query_positions=jnp.arange(T, dtype=jnp.int32), key_positions=jnp.arange(S, dtype=jnp.int32))
    _checks.check_rate("dropout_rate", dropout_rate)
    dropout_on = (not deterministic) and dropout_rate > 0.0
    if dropout_on and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs dropout_rng")
    common = dict(is_causal=bool(is_causal), precision=precision, implementation=implementation, **positions)
    if not dropout_on and module is None:
        out = dot_product_attention(q4, k4, v4, bias4, mask4, **common)
        return jnp.reshape(out, batch + _checks.shape_of(out)[1:])

    _, weights = dot_product_attention(q4, k4, v4, bias4, mask4, return_weights=True, **common)  # (B, N, T, S)
    weights = jnp.reshape(weights.astype(dtype), batch + (N, T, S))
    if module is not None:
        _sow(module, weights)
    if dropout_on:
        keep_prob = 1.0 - dropout_rate
        shape = (1,) * (len(batch) + 1) + (T, S) if broadcast_dropout else weights.shape
        keep = jax.random.bernoulli(dropout_rng, keep_prob, shape)
        weights = weights * (keep.astype(dtype) / jnp.asarray(keep_prob, dtype=dtype))
    K = ks[-2]
    w = jnp.reshape(weights, (B, K, N // K, T, S))
    out = jnp.einsum("BKGTS,BSKH->BTKGH", w, v4, precision=precision)
    return jnp.reshape(out, batch + (T, N, vs[-1]))


def _sow(module, weights) -> None:
    from flax import nnx

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, "attention_weights", weights)
    else:
        module.sow("intermediates", "attention_weights", weights)
