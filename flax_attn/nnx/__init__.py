"""flax_attn's modules as native Flax NNX modules (``flax.nnx.Module``, ``rngs`` in the constructor).

Every Linen module has an NNX twin of the same name, arguments and parameter names, calling
the same pure stage (so nothing is written twice and both compute the same numbers):

* :class:`Attention` (configured by :class:`flax_attn.AttentionConfig`; KV cache in, cache out)
  and :class:`LearnedPositionalEmbedding` (:mod:`flax_attn.nnx.layers`);
* :class:`MultiHeadLatentAttention` (configured by :class:`flax_attn.MLAConfig`; latent cache in,
  cache out; :mod:`flax_attn.nnx.mla`);
* the chapter's :class:`SelfAttention_v1`, :class:`SelfAttention_v2`, :class:`CausalAttention`,
  :class:`MultiHeadAttentionWrapper`, :class:`MultiHeadAttention` and the notes'
  :class:`TransformerMultiHeadAttention` (:mod:`flax_attn.nnx.textbook`).

Weights move with :func:`to_linen` / :func:`from_linen` (:mod:`flax_attn.nnx.convert`), so
PyTorch weights (``flax_attn.from_torch_state_dict(nnx_module, state_dict)`` loads into an NNX
module), Orbax checkpoints (through :func:`linen_twin`) and ``torch_ref.twin(nnx_module)``
serve both.

    from flax import nnx
    layer = fa.nnx.Attention(fa.AttentionConfig(d_model=64, num_heads=4), rngs=nnx.Rngs(0))
    y = nnx.jit(lambda m, x, p: m(x, p))(layer, x, positions)
"""
from flax_attn.nnx.common import Params
from flax_attn.nnx.convert import from_linen, linen_twin, nnx_class_of, nnx_twin, register, to_linen
from flax_attn.nnx.layers import Attention, LearnedPositionalEmbedding
from flax_attn.nnx.mla import MultiHeadLatentAttention
from flax_attn.nnx.textbook import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    TransformerMultiHeadAttention,
)

__all__ = [
    "Attention",
    "CausalAttention",
    "LearnedPositionalEmbedding",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "MultiHeadLatentAttention",
    "Params",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "TransformerMultiHeadAttention",
    "from_linen",
    "linen_twin",
    "nnx_class_of",
    "nnx_twin",
    "register",
    "to_linen",
]
