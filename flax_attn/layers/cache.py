"""A pure key/value cache for autoregressive decoding: it goes into a layer and comes back out.

    cache = KVCache.create(batch=B, max_len=S, num_kv_heads=K, head_dim=H)
    out, cache = layer.apply(params, prompt, positions=jnp.arange(T)[None], cache=cache)   # prefill
    out, cache = layer.apply(params, token, positions=jnp.array([[T]]), cache=cache)       # one step

Every slot stores its key, value, position and segment id, so the masks of cached attention
(causal, sliding window, padding, packing) come from positions exactly as without a cache.
Empty slots have segment id -1 and are never attended to. All shapes are fixed, so a jitted
step compiles once.

A layer attends over the cached slots followed by the new keys, then writes the new keys into
the cache. A linear cache (the default) holds ``max_len`` tokens and raises on overflow. A
rolling cache (``rolling=True``) overwrites its oldest slots: for sliding-window attention it
needs only ``max_len >= window - 1`` slots, whatever the sequence length.
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from flax_attn import _checks


@flax.struct.dataclass
class KVCache:
    """Cached keys ``(B, S, K, H)``, values ``(B, S, K, Hv)``, positions and segment ids ``(B, S)``.

    ``length`` (int32 scalar) counts the tokens written so far; ``rolling`` (static) says
    whether old slots are overwritten when full.
    """

    key: Any
    value: Any
    positions: Any
    segment_ids: Any
    length: Any
    rolling: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def create(cls, *, batch: int, max_len: int, num_kv_heads: int, head_dim: int, value_dim: int | None = None,
               dtype=jnp.float32, rolling: bool = False) -> "KVCache":
        """An empty cache of ``max_len`` slots."""
        for name, v in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            _checks.check_positive_int(name, v)
        value_dim = head_dim if value_dim is None else value_dim
        return cls(
            key=jnp.zeros((batch, max_len, num_kv_heads, head_dim), dtype),
            value=jnp.zeros((batch, max_len, num_kv_heads, value_dim), dtype),
            positions=jnp.zeros((batch, max_len), jnp.int32),
            segment_ids=jnp.full((batch, max_len), -1, jnp.int32),
            length=jnp.zeros((), jnp.int32),
            rolling=rolling,
        )

    @property
    def max_len(self) -> int:
        return self.key.shape[1]

    def check_compatible(self, key, value, positions, segment_ids) -> None:
        """Shapes of new entries ``(B, T, K, H)``, ``(B, T, K, Hv)``, ``(B, T)``, ``(B, T)``."""
        B, S, K, H = self.key.shape
        T = key.shape[1]
        if key.shape != (B, T, K, H) or value.shape != (B, T, K, self.value.shape[-1]):
            raise ValueError(f"new keys {key.shape} / values {value.shape} do not fit the cache's "
                             f"keys {self.key.shape} / values {self.value.shape}")
        if positions.shape != (B, T) or segment_ids.shape != (B, T):
            raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must be {(B, T)}")
        if not self.rolling and T > S:
            raise ValueError(f"{T} new tokens do not fit a cache of max_len={S}")

    def update(self, key, value, positions, segment_ids) -> "KVCache":
        """The cache with ``T`` new entries written after the ``length`` already there."""
        self.check_compatible(key, value, positions, segment_ids)
        S, T = self.max_len, key.shape[1]
        if not self.rolling:
            _checks.runtime_check(
                self.length + T <= S,
                "KV cache overflow: {length} cached + {new} new tokens > max_len={max_len}; "
                "create a larger cache (KVCache.create(max_len=...)) or a rolling one for a sliding window",
                length=self.length, new=T, max_len=S)
            write = lambda buf, new: jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), self.length, axis=1)
        else:
            keep = min(T, S)  # of T new tokens only the last S can be held
            slots = (self.length + T - keep + jnp.arange(keep)) % S
            write = lambda buf, new: buf.at[:, slots].set(new[:, T - keep:].astype(buf.dtype))
        return self.replace(
            key=write(self.key, key), value=write(self.value, value),
            positions=write(self.positions, positions), segment_ids=write(self.segment_ids, segment_ids),
            length=self.length + T,
        )
