"""Learned absolute positions (GPT-2's ``wpe``): the one positional encoding with parameters.

The parameter-free encodings (RoPE, ALiBi, T5 buckets, sinusoidal) are functions in
:mod:`flax_attn.positional`.
"""
from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.layers.common import declare, declared, embed, embed_params


def learned_positions_params(num_positions: int, features: int) -> dict:
    """Specs: ``wpe`` (``embedding`` ``(num_positions, features)``, N(0, 1) as ``nn.Embedding``)."""
    _checks.check_positive_int("num_positions", num_positions)
    _checks.check_positive_int("features", features)
    return {"wpe": embed_params(num_positions, features)}


def learned_positions_forward(num_positions: int, params, positions):
    """The rows of ``params['wpe']['embedding']`` at integer ``positions`` (any shape):
    ``positions.shape + (features,)``. A position outside ``[0, num_positions)`` raises
    ``ValueError`` (at run time under ``jax.jit``); float positions raise ``TypeError``."""
    _checks.check_integer("positions", positions)
    positions = jnp.asarray(positions)
    _checks.runtime_check(
        (jnp.min(positions) >= 0) & (jnp.max(positions) < num_positions),
        "positions must lie in [0, {n}), got min {lo} and max {hi}",
        n=num_positions, lo=jnp.min(positions), hi=jnp.max(positions))
    return embed(params["wpe"], positions)


class LearnedPositionalEmbedding(nn.Module):
    """Learned absolute positions (GPT-2's ``wpe``): a table ``(num_positions, features)``.

    Call with integer ``positions`` of any shape (offsets for decoding are just larger
    positions); returns ``positions.shape + (features,)``. A position outside
    ``[0, num_positions)`` raises ``ValueError`` (at run time under ``jax.jit``).
    Its PyTorch twin is ``torch_ref.modern.LearnedPositionalEmbedding`` (``wpe`` an ``nn.Embedding``);
    its NNX twin :class:`flax_attn.nnx.LearnedPositionalEmbedding`. The computation is
    :func:`learned_positions_forward`.
    """

    num_positions: int
    features: int
    param_dtype: object = jnp.float32

    def setup(self):
        declare(self, learned_positions_params(self.num_positions, self.features), self.param_dtype)

    def __call__(self, positions):
        params = declared(self, learned_positions_params(self.num_positions, self.features))
        return learned_positions_forward(self.num_positions, params, positions)
