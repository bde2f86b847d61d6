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

Each module's computation is a pure stage of ``(params, inputs)`` here (``self_attention_v1``,
``self_attention_v2``, ``causal_attention``, ``multi_head_attention_wrapper``,
``multi_head_attention``), with its parameter specs (``*_params``); the Linen modules below and
their NNX twins in :mod:`flax_attn.nnx` only hold parameters and call them.
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
from flax_attn.layers.common import (ParamSpec, by_row_chunks, check_floating, check_tokens, declare, declared, dense,
                                     dropout_on, dropout_rng, linear_params, uniform_init)

Dtype = Any


def _check_sizes(owner: str, **sizes) -> None:
    for field, value in sizes.items():
        _checks.check_positive_int(f"{owner} {field}", value)


def _check_unbatched_or_batched(owner: str, x, d_in: int) -> None:
    _checks.check_rank(f"{owner} input x", x, (2, 3), "(num_tokens, d_in) or (batch, num_tokens, d_in)")
    check_floating(owner, "x", x)
    if x.shape[-1] != d_in:
        raise ValueError(f"{owner} input x has shape {x.shape}: its last dim must be d_in={d_in}")


# --------------------------------------------------------------------------- pure stages

def self_attention_v1_params(d_in: int, d_out: int) -> dict:
    """Specs: raw matrices ``W_query``, ``W_key``, ``W_value`` ``(d_in, d_out)``, uniform in [0, 1)."""
    _check_sizes("SelfAttention_v1", d_in=d_in, d_out=d_out)
    return {name: ParamSpec((d_in, d_out), uniform_init(0.0, 1.0)) for name in ("W_query", "W_key", "W_value")}


def self_attention_v1(d_in: int, params, x, *, precision: Any = None):
    """``softmax(x W_query (x W_key)^T / sqrt(d_out)) x W_value`` for ``x`` ``(T, d_in)`` or
    ``(B, T, d_in)``; returns ``(T, d_out)`` or ``(B, T, d_out)``. ``params``: raw matrices."""
    _check_unbatched_or_batched("SelfAttention_v1", x, d_in)
    project = lambda w: jnp.matmul(x, w, precision=precision)[..., None, :]
    out = dot_product_attention(project(params["W_query"]), project(params["W_key"]), project(params["W_value"]),
                                precision=precision)
    return out[..., 0, :]


def self_attention_v2_params(d_in: int, d_out: int, qkv_bias: bool = False) -> dict:
    """Specs: ``W_query``, ``W_key``, ``W_value`` linear layers ``d_in -> d_out`` (``nn.Linear`` init)."""
    _check_sizes("SelfAttention_v2", d_in=d_in, d_out=d_out)
    return {name: linear_params(d_in, d_out, use_bias=qkv_bias) for name in ("W_query", "W_key", "W_value")}


def self_attention_v2(d_in: int, params, x, *, precision: Any = None):
    """:func:`self_attention_v1` with linear layers: ``x`` ``(T, d_in)`` or ``(B, T, d_in)`` ->
    ``(T, d_out)`` or ``(B, T, d_out)``."""
    _check_unbatched_or_batched("SelfAttention_v2", x, d_in)
    q, k, v = (dense(params[name], x, precision)[..., None, :] for name in ("W_query", "W_key", "W_value"))
    return dot_product_attention(q, k, v, precision=precision)[..., 0, :]


def causal_attention_params(d_in: int, d_out: int, context_length: int, dropout: float,
                            qkv_bias: bool = False) -> dict:
    """Specs of :class:`CausalAttention`: ``W_query``, ``W_key``, ``W_value`` linear ``d_in -> d_out``."""
    _check_sizes("CausalAttention", d_in=d_in, d_out=d_out, context_length=context_length)
    _checks.check_rate("CausalAttention dropout", dropout)
    return {name: linear_params(d_in, d_out, use_bias=qkv_bias) for name in ("W_query", "W_key", "W_value")}


def causal_attention(d_in: int, context_length: int, dropout: float, params, x, *, dropout_rng=None,
                     precision: Any = None, owner: str = "CausalAttention"):
    """One causal head: ``x`` ``(B, T, d_in)`` (``T <= context_length``) -> ``(B, T, d_out)``;
    dropout at ``dropout`` on the weights when ``dropout_rng`` is a key (None: no dropout)."""
    check_tokens(owner, x, d_in, context_length)
    q, k, v = (dense(params[name], x, precision)[:, :, None, :] for name in ("W_query", "W_key", "W_value"))
    out = dot_product_attention(q, k, v, is_causal=True, dropout_rate=dropout if dropout_rng is not None else 0.0,
                                dropout_rng=dropout_rng, precision=precision)
    return out[:, :, 0, :]


def multi_head_attention_wrapper_params(d_in: int, d_out: int, context_length: int, dropout: float,
                                        num_heads: int, qkv_bias: bool = False) -> dict:
    """Specs: ``heads_0`` .. ``heads_{num_heads-1}``, each :func:`causal_attention_params`."""
    _check_sizes("MultiHeadAttentionWrapper", d_in=d_in, d_out=d_out, context_length=context_length,
                 num_heads=num_heads)
    _checks.check_rate("MultiHeadAttentionWrapper dropout", dropout)
    head = causal_attention_params(d_in, d_out, context_length, dropout, qkv_bias)
    return {f"heads_{i}": head for i in range(num_heads)}


def multi_head_attention_wrapper(d_in: int, context_length: int, dropout: float, num_heads: int, params, x, *,
                                 dropout_rngs=None, precision: Any = None):
    """``num_heads`` :func:`causal_attention` heads concatenated: ``(B, T, d_in)`` ->
    ``(B, T, num_heads * d_out)``. ``dropout_rngs``: one key per head, or None (no dropout)."""
    check_tokens("MultiHeadAttentionWrapper", x, d_in, context_length)
    rngs = [None] * num_heads if dropout_rngs is None else list(dropout_rngs)
    if len(rngs) != num_heads:
        raise ValueError(f"dropout_rngs must hold one key per head ({num_heads}), got {len(rngs)}")
    return jnp.concatenate([causal_attention(d_in, context_length, dropout, params[f"heads_{i}"], x,
                                             dropout_rng=rngs[i], precision=precision)
                            for i in range(num_heads)], axis=-1)


def multi_head_attention_params(d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int,
                                qkv_bias: bool = False) -> dict:
    """Specs: ``W_query``, ``W_key``, ``W_value`` linear ``d_in -> d_out``; ``out_proj`` ``d_out -> d_out`` (biased)."""
    _check_sizes("MultiHeadAttention", d_in=d_in, d_out=d_out, context_length=context_length, num_heads=num_heads)
    _checks.check_divides("d_out", d_out, "num_heads", num_heads)
    _checks.check_rate("MultiHeadAttention dropout", dropout)
    specs = {name: linear_params(d_in, d_out, use_bias=qkv_bias) for name in ("W_query", "W_key", "W_value")}
    specs["out_proj"] = linear_params(d_out, d_out, use_bias=True)
    return specs


def multi_head_attention(d_in: int, d_out: int, context_length: int, dropout: float, num_heads: int, params, x,
                         *, dropout_rng=None, precision: Any = None, implementation: Optional[str] = None):
    """GPT-2's causal multi-head attention: ``(B, T, d_in)`` -> ``(B, T, d_out)``, heads of
    ``d_out // num_heads``; dropout on the weights when ``dropout_rng`` is a key. Without
    dropout, on CPU, a call of at least 4,096 tokens that is not differentiated runs a few batch
    rows at a time (:func:`flax_attn.layers.common.by_row_chunks`; GPT-2-small's layer at 8 x
    1,024 tokens: 0.18 -> 0.14 s forward on a 2-core AMD EPYC)."""
    check_tokens("MultiHeadAttention", x, d_in, context_length)

    def stage(params, x):
        b, t, _ = x.shape
        # three matmuls, not one on kernels concatenated at call time: the fused output's slices
        # come back in reverse mode as a padded sum, and a GPT-2-small layer's forward+backward took
        # 6% longer so (2-core AMD EPYC, benchmarks.run's "one fused QKV matmul" row)
        q, k, v = (dense(params[name], x, precision).reshape(b, t, num_heads, d_out // num_heads)
                   for name in ("W_query", "W_key", "W_value"))
        ctx = dot_product_attention(q, k, v, is_causal=True, dropout_rate=dropout if dropout_rng is not None else 0.0,
                                    dropout_rng=dropout_rng, precision=precision, implementation=implementation)
        return dense(params["out_proj"], ctx.reshape(b, t, d_out), precision)

    # rows are independent unless one dropout key draws for the whole batch
    return stage(params, x) if dropout_rng is not None else by_row_chunks(stage, params, x)


# --------------------------------------------------------------------------- Linen modules

class SelfAttention_v1(nn.Module):
    """Self-attention with raw weight matrices ``(d_in, d_out)``, drawn uniform in [0, 1).

        Q = x W_query,  K = x W_key,  V = x W_value,  out = softmax(Q K^T / sqrt(d_out)) V

    Args (fields):
      d_in: input embedding size.
      d_out: query/key/value size.

    Call:
      x: floating ``(T, d_in)`` as in the chapter, or batched ``(B, T, d_in)``.

    Returns:
      ``(T, d_out)`` or ``(B, T, d_out)``. No mask: every token attends to every token.
    """

    d_in: int
    d_out: int
    param_dtype: Dtype = jnp.float32
    precision: Any = None

    def setup(self):
        declare(self, self_attention_v1_params(self.d_in, self.d_out), self.param_dtype)

    def __call__(self, x):
        params = declared(self, self_attention_v1_params(self.d_in, self.d_out))
        return self_attention_v1(self.d_in, params, x, precision=self.precision)


class SelfAttention_v2(nn.Module):
    """Self-attention with linear layers (``nn.Linear`` initialisation), optional ``qkv_bias``.

    The same function as :class:`SelfAttention_v1`; ``v2``'s ``kernel`` is ``v1``'s matrix, so
    ``{'W_query': v2_params['W_query']['kernel'], ...}`` loads v2's weights into v1.

    Call:
      x: floating ``(T, d_in)`` or ``(B, T, d_in)``. Returns ``(T, d_out)`` or ``(B, T, d_out)``.
    """

    d_in: int
    d_out: int
    qkv_bias: bool = False
    param_dtype: Dtype = jnp.float32
    precision: Any = None

    def setup(self):
        declare(self, self_attention_v2_params(self.d_in, self.d_out, self.qkv_bias), self.param_dtype)

    def __call__(self, x):
        params = declared(self, self_attention_v2_params(self.d_in, self.d_out, self.qkv_bias))
        return self_attention_v2(self.d_in, params, x, precision=self.precision)


class CausalAttention(nn.Module):
    """Single-head causal self-attention with dropout on the attention weights.

        out_t = sum_{s <= t} softmax_s(q_t . k_s / sqrt(d_out)) v_s

    Args (fields):
      d_in, d_out: input and head size.
      context_length: the most tokens a call may have (the original sizes its mask buffer by it).
      dropout: dropout rate on the attention weights, in [0, 1).
      qkv_bias: biases in the query/key/value projections.

    Call:
      x: floating ``(B, T, d_in)`` with ``T <= context_length``.
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

    def _specs(self):
        return causal_attention_params(self.d_in, self.d_out, self.context_length, self.dropout, self.qkv_bias)

    def setup(self):
        declare(self, self._specs(), self.param_dtype)

    def __call__(self, x, *, deterministic: Optional[bool] = None):
        params = declared(self, self._specs())
        rng = dropout_rng(self, self.dropout, deterministic, "CausalAttention")
        return causal_attention(self.d_in, self.context_length, self.dropout, params, x, dropout_rng=rng,
                                precision=self.precision)


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` independent :class:`CausalAttention` heads, outputs concatenated.

    Parameters ``heads_0`` .. ``heads_{num_heads-1}``, each a :class:`CausalAttention`'s.

    Call:
      x: floating ``(B, T, d_in)``; ``deterministic`` as in :class:`CausalAttention`.

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

    def _specs(self):
        return multi_head_attention_wrapper_params(self.d_in, self.d_out, self.context_length, self.dropout,
                                                   self.num_heads, self.qkv_bias)

    def setup(self):
        declare(self, self._specs(), self.param_dtype)

    def __call__(self, x, *, deterministic: Optional[bool] = None):
        params = declared(self, self._specs())
        rngs = None
        if dropout_on(self.dropout, deterministic, "MultiHeadAttentionWrapper"):
            # each head draws its key in its own scope, as a CausalAttention submodule would
            rngs = [getattr(self, f"heads_{i}").rng("dropout") for i in range(self.num_heads)]
        return multi_head_attention_wrapper(self.d_in, self.context_length, self.dropout, self.num_heads, params, x,
                                            dropout_rngs=rngs, precision=self.precision)


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
      x: floating ``(B, T, d_in)``, ``T <= context_length``; ``deterministic`` as in
      :class:`CausalAttention`.

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

    def _specs(self):
        return multi_head_attention_params(self.d_in, self.d_out, self.context_length, self.dropout, self.num_heads,
                                           self.qkv_bias)

    def setup(self):
        declare(self, self._specs(), self.param_dtype)

    @property
    def head_dim(self) -> int:
        return self.d_out // self.num_heads

    def __call__(self, x, *, deterministic: Optional[bool] = None):
        """Causal self-attention over ``x`` with N = ``num_heads`` heads of H = ``head_dim``.

        Args:
          x: floating ``(B, T, d_in)``, ``T <= context_length``.
          deterministic: required when ``dropout > 0``; False applies dropout with
            ``rngs={'dropout': key}``.

        Returns:
          ``(B, T, d_out)``, ``d_out = N * H``.
        """
        params = declared(self, self._specs())
        rng = dropout_rng(self, self.dropout, deterministic, "MultiHeadAttention")
        return multi_head_attention(self.d_in, self.d_out, self.context_length, self.dropout, self.num_heads, params,
                                    x, dropout_rng=rng, precision=self.precision, implementation=self.implementation)


def count_parameters(variables) -> int:
    """Number of trainable scalars in ``variables['params']`` (the chapter's ``count_parameters``)."""
    params = variables["params"] if "params" in variables else variables
    return int(sum(math.prod(np.shape(p)) for p in jax.tree_util.tree_leaves(params)))
