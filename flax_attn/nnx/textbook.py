"""NNX twins of the textbook modules: the chapter's ``SelfAttention_v1``, ``SelfAttention_v2``,
``CausalAttention``, ``MultiHeadAttentionWrapper``, ``MultiHeadAttention`` and the Transformer
notes' ``TransformerMultiHeadAttention``.

Each takes its Linen twin's arguments in the same order (the chapter's names), then
keyword-only ``deterministic`` (modules with dropout) and ``rngs``; holds the same parameters
(``W_query``, ``out_proj``, ``heads_0``, ...) and calls the same stage from
:mod:`flax_attn.textbook.chapter` / :mod:`flax_attn.textbook.transformer`.

    mha = fa.nnx.MultiHeadAttention(768, 768, 1024, 0.1, 12, rngs=nnx.Rngs(0, dropout=1))
    y = mha(x, deterministic=False)          # x (B, T, 768); the key comes from rngs.dropout
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from flax_attn.textbook import chapter, transformer
from flax_attn.layers.common import dropout_on
from flax_attn.nnx.common import DROPOUT_HOW, Dropout, declare, params_of

Dtype = Any


class SelfAttention_v1(nnx.Module):
    """The chapter's self-attention with raw matrices ``W_query``, ``W_key``, ``W_value``
    ``(d_in, d_out)`` (uniform in [0, 1)), as an NNX module. ``x`` ``(T, d_in)`` or
    ``(B, T, d_in)`` -> ``(T, d_out)`` or ``(B, T, d_out)``. Twin of :class:`flax_attn.SelfAttention_v1`."""

    linen_class = chapter.SelfAttention_v1

    def __init__(self, d_in: int, d_out: int, param_dtype: Dtype = jnp.float32, precision: Any = None, *,
                 rngs: nnx.Rngs):
        self.d_in, self.d_out, self.param_dtype, self.precision = d_in, d_out, param_dtype, precision
        declare(self, chapter.self_attention_v1_params(d_in, d_out), param_dtype, rngs)

    def __call__(self, x):
        return chapter.self_attention_v1(self.d_in, params_of(self), x, precision=self.precision)


class SelfAttention_v2(nnx.Module):
    """The chapter's self-attention with linear layers ``W_query``, ``W_key``, ``W_value``
    (``kernel`` ``(d_in, d_out)``, ``bias`` with ``qkv_bias``), as an NNX module.
    ``x`` ``(T, d_in)`` or ``(B, T, d_in)``. Twin of :class:`flax_attn.SelfAttention_v2`."""

    linen_class = chapter.SelfAttention_v2

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False, param_dtype: Dtype = jnp.float32,
                 precision: Any = None, *, rngs: nnx.Rngs):
        self.d_in, self.d_out, self.qkv_bias = d_in, d_out, qkv_bias
        self.param_dtype, self.precision = param_dtype, precision
        declare(self, chapter.self_attention_v2_params(d_in, d_out, qkv_bias), param_dtype, rngs)

    def __call__(self, x):
        return chapter.self_attention_v2(self.d_in, params_of(self), x, precision=self.precision)


class CausalAttention(Dropout, nnx.Module):
    """The chapter's single causal head with dropout on the weights, as an NNX module.

    ``x`` floating ``(B, T, d_in)``, ``T <= context_length`` -> ``(B, T, d_out)``. Call:
    ``head(x, *, deterministic=None, rngs=None)``. Twin of :class:`flax_attn.CausalAttention`.
    """

    linen_class = chapter.CausalAttention

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False,
                 param_dtype: Dtype = jnp.float32, precision: Any = None, *, deterministic: Optional[bool] = None,
                 rngs: nnx.Rngs):
        self.d_in, self.d_out, self.context_length, self.dropout = d_in, d_out, context_length, dropout
        self.qkv_bias, self.param_dtype, self.precision = qkv_bias, param_dtype, precision
        declare(self, chapter.causal_attention_params(d_in, d_out, context_length, dropout, qkv_bias),
                param_dtype, rngs)
        self._init_dropout(dropout, deterministic, rngs)

    def __call__(self, x, *, deterministic: Optional[bool] = None, rngs=None):
        key = self._dropout_key(self.dropout, deterministic, rngs, "CausalAttention")
        return chapter.causal_attention(self.d_in, self.context_length, self.dropout, params_of(self), x,
                                        dropout_rng=key, precision=self.precision)


class MultiHeadAttentionWrapper(Dropout, nnx.Module):
    """``num_heads`` :class:`CausalAttention` heads (``heads_0`` ...), concatenated, as an NNX
    module: ``(B, T, d_in)`` -> ``(B, T, num_heads * d_out)``. Each head draws its dropout key
    from its own stream (or, in turn, from the call's ``rngs``; a key given as ``rngs`` is split
    into one per head). Twin of :class:`flax_attn.MultiHeadAttentionWrapper`."""

    linen_class = chapter.MultiHeadAttentionWrapper

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False, param_dtype: Dtype = jnp.float32, precision: Any = None, *,
                 deterministic: Optional[bool] = None, rngs: nnx.Rngs):
        chapter.multi_head_attention_wrapper_params(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.d_in, self.d_out, self.context_length, self.dropout = d_in, d_out, context_length, dropout
        self.num_heads, self.qkv_bias, self.param_dtype, self.precision = num_heads, qkv_bias, param_dtype, precision
        for i in range(num_heads):  # named heads_i, as the Linen twin's parameters (PyTorch's heads.i)
            setattr(self, f"heads_{i}", CausalAttention(d_in, d_out, context_length, dropout, qkv_bias, param_dtype,
                                                        precision, deterministic=deterministic, rngs=rngs))
        self.deterministic = deterministic

    def __call__(self, x, *, deterministic: Optional[bool] = None, rngs=None):
        keys = None
        if dropout_on(self.dropout, self._resolve_deterministic(deterministic), "MultiHeadAttentionWrapper", DROPOUT_HOW):
            per_head = list(jax.random.split(rngs, self.num_heads)) if isinstance(rngs, jax.Array) else \
                [rngs] * self.num_heads  # a stream (or None: each head's own) is drawn from in turn
            keys = [getattr(self, f"heads_{i}")._dropout_key(self.dropout, False, per_head[i], "CausalAttention")
                    for i in range(self.num_heads)]
        return chapter.multi_head_attention_wrapper(self.d_in, self.context_length, self.dropout, self.num_heads,
                                                    params_of(self), x, dropout_rngs=keys, precision=self.precision)


class MultiHeadAttention(Dropout, nnx.Module):
    """The chapter's (GPT-2's) causal multi-head attention as an NNX module:
    ``(B, T, d_in)`` -> ``(B, T, d_out)``; ``W_query``, ``W_key``, ``W_value``, ``out_proj``.
    Call: ``mha(x, *, deterministic=None, rngs=None)``. Twin of :class:`flax_attn.MultiHeadAttention`."""

    linen_class = chapter.MultiHeadAttention

    def __init__(self, d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                 qkv_bias: bool = False, param_dtype: Dtype = jnp.float32, precision: Any = None,
                 implementation: Optional[str] = None, *, deterministic: Optional[bool] = None, rngs: nnx.Rngs):
        self.d_in, self.d_out, self.context_length, self.dropout = d_in, d_out, context_length, dropout
        self.num_heads, self.qkv_bias, self.param_dtype = num_heads, qkv_bias, param_dtype
        self.precision, self.implementation = precision, implementation
        declare(self, chapter.multi_head_attention_params(d_in, d_out, context_length, dropout, num_heads, qkv_bias),
                param_dtype, rngs)
        self._init_dropout(dropout, deterministic, rngs)

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    def __call__(self, x, *, deterministic: Optional[bool] = None, rngs=None):
        key = self._dropout_key(self.dropout, deterministic, rngs, "MultiHeadAttention")
        return chapter.multi_head_attention(self.d_in, self.d_out, self.context_length, self.dropout, self.num_heads,
                                            params_of(self), x, dropout_rng=key, precision=self.precision,
                                            implementation=self.implementation)


class TransformerMultiHeadAttention(nnx.Module):
    """The Transformer notes' ``MultiHeadAttention(d_model, num_heads)`` as an NNX module:
    biased ``W_q``, ``W_k``, ``W_v``, ``W_o``. Call ``(Q, K, V, mask=None)`` with ``Q``
    ``(B, T, d_model)``, ``K``/``V`` ``(B, S, d_model)``, ``mask`` boolean broadcastable to
    ``(B, N, T, S)``; returns ``(output (B, T, d_model), weights (B, N, T, S))``.
    Twin of :class:`flax_attn.TransformerMultiHeadAttention`."""

    linen_class = transformer.TransformerMultiHeadAttention

    def __init__(self, d_model: int, num_heads: int, param_dtype: Dtype = jnp.float32, precision: Any = None, *,
                 rngs: nnx.Rngs):
        self.d_model, self.num_heads, self.param_dtype, self.precision = d_model, num_heads, param_dtype, precision
        declare(self, transformer.transformer_multi_head_attention_params(d_model, num_heads), param_dtype, rngs)

    def __call__(self, Q, K, V, mask=None):
        return transformer.transformer_multi_head_attention(self.d_model, self.num_heads, params_of(self), Q, K, V,
                                                            mask, precision=self.precision)
