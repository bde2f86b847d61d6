"""PyTorch references for user-defined attention, attention sinks and chunked attention.

Written from the published descriptions, independently of flax_attn:

* :func:`flex_attention`: the semantics of PyTorch's FlexAttention
  (``torch.nn.attention.flex_attention``): ``score_mod(score, b, h, q_idx, kv_idx)`` rewrites
  every score and ``mask_mod(b, h, q_idx, kv_idx)`` says which pairs may attend. Here the whole
  ``(B, N, T, S)`` score tensor is materialised and the functions are called once on broadcast
  index tensors (``b`` ``(B, 1, 1, 1)``, ``h`` ``(1, N, 1, 1)``, ``q_idx`` ``(B|1, 1, T, 1)``,
  ``kv_idx`` ``(B|1, 1, 1, S)``), the plainest reading of "a function of the score and its
  indices".
* Attention sinks as gpt-oss writes them (``gpt_oss/torch/model.py``, ``sdpa``): one learned
  logit per head is concatenated to every row of scores as an extra column, the softmax taken,
  and that column dropped; it has no value.
* Llama 4's chunked attention mask: causal, and only within fixed chunks of ``C`` positions
  (``q // C == k // C``).

Shapes follow the project alphabet: queries ``(B, T, N, H)``, keys/values ``(B, S, K, H)``,
``K`` divides ``N`` (key/value heads are repeated to N). A query row with nothing allowed and
no sink returns zeros (the project's convention; FlexAttention does the same).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch


def chunked_causal_mask(query_positions, key_positions, chunk_size: int):
    """Llama 4's chunked attention: ``(..., T, S)`` bool, True where the key is at or before the
    query and in the same chunk of ``chunk_size`` positions."""
    q = query_positions[..., :, None]
    k = key_positions[..., None, :]
    same_chunk = torch.div(q, chunk_size, rounding_mode="floor") == torch.div(k, chunk_size, rounding_mode="floor")
    return same_chunk & (k <= q)


def _repeat_kv(q, k, v):
    G = q.shape[2] // k.shape[2]
    return k.repeat_interleave(G, dim=2), v.repeat_interleave(G, dim=2)


def _indices(B, N, query_positions, key_positions):
    """Broadcast index tensors ``b, h, q_idx, kv_idx`` for ``(B, N, T, S)``; positions ``(T,)``
    or ``(B, T)`` and ``(S,)`` or ``(B, S)``."""
    qp = query_positions if query_positions.dim() == 2 else query_positions[None]
    kp = key_positions if key_positions.dim() == 2 else key_positions[None]
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(N)[None, :, None, None]
    return b, h, qp[:, None, :, None], kp[:, None, None, :]


def flex_attention(q, k, v, *, score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None,
                   scale: Optional[float] = None, query_positions=None, key_positions=None, sinks=None):
    """Attention with a user ``score_mod`` and ``mask_mod``, all scores materialised.

    ``out = softmax(mask(score_mod(scale * q k^T)) [, sink column]) v``.

    Args:
      q: ``(B, T, N, H)``; k, v: ``(B, S, K, H)``.
      score_mod: ``(score (B, N, T, S), b, h, q_idx, kv_idx) -> score``, broadcasting.
      mask_mod: ``(b, h, q_idx, kv_idx) -> bool`` broadcastable to ``(B, N, T, S)``.
      scale: default ``1/sqrt(H)``.
      query_positions, key_positions: what ``q_idx``/``kv_idx`` are; default ``0..T-1`` and
        ``0..S-1`` shifted so that queries are the last T of the S keys (flax_attn's default).
      sinks: ``(N,)``: gpt-oss sinks (see :func:`attention_with_sinks`).

    Returns:
      ``out`` ``(B, T, N, Hv)`` and the weights ``(B, N, T, S)``.
    """
    B, T, N, H = q.shape
    S = k.shape[1]
    if query_positions is None:
        query_positions = torch.arange(T) + (S - T)
    if key_positions is None:
        key_positions = torch.arange(S)
    k, v = _repeat_kv(q, k, v)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    scores = torch.einsum("btnh,bsnh->bnts", q, k) * scale
    b, h, qi, ki = _indices(B, N, query_positions, key_positions)
    if score_mod is not None:
        scores = score_mod(scores, b, h, qi, ki)
    allowed = torch.ones(scores.shape, dtype=torch.bool)
    if mask_mod is not None:
        allowed = allowed & mask_mod(b, h, qi, ki)
    return _softmax_attend(scores, allowed, v, sinks)


def attention_with_sinks(q, k, v, sinks, *, allowed=None, scale: Optional[float] = None):
    """gpt-oss attention sinks: per-head logits ``sinks`` ``(N,)`` concatenated to every row of
    scores as a column, softmax over keys and sink, the sink column dropped.

    ``allowed``: bool broadcastable to ``(B, N, T, S)`` (True = may attend); None: all.
    Returns ``out`` ``(B, T, N, Hv)`` and the weights ``(B, N, T, S)`` (rows sum to less than 1).
    """
    B, T, N, H = q.shape
    k, v = _repeat_kv(q, k, v)
    scale = 1.0 / math.sqrt(H) if scale is None else scale
    scores = torch.einsum("btnh,bsnh->bnts", q, k) * scale
    allowed = torch.ones(scores.shape, dtype=torch.bool) if allowed is None else allowed.expand(scores.shape)
    return _softmax_attend(scores, allowed, v, sinks)


def _softmax_attend(scores, allowed, v, sinks):
    allowed = allowed.expand(scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        B, N, T, _ = scores.shape
        column = sinks.to(scores.dtype).reshape(1, N, 1, 1).expand(B, N, T, 1)
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        any_allowed = allowed.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~any_allowed, 0.0)  # a row with nothing allowed: finite, zeroed below
        weights = torch.softmax(scores, dim=-1) * any_allowed
    return torch.einsum("bnts,bsnh->btnh", weights, v), weights
