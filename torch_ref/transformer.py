"""The Transformer notes (scaled dot-product attention, multi-head attention with biased
``W_q, W_k, W_v, W_o``, causal mask, sinusoidal positional encoding) in PyTorch.

Behaviour as in the notes: masks are 0/1 floats and ``mask == 0`` blocks with ``-1e9``, so a
fully blocked row becomes a uniform average. ``positional_encoding`` also accepts an odd
``d_model`` (the notes' version fails there with a shape error): the last column is a sine.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def scaled_dot_product_attention(Q, K, V, mask=None):
    """``(output, attention_weights)``: ``softmax(Q K^T / sqrt(d_k)) V`` over the last two axes."""
    d_k = Q.size(-1)
    scores = torch.matmul(Q, K.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    attention_weights = F.softmax(scores, dim=-1)
    return torch.matmul(attention_weights, V), attention_weights


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.d_k = d_model // num_heads
        self.W_q = nn.Linear(d_model, d_model)
        self.W_k = nn.Linear(d_model, d_model)
        self.W_v = nn.Linear(d_model, d_model)
        self.W_o = nn.Linear(d_model, d_model)

    def split_heads(self, x):
        """``[B, T, d_model]`` -> ``[B, num_heads, T, d_k]``."""
        batch_size, seq_len, _ = x.size()
        return x.view(batch_size, seq_len, self.num_heads, self.d_k).transpose(1, 2)

    def combine_heads(self, x):
        """``[B, num_heads, T, d_k]`` -> ``[B, T, d_model]``."""
        batch_size, _, seq_len, _ = x.size()
        return x.transpose(1, 2).contiguous().view(batch_size, seq_len, self.d_model)

    def forward(self, Q, K, V, mask=None):
        Q = self.split_heads(self.W_q(Q))
        K = self.split_heads(self.W_k(K))
        V = self.split_heads(self.W_v(V))
        attention_output, attention_weights = scaled_dot_product_attention(Q, K, V, mask)
        return self.W_o(self.combine_heads(attention_output)), attention_weights


def create_causal_mask(seq_len):
    return torch.tril(torch.ones(seq_len, seq_len))


def positional_encoding(seq_len, d_model, *, dtype=torch.float32):
    """``pe[p, 0::2] = sin(p * div_term)``, ``pe[p, 1::2] = cos(p * div_term)``: ``[seq_len, d_model]``."""
    pe = torch.zeros(seq_len, d_model, dtype=dtype)
    position = torch.arange(0, seq_len, dtype=dtype).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2).to(dtype) * (-math.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d_model // 2])
    return pe
