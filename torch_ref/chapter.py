"""The chapter's attention modules in PyTorch, behaving exactly as the originals.

Same class names, constructor signatures and order of parameter creation, so that
``torch.manual_seed(123)`` before construction gives the chapter's weights and printed
outputs. Two departures, both on inputs the originals cannot handle: a clear ``ValueError``
for inputs of the wrong rank or with more tokens than ``context_length`` (the originals fail
deep inside with a broadcasting error), and ``SelfAttention_v1/v2`` refuse batched input,
on which the originals' ``keys.T`` is wrong.

Softmax runs over the last axis (``dim=-1``). One translation of the chapter prints
``CausalAttention`` outputs made with ``dim=1``, which normalises over queries; that is an
erratum (``parity_tests/textbook/test_chapter_goldens.py`` reproduces both tables).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _check_2d(owner: str, x: torch.Tensor, d_in: int) -> None:
    if x.dim() != 2 or x.shape[-1] != d_in:
        raise ValueError(f"{owner} takes x of shape (num_tokens, d_in={d_in}), got {tuple(x.shape)}")


def _check_tokens(owner: str, x: torch.Tensor, d_in: int, context_length: int) -> None:
    if x.dim() != 3 or x.shape[-1] != d_in:
        raise ValueError(f"{owner} takes x of shape (batch, num_tokens, d_in={d_in}), got {tuple(x.shape)}")
    if x.shape[1] > context_length:
        raise ValueError(f"{owner} input x has {x.shape[1]} tokens (shape {tuple(x.shape)}), "
                         f"more than context_length={context_length}")


class SelfAttention_v1(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x):
        _check_2d("SelfAttention_v1", x, self.W_query.shape[0])
        keys = x @ self.W_key
        queries = x @ self.W_query
        values = x @ self.W_value
        attn_scores = queries @ keys.T  # omega
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class SelfAttention_v2(nn.Module):
    def __init__(self, d_in, d_out, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x):
        _check_2d("SelfAttention_v2", x, self.W_query.in_features)
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.T
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        return attn_weights @ values


class CausalAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, qkv_bias=False):
        super().__init__()
        self.d_out = d_out
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        _check_tokens("CausalAttention", x, self.W_query.in_features, self.mask.shape[0])
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        attn_scores = queries @ keys.transpose(1, 2)
        attn_scores.masked_fill_(self.mask.bool()[:num_tokens, :num_tokens], -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        return attn_weights @ values


class MultiHeadAttentionWrapper(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x):
        return torch.cat([head(x) for head in self.heads], dim=-1)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_in, d_out, context_length, dropout, num_heads, qkv_bias=False):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x):
        _check_tokens("MultiHeadAttention", x, self.W_query.in_features, self.mask.shape[0])
        b, num_tokens, d_in = x.shape
        keys = self.W_key(x)
        queries = self.W_query(x)
        values = self.W_value(x)
        # (b, num_tokens, d_out) -> (b, num_heads, num_tokens, head_dim)
        keys = keys.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        values = values.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        return self.out_proj(context_vec)


def count_parameters(model: nn.Module) -> int:
    """Trainable scalars, as the chapter counts them."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
