"""Attention without trainable weights: the chapter's first section, step by step.

The inputs are token embeddings ``(T, d)``. For a query ``x_q`` the scores are dot products
``w_j = x_j . x_q``, the weights are the scores normalised to sum to one, and the context
vector is the weighted sum ``z = sum_j a_j x_j``. Each step comes in the loop form the
chapter starts with and the matrix form it ends with; they agree.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.core.numerics import masked_softmax
from flax_attn.textbook.transformer import create_causal_mask


def attention_scores(queries, inputs):
    """Matrix form: ``queries @ inputs.T``. ``(d,)`` -> ``(T,)``; ``(T', d)`` -> ``(T', T)``."""
    _checks.check_rank("queries", queries, (1, 2), "(d,) or (T', d)")
    _checks.check_rank("inputs", inputs, 2, "(T, d)")
    if queries.shape[-1] != inputs.shape[-1]:
        raise ValueError(f"queries {queries.shape} and inputs {inputs.shape} differ in the last dim")
    return queries @ inputs.T


def attention_scores_loop(queries, inputs):
    """Loop form of :func:`attention_scores`: one ``jnp.dot`` per (query, input) pair."""
    _checks.check_rank("queries", queries, (1, 2), "(d,) or (T', d)")
    _checks.check_rank("inputs", inputs, 2, "(T, d)")
    if queries.shape[-1] != inputs.shape[-1]:
        raise ValueError(f"queries {queries.shape} and inputs {inputs.shape} differ in the last dim")
    rows = queries[None] if queries.ndim == 1 else queries
    scores = jnp.stack([jnp.stack([jnp.dot(x_j, q) for x_j in inputs]) for q in rows])
    return scores[0] if queries.ndim == 1 else scores


def normalize_by_sum(scores, axis: int = -1):
    """``scores / scores.sum(axis)``: sums to one, but is not a softmax (negative scores break it)."""
    return scores / jnp.sum(scores, axis=axis, keepdims=True)


def softmax_naive(x, axis: int = 0):
    """``exp(x) / sum(exp(x))`` over ``axis`` (0, as in the chapter): overflows for large ``x``.

    ``exp(89)`` is already ``inf`` in float32, so the result is NaN; and from about 87 on, XLA on
    CPU returns zeros (it multiplies by ``1/sum``, a subnormal flushed to zero). :func:`softmax`
    subtracts the maximum first and has neither problem.
    """
    exp_x = jnp.exp(x)
    return exp_x / jnp.sum(exp_x, axis=axis, keepdims=True)


def softmax(x, axis: int = -1):
    """Numerically stable softmax (the maximum is subtracted before ``exp``)."""
    return jax.nn.softmax(x, axis=axis)


def context_vectors(weights, inputs):
    """Matrix form: ``weights @ inputs``. ``(T,)`` -> ``(d,)``; ``(T', T)`` -> ``(T', d)``."""
    _checks.check_rank("weights", weights, (1, 2), "(T,) or (T', T)")
    _checks.check_rank("inputs", inputs, 2, "(T, d)")
    if weights.shape[-1] != inputs.shape[0]:
        raise ValueError(f"weights {weights.shape} do not match inputs {inputs.shape} (T)")
    return weights @ inputs


def context_vectors_loop(weights, inputs):
    """Loop form of :func:`context_vectors`: accumulate ``a_j * x_j`` one input at a time."""
    _checks.check_rank("weights", weights, (1, 2), "(T,) or (T', T)")
    _checks.check_rank("inputs", inputs, 2, "(T, d)")
    if weights.shape[-1] != inputs.shape[0]:
        raise ValueError(f"weights {weights.shape} do not match inputs {inputs.shape} (T)")
    rows = weights[None] if weights.ndim == 1 else weights
    out = []
    for row in rows:
        z = jnp.zeros(inputs.shape[-1], inputs.dtype)
        for a_j, x_j in zip(row, inputs):
            z = z + a_j * x_j
        out.append(z)
    out = jnp.stack(out)
    return out[0] if weights.ndim == 1 else out


def self_attention_without_weights(inputs):
    """The whole section in one call: scores ``X X^T``, row softmax, contexts. Returns ``(Z, A)``."""
    weights = softmax(attention_scores(inputs, inputs), axis=-1)
    return context_vectors(weights, inputs), weights


def causal_weights_by_renormalizing(weights):
    """Causal weights the first way: zero the weights above the diagonal, renormalise each row."""
    _checks.check_rank("weights", weights, (2, 3, 4), "(..., T, T)")
    if weights.shape[-1] != weights.shape[-2]:
        raise ValueError(f"weights must be square in the last two dims (..., T, T), got {weights.shape}")
    masked = jnp.where(create_causal_mask(weights.shape[-1]), weights, 0)
    return masked / jnp.sum(masked, axis=-1, keepdims=True)


def causal_weights_by_masking(scores, *, scale: float = 1.0):
    """Causal weights the second way: block scores above the diagonal, then softmax(scale * s)."""
    _checks.check_rank("scores", scores, (2, 3, 4), "(..., T, T)")
    if scores.shape[-1] != scores.shape[-2]:
        raise ValueError(f"scores must be square in the last two dims (..., T, T), got {scores.shape}")
    return masked_softmax(scores * scale, create_causal_mask(scores.shape[-1]))
