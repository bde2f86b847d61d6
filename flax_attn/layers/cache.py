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

Positions only move forward in a linear cache: new tokens whose positions are not after every
cached one (padding, segment id < 0, excepted on both sides) raise ``ValueError`` (when the
compiled program runs, under ``jax.jit``). To go back, say so: ``cache.truncate(length)``
keeps the first ``length`` tokens (e.g. to rewind rejected draft tokens in speculative decoding).
"""
from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

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
            # Positions go forward: each row's new (non-padding) positions after its cached ones.
            # Not checked when the write overflows (that error comes first, and alone).
            filled = (jnp.arange(S) < self.length)[None, :] & (self.segment_ids >= 0)
            cached_max = jnp.max(jnp.where(filled, self.positions, jnp.iinfo(jnp.int32).min), axis=1)
            new_min = jnp.min(jnp.where(segment_ids >= 0, positions, jnp.iinfo(jnp.int32).max), axis=1)
            _checks.runtime_check(
                jnp.all(new_min > cached_max) | (self.length + T > S),
                "KV cache positions go backwards: new positions (smallest per row {new}) must come after the "
                "cached ones (largest per row {cached}); to roll back, call cache.truncate(length) first",
                new=new_min, cached=cached_max)
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

    def truncate(self, length) -> "KVCache":
        """The cache holding only its first ``length`` tokens (a linear cache): the rest emptied.

        The explicit way to roll back (rewind rejected draft tokens, regenerate from a point):
        afterwards new positions need only come after those of the tokens kept. ``length`` is
        an int or an int32 scalar (traced under ``jax.jit``), ``0 <= length <= self.length``
        (``ValueError`` otherwise, at run time under ``jax.jit``). A rolling cache has already
        overwritten old tokens and cannot be rolled back: ``ValueError``.
        """
        if self.rolling:
            raise ValueError("a rolling cache cannot be truncated: its slots are overwritten in a ring, so the "
                             "first tokens are gone; keep a linear cache (rolling=False) to roll back")
        if isinstance(length, bool) or not (isinstance(length, (int, np.integer)) or (
                hasattr(length, "dtype") and jnp.issubdtype(length.dtype, jnp.integer) and jnp.ndim(length) == 0)):
            raise TypeError(f"truncate(length): length must be an integer scalar, got {length!r}")
        length = jnp.asarray(length, jnp.int32)
        _checks.runtime_check((length >= 0) & (length <= self.length),
                              "truncate(length={length}): length must lie in [0, {cached}], the tokens cached",
                              length=length, cached=self.length)
        keep = jnp.arange(self.max_len) < length
        empty = lambda buf, fill: jnp.where(keep.reshape((1, -1) + (1,) * (buf.ndim - 2)), buf,
                                            jnp.asarray(fill, buf.dtype))
        return self.replace(key=empty(self.key, 0), value=empty(self.value, 0), positions=empty(self.positions, 0),
                            segment_ids=empty(self.segment_ids, -1), length=length)
