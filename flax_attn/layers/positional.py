"""Learned absolute positions (GPT-2's ``wpe``): the one positional encoding with parameters.

The parameter-free encodings (RoPE, ALiBi, T5 buckets, sinusoidal) are functions in
:mod:`flax_attn.positional`.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from flax_attn import _checks


class LearnedPositionalEmbedding(nn.Module):
    """Learned absolute positions (GPT-2's ``wpe``): a table ``(num_positions, features)``.

    Call with integer ``positions`` of any shape (offsets for decoding are just larger
    positions); returns ``positions.shape + (features,)``. A position outside
    ``[0, num_positions)`` raises ``ValueError`` (at run time under ``jax.jit``).
    Its PyTorch twin is ``torch_ref.modern.LearnedPositionalEmbedding`` (``wpe`` an ``nn.Embedding``).
    """

    num_positions: int
    features: int
    param_dtype: object = jnp.float32

    def setup(self):
        _checks.check_positive_int("num_positions", self.num_positions)
        _checks.check_positive_int("features", self.features)
        self.wpe = nn.Embed(self.num_positions, self.features, embedding_init=nn.initializers.normal(1.0),
                            param_dtype=self.param_dtype)

    def __call__(self, positions):
        _checks.check_integer("positions", positions)
        positions = jnp.asarray(positions)
        _checks.runtime_check(
            (jnp.min(positions) >= 0) & (jnp.max(positions) < self.num_positions),
            "positions must lie in [0, {n}), got min {lo} and max {hi}",
            n=self.num_positions, lo=jnp.min(positions), hi=jnp.max(positions))
        return self.wpe(positions)
