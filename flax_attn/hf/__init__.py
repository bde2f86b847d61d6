"""Hugging Face checkpoints into flax_attn's :class:`~flax_attn.Attention` layers, and back.

    import json, flax_attn as fa
    config = json.load(open("config.json"))
    layers = fa.hf.load_attention(config, "model.safetensors")   # one HFAttention per layer
    layer = layers[0]
    y = layer.module().apply({"params": layer.params}, x, positions)   # fa.Attention (or MLA)
    segment_ids, positions = fa.hf.segments_and_positions(attention_mask)  # HF padding -> flax_attn
    weights = fa.hf.to_hf_weights(config, layers)                # back to HF names

Families (``model_type``): llama, mistral, qwen2, qwen3, gemma2, gemma3, cohere (with or
without use_qk_norm), olmo2, phi (with or without qk_layernorm), phi3, gpt_neox, falcon (RoPE, or
ALiBi with ``alibi=True``: Falcon-RW), gpt2, gptj, bloom, gpt_oss, llama4_text and llama4 (RoPE
layers with chunked attention and a weightless QK-norm, NoPE layers with temperature tuning),
deepseek_v3 and deepseek_v2 (multi-head latent attention: :class:`~flax_attn.layers.mla.MLAConfig`
layers, built by :meth:`HFAttention.module`), t5, whisper, bart. A family or option that needs a
layer feature flax_attn lacks raises ``NotImplementedError`` naming it (:data:`MISSING_FEATURES`,
empty today). This package imports neither torch nor transformers; safetensors only when given a
file.
"""
from flax_attn.hf.convert import HFAttention, fused_indices, load_attention, read_weights, to_hf_weights
from flax_attn.hf.families import FAMILIES, FUSED_LAYOUTS, MISSING_FEATURES, Family, family_of, rope_fields
from flax_attn.hf.padding import CONVENTIONS, convention_of, segments_and_positions

__all__ = [
    "CONVENTIONS", "FAMILIES", "FUSED_LAYOUTS", "Family", "HFAttention", "MISSING_FEATURES", "convention_of",
    "family_of", "fused_indices", "load_attention", "read_weights", "rope_fields", "segments_and_positions",
    "to_hf_weights",
]
