"""Hugging Face ``attention_mask`` (B, S) of 0/1 -> flax_attn's segment ids and positions.

Hugging Face marks padding with a 0/1 ``attention_mask``; flax_attn marks it with a negative
segment id and takes positions as an argument. Which positions a Hugging Face model uses for a
padded row depends on the family (and on how it is called):

* ``'cumsum'``: the first real token is position 0, whatever padding precedes it:
  ``positions = cumsum(mask) - 1``. This is what ``generate()`` passes as ``position_ids`` to
  RoPE decoders (Llama, Mistral, Qwen, Gemma, GPT-NeoX, Phi, Falcon, GPT-J, Cohere) and to GPT-2,
  and what BLOOM computes itself for its ALiBi key positions.
* ``'index'``: a token's position is its index in the padded row: ``0..S-1``. T5's relative
  bias, Whisper's and BART's learned absolute positions (added outside the attention layer)
  use the row index; so does any model called without ``position_ids``.

Relative encodings (RoPE, ALiBi, T5) give the same scores under both for a contiguous block of
real tokens; they differ for learned absolute positions, for the length-dependent RoPE scalings
(dynamic NTK, LongRoPE: the largest position decides) and for where a KV cache continues.
"""
from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp

from flax_attn import _checks

CONVENTIONS = ("cumsum", "index")


def segments_and_positions(attention_mask, *, convention: str = "cumsum"):
    """Segment ids and positions of an HF ``attention_mask``.

    Args:
      attention_mask: ``(B, S)`` of 0/1 (integers or booleans; 1 = real token), left or right
        padded (any pattern is accepted).
      convention: ``'cumsum'`` (positions count real tokens: ``cumsum(mask) - 1``) or
        ``'index'`` (``0..S-1``); see the module docstring, or :func:`convention_of`.

    Returns:
      ``(segment_ids, positions)``, both int32 ``(B, S)``: segment 0 for real tokens and -1 for
      padding (never attended to; its queries return zeros); padding positions are 0.
    """
    _checks.check_one_of("convention", convention, CONVENTIONS)
    _checks.check_rank("attention_mask", attention_mask, 2, "(B, S)")
    mask = jnp.asarray(attention_mask)
    if not (jnp.issubdtype(mask.dtype, jnp.integer) or mask.dtype == jnp.bool_):
        raise TypeError(f"attention_mask must hold 0/1 integers or booleans, got dtype {mask.dtype} "
                        f"(shape {mask.shape})")
    real = mask.astype(bool)
    if not isinstance(attention_mask, jax.core.Tracer):  # values are checkable outside jit
        values = np.asarray(attention_mask)
        if not np.isin(values, (0, 1)).all():
            raise ValueError(f"attention_mask must hold only 0 and 1, got values {np.unique(values)[:8]} "
                             f"(shape {values.shape})")
    segment_ids = jnp.where(real, 0, -1).astype(jnp.int32)
    if convention == "cumsum":
        positions = jnp.cumsum(real.astype(jnp.int32), axis=-1) - 1
    else:
        positions = jnp.broadcast_to(jnp.arange(mask.shape[-1], dtype=jnp.int32), mask.shape)
    positions = jnp.where(real, positions, 0).astype(jnp.int32)
    return segment_ids, positions


def convention_of(config: dict) -> str:
    """The position convention of a Hugging Face config's family (``model_type``)."""
    from flax_attn.hf.families import family_of
    return family_of(config).positions
