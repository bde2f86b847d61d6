"""flax_attn: attention variants and positional encodings for JAX/Flax, each held equal to a
PyTorch reference (``torch_ref``) by parity tests.

Layers of the package (imports point down):

1. functional core: :mod:`flax_attn.attention`, :mod:`flax_attn.masks`,
   :mod:`flax_attn.positional`, :mod:`flax_attn.rope`, :mod:`flax_attn.alibi`,
   :mod:`flax_attn.t5`, :mod:`flax_attn.basics`;
2. modules (Flax Linen): :mod:`flax_attn.chapter`, :mod:`flax_attn.transformer`,
   :mod:`flax_attn.layer` (with :mod:`flax_attn.cache`);
3. interop: :mod:`flax_attn.interop` (PyTorch state_dict <-> Flax params, NumPy only) and
   :mod:`flax_attn.checkpoint` (Orbax save/restore, checked against the module).
"""
from flax_attn import alibi, basics, checkpoint, interop, masks, rope, t5
from flax_attn.alibi import alibi_bias, alibi_slopes
from flax_attn.attention import dot_product_attention, dropout, masked_softmax, scaled_dot_product_attention
from flax_attn.cache import KVCache
from flax_attn.layer import Attention, AttentionConfig
from flax_attn.rope import RopeScaling, apply_rope, rope_frequencies
from flax_attn.t5 import relative_position_bucket, t5_bias
from flax_attn.chapter import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    count_parameters,
)
from flax_attn.interop import StateDictError, from_torch_state_dict, to_torch_state_dict
from flax_attn.masks import create_causal_mask
from flax_attn.positional import LearnedPositionalEmbedding, positional_encoding, sinusoidal_positions
from flax_attn.transformer import TransformerMultiHeadAttention

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionConfig",
    "KVCache",
    "LearnedPositionalEmbedding",
    "RopeScaling",
    "alibi",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "relative_position_bucket",
    "rope",
    "rope_frequencies",
    "t5",
    "t5_bias",
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "StateDictError",
    "TransformerMultiHeadAttention",
    "basics",
    "checkpoint",
    "count_parameters",
    "create_causal_mask",
    "dot_product_attention",
    "dropout",
    "from_torch_state_dict",
    "interop",
    "masked_softmax",
    "masks",
    "positional_encoding",
    "scaled_dot_product_attention",
    "sinusoidal_positions",
    "to_torch_state_dict",
]
