"""Sinusoidal positional encoding (Vaswani et al., 2017, section 3.5).

    PE[p, 2i]   = sin(p / base^(2i / d_model))
    PE[p, 2i+1] = cos(p / base^(2i / d_model))

Positions are arguments: :func:`sinusoidal_positions` takes any integer positions (an
offset for decoding, per-sequence positions for packing); :func:`positional_encoding` is
the Transformer notes' ``positional_encoding(seq_len, d_model)``, positions ``0..seq_len-1``.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from flax_attn import _checks


def sinusoidal_positions(positions, d_model: int, *, base: float = 10000.0, dtype=jnp.float32):
    """Sinusoidal encodings of ``positions``.

    Args:
      positions: integer array of any shape ``(...,)``.
      d_model: encoding width. An odd width is allowed: it has ``ceil(d/2)`` sine and
        ``floor(d/2)`` cosine columns (the last column is a sine).
      base: the wavelength base (10000 in the paper).
      dtype: floating dtype of the computation and result.

    Returns:
      ``(..., d_model)``.
    """
    _checks.check_positive_int("d_model", d_model)
    _checks.check_integer("positions", positions)
    _checks.check_floating_dtype("sinusoidal_positions dtype", dtype)
    if not (isinstance(base, (int, float, np.integer, np.floating)) and np.isfinite(base) and base > 0):
        raise ValueError(f"sinusoidal_positions base must be a finite positive number, got {base!r}")
    div_term = jnp.exp(jnp.arange(0, d_model, 2, dtype=dtype) * jnp.asarray(-math.log(base) / d_model, dtype))
    angles = jnp.asarray(positions).astype(dtype)[..., None] * div_term
    pairs = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pairs.reshape(np.shape(positions) + (2 * div_term.shape[0],))[..., :d_model]


def positional_encoding(seq_len: int, d_model: int, *, dtype=jnp.float32):
    """The Transformer notes' table: ``(seq_len, d_model)`` encodings of positions ``0..seq_len-1``."""
    _checks.check_positive_int("seq_len", seq_len)
    return sinusoidal_positions(jnp.arange(seq_len, dtype=jnp.int32), d_model, dtype=dtype)
