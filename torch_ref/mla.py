"""PyTorch reference for multi-head latent attention (DeepSeek-V2, arXiv 2405.04434, section 2.1;
DeepSeek-V3), written from the paper's equations (9)-(19), independently of flax_attn.

Parameter names are Hugging Face ``DeepseekV3Attention``'s (``q_a_proj``, ``q_a_layernorm``,
``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
``o_proj``), so state_dicts carry HF names. Choices that differ from flax_attn's formulation, so
that parity compares two implementations:

* interleaved RoPE as DeepSeek's own code computes it: adjacent dims as complex numbers,
  multiplied by ``e^{i p theta_j}`` (rotate-half by ``x cos + rotate_half(x) sin``);
  frequencies and YaRN's factor from :func:`torch_ref.modern.rope_inv_freq` (wavelengths);
* every head's key built explicitly (``k_pe`` repeated over heads) and attention as an explicit
  masked softmax;
* the cache grows by concatenation (a dict of tensors), rather than being written in place.

Shapes use flax_attn's alphabet: x ``(B, T, D)``, positions ``(B, T)``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch_ref.modern import rope_inv_freq


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight``, statistics in at least float32 (DeepSeek's RMSNorm)."""

    def __init__(self, features: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.eps = eps

    def forward(self, x):
        acc = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = acc * torch.rsqrt(acc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotate(x, positions, *, theta, layout, scaling):
    """RoPE on the last dim of ``x`` ``(B, T, ..., d)`` at ``positions`` ``(B, T)``."""
    d = x.shape[-1]
    inv_freq, factor = rope_inv_freq(d, theta, scaling)
    angles = positions.to(torch.float64)[..., None] * inv_freq                      # (B, T, d/2)
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.dim() - 3) + (d // 2,))
    if layout == "interleaved":
        turn = torch.polar(torch.full_like(angles, factor), angles)                 # factor e^{i angle}
        pairs = torch.view_as_complex(x.to(torch.float64).reshape(x.shape[:-1] + (d // 2, 2)).contiguous())
        return torch.view_as_real(pairs * turn).reshape(x.shape).to(x.dtype)
    if layout == "rotate_half":
        cos = torch.cat([angles.cos(), angles.cos()], -1) * factor
        sin = torch.cat([angles.sin(), angles.sin()], -1) * factor
        half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return (x * cos + half * sin).to(x.dtype)
    raise ValueError(f"unknown RoPE layout {layout!r}")


class MultiHeadLatentAttention(nn.Module):
    """MLA with the same keyword arguments as ``flax_attn.MLAConfig``.

    ``forward(x, positions, segment_ids=None, mask=None, cache=None)``: ``x`` ``(B, T, D)``,
    positions and segment ids ``(B, T)`` (negative id: padding), ``mask`` boolean broadcastable to
    ``(B, N, T, S)``; with ``cache`` (a dict from :meth:`empty_cache` or a previous call) returns
    ``(out, cache)`` with the new tokens' ``c_kv`` and ``k_pe`` appended.
    """

    def __init__(self, d_model, num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
                 q_lora_rank=None, causal=True, rope_theta=10000.0, rope_layout="interleaved", rope_scaling=None,
                 rms_norm_eps=1e-6, attention_bias=False, dropout=0.0, scale=None, absorb=False):
        super().__init__()
        self.n, self.dn, self.dr, self.dv, self.r = num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, \
            kv_lora_rank
        self.q_lora_rank, self.causal, self.theta, self.layout = q_lora_rank, causal, rope_theta, rope_layout
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.dropout = dropout
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, rms_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_model, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, rms_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, d_model, bias=attention_bias)
        # The paper's 1/sqrt(d_h + d_h^R); DeepSeek-V3 with YaRN multiplies by mscale(s, mscale_all_dim)^2.
        if scale is None:
            scale = qk ** -0.5
            rs = self.rope_scaling
            if rs and rs["kind"] == "yarn" and rs.get("mscale_all_dim") and rs["factor"] > 1:
                m = 1 + 0.1 * rs["mscale_all_dim"] * math.log(rs["factor"])
                scale = scale * m ** 2
        self.scale = scale

    def empty_cache(self, batch: int, dtype=torch.float32) -> dict:
        """A cache holding no tokens: ``c_kv`` ``(B, 0, r_kv)``, ``k_pe`` ``(B, 0, d_r)``, positions, segments."""
        return {"c_kv": torch.zeros(batch, 0, self.r, dtype=dtype), "k_pe": torch.zeros(batch, 0, self.dr, dtype=dtype),
                "positions": torch.zeros(batch, 0, dtype=torch.long),
                "segment_ids": torch.zeros(batch, 0, dtype=torch.long)}

    def forward(self, x, positions, segment_ids=None, mask=None, cache: Optional[dict] = None):
        B, T, _ = x.shape
        positions = positions.expand(B, T)
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))                    # eq. (12)-(13)
        q = q.view(B, T, self.n, self.dn + self.dr)
        q_c, q_r = q.split([self.dn, self.dr], dim=-1)
        q_r = rotate(q_r, positions, theta=self.theta, layout=self.layout, scaling=self.rope_scaling)  # eq. (14)
        c_kv, k_r = self.kv_a_proj_with_mqa(x).split([self.r, self.dr], dim=-1)        # eq. (9), (15)
        c_kv = self.kv_a_layernorm(c_kv)
        k_r = rotate(k_r, positions, theta=self.theta, layout=self.layout, scaling=self.rope_scaling)
        q_segments = torch.zeros(B, T, dtype=torch.long) if segment_ids is None else segment_ids.expand(B, T)
        k_positions, k_segments = positions, q_segments
        if cache is not None:
            c_kv = torch.cat([cache["c_kv"], c_kv], 1)
            k_r = torch.cat([cache["k_pe"], k_r], 1)
            k_positions = torch.cat([cache["positions"], positions], 1)
            k_segments = torch.cat([cache["segment_ids"], q_segments], 1)
            cache = {"c_kv": c_kv, "k_pe": k_r, "positions": k_positions, "segment_ids": k_segments}
        S = c_kv.shape[1]
        kv = self.kv_b_proj(c_kv).view(B, S, self.n, self.dn + self.dv)               # eq. (10)-(11)
        k_c, v = kv.split([self.dn, self.dv], dim=-1)
        keys = torch.cat([k_c, k_r[:, :, None, :].repeat(1, 1, self.n, 1)], -1)       # eq. (17)
        queries = torch.cat([q_c, q_r], -1)                                           # eq. (16)
        logits = torch.einsum("btnh,bsnh->bnts", queries, keys) * self.scale           # eq. (18)
        allowed = (q_segments[:, :, None] == k_segments[:, None, :]) & (k_segments[:, None, :] >= 0)
        allowed = allowed & (q_segments[:, :, None] >= 0)
        if self.causal:
            allowed = allowed & (k_positions[:, None, :] <= positions[:, :, None])
        allowed = allowed[:, None]                                                    # (B, 1, T, S)
        if mask is not None:
            allowed = allowed & mask
        any_key = allowed.any(-1, keepdim=True)
        logits = logits.masked_fill(~allowed, float("-inf")).masked_fill(~any_key, 0.0)
        weights = torch.softmax(logits, dim=-1) * any_key                             # nothing to see: zeros
        weights = F.dropout(weights, self.dropout, self.training)
        out = torch.einsum("bnts,bsnh->btnh", weights, v).reshape(B, T, self.n * self.dv)
        out = self.o_proj(out)                                                        # eq. (19)
        return out if cache is None else (out, cache)
