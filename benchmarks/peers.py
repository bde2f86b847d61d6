"""The layers flax_attn is measured against, each the GPT-2-style causal multi-head layer
``x -> out_proj(attention(W_q x, W_k x, W_v x))`` with the same sizes."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F


class TorchSDPAMultiHeadAttention(torch.nn.Module):
    """PyTorch's idiomatic layer: one fused QKV projection and ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, D))


class JaxNNMultiHeadAttention(nn.Module):
    """The same layer in Flax with ``jax.nn.dot_product_attention`` as its core."""

    d_model: int
    num_heads: int
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        B, T, D = x.shape
        H = D // self.num_heads
        qkv = nn.Dense(3 * D, use_bias=False, dtype=self.dtype, param_dtype=self.dtype)(x)
        q, k, v = jnp.split(qkv.reshape(B, T, 3 * self.num_heads, H), 3, axis=2)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return nn.Dense(D, dtype=self.dtype, param_dtype=self.dtype)(y.reshape(B, T, D))


class FlaxMultiHeadDotProductAttention(nn.Module):
    """Flax's own ``nn.MultiHeadDotProductAttention`` with a causal mask."""

    d_model: int
    num_heads: int
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x):
        layer = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, qkv_features=self.d_model,
                                                out_features=self.d_model, dtype=self.dtype,
                                                param_dtype=self.dtype, deterministic=True)
        return layer(x, mask=nn.make_causal_mask(jnp.ones(x.shape[:2], bool)))
