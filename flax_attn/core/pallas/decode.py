"""JAX's Pallas decoding kernel for GPUs: ``jax.experimental.pallas.ops.gpu.decode_attention``.

    out = softmax(scale * q K^T [keys start..length-1]) V,  one query per sequence

For one decoding step (T == 1): the kernel splits the keys into ``k_splits`` pieces, runs a
flash-style pass over each (grid: query-head blocks x splits) and combines them. It masks keys
outside ``[start, length)`` per sequence and serves grouped-query heads directly. This file
translates a :class:`~flax_attn.core.call.Call`: with default positions the query sits at
position ``S - 1``, so causal masking allows every key, a window ``(left, right)`` starts at
``S - 1 - left``, and ``key_value_seq_lengths`` is the kernel's length (padding keys added to
fill the splits lie past it). A row with nothing to attend to comes out zero.

**Derivatives.** The kernel has no backward pass. This implementation is a ``jax.custom_vjp``
whose backward pass is the plain path's (:class:`~flax_attn.core.xla.XLA`) pullback,
recomputed from the inputs: gradients are exact, and the forward pass is the kernel's. Forward
mode (``jax.jvp``) raises, as for every custom_vjp; so do second derivatives.

Refused: T != 1, H != Hv, float64 (the kernel accumulates in float32), a bias, boolean masks,
explicit positions, segment ids, soft-capping, dropout, returned weights.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.core.pallas import _common
from flax_attn.core.registry import Result
from flax_attn.core.xla import XLA


@dataclasses.dataclass(frozen=True)
class PallasDecode(_common.Kernel):
    """The decoding kernel (``gqa`` of ``decode_attention``). Fields: ``block_k`` keys per
    step (at least 16), ``k_splits`` pieces of the keys at most, ``block_h`` query heads per
    block; ``interpret=True`` runs it through Pallas' interpreter on any backend."""

    home: ClassVar[str] = "gpu"
    hardware: ClassVar[str] = "a GPU"
    name: str = "pallas_decode"
    block_k: int = 128
    k_splits: int = 16
    block_h: int = 16

    def __post_init__(self):
        _checks.check_positive_int("PallasDecode k_splits", self.k_splits)
        _common.check_power_of_2("PallasDecode block_h", self.block_h)
        _common.check_power_of_2("PallasDecode block_k", self.block_k)
        if self.block_k < 16:
            raise ValueError(f"PallasDecode block_k must be at least 16 (the kernel's smallest matmul tile), "
                             f"got {self.block_k}")

    # its backward pass is the plain path's, which differentiates the log-sum-exp too
    residual_forward_only: ClassVar[bool] = False

    def supports(self, call) -> Optional[str]:
        problem = self.refusal(call)
        if problem:
            return problem
        if call.T != 1:
            return f"T={call.T} queries (the decoding kernel takes one query per sequence)"
        if call.H != call.Hv:
            return f"head dims H={call.H} != Hv={call.Hv} (the decoding kernel needs them equal)"
        return _common.mask_refusals(call, kv_lengths=True, window=True)

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        m = call.mask
        lengths = [m.q_lengths, m.kv_lengths]
        # the arrays travel as arguments; the description without them is static
        static = dataclasses.replace(call, mask=dataclasses.replace(m, q_lengths=None, kv_lengths=None))
        out, lse = _decode(self, static, query, key, value, lengths)
        return Result(out=out, lse=lse if call.return_residual else None)


def _bind(call, lengths):
    m = call.mask
    return dataclasses.replace(call, mask=dataclasses.replace(m, q_lengths=lengths[0], kv_lengths=lengths[1]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode(impl, call, query, key, value, lengths):
    return _kernel(impl, _bind(call, lengths), query, key, value)


def _decode_fwd(impl, call, query, key, value, lengths):
    query, key, value = _common.no_second_order(impl.name, (query, key, value))
    return _kernel(impl, _bind(call, lengths), query, key, value), (query, key, value, lengths)


def _decode_bwd(impl, call, residuals, cotangents):
    query, key, value, lengths = residuals
    call = dataclasses.replace(_bind(call, lengths), return_residual=True)
    _, pullback = jax.vjp(lambda q, k, v: _plain(call, q, k, v), query, key, value)
    grads = _common.first_order_only(pullback, cotangents, name=impl.name)
    return (*grads, [None, None])


_decode.defvjp(_decode_fwd, _decode_bwd)


def _plain(call, q, k, v):
    r = XLA()(call, q, k, v, None)
    return r.out, r.lse


def _kernel(impl, call, query, key, value):
    """``(out (B, 1, N, H), lse (B, 1, N))`` from the kernel."""
    from jax.experimental.pallas.ops.gpu import decode_attention

    B, _, N, H = query.shape
    S, m = call.S, call.mask
    splits = max(1, min(impl.k_splits, _common.cdiv(S, impl.block_k)))
    block_k = impl.block_k
    Sp = _common.round_up(S, splits * block_k)
    k = _common.pad_axis(key, 1, Sp)
    v = _common.pad_axis(value, 1, Sp)
    length = jnp.full((B,), S, jnp.int32) if m.kv_lengths is None else jnp.minimum(m.kv_lengths, S)
    start = None
    if m.window is not None:
        start = jnp.full((B,), max(0, S - 1 - m.window[0]), jnp.int32)
    with jax.enable_x64(False):  # the kernel mixes int32 program ids with Python ints (see _common)
        out, (l, mx) = decode_attention.gqa(query[:, 0], k, v, start, length, sm_scale=call.scale,
                                            block_h=impl.block_h, block_k=block_k, k_splits=splits,
                                            interpret=impl.interpret, return_residuals=True)
    out = out.astype(query.dtype)
    lse = jnp.where(l > 0, mx + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf).astype(call.acc_dtype)
    if m.q_lengths is not None:
        some = m.q_lengths > 0
        out = jnp.where(some[:, None, None], out, jnp.zeros((), out.dtype))
        lse = jnp.where(some[:, None], lse, -jnp.inf)
    return out[:, None], lse[:, None]
