"""ALiBi: attention with linear biases (Press et al., 2022, "Train Short, Test Long").

No position embeddings; instead each head n adds ``-m_n * |q_pos - k_pos|`` to its logits,
with head-specific slopes ``m_n``: for N a power of two, ``m_n = 2^(-8 n / N)``, n = 1..N.
For other N, the slopes of the nearest lower power of two P, then every other slope of 2P
(``2^(-4 (2j - 1) / P)``, j = 1..N-P), as BLOOM and MPT compute them.

For causal attention the bias is ``-m (q - k)`` on the keys a query may see (the paper's
form; BLOOM's ``m k`` differs from it by a constant per row, which softmax ignores). For
bidirectional attention the same ``-m |q - k|`` is symmetric. Positions are explicit, so
left-padded batches and cached decoding get the right distances.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core.mask import check_position_pair


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Head slopes ``(num_heads,)`` as float64 NumPy (see the module docstring)."""
    _checks.check_positive_int("num_heads", num_heads)
    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * n / p) for n in range(1, p + 1)]
    slopes += [2.0 ** (-4.0 * (2 * j - 1) / p) for j in range(1, num_heads - p + 1)]
    return np.asarray(slopes, np.float64)


def alibi_bias(slopes, query_positions, key_positions, *, dtype=None):
    """``bias[..., n, t, s] = -slopes[n] * |query_positions[t] - key_positions[s]|``.

    Args:
      slopes: ``(N,)``.
      query_positions: integer ``(T,)`` or ``(B, T)``; key_positions: ``(S,)`` or ``(B, S)``.
      dtype: of the bias; default the slopes' floating dtype, at least float32 (the float64
        slopes of :func:`alibi_slopes` give a float64 bias when JAX has x64 enabled, float32
        otherwise). ``dot_product_attention`` adds it in its accumulation dtype, so a float32
        layer is unaffected while a float64 layer keeps its slopes exact (slopes that are not
        powers of two lose 4e-9 relative in float32).

    Returns:
      ``(N, T, S)`` or ``(B, N, T, S)``, to pass as ``bias`` to ``dot_product_attention``.
    """
    query_positions, key_positions = check_position_pair("query_positions", query_positions, "key_positions",
                                                         key_positions)
    _checks.check_rank("slopes", slopes, 1, "(N,)")
    if dtype is None:
        dtype = jnp.promote_types(jnp.asarray(slopes).dtype, jnp.float32)
        if not jnp.issubdtype(dtype, jnp.floating):
            dtype = jnp.float32
    _checks.check_floating_dtype("alibi_bias dtype", dtype)
    distance = jnp.abs(query_positions[..., :, None] - key_positions[..., None, :]).astype(dtype)
    return -jnp.asarray(slopes, dtype)[:, None, None] * distance[..., None, :, :]
