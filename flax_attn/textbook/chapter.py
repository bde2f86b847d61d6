"""The chapter's attention modules as Flax Linen modules.

Constructor fields carry the chapter's argument names and order, parameter names mirror the
PyTorch originals in ``torch_ref.chapter`` (``W_query``, ``W_key``, ``W_value``, ``out_proj``,
``heads_0`` for ``heads.0``), so ``flax_attn.from_torch_state_dict`` converts their weights.
Every module computes attention with :func:`flax_attn.dot_product_attention` and scales the
scores by ``1/sqrt(head_dim)``, as the chapter does with ``keys.shape[-1]**0.5``.

Usage::

    mha = MultiHeadAttention(d_in=768, d_out=768, context_length=1024, dropout=0.1, num_heads=12)
    variables = mha.init(jax.random.key(0), x, deterministic=True)         # x: (B, T, 768)
    y = mha.apply(variables, x, deterministic=False, rngs={"dropout": key})  # (B, T, 768)
"""
from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core import dot_product_attention
from flax_attn.layers.common import check_tokens, dropout_rng, linear, uniform_init

Dtype = Any


def _check_sizes(module, *fields) -> None:
    for field in fields:
        _checks.check_positive_int(f"{type(module).__name__} {field}", getattr(module, field))


class SelfAttention_v1(nn.Module):
    """Self-attention with raw weight matrices ``(d_in, d_out)``, drawn uniform in [0, 1).

        Q = x W_query,  K = x W_key,  V = x W_value,  out = softmax(Q K^T / sqrt(d_out)) V

    Args (fields):
      d_in: input embedding size.
      d_out: query/key/value size.

    Call:
      x: ``(T, d_in)`` as in the chapter, or batched ``(B, T, d_in)``.

    Returns:
      ``(T, d_out)`` or ``(B, T, d_out)``. No mask: every token attends to every token.
    """

    d_in: int
    d_out: int
    param_dtype: Dtype = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x):
        _check_sizes(self, "d_in", "d_out")
        _checks.check_rank("SelfAttention_v1 input x", x, (2, 3), "(num_tokens, d_in) or (batch, num_tokens, d_in)")
        if x.shape[-1] != self.d_in:
            raise ValueError(f"SelfAttention_v1 input x has shape {x.shape}: its last dim must be d_in={self.d_in}")
        shape = (self.d_in, self.d_out)
        W_query = self.param("W_query", uniform_init(0.0, 1.0), shape, self.param_dtype)
        W_key = self.param("W_key", uniform_init(0.0, 1.0), shape, self.param_dtype)
        W_value = self.param("W_value", uniform_init(0.0, 1.0), shape, self.param_dtype)
        project = lambda w: jnp.matmul(x, w, precision=self.precision)[..., None, :]
        out = dot_product_attention(project(W_query), project(W_key), project(W_value),
                                    precision=self.precision)
        return out[..., 0, :]


class SelfAttention_v2(nn.Module):
    """Self-attention with linear layers (``nn.Linear`` initialisation), optional ``qkv_bias``.

    The same function as :class:`SelfAttention_v1`; ``v2``'s ``kernel`` is ``v1``'s matrix, so
    ``{'W_query': v2_params['W_query']['kernel'], ...}`` loads v2's weights into v1.

    Call:
      x: ``(T, d_in)`` or ``(B, T, d_in)``. Returns ``(T, d_out)`` or ``(B, T, d_out)``.
    """

    d_in: int
    d_out: int
    qkv_bias: bool = False
    param_dtype: Dtype = jnp.float32
    precision: Any = None

    def setup(self):
        _check_sizes(self, "d_in", "d_out")
        make = lambda: linear(self.d_out, self.d_in, use_bias=self.qkv_bias,
                              param_dtype=self.param_dtype, precision=self.precision)
        self.W_query, self.W_key, self.W_value = make(), make(), make()

    def __call__(self, x):
        _checks.check_rank("SelfAttention_v2 input x", x, (2, 3), "(num_tokens, d_in) or (batch, num_tokens, d_in)")
        if x.shape[-1] != self.d_in:
            raise ValueError(f"SelfAttention_v2 input x has shape {x.shape}: its last dim must be d_in={self.d_in}")
        q, k, v = (layer(x)[..., None, :] for layer in (self.W_query, self.W_key, self.W_value))
        return dot_product_attention(q, k, v, precision=self.precision)[..., 0, :]


class CausalAttention(nn.Module):
    """Single-head causal self-attention with dropout on the attention weights.

        out_t = sum_{s <= t} softmax_s(q_t . k_s / sqrt(d_out)) v_s

    Args (fields):
      d_in, d_out: input and head size.
      context_length: the most tokens a call may have (the original sizes its mask buffer by it).
      dropout: dropout rate on the attention weights, in [0, 1).
      qkv_bias: biases in the query/key/value projections.

    Call:
      x: ``(B, T, d_in)`` with ``T <= context_length``.
      deterministic: required when ``dropout > 0``; False applies dropout with
        ``rngs={'dropout': key}``.

    Returns:
      ``(B, T, d_out)``.
    """

    d_in: int
    d_out: int
    context_length: int
    dropout: float
    qkv_bias: bool = False
    param_dtype: Dtype = jnp.float32
    precision: Any = None

    def setup(self):
        _check_sizes(self, "d_in", "d_out", "context_length")
        _checks.check_rate("CausalAttention dropout", self.dropout)
        make = lambda: linear(self.d_out, self.d_in, use_bias=self.qkv_bias,
                              param_dtype=self.param_dtype, precision=self.precision)
        self.W_query, self.W_key, self.W_value = make(), make(), make()

    def __call__(self, x, *, deterministic: Optional[bool] = None):
        check_tokens("CausalAttention", x, self.d_in, self.context_length)
        rng = dropout_rng(self, self.dropout, deterministic, "CausalAttention")
        q, k, v = (layer(x)[:, :, None, :] for layer in (self.W_query, self.W_key, self.W_value))
        out = dot_product_attention(q, k, v, is_causal=True, dropout_rate=self.dropout if rng is not None else 0.0,
                                    dropout_rng=rng, precision=self.precision)
        return out[:, :, 0, :]


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent :class:`CausalAttention` heads, outputs concatenated.

    Call:
      x: ``(B, T, d_in)``; ``deterministic`` as in :class:`CausalAttention`.

    Returns:
      ``(B, T, num_heads * d_out)``.
    """

    d_in: int
    d_out: int
    context_length: int
    dropout: float
    num_heads: int
    qkv_bias: bool = False
    param_dtype: Dtype = jnp.float32
    precision: Any = None

    def setup(self):
        _check_sizes(self, "d_in", "d_out", "context_length", "num_heads")
        self.heads = [
            CausalAttention(self.d_in, self.d_out, self.context_length, self.dropout, self.qkv_bias,
                            param_dtype=self.param_dtype, precision=self.precision)
            for _ in range(self.num_heads)
        ]

    def __call__(self, x, *, deterministic: Optional[bool] = None):
        check_tokens("MultiHeadAttentionWrapper", x, self.d_in, self.context_length)
        return jnp.concatenate([head(x, deterministic=deterministic) for head in self.heads], axis=-1)


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with one projection per Q/K/V split into heads (GPT-2's).

        head_i = CausalAttention(Q_i, K_i, V_i),  out = concat(head_1..head_h) W_out + b_out

    Args (fields):
      d_in: input size. d_out: total size, split into ``num_heads`` heads of
        ``head_dim = d_out // num_heads``.
      context_length: the most tokens a call may have.
      dropout: dropout rate on the attention weights, in [0, 1).
      num_heads: must divide ``d_out``.
      qkv_bias: biases in the Q/K/V projections (``out_proj`` always has one).
      implementation: passed to :func:`flax_attn.dot_product_attention`.

    Call:
      x: ``(B, T, d_in)``, ``T <= context_length``; ``deterministic`` as in :class:`CausalAttention`.

    Returns:
      ``(B, T, d_out)``.

    The Transformer notes' ``MultiHeadAttention(d_model, num_heads)`` is
    :class:`flax_attn.TransformerMultiHeadAttention`.
    """

    d_in: int
    d_out: int
    context_length: int
    dropout: float
    num_heads: int
    qkv_bias: bool = False
    param_dtype: Dtype = jnp.float32
    precision: Any = None
    implementation: Optional[str] = None

    def setup(self):
        _check_sizes(self, "d_in", "d_out", "context_length", "num_heads")
        _checks.check_divides("d_out", self.d_out, "num_heads", self.num_heads)
        _checks.check_rate("MultiHeadAttention dropout", self.dropout)
        make = lambda bias, fan_in: linear(self.d_out, fan_in, use_bias=bias,
                                           param_dtype=self.param_dtype, precision=self.precision)
        self.W_query = make(self.qkv_bias, self.d_in)
        self.W_key = make(self.qkv_bias, self.d_in)
        self.W_value = make(self.qkv_bias, self.d_in)
        self.out_proj = make(True, self.d_out)

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    def __call__(self, x, *, deterministic: Optional[bool] = None):
        check_tokens("MultiHeadAttention", x, self.d_in, self.context_length)
        rng = dropout_rng(self, self.dropout, deterministic, "MultiHeadAttention")
        b, t, _ = x.shape
        split = lambda y: y.reshape(b, t, self.num_heads, self.head_dim)
        q, k, v = split(self.W_query(x)), split(self.W_key(x)), split(self.W_value(x))
        ctx = dot_product_attention(q, k, v, is_causal=True,
                                    dropout_rate=self.dropout if rng is not None else 0.0,
                                    dropout_rng=rng, precision=self.precision,
                                    implementation=self.implementation)
        return self.out_proj(ctx.reshape(b, t, self.d_out))


def count_parameters(variables) -> int:
    """Number of trainable scalars in ``variables['params']`` (the chapter's ``count_parameters``)."""
    params = variables["params"] if "params" in variables else variables
    return int(sum(math.prod(np.shape(p)) for p in jax.tree_util.tree_leaves(params)))
