"""The textbook: the chapter's and the Transformer notes' code, reproduced in JAX/Flax.

These modules and functions reproduce the book: the chapter's names, argument order and
printed numbers, and the Transformer notes' functions, each held equal to its PyTorch
original in ``torch_ref``. They are for reading alongside the text and for loading the
book's weights. For new models use :class:`flax_attn.Attention` (configured by
:class:`flax_attn.AttentionConfig`): grouped-query attention, RoPE/ALiBi/T5 positions,
sliding windows, packing and a KV cache.

* :mod:`~flax_attn.textbook.basics`: attention without trainable weights, step by step;
* :mod:`~flax_attn.textbook.chapter`: ``SelfAttention_v1`` and ``_v2``, ``CausalAttention``,
  ``MultiHeadAttentionWrapper``, ``MultiHeadAttention``, ``count_parameters``;
* :mod:`~flax_attn.textbook.transformer`: the notes' ``scaled_dot_product_attention``,
  ``create_causal_mask`` and ``MultiHeadAttention(d_model, num_heads)`` (here
  ``TransformerMultiHeadAttention``).
"""
from flax_attn.textbook import basics, chapter, transformer
from flax_attn.textbook.chapter import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    count_parameters,
)
from flax_attn.textbook.transformer import (
    TransformerMultiHeadAttention,
    create_causal_mask,
    scaled_dot_product_attention,
)

__all__ = [
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "TransformerMultiHeadAttention",
    "basics",
    "chapter",
    "count_parameters",
    "create_causal_mask",
    "scaled_dot_product_attention",
    "transformer",
]
