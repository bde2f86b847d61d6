"""The Transformer notes: ``scaled_dot_product_attention``, ``create_causal_mask`` and
``MultiHeadAttention(d_model, num_heads)``.

The notes' multi-head attention is named :class:`TransformerMultiHeadAttention` in flax_attn to
keep it apart from the chapter's GPT-style :class:`flax_attn.MultiHeadAttention`. It differs from
that one in three ways:
biased ``W_q, W_k, W_v, W_o`` projections of size ``d_model``; separate ``Q, K, V`` inputs
(so ``K, V`` may come from another sequence, of another length: cross-attention); no built-in
causal mask, an optional ``mask`` instead; and it returns the attention weights too.

Its computation is the pure stage :func:`transformer_multi_head_attention` (parameter specs
:func:`transformer_multi_head_attention_params`), shared with the NNX twin
:class:`flax_attn.nnx.TransformerMultiHeadAttention`.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.core import dot_product_attention
from flax_attn.layers.common import check_floating, declare, declared, dense, linear_params

PrecisionLike = Any


def create_causal_mask(seq_len: int) -> jnp.ndarray:
    """Lower-triangular ``(seq_len, seq_len)`` boolean mask: query t may attend to keys 0..t.

    The JAX counterpart of the Transformer notes' ``create_causal_mask``, which returns
    ``torch.tril(torch.ones(seq_len, seq_len))`` as floats (1 = attend). Here the mask is
    boolean with the same meaning, as every flax_attn mask is.
    """
    _checks.check_positive_int("seq_len", seq_len)
    return jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))


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


def transformer_multi_head_attention_params(d_model: int, num_heads: int) -> dict:
    """Specs: ``W_q``, ``W_k``, ``W_v``, ``W_o``, each a biased linear ``d_model -> d_model``."""
    _checks.check_positive_int("d_model", d_model)
    _checks.check_positive_int("num_heads", num_heads)
    _checks.check_divides("d_model", d_model, "num_heads", num_heads)
    return {name: linear_params(d_model, d_model) for name in ("W_q", "W_k", "W_v", "W_o")}


def transformer_multi_head_attention(d_model: int, num_heads: int, params, Q, K, V, mask=None, *,
                                     precision: PrecisionLike = None):
    """The notes' multi-head attention as a pure function of ``params``
    (:func:`transformer_multi_head_attention_params`).

    Args:
      Q: floating ``(B, T, d_model)``; K, V: floating ``(B, S, d_model)``.
      mask: boolean, True = may attend, broadcastable to ``(B, N, T, S)``.

    Returns:
      ``(output, weights)``: ``(B, T, d_model)`` and ``(B, N, T, S)``.
    """
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        _checks.check_rank(name, x, 3, "(batch, seq_len, d_model)")
        check_floating("TransformerMultiHeadAttention", name, x)
        if x.shape[-1] != d_model:
            raise ValueError(f"{name} has shape {x.shape}: its last dim must be d_model={d_model}")
    if K.shape != V.shape or K.shape[0] != Q.shape[0]:
        raise ValueError(f"K and V must have one shape and Q the same batch: Q {Q.shape}, K {K.shape}, V {V.shape}")
    h = d_model // num_heads
    split = lambda y: y.reshape(y.shape[0], y.shape[1], num_heads, h)
    out, weights = dot_product_attention(
        split(dense(params["W_q"], Q, precision)), split(dense(params["W_k"], K, precision)),
        split(dense(params["W_v"], V, precision)), mask=mask, return_weights=True, precision=precision,
    )
    return dense(params["W_o"], out.reshape(Q.shape[0], Q.shape[1], d_model), precision), weights


class TransformerMultiHeadAttention(nn.Module):
    r"""Multi-head attention from "Attention Is All You Need" (Vaswani et al., 2017, 3.2.2).

    .. math::  \mathrm{head}_i = \mathrm{softmax}(Q W^q_i (K W^k_i)^T / \sqrt{d_k}) V W^v_i,
               \quad \mathrm{out} = \mathrm{concat}(\mathrm{head}_i) W^o

    with ``d_k = d_model / num_heads`` (our H).

    Args (fields):
      d_model: model size D. num_heads: N, must divide ``d_model``.

    Call:
      Q: floating ``(B, T, d_model)``; K, V: floating ``(B, S, d_model)``.
      mask: boolean, True = may attend, broadcastable to ``(B, N, T, S)`` (e.g.
        ``create_causal_mask(T)`` for ``(T, T)``). The original takes 0/1 floats and blocks
        with ``-1e9`` where ``mask == 0``: a fully blocked row is a uniform average there and
        zeros here.

    Returns:
      ``(output, weights)``: ``(B, T, d_model)`` and ``(B, N, T, S)``.
    """

    d_model: int
    num_heads: int
    param_dtype: Any = jnp.float32
    precision: Any = None

    def setup(self):
        declare(self, transformer_multi_head_attention_params(self.d_model, self.num_heads), self.param_dtype)

    def __call__(self, Q, K, V, mask=None):
        params = declared(self, transformer_multi_head_attention_params(self.d_model, self.num_heads))
        return transformer_multi_head_attention(self.d_model, self.num_heads, params, Q, K, V, mask,
                                                precision=self.precision)
