"""Rotary position embedding (RoPE; Su et al., 2021, "RoFormer").

Each pair of dimensions ``(a, b)`` of a query or key at position p is rotated by the angle
``p * inv_freq[i]``::

    (a, b) -> (a cos - b sin,  b cos + a sin),    inv_freq[i] = theta^(-2i / d)

so that ``rope(q, m) . rope(k, n)`` depends on ``m - n`` only. Which dimensions form a pair is
the layout, and it must be named (mixing them up is the most common cross-framework bug):

* ``'rotate_half'`` (GPT-NeoX, Llama in Hugging Face transformers): dim i pairs with i + d/2.
* ``'interleaved'`` (GPT-J, RoFormer, Meta's original Llama): dim 2i pairs with 2i + 1.

Partial rotary (``rotary_dim < H``) rotates the first ``rotary_dim`` dims of each head and
passes the rest through. Frequency scalings for longer contexts: :class:`RopeScaling`. Two of
them depend on the sequence length (``dynamic`` NTK and LongRoPE): :func:`apply_rope` takes it as
``max(positions) + 1`` over the whole call, as Hugging Face transformers does.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import jax.numpy as jnp
import numpy as np

from flax_attn import _checks

LAYOUTS = ("rotate_half", "interleaved")
SCALING_KINDS = ("linear", "ntk", "dynamic", "llama3", "yarn", "longrope")
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """How to stretch RoPE's frequencies to a longer context.

    Attributes:
      kind: ``'linear'`` (position interpolation, Chen et al. 2023: every frequency / factor);
        ``'ntk'`` (NTK-aware: theta * factor^(d / (d - 2)), the static form);
        ``'dynamic'`` (dynamic NTK: with L = max(seq_len, original), the base becomes
        ``theta * (factor * L / original - (factor - 1))^(d / (d - 2))``: unchanged up to the
        original context, growing with the sequence beyond it);
        ``'llama3'`` (Llama 3.1: low frequencies / factor, high ones kept, a smooth ramp between);
        ``'yarn'`` (Peng et al. 2023: per-dimension ramp between interpolation and extrapolation,
        plus an attention temperature);
        ``'longrope'`` (LongRoPE, Phi-3: each frequency divided by its own factor, ``short_factor``
        while the sequence fits the original context, ``long_factor`` beyond it; attention factor
        ``sqrt(1 + ln(factor) / ln(original))``).
      factor: the context extension factor s (> 0).
      original_max_position_embeddings: the pre-training context length (llama3, yarn, longrope;
        for dynamic, the length up to which frequencies are unchanged).
      low_freq_factor, high_freq_factor: llama3's band edges (wavelengths above
        original / low_freq_factor are scaled, below original / high_freq_factor kept).
      beta_fast, beta_slow: yarn's ramp edges, in rotations over the original context.
      attention_factor: yarn's and longrope's multiplier on cos and sin (so on the logits,
        squared); yarn's default ``0.1 * ln(factor) + 1`` (1 when factor <= 1).
      mscale, mscale_all_dim: yarn as DeepSeek uses it: when both are set (non-zero) and
        attention_factor is not, the factor is ``m(factor, mscale) / m(factor, mscale_all_dim)``
        with ``m(s, a) = 0.1 a ln(s) + 1`` (1 when s <= 1).
      truncate: yarn: round the ramp's edges outwards to whole dims (True, the paper's code) or
        keep them fractional (False, gpt-oss).
      short_factor, long_factor: longrope's per-frequency divisors, ``rotary_dim // 2`` each.
    """

    kind: str
    factor: float
    original_max_position_embeddings: Optional[int] = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True
    short_factor: Optional[tuple] = None
    long_factor: Optional[tuple] = None

    def __post_init__(self):
        _checks.check_one_of("RopeScaling kind", self.kind, SCALING_KINDS)
        if not (isinstance(self.factor, (int, float, np.integer, np.floating)) and not isinstance(self.factor, bool)
                and np.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"RopeScaling factor must be a finite positive number, got {self.factor!r}")
        object.__setattr__(self, "factor", self.factor if isinstance(self.factor, int) else float(self.factor))
        if self.kind in ("llama3", "yarn", "dynamic", "longrope"):
            _checks.check_positive_int("RopeScaling original_max_position_embeddings",
                                       self.original_max_position_embeddings)
        if self.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                value = getattr(self, name)
                if value is None or not len(value) or not all(float(v) > 0 for v in value):
                    raise ValueError(f"longrope needs {name}: positive numbers, one per frequency, got {value!r}")
                object.__setattr__(self, name, tuple(float(v) for v in value))
            if len(self.short_factor) != len(self.long_factor):
                raise ValueError(f"longrope short_factor and long_factor differ in length: "
                                 f"{len(self.short_factor)} and {len(self.long_factor)}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"llama3 needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")


ScalingLike = Union[RopeScaling, dict, None]


def as_scaling(scaling: ScalingLike) -> Optional[RopeScaling]:
    """``RopeScaling`` from itself, a dict of its fields (``{'kind': 'yarn', 'factor': 4, ...}``) or None."""
    if scaling is None or isinstance(scaling, RopeScaling):
        return scaling
    if isinstance(scaling, dict):
        unknown = set(scaling) - {f.name for f in dataclasses.fields(RopeScaling)}
        if unknown:
            raise ValueError(f"unknown RopeScaling fields {sorted(unknown)}")
        return RopeScaling(**scaling)
    raise TypeError(f"rope scaling must be a RopeScaling, a dict or None, got {type(scaling).__name__}")


def rope_frequencies(rotary_dim: int, *, theta: float = 10000.0, scaling: ScalingLike = None,
                     seq_len: Optional[int] = None) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``(rotary_dim // 2,)`` (float64) and the attention factor.

    The attention factor multiplies cos and sin; it is 1 except for YaRN and LongRoPE.
    ``seq_len`` (the number of positions, ``max(positions) + 1``) matters only for the
    length-dependent scalings (``dynamic``, ``longrope``); None means a sequence within the
    original context.
    """
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    if not theta > 0:
        raise ValueError(f"theta must be positive, got {theta}")
    scaling = as_scaling(scaling)
    d = rotary_dim
    exponents = np.arange(0, d, 2, dtype=np.float64) / d
    if scaling is None:
        return theta ** -exponents, 1.0
    s = float(scaling.factor)
    if scaling.kind == "linear":
        return theta ** -exponents / s, 1.0
    if scaling.kind == "ntk":
        _check_ntk_dim(d)
        return (theta * s ** (d / (d - 2))) ** -exponents, 1.0
    if scaling.kind == "dynamic":
        _check_ntk_dim(d)
        return _dynamic_theta(theta, d, scaling, seq_len, np) ** -exponents, 1.0
    if scaling.kind == "longrope":
        _check_longrope_dim(d, scaling)
        original = scaling.original_max_position_embeddings
        long = seq_len is not None and seq_len > original
        divisors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float64)
        return theta ** -exponents / divisors, _longrope_attention_factor(scaling)
    if scaling.kind == "llama3":
        inv_freq = theta ** -exponents
        original = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = original / scaling.low_freq_factor
        high_freq_wavelen = original / scaling.high_freq_factor
        smooth = (original / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / s + smooth * inv_freq
        out = np.where(wavelen > low_freq_wavelen, inv_freq / s, inv_freq)
        medium = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        return np.where(medium, smoothed, out), 1.0
    # yarn
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations):  # the dim whose wavelength fits `rotations` times in `original`
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolation_weight = 1.0 - ramp  # 1 for high frequencies (kept), 0 for low ones (interpolated)
    inv_freq = theta ** -exponents
    inv_freq = inv_freq / s * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    factor = scaling.attention_factor
    if factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            factor = _yarn_mscale(s, scaling.mscale) / _yarn_mscale(s, scaling.mscale_all_dim)
        else:
            factor = _yarn_mscale(s, 1.0)
    return inv_freq, float(factor)


def _yarn_mscale(s: float, weight: float) -> float:
    """YaRN's temperature ``0.1 * weight * ln(s) + 1`` (1 when s <= 1)."""
    return 0.1 * weight * math.log(s) + 1.0 if s > 1 else 1.0


def _check_ntk_dim(d):
    if d < 4:
        raise ValueError(f"NTK-aware scaling needs rotary_dim >= 4 (its exponent is d / (d - 2)), got {d}")


def _check_longrope_dim(d, scaling):
    if len(scaling.short_factor) != d // 2:
        raise ValueError(f"longrope factors have {len(scaling.short_factor)} entries; rotary_dim={d} needs {d // 2}")


def _longrope_attention_factor(scaling) -> float:
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    s, original = float(scaling.factor), scaling.original_max_position_embeddings
    return math.sqrt(1 + math.log(s) / math.log(original)) if s > 1 else 1.0


def _dynamic_theta(theta, d, scaling, seq_len, xp):
    """Dynamic NTK's base for a sequence of ``seq_len`` positions (NumPy or traced ``jnp``)."""
    s, original = float(scaling.factor), scaling.original_max_position_embeddings
    if seq_len is None:
        return theta
    length = xp.maximum(seq_len, original)
    return theta * (s * length / original - (s - 1)) ** (d / (d - 2))


def apply_rope(x, positions, *, theta: float = 10000.0, layout: str = "rotate_half",
               rotary_dim: Optional[int] = None, scaling: ScalingLike = None):
    """Rotate queries or keys by their positions.

    Args:
      x: ``(B, T, N, H)`` (or ``(T, N, H)``): queries or keys, heads before the head dim.
      positions: integer ``(B, T)`` or ``(T,)``: the position of each token (an offset for
        decoding, restarting positions for packed sequences).
      theta: the frequency base (10000 in the paper; Llama 3 uses 500000).
      layout: ``'rotate_half'`` or ``'interleaved'`` (see the module docstring). Required knowledge:
        weights trained with one layout give wrong results with the other.
      rotary_dim: rotate only the first ``rotary_dim`` dims (even, <= H); default H.
      scaling: a :class:`RopeScaling` (or dict of its fields) for extended contexts. The
        length-dependent ones (dynamic, longrope) take the length as ``max(positions) + 1`` over
        the call (one choice for the whole batch, as Hugging Face transformers does).

    Returns:
      ``x`` rotated, same shape and dtype. Angles and rotation are computed in float32
      (float64 for float64 inputs).
    """
    _checks.check_rank("x", x, (3, 4), "(B, T, N, H) or (T, N, H)")
    _checks.check_floating("x", x)
    _checks.check_integer("positions", positions)
    _checks.check_one_of("layout", layout, LAYOUTS)
    T, H = x.shape[-3], x.shape[-1]
    lead = x.shape[:-3]
    if _checks.shape_of(positions) not in ((T,), lead + (T,)):
        shapes = f"({T},) or {lead + (T,)}" if lead else f"({T},)"
        raise ValueError(f"positions must have shape {shapes} for x of shape {x.shape}, "
                         f"got {_checks.shape_of(positions)}")
    if rotary_dim is None:
        if H % 2:
            raise ValueError(f"RoPE rotates pairs of features: the head dim H={H} of x {x.shape} is odd; "
                             f"rotate an even part of it with rotary_dim=")
        rd = H
    else:
        rd = rotary_dim
    if not (isinstance(rd, (int, np.integer)) and 2 <= rd <= H and rd % 2 == 0):
        raise ValueError(f"rotary_dim must be an even number in [2, H={H}], got {rotary_dim}")
    scaling = as_scaling(scaling)
    inv_freq, attention_factor = rope_frequencies(rd, theta=theta, scaling=scaling)
    compute = jnp.promote_types(x.dtype, jnp.float32)
    inv_freq = jnp.asarray(inv_freq, compute)
    if scaling is not None and scaling.kind in LENGTH_DEPENDENT:
        seq_len = jnp.max(jnp.asarray(positions)).astype(compute) + 1  # over the whole call
        if scaling.kind == "dynamic":
            exponents = jnp.arange(0, rd, 2, dtype=compute) / rd
            inv_freq = _dynamic_theta(theta, rd, scaling, seq_len, jnp) ** -exponents
        else:
            long, _ = rope_frequencies(rd, theta=theta, scaling=scaling,
                                       seq_len=scaling.original_max_position_embeddings + 1)
            inv_freq = jnp.where(seq_len > scaling.original_max_position_embeddings, jnp.asarray(long, compute),
                                 inv_freq)
    angles = jnp.asarray(positions).astype(compute)[..., None] * inv_freq
    cos = (jnp.cos(angles) * attention_factor)[..., None, :]  # (..., T, 1, rd/2): same for all heads
    sin = (jnp.sin(angles) * attention_factor)[..., None, :]
    rot, rest = x[..., :rd].astype(compute), x[..., rd:]
    if layout == "rotate_half":
        a, b = rot[..., : rd // 2], rot[..., rd // 2:]
        rotated = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rotated = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([rotated.astype(x.dtype), rest], axis=-1)
