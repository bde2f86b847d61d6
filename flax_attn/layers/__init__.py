"""Flax Linen layers for new models, with parameters.

* :mod:`~flax_attn.layers.attention`: :class:`Attention`, the configurable multi-head layer,
  and :class:`AttentionConfig` (grouped-query, RoPE/ALiBi/T5/no positions, sliding windows,
  QK-norm, soft-capping, packing, cross-attention);
* :mod:`~flax_attn.layers.cache`: :class:`KVCache`, the pure key/value cache for decoding, and
  :class:`ContextKV`, cross-attention keys and values computed once;
* :mod:`~flax_attn.layers.decode`: :func:`decode_step`, a layer's jitted cached call with the
  cache donated (updated in place), and :func:`decode_loop`, a run of such steps as one program;
* :mod:`~flax_attn.layers.mla`: :class:`MultiHeadLatentAttention` + :class:`MLAConfig`
  (DeepSeek-V2/V3 multi-head latent attention) and :class:`LatentKVCache`;
* :mod:`~flax_attn.layers.positional`: :class:`LearnedPositionalEmbedding` (GPT-2's ``wpe``);
* :mod:`~flax_attn.layers.common`: building blocks shared with the textbook modules
  (PyTorch-equivalent initialisation, dropout plumbing, input checks).
"""
from flax_attn.layers.attention import Attention, AttentionConfig
from flax_attn.layers.cache import ContextKV, KVCache
from flax_attn.layers.decode import decode_loop, decode_step
from flax_attn.layers.mla import LatentKVCache, MLAConfig, MultiHeadLatentAttention, mla_forward, mla_params
from flax_attn.layers.positional import LearnedPositionalEmbedding

__all__ = ["Attention", "AttentionConfig", "ContextKV", "KVCache", "LatentKVCache", "LearnedPositionalEmbedding",
           "MLAConfig", "MultiHeadLatentAttention", "decode_loop", "decode_step", "mla_forward", "mla_params"]
