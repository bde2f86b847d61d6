"""One configurable multi-head attention layer for modern decoders and encoders.

:class:`AttentionConfig` composes the variants; :class:`Attention` owns the parameters and
calls :func:`flax_attn.dot_product_attention`. Its PyTorch twin is ``torch_ref.modern.Attention``
(the same fields as keyword arguments, the same parameter names; ``torch_ref.twin(layer)`` builds
it, see :mod:`flax_attn.interop`), so checkpoints convert with ``flax_attn.from_torch_state_dict``.

    config = AttentionConfig(d_model=512, num_heads=8, num_kv_heads=2, position="rope",
                             sliding_window=256, qk_norm=True)
    layer = Attention(config)
    params = layer.init(key, x, positions)          # x: (B, T, 512), positions: (B, T)
    y = layer.apply(params, x, positions)

Order of operations: project; QK-norm (before or after the head split); rotate (RoPE); tune the
queries' temperature (Llama 4); write into the cache (in place) and attend over it; bias (ALiBi,
T5); scaled dot product with soft-cap, masks (causal, window, chunks, segments), sinks and
dropout; output projection. A ``mask`` given with a cache covers the cache's ``max_len`` slots
(``S = max_len``), or the cached slots followed by the new keys where a rolling cache is too
small to hold them.

A QK-norm without weight (``qk_norm_weight=False``, Llama 4's L2Norm) is applied where every
QK-norm is, before RoPE, while Llama 4 applies it after: an RMS normalisation without weight of
each head (or of all heads) commutes with RoPE, which rotates pairs of features and so keeps
their sum of squares. (A RoPE scaling with an attention factor scales instead of rotating; the
configuration refuses that combination.)

Cross-attention keys and values can be computed once (:meth:`Attention.context_kv`, a
:class:`ContextKV`) and passed as ``context=`` at every decoding step.

The computation is the pure stage :func:`attention_forward` of ``(config, params, inputs)``,
with the parameter specs of :func:`attention_params`; :class:`Attention` (Linen) and
:class:`flax_attn.nnx.Attention` (NNX) only hold the parameters and call it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from jax import lax

from flax_attn import _checks
from flax_attn.core import dot_product_attention
from flax_attn.core import mask as mask_lib
from flax_attn.core import tuning
from flax_attn.layers.cache import BLOCK, ContextKV, KVCache, combined_mask, one_query_key_positions, stored_ints
from flax_attn.layers.common import (ParamSpec, batched_positions, by_row_chunks, check_floating, declare, declared,
                                     dense, dropout_rng, linear_params, norm, norm_params, rms_norm, embed_params)
from flax_attn.positional import alibi as alibi_lib
from flax_attn.positional import rope as rope_lib
from flax_attn.positional import t5 as t5_lib

POSITIONS = ("rope", "alibi", "t5", "none")
QK_NORM_TYPES = ("rms", "layer")
QK_NORM_SCOPES = ("head", "per_head", "projection")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Configuration of :class:`Attention`; every field is also a keyword of ``torch_ref.modern.Attention``.

    Shapes use D = ``d_model``, N = ``num_heads``, K = the key/value heads (:attr:`kv_heads`) and
    H = the head dim (:attr:`kv_head_dim`). Fields are checked at construction (``ValueError`` or
    ``TypeError`` naming the field); ``rope_scaling`` is stored as a ``RopeScaling`` and
    ``qkv_bias`` as one bool when its three flags agree.

    Attributes:
      d_model: D, the width of the input ``x`` (and of ``context``) and of the output; an int >= 1.
      num_heads: N, the query heads; an int >= 1. ``q_proj`` is ``(D, N*H)``, ``o_proj`` ``(N*H, D)``.
      num_kv_heads: K, the key/value heads, an int >= 1 dividing N; each serves N / K query heads.
        None (default): K = N (multi-head); 1: multi-query; in between: grouped-query.
        ``k_proj`` and ``v_proj`` are ``(D, K*H)``; a cache holds K heads.
      head_dim: H, the features of each query, key and value head, an int >= 1 (need not be D / N).
        None (default): ``d_model // num_heads``, and then ``num_heads`` must divide ``d_model``.
      causal: True (default): a query attends to keys at its position or earlier (by the
        positions given). False: to every key (encoders; set it for cross-attention). It also picks
        the sliding window's shape and one-sided (causal) or bidirectional T5 buckets.
      sliding_window: W, an int >= 1, or None (default: no window). Causal: the W keys ending at
        the query, itself included (Mistral; ``local_window_size=(W - 1, 0)``); not causal: W keys
        on each side, the query included (``(W - 1, W - 1)``). Bounds what a rolling cache keeps.
      position: how positions enter: ``'rope'`` (default: queries and keys rotated), ``'alibi'``
        (a fixed bias ``-slope_n * |q_pos - k_pos|`` per head, no parameter), ``'t5'`` (a learned
        relative bias by bucket, parameter ``rel_bias`` ``embedding`` ``(t5_num_buckets, N)``) or
        ``'none'`` (NoPE; add sinusoidal or learned positions to the embeddings outside the
        layer). Calls need ``positions`` unless ``'none'`` (and no cache, no temperature tuning).
      rope_theta: the RoPE frequency base (default 10000.0). The ``rope_*`` fields and
        ``rotary_dim`` act with ``position='rope'`` only.
      rope_layout: the dims RoPE rotates together: ``'rotate_half'`` (default: i with i + d/2;
        GPT-NeoX, Llama) or ``'interleaved'`` (2i with 2i + 1; GPT-J, RoFormer).
      rotary_dim: partial rotary: RoPE rotates only the first ``rotary_dim`` dims of each head, an
        even number in [2, H]. None (default): all H (which must then be even).
      rope_scaling: None (default: plain RoPE), a :class:`flax_attn.RopeScaling` or a dict of its
        fields; kinds ``'linear'``, ``'ntk'``, ``'dynamic'``, ``'llama3'``, ``'yarn'``, ``'longrope'``.
      t5_num_buckets: the T5 bias buckets (default 32), the rows of ``rel_bias``; halved between
        the two directions when not causal.
      t5_max_distance: T5 bias: relative distances from this one on share the last bucket
        (default 128).
      qk_norm: normalise queries and keys after projection, before RoPE (default False): by
        default an RMSNorm of each head, one weight ``(H,)`` shared by the heads; ``qk_norm_type``,
        ``_scope``, ``_bias``, ``_zero_centered`` and ``_weight`` change that, and need
        ``qk_norm=True``. Parameters ``q_norm`` and ``k_norm`` (``scale``, and ``bias`` with
        ``qk_norm_bias``).
      qk_norm_eps: the QK-norm's epsilon (default 1e-6).
      qk_norm_type: ``'rms'`` (default: RMSNorm) or ``'layer'`` (LayerNorm, mean subtracted; Phi,
        Cohere).
      qk_norm_scope: what one norm covers, and the shapes of its query / key weights: ``'head'``
        (default): each head's H features, ``(H,)`` / ``(H,)`` shared by the heads;
        ``'per_head'``: each head's H features, ``(N, H)`` / ``(K, H)`` (Cohere); ``'projection'``:
        all N*H (K*H) features before the head split, ``(N*H,)`` / ``(K*H,)`` (OLMo 2).
      qk_norm_bias: a learned bias in the QK-norm, of the weight's shape, zeros at init (default
        False; Phi); needs ``qk_norm_type='layer'``.
      qk_norm_zero_centered: the norm weight is stored as w and applied as 1 + w, zeros at init
        (Gemma). False (default): applied as is, ones at init.
      logit_softcap: c > 0: the logits become ``c * tanh(logits / c)`` (before bias and mask).
        None (default): no cap.
      qkv_bias: biases in the query / key / value projections, ``(N*H,)`` / ``(K*H,)`` /
        ``(K*H,)``: one bool for all three (default False) or three bools (q, k, v), e.g.
        ``(True, False, True)`` (Whisper: no key bias). See :attr:`projection_biases`.
      out_bias: a bias ``(D,)`` in the output projection (default False).
      sinks: attention sinks (gpt-oss; default False): a learned logit per query head, parameter
        ``sinks`` ``(N,)``, which joins each softmax denominator and takes no value.
      dropout: the dropout rate on the attention weights, in [0, 1) (default 0.0); with a rate
        above 0 a call needs ``deterministic``.
      scale: the logit scale, ``logits = q . k * scale``. None (default): ``1 / sqrt(H)`` (T5
        uses 1.0).
      chunk_size: C, an int >= 1: chunked attention (Llama 4's ``attention_chunk_size``), a query
        sees only keys in its own chunk, ``position // C`` (with the causal rule). None
        (default): no chunks.
      temperature_tuning: ``(floor_scale, attn_scale)``, floor_scale > 0 (Llama 4's
        ``attn_temperature_tuning`` on its NoPE layers: 8192 and 0.1): queries at position p are
        multiplied by ``log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1``
        (:func:`temperature_factor`). p is the ``positions`` argument, where Hugging Face uses
        ``cache_position`` (the token's index in the cache): equal for unpadded rows from 0.
        None (default): off.
      qk_norm_weight: True (default): the QK-norm has learned weights. False: none (Llama 4's
        L2Norm, ``x / sqrt(mean(x^2) + eps)``; no ``q_norm`` / ``k_norm`` parameters); needs
        ``qk_norm=True``, ``qk_norm_type='rms'``, ``qk_norm_zero_centered=False`` and no RoPE
        scaling with an attention factor (see the module docstring).
      alibi_scaled: ALiBi added before the logit scale, ``(q . k + alibi) * scale``, i.e. the
        slopes multiplied by the scale (Falcon-RW, Falcon with ``alibi=True``); needs
        ``position='alibi'`` and no ``logit_softcap``. False (default): ``q . k * scale + alibi``.
    """

    d_model: int                        # D
    num_heads: int                      # N
    num_kv_heads: Optional[int] = None  # K (None: N)
    head_dim: Optional[int] = None      # H (None: d_model // num_heads)
    causal: bool = True
    sliding_window: Optional[int] = None  # W
    position: str = "rope"              # 'rope' | 'alibi' | 't5' | 'none'
    rope_theta: float = 10000.0
    rope_layout: str = "rotate_half"    # 'rotate_half' | 'interleaved'
    rotary_dim: Optional[int] = None
    rope_scaling: Any = None            # RopeScaling or a dict of its fields
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    qk_norm: bool = False
    qk_norm_eps: float = 1e-6
    qk_norm_type: str = "rms"           # 'rms' | 'layer'
    qk_norm_scope: str = "head"         # 'head' | 'per_head' | 'projection'
    qk_norm_bias: bool = False
    qk_norm_zero_centered: bool = False  # weight applied as 1 + w
    logit_softcap: Optional[float] = None  # c
    qkv_bias: Any = False               # a bool, or (q, k, v) bools
    out_bias: bool = False
    sinks: bool = False
    dropout: float = 0.0
    scale: Optional[float] = None       # None: 1 / sqrt(H)
    chunk_size: Optional[int] = None    # C
    temperature_tuning: Optional[tuple] = None  # (floor_scale, attn_scale)
    qk_norm_weight: bool = True
    alibi_scaled: bool = False

    def __post_init__(self):
        _checks.check_positive_int("d_model", self.d_model)
        _checks.check_positive_int("num_heads", self.num_heads)
        if self.num_kv_heads is not None:
            _checks.check_positive_int("num_kv_heads", self.num_kv_heads)
            _checks.check_divides("num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        if self.head_dim is None:
            _checks.check_divides("d_model", self.d_model, "num_heads", self.num_heads)
        else:
            _checks.check_positive_int("head_dim", self.head_dim)
        if self.sliding_window is not None:
            if isinstance(self.sliding_window, bool) or not isinstance(self.sliding_window, (int, np.integer)) \
                    or self.sliding_window < 1:
                raise ValueError(f"sliding_window must be an integer >= 1, got {self.sliding_window!r}")
        _checks.check_one_of("position", self.position, POSITIONS)
        _checks.check_one_of("rope_layout", self.rope_layout, rope_lib.LAYOUTS)
        object.__setattr__(self, "rope_scaling", rope_lib.as_scaling(self.rope_scaling))
        if self.position == "rope":
            rd = self.rotary_dim if self.rotary_dim is not None else self.kv_head_dim
            if not (2 <= rd <= self.kv_head_dim and rd % 2 == 0):
                raise ValueError(f"rotary_dim must be an even number in [2, head_dim={self.kv_head_dim}], got {rd}")
            rope_lib.rope_frequencies(rd, theta=self.rope_theta, scaling=self.rope_scaling)
        _checks.check_rate("dropout", self.dropout)
        _checks.check_one_of("qk_norm_type", self.qk_norm_type, QK_NORM_TYPES)
        _checks.check_one_of("qk_norm_scope", self.qk_norm_scope, QK_NORM_SCOPES)
        if not self.qk_norm:
            changed = [f"{name}={getattr(self, name)!r}" for name, default in
                       (("qk_norm_type", "rms"), ("qk_norm_scope", "head"), ("qk_norm_bias", False),
                        ("qk_norm_zero_centered", False)) if getattr(self, name) != default]
            if changed:
                raise ValueError(f"{', '.join(changed)} configure the QK-norm, but qk_norm=False: set qk_norm=True")
        if self.qk_norm_bias and self.qk_norm_type != "layer":
            raise ValueError(f"qk_norm_bias=True needs qk_norm_type='layer' (LayerNorm), got "
                             f"qk_norm_type={self.qk_norm_type!r}")
        for name in ("qk_norm_bias", "qk_norm_zero_centered", "out_bias", "sinks"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        qkv = self.qkv_bias
        if isinstance(qkv, (bool, np.bool_)):
            qkv = (bool(qkv),) * 3
        elif isinstance(qkv, (tuple, list)) and len(qkv) == 3 and all(isinstance(b, (bool, np.bool_)) for b in qkv):
            qkv = tuple(bool(b) for b in qkv)
        else:
            raise ValueError(f"qkv_bias must be a bool or three bools (q, k, v), got {self.qkv_bias!r}")
        # One bool when all three agree (the common case, and the form checkpoints recorded before).
        object.__setattr__(self, "qkv_bias", qkv[0] if len(set(qkv)) == 1 else qkv)
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be positive, got {self.logit_softcap}")
        self._check_llama4_and_falcon_fields()

    def _check_llama4_and_falcon_fields(self):
        if self.chunk_size is not None:
            if isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, (int, np.integer)) \
                    or self.chunk_size < 1:
                raise ValueError(f"chunk_size must be an integer >= 1 or None, got {self.chunk_size!r}")
            object.__setattr__(self, "chunk_size", int(self.chunk_size))
        tt = self.temperature_tuning
        if tt is not None:
            if not (isinstance(tt, (tuple, list)) and len(tt) == 2
                    and all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                            for v in tt)):
                raise ValueError(f"temperature_tuning must be None or (floor_scale, attn_scale), two numbers, "
                                 f"got {tt!r}")
            floor_scale, attn_scale = float(tt[0]), float(tt[1])
            if not (np.isfinite(floor_scale) and floor_scale > 0):
                raise ValueError(f"temperature_tuning floor_scale must be a positive number, got {tt[0]!r}")
            if not np.isfinite(attn_scale):
                raise ValueError(f"temperature_tuning attn_scale must be finite, got {tt[1]!r}")
            object.__setattr__(self, "temperature_tuning", (floor_scale, attn_scale))
        for name in ("qk_norm_weight", "alibi_scaled"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.qk_norm_weight:
            if not self.qk_norm:
                raise ValueError("qk_norm_weight=False configures the QK-norm, but qk_norm=False: set qk_norm=True")
            if self.qk_norm_type != "rms" or self.qk_norm_zero_centered:
                raise ValueError(f"qk_norm_weight=False (a QK-norm without learned weight, Llama 4's L2Norm) needs "
                                 f"qk_norm_type='rms' and qk_norm_zero_centered=False, got "
                                 f"qk_norm_type={self.qk_norm_type!r}, qk_norm_zero_centered="
                                 f"{self.qk_norm_zero_centered!r}")
            if self.position == "rope":
                rd = self.rotary_dim if self.rotary_dim is not None else self.kv_head_dim
                _, factor = rope_lib.rope_frequencies(rd, theta=self.rope_theta, scaling=self.rope_scaling)
                if factor != 1.0:
                    raise ValueError(f"qk_norm_weight=False with a RoPE scaling whose attention factor is {factor} "
                                     f"(not 1): the weightless norm commutes with RoPE only when RoPE is a pure "
                                     f"rotation; use a scaling without attention factor")
        if self.alibi_scaled:
            if self.position != "alibi":
                raise ValueError(f"alibi_scaled=True scales the ALiBi bias: it needs position='alibi', "
                                 f"got position={self.position!r}")
            if self.logit_softcap is not None:
                raise ValueError("alibi_scaled=True and logit_softcap: the bias would be scaled inside or "
                                 "outside the cap, which no model defines; drop one")

    @property
    def cache_window(self) -> Optional[int]:
        """The most keys (the query's own included) a causal query may see: the smaller of
        ``sliding_window`` and ``chunk_size`` (a query sees at most its chunk's keys up to itself),
        or None when neither bounds it. What a rolling cache must keep."""
        bounds = [w for w in (self.sliding_window, self.chunk_size) if w is not None]
        return min(bounds) if bounds else None

    @property
    def projection_biases(self) -> tuple[bool, bool, bool]:
        """Whether the query, key and value projections have a bias (from ``qkv_bias``)."""
        return self.qkv_bias if isinstance(self.qkv_bias, tuple) else (self.qkv_bias,) * 3

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def kv_head_dim(self) -> int:
        return self.d_model // self.num_heads if self.head_dim is None else self.head_dim

    @property
    def window(self) -> Optional[tuple[int, int]]:
        """``local_window_size`` for :func:`dot_product_attention`."""
        if self.sliding_window is None:
            return None
        w = self.sliding_window - 1
        return (w, 0) if self.causal else (w, w)

    def init_cache(self, batch: int, max_len: int, *, dtype=jnp.float32, rolling: bool = False,
                   layout: str = "BKSH", block: int = BLOCK) -> KVCache:
        """An empty :class:`KVCache` for this layer, ``S = max_len`` slots: keys stored
        ``(B*K, S, H)`` (``layout='BKSH'``, the default: each head's keys contiguous, read in place
        when decoding), ``(B, S, K, H)`` (``'BSKH'``) or ``(S // block, B*K, block, H)`` (``'blocks'``:
        a cache much larger than its fill, read block by block, see :class:`KVCache`).

        ``dtype`` must be the dtype of the keys the layer computes (the result type of ``x`` and
        its parameters); a layer given a cache of another dtype raises ``TypeError``. The
        configuration knows no dtype, hence the float32 default here;
        :meth:`Attention.init_cache` defaults to the layer's ``param_dtype``.
        """
        if rolling:
            w = self.cache_window
            if w is None:
                raise ValueError("a rolling cache drops old keys: it needs a sliding_window or a chunk_size")
            if max_len < w - 1:
                raise ValueError(f"a rolling cache for sliding_window={self.sliding_window}, chunk_size="
                                 f"{self.chunk_size} needs max_len >= {w - 1}, got {max_len}")
        return KVCache.create(batch=batch, max_len=max_len, num_kv_heads=self.kv_heads,
                              head_dim=self.kv_head_dim, dtype=dtype, rolling=rolling, layout=layout, block=block)


def attention_params(config: AttentionConfig) -> dict:
    """The parameter specs of the layer (see :class:`flax_attn.layers.common.ParamSpec`):

    ``q_proj`` ``(D, N*H)``, ``k_proj``/``v_proj`` ``(D, K*H)``, ``o_proj`` ``(N*H, D)`` (biases with
    ``qkv_bias``/``out_bias``); with QK-norm ``q_norm``/``k_norm`` (``scale``, and ``bias`` with
    ``qk_norm_bias``, of shape ``(H,)``, or ``(N, H)``/``(K, H)`` per head, or ``(N*H,)``/``(K*H,)``
    over the projection; none with ``qk_norm_weight=False``); with sinks ``sinks`` ``(N,)``; with T5
    bias ``rel_bias`` (``embedding`` ``(buckets, N)``).
    """
    c = config
    N, K, H, D = c.num_heads, c.kv_heads, c.kv_head_dim, c.d_model
    qb, kb, vb = c.projection_biases
    specs = {
        "q_proj": linear_params(D, N * H, use_bias=qb),
        "k_proj": linear_params(D, K * H, use_bias=kb),
        "v_proj": linear_params(D, K * H, use_bias=vb),
        "o_proj": linear_params(N * H, D, use_bias=c.out_bias),
    }
    if c.qk_norm and c.qk_norm_weight:
        shapes = {"head": ((H,), (H,)), "per_head": ((N, H), (K, H)), "projection": ((N * H,), (K * H,))}
        q_shape, k_shape = shapes[c.qk_norm_scope]
        specs["q_norm"] = norm_params(q_shape, bias=c.qk_norm_bias, zero_centered=c.qk_norm_zero_centered)
        specs["k_norm"] = norm_params(k_shape, bias=c.qk_norm_bias, zero_centered=c.qk_norm_zero_centered)
    if c.sinks:
        specs["sinks"] = ParamSpec((N,), nn.initializers.normal(1.0))
    if c.position == "t5":
        specs["rel_bias"] = embed_params(c.t5_num_buckets, N)
    return specs


def _rope(config, x, positions):
    c = config
    return rope_lib.apply_rope(x, positions, theta=c.rope_theta, layout=c.rope_layout,
                               rotary_dim=c.rotary_dim, scaling=c.rope_scaling)


def _qk_norm(config, p, x):
    c = config
    if not c.qk_norm_weight:
        # Llama 4's L2Norm: x / sqrt(mean(x^2) + eps), no parameter, the statistics in at least float32.
        acc = jnp.promote_types(x.dtype, jnp.float32)
        xa = x.astype(acc)
        return (xa * lax.rsqrt(jnp.mean(lax.square(xa), axis=-1, keepdims=True) + c.qk_norm_eps)).astype(x.dtype)
    if c.qk_norm_type == "rms" and not c.qk_norm_zero_centered and c.qk_norm_scope == "head":
        return rms_norm(p, x, c.qk_norm_eps)
    return norm(p, x, c.qk_norm_eps, kind=c.qk_norm_type, zero_centered=c.qk_norm_zero_centered)


def _project_queries(config, params, x, positions, precision):
    """``x`` ``(B, T, D)`` -> queries ``(B, T, N, H)``: projected, QK-normed, rotated, temperature-tuned."""
    c = config
    B, T, _ = x.shape
    q = dense(params["q_proj"], x, precision)
    if c.qk_norm and c.qk_norm_scope == "projection":  # over all heads' features, before the split
        q = _qk_norm(c, params.get("q_norm"), q)
    q = q.reshape(B, T, c.num_heads, c.kv_head_dim)
    if c.qk_norm and c.qk_norm_scope != "projection":  # over each head's H features
        q = _qk_norm(c, params.get("q_norm"), q)
    if c.position == "rope":
        q = _rope(c, q, positions)
    if c.temperature_tuning is not None:
        q = q * temperature_factor(c.temperature_tuning, positions, q.dtype)[:, :, None, None]
    return q


def _project_keys_values(config, params, source, positions, precision):
    """``source`` ``(B, S, D)`` -> keys and values ``(B, S, K, H)``: projected, QK-normed, rotated."""
    c = config
    B, S, _ = source.shape
    K, H = c.kv_heads, c.kv_head_dim
    k = dense(params["k_proj"], source, precision)
    if c.qk_norm and c.qk_norm_scope == "projection":
        k = _qk_norm(c, params.get("k_norm"), k)
    k = k.reshape(B, S, K, H)
    v = dense(params["v_proj"], source, precision).reshape(B, S, K, H)
    if c.qk_norm and c.qk_norm_scope != "projection":
        k = _qk_norm(c, params.get("k_norm"), k)
    if c.position == "rope":
        k = _rope(c, k, positions)
    return k, v


def temperature_factor(temperature_tuning, positions, dtype=jnp.float32):
    """Llama 4's attention temperature tuning: the factor ``log(floor((p + 1) / floor_scale) + 1) *
    attn_scale + 1`` by which a query at position ``p`` is multiplied (arXiv 2501.19399 motivates it:
    the attention's entropy grows with the context length, the factor sharpens it back).

    Args:
      temperature_tuning: ``(floor_scale, attn_scale)`` (Llama 4: 8192 and 0.1).
      positions: int ``(B, T)``.
      dtype: of the result; computed in at least float32.

    Returns:
      ``(B, T)`` in ``dtype``. 1 for ``p + 1 < floor_scale``.

    Note: Hugging Face's ``Llama4TextAttention`` uses ``cache_position`` for ``p``, the index of
    the token in the cache (0, 1, 2, ... over the whole sequence, padding included); here ``p`` is
    the ``positions`` argument, so left-padded or packed rows are tuned by their own positions.
    For an unpadded sequence starting at 0 the two agree.
    """
    floor_scale, attn_scale = temperature_tuning
    acc = jnp.promote_types(dtype, jnp.float32)
    p = jnp.asarray(positions).astype(acc)
    return (jnp.log1p(jnp.floor((p + 1) / floor_scale)) * attn_scale + 1).astype(dtype)


def _check_context(config, context, name="context"):
    _checks.check_rank(name, context, 3, "(B, S, D)")
    check_floating("Attention", name, context)
    if context.shape[-1] != config.d_model:
        raise ValueError(f"{name} has shape {context.shape}: its last dim must be d_model={config.d_model}")


def context_kv_forward(config: AttentionConfig, params, context, context_positions=None, context_segment_ids=None,
                       *, precision=None) -> ContextKV:
    """The cross-attention keys and values of ``context``, computed once for every decode step.

    Args:
      config, params: as :func:`attention_forward`.
      context: floating ``(B, S, D)``.
      context_positions: int ``(B, S)`` or ``(S,)``; required unless ``position='none'``.
      context_segment_ids: int ``(B, S)`` or None (then the layer's calls give no segment ids).
      precision: of the projections.

    Returns:
      a :class:`ContextKV`: keys and values ``(B, S, K, H)`` after projection, QK-norm and RoPE,
      positions and segment ids ``(B, S)`` (or None). Passed as ``context=`` to the layer, it
      gives the result of the raw ``context``.
    """
    c = config
    _check_context(c, context)
    B, S, _ = context.shape
    context_positions = batched_positions("context_positions", context_positions, B, S)
    if c.position != "none" and context_positions is None:
        raise ValueError(f"context_positions are required with position='{c.position}': pass positions of "
                         f"shape ({B}, {S})")
    context_segment_ids = batched_positions("context_segment_ids", context_segment_ids, B, S)
    k, v = _project_keys_values(c, params, context, context_positions, precision)
    return ContextKV(key=k, value=v, positions=context_positions, segment_ids=context_segment_ids)


def attention_forward(config: AttentionConfig, params, x, positions=None, segment_ids=None, context=None,
                      context_positions=None, context_segment_ids=None, mask=None, cache: Optional[KVCache] = None,
                      *, dropout_rng=None, precision=None, implementation=None):
    """The layer as a pure function: :class:`Attention`'s computation with ``params`` given.

    Args:
      config: the :class:`AttentionConfig`.
      params: the parameter tree of :func:`attention_params` (``variables['params']`` of the Linen
        layer, ``flax_attn.nnx.to_linen(layer)['params']`` of the NNX one).
      x, positions, segment_ids, context, context_positions, context_segment_ids, mask, cache:
        as in :class:`Attention` (``x`` ``(B, T, D)``, positions ``(B, T)``, ...). ``context``
        is a ``(B, S, D)`` array or a :class:`ContextKV` from :func:`context_kv_forward` (then
        ``context_positions``/``context_segment_ids`` come from it and must not be given).
      dropout_rng: the PRNG key for dropout on the attention weights (``config.dropout``), or
        None for no dropout.
      precision, implementation: passed to the projections and :func:`dot_product_attention`.

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.

    On CPU a call of at least 4,096 tokens without cache, mask or dropout that is not
    differentiated runs a few batch rows at a time
    (:func:`flax_attn.layers.common.by_row_chunks`: the same numbers, 11-13% faster forward at
    8 x 1,024 tokens, 768 wide, on a 2-core AMD EPYC).
    """
    c = config
    K, H, D = c.kv_heads, c.kv_head_dim, c.d_model
    _checks.check_rank("x", x, 3, "(B, T, D)")
    check_floating("Attention", "x", x)
    if x.shape[-1] != D:
        raise ValueError(f"x has shape {x.shape}: its last dim must be d_model={D}")
    B, T, _ = x.shape
    cross = context is not None
    precomputed = isinstance(context, ContextKV)
    if cross:
        if precomputed:
            if context_positions is not None or context_segment_ids is not None:
                raise ValueError("context is a ContextKV, which holds its positions and segment ids: do not pass "
                                 "context_positions or context_segment_ids")
            context.check_fits(B, K, H)
            context_positions, context_segment_ids = context.positions, context.segment_ids
        else:
            _check_context(c, context)
            if context.shape[0] != B:
                raise ValueError(f"context has shape {context.shape}, expected ({B}, S, {D}) for x of shape {x.shape}")
        if cache is not None:
            raise ValueError("cache is for self-attention; pass either context or cache")
    if cache is not None and not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache (AttentionConfig.init_cache or the layer's init_cache), "
                        f"got {type(cache).__name__}")
    S_new = (context.key.shape[1] if precomputed else context.shape[1]) if cross else T
    needs_positions = c.position != "none" or cache is not None or c.temperature_tuning is not None
    positions = batched_positions("positions", positions, B, T)
    if needs_positions and positions is None:
        why = f"position='{c.position}'" if c.position != "none" else \
            ("a cache" if cache is not None else "temperature_tuning")
        raise ValueError(f"positions are required with {why}: pass positions of shape ({B}, {T})")
    if cross:
        if not precomputed:
            context_positions = batched_positions("context_positions", context_positions, B, S_new)
        if c.position != "none" and context_positions is None:
            raise ValueError(f"context_positions are required with position='{c.position}'")
    else:
        context_positions = positions
    segment_ids = batched_positions("segment_ids", segment_ids, B, T)
    if cross:
        if not precomputed:
            context_segment_ids = batched_positions("context_segment_ids", context_segment_ids, B, S_new)
        if (segment_ids is None) != (context_segment_ids is None):
            raise ValueError("segment_ids and context_segment_ids must be given together"
                             + (" (the ContextKV was made with context_segment_ids="
                                f"{'None' if context_segment_ids is None else 'given'})" if precomputed else ""))
    else:
        context_segment_ids = segment_ids

    def stage(params, x, positions, segment_ids, context, context_positions, context_segment_ids):
        return _attend(c, params, x, positions, segment_ids, context, context_positions, context_segment_ids, mask,
                       cache, dropout_rng, precision, implementation)

    rows = (x, positions, segment_ids, context, context_positions, context_segment_ids)
    if cache is None and mask is None and dropout_rng is None and not precomputed:
        return by_row_chunks(stage, params, *rows)  # every input's rows are independent
    return stage(params, *rows)


def _attend(c: AttentionConfig, params, x, positions, segment_ids, context, context_positions, context_segment_ids,
            mask, cache, dropout_rng, precision, implementation):
    """:func:`attention_forward` after its checks, positions and segment ids batched."""
    N, H = c.num_heads, c.kv_head_dim
    B, T, _ = x.shape
    cross, precomputed = context is not None, isinstance(context, ContextKV)
    q = _project_queries(c, params, x, positions, precision)
    if precomputed:
        context.check_dtype(q)
        k, v = context.key, context.value
    else:
        k, v = _project_keys_values(c, params, context if cross else x, context_positions, precision)

    key_positions, key_segments = context_positions, context_segment_ids
    mask_key_positions, mask_segments = None, ()  # () = as key_positions / key_segments
    new_cache = None
    written = None  # how many leading cache slots hold tokens
    in_place = False  # attending over the cache itself
    if cache is not None:
        # A cache stores int32 positions and segment ids (its keys are rotated already)
        positions = stored_ints("positions", positions)
        segment_ids = stored_ints("segment_ids", segment_ids)
        may_pad = segment_ids is not None  # padding comes only with segment ids
        if segment_ids is None:
            segment_ids = key_segments = jnp.zeros((B, T), jnp.int32)
        cache.check_compatible(k, v, positions, segment_ids)
        cache.check_dtype(k)
        reach = c.cache_window
        if cache.rolling and (reach is None or cache.max_len < reach - 1):
            raise ValueError(f"a rolling cache of max_len={cache.max_len} is too small for "
                             f"sliding_window={c.sliding_window} and chunk_size={c.chunk_size}: "
                             f"use AttentionConfig.init_cache")
        if cache.rolling and T > 1 and may_pad:
            # Padding after a row's real tokens (right padding) takes ring slots without moving the
            # row's positions on: the ring must hold the padding and a reach of keys behind it.
            real = segment_ids >= 0
            pads = jnp.max(jnp.sum((jnp.cumsum(real, axis=1) > 0) & ~real, axis=1))
            _checks.runtime_check(
                (pads == 0) | (pads + reach <= cache.max_len),
                "a rolling cache of max_len={max_len} cannot take {pads} padding tokens after a row's real ones "
                "(right padding): they fill ring slots and push out keys that its next tokens still see "
                "(a reach of {reach}); left-pad the row instead, or create the cache with max_len >= {need}",
                max_len=cache.max_len, pads=pads, reach=reach, need=pads + reach)
        # Padding keeps zeros in its slots, so no garbage (NaN in padded embeddings) is ever cached.
        pad = (segment_ids < 0)[:, :, None, None]
        k, v = jnp.where(pad, jnp.zeros_like(k), k), jnp.where(pad, jnp.zeros_like(v), v)
        new_cache = cache.update(k, v, positions, segment_ids)
        if cache.rolling and T > 1 and cache.holds_window(T, reach):
            _check_ring_keeps_window(cache, positions, segment_ids, reach)
        if cache.holds_window(T, reach):
            # The new keys are in their slots: attend over the cache itself (no copy); unwritten
            # slots have segment id -1, and the stored positions give causal and window masks.
            k, v = new_cache.keys(), new_cache.values()
            in_place = True
            key_positions, key_segments = new_cache.positions, new_cache.segment_ids
            written = jnp.minimum(new_cache.length, new_cache.max_len)  # a ring fills from slot 0 too
            if T == 1 and (c.causal or c.window is not None):
                # One query per row: its segment rule (same segment, no padding) folds into the key
                # positions, a slot it may not see moving out of reach of the causal/window rule
                # (and into another chunk). The core then needs no segment ids and zeroes no cached
                # keys (a pass over the cache).
                mask_key_positions = one_query_key_positions(key_positions, key_segments, segment_ids)
                mask_segments = None
        else:
            # A rolling cache too small to keep what these queries see: cached slots, then new keys.
            k = jnp.concatenate([cache.keys(), k], axis=1)
            v = jnp.concatenate([cache.values(), v], axis=1)
            key_positions = jnp.concatenate([cache.positions, positions], axis=1)
            key_segments = jnp.concatenate([cache.segment_ids, segment_ids], axis=1)

    bias = None
    if c.position == "alibi":
        slopes = alibi_lib.alibi_slopes(N)
        if c.alibi_scaled:  # (q.k + alibi) * scale = q.k * scale + alibi * scale
            slopes = slopes * (c.scale if c.scale is not None else 1.0 / np.sqrt(H))
        bias = alibi_lib.alibi_bias(slopes, positions, key_positions)
    elif c.position == "t5":
        bias = t5_lib.t5_bias(params["rel_bias"]["embedding"], positions, key_positions, bidirectional=not c.causal,
                              max_distance=c.t5_max_distance)
    if mask_key_positions is None:
        mask_key_positions = key_positions
    if mask_segments == ():
        mask_segments = key_segments
    # Llama 4's chunk rule: a query sees keys of its own chunk, position // chunk_size
    chunk = [] if c.chunk_size is None else [mask_lib.chunked(c.chunk_size)]
    mask = combined_mask(chunk, mask, written=written, batch=B)
    declared = (cache.layout, cache.block) if cache is not None and in_place else (None, None)
    with tuning.keys_stored(*declared):
        out = dot_product_attention(
            q, k, v, bias, mask,
            scale=c.scale, is_causal=c.causal, local_window_size=c.window,
            query_positions=positions, key_positions=mask_key_positions if positions is not None else None,
            query_segment_ids=segment_ids if mask_segments is not None else None, key_segment_ids=mask_segments,
            logit_softcap=c.logit_softcap, sinks=params["sinks"] if c.sinks else None,
            dropout_rate=c.dropout if dropout_rng is not None else 0.0,
            dropout_rng=dropout_rng, precision=precision, implementation=implementation,
        )
    out = dense(params["o_proj"], out.reshape(B, T, N * H), precision)
    return out if cache is None else (out, new_cache)


def _check_ring_keeps_window(cache, positions, segment_ids, reach: int) -> None:
    """Raise (at run time, :func:`flax_attn._checks.runtime_check`) where writing these ``T``
    tokens into a rolling cache overwrites a key that one of them may still see: a query at
    position p sees the keys of its segment at ``p - reach + 1 .. p``. Without padding in the
    ring, :meth:`KVCache.holds_window` guarantees it statically; padding after a row's real
    tokens takes ring slots without moving positions on, so the slots a chunk overwrites may
    still hold such keys."""
    T, S = positions.shape[1], cache.max_len
    slots = (cache.length + jnp.arange(T)) % S  # the slots these tokens overwrite
    old_positions, old_segments = cache.positions[:, slots], cache.segment_ids[:, slots]  # (B, T)
    q_pos, q_seg = positions[:, :, None], segment_ids[:, :, None]
    seen = ((q_seg >= 0) & (old_segments[:, None, :] == q_seg) & (old_positions[:, None, :] <= q_pos)
            & (old_positions[:, None, :] > q_pos - reach))
    written = jnp.arange(S) < cache.length  # slots holding a token (padding or real)
    pads = jnp.max(jnp.sum(written & (cache.segment_ids < 0), axis=1))
    _checks.runtime_check(
        ~jnp.any(seen),
        "a rolling cache of max_len={max_len} cannot take {new} tokens at once here: padding after a row's real "
        "tokens ({pads} slots) leaves the ring too few slots for the keys they still see (a reach of {reach}); "
        "feed them in smaller pieces, left-pad instead, or create the cache with max_len >= {need}",
        max_len=S, new=T, pads=pads, reach=reach, need=pads + reach + T - 1)


class Attention(nn.Module):
    """Multi-head attention configured by :class:`AttentionConfig`.

    Parameters (:func:`attention_params`): ``q_proj`` ``(D, N*H)``, ``k_proj``/``v_proj``
    ``(D, K*H)``, ``o_proj`` ``(N*H, D)``; with QK-norm ``q_norm``/``k_norm`` (scale ``(H,)``, or
    as ``qk_norm_scope`` says); with sinks ``sinks`` ``(N,)``; with T5 bias ``rel_bias`` ``(buckets, N)``.
    The NNX twin is :class:`flax_attn.nnx.Attention`.

    Call (arrays may be passed by position, in this order, or by name; options are keyword-only):
      x: floating ``(B, T, D)``: the queries' sequence (and the keys', for self-attention).
      positions: int ``(B, T)`` or ``(T,)``. Required unless ``position='none'`` and no cache.
      segment_ids: int ``(B, T)``: packed sequences attend only within their segment; negative
        ids mark padding (never attended to; such queries return zeros).
      context: ``(B, S, D)`` for cross-attention (keys and values from it; set ``causal=False``),
        or a :class:`ContextKV` made once by :meth:`context_kv` (the same result, without
        projecting the context again); context_positions, context_segment_ids: as above for the
        context (``(B, S)``), held by a ``ContextKV`` instead.
      mask: extra boolean mask, True = may attend, broadcastable to ``(B, N, T, S)``.
      cache: a :class:`KVCache` (self-attention only; its dtype must be the keys' dtype, see
        :meth:`init_cache`): the call writes its keys into the cache, attends over the cache
        and returns ``(output, new_cache)``. :func:`flax_attn.decode_step` jits this with the
        cache donated.
      deterministic: required when ``dropout > 0``.

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
    """

    config: AttentionConfig
    param_dtype: Any = jnp.float32
    precision: Any = None
    implementation: Optional[str] = None

    def setup(self):
        declare(self, attention_params(self.config), self.param_dtype)

    def init_cache(self, batch: int, max_len: int, *, dtype=None, rolling: bool = False,
                   layout: str = "BKSH", block: int = BLOCK) -> KVCache:
        """An empty :class:`KVCache` for this layer (see :meth:`AttentionConfig.init_cache`);
        ``dtype`` defaults to the layer's ``param_dtype``, the dtype of its keys for inputs of
        that dtype or narrower. Callable on the unbound layer: ``layer.init_cache(B, S)``."""
        return self.config.init_cache(batch, max_len, dtype=self.param_dtype if dtype is None else dtype,
                                      rolling=rolling, layout=layout, block=block)

    def __call__(self, x, positions=None, segment_ids=None, context=None, context_positions=None,
                 context_segment_ids=None, mask=None, cache: Optional[KVCache] = None, *,
                 deterministic: Optional[bool] = None):
        """Self-attention over ``x``, or cross-attention from ``x`` to ``context`` (see the class docstring).

        Args:
          x: floating ``(B, T, D)``: the queries' sequence (and the keys', for self-attention).
          positions: int ``(B, T)``, ``(1, T)`` or ``(T,)``; required unless ``position='none'``
            with neither cache nor ``temperature_tuning``.
          segment_ids: int, shaped as ``positions``: packed sequences attend only within their
            segment; negative ids mark padding (never attended to; such queries return zeros).
          context: ``(B, S, D)`` for cross-attention, or a :class:`ContextKV` of :meth:`context_kv`
            (the same result, the context not projected again); None: self-attention, S = T.
          context_positions, context_segment_ids: ``(B, S)`` or ``(S,)``, as ``positions`` and
            ``segment_ids`` for the context (segment ids on both sides or neither); not with a
            ``ContextKV``, which holds them.
          mask: extra boolean mask, True = may attend, broadcastable to ``(B, N, T, S)`` (with a
            cache, S = its ``max_len``, see the module docstring).
          cache: a :class:`KVCache` (self-attention only; dtype of the keys, see :meth:`init_cache`):
            the new keys and values are written into it and the call attends over the cache.
          deterministic: required when ``dropout > 0``; False applies dropout with
            ``rngs={'dropout': key}``.

        Returns:
          ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
        """
        params = declared(self, attention_params(self.config))
        rng = dropout_rng(self, self.config.dropout, deterministic, "Attention")
        return attention_forward(self.config, params, x, positions, segment_ids, context, context_positions,
                                 context_segment_ids, mask, cache, dropout_rng=rng, precision=self.precision,
                                 implementation=self.implementation)

    def context_kv(self, context, context_positions=None, context_segment_ids=None) -> ContextKV:
        """The cross-attention keys and values of ``context`` ``(B, S, D)`` (positions and
        segment ids ``(B, S)``), to pass as ``context=`` at every later call:

            ckv = layer.apply(variables, context, context_positions, method='context_kv')
            y = layer.apply(variables, x, positions, context=ckv)   # = context=context, ...

        See :func:`context_kv_forward`."""
        params = declared(self, attention_params(self.config))
        return context_kv_forward(self.config, params, context, context_positions, context_segment_ids,
                                  precision=self.precision)
