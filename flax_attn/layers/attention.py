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

Order of operations: project; QK-norm (before or after the head split); rotate (RoPE); write into the cache (in place) and
attend over it; bias (ALiBi, T5); scaled dot product with soft-cap, masks, sinks and dropout; output
projection. A ``mask`` given with a cache covers the cache's ``max_len`` slots (``S = max_len``),
or the cached slots followed by the new keys where a rolling cache is too small to hold them.

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

from flax_attn import _checks
from flax_attn.core import dot_product_attention
from flax_attn.layers.cache import KVCache
from flax_attn.layers.common import (ParamSpec, check_floating, declare, declared, dense, dropout_rng,
                                     linear_params, norm, norm_params, rms_norm, scale_params, embed_params)
from flax_attn.positional import alibi as alibi_lib
from flax_attn.positional import rope as rope_lib
from flax_attn.positional import t5 as t5_lib

POSITIONS = ("rope", "alibi", "t5", "none")
QK_NORM_TYPES = ("rms", "layer")
QK_NORM_SCOPES = ("head", "per_head", "projection")
_OUT_OF_REACH = 1 << 30  # a key position no causal or window rule admits (positions stay below 2**29)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Configuration of :class:`Attention`; every field is also a keyword of ``torch_ref.modern.Attention``."""

    d_model: int                        # D: input and output width
    num_heads: int                      # N: query heads
    num_kv_heads: Optional[int] = None  # K: key/value heads, dividing N (None: N, multi-head; 1: multi-query)
    head_dim: Optional[int] = None      # H (None: d_model // num_heads)
    causal: bool = True                 # a query sees keys at its position or earlier
    sliding_window: Optional[int] = None  # W: causal, the W keys ending at the query (Mistral);
    #                                       bidirectional, W keys on each side including the query
    position: str = "rope"              # 'rope' | 'alibi' | 't5' | 'none' (NoPE; add sinusoidal or
    #                                     learned positions to the embeddings outside the layer)
    rope_theta: float = 10000.0         # RoPE frequency base
    rope_layout: str = "rotate_half"    # 'rotate_half' (GPT-NeoX, Llama) | 'interleaved' (GPT-J, RoFormer)
    rotary_dim: Optional[int] = None    # partial rotary: rotate only the first rotary_dim dims of a head
    rope_scaling: Any = None            # RopeScaling or a dict of its fields: linear, ntk, llama3, yarn
    t5_num_buckets: int = 32            # T5 bias: buckets (bidirectional when not causal)
    t5_max_distance: int = 128          # T5 bias: distances beyond share the last bucket
    qk_norm: bool = False               # normalise queries and keys after projection (RMSNorm per head unless
    #                                     the qk_norm_* fields below say otherwise)
    qk_norm_eps: float = 1e-6
    qk_norm_type: str = "rms"           # 'rms' (RMSNorm) | 'layer' (LayerNorm: mean subtracted; Phi, Cohere)
    qk_norm_scope: str = "head"         # what one norm covers and its weights' shape:
    #                                     'head': each head's H features, one weight (H,) shared by heads;
    #                                     'per_head': each head's H features, weights (N, H) / (K, H) (Cohere);
    #                                     'projection': all N*H (K*H) features before the head split (OLMo 2)
    qk_norm_bias: bool = False          # a learned bias in the QK-norm (qk_norm_type='layer' only; Phi)
    qk_norm_zero_centered: bool = False  # the norm weight is stored as w and applied as 1 + w (Gemma);
    #                                      initialised to zeros. A plain weight is applied as is (ones).
    logit_softcap: Optional[float] = None  # c: logits -> c * tanh(logits / c)
    qkv_bias: Any = False               # biases in the query/key/value projections: a bool for all three,
    #                                     or (q, k, v) flags, e.g. (True, False, True) (Whisper: no key bias)
    out_bias: bool = False              # bias in the output projection
    sinks: bool = False                 # attention sinks (gpt-oss): a learned logit per query head, parameter
    #                                     ``sinks`` (N,), joins each softmax denominator and takes no value
    dropout: float = 0.0                # dropout on the attention weights
    scale: Optional[float] = None       # logit scale (None: 1 / sqrt(H); T5 uses 1.0)

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
                   layout: str = "BKSH") -> KVCache:
        """An empty :class:`KVCache` for this layer, ``S = max_len`` slots: keys stored
        ``(B*K, S, H)`` (``layout='BKSH'``, the default: each head's keys contiguous, read in place
        when decoding) or ``(B, S, K, H)`` (``'BSKH'``).

        ``dtype`` must be the dtype of the keys the layer computes (the result type of ``x`` and
        its parameters); a layer given a cache of another dtype raises ``TypeError``. The
        configuration knows no dtype, hence the float32 default here;
        :meth:`Attention.init_cache` defaults to the layer's ``param_dtype``.
        """
        if rolling:
            if self.sliding_window is None:
                raise ValueError("a rolling cache drops old keys: it needs a sliding_window")
            if max_len < self.sliding_window - 1:
                raise ValueError(f"a rolling cache for sliding_window={self.sliding_window} needs max_len >= "
                                 f"{self.sliding_window - 1}, got {max_len}")
        return KVCache.create(batch=batch, max_len=max_len, num_kv_heads=self.kv_heads,
                              head_dim=self.kv_head_dim, dtype=dtype, rolling=rolling, layout=layout)


def _batched_positions(name, positions, batch, length):
    if positions is None:
        return None
    _checks.check_integer(name, positions)
    shape = _checks.shape_of(positions)
    if shape not in ((length,), (1, length), (batch, length)):
        raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {shape}")
    return jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch, length))


def attention_params(config: AttentionConfig) -> dict:
    """The parameter specs of the layer (see :class:`flax_attn.layers.common.ParamSpec`):

    ``q_proj`` ``(D, N*H)``, ``k_proj``/``v_proj`` ``(D, K*H)``, ``o_proj`` ``(N*H, D)`` (biases with
    ``qkv_bias``/``out_bias``); with QK-norm ``q_norm``/``k_norm`` (``scale``, and ``bias`` with
    ``qk_norm_bias``, of shape ``(H,)``, or ``(N, H)``/``(K, H)`` per head, or ``(N*H,)``/``(K*H,)``
    over the projection); with sinks ``sinks`` ``(N,)``; with T5 bias ``rel_bias`` (``embedding``
    ``(buckets, N)``).
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
    if c.qk_norm:
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
    if c.qk_norm_type == "rms" and not c.qk_norm_zero_centered and c.qk_norm_scope == "head":
        return rms_norm(p, x, c.qk_norm_eps)
    return norm(p, x, c.qk_norm_eps, kind=c.qk_norm_type, zero_centered=c.qk_norm_zero_centered)


def attention_forward(config: AttentionConfig, params, x, positions=None, segment_ids=None, context=None,
                      context_positions=None, context_segment_ids=None, mask=None, cache: Optional[KVCache] = None,
                      *, dropout_rng=None, precision=None, implementation=None):
    """The layer as a pure function: :class:`Attention`'s computation with ``params`` given.

    Args:
      config: the :class:`AttentionConfig`.
      params: the parameter tree of :func:`attention_params` (``variables['params']`` of the Linen
        layer, ``flax_attn.nnx.to_linen(layer)['params']`` of the NNX one).
      x, positions, segment_ids, context, context_positions, context_segment_ids, mask, cache:
        as in :class:`Attention` (``x`` ``(B, T, D)``, positions ``(B, T)``, ...).
      dropout_rng: the PRNG key for dropout on the attention weights (``config.dropout``), or
        None for no dropout.
      precision, implementation: passed to the projections and :func:`dot_product_attention`.

    Returns:
      ``(B, T, D)``, or ``(output, new_cache)`` when a cache is given.
    """
    c = config
    N, K, H, D = c.num_heads, c.kv_heads, c.kv_head_dim, c.d_model
    _checks.check_rank("x", x, 3, "(B, T, D)")
    check_floating("Attention", "x", x)
    if x.shape[-1] != D:
        raise ValueError(f"x has shape {x.shape}: its last dim must be d_model={D}")
    B, T, _ = x.shape
    cross = context is not None
    if cross:
        _checks.check_rank("context", context, 3, "(B, S, D)")
        check_floating("Attention", "context", context)
        if context.shape[0] != B or context.shape[-1] != D:
            raise ValueError(f"context has shape {context.shape}, expected ({B}, S, {D}) for x of shape {x.shape}")
        if cache is not None:
            raise ValueError("cache is for self-attention; pass either context or cache")
    source = context if cross else x
    S_new = source.shape[1]
    needs_positions = c.position != "none" or cache is not None
    positions = _batched_positions("positions", positions, B, T)
    if needs_positions and positions is None:
        raise ValueError(f"positions are required with position='{c.position}'"
                         f"{' and a cache' if cache is not None else ''}: pass positions of shape ({B}, {T})")
    if cross:
        context_positions = _batched_positions("context_positions", context_positions, B, S_new)
        if c.position != "none" and context_positions is None:
            raise ValueError(f"context_positions are required with position='{c.position}'")
    else:
        context_positions = positions
    segment_ids = _batched_positions("segment_ids", segment_ids, B, T)
    if cross:
        context_segment_ids = _batched_positions("context_segment_ids", context_segment_ids, B, S_new)
        if (segment_ids is None) != (context_segment_ids is None):
            raise ValueError("segment_ids and context_segment_ids must be given together")
    else:
        context_segment_ids = segment_ids

    q = dense(params["q_proj"], x, precision)
    k = dense(params["k_proj"], source, precision)
    if c.qk_norm and c.qk_norm_scope == "projection":  # over all heads' features, before the split
        q, k = _qk_norm(c, params["q_norm"], q), _qk_norm(c, params["k_norm"], k)
    q, k = q.reshape(B, T, N, H), k.reshape(B, S_new, K, H)
    v = dense(params["v_proj"], source, precision).reshape(B, S_new, K, H)
    if c.qk_norm and c.qk_norm_scope != "projection":  # over each head's H features
        q, k = _qk_norm(c, params["q_norm"], q), _qk_norm(c, params["k_norm"], k)
    if c.position == "rope":
        q, k = _rope(c, q, positions), _rope(c, k, context_positions)

    key_positions, key_segments = context_positions, context_segment_ids
    mask_key_positions, mask_segments = None, ()  # () = as key_positions / key_segments
    new_cache = None
    if cache is not None:
        if segment_ids is None:
            segment_ids = key_segments = jnp.zeros((B, T), jnp.int32)
        cache.check_compatible(k, v, positions, segment_ids)
        cache.check_dtype(k)
        if cache.rolling and (c.sliding_window is None or cache.max_len < c.sliding_window - 1):
            raise ValueError(f"a rolling cache of max_len={cache.max_len} is too small for "
                             f"sliding_window={c.sliding_window}: use AttentionConfig.init_cache")
        # Padding keeps zeros in its slots, so no garbage (NaN in padded embeddings) is ever cached.
        pad = (segment_ids < 0)[:, :, None, None]
        k, v = jnp.where(pad, jnp.zeros_like(k), k), jnp.where(pad, jnp.zeros_like(v), v)
        new_cache = cache.update(k, v, positions, segment_ids)
        if cache.holds_window(T, c.sliding_window):
            # The new keys are in their slots: attend over the cache itself (no copy); unwritten
            # slots have segment id -1, and the stored positions give causal and window masks.
            k, v = new_cache.keys(), new_cache.values()
            key_positions, key_segments = new_cache.positions, new_cache.segment_ids
            if T == 1 and (c.causal or c.window is not None):
                # One query per row: its segment rule (same segment, no padding) folds into the key
                # positions, a slot it may not see moving out of reach of the causal/window rule.
                # The core then needs no segment ids and zeroes no cached keys (a pass over the cache).
                same = (key_segments == segment_ids) & (key_segments >= 0)
                mask_key_positions = jnp.where(same, key_positions, _OUT_OF_REACH)
                mask_segments = None
        else:
            # A rolling cache too small to keep what these queries see: cached slots, then new keys.
            k = jnp.concatenate([cache.keys(), k], axis=1)
            v = jnp.concatenate([cache.values(), v], axis=1)
            key_positions = jnp.concatenate([cache.positions, positions], axis=1)
            key_segments = jnp.concatenate([cache.segment_ids, segment_ids], axis=1)

    bias = None
    if c.position == "alibi":
        bias = alibi_lib.alibi_bias(alibi_lib.alibi_slopes(N), positions, key_positions)
    elif c.position == "t5":
        bias = t5_lib.t5_bias(params["rel_bias"]["embedding"], positions, key_positions, bidirectional=not c.causal,
                              max_distance=c.t5_max_distance)
    if mask_key_positions is None:
        mask_key_positions = key_positions
    if mask_segments == ():
        mask_segments = key_segments
    out = dot_product_attention(
        q, k, v, bias, mask,
        scale=c.scale, is_causal=c.causal, local_window_size=c.window,
        query_positions=positions, key_positions=mask_key_positions if positions is not None else None,
        query_segment_ids=segment_ids if mask_segments is not None else None, key_segment_ids=mask_segments,
        logit_softcap=c.logit_softcap, sinks=params["sinks"] if c.sinks else None, dropout_rate=c.dropout if dropout_rng is not None else 0.0,
        dropout_rng=dropout_rng, precision=precision, implementation=implementation,
    )
    out = dense(params["o_proj"], out.reshape(B, T, N * H), precision)
    return out if cache is None else (out, new_cache)


class Attention(nn.Module):
    """Multi-head attention configured by :class:`AttentionConfig`.

    Parameters (:func:`attention_params`): ``q_proj`` ``(D, N*H)``, ``k_proj``/``v_proj``
    ``(D, K*H)``, ``o_proj`` ``(N*H, D)``; with QK-norm ``q_norm``/``k_norm`` (scale ``(H,)``, or
    as ``qk_norm_scope`` says); with sinks ``sinks`` ``(N,)``; with T5 bias ``rel_bias`` ``(buckets, N)``. The NNX twin is :class:`flax_attn.nnx.Attention`.

    Call (arrays may be passed by position, in this order, or by name; options are keyword-only):
      x: floating ``(B, T, D)``: the queries' sequence (and the keys', for self-attention).
      positions: int ``(B, T)`` or ``(T,)``. Required unless ``position='none'`` and no cache.
      segment_ids: int ``(B, T)``: packed sequences attend only within their segment; negative
        ids mark padding (never attended to; such queries return zeros).
      context: ``(B, S, D)`` for cross-attention (keys and values from it; set ``causal=False``);
        context_positions, context_segment_ids: as above for the context (``(B, S)``).
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
                   layout: str = "BKSH") -> KVCache:
        """An empty :class:`KVCache` for this layer (see :meth:`AttentionConfig.init_cache`);
        ``dtype`` defaults to the layer's ``param_dtype``, the dtype of its keys for inputs of
        that dtype or narrower. Callable on the unbound layer: ``layer.init_cache(B, S)``."""
        return self.config.init_cache(batch, max_len, dtype=self.param_dtype if dtype is None else dtype,
                                      rolling=rolling, layout=layout)

    def __call__(self, x, positions=None, segment_ids=None, context=None, context_positions=None,
                 context_segment_ids=None, mask=None, cache: Optional[KVCache] = None, *,
                 deterministic: Optional[bool] = None):
        params = declared(self, attention_params(self.config))
        rng = dropout_rng(self, self.config.dropout, deterministic, "Attention")
        return attention_forward(self.config, params, x, positions, segment_ids, context, context_positions,
                                 context_segment_ids, mask, cache, dropout_rng=rng, precision=self.precision,
                                 implementation=self.implementation)
