"""Positional encodings as pure functions of explicit integer positions (no parameters).

* :mod:`~flax_attn.positional.rope`: rotary position embedding, both layouts, partial rotary,
  frequency scalings (:class:`RopeScaling`: linear, NTK-aware static and dynamic, Llama 3, YaRN
  with DeepSeek's mscale, LongRoPE);
* :mod:`~flax_attn.positional.alibi`: ALiBi's per-head linear biases (in the slopes' dtype);
* :mod:`~flax_attn.positional.t5`: T5's bucketed relative position bias (the table is a
  parameter of the layer that owns it);
* :mod:`~flax_attn.positional.sinusoidal`: the Transformer's sinusoidal encodings.

Learned absolute positions have parameters: :class:`flax_attn.layers.LearnedPositionalEmbedding`.
"""
from flax_attn.positional import alibi, rope, sinusoidal, t5
from flax_attn.positional.alibi import alibi_bias, alibi_slopes
from flax_attn.positional.rope import RopeScaling, apply_rope, rope_frequencies
from flax_attn.positional.sinusoidal import positional_encoding, sinusoidal_positions
from flax_attn.positional.t5 import relative_position_bucket, t5_bias

__all__ = [
    "RopeScaling",
    "alibi",
    "alibi_bias",
    "alibi_slopes",
    "apply_rope",
    "positional_encoding",
    "relative_position_bucket",
    "rope",
    "rope_frequencies",
    "sinusoidal",
    "sinusoidal_positions",
    "t5",
    "t5_bias",
]
