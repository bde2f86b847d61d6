"""Boolean attention masks as small pure functions. True means "may attend".

Every structured mask is built from explicit integer positions, never from an implicit
``arange`` inside a layer: that is what lets the same code serve packed sequences, KV
caches and offsets. Shapes: positions are ``(B, T)`` / ``(B, S)`` or unbatched ``(T,)`` /
``(S,)``; masks come back as ``(..., T, S)`` with the batch dimension first when present.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np

from flax_attn import _checks

Window = Union[int, Tuple[int, int]]


def create_causal_mask(seq_len: int) -> jnp.ndarray:
    """Lower-triangular ``(seq_len, seq_len)`` boolean mask: query t may attend to keys 0..t.

    The JAX counterpart of the Transformer notes' ``create_causal_mask``, which returns
    ``torch.tril(torch.ones(seq_len, seq_len))`` as floats (1 = attend). Here the mask is
    boolean with the same meaning, as every flax_attn mask is.
    """
    _checks.check_positive_int("seq_len", seq_len)
    return jnp.tril(jnp.ones((seq_len, seq_len), dtype=bool))


def default_positions(query_len: int, key_len: int) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Positions used when none are given: keys at ``0..S-1``, queries at the last T of them.

    Queries are aligned with the *end* of the keys (query t sits at key position
    ``t + S - T``), as when decoding with a cache; for self-attention (T == S) this is
    the ordinary alignment.
    """
    key_pos = jnp.arange(key_len, dtype=jnp.int32)
    query_pos = jnp.arange(query_len, dtype=jnp.int32) + (key_len - query_len)
    return query_pos, key_pos


def _check_position_pair(q_name, q, k_name, k):
    _checks.check_integer(q_name, q)
    _checks.check_integer(k_name, k)
    _checks.check_rank(q_name, q, (1, 2), "(T,) or (B, T)")
    _checks.check_rank(k_name, k, (1, 2), "(S,) or (B, S)")
    qb, kb = _checks.shape_of(q)[:-1], _checks.shape_of(k)[:-1]
    if qb and kb and qb != kb and 1 not in (qb[0], kb[0]):
        raise ValueError(f"{q_name} {_checks.shape_of(q)} and {k_name} {_checks.shape_of(k)} have different batches")


def causal_mask(query_positions, key_positions) -> jnp.ndarray:
    """``mask[..., t, s] = key_positions[s] <= query_positions[t]``. Shape ``(..., T, S)``."""
    _check_position_pair("query_positions", query_positions, "key_positions", key_positions)
    return key_positions[..., None, :] <= query_positions[..., :, None]


def normalize_window(local_window_size: Optional[Window]) -> Optional[tuple[int, int]]:
    """``int w`` -> ``(w, w)``; ``(left, right)`` is kept. Raises on negative or non-integer sizes.

    A window ``(left, right)`` admits ``left + 1 + right`` keys around the query: the
    ``jax.nn.dot_product_attention`` convention. A causal sliding window that holds W keys
    including the current one (the Mistral convention) is ``(W - 1, 0)``.
    """
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
        window = (int(local_window_size), int(local_window_size))
    elif (
        isinstance(local_window_size, (tuple, list))
        and len(local_window_size) == 2
        and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in local_window_size)
    ):
        window = (int(local_window_size[0]), int(local_window_size[1]))
    else:
        raise TypeError(
            f"local_window_size must be an int or a (left, right) pair of ints, got {local_window_size!r}"
        )
    if window[0] < 0 or window[1] < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    return window


def window_mask(query_positions, key_positions, local_window_size: Window) -> jnp.ndarray:
    """Keys within ``left`` positions before and ``right`` after the query. Shape ``(..., T, S)``."""
    left, right = normalize_window(local_window_size)
    _check_position_pair("query_positions", query_positions, "key_positions", key_positions)
    offset = query_positions[..., :, None] - key_positions[..., None, :]
    return (offset <= left) & (offset >= -right)


def length_mask(query_len: int, key_len: int, query_seq_lengths=None, key_value_seq_lengths=None):
    """Padding mask from per-sequence lengths ``(B,)``: entries past a length are blocked.

    Returns ``(B, T, S)``, or None when neither length is given.
    """
    if query_seq_lengths is None and key_value_seq_lengths is None:
        return None
    mask = jnp.ones((1, query_len, key_len), dtype=bool)
    if query_seq_lengths is not None:
        mask = mask & padding_mask(query_seq_lengths, query_len, name="query_seq_lengths")[:, :, None]
    if key_value_seq_lengths is not None:
        mask = mask & padding_mask(key_value_seq_lengths, key_len, name="key_value_seq_lengths")[:, None, :]
    return mask


def segment_mask(query_segment_ids, key_segment_ids) -> jnp.ndarray:
    """Packed sequences: attend only within the same segment. Shape ``(..., T, S)``.

    Negative ids mark padding: such a key is never attended to, and such a query attends to
    nothing (its output is zeros).
    """
    _check_position_pair("query_segment_ids", query_segment_ids, "key_segment_ids", key_segment_ids)
    keys = key_segment_ids[..., None, :]
    return (query_segment_ids[..., :, None] == keys) & (keys >= 0)


def padding_mask(lengths, seq_len: int, *, name: str = "lengths") -> jnp.ndarray:
    """``(B, seq_len)`` boolean, True where the position is inside the sequence's length.

    ``name`` is the argument named in errors.
    """
    _checks.check_integer(name, lengths)
    _checks.check_rank(name, lengths, 1, "(B,)")
    _checks.check_positive_int("seq_len", seq_len)
    return jnp.arange(seq_len)[None, :] < jnp.asarray(lengths)[:, None]


def combine_masks(*masks) -> Optional[jnp.ndarray]:
    """Logical AND of the masks that are not None (broadcasting); None if all are None."""
    result = None
    for m in masks:
        if m is None:
            continue
        result = m if result is None else jnp.logical_and(result, m)
    return result
