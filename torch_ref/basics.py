"""Attention without trainable weights, in PyTorch, as the chapter computes it step by step.

Same names and meaning as ``flax_attn.textbook.basics``.
"""
from __future__ import annotations

import torch


def attention_scores(queries, inputs):
    """``queries @ inputs.T``: ``(d,)`` -> ``(T,)``, ``(T', d)`` -> ``(T', T)``."""
    return queries @ inputs.T


def attention_scores_loop(queries, inputs):
    """The chapter's loops: ``torch.dot(x_i, query)`` into an empty tensor."""
    rows = queries[None] if queries.dim() == 1 else queries
    scores = torch.empty(rows.shape[0], inputs.shape[0], dtype=inputs.dtype)
    for r, query in enumerate(rows):
        for i, x_i in enumerate(inputs):
            scores[r, i] = torch.dot(x_i, query)
    return scores[0] if queries.dim() == 1 else scores


def normalize_by_sum(scores, dim=-1):
    return scores / scores.sum(dim=dim, keepdim=True)


def softmax_naive(x):
    """The chapter's ``softmax_naive``: ``exp(x) / exp(x).sum(dim=0)``."""
    return torch.exp(x) / torch.exp(x).sum(dim=0)


def softmax(x, dim=-1):
    return torch.softmax(x, dim=dim)


def context_vectors(weights, inputs):
    return weights @ inputs


def context_vectors_loop(weights, inputs):
    """The chapter's loop: ``context_vec += attn_weights[i] * x_i``."""
    rows = weights[None] if weights.dim() == 1 else weights
    out = torch.zeros(rows.shape[0], inputs.shape[-1], dtype=inputs.dtype)
    for r, row in enumerate(rows):
        for i, x_i in enumerate(inputs):
            out[r] += row[i] * x_i
    return out[0] if weights.dim() == 1 else out


def self_attention_without_weights(inputs):
    attn_weights = torch.softmax(inputs @ inputs.T, dim=-1)
    return attn_weights @ inputs, attn_weights


def causal_weights_by_renormalizing(weights):
    """``mask_simple = tril(ones)``; ``masked = weights * mask_simple``; divide by row sums."""
    n = weights.shape[-1]
    masked_simple = weights * torch.tril(torch.ones(n, n, dtype=weights.dtype))
    return masked_simple / masked_simple.sum(dim=-1, keepdim=True)


def causal_weights_by_masking(scores, *, scale=1.0):
    """``masked_fill(triu(ones, 1).bool(), -inf)``, then ``softmax(masked * scale)``."""
    n = scores.shape[-1]
    mask = torch.triu(torch.ones(n, n), diagonal=1)
    masked = scores.masked_fill(mask.bool(), -torch.inf)
    return torch.softmax(masked * scale, dim=-1)
