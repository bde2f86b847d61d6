"""A pure key/value cache for autoregressive decoding: it goes into a layer and comes back out.

    cache = KVCache.create(batch=B, max_len=S, num_kv_heads=K, head_dim=H)
    out, cache = layer.apply(params, prompt, positions=jnp.arange(T)[None], cache=cache)   # prefill
    out, cache = layer.apply(params, token, positions=jnp.array([[T]]), cache=cache)       # one step

Every slot stores its key, value, position and segment id, so the masks of cached attention
(causal, sliding window, padding, packing) come from positions exactly as without a cache.
Empty slots have segment id -1 and are never attended to. All shapes are fixed, so a jitted
step compiles once.

A layer writes the new keys into their slots in place (``lax.dynamic_update_slice`` at the
write index; with the cache donated to a jitted step, see :func:`flax_attn.decode_step`, no
copy of the cache is made) and attends over the cache: unwritten slots are masked by their
segment id -1, and causal and window masks compare the stored positions, so nothing is
concatenated and no mask is rebuilt beyond the ``(B, 1, T, S)`` comparison of positions. The
layer also tells the attention core how many slots are written (``min(length, max_len)``, as
lengths whose slots past them hold zeros, never NaN), so a cache allocated for the longest
generation costs what it holds, not its capacity: on CPU a float32 one-token step over a
``'BKSH'`` or ``'BSKH'`` cache takes the compiled kernel (``implementation='cpu_native'``),
which reads the written slots where they lie; other steps (another dtype, head dims that are
not multiples of 16, a ``'blocks'`` cache, a chunk of tokens) visit only the key blocks in use
while at most half the cache is filled (``implementation='key_blocks'``; each visited block
is copied out of the cache first, so more than a cache of its fill's size costs;
:meth:`KVCache.reserve` grows a cache with its tokens instead, at a compilation of the step
per size).

A linear cache (the default) holds ``max_len`` tokens and raises on overflow. A rolling cache
(``rolling=True``) overwrites its oldest slots: for sliding-window attention it needs only
``max_len >= window - 1`` slots, whatever the sequence length (for chunked attention,
``chunk_size - 1``: a query sees at most the keys of its chunk). When a call's new tokens would
overwrite keys that its own queries still see (``max_len < window + T - 1``, e.g. a long
prefill into a small ring), the layer attends over the cached slots followed by the new keys
instead (a concatenation, as for any prefill that does not fit the ring).

**Layouts.** ``layout='BKSH'`` (the default) stores keys as ``(B*K, S, H)``: batch-major, then key/value heads, each head's S keys contiguous, which is what
the attention matmuls read (``B`` and ``K`` merged into one axis so that no axis of size 1 makes
XLA copy the cache around its in-place update when ``B == 1``); on CPU a decoding step then
makes no copy of the cache. ``layout='BSKH'`` stores ``(B, S, K, H)``, the order of
:func:`flax_attn.dot_product_attention`'s arguments: the key blocks
(:mod:`flax_attn.core.key_blocks`) then cut and regroup the slots in use block by block
however full the cache, where the plain pass would transpose all of it every step (on a CPU
with AVX-512 both read it where it lies instead, against block-diagonal queries); still
slower than ``'BKSH'`` there once the cache is mostly full (``benchmarks/decode.py`` measures
both). The compiled kernel reads either layout where it lies.
``layout='blocks'`` stores ``(S // block, B*K, block, H)``: block-major, each block of
``block`` slots (default :data:`BLOCK`, 128) of every (batch row, key/value head) one
contiguous array, so that the key blocks copy each block in use out of the cache as one
piece (XLA's CPU matmul reads whole arrays), where the other layouts' blocks are gathered
from many runs of slots, and past half the slots one pass reads every block in place. It is the layout for a cache
allocated much larger than its fill (a cache sized for the longest generation); once the cache
is mostly full a ``'BKSH'`` step is faster. A token is written to its block and row (one
token: a dynamic update slice; more: a scatter), in place when the cache is donated.
``max_len`` must be a whole number of blocks.
It is a CPU layout: elsewhere (a GPU's decoding kernel, the plain path) the attention reads
the ``(B, S, K, H)`` view, a transposed copy of the cache at every step.
The layer declares the layout to the attention (:func:`flax_attn.core.tuning.keys_stored`). :meth:`KVCache.keys` and
:meth:`KVCache.values` give the ``(B, S, K, H)`` view of any of them.

**Dtype.** The cache holds keys in the dtype the layer computes them in (the result type of
``x`` and the parameters). A layer given a cache of another dtype raises ``TypeError`` naming
both: nothing is rounded silently. ``Attention.init_cache`` / ``flax_attn.nnx.Attention.init_cache``
default to the layer's ``param_dtype``.

Positions only move forward in a linear cache: new tokens whose positions are not after every
cached one (padding, segment id < 0, excepted on both sides) raise ``ValueError`` (when the
compiled program runs, under ``jax.jit``). To go back, say so: ``cache.truncate(length)``
keeps the first ``length`` tokens (e.g. to rewind rejected draft tokens in speculative decoding).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core import mask as mask_lib


LAYOUTS = ("BSKH", "BKSH", "blocks")
BLOCK = 128  # slots a block of a layout='blocks' cache holds, by default
GROWTH = 1.25  # KVCache.reserve's default: grown by a quarter at least
OUT_OF_REACH = 1 << 30  # a key position no causal or window rule admits (positions stay below 2**29)


@flax.struct.dataclass
class KVCache:
    """Cached keys and values, positions and segment ids ``(B, S)``, and the fill level.

    With ``layout='BKSH'`` (default) keys are ``(B*K, S, H)`` and values ``(B*K, S, Hv)``
    (batch-major); with ``layout='BSKH'`` keys are ``(B, S, K, H)`` and values ``(B, S, K, Hv)``;
    with ``layout='blocks'`` keys are ``(S // block, B*K, block, H)`` (block-major; ``block``, a
    static field, is None for the other layouts) (:meth:`keys` / :meth:`values` give the ``(B,
    S, K, H)`` view of any).
    ``length`` (int32 scalar) counts the tokens written so far; ``rolling`` (static) says
    whether old slots are overwritten when full.
    """

    key: Any
    value: Any
    positions: Any
    segment_ids: Any
    length: Any
    rolling: bool = flax.struct.field(pytree_node=False, default=False)
    layout: str = flax.struct.field(pytree_node=False, default="BKSH")
    block: int | None = flax.struct.field(pytree_node=False, default=None)

    @classmethod
    def create(cls, *, batch: int, max_len: int, num_kv_heads: int, head_dim: int, value_dim: int | None = None,
               dtype=jnp.float32, rolling: bool = False, layout: str = "BKSH", block: int = BLOCK) -> "KVCache":
        """An empty cache of ``max_len`` slots (keys and values zero, segment ids -1).

        Args:
          batch, max_len, num_kv_heads, head_dim: B, S, K, H. value_dim: Hv (default H).
          dtype: of keys and values; must be the dtype of the keys the layer computes.
          rolling: overwrite the oldest slots when full (sliding-window attention only).
          layout: ``'BKSH'`` (the default: keys stored ``(B*K, S, H)``, read in place when decoding),
            ``'BSKH'`` (keys ``(B, S, K, H)``) or ``'blocks'`` (keys ``(S // block, B*K, block, H)``:
            each block of slots one contiguous array, for a cache much larger than its fill).
          block: slots per block of a ``'blocks'`` cache (default ``BLOCK``); ``max_len`` must be a
            multiple of it (``ValueError`` naming both otherwise).
        """
        for name, v in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            _checks.check_positive_int(name, v)
        _checks.check_one_of("layout", layout, LAYOUTS)
        value_dim = head_dim if value_dim is None else value_dim
        if layout == "blocks":
            _checks.check_positive_int("block", block)
            if max_len % block:
                raise ValueError(f"a layout='blocks' cache holds whole blocks: max_len={max_len} is not a multiple of "
                                 f"block={block} (take max_len={-(-max_len // block) * block}, or another block)")
            shape = lambda h: (max_len // block, batch * num_kv_heads, block, h)
        elif layout == "BSKH":
            shape = lambda h: (batch, max_len, num_kv_heads, h)
        else:
            shape = lambda h: (batch * num_kv_heads, max_len, h)
        return cls(
            key=jnp.zeros(shape(head_dim), dtype),
            value=jnp.zeros(shape(value_dim), dtype),
            positions=jnp.zeros((batch, max_len), jnp.int32),
            segment_ids=jnp.full((batch, max_len), -1, jnp.int32),
            length=jnp.zeros((), jnp.int32),
            rolling=rolling,
            layout=layout,
            block=block if layout == "blocks" else None,
        )

    @property
    def max_len(self) -> int:
        return self.positions.shape[1]

    @property
    def dtype(self):
        return self.key.dtype

    def _bskh(self, x):
        if self.layout == "BSKH":
            return x
        B = self.positions.shape[0]
        if self.layout == "blocks":  # (S/c, B*K, c, h) -> (B, S, K, h)
            n, U, c, h = x.shape
            return x.reshape(n, B, U // B, c, h).transpose(1, 0, 3, 2, 4).reshape(B, n * c, U // B, h)
        return jnp.swapaxes(x.reshape((B, x.shape[0] // B) + x.shape[1:]), 1, 2)

    def _stored(self, x):
        """New entries ``(B, T, K, H)`` in the cache's layout (as given for ``'blocks'``, written by
        :meth:`_put_blocks`)."""
        if self.layout in ("BSKH", "blocks"):
            return x
        B, T, K, H = x.shape
        return jnp.swapaxes(x, 1, 2).reshape(B * K, T, H)

    def keys(self):
        """The cached keys as ``(B, S, K, H)`` (a transposed view for ``layout='BKSH'``)."""
        return self._bskh(self.key)

    def values(self):
        """The cached values as ``(B, S, K, Hv)``."""
        return self._bskh(self.value)

    def check_compatible(self, key, value, positions, segment_ids) -> None:
        """Shapes of new entries ``(B, T, K, H)``, ``(B, T, K, Hv)``, ``(B, T)``, ``(B, T)``."""
        B, S, K, H = self.keys().shape
        T = key.shape[1]
        if key.shape != (B, T, K, H) or value.shape != (B, T, K, self.value.shape[-1]):
            raise ValueError(f"new keys {key.shape} / values {value.shape} do not fit the cache's "
                             f"keys {self.keys().shape} / values {self.values().shape} (B, S, K, H)")
        if positions.shape != (B, T) or segment_ids.shape != (B, T):
            raise ValueError(f"positions {positions.shape} and segment_ids {segment_ids.shape} must be {(B, T)}")
        if not self.rolling and T > S:
            raise ValueError(f"{T} new tokens do not fit a cache of max_len={S}")

    def check_dtype(self, key) -> None:
        """``TypeError`` unless new keys ``key`` have the cache's dtype (nothing is rounded silently)."""
        new, held = _checks.dtype_of(key), self.key.dtype
        if new != held:
            raise TypeError(f"KV cache dtype {held} does not match the keys' dtype {new}: create the cache "
                            f"with dtype={new} (layer.init_cache(...) follows the layer's param_dtype; "
                            f"config.init_cache(..., dtype=...))")

    def holds_window(self, new_tokens: int, sliding_window) -> bool:
        """Whether, after ``new_tokens`` are written, the cache still holds every key that their
        queries may see (always for a linear cache; a rolling one needs
        ``max_len >= sliding_window + new_tokens - 1``). Static: decided at trace time."""
        if not self.rolling:
            return True
        return sliding_window is not None and self.max_len >= sliding_window + new_tokens - 1

    def update(self, key, value, positions, segment_ids) -> "KVCache":
        """The cache with ``T`` new entries written after the ``length`` already there.

        ``key`` ``(B, T, K, H)``, ``value`` ``(B, T, K, Hv)``, ``positions`` and ``segment_ids``
        ``(B, T)`` int. Written in place with ``lax.dynamic_update_slice`` (a rolling cache
        taking more than one token at once scatters into its ring).
        """
        self.check_compatible(key, value, positions, segment_ids)
        positions, segment_ids = stored_ints("positions", positions), stored_ints("segment_ids", segment_ids)
        S, T = self.max_len, key.shape[1]
        key, value = self._stored(key), self._stored(value)  # slots are axis 1 of every array
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
            start = self.length
        elif T == 1:
            start = self.length % S
        else:
            keep = min(T, S)  # of T new tokens only the last S can be held
            slots = (self.length + T - keep + jnp.arange(keep)) % S

            def scatter(buf, new):
                return buf.at[:, slots].set(new[:, T - keep:].astype(buf.dtype))

            if self.layout == "blocks":
                return self.replace(key=self._put_blocks(self.key, key, slots, T - keep),
                                    value=self._put_blocks(self.value, value, slots, T - keep),
                                    positions=scatter(self.positions, positions),
                                    segment_ids=scatter(self.segment_ids, segment_ids), length=self.length + T)
            return self.replace(key=scatter(self.key, key), value=scatter(self.value, value),
                                positions=scatter(self.positions, positions),
                                segment_ids=scatter(self.segment_ids, segment_ids), length=self.length + T)

        def write(buf, new):
            return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=1)

        if self.layout == "blocks":
            slots = start + jnp.arange(T)
            key, value = self._put_blocks(self.key, key, slots, 0), self._put_blocks(self.value, value, slots, 0)
        else:
            key, value = write(self.key, key), write(self.value, value)
        return self.replace(key=key, value=value,
                            positions=write(self.positions, positions),
                            segment_ids=write(self.segment_ids, segment_ids), length=self.length + T)

    def _put_blocks(self, buf, new, slots, first: int):
        """``buf`` ``(S/c, B*K, c, h)`` with tokens ``first..`` of ``new`` ``(B, T, K, h)`` written
        at ``slots`` (one per token): slot s is row ``s % c`` of block ``s // c`` (one token: a
        dynamic update slice; more: a scatter, which XLA's CPU runtime computes in float32 for
        narrower caches; either in place when the cache is donated)."""
        B, T, K, h = new.shape
        c = self.block
        units = jnp.swapaxes(jnp.swapaxes(new[:, first:], 1, 2).reshape(B * K, T - first, h), 0, 1).astype(buf.dtype)
        if T - first == 1:  # a decoding step: one slot, an update in place in the cache's own dtype
            slot = slots[0]
            return jax.lax.dynamic_update_slice(buf, units.reshape(1, B * K, 1, h), (slot // c, 0, slot % c, 0))
        return buf.at[slots // c, :, slots % c].set(units)

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
        return truncate_slots(self, length, key=0, value=0, positions=0, segment_ids=-1)

    def resize(self, max_len: int) -> "KVCache":
        """The same tokens in a cache of ``max_len`` slots: new slots empty, or empty slots past
        the tokens dropped (a linear cache; ``max_len`` at least ``length``, a whole number of
        blocks for ``layout='blocks'``; ``ValueError`` otherwise). A copy of the cache; a step
        compiled for the old size compiles again for the new one. See :meth:`reserve`."""
        return resize_slots(self, max_len, key=0, value=0, positions=0, segment_ids=-1)

    def reserve(self, tokens: int, growth: float = GROWTH) -> "KVCache":
        """This cache if it holds ``tokens`` slots, else the same tokens in a larger one
        (:meth:`resize`): ``growth`` times the slots at least, rounded up to a whole number of
        :data:`BLOCK` slots (of ``block`` for a ``'blocks'`` cache).

        ``tokens`` (an int) is what the cache must hold after the next step (the prompt and
        every token so far, plus the step's). Grown this way from about the prompt's size, a
        cache stays at least ``1 / growth`` full, so a decoding step reads little more than the
        tokens it holds, where a cache allocated for the longest generation is read in key
        blocks while mostly empty (slower than PyTorch's step over its filled slots: the README's
        Known limits, "Decoding outside the target's cells"). Each new size costs one copy of the cache and one compilation of the
        step (``log(longest / prompt) / log(growth)`` of them; 0.4-0.7 s each for a 768-wide
        layer on a 2-core AMD EPYC), so growing pays for long generations and large batches, or
        where the sizes are compiled already (JAX's persistent compilation cache keeps them for
        later processes), not for one short generation in a fresh process (``python -m
        benchmarks.decode --generation`` measures both ways)::

            cache = layer.init_cache(B, prompt_len)
            for t in range(prompt_len, prompt_len + steps):
                cache = cache.reserve(t + 1)
                out, cache = step(params, cache, token, positions)
        """
        return reserve_slots(self, tokens, growth, self.block or BLOCK)


def stored_ints(name: str, x):
    """``x`` (int positions or segment ids ``(B, T)``) as the int32 a cache stores. Where JAX
    holds it wider (int64 or uint32 and up, with ``jax_enable_x64``) a value outside int32's range
    is a ``ValueError`` naming ``name`` (at once when concrete, when the program runs when
    traced: :func:`flax_attn._checks.runtime_check`), never wrapped."""
    if x is None:
        return None
    dtype = _checks.dtype_of(x)
    if np.iinfo(dtype).max > np.iinfo(np.int32).max:
        info = np.iinfo(np.int32)
        traced = isinstance(x, jax.core.Tracer)
        low, high = (jnp.min(x), jnp.max(x)) if traced else (np.min(np.asarray(x)), np.max(np.asarray(x)))
        _checks.runtime_check((low >= info.min) & (high <= info.max),
                              name + " must fit int32 to be stored in a KV cache, got values from {low} to {high}",
                              low=low, high=high)
    return jnp.asarray(x).astype(jnp.int32)


def reserve_slots(cache, tokens: int, growth: float, multiple: int):
    """``cache`` if its ``max_len`` is at least ``tokens``, else ``cache.resize`` to at least
    ``growth`` times its slots and ``tokens``, rounded up to a multiple of ``multiple``: the
    ``reserve`` of :class:`KVCache` and of the latent cache."""
    if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)):
        raise TypeError(f"reserve(tokens): tokens must be an int (the tokens the cache must hold), got {tokens!r}")
    _checks.check_positive_int("reserve tokens", int(tokens))
    if isinstance(growth, bool) or not (isinstance(growth, (int, float, np.integer, np.floating)) and growth > 1):
        raise ValueError(f"reserve(growth={growth!r}): growth must be a number above 1")
    if tokens <= cache.max_len:
        return cache
    want = max(int(tokens), int(np.ceil(cache.max_len * growth)))
    return cache.resize(-(-want // multiple) * multiple)


def resize_slots(cache, max_len: int, **fills):
    """``cache`` with ``max_len`` slots: each array named in ``fills`` (its slots on axis 1, or
    the blocks on axis 0 of a ``'blocks'`` layout's keys and values) cut or extended with its
    fill value. The ``resize`` of :class:`KVCache` and of the latent cache."""
    _checks.check_positive_int("resize max_len", max_len)
    if getattr(cache, "rolling", False):
        raise ValueError("a rolling cache cannot be resized: its tokens lie in a ring of max_len slots; create a new "
                         "one of the size wanted (a window needs max_len >= window - 1)")
    block = getattr(cache, "block", None)
    if block is not None and max_len % block:
        raise ValueError(f"a layout='blocks' cache holds whole blocks: resize(max_len={max_len}) is not a multiple of "
                         f"block={block} (take max_len={-(-max_len // block) * block})")
    _checks.runtime_check(cache.length <= max_len,
                          "resize(max_len={max_len}): the cache holds {length} tokens, more than max_len",
                          max_len=max_len, length=cache.length)

    def sized(buf, fill):
        axis, n = (0, max_len // block) if block is not None and buf.ndim == 4 else (1, max_len)
        have = buf.shape[axis]
        if n == have:
            return jnp.array(buf, copy=True)
        if n < have:
            return jax.lax.slice_in_dim(buf, 0, n, axis=axis)
        pad = [(0, 0)] * buf.ndim
        pad[axis] = (0, n - have)
        return jnp.pad(buf, pad, constant_values=jnp.asarray(fill, buf.dtype))

    # A copy: nothing shared with ``cache``, which a step may donate (or keep) independently.
    return cache.replace(length=jnp.array(cache.length, copy=True),
                         **{name: sized(getattr(cache, name), fill) for name, fill in fills.items()})


def truncate_slots(cache, length, **fills):
    """``cache`` holding only its first ``length`` tokens: each array named in ``fills`` (its
    slots on axis 1) set to its fill value beyond them, ``cache.length`` to ``length``. The
    ``truncate`` of :class:`KVCache` and of the latent cache. ``length``: an int or an int32
    scalar (traced under ``jax.jit``) in ``[0, cache.length]`` (``ValueError`` otherwise, at run
    time under ``jax.jit``)."""
    if isinstance(length, bool) or not (isinstance(length, (int, np.integer)) or (
            hasattr(length, "dtype") and jnp.issubdtype(length.dtype, jnp.integer) and jnp.ndim(length) == 0)):
        raise TypeError(f"truncate(length): length must be an integer scalar, got {length!r}")
    length = jnp.asarray(length, jnp.int32)
    _checks.runtime_check((length >= 0) & (length <= cache.length),
                          "truncate(length={length}): length must lie in [0, {cached}], the tokens cached",
                          length=length, cached=cache.length)
    keep = jnp.arange(cache.max_len) < length

    block = getattr(cache, "block", None)

    def empty(buf, fill):
        if block is not None and buf.ndim == 4:  # a 'blocks' layout's keys or values, (S/c, B*K, c, h)
            shape = (buf.shape[0], 1, block, 1)
        else:  # slots on axis 1
            shape = (1, -1) + (1,) * (buf.ndim - 2)
        return jnp.where(keep.reshape(shape), buf, jnp.asarray(fill, buf.dtype))

    return cache.replace(length=length, **{name: empty(getattr(cache, name), fill) for name, fill in fills.items()})


def one_query_key_positions(key_positions, key_segments, segment_ids):
    """Key positions ``(B, S)`` for one query per row ``(B, 1)`` under a causal or window rule:
    a slot the query may not see by its segment rule (another segment, padding, an unwritten
    slot: segment id -1) moved out of reach of every such rule. The call then needs no segment
    ids, so the core zeroes no cached keys (a pass over the whole cache)."""
    same = (key_segments == segment_ids) & (key_segments >= 0)
    return jnp.where(same, key_positions, OUT_OF_REACH)


def combined_mask(rules, mask, *, written=None, batch=None):
    """One mask description (:mod:`flax_attn.core.mask`) for attending over a cache, or None.

    Args:
      rules: mask descriptions to include (e.g. a chunk rule).
      mask: the caller's mask: a description, a boolean array broadcastable to ``(B, N, T, S)``
        (True = may attend), or None.
      written: with a cache attended over in place, how many leading slots hold tokens (int32
        scalar). The slots past them are blocked already (segment id -1, or out of reach) and
        hold zeros or old keys, never NaN; saying so with a ``finite_past_lengths`` rule lets
        the core skip them (a decoding step costs what the cache holds, not its capacity) and
        zero nothing. Left out when ``mask`` gives key/value lengths of its own.
      batch: B, with ``written``.
    """
    rules = list(rules)
    if written is not None and getattr(mask, "kv_lengths", None) is None:
        rules.append(mask_lib.lengths(key_value_seq_lengths=jnp.broadcast_to(written, (batch,)),
                                      finite_past_lengths=True))
    if mask is not None:
        rules.append(mask if isinstance(mask, mask_lib.Mask) else mask_lib.dense(mask))
    return functools.reduce(operator.and_, rules) if rules else None


@flax.struct.dataclass
class ContextKV:
    """Cross-attention keys and values computed once from a context, reused by every call.

    Made by ``Attention.context_kv`` (Linen: ``layer.apply(variables, context, context_positions,
    method='context_kv')``; NNX: ``layer.context_kv(context, context_positions)``) and passed
    as the layer's ``context=``: an encoder-decoder's decoder then projects the encoder output
    once, not at every decoding step.

    ``key`` and ``value`` ``(B, S, K, H)``: after projection, QK-norm and RoPE (the context's
    positions); ``positions`` and ``segment_ids`` ``(B, S)`` int32, or None when not given.
    A pytree: it goes through ``jax.jit`` as an argument.
    """

    key: Any
    value: Any
    positions: Any = None
    segment_ids: Any = None

    @property
    def dtype(self):
        return self.key.dtype

    def check_fits(self, batch: int, num_kv_heads: int, head_dim: int) -> None:
        """``ValueError`` unless keys and values are ``(batch, S, num_kv_heads, head_dim)`` and
        positions and segment ids (when held) ``(batch, S)``."""
        if getattr(self.key, "ndim", None) != 4 or getattr(self.value, "ndim", None) != 4:
            raise ValueError(f"ContextKV keys {_checks.shape_of(self.key)} and values {_checks.shape_of(self.value)} "
                             f"must be (B, S, K, H)")
        want = (batch, self.key.shape[1], num_kv_heads, head_dim)
        if self.key.shape != want or self.value.shape != want:
            raise ValueError(f"ContextKV keys {self.key.shape} / values {self.value.shape} do not fit this layer and "
                             f"x: expected (B, S, K, H) = {want} (batch {batch}, {num_kv_heads} key/value heads of "
                             f"{head_dim})")
        for name in ("positions", "segment_ids"):
            a = getattr(self, name)
            if a is not None and _checks.shape_of(a) != want[:2]:
                raise ValueError(f"ContextKV {name} have shape {_checks.shape_of(a)}, expected {want[:2]}")

    def check_dtype(self, query) -> None:
        """``TypeError`` unless the keys have the dtype of the layer's queries ``query`` (the
        dtype keys computed from a raw context of ``x``'s dtype would have)."""
        new, held = _checks.dtype_of(query), self.key.dtype
        if new != held or self.value.dtype != held:
            raise TypeError(f"ContextKV keys/values of dtype {held}/{self.value.dtype} do not match the layer's "
                            f"queries' dtype {new}: make the ContextKV from a context of the dtype of x")
