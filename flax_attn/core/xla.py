"""The plain path: materialises the ``(B, N, T, S)`` logits; serves every call.

Grouped-query attention without repeating keys: the G query heads of each key/value head are
folded into its query axis, and batch and key/value heads into one axis U = B*K:
``URH,USH->URS`` with R = G*T (MHA: G = 1, MQA: K = 1). Keys and values are read as
``(B*K, S, H)``: a KV cache stored that way (``KVCache(layout='BKSH')``) is read in place, and no
axis of size 1 (a batch of one) makes XLA copy a cache around its in-place update. On a CPU
with AVX-512 a decoding step over keys in any other order reads them where they lie instead,
as ``(B, S, K*H)`` rows against block-diagonal queries
(:func:`flax_attn.core.numerics.reads_heads_in_place`).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flax_attn.core import numerics
from flax_attn.core.registry import Implementation, Result


@dataclasses.dataclass(frozen=True)
class XLA(Implementation):
    name: str = "xla"

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        B, T, N, H = query.shape
        S, K, G = call.S, call.K, call.G
        acc = call.acc_dtype
        U = B * K
        q = numerics.group_queries(query, K).reshape(U, G * T, H)
        units = lambda x: jnp.swapaxes(x, 1, 2).reshape(U, S, x.shape[-1])  # (B, S, K, .) -> (B*K, S, .)
        in_place = numerics.reads_heads_in_place(call)  # (B, S, K*H) rows against block-diagonal queries
        if in_place:
            qd = numerics.diagonal_queries(q.reshape(B, K, G * T, H))
            raw = numerics.diagonal_logits(qd, key.reshape(B, S, K * H), call.precision, acc)
        else:
            raw = numerics.key_logits(q, units(key), call.precision, acc, call.platform)
        bias = None if call.mask.bias is None else numerics.group_heads(call.mask.bias, K)
        logits = numerics.finish_logits(call, raw.reshape(B, K, G, T, S), bias)
        allowed = call.mask.dense_mask()
        allowed = None if allowed is None else jnp.broadcast_to(numerics.group_heads(allowed, K), logits.shape)
        weights, lse = numerics.softmax_parts(logits, allowed)
        if call.dropout_rate > 0.0:
            weights = numerics.dropout(weights, call.dropout_rate, dropout_rng)
        if in_place:
            out = numerics.diagonal_values(weights.reshape(B, K * G * T, S), value.reshape(B, S, -1), K,
                                           call.precision, acc)
        else:
            out = numerics.weighted_values(weights.reshape(U, G * T, S), units(value), call.precision, acc,
                                           call.platform)
        out = numerics.ungroup(out.reshape(B, K, G, T, -1)).astype(query.dtype)
        return Result(
            out=out,
            lse=numerics.ungroup(lse[..., None])[..., 0] if call.return_residual else None,
            weights=weights.reshape(B, N, T, S).astype(query.dtype) if call.return_weights else None,
        )
