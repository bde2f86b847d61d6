"""JAX's Splash attention for TPUs: ``jax.experimental.pallas.ops.tpu.splash_attention``.

    out = softmax(cap(scale * Q K^T) [masked]) V,  block-sparse forward and backward kernels

Splash takes a static mask pattern (an object describing which blocks of the ``(T, S)`` grid
are empty, full or partial, so that empty blocks are skipped), query and key segment ids,
grouped-query heads, a logit soft-cap and per-head "sink" logits. It runs one batch item
(``jax.vmap`` over the batch). This file translates a :class:`~flax_attn.core.call.Call`:

* causal and window rules (default positions: query t at ``t + S - T``) become splash's
  ``CausalMask`` / ``LocalMask`` with offset ``S - T``;
* segment ids, key lengths and the padding of T and S to the blocks (multiples of 128) become
  segment ids: a query that may attend to nothing (negative id, past its length) gets id -2,
  a key nobody may see (negative id, past the key length, padding) id -1, so they never meet;
* the scale multiplies the queries before the kernel (splash has no scale argument);
* a row that may attend to nothing must give zeros, with zero gradients. Splash would give
  the average of the values in its blocks (or 0/0 where every block is skipped), so every
  head gets a sink logit of -1e38: ``e^(-1e38 - m)`` is exactly 0 beside any real logit, and
  alone (an empty row) it makes the denominator 1 with nothing in the numerator.

Refused: float64 (the kernel accumulates in float32), a bias, boolean masks, explicit
positions. ``return_residual`` is served forward only (splash cannot differentiate through its
residuals: a derivative of such a call raises ``NotImplementedError``, and the automatic choice
does not take splash for it). Forward-mode autodiff (``jax.jvp``) raises: the kernel's derivative is a
``jax.custom_vjp``.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp

from flax_attn import _checks
from flax_attn.core.mask import FAR
from flax_attn.core.pallas import _common
from flax_attn.core.registry import Result

SINK = -1e38          # a logit below any real one, far above splash's masked value (-2.4e38)
EMPTY_LSE = -1e37     # a log-sum-exp below this is the sink's alone: an empty row

LANES = 128           # splash tiles sequences in multiples of the TPU's 128 lanes


@dataclasses.dataclass(frozen=True)
class Splash(_common.Kernel):
    """Splash attention. Fields: ``block_q``/``block_kv`` tile the forward pass and
    ``block_bwd`` the backward passes (multiples of 128); ``interpret=True`` runs the kernel
    through Pallas' interpreter on any backend (CPU included), for tests."""

    home: ClassVar[str] = "tpu"
    hardware: ClassVar[str] = "a TPU"
    name: str = "splash"
    block_q: int = 128
    block_kv: int = 128
    block_bwd: int = 128

    def __post_init__(self):
        for field in ("block_q", "block_kv", "block_bwd"):
            value = getattr(self, field)
            _checks.check_positive_int(f"Splash {field}", value)
            if value % LANES:
                raise ValueError(f"Splash {field} must be a multiple of {LANES} (the kernel tiles sequences in "
                                 f"the TPU's {LANES} lanes), got {value}")

    def supports(self, call) -> Optional[str]:
        return self.refusal(call) or _common.mask_refusals(call, segments=True, kv_lengths=True, window=True,
                                                           softcap=True)

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        from jax.experimental.pallas.ops.tpu import splash_attention as sa

        B, T, N, H = query.shape
        S, m = call.S, call.mask
        tile = max(self.block_q, self.block_kv, self.block_bwd)
        Tp, Sp = _common.round_up(T, tile), _common.round_up(S, tile)
        with jax.ensure_compile_time_eval():  # the mask's block tables are constants, even under remat
            kernel = sa.make_splash_mha(
                _pattern(sa, m, N, T, S, Tp, Sp),
                block_sizes=sa.BlockSizes(block_q=self.block_q, block_kv=self.block_kv,
                                          block_kv_compute=self.block_kv, block_q_dkv=self.block_bwd,
                                          block_kv_dkv=self.block_bwd, block_kv_dkv_compute=self.block_bwd,
                                          block_q_dq=self.block_bwd, block_kv_dq=self.block_bwd),
                save_residuals=call.return_residual, attn_logits_soft_cap=call.softcap,
                head_shards=1, q_seq_shards=1, interpret=self.interpret)
        # (B, T, N, H) -> (B, N, Tp, H); the scale goes on the queries
        q = (query * jnp.asarray(call.scale, query.dtype)).transpose(0, 2, 1, 3)
        q = _common.pad_axis(q, 2, Tp)
        k = _common.pad_axis(key.transpose(0, 2, 1, 3), 2, Sp)
        v = _common.pad_axis(value.transpose(0, 2, 1, 3), 2, Sp)
        q_ids, k_ids = _segment_ids(m, B, T, S, Tp, Sp)
        sinks = jnp.full((N,), SINK, jnp.float32)

        def one(q, k, v, q_ids, k_ids, sinks):
            ids = None if q_ids is None else sa.SegmentIds(q=q_ids, kv=k_ids)
            return kernel(q, k, v, ids, sinks)

        id_axis = None if q_ids is None else 0
        batched = jax.vmap(one, in_axes=(0, 0, 0, id_axis, id_axis, None))
        result = _common.traced_in_32_bits(batched, self.name, residual=call.return_residual)(
            q, k, v, q_ids, k_ids, jax.lax.stop_gradient(sinks))
        out, lse = (result[0], result[1][0]) if call.return_residual else (result, None)
        out = out[:, :, :T].transpose(0, 2, 1, 3)
        if lse is not None:
            lse = lse[:, :, :T].transpose(0, 2, 1).astype(call.acc_dtype)
            lse = jnp.where(lse < EMPTY_LSE, -jnp.inf, lse)
        return Result(out=out, lse=lse)


def _pattern(sa, m, N, T, S, Tp, Sp):
    """The static mask of the causal and window rules on the padded ``(Tp, Sp)`` grid, one per head."""
    if m.uses_positions:
        lower, upper = m.bounds
        window = (None if lower >= FAR else lower, None if upper >= FAR else upper)
        if window == (None, 0):
            base = sa.CausalMask((Tp, Sp), offset=S - T)
        else:
            base = sa.LocalMask((Tp, Sp), window_size=window, offset=S - T)
    else:
        base = sa.FullMask((Tp, Sp))
    return sa.MultiHeadMask([base] * N)


def _segment_ids(m, B, T, S, Tp, Sp):
    """``(B, Tp)`` and ``(B, Sp)`` int32 ids, or None when nothing needs them: valid ids are
    the user's (>= 0, else 0); queries that attend to nothing get -2, keys nobody sees -1."""
    if m.q_segments is None and m.kv_lengths is None and m.q_lengths is None and Sp == S:
        return None, None
    q_ids = jnp.zeros((B, T), jnp.int32) if m.q_segments is None else _common.rows(m.q_segments, B)
    k_ids = jnp.zeros((B, S), jnp.int32) if m.k_segments is None else _common.rows(m.k_segments, B)
    q_ids = jnp.where(q_ids < 0, -2, q_ids)
    k_ids = jnp.where(k_ids < 0, -1, k_ids)
    if m.q_lengths is not None:
        q_ids = jnp.where(jnp.arange(T)[None, :] < m.q_lengths[:, None], q_ids, -2)
    if m.kv_lengths is not None:
        k_ids = jnp.where(jnp.arange(S)[None, :] < m.kv_lengths[:, None], k_ids, -1)
    return _common.pad_axis(q_ids, 1, Tp, -2), _common.pad_axis(k_ids, 1, Sp, -1)
