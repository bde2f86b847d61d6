"""NNX twin of :class:`flax_attn.layers.mla.MultiHeadLatentAttention` (DeepSeek's multi-head
latent attention): the same configuration (:class:`~flax_attn.layers.mla.MLAConfig`), the same
parameter names (Hugging Face's: ``q_a_proj``, ``kv_b_proj``, ...) and the same stage
(:func:`~flax_attn.layers.mla.mla_forward`), so both compute the same numbers and weights move
with :func:`flax_attn.nnx.from_linen` / :func:`flax_attn.nnx.to_linen`.

    layer = MultiHeadLatentAttention(MLAConfig(...), rngs=nnx.Rngs(0))
    y = layer(x, positions)                          # x (B, T, D), positions (B, T)
    cache = layer.init_cache(batch=B, max_len=256)   # a LatentKVCache, dtype param_dtype
    y, cache = layer(x_t, positions_t, cache=cache)
"""
from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx

from flax_attn.layers import mla as linen_mla
from flax_attn.layers.mla import LatentKVCache, MLAConfig, mla_forward, mla_params
from flax_attn.nnx.common import Dropout, declare, params_of
from flax_attn.nnx.convert import register


@register
class MultiHeadLatentAttention(Dropout, nnx.Module):
    """Multi-head latent attention configured by :class:`~flax_attn.layers.mla.MLAConfig`, as an
    NNX module (twin of the Linen :class:`flax_attn.layers.mla.MultiHeadLatentAttention`).

    Args:
      config: the :class:`~flax_attn.layers.mla.MLAConfig`.
      param_dtype: dtype of the parameters. precision: of every matmul.
      implementation: passed to :func:`flax_attn.dot_product_attention`.
      deterministic: default for calls (``config.dropout > 0`` needs it here or in the call).
      rngs: ``nnx.Rngs``; ``params`` (or ``default``) initialises, ``dropout`` keys dropout.

    Call: ``layer(x, positions, segment_ids=None, mask=None, cache=None, *, deterministic=None,
    rngs=None)``: ``x`` floating ``(B, T, D)``, ``positions`` int ``(B, T)`` (required),
    ``segment_ids`` int ``(B, T)`` (negative: padding), ``mask`` boolean broadcastable to
    ``(B, N, T, S)``, ``cache`` a :class:`~flax_attn.layers.mla.LatentKVCache`.

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
    """

    linen_class = linen_mla.MultiHeadLatentAttention

    def __init__(self, config: MLAConfig, param_dtype: Any = jnp.float32, precision: Any = None,
                 implementation: Optional[str] = None, *, deterministic: Optional[bool] = None, rngs: nnx.Rngs):
        if not isinstance(config, MLAConfig):
            raise TypeError(f"config must be a flax_attn.layers.mla.MLAConfig, got {type(config).__name__}")
        self.config = config
        self.param_dtype = param_dtype
        self.precision = precision
        self.implementation = implementation
        declare(self, mla_params(config), param_dtype, rngs)
        self._init_dropout(config.dropout, deterministic, rngs)

    def init_cache(self, batch: int, max_len: int, *, dtype=None) -> LatentKVCache:
        """An empty :class:`~flax_attn.layers.mla.LatentKVCache` (``dtype`` defaults to ``param_dtype``)."""
        return self.config.init_cache(batch, max_len, dtype=self.param_dtype if dtype is None else dtype)

    def __call__(self, x, positions=None, segment_ids=None, mask=None, cache: Optional[LatentKVCache] = None, *,
                 deterministic: Optional[bool] = None, rngs=None):
        key = self._dropout_key(self.config.dropout, deterministic, rngs, "MultiHeadLatentAttention")
        return mla_forward(self.config, params_of(self), x, positions, segment_ids, mask, cache, dropout_rng=key,
                           precision=self.precision, implementation=self.implementation)
