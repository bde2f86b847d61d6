"""One description of an attention call: validation turns the arguments into a :class:`Call`.

Every implementation receives the same :class:`Call` (shapes, dtype, scale, soft-cap, dropout,
precision, what to return, the platform) and its bound :class:`~flax_attn.core.mask.Mask`
(every masking rule and the bias); none re-reads the raw arguments.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core import mask as mask_lib
from flax_attn.core.mask import Mask


@dataclasses.dataclass(frozen=True)
class Call:
    """A validated attention call. Shapes use the alphabet: queries ``(B, T, N, H)``, keys
    ``(B, S, K, H)``, values ``(B, S, K, Hv)``; ``G = N // K`` query heads per key/value head."""

    B: Any  # an int, or a symbolic dimension under jax.export
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    dtype: np.dtype
    scale: float
    softcap: Optional[float]
    dropout_rate: float          # 0 when deterministic
    return_weights: bool
    return_residual: bool
    precision: Any
    mask: Mask                   # bound to (B, N, T, S); holds the mask_mods and the score_mod
    platform: str                # 'cpu', 'gpu', 'tpu': where it runs (an argument for decision tests)
    sinks: Any = None            # (N,) sink logits, applied by dot_product_attention from the lse; None: no sinks

    @property
    def score_mod(self):
        """The bound score modification (:class:`~flax_attn.core.mask.Mod`), or None."""
        return self.mask.score_mod

    @property
    def mask_mod(self):
        """The bound user mask rules (a tuple of :class:`~flax_attn.core.mask.Mod`), or None."""
        return self.mask.mask_mods or None

    @property
    def G(self) -> int:
        return self.N // self.K

    @property
    def acc_dtype(self):
        """Logits, softmax and accumulators: at least float32."""
        return jnp.promote_types(self.dtype, jnp.float32)


def _positions(name, x, B, L):
    if x is None:
        return None
    _checks.check_integer(name, x)
    given = _checks.shape_of(x)
    shape = (1,) + given if len(given) == 1 else given
    if len(shape) != 2 or shape[1] != L or not _checks.dim_is(shape[0], (1, B)):
        raise ValueError(f"{name} must have shape ({L},) or ({B}, {L}), got {given}")
    return jnp.asarray(x, jnp.int32).reshape(shape)


def _lengths(name, x, B, L):
    if x is None:
        return None
    _checks.check_integer(name, x)
    shape = _checks.shape_of(x)
    if len(shape) != 1 or not _checks.dim_is(shape[0], (B,)):
        raise ValueError(f"{name} must have shape ({B},), got {shape}")
    if isinstance(L, int) and _on_host(x):  # values known now, read without a device round trip
        values = np.asarray(x)
        if np.any(values < 0) or np.any(values > L):
            raise ValueError(f"{name} must lie in [0, {L}] (the axis they count), got {values.tolist()}")
    return jnp.asarray(x, jnp.int32)


def _on_host(x) -> bool:
    """Whether ``x``'s values can be read now without waiting on an accelerator: NumPy data, or a
    concrete JAX array on CPU (traced values are not known until the program runs)."""
    if isinstance(x, jax.core.Tracer):
        return False
    if isinstance(x, jax.Array):
        return all(d.platform == "cpu" for d in x.devices())
    return True


def _dense(name, x, target, check):
    """A mask or bias, reshaped to 4 dims; a constant of a traced program behind a barrier.

    Under ``jit``, an array whose values are known while tracing (NumPy data, or a concrete JAX
    array the function closes over) becomes a constant of the program, and XLA then evaluates at
    compile time everything computed from it alone: the reductions over it (which keys and
    queries any pair reaches) ran in XLA's constant folder, element by element (a closed-over
    2,048 x 2,048 causal mask took 8.5-15.8 s to compile against 0.2-1.0 s passed as an
    argument, on an Intel Xeon of family 6, model 207). ``lax.optimization_barrier`` keeps the
    constant as a value the program reads, as it reads an argument."""
    if x is None:
        return None
    check(name, x)
    shaped = jnp.asarray(x).reshape(_checks.check_broadcast(name, x, target, "(B, N, T, S)"))
    if isinstance(shaped, jax.core.Tracer) and not isinstance(x, jax.core.Tracer):
        shaped = jax.lax.optimization_barrier(shaped)
    return shaped


def bind_mask(m: Mask, bias, B, N, T, S, *, score_mod=None, score_dtype=jnp.float32) -> Mask:
    """Validate an unbound description (and ``bias``, ``score_mod``) against the call's shapes and
    bind it; user functions are checked on scalars and closure-converted (scores in
    ``score_dtype``, the accumulation dtype)."""
    if m.bound:
        raise ValueError("mask: pass an unbound description (from flax_attn.core.mask's builders)")
    if (m.q_segments is None) != (m.k_segments is None):
        raise ValueError("query_segment_ids and key_segment_ids must be given together")
    target = (B, N, T, S)
    ints = (jnp.zeros((), jnp.int32),) * 4
    return dataclasses.replace(
        m,
        mask_mods=tuple(mask_lib.bind_mod("mask_mod", mod.fn, ints) for mod in m.mask_mods),
        score_mod=None if score_mod is None else mask_lib.bind_mod(
            "score_mod", score_mod, (jnp.zeros((), score_dtype),) + ints),
        q_positions=_positions("query_positions", m.q_positions, B, T),
        k_positions=_positions("key_positions", m.k_positions, B, S),
        q_segments=_positions("query_segment_ids", m.q_segments, B, T),
        k_segments=_positions("key_segment_ids", m.k_segments, B, S),
        q_lengths=_lengths("query_seq_lengths", m.q_lengths, B, T),
        kv_lengths=_lengths("key_value_seq_lengths", m.kv_lengths, B, S),
        dense=_dense("mask", m.dense, target, _checks.check_bool),
        bias=_dense("bias", bias, target, _checks.check_floating),
        shape=target,
    )


def check_qkv(query, key, value):
    """Ranks, dtypes and shapes of query/key/value; returns ``(B, T, N, H), (S, K, Hv)``."""
    _checks.check_rank("query", query, 4, "BTNH")
    _checks.check_rank("key", key, 4, "BSKH")
    _checks.check_rank("value", value, 4, "BSKH")
    for name, x in (("query", query), ("key", key), ("value", value)):
        _checks.check_floating(name, x)
    dtypes = {name: _checks.dtype_of(x) for name, x in (("query", query), ("key", key), ("value", value))}
    if len(set(dtypes.values())) > 1:
        raise TypeError("query, key and value must have one dtype, got " + ", ".join(f"{n} {d}" for n, d in dtypes.items()))
    B, T, N, H = _checks.shape_of(query)
    kB, S, K, kH = _checks.shape_of(key)
    if not _checks.dims_equal((kB, S, K), (B, S, K)) or not _checks.dims_equal(_checks.shape_of(value)[:3], (B, S, K)):
        raise ValueError(
            f"query, key and value must agree on batch, and key and value on length and heads: "
            f"query {_checks.shape_of(query)}, key {_checks.shape_of(key)}, value {_checks.shape_of(value)}")
    if kH != H:
        raise ValueError(f"query and key head dims differ: query {(B, T, N, H)}, key {(kB, S, K, kH)}")
    for what, d in (("number of query heads N", N), ("number of key/value heads K", K), ("head dim H", H)):
        if isinstance(d, int) and d == 0:
            raise ValueError(f"the {what} is 0: query {(B, T, N, H)}, key {(kB, S, K, kH)}; attention needs at "
                             f"least one")
    _checks.check_divides("number of query heads N", N, "number of key/value heads K", K)
    return (B, T, N, H), (S, K, _checks.shape_of(value)[-1])


def describe(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False, query_seq_lengths=None,
             key_value_seq_lengths=None, local_window_size=None, query_positions=None, key_positions=None,
             query_segment_ids=None, key_segment_ids=None, logit_softcap=None, dropout_rate=0.0, dropout_rng=None,
             deterministic=False, return_weights=False, return_residual=False, precision=None,
             score_mod=None, sinks=None, platform: Optional[str] = None) -> Call:
    """Validate :func:`~flax_attn.dot_product_attention`'s arguments (4-D) into a :class:`Call`.

    Arrays may be ``jax.ShapeDtypeStruct`` where only shapes matter (query, key, value), so
    that the automatic choice can be asked about a call without running it; ``platform``
    (``'cpu'``, ``'gpu'`` or ``'tpu'``) defaults to JAX's default backend. With ``sinks`` the call asks the implementation for the
    log-sum-exp (``return_residual=True``): the sinks are applied from it.
    """
    (B, T, N, H), (S, K, Hv) = check_qkv(query, key, value)
    if platform is not None:
        _checks.check_platform(platform)
    if isinstance(mask, Mask):
        rules = mask
    else:
        rules = Mask() if mask is None else mask_lib.dense(mask)
    keyword = Mask(causal=_checks.static_bool("is_causal", is_causal),
                   window=mask_lib.normalize_window(local_window_size))
    if query_positions is not None or key_positions is not None:
        if query_positions is None or key_positions is None:
            # one side given: the other takes its default
            dq, dk = jnp.arange(T, dtype=jnp.int32) + (S - T), jnp.arange(S, dtype=jnp.int32)
            query_positions = dq if query_positions is None else query_positions
            key_positions = dk if key_positions is None else key_positions
        keyword = keyword & mask_lib.positions(query_positions, key_positions)
    if query_segment_ids is not None or key_segment_ids is not None:
        if query_segment_ids is None or key_segment_ids is None:
            raise ValueError("query_segment_ids and key_segment_ids must be given together")
        keyword = keyword & mask_lib.segments(query_segment_ids, key_segment_ids)
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        keyword = keyword & mask_lib.lengths(query_seq_lengths, key_value_seq_lengths)
    acc_dtype = jnp.promote_types(_checks.dtype_of(query), jnp.float32)
    if rules.bound:
        raise ValueError("mask: pass an unbound description (from flax_attn.core.mask's builders), not one "
                         "already bound to a call")
    for field, what, given in (("q_positions", "positions", "query_positions=/key_positions="),
                               ("q_segments", "segment ids", "query_segment_ids=/key_segment_ids="),
                               ("q_lengths", "query lengths", "query_seq_lengths="),
                               ("kv_lengths", "key/value lengths", "key_value_seq_lengths=")):
        if getattr(rules, field) is not None and getattr(keyword, field) is not None:
            raise ValueError(f"mask= gives {what} and so does {given}: give them once, in the description "
                             "or as keyword arguments")
    combined = rules & keyword
    bound = bind_mask(combined, bias, B, N, T, S, score_mod=score_mod, score_dtype=acc_dtype)
    if sinks is not None:
        _checks.check_floating("sinks", sinks)
        if _checks.shape_of(sinks) != (N,):
            raise ValueError(f"sinks must have shape (N,) = ({N},), one logit per query head; got "
                             f"{_checks.shape_of(sinks)} (query {(B, T, N, H)})")

    if scale is None:
        scale = 1.0 / math.sqrt(H)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)) \
            or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite Python number, got {scale!r}")
    if logit_softcap is not None and (isinstance(logit_softcap, bool) or not isinstance(
            logit_softcap, (int, float, np.floating, np.integer)) or not logit_softcap > 0):
        raise ValueError(f"logit_softcap must be a positive number, got {logit_softcap!r}")
    _checks.check_rate("dropout_rate", dropout_rate)
    if deterministic:
        dropout_rate = 0.0
    if dropout_rate > 0.0 and dropout_rng is None:
        raise ValueError("dropout_rate > 0 needs dropout_rng (or deterministic=True)")
    return Call(B=B, T=T, S=S, N=N, K=K, H=H, Hv=Hv, dtype=_checks.dtype_of(query), scale=float(scale),
                softcap=None if logit_softcap is None else float(logit_softcap),
                dropout_rate=float(dropout_rate), return_weights=_checks.static_bool("return_weights", return_weights),
                return_residual=_checks.static_bool("return_residual", return_residual) or sinks is not None,
                precision=precision, mask=bound,
                platform=platform or jax.default_backend(), sinks=sinks)
