"""Causal load balancing for context parallelism: reorder the sequence before splitting it.

Split in order over P devices, a causal mask leaves device 0's queries almost nothing to attend
to and device P-1's the most: with the ring, devices wait for the slowest. Reordering the tokens
evens the work (Brandon et al. 2023, "Striped Attention"; the zig-zag of Megatron-LM's context
parallelism and ring-flash-attention):

* ``'zigzag'``: cut the sequence into 2P chunks; device r takes chunks r and 2P-1-r (an early
  and a late one). Needs the length divisible by 2P.
* ``'striped'``: token t goes to device t mod P. Needs the length divisible by P.

The masks stay correct because positions are explicit: reorder the tokens **and their
positions** (and segment ids) with the same permutation, pass the positions to the attention
(or the layer), and restore the order of the outputs afterwards::

    pos = load_balance(jnp.broadcast_to(jnp.arange(T), (B, T)), P)    # (B, T) reordered positions
    out = ring_attention(load_balance(q, P), load_balance(k, P), load_balance(v, P), mesh=mesh,
                         is_causal=True, query_positions=pos, key_positions=pos)
    out = restore_order(out, P)                                        # (B, T, N, H), original order

Lengths index tokens in the original order; turn them into segment ids first
(:func:`padding_segment_ids`) so that they move with their tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core import mask as mask_lib

SCHEMES = ("zigzag", "striped")


def permutation(length: int, num_shards: int, scheme: str = "zigzag") -> np.ndarray:
    """``perm`` ``(length,)`` int: the reordered sequence is ``x[perm]`` (position i holds token perm[i]).

    Device r of ``num_shards`` then holds ``perm[r*L/P : (r+1)*L/P]``.
    """
    _checks.check_positive_int("length", length)
    _checks.check_positive_int("num_shards", num_shards)
    _checks.check_one_of("scheme", scheme, SCHEMES)
    if scheme == "zigzag":
        if length % (2 * num_shards):
            raise ValueError(f"zig-zag load balancing cuts the sequence into 2 x {num_shards} chunks: its length "
                             f"{length} must be divisible by {2 * num_shards} (pad it, e.g. with segment id -1)")
        chunks = np.arange(length).reshape(2 * num_shards, -1)
        order = [c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)]
        return chunks[order].reshape(-1)
    if length % num_shards:
        raise ValueError(f"striped load balancing deals tokens to {num_shards} devices: the length {length} must be "
                         f"divisible by {num_shards}")
    return np.arange(length).reshape(-1, num_shards).T.reshape(-1)


def load_balance(x, num_shards: int, *, axis: int = 1, scheme: str = "zigzag"):
    """Reorder ``x`` (an array or a pytree of arrays, e.g. ``(B, T, ...)``) along ``axis`` by
    :func:`permutation`, before splitting it over ``num_shards`` devices."""
    return jax.tree_util.tree_map(lambda a: _take(a, num_shards, axis, scheme, inverse=False), x)


def restore_order(x, num_shards: int, *, axis: int = 1, scheme: str = "zigzag"):
    """The inverse of :func:`load_balance`: outputs back in the original order."""
    return jax.tree_util.tree_map(lambda a: _take(a, num_shards, axis, scheme, inverse=True), x)


def _take(a, num_shards, axis, scheme, inverse):
    length = np.shape(a)[axis]
    perm = permutation(length, num_shards, scheme)
    if inverse:
        perm = np.argsort(perm)
    return jnp.take(a, jnp.asarray(perm), axis=axis)


def padding_segment_ids(lengths, length: int, segment_ids=None):
    """``(B, length)`` int32 segment ids with -1 (padding: never attended, attends to nothing)
    at every index ``>= lengths[b]``; ``segment_ids`` ``(B, length)`` (default 0) elsewhere.

    Lengths count tokens in the original order; segment ids travel with their tokens through
    :func:`load_balance`, so padding stays where it belongs.
    """
    inside = mask_lib.padding_mask(lengths, length, name="lengths")
    ids = jnp.zeros(inside.shape, jnp.int32) if segment_ids is None else jnp.asarray(segment_ids, jnp.int32)
    if ids.shape != inside.shape:
        raise ValueError(f"segment_ids of shape {ids.shape} must have shape {inside.shape} "
                         f"(lengths {np.shape(lengths)}, length {length})")
    return jnp.where(inside, ids, -1)
