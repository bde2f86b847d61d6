"""NNX twins of :mod:`flax_attn.layers`: :class:`Attention` and :class:`LearnedPositionalEmbedding`.

Same configuration, same parameter names, same stages
(:func:`flax_attn.layers.attention.attention_forward`,
:func:`flax_attn.layers.positional.learned_positions_forward`) as the Linen modules; weights
move between them with :func:`flax_attn.nnx.from_linen` / :func:`flax_attn.nnx.to_linen`.

    layer = fa.nnx.Attention(fa.AttentionConfig(d_model=64, num_heads=4), rngs=nnx.Rngs(0))
    y = layer(x, positions)                                  # x (B, T, 64), positions (B, T)
    cache = layer.init_cache(batch=B, max_len=256)           # dtype: the layer's param_dtype
    y, cache = layer(x, positions, cache=cache)              # the cache goes in and comes back
    step = fa.decode_step(layer)                             # jitted, cache donated
    y, cache = step(cache, x_t, positions_t)
    ckv = layer.context_kv(enc, enc_positions)               # cross-attention keys/values, once
    y = cross(x_t, positions_t, context=ckv)                 # (cross: a layer with causal=False)
"""
from __future__ import annotations

from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx

from flax_attn.layers import attention as linen_attention
from flax_attn.layers import positional as linen_positional
from flax_attn.layers.attention import AttentionConfig, attention_forward, attention_params, context_kv_forward
from flax_attn.layers.cache import BLOCK, ContextKV, KVCache
from flax_attn.layers.positional import learned_positions_forward, learned_positions_params
from flax_attn.nnx.common import Dropout, declare, params_of


class Attention(Dropout, nnx.Module):
    """Multi-head attention configured by :class:`flax_attn.AttentionConfig`, as an NNX module.

    The NNX twin of :class:`flax_attn.Attention`: the same arguments (``config``,
    ``param_dtype``, ``precision``, ``implementation``), the same parameters (``q_proj``,
    ``k_proj``, ``v_proj``, ``o_proj`` with ``kernel``/``bias``; ``q_norm``/``k_norm``;
    ``rel_bias``) and the same computation (:func:`~flax_attn.layers.attention.attention_forward`).

    Args:
      config: the :class:`~flax_attn.AttentionConfig`.
      param_dtype: dtype of the parameters. precision: of every matmul.
      implementation: passed to :func:`flax_attn.dot_product_attention`.
      deterministic: default for calls (``config.dropout > 0`` needs it here or in the call).
      rngs: ``nnx.Rngs``; ``params`` (or ``default``) initialises, ``dropout`` keys dropout.

    Call: ``layer(x, positions, segment_ids, context, context_positions, context_segment_ids,
    mask, cache, *, deterministic=None, rngs=None)``, shapes as :class:`flax_attn.Attention`
    (``x`` floating ``(B, T, D)``, ``positions`` int ``(B, T)``, ``cache`` a :class:`KVCache`).

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
    """

    linen_class = linen_attention.Attention

    def __init__(self, config: AttentionConfig, param_dtype: Any = jnp.float32, precision: Any = None,
                 implementation: Optional[str] = None, *, deterministic: Optional[bool] = None, rngs: nnx.Rngs):
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be a flax_attn.AttentionConfig, got {type(config).__name__}")
        self.config = config
        self.param_dtype = param_dtype
        self.precision = precision
        self.implementation = implementation
        declare(self, attention_params(config), param_dtype, rngs)
        self._init_dropout(config.dropout, deterministic, rngs)

    def init_cache(self, batch: int, max_len: int, *, dtype=None, rolling: bool = False,
                   layout: str = "BKSH", block: int = BLOCK) -> KVCache:
        """An empty :class:`KVCache` for this layer (see :meth:`flax_attn.AttentionConfig.init_cache`);
        ``dtype`` defaults to the layer's ``param_dtype``."""
        return self.config.init_cache(batch, max_len, dtype=self.param_dtype if dtype is None else dtype,
                                      rolling=rolling, layout=layout, block=block)

    def __call__(self, x, positions=None, segment_ids=None, context=None, context_positions=None,
                 context_segment_ids=None, mask=None, cache: Optional[KVCache] = None, *,
                 deterministic: Optional[bool] = None, rngs=None):
        key = self._dropout_key(self.config.dropout, deterministic, rngs, "Attention")
        return attention_forward(self.config, params_of(self), x, positions, segment_ids, context, context_positions,
                                 context_segment_ids, mask, cache, dropout_rng=key, precision=self.precision,
                                 implementation=self.implementation)

    def context_kv(self, context, context_positions=None, context_segment_ids=None) -> ContextKV:
        """The cross-attention keys and values of ``context`` ``(B, S, D)`` (positions and
        segment ids ``(B, S)``) as a :class:`flax_attn.ContextKV`, to pass as ``context=`` at
        every later call (see :meth:`flax_attn.Attention.context_kv`)."""
        return context_kv_forward(self.config, params_of(self), context, context_positions, context_segment_ids,
                                  precision=self.precision)


class LearnedPositionalEmbedding(nnx.Module):
    """Learned absolute positions (GPT-2's ``wpe``) as an NNX module: a table
    ``wpe.embedding`` ``(num_positions, features)``.

    The NNX twin of :class:`flax_attn.LearnedPositionalEmbedding`. Call with integer
    ``positions`` of any shape; returns ``positions.shape + (features,)``; a position outside
    ``[0, num_positions)`` raises ``ValueError`` (at run time under ``nnx.jit``).
    """

    linen_class = linen_positional.LearnedPositionalEmbedding

    def __init__(self, num_positions: int, features: int, param_dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        self.num_positions = num_positions
        self.features = features
        self.param_dtype = param_dtype
        declare(self, learned_positions_params(num_positions, features), param_dtype, rngs)

    def __call__(self, positions):
        return learned_positions_forward(self.num_positions, params_of(self), positions)
