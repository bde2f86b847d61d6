"""T5 relative position bias (Raffel et al., 2020, section 2.1).

Each head learns one scalar per *bucket* of relative position ``k_pos - q_pos``: exact buckets
for small distances, logarithmically wider ones up to ``max_distance``, beyond which all
distances share the last bucket. Bidirectional (encoders) spends half the buckets on each
direction; one-sided (decoders) maps every future offset to bucket 0 and spends all buckets
on the past.
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.core.mask import check_position_pair


def relative_position_bucket(relative_position, *, bidirectional: bool = True, num_buckets: int = 32,
                             max_distance: int = 128):
    """Bucket of each relative position ``k_pos - q_pos`` (int array, any shape) -> int32 same shape.

    With ``num_buckets=32, max_distance=128`` bidirectionally: offsets 0..7 are buckets 0..7 for
    keys before (or at) the query and 16..23 after it; 8..127 share buckets 8..15 (24..31)
    logarithmically; 128 and beyond fall in 15 (31). The log is taken in float32, as T5 does.
    """
    _checks.check_positive_int("num_buckets", num_buckets)
    _checks.check_positive_int("max_distance", max_distance)
    _checks.check_integer("relative_position", relative_position)
    rel = _checks.as_positions(relative_position)
    given = num_buckets
    buckets = jnp.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).astype(jnp.int32) * num_buckets
        rel = jnp.abs(rel)
    else:
        rel = -jnp.minimum(rel, 0)
    max_exact = num_buckets // 2
    if max_exact < 1 or max_distance <= max_exact:
        raise ValueError(f"need num_buckets >= {4 if bidirectional else 2} and max_distance > {max_exact}, "
                         f"got num_buckets={given}, max_distance={max_distance}")
    is_small = rel < max_exact
    # float32 throughout: rel / max_exact, divided by log(max_distance / max_exact) as a float32.
    log_ratio = jnp.log(jnp.maximum(rel, 1).astype(jnp.float32) / max_exact)
    large = max_exact + (log_ratio / jnp.float32(math.log(max_distance / max_exact))
                         * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return (buckets + jnp.where(is_small, rel, large)).astype(jnp.int32)


def t5_bias(table, query_positions, key_positions, *, bidirectional: bool = True, max_distance: int = 128):
    """Bias ``(N, T, S)`` or ``(B, N, T, S)`` from a learned ``table`` of shape ``(num_buckets, N)``.

    ``bias[..., n, t, s] = table[bucket(key_positions[s] - query_positions[t]), n]``
    (:func:`relative_position_bucket`).

    Args:
      table: ``(num_buckets, N)``; ``num_buckets`` is its first dim.
      query_positions: int ``(T,)`` or ``(B, T)``.
      key_positions: int ``(S,)`` or ``(B, S)``; a batch dim on both sides must be equal, or 1
        on one side.
      bidirectional: half the buckets for each direction (encoders); False: one-sided (decoders).
      max_distance: distances from this one on share the last bucket.

    Returns:
      ``(N, T, S)`` when both positions are 1-D, else ``(B, N, T, S)``: a ``bias`` for
      :func:`flax_attn.dot_product_attention`.
    """
    _checks.check_rank("table", table, 2, "(num_buckets, N)")
    query_positions, key_positions = check_position_pair("query_positions", query_positions, "key_positions",
                                                         key_positions)
    buckets = relative_position_bucket(
        key_positions[..., None, :] - query_positions[..., :, None],
        bidirectional=bidirectional, num_buckets=table.shape[0], max_distance=max_distance)
    return jnp.moveaxis(jnp.take(table, buckets, axis=0), -1, -3)  # (..., T, S, N) -> (..., N, T, S)
