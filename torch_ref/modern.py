"""PyTorch references for the modern attention variants, written to their published conventions.

Shapes use flax_attn's alphabet: queries ``(B, T, N, H)``, keys/values ``(B, S, K, H)``,
positions ``(B, T)``. These are written independently of flax_attn (different formulations
where there is a choice), so that parity tests compare two implementations, not one twice:

* RoPE ``rotate_half`` as in GPT-NeoX / Hugging Face Llama (``x cos + rotate_half(x) sin``);
  ``interleaved`` as in Meta's Llama and GPT-J, with complex multiplication of dimension pairs.
* RoPE frequency scalings (linear, NTK-aware static and dynamic, Llama 3, YaRN with DeepSeek's
  mscale, LongRoPE) as stretches of each pair's wavelength, vectorised, from the papers'
  descriptions; the length-dependent ones read the length off the positions.
* ALiBi slopes as MPT computes them (``2^ceil(log2 N)`` slopes, odd ones first).
* T5 buckets as the T5 code computes them.
* Grouped-query attention by repeating key/value heads (``repeat_interleave``).
* A KV cache that grows by concatenation.
* Llama 4: chunked attention as a comparison of chunk indices, attention temperature tuning as
  Hugging Face's ``Llama4TextAttention`` writes it, and its weightless ``L2Norm`` applied after
  RoPE, where Llama 4 applies it.
* Falcon's ALiBi (``alibi=True``): the bias added to ``q k^T`` before the scale multiplies both.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn


# --------------------------------------------------------------------------- RoPE

def rope_inv_freq(rotary_dim: int, theta: float = 10000.0, scaling: Optional[dict] = None,
                  seq_len: Optional[int] = None):
    """Inverse frequencies (float64, ``rotary_dim // 2``) and the attention factor (YaRN's mscale).

    Written from the published descriptions in terms of wavelengths: pair i of a head turns once
    every ``wavelength_i = 2 pi theta^(2i/d)`` tokens, and each scaling stretches some wavelengths.
    A stretch of s is a frequency divided by s, i.e. positions interpolated by s. ``seq_len``
    (positions seen, the largest plus one) matters for 'dynamic' and 'longrope' only.
    """
    d = rotary_dim
    pair = torch.arange(d // 2, dtype=torch.float64)
    wavelength = 2 * math.pi * theta ** (2 * pair / d)
    mscale = 1.0
    if not scaling:
        return 2 * math.pi / wavelength, mscale
    kind, s = scaling["kind"], float(scaling["factor"])
    if kind == "linear":
        # Position interpolation (Chen et al., 2023): positions / s, so every wavelength is s times longer.
        stretch = torch.full_like(wavelength, s)
    elif kind == "ntk":
        # NTK-aware (bloc97): the base becomes theta * s^(d/(d-2)). Pair i's wavelength then grows by
        # s^(2i/(d-2)): the fastest pair (i = 0) is kept, the slowest (i = d/2 - 1) stretched by exactly s.
        if d < 4:
            raise ValueError(f"NTK-aware scaling needs rotary_dim >= 4 (its exponent is d / (d - 2)), got {d}")
        stretch = s ** (2 * pair / (d - 2))
    elif kind == "dynamic":
        # Dynamic NTK (emozilla/bloc97): below the original context L nothing changes; a sequence of
        # n > L positions uses NTK-aware scaling with the effective factor s n / L - (s - 1), which is
        # 1 at n = L and grows linearly. Under NTK-aware scaling with factor a, pair i's wavelength
        # grows by a^(2i / (d - 2)).
        if d < 4:
            raise ValueError(f"NTK-aware scaling needs rotary_dim >= 4 (its exponent is d / (d - 2)), got {d}")
        L = scaling["original_max_position_embeddings"]
        n = L if seq_len is None else max(int(seq_len), L)
        effective = s * n / L - (s - 1)
        stretch = effective ** (2 * pair / (d - 2))
    elif kind == "longrope":
        # LongRoPE (Ding et al., 2024; Phi-3): a searched stretch per pair, one set for sequences
        # within the original context L ("short") and one beyond it ("long"); the logits are
        # tempered by sqrt(1 + ln(s) / ln(L)) through cos and sin, s = the extension ratio.
        L = scaling["original_max_position_embeddings"]
        chosen = "long_factor" if seq_len is not None and seq_len > L else "short_factor"
        stretch = torch.tensor([float(f) for f in scaling[chosen]], dtype=torch.float64)
        given = scaling.get("attention_factor")
        mscale = given if given is not None else (math.sqrt(1 + math.log(s) / math.log(L)) if s > 1 else 1.0)
    elif kind == "llama3":
        # Llama 3.1: with L the original context, wavelengths longer than L / low_freq_factor are
        # stretched by s, those shorter than L / high_freq_factor kept; in between the frequency is
        # the blend (1 - w) f / s + w f with w = (L / wavelength - low) / (high - low), which runs
        # from 0 at the long edge to 1 at the short one.
        L = scaling["original_max_position_embeddings"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        w = ((L / wavelength - low) / (high - low)).clamp(0.0, 1.0)
        stretch = 1.0 / ((1 - w) / s + w)
    elif kind == "yarn":
        # YaRN (Peng et al., 2023): pair i completes L / wavelength_i rotations over the original
        # context L. Pairs that rotate more than beta_fast times keep their frequency (extrapolation),
        # pairs that rotate less than beta_slow times are interpolated by s, and the share of
        # interpolation ramps linearly over the pair index between the two crossings (the
        # fractional indices where the rotations equal beta_fast and beta_slow, rounded outwards).
        L = scaling["original_max_position_embeddings"]
        beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

        def crossing(rotations):  # solve L / (2 pi theta^(2i/d)) = rotations for i
            return d / 2 * math.log(L / (2 * math.pi * rotations), theta)

        first, last = crossing(beta_fast), crossing(beta_slow)
        if scaling.get("truncate", True):  # whole dims, rounded outwards (gpt-oss keeps fractions)
            first, last = math.floor(first), math.ceil(last)
        first, last = max(first, 0), min(last, d - 1)
        width = (last - first) or 0.001  # a ramp of zero width would divide by zero
        interpolated = ((pair - first) / width).clamp(0.0, 1.0)
        stretch = 1.0 / (interpolated / s + (1 - interpolated))
        # The attention temperature: cos and sin scaled by 0.1 ln(s) + 1 unless given.
        # DeepSeek-V2/V3 give two weights a, b instead: the factor is t(a) / t(b) with
        # t(w) = 1 + 0.1 w ln(s) (their softmax scale later multiplies by t(b)^2 on its own).
        given = scaling.get("attention_factor")

        def temperature(weight):
            return 1.0 + 0.1 * weight * math.log(s) if s > 1 else 1.0

        a, b = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if given is not None:
            mscale = given
        elif a and b:
            mscale = temperature(a) / temperature(b)
        else:
            mscale = temperature(1.0)
    else:
        raise ValueError(f"unknown RoPE scaling kind {kind!r}")
    return 2 * math.pi / (wavelength * stretch), mscale


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, positions, *, theta=10000.0, layout="rotate_half", rotary_dim=None, scaling=None):
    """Rotate ``x`` ``(B, T, N, H)`` by ``positions`` ``(B, T)``; see flax_attn.positional.rope for the conventions."""
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    compute = torch.promote_types(x.dtype, torch.float32)
    seq_len = int(positions.max()) + 1 if scaling and scaling["kind"] in ("dynamic", "longrope") else None
    inv_freq, mscale = rope_inv_freq(rd, theta, scaling, seq_len)
    angles = positions.to(compute)[..., None] * inv_freq.to(compute)  # (B, T, rd/2)
    x_rot, x_pass = x[..., :rd].to(compute), x[..., rd:]
    if layout == "rotate_half":
        emb = torch.cat((angles, angles), dim=-1)[:, :, None, :]  # (B, T, 1, rd)
        cos, sin = emb.cos() * mscale, emb.sin() * mscale
        rotated = x_rot * cos + rotate_half(x_rot) * sin
    elif layout == "interleaved":
        complex_dtype = torch.complex128 if compute == torch.float64 else torch.complex64
        pairs = torch.view_as_complex(x_rot.reshape(*x_rot.shape[:-1], rd // 2, 2).contiguous())
        freqs_cis = torch.polar(torch.full_like(angles, mscale), angles).to(complex_dtype)[:, :, None, :]
        rotated = torch.view_as_real(pairs * freqs_cis).flatten(-2)
    else:
        raise ValueError(f"unknown RoPE layout {layout!r}")
    return torch.cat((rotated.to(x.dtype), x_pass), dim=-1)


# --------------------------------------------------------------------------- ALiBi, T5

def alibi_slopes(num_heads: int, alibi_bias_max: int = 8) -> torch.Tensor:
    """MPT's recipe: slopes for the next power of two, the odd-indexed ones first, cut to N."""
    n = 2 ** math.ceil(math.log2(num_heads))
    m = torch.arange(1, n + 1, dtype=torch.float64) * (alibi_bias_max / n)
    slopes = 1.0 / torch.pow(2, m)
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def alibi_bias(slopes, query_positions, key_positions):
    """``(B, N, T, S)``: ``-slope * |q - k|``."""
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).abs()
    return -slopes[None, :, None, None] * distance[:, None, :, :]


def t5_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    if_large = torch.min(if_large, torch.full_like(if_large, num_buckets - 1))
    return relative_buckets + torch.where(is_small, relative_position, if_large)


# --------------------------------------------------------------------------- attention

def reference_attention(q, k, v, *, allowed=None, bias=None, scale=None, softcap=None, sinks=None,
                        bias_scaled=False):
    """``softmax(scale * q k^T [capped] + bias, allowed) v`` with q ``(B, T, N, H)``, k/v ``(B, S, K, H)``.

    ``bias_scaled``: Falcon's order instead, ``scale * (q k^T + bias)`` (no soft-cap).

    Key/value heads are repeated to N. ``allowed``: boolean broadcastable to ``(B, N, T, S)``.
    A query with nothing allowed returns zeros (the convention flax_attn keeps). ``sinks``
    ``(N,)``: as gpt-oss, each head's sink logit is appended as one more column of the scores,
    the softmax taken over all columns, and the sink's column dropped.
    """
    N, K = q.shape[2], k.shape[2]
    k = k.repeat_interleave(N // K, dim=2)
    v = v.repeat_interleave(N // K, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if bias_scaled:
        scores = (torch.einsum("btnh,bsnh->bnts", q, k) + bias) * scale
        bias = None
    else:
        scores = torch.einsum("btnh,bsnh->bnts", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias
    if sinks is not None:
        B, _, T, S = scores.shape
        if allowed is not None:
            scores = scores.masked_fill(~allowed.expand(scores.shape), float("-inf"))
        sink_column = sinks.to(scores.dtype)[None, :, None, None].expand(B, -1, T, 1)
        weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :S]
        return torch.einsum("bnts,bsnh->btnh", weights, v), weights
    if allowed is not None:
        allowed = allowed.expand(scores.shape)
        scores = scores.masked_fill(~allowed, float("-inf"))
        any_allowed = allowed.any(dim=-1, keepdim=True)
        scores = scores.masked_fill(~any_allowed, 0.0)  # keep fully blocked rows finite
        weights = torch.softmax(scores, dim=-1) * any_allowed
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.einsum("bnts,bsnh->btnh", weights, v), weights


def allowed_keys(query_positions, key_positions, *, causal, window=None, query_segments=None, key_segments=None,
                 chunk=None):
    """Boolean ``(B, 1, T, S)``: causal by position, a window of W keys, equal non-negative segments,
    and (Llama 4's chunked attention) query and key in the same chunk of ``chunk`` positions."""
    offset = query_positions[:, :, None] - key_positions[:, None, :]  # how far back the key is
    allowed = torch.ones_like(offset, dtype=torch.bool)
    if causal:
        allowed &= offset >= 0
    if window is not None:
        allowed &= (offset < window) if causal else (offset.abs() < window)
    if chunk is not None:
        allowed &= torch.div(query_positions, chunk, rounding_mode="floor")[:, :, None] == \
            torch.div(key_positions, chunk, rounding_mode="floor")[:, None, :]
    if query_segments is not None:
        allowed &= (query_segments[:, :, None] == key_segments[:, None, :]) & (key_segments[:, None, :] >= 0)
    return allowed[:, None]


class LearnedPositionalEmbedding(nn.Module):
    """GPT-2's learned absolute positions: a table ``(num_positions, features)`` indexed by position."""

    def __init__(self, num_positions, features):
        super().__init__()
        self.wpe = nn.Embedding(num_positions, features)

    def forward(self, positions):
        return self.wpe(positions)


class Llama4L2Norm(nn.Module):
    """Llama 4's QK-norm (``L2Norm``): ``x * rsqrt(mean(x^2) + eps)`` over each head's features,
    computed in float32 (or wider), no parameter."""

    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def llama4_attention_scales(positions, floor_scale, attn_scale):
    """Llama 4's attention temperature tuning (Hugging Face ``Llama4TextAttention``, which passes
    ``cache_position``; here the positions): ``log(1 + floor((p + 1) / floor_scale)) * attn_scale + 1``."""
    p = positions.to(torch.float64)
    return torch.log(1.0 + torch.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


class OLMo2ProjectionNorm(nn.RMSNorm):
    """OLMo 2's QK-norm: an RMSNorm over the whole query (or key) projection, ``N*H`` features,
    applied before the projection is split into heads."""


class PhiQKLayerNorm(nn.LayerNorm):
    """Phi's ``qk_layernorm``: a LayerNorm (weight and bias) over each head's ``H`` features,
    one set of parameters shared by all heads."""


class CohereHeadLayerNorm(nn.Module):
    """Cohere's ``use_qk_norm``: a LayerNorm without bias over each head's features, with one
    weight row per head: ``weight`` ``(heads, H)``, input ``(B, T, heads, H)``."""

    def __init__(self, heads, head_dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.promote_types(dtype, torch.float32))
        centred = x - x.mean(-1, keepdim=True)
        variance = (centred * centred).mean(-1, keepdim=True)
        x = centred * torch.rsqrt(variance + self.eps)
        return (self.weight.to(x.dtype) * x).to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, computed in float32 (or
    wider), ``weight`` stored zero-centred (zeros make the identity scale)."""

    def __init__(self, shape, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))
        self.eps = eps

    def forward(self, x):
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.to(compute))).to(x.dtype)


class GeneralQKNorm(nn.Module):
    """The QK-norm combinations no published model above uses, from the definitions: RMSNorm or
    LayerNorm over the last axis, ``weight`` of ``shape`` (applied as ``1 + weight`` when
    zero-centred), and an optional ``bias``."""

    def __init__(self, shape, eps, kind, bias, zero_centered):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape) if zero_centered else torch.ones(shape))
        self.bias = nn.Parameter(torch.zeros(shape)) if bias else None
        self.eps, self.kind, self.zero_centered = eps, kind, zero_centered

    def forward(self, x):
        compute = torch.promote_types(x.dtype, torch.float32)
        h = x.to(compute)
        if self.kind == "layer":
            h = h - h.mean(-1, keepdim=True)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.to(compute)
        h = h * (1.0 + w if self.zero_centered else w)
        if self.bias is not None:
            h = h + self.bias
        return h.to(x.dtype)


def make_qk_norm(features, heads, head_dim, *, eps, kind, scope, bias, zero_centered):
    """The QK-norm module of one side (queries: ``heads = N``; keys: ``K``); ``features = heads * head_dim``."""
    shape = {"head": (head_dim,), "per_head": (heads, head_dim), "projection": (features,)}[scope]
    if kind == "rms" and not bias and not zero_centered:
        return OLMo2ProjectionNorm(features, eps=eps) if scope == "projection" else \
            (nn.RMSNorm(head_dim, eps=eps) if scope == "head" else GeneralQKNorm(shape, eps, kind, bias, False))
    if kind == "layer" and scope == "head" and bias and not zero_centered:
        return PhiQKLayerNorm(head_dim, eps=eps)
    if kind == "layer" and scope == "per_head" and not bias and not zero_centered:
        return CohereHeadLayerNorm(heads, head_dim, eps)
    if kind == "rms" and zero_centered and not bias:
        return GemmaRMSNorm(shape, eps)
    return GeneralQKNorm(shape, eps, kind, bias, zero_centered)


class Attention(nn.Module):
    """The configurable layer: the keyword arguments are ``flax_attn.AttentionConfig``'s fields."""

    def __init__(self, d_model, num_heads, num_kv_heads=None, head_dim=None, causal=True, sliding_window=None,
                 position="rope", rope_theta=10000.0, rope_layout="rotate_half", rotary_dim=None,
                 rope_scaling=None, t5_num_buckets=32, t5_max_distance=128, qk_norm=False, qk_norm_eps=1e-6,
                 qk_norm_type="rms", qk_norm_scope="head", qk_norm_bias=False, qk_norm_zero_centered=False,
                 logit_softcap=None, qkv_bias=False, out_bias=False, sinks=False, dropout=0.0, scale=None,
                 chunk_size=None, temperature_tuning=None, qk_norm_weight=True, alibi_scaled=False):
        super().__init__()
        self.N = num_heads
        self.K = num_heads if num_kv_heads is None else num_kv_heads
        self.H = d_model // num_heads if head_dim is None else head_dim
        self.causal, self.window, self.position = causal, sliding_window, position
        self.rope = dict(theta=rope_theta, layout=rope_layout, rotary_dim=rotary_dim, scaling=rope_scaling)
        self.t5 = dict(num_buckets=t5_num_buckets, max_distance=t5_max_distance, bidirectional=not causal)
        self.softcap, self.scale = logit_softcap, scale
        q_bias, k_bias, v_bias = (qkv_bias,) * 3 if isinstance(qkv_bias, bool) else tuple(qkv_bias)
        self.q_proj = nn.Linear(d_model, self.N * self.H, bias=q_bias)
        self.k_proj = nn.Linear(d_model, self.K * self.H, bias=k_bias)
        self.v_proj = nn.Linear(d_model, self.K * self.H, bias=v_bias)
        self.o_proj = nn.Linear(self.N * self.H, d_model, bias=out_bias)
        # Llama 4's weightless L2Norm goes after RoPE, as Llama 4 applies it.
        self.l2_norm = Llama4L2Norm(qk_norm_eps) if qk_norm and not qk_norm_weight else None
        if qk_norm and self.l2_norm is None:
            options = dict(eps=qk_norm_eps, kind=qk_norm_type, scope=qk_norm_scope, bias=qk_norm_bias,
                           zero_centered=qk_norm_zero_centered)
            self.q_norm = make_qk_norm(self.N * self.H, self.N, self.H, **options)
            self.k_norm = make_qk_norm(self.K * self.H, self.K, self.H, **options)
        self.qk_norm = qk_norm and self.l2_norm is None
        self.norm_before_split = self.qk_norm and qk_norm_scope == "projection"
        self.l2_norm_over_heads = qk_norm_scope == "projection"
        self.chunk, self.temperature_tuning, self.alibi_scaled = chunk_size, temperature_tuning, alibi_scaled
        # gpt-oss: one learned sink logit per query head.
        self.sinks = nn.Parameter(torch.randn(self.N)) if sinks else None
        if position == "t5":
            self.rel_bias = nn.Embedding(t5_num_buckets, self.N)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, positions=None, segment_ids=None, context=None, context_positions=None,
                context_segment_ids=None, mask=None, cache=None):
        """As flax_attn.Attention. ``cache``: None or a dict of key, value, positions, segment_ids
        (``(B, S, ...)``); with ``cache`` given (an empty dict to start) returns ``(out, new_cache)``."""
        B, T, _ = x.shape
        source = x if context is None else context
        S = source.shape[1]
        q, k = self.q_proj(x), self.k_proj(source)
        if self.norm_before_split:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, T, self.N, self.H), k.view(B, S, self.K, self.H)
        v = self.v_proj(source).view(B, S, self.K, self.H)
        if self.qk_norm and not self.norm_before_split:
            q, k = self.q_norm(q), self.k_norm(k)
        k_pos = positions if context is None else context_positions
        k_seg = segment_ids if context is None else context_segment_ids
        if self.position == "rope":
            q, k = apply_rope(q, positions, **self.rope), apply_rope(k, k_pos, **self.rope)
        if self.l2_norm is not None:
            if self.l2_norm_over_heads:  # one norm over all heads' features
                q = self.l2_norm(q.reshape(B, T, -1)).view(B, T, self.N, self.H)
                k = self.l2_norm(k.reshape(B, S, -1)).view(B, S, self.K, self.H)
            else:
                q, k = self.l2_norm(q), self.l2_norm(k)
        if self.temperature_tuning is not None:
            scales = llama4_attention_scales(positions, *self.temperature_tuning)
            q = (q * scales[:, :, None, None].to(q.dtype)).to(q.dtype)
        new_cache = None
        if cache is not None:
            if segment_ids is None:
                segment_ids = k_seg = torch.zeros(B, T, dtype=torch.long)
            if cache:
                k = torch.cat([cache["key"], k], dim=1)
                v = torch.cat([cache["value"], v], dim=1)
                k_pos = torch.cat([cache["positions"], k_pos], dim=1)
                k_seg = torch.cat([cache["segment_ids"], k_seg], dim=1)
            new_cache = {"key": k, "value": v, "positions": k_pos, "segment_ids": k_seg}
        if positions is None:  # position='none' without a cache: queries are the last T of S keys
            S_all = k.shape[1]
            k_pos = torch.arange(S_all)[None].expand(B, S_all)
            positions = (torch.arange(T) + S_all - T)[None].expand(B, T)
        allowed = allowed_keys(positions, k_pos, causal=self.causal, window=self.window,
                               query_segments=segment_ids if k_seg is not None else None, key_segments=k_seg,
                               chunk=self.chunk)
        if mask is not None:
            allowed = allowed & mask
        bias = None
        if self.position == "alibi":
            bias = alibi_bias(alibi_slopes(self.N).to(q.dtype), positions, k_pos)
        elif self.position == "t5":
            buckets = t5_relative_position_bucket(k_pos[:, None, :] - positions[:, :, None], **self.t5)
            bias = self.rel_bias(buckets).permute(0, 3, 1, 2)
        out, weights = reference_attention(q, k, v, allowed=allowed, bias=bias, scale=self.scale, softcap=self.softcap,
                                           sinks=self.sinks, bias_scaled=self.alibi_scaled)
        out = self.o_proj(out.reshape(B, T, self.N * self.H))
        return out if cache is None else (out, new_cache)
