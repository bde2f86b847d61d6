"""Hugging Face checkpoints into flax_attn's :class:`~flax_attn.Attention` layers, and back.

    import json, flax_attn as fa
    config = json.load(open("config.json"))
    layers = fa.hf.load_attention(config, "model.safetensors")   # one HFAttention per layer
    layer = layers[0]
    y = fa.Attention(layer.config).apply({"params": layer.params}, x, positions)
    segment_ids, positions = fa.hf.segments_and_positions(attention_mask)  # HF padding -> flax_attn
    weights = fa.hf.to_hf_weights(config, layers)                # back to HF names

Families (``model_type``): llama, mistral, qwen2, qwen3, gemma2, gemma3, cohere (without
use_qk_norm), phi (without qk_layernorm), phi3, gpt_neox, falcon (RoPE), gpt2, gptj, bloom,
t5, whisper, bart. Others known to need missing layer features (olmo2, llama4, deepseek_v3,
gpt_oss) raise ``NotImplementedError`` naming them (:data:`MISSING_FEATURES`). This package
imports neither torch nor transformers; safetensors only when given a file.
"""
from flax_attn.hf.convert import HFAttention, fused_indices, load_attention, read_weights, to_hf_weights
from flax_attn.hf.families import FAMILIES, FUSED_LAYOUTS, MISSING_FEATURES, Family, family_of, rope_fields
from flax_attn.hf.padding import CONVENTIONS, convention_of, segments_and_positions

__all__ = [
    "CONVENTIONS", "FAMILIES", "FUSED_LAYOUTS", "Family", "HFAttention", "MISSING_FEATURES", "convention_of",
    "family_of", "fused_indices", "load_attention", "read_weights", "rope_fields", "segments_and_positions",
    "to_hf_weights",
]
