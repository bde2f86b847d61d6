"""flax_attn: attention variants and positional encodings for JAX/Flax, each held equal to a
PyTorch reference (``torch_ref``) by parity tests.

Rooms of the package (imports point down the list):

1. :mod:`flax_attn.core`: the attention core: :func:`dot_product_attention`, the mask
   description (:mod:`flax_attn.core.mask`, also ``flax_attn.masks``), the registry of
   implementations (xla, blockwise, cudnn; one file each);
2. :mod:`flax_attn.positional`: positional encodings as pure functions of explicit positions
   (:mod:`~flax_attn.positional.rope`, :mod:`~flax_attn.positional.alibi`,
   :mod:`~flax_attn.positional.t5`, :mod:`~flax_attn.positional.sinusoidal`);
3. :mod:`flax_attn.layers`: Flax Linen layers for new models: :class:`Attention` with
   :class:`AttentionConfig`, :class:`KVCache`, :class:`LearnedPositionalEmbedding`;
4. :mod:`flax_attn.textbook`: the chapter's and the Transformer notes' code, reproduced
   (``basics``, ``MultiHeadAttention`` and the other chapter modules,
   ``scaled_dot_product_attention``, ``create_causal_mask``, ``TransformerMultiHeadAttention``);
5. :mod:`flax_attn.nnx`: every module as a native Flax NNX module, on the same pure stages;
   :func:`flax_attention_fn`, an ``attention_fn`` for Flax's own attention layers;
6. interop: :mod:`flax_attn.interop` (the registry of PyTorch twins; state_dict <-> Flax
   params, NumPy only) and :mod:`flax_attn.checkpoint` (Orbax save/restore, checked against
   the module);
7. :mod:`flax_attn.parallel`: meshes, partition specs, ring and all-gather attention.

Every public name is importable from here; ``flax_attn.rope``, ``flax_attn.alibi``,
``flax_attn.t5`` and ``flax_attn.basics`` are the submodules of the same names.
"""
from flax_attn.positional import alibi, rope, t5
from flax_attn.textbook import basics
from flax_attn import checkpoint, core, hf, interop, nnx, parallel, plot
from flax_attn.layers.flax_hook import flax_attention_fn
from flax_attn.core import dot_product_attention, dropout, keep_host_memory, masked_softmax
from flax_attn.core import mask as masks
from flax_attn.core.tuning import jit, projections_as
from flax_attn.interop import StateDictError, from_torch_state_dict, to_torch_state_dict
from flax_attn.layers import (Attention, AttentionConfig, ContextKV, KVCache, LatentKVCache, LearnedPositionalEmbedding,
                              MLAConfig, MultiHeadLatentAttention, decode_loop, decode_step, mla_forward,
                              mla_params)
from flax_attn.positional import (
    RopeScaling,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    positional_encoding,
    relative_position_bucket,
    rope_frequencies,
    sinusoidal_positions,
    t5_bias,
)
from flax_attn.textbook import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    TransformerMultiHeadAttention,
    count_parameters,
    create_causal_mask,
    scaled_dot_product_attention,
)

__version__ = "0.1.0"

__all__ = [
    "Attention",
    "AttentionConfig",
    "ContextKV",
    "KVCache",
    "LatentKVCache",
    "LearnedPositionalEmbedding",
    "MLAConfig",
    "MultiHeadLatentAttention",
    "decode_loop",
    "decode_step",
    "jit",
    "keep_host_memory",
    "mla_forward",
    "mla_params",
    "projections_as",
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
    "core",
    "count_parameters",
    "create_causal_mask",
    "dot_product_attention",
    "dropout",
    "from_torch_state_dict",
    "flax_attention_fn",
    "hf",
    "interop",
    "nnx",
    "parallel",
    "plot",
    "masked_softmax",
    "masks",
    "positional_encoding",
    "scaled_dot_product_attention",
    "sinusoidal_positions",
    "to_torch_state_dict",
]
