"""The Transformer notes' multi-head attention: ``MultiHeadAttention(d_model, num_heads)``.

Named :class:`TransformerMultiHeadAttention` in flax_attn to keep it apart from the chapter's
GPT-style :class:`flax_attn.MultiHeadAttention`. It differs from that one in three ways:
biased ``W_q, W_k, W_v, W_o`` projections of size ``d_model``; separate ``Q, K, V`` inputs
(so ``K, V`` may come from another sequence, of another length: cross-attention); no built-in
causal mask, an optional ``mask`` instead; and it returns the attention weights too.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn._layers import linear
from flax_attn.attention import dot_product_attention
from flax_attn.interop import TorchConvertible


class TransformerMultiHeadAttention(nn.Module, TorchConvertible):
    r"""Multi-head attention from "Attention Is All You Need" (Vaswani et al., 2017, 3.2.2).

    .. math::  \mathrm{head}_i = \mathrm{softmax}(Q W^q_i (K W^k_i)^T / \sqrt{d_k}) V W^v_i,
               \quad \mathrm{out} = \mathrm{concat}(\mathrm{head}_i) W^o

    with ``d_k = d_model / num_heads`` (our H).

    Args (fields):
      d_model: model size D. num_heads: N, must divide ``d_model``.

    Call:
      Q: ``(B, T, d_model)``; K, V: ``(B, S, d_model)``.
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
        _checks.check_positive_int("d_model", self.d_model)
        _checks.check_positive_int("num_heads", self.num_heads)
        _checks.check_divides("d_model", self.d_model, "num_heads", self.num_heads)
        make = lambda: linear(self.d_model, self.d_model, param_dtype=self.param_dtype,
                              precision=self.precision)
        self.W_q, self.W_k, self.W_v, self.W_o = make(), make(), make(), make()

    def __call__(self, Q, K, V, mask=None):
        for name, x in (("Q", Q), ("K", K), ("V", V)):
            _checks.check_rank(name, x, 3, "(batch, seq_len, d_model)")
            if x.shape[-1] != self.d_model:
                raise ValueError(f"{name} has shape {x.shape}: its last dim must be d_model={self.d_model}")
        if K.shape != V.shape or K.shape[0] != Q.shape[0]:
            raise ValueError(f"K and V must have one shape and Q the same batch: Q {Q.shape}, K {K.shape}, V {V.shape}")
        h = self.d_model // self.num_heads
        split = lambda y: y.reshape(y.shape[0], y.shape[1], self.num_heads, h)
        out, weights = dot_product_attention(
            split(self.W_q(Q)), split(self.W_k(K)), split(self.W_v(V)), mask=mask,
            return_weights=True, precision=self.precision,
        )
        return self.W_o(out.reshape(Q.shape[0], Q.shape[1], self.d_model)), weights

    def example_inputs(self):
        x = jnp.zeros((1, 1, self.d_model), self.param_dtype)
        return (x, x, x)
