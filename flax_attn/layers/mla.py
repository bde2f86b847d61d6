"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, section 2.1; DeepSeek-V3).

Keys and values of all N heads are decompressed from one low-rank latent per token, so a
decoding cache holds that latent (``kv_lora_rank`` numbers) and one shared rotary key
(``qk_rope_head_dim``) per token instead of N heads' keys and values. With ``d_n`` =
``qk_nope_head_dim``, ``d_r`` = ``qk_rope_head_dim``, ``d_v`` = ``v_head_dim``, for each token::

    c_q           = RMSNorm(x W_DQ)                       (q_a_proj, q_a_layernorm; r_q = q_lora_rank)
    [q_n, q_r]    = c_q W_UQ  (or x W_Q without q_lora_rank)   (q_b_proj / q_proj)  N x (d_n + d_r)
    [c_kv, k_r]   = x W_DKV                               (kv_a_proj_with_mqa)        r_kv + d_r
    c_kv          = RMSNorm(c_kv)                         (kv_a_layernorm)
    [k_n, v]      = c_kv W_UKV                            (kv_b_proj)            N x (d_n + d_v)
    q = [q_n, RoPE(q_r)],  k = [k_n, RoPE(k_r) for every head]
    o = softmax(scale q k^T, masked) v,   y = o W_O       (o_proj)                N d_v -> D

The decoupled rotary part: RoPE touches only the ``d_r`` dims of each query head and the one
``k_r`` shared by all heads (so the latent stays position-free and ``W_UK`` can be absorbed).
The default softmax scale is ``1 / sqrt(d_n + d_r)``, times ``m(s, mscale_all_dim)^2`` with
``m(s, a) = 0.1 a ln(s) + 1`` when a YaRN ``rope_scaling`` sets ``mscale_all_dim`` (DeepSeek-V3
and Hugging Face ``DeepseekV3Attention`` do this; YaRN's own factor on cos and sin,
``m(s, mscale) / m(s, mscale_all_dim)``, comes from :func:`flax_attn.positional.rope_frequencies`).

**RoPE layout.** ``rope_layout='interleaved'`` (the default) rotates adjacent pairs
``(2i, 2i + 1)``, as DeepSeek's own code does (complex multiplication) and as Hugging Face's
``DeepseekV3Attention`` does with ``rope_interleave=True`` (its default; it rotates the even and
odd dims and writes them back de-interleaved, which permutes query and key dims alike and so
gives the same logits). ``'rotate_half'`` pairs dim i with i + d_r/2: Hugging Face's
``rope_interleave=False``.

**Latent cache.** :class:`LatentKVCache` stores the normalised ``c_kv`` ``(B, S, r_kv)`` and the
rotated ``k_r`` ``(B, S, d_r)`` per slot (side by side, in one array), with positions and segment ids like
:class:`flax_attn.KVCache`: ``r_kv + d_r`` numbers per token and layer instead of
``N (d_n + d_r + d_v)`` (DeepSeek-V3: 576 instead of 40960, 71x smaller). It is checked as
``KVCache`` is (shapes, dtype, overflow, a row's new positions after its cached ones) and rolls
back only on purpose (:meth:`LatentKVCache.truncate`).

**Absorbed form** (``MLAConfig(absorb=True)``): ``q_n k_n^T = (q_n W_UK^T) c_kv^T``, so the query
is mapped into the latent space and attention runs as multi-query attention over the cached
latents themselves (key ``[c_kv, k_r]``, value ``c_kv``), the value projection ``W_UV`` applied
to the attention output. The same function; per decoded token it reads the latent cache once
instead of decompressing N heads' keys and values for every cached token.

**Decoding cost.** With a cache, the core is told how many slots are filled (a
``finite_past_lengths`` rule: the slots past them hold zeros), and a one-token step's segment
rule is folded into the key positions, so nothing is zeroed and, on CPU, the absorbed form's
step reads only the filled blocks of the cache (:class:`flax_attn.core.key_blocks.KeyBlocks`).
On a 2-core AMD EPYC (16 heads, r_kv 512, d_n 128, d_r 64, d_v 128, D 2048, float32; 1,025
tokens in 8,192 slots) an absorbed step took 4.6 ms at batch 1 and 14 ms at batch 8, where it
took 34 and 181 ms while every slot was read and the cache concatenated and zeroed each step
(``python -m benchmarks.decode_mla`` compares it with PyTorch eager). The plain form
decompresses every slot's keys and values at each step (``kv_b_proj`` over the whole cache:
335 ms there): decode with ``absorb=True``. The absorbed form's two products with
``kv_b_proj`` (Hugging Face's layout interleaves each head's key and value blocks) take one of
three forms: on CPU, up to :data:`ROWS_LOOPING_OVER_HEADS` query rows (batch x tokens), a loop
over the heads reading each head's blocks where they lie; with one or two rows, in a step of
:func:`flax_attn.decode_step` compiled without YNNPACK (CPUs without AVX-512), sums of products
over the weight where it lies (:data:`ROWS_READING_KV_B_IN_PLACE`: with 128 heads, D 2048,
batch 1, 1,024 cached tokens, AMD EPYC family 25, a step took 80 ms rearranging and 65 ms
without); otherwise (more rows, GPU, TPU) ``kv_b_proj`` rearranged into per-head blocks at
each call for two batched matmuls, a cost that grows with the heads.

The pure stage is :func:`mla_forward` with the parameter specs of :func:`mla_params`;
:class:`MultiHeadLatentAttention` (Linen) and its NNX twin
:class:`flax_attn.nnx.mla.MultiHeadLatentAttention` hold the parameters and call it. Parameter names are
Hugging Face's (``q_a_proj``, ``kv_b_proj``, ...), so :func:`from_torch_state_dict` reads a
``DeepseekV3Attention`` (or ``torch_ref.mla.MultiHeadLatentAttention``) state_dict.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core import dot_product_attention, tuning
from flax_attn.layers.cache import (BLOCK, GROWTH, combined_mask, one_query_key_positions, reserve_slots, resize_slots,
                                    stored_ints, truncate_slots)
from flax_attn.layers.common import (batched_positions, by_row_chunks, check_floating, declare, declared, dense,
                                     dropout_rng, linear_params, on_one_cpu_device, rms_norm, scale_params)
from flax_attn.positional import rope as rope_lib


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Configuration of :class:`MultiHeadLatentAttention`; every field is also a keyword of
    ``torch_ref.mla.MultiHeadLatentAttention``. Hugging Face ``DeepseekV3Config`` names in brackets
    (fields without brackets have no counterpart there); :func:`flax_attn.hf.load_attention`
    reads a checkpoint's ``config.json`` into them.

    Symbols as in the module docstring: D, N, r_kv, r_q, d_n, d_r, d_v. Fields are checked at
    construction (``ValueError`` naming the field); ``rope_scaling`` is stored as a ``RopeScaling``.

    Attributes:
      d_model [hidden_size]: D, the width of the input ``x`` and of the output; an int >= 1.
      num_heads [num_attention_heads]: N, the attention heads (queries, keys and values alike);
        an int >= 1.
      kv_lora_rank [kv_lora_rank]: r_kv, the width of the latent ``c_kv`` from which every head's
        keys and values are decompressed, and which a cache stores: ``kv_a_proj_with_mqa``
        ``(D, r_kv + d_r)``, ``kv_a_layernorm`` ``scale (r_kv,)``, ``kv_b_proj`` ``(r_kv, N (d_n + d_v))``.
      qk_nope_head_dim [qk_nope_head_dim]: d_n, the query/key dims of each head without position
        (the keys' from the latent).
      qk_rope_head_dim [qk_rope_head_dim]: d_r, the query dims of each head with RoPE, and the dims
        of the one rotary key shared by all heads; even.
      v_head_dim [v_head_dim]: d_v, the value dims of each head (may differ from d_n + d_r);
        ``o_proj`` is ``(N d_v, D)``.
      q_lora_rank [q_lora_rank]: r_q, low-rank queries: ``q_a_proj`` ``(D, r_q)``, ``q_a_layernorm``
        ``scale (r_q,)``, ``q_b_proj`` ``(r_q, N (d_n + d_r))``. None (default; DeepSeek-V2-Lite):
        one ``q_proj`` ``(D, N (d_n + d_r))``.
      causal: a query attends to keys at its position or earlier (default True, as in DeepSeek);
        False: to every key.
      rope_theta [rope_theta]: the RoPE frequency base (default 10000.0).
      rope_layout [rope_interleave]: ``'interleaved'`` (default: pairs ``(2i, 2i + 1)``, DeepSeek's
        code; ``rope_interleave=True``) or ``'rotate_half'`` (i with i + d_r/2;
        ``rope_interleave=False``).
      rope_scaling [rope_scaling]: None (default), a :class:`flax_attn.RopeScaling` or a dict of
        its fields, passed to :func:`flax_attn.rope_frequencies` (DeepSeek-V3: YaRN, with
        ``mscale`` and ``mscale_all_dim``; ``flax_attn.hf`` translates Hugging Face's keys).
      rms_norm_eps: the epsilon of ``q_a_layernorm`` and ``kv_a_layernorm``, > 0 (default 1e-6).
        Not Hugging Face's ``rms_norm_eps``, which is the decoder's: transformers builds these two
        norms with 1e-6, and ``flax_attn.hf`` does too.
      attention_bias [attention_bias]: biases on ``q_a_proj`` ``(r_q,)``, ``kv_a_proj_with_mqa``
        ``(r_kv + d_r,)`` and ``o_proj`` ``(D,)`` (default False); never on ``q_proj``,
        ``q_b_proj`` or ``kv_b_proj``, as in DeepSeek.
      dropout [attention_dropout]: the dropout rate on the attention weights, in [0, 1) (default
        0.0); with a rate above 0 a call needs ``deterministic``.
      scale: the softmax scale, a positive number. None (default): ``1 / sqrt(d_n + d_r)``, times
        YaRN's ``m(factor, mscale_all_dim)^2`` when ``rope_scaling`` sets ``mscale_all_dim``
        (:attr:`softmax_scale`).
      absorb: attend in the latent space (``W_UK`` folded into the query, ``W_UV`` applied after;
        default False): the same function and parameters, and the cheap way to decode with a
        cache (see the module docstring).
    """

    d_model: int                        # D
    num_heads: int                      # N
    kv_lora_rank: int                   # r_kv
    qk_nope_head_dim: int               # d_n
    qk_rope_head_dim: int               # d_r (even)
    v_head_dim: int                     # d_v
    q_lora_rank: Optional[int] = None   # r_q (None: one q_proj)
    causal: bool = True
    rope_theta: float = 10000.0
    rope_layout: str = "interleaved"    # 'interleaved' | 'rotate_half'
    rope_scaling: Any = None            # RopeScaling or a dict of its fields
    rms_norm_eps: float = 1e-6          # of q_a_layernorm and kv_a_layernorm
    attention_bias: bool = False
    dropout: float = 0.0
    scale: Optional[float] = None       # None: softmax_scale's default
    absorb: bool = False

    def __post_init__(self):
        for name in ("d_model", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _checks.check_positive_int(name, getattr(self, name))
        if self.q_lora_rank is not None:
            _checks.check_positive_int("q_lora_rank", self.q_lora_rank)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (RoPE rotates pairs of dims), got {self.qk_rope_head_dim}")
        _checks.check_one_of("rope_layout", self.rope_layout, rope_lib.LAYOUTS)
        object.__setattr__(self, "rope_scaling", rope_lib.as_scaling(self.rope_scaling))
        rope_lib.rope_frequencies(self.qk_rope_head_dim, theta=self.rope_theta, scaling=self.rope_scaling)
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        _checks.check_rate("dropout", self.dropout)
        if self.scale is not None and not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise ValueError(f"scale must be a positive number or None, got {self.scale!r}")

    @property
    def qk_head_dim(self) -> int:
        """``d_n + d_r``: the query/key head dim of the plain form."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``scale`` if given, else ``1/sqrt(d_n + d_r)`` times ``m(factor, mscale_all_dim)^2`` for a
        YaRN ``rope_scaling`` with ``mscale_all_dim`` (``m(s, a) = 0.1 a ln(s) + 1``, 1 for s <= 1)."""
        if self.scale is not None:
            return float(self.scale)
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        rs = self.rope_scaling
        if rs is not None and rs.kind == "yarn" and rs.mscale_all_dim:
            s = float(rs.factor)
            m = 0.1 * rs.mscale_all_dim * math.log(s) + 1.0 if s > 1 else 1.0
            scale *= m * m
        return scale

    @property
    def cache_width(self) -> int:
        """Numbers the latent cache stores per token: ``r_kv + d_r``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_cache_width(self) -> int:
        """Numbers a cache of every head's keys and values would store per token: ``N (d_n + d_r + d_v)``."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim)

    def init_cache(self, batch: int, max_len: int, *, dtype=jnp.float32) -> "LatentKVCache":
        """An empty :class:`LatentKVCache` of ``max_len`` slots: ``c_kv`` ``(B, S, r_kv)``, ``k_pe``
        ``(B, S, d_r)``. ``dtype`` must be that of the latents the layer computes (the result type of
        ``x`` and the parameters); :meth:`MultiHeadLatentAttention.init_cache` defaults to ``param_dtype``."""
        return LatentKVCache.create(batch=batch, max_len=max_len, kv_lora_rank=self.kv_lora_rank,
                                    rope_dim=self.qk_rope_head_dim, dtype=dtype)


@flax.struct.dataclass
class LatentKVCache:
    """MLA's decoding cache: per slot the normalised latent ``c_kv`` ``(B, S, r_kv)`` and the
    rotated shared key ``k_pe`` ``(B, S, d_r)``, side by side in one array ``latent`` ``(B, S,
    r_kv + d_r)`` (``c_kv`` and ``k_pe`` are its two parts), the position and segment id ``(B,
    S)`` (empty slots: -1, never attended to), and ``length`` (int32 scalar), the tokens written
    so far.

    One array, because it is the absorbed form's key as it stands: a decoding step reads it in
    place, where two arrays were first concatenated into a copy of the whole cache (a 16-head,
    rank-512 layer decoding with 1,025 of 8,192 slots filled, on a 2-core AMD EPYC: the
    attention took 52 ms at batch 8 with the copy, 11 ms without).

    Fixed shapes (a jitted step compiles once); new tokens are written in place at ``length``
    with ``lax.dynamic_update_slice``. Checked as :class:`flax_attn.KVCache` is: new latents,
    positions and segment ids must have the cache's batch and widths (``ValueError`` quoting the
    shapes); overflow and new positions that do not come after a row's cached ones raise
    ``ValueError`` (eagerly; under ``jax.jit`` when the compiled program runs);
    :meth:`truncate` rolls back on purpose.
    """

    latent: Any
    positions: Any
    segment_ids: Any
    length: Any
    kv_lora_rank: int = flax.struct.field(pytree_node=False)

    @classmethod
    def create(cls, *, batch: int, max_len: int, kv_lora_rank: int, rope_dim: int,
               dtype=jnp.float32) -> "LatentKVCache":
        """An empty cache (latents zero, segment ids -1): B = ``batch``, S = ``max_len``."""
        for name, v in (("batch", batch), ("max_len", max_len), ("kv_lora_rank", kv_lora_rank),
                        ("rope_dim", rope_dim)):
            _checks.check_positive_int(name, v)
        return cls(latent=jnp.zeros((batch, max_len, kv_lora_rank + rope_dim), dtype),
                   positions=jnp.zeros((batch, max_len), jnp.int32),
                   segment_ids=jnp.full((batch, max_len), -1, jnp.int32),
                   length=jnp.zeros((), jnp.int32), kv_lora_rank=kv_lora_rank)

    @property
    def c_kv(self):
        """The normalised latents ``(B, S, r_kv)``."""
        return self.latent[..., :self.kv_lora_rank]

    @property
    def k_pe(self):
        """The rotated shared keys ``(B, S, d_r)``."""
        return self.latent[..., self.kv_lora_rank:]

    @property
    def max_len(self) -> int:
        return self.latent.shape[1]

    @property
    def dtype(self):
        return self.latent.dtype

    def update(self, c_kv, k_pe, positions, segment_ids) -> "LatentKVCache":
        """The cache with ``T`` new tokens written after the ``length`` already there.

        Args:
          c_kv: ``(B, T, r_kv)``; k_pe: ``(B, T, d_r)``; positions, segment_ids: int ``(B, T)``.

        Returns:
          The new cache (same shapes); ``length`` grows by T.
        """
        B, S, W = self.latent.shape
        R = self.kv_lora_rank
        T = c_kv.shape[1] if np.ndim(c_kv) == 3 else None
        dr = W - R
        if T is None or c_kv.shape != (B, T, R) or k_pe.shape != (B, T, dr):
            raise ValueError(f"new latents c_kv {_checks.shape_of(c_kv)} / k_pe {_checks.shape_of(k_pe)} do not fit "
                             f"the cache's c_kv {(B, S, R)} / k_pe {(B, S, dr)}")
        if _checks.shape_of(positions) != (B, T) or _checks.shape_of(segment_ids) != (B, T):
            raise ValueError(f"positions {_checks.shape_of(positions)} and segment_ids "
                             f"{_checks.shape_of(segment_ids)} must be {(B, T)}")
        if T > S:
            raise ValueError(f"{T} new tokens do not fit a latent cache of max_len={S}")
        positions, segment_ids = stored_ints("positions", positions), stored_ints("segment_ids", segment_ids)
        _checks.runtime_check(
            self.length + T <= S,
            "latent KV cache overflow: {length} cached + {new} new tokens > max_len={max_len}; "
            "create a larger cache (MLAConfig.init_cache(batch, max_len))",
            length=self.length, new=T, max_len=S)
        # Positions go forward: each row's new (non-padding) positions after its cached ones (as
        # KVCache); not checked when the write overflows (that error comes first, and alone).
        filled = (jnp.arange(S) < self.length)[None, :] & (self.segment_ids >= 0)
        cached_max = jnp.max(jnp.where(filled, self.positions, jnp.iinfo(jnp.int32).min), axis=1)
        new_min = jnp.min(jnp.where(jnp.asarray(segment_ids) >= 0, jnp.asarray(positions),
                                    jnp.iinfo(jnp.int32).max), axis=1)
        _checks.runtime_check(
            jnp.all(new_min > cached_max) | (self.length + T > S),
            "latent KV cache positions go backwards: new positions (smallest per row {new}) must come after the "
            "cached ones (largest per row {cached}); to roll back, call cache.truncate(length) first",
            new=new_min, cached=cached_max)

        def write(buf, new):
            return jax.lax.dynamic_update_slice_in_dim(buf, jnp.asarray(new).astype(buf.dtype), self.length, axis=1)

        new = jnp.concatenate([jnp.asarray(c_kv).astype(self.dtype), jnp.asarray(k_pe).astype(self.dtype)], axis=-1)
        return self.replace(latent=write(self.latent, new),
                            positions=write(self.positions, positions),
                            segment_ids=write(self.segment_ids, segment_ids), length=self.length + T)

    def truncate(self, length) -> "LatentKVCache":
        """The cache holding only its first ``length`` tokens, the other slots emptied (latents
        zero, segment ids -1): the explicit way to roll back (rewind rejected draft tokens).
        ``length``: an int or int32 scalar (traced under ``jax.jit``), ``0 <= length <=
        self.length`` (``ValueError`` otherwise, at run time under ``jax.jit``)."""
        return truncate_slots(self, length, latent=0, positions=0, segment_ids=-1)

    def resize(self, max_len: int) -> "LatentKVCache":
        """The same tokens in a cache of ``max_len`` slots (``KVCache.resize``)."""
        return resize_slots(self, max_len, latent=0, positions=0, segment_ids=-1)

    def reserve(self, tokens: int, growth: float = GROWTH) -> "LatentKVCache":
        """This cache if it holds ``tokens`` slots, else the same tokens in one grown by
        ``growth`` at least (``KVCache.reserve``)."""
        return reserve_slots(self, tokens, growth, BLOCK)


def mla_params(config: MLAConfig) -> dict:
    """The parameter specs (:class:`flax_attn.layers.common.ParamSpec`), Hugging Face's names:

    with ``q_lora_rank``: ``q_a_proj`` ``(D, r_q)``, ``q_a_layernorm`` ``scale (r_q,)``, ``q_b_proj``
    ``(r_q, N (d_n + d_r))``; without: ``q_proj`` ``(D, N (d_n + d_r))``. Always
    ``kv_a_proj_with_mqa`` ``(D, r_kv + d_r)``, ``kv_a_layernorm`` ``scale (r_kv,)``, ``kv_b_proj``
    ``(r_kv, N (d_n + d_v))`` (per head: d_n key dims, then d_v value dims), ``o_proj`` ``(N d_v, D)``.
    Biases (``attention_bias``) on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
    """
    c = config
    N, D, bias = c.num_heads, c.d_model, c.attention_bias
    specs = {}
    if c.q_lora_rank is None:
        specs["q_proj"] = linear_params(D, N * c.qk_head_dim, use_bias=False)
    else:
        specs["q_a_proj"] = linear_params(D, c.q_lora_rank, use_bias=bias)
        specs["q_a_layernorm"] = scale_params(c.q_lora_rank)
        specs["q_b_proj"] = linear_params(c.q_lora_rank, N * c.qk_head_dim, use_bias=False)
    specs["kv_a_proj_with_mqa"] = linear_params(D, c.kv_lora_rank + c.qk_rope_head_dim, use_bias=bias)
    specs["kv_a_layernorm"] = scale_params(c.kv_lora_rank)
    specs["kv_b_proj"] = linear_params(c.kv_lora_rank, N * (c.qk_nope_head_dim + c.v_head_dim), use_bias=False)
    specs["o_proj"] = linear_params(N * c.v_head_dim, D, use_bias=bias)
    return specs


def _rope(config: MLAConfig, x, positions):
    return rope_lib.apply_rope(x, positions, theta=config.rope_theta, layout=config.rope_layout,
                               scaling=config.rope_scaling)


def mla_forward(config: MLAConfig, params: Mapping, x, positions, segment_ids=None, mask=None,
                cache: Optional[LatentKVCache] = None, *, dropout_rng=None, precision=None, implementation=None):
    """Multi-head latent attention as a pure function (see the module docstring for the formulas).

    Args:
      config: the :class:`MLAConfig`.
      params: the tree of :func:`mla_params` (``variables['params']`` of the Linen layer).
      x: floating ``(B, T, D)``.
      positions: int ``(B, T)`` or ``(T,)``: RoPE angles and the causal rule compare them.
      segment_ids: int ``(B, T)``: packed sequences attend within their segment; negative ids
        are padding (never attended to; such queries return zeros).
      mask: extra boolean mask, True = may attend, broadcastable to ``(B, N, T, S)`` (S = T, or
        the cache's ``max_len`` with a cache).
      cache: a :class:`LatentKVCache`: the new tokens' latents are written into it and the call
        attends over every cached token; returns ``(output, new_cache)``.
      dropout_rng: PRNG key for dropout on the attention weights, or None (no dropout).
      precision, implementation: for the matmuls and :func:`flax_attn.dot_product_attention`.

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` with a cache.
    """
    c = config
    D = c.d_model
    _checks.check_rank("x", x, 3, "(B, T, D)")
    check_floating("MultiHeadLatentAttention", "x", x)
    if x.shape[-1] != D:
        raise ValueError(f"x has shape {x.shape}: its last dim must be d_model={D}")
    B, T, _ = x.shape
    if positions is None:
        raise ValueError(f"positions are required (RoPE and the causal rule use them): pass positions of shape "
                         f"({B}, {T})")
    positions = batched_positions("positions", positions, B, T)
    segment_ids = batched_positions("segment_ids", segment_ids, B, T)
    if cache is not None:
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"cache must be a LatentKVCache (MLAConfig.init_cache), got {type(cache).__name__}")
        a = params["kv_a_proj_with_mqa"]
        latent_dtype = jnp.result_type(x, a["kernel"], *(() if "bias" not in a else (a["bias"],)),
                                       params["kv_a_layernorm"]["scale"])
        if cache.dtype != latent_dtype:
            raise TypeError(f"latent cache dtype {cache.dtype} does not match the latents' dtype {latent_dtype}: "
                            f"create it with dtype={latent_dtype} (MLAConfig.init_cache(..., dtype=...))")

    def stage(params, x, positions, segment_ids):
        return _mla(c, params, x, positions, segment_ids, mask, cache, dropout_rng, precision, implementation)

    if cache is None and mask is None and dropout_rng is None:
        return by_row_chunks(stage, params, x, positions, segment_ids)  # every input's rows are independent
    return stage(params, x, positions, segment_ids)


ROWS_READING_KV_B_IN_PLACE = 2
"""Up to this many query rows (batch x tokens), in a program declared to compile without
XLA's YNNPACK fusions (:func:`flax_attn.core.tuning.compiled_with`: a step of
:func:`flax_attn.decode_step` on a CPU without AVX-512), the absorbed form sums products over
``kv_b_proj`` where it lies instead of rearranging it into per-head blocks for two batched
matmuls. A decoding step of DeepSeek-V2-Lite's attention shapes (16 heads, 1,024 cached
tokens, AMD EPYC family 25, in turns in one process): 7.8 -> 6.7-7.0 ms at batch 1, 18.0 ->
15.2 ms at batch 2, even at batch 4 and twice as slow at batch 8, where every row reads the
whole weight again. With YNNPACK's fusions on (XLA's default) the sums took 20.3 ms at
batch 1 against the matmuls' 8.7."""


ROWS_LOOPING_OVER_HEADS = 64
"""Up to this many query rows (batch x tokens) on CPU, the absorbed form multiplies by
``kv_b_proj`` one head at a time in a loop (:func:`_head_by_head`), each head's ``W_UK`` and
``W_UV`` blocks read where they lie, instead of rearranging ``kv_b_proj`` into per-head blocks
for two batched matmuls, which XLA's CPU runtime runs slowly with few rows. The two products
alone (r_kv 512, d_n = d_v = 128, float32, caches cold; AMD EPYC family 25, model 17), ms,
batched / loop: 16 heads, 1 row 1.47 / 1.13, 8 rows 3.25 / 1.96, 64 rows 6.11 / 5.35; 128
heads, 1 row 26.0 / 6.5, 8 rows 38.0 / 16.2, 64 rows 81.7 / 42.2. A whole decoding step of
DeepSeek-V2-Lite's shapes is in :mod:`benchmarks.decode_mla`. Programs declared without
YNNPACK's fusions keep :data:`ROWS_READING_KV_B_IN_PLACE` for one or two rows; where JAX sees
more than one device, ``kv_b_proj`` may be sharded over its heads, and the batched matmuls stay
(a loop over the heads would cut across the shards)."""


def _head_by_head(x, kv_b, block: slice, axis: int, precision: Any = None):
    """``x`` ``(B, T, N, X)`` by each head's block of ``kv_b`` ``(r_kv, N, d_n + d_v)``, one head
    a step: head ``n``'s rows ``x[:, :, n]`` contracted with ``kv_b[:, n, block]`` over that
    block's ``axis`` (1: its ``d_n`` columns, giving ``(B, T, N, r_kv)``; 0: its ``r_kv`` rows,
    giving ``(B, T, N, d_v)``)."""
    def head(n):
        w = jax.lax.dynamic_index_in_dim(kv_b, n, 1, keepdims=False)[:, block]
        rows = jax.lax.dynamic_index_in_dim(x, n, 2, keepdims=False)
        return jax.lax.dot_general(rows, w, (((2,), (axis,)), ((), ())), precision=precision)
    return jnp.moveaxis(jax.lax.map(head, jnp.arange(x.shape[2])), 0, 2)


def _mla(c: MLAConfig, params, x, positions, segment_ids, mask, cache, dropout_rng, precision, implementation):
    """:func:`mla_forward` after its checks, positions and segment ids batched."""
    N = c.num_heads
    dn, dr, dv, R = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    B, T, _ = x.shape
    if c.q_lora_rank is None:
        q = dense(params["q_proj"], x, precision)
    else:
        q = dense(params["q_b_proj"], rms_norm(params["q_a_layernorm"], dense(params["q_a_proj"], x, precision),
                                               c.rms_norm_eps), precision)
    q = q.reshape(B, T, N, dn + dr)
    q_nope, q_pe = q[..., :dn], _rope(c, q[..., dn:], positions)
    latent = dense(params["kv_a_proj_with_mqa"], x, precision)
    c_kv = rms_norm(params["kv_a_layernorm"], latent[..., :R], c.rms_norm_eps)   # (B, T, r_kv)
    k_pe = _rope(c, latent[..., None, R:], positions)[:, :, 0]                   # (B, T, d_r), shared by heads

    key_positions, key_segments, new_cache, query_segments = positions, segment_ids, None, segment_ids
    if cache is not None:
        if segment_ids is None:
            segment_ids = query_segments = jnp.zeros((B, T), jnp.int32)
        pad = (segment_ids < 0)[..., None]  # padding keeps zeros in its slots (no garbage cached)
        new_cache = cache.update(jnp.where(pad, 0, c_kv), jnp.where(pad, 0, k_pe), positions, segment_ids)
        c_kv, k_pe = new_cache.c_kv, new_cache.k_pe
        key_positions, key_segments = new_cache.positions, new_cache.segment_ids
        # Past its length the cache holds zeros (never NaN) with segment id -1: the core may skip
        # those slots and need not zero them. One query per row (decoding): its segment rule
        # folds into the key positions, and the call needs no segment ids at all.
        mask = combined_mask((), mask, written=new_cache.length, batch=B)
        if T == 1 and c.causal:
            key_positions = one_query_key_positions(key_positions, key_segments, segment_ids)
            key_segments = query_segments = None
    S = c_kv.shape[1]

    kv_b = params["kv_b_proj"]["kernel"].reshape(R, N, dn + dv)
    attend = dict(scale=c.softmax_scale, is_causal=c.causal, query_positions=positions, key_positions=key_positions,
                  query_segment_ids=query_segments, key_segment_ids=key_segments,
                  dropout_rate=c.dropout if dropout_rng is not None else 0.0, dropout_rng=dropout_rng,
                  precision=precision, implementation=implementation)
    if c.absorb:
        # q_n . k_n = (q_n W_UK^T) . c_kv: multi-query attention over the latents themselves.
        dtype = jnp.result_type(q_nope, kv_b)
        if _checks.decided(lambda: B * T <= ROWS_READING_KV_B_IN_PLACE) and tuning.ynnpack_fusions_off():
            # One or two query rows (decoding) in a program without YNNPACK's fusions: products
            # summed where kv_b_proj lies, each half read once and nothing rearranged (float32
            # sums for 16-bit inputs).
            acc = jnp.promote_types(dtype, jnp.float32)
            q_latent = jnp.sum(q_nope.astype(acc)[:, :, None] * kv_b[..., :dn].astype(acc), axis=-1)  # (B, T, R, N)
            absorb_values = lambda o: jnp.sum(  # noqa: E731
                jnp.swapaxes(o, 2, 3)[..., None].astype(acc) * kv_b[..., dn:].astype(acc), axis=2).astype(dtype)
            q_latent = jnp.swapaxes(q_latent, 2, 3).astype(dtype)
        elif _checks.decided(lambda: B * T <= ROWS_LOOPING_OVER_HEADS) and on_one_cpu_device():
            # A few query rows (decoding) on CPU: one head a step, each head's blocks of
            # kv_b_proj read where they lie (a loop: the program does not grow with the heads).
            kv_b = kv_b.astype(dtype)
            q_latent = _head_by_head(q_nope.astype(dtype), kv_b, slice(0, dn), 1, precision)       # (B, T, N, R)
            absorb_values = lambda o: _head_by_head(o, kv_b, slice(dn, None), 0, precision)  # noqa: E731
        else:
            # kv_b_proj per head, (N, r_kv, d_n + d_v): one transpose copying runs of d_n + d_v,
            # kept as it is (the barrier) so that XLA does not fold it into each matmul below,
            # where it chose a transpose with r_kv innermost (strided reads). 16 heads of a
            # 2,048-wide layer, one token, AMD EPYC: the two matmuls 2.3 -> 0.9 ms (batch 1),
            # 5.1 -> 3.1 ms (batch 8).
            kv_b = jax.lax.optimization_barrier(jnp.transpose(kv_b, (1, 0, 2)).astype(dtype))
            q_latent = jnp.einsum("BTNH,NRH->BTNR", q_nope.astype(dtype), kv_b[..., :dn], precision=precision)
            absorb_values = lambda o: jnp.einsum("BTNR,NRV->BTNV", o, kv_b[..., dn:],  # noqa: E731
                                                 precision=precision)
        query = jnp.concatenate([q_latent, q_pe.astype(dtype)], axis=-1)                 # (B, T, N, r_kv + d_r)
        # key [c_kv, k_pe] (B, S, 1, r_kv + d_r): the latent cache as it stands. It is the value
        # too, the output's last d_r dims dropped: c_kv alone would be a strided copy of the cache.
        key = (jnp.concatenate([c_kv, k_pe], axis=-1) if cache is None else new_cache.latent)[:, :, None, :]
        key = key.astype(dtype)
        with tuning.keys_stored("BKSH" if cache is not None else None):  # one latent head: the cache as it lies
            o_latent = dot_product_attention(query, key, key, None, mask, **attend)[..., :R]
        out = absorb_values(o_latent)
    else:
        kv = dense(params["kv_b_proj"], c_kv, precision).reshape(B, S, N, dn + dv)
        key = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_pe[:, :, None, :], (B, S, N, dr)).astype(kv.dtype)],
                              axis=-1)                                                    # (B, S, N, d_n + d_r)
        query = jnp.concatenate([q_nope, q_pe], axis=-1)
        out = dot_product_attention(query, key, kv[..., dn:], None, mask, **attend)     # (B, T, N, d_v)
    out = dense(params["o_proj"], out.reshape(B, T, N * dv), precision)
    return out if cache is None else (out, new_cache)


class MultiHeadLatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3) configured by :class:`MLAConfig`.

    Parameters (:func:`mla_params`, Hugging Face's names): ``q_proj`` or ``q_a_proj`` /
    ``q_a_layernorm`` / ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``. The PyTorch twin is ``torch_ref.mla.MultiHeadLatentAttention``.

    Call (arrays by position in this order or by name; options keyword-only):
      x: floating ``(B, T, D)``.
      positions: int ``(B, T)`` or ``(T,)`` (required).
      segment_ids: int ``(B, T)``; negative ids mark padding.
      mask: extra boolean mask, True = may attend, broadcastable to ``(B, N, T, S)``.
      cache: a :class:`LatentKVCache`; the call returns ``(output, new_cache)``.
      deterministic: required when ``dropout > 0``.

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
    """

    config: MLAConfig
    param_dtype: Any = jnp.float32
    precision: Any = None
    implementation: Optional[str] = None

    def setup(self):
        declare(self, mla_params(self.config), self.param_dtype)

    def init_cache(self, batch: int, max_len: int, *, dtype=None) -> LatentKVCache:
        """An empty :class:`LatentKVCache` (``dtype`` defaults to ``param_dtype``); callable unbound."""
        return self.config.init_cache(batch, max_len, dtype=self.param_dtype if dtype is None else dtype)

    def __call__(self, x, positions=None, segment_ids=None, mask=None, cache: Optional[LatentKVCache] = None, *,
                 deterministic: Optional[bool] = None):
        """Causal (by default) multi-head latent self-attention over ``x`` (see the class docstring).

        Args:
          x: floating ``(B, T, D)``.
          positions: int ``(B, T)``, ``(1, T)`` or ``(T,)`` (required): RoPE angles and the causal
            rule use them.
          segment_ids: int, shaped as ``positions``: packed sequences attend only within their
            segment; negative ids mark padding (never attended to; such queries return zeros).
          mask: extra boolean mask, True = may attend, broadcastable to ``(B, N, T, S)`` (S = T, or
            the cache's ``max_len`` with a cache).
          cache: a :class:`LatentKVCache` (dtype of the latents, see :meth:`init_cache`): the new
            tokens' latents are written into it and the call attends over every cached token.
          deterministic: required when ``dropout > 0``; False applies dropout with
            ``rngs={'dropout': key}``.

        Returns:
          ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
        """
        params = declared(self, mla_params(self.config))
        rng = dropout_rng(self, self.config.dropout, deterministic, "MultiHeadLatentAttention")
        return mla_forward(self.config, params, x, positions, segment_ids, mask, cache, dropout_rng=rng,
                           precision=self.precision, implementation=self.implementation)


# --------------------------------------------------------------------------- PyTorch weights

def _template(config: MLAConfig) -> dict:
    return {name: {leaf: jax.ShapeDtypeStruct(spec.shape, jnp.float32) for leaf, spec in sub.items()}
            for name, sub in mla_params(config).items()}


def from_torch_state_dict(config: MLAConfig, state_dict: Mapping[str, Any], *, prefix: str = "", dtype=None) -> dict:
    """Variables ``{'params': ...}`` from a PyTorch state_dict with Hugging Face's names.

    ``state_dict``: NumPy arrays (``torch_ref.state_dict_to_numpy``) of a
    ``torch_ref.mla.MultiHeadLatentAttention`` or a ``DeepseekV3Attention``; an ``nn.Linear``
    weight ``(out, in)`` becomes a ``kernel`` ``(in, out)``, an RMSNorm ``weight`` a ``scale``.
    ``prefix`` (e.g. ``'model.layers.0.self_attn.'``) selects one layer of a model's state_dict:
    only entries starting with it are read. Strict as :func:`flax_attn.interop.params_from_state_dict`
    (every missing, unexpected or mis-shaped entry listed in one ``StateDictError``); ``dtype``
    converts on purpose.
    """
    from flax_attn import interop  # the generic converter (imported here: layers sit below interop)

    entries = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    return {"params": interop.params_from_state_dict(entries, _template(config), dtype=dtype)}


def to_torch_state_dict(config: MLAConfig, variables, *, prefix: str = "") -> dict[str, np.ndarray]:
    """The state_dict (NumPy arrays, Hugging Face's names, each prefixed by ``prefix``) of
    ``variables`` (``{'params': ...}`` or the params tree), checked against ``config``'s shapes."""
    from flax_attn import interop
    from flax import traverse_util

    params = variables["params"] if "params" in variables else variables
    got, want = traverse_util.flatten_dict(params), traverse_util.flatten_dict(_template(config))
    problems = [f"missing parameter {'/'.join(p)}" for p in sorted(set(want) - set(got))]
    problems += [f"unexpected parameter {'/'.join(p)}" for p in sorted(set(got) - set(want))]
    problems += [f"parameter {'/'.join(p)} has shape {tuple(np.shape(got[p]))}, expected {want[p].shape}"
                 for p in sorted(set(got) & set(want)) if tuple(np.shape(got[p])) != tuple(want[p].shape)]
    if problems:
        raise interop.StateDictError("params do not fit the MLA configuration:\n  " + "\n  ".join(problems))
    return {prefix + k: v for k, v in interop.params_to_state_dict(params).items()}
