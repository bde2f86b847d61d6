"""JAX's Pallas flash attention for GPUs (Triton): ``jax.experimental.pallas.ops.gpu.attention``.

    out = softmax(scale * Q K^T [masked]) V,  forward and backward as fused Pallas kernels

The kernel knows causal masking by index, one segment-id array shared by queries and keys, and
nothing else; its sequence lengths must be multiples of its blocks and its heads equal in
number. This file translates a :class:`~flax_attn.core.call.Call` into those terms:

* grouped-query attention: key/value heads repeated G times (their gradients summed back);
* head dims: H and Hv zero-padded to one power of two (zeros change no dot product);
* lengths: queries and keys padded to a multiple of the blocks. Causal calls are aligned at
  the end (query t at position ``t + S - T``) by padding ``S - T`` dummy queries in front, so
  that index order is position order; padded keys come after every real query and the causal
  rule blocks them. Without causal masking, padded keys take segment id -1;
* segment ids: the kernel compares ``ids[t] == ids[s]`` of one array, so it serves them where
  T == S and the query ids equal the key ids (checked when the program runs: a difference
  raises, never a silent wrong answer);
* rows that attend to nothing (query lengths, negative query segment ids) are set to zero
  after the kernel, which gives them zero gradients.

Refused: float64 (the kernel accumulates in float32), a bias, boolean masks, windows,
explicit positions, key lengths, soft-capping, T > S, dropout, returned weights.
``return_residual`` is served forward only (the kernel cannot differentiate through its
residual output: a derivative of such a call raises ``NotImplementedError``, and the automatic
choice does not take the kernel for it). Forward-mode autodiff (``jax.jvp``) raises: the kernel's derivative is a
``jax.custom_vjp``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Optional

import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core.pallas import _common
from flax_attn.core.registry import Result


@dataclasses.dataclass(frozen=True)
class PallasTriton(_common.Kernel):
    """The Triton flash-attention kernel of ``jax.experimental.pallas.ops.gpu.attention``.

    Fields: ``block_q``/``block_k`` tile the forward pass, ``block_bwd`` both backward passes
    (all powers of two); ``interpret=True`` runs the kernel through Pallas' interpreter on any
    backend (CPU included), for tests.
    """

    home: ClassVar[str] = "gpu"
    hardware: ClassVar[str] = "a GPU"
    name: str = "pallas_triton"
    block_q: int = 64
    block_k: int = 64
    block_bwd: int = 32

    def __post_init__(self):
        for field in ("block_q", "block_k", "block_bwd"):
            _common.check_power_of_2(f"PallasTriton {field}", getattr(self, field))

    def supports(self, call) -> Optional[str]:
        problem = self.refusal(call) or _common.mask_refusals(call, segments=True)
        if problem:
            return problem
        if call.T > call.S:
            return f"T={call.T} > S={call.S} (the kernel's one segment-id array must cover every query)"
        if call.mask.q_segments is not None and call.T != call.S:
            return (f"segment ids with T={call.T} != S={call.S} (the kernel reads one id array for queries "
                    f"and keys)")
        return None

    def _tile(self) -> int:
        return math.lcm(self.block_q, self.block_k, self.block_bwd)

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        from jax.experimental.pallas.ops.gpu import attention as triton_attention

        B, T, N, H = query.shape
        S, G, m = call.S, call.G, call.mask
        causal = m.causal
        if G > 1:
            key, value = jnp.repeat(key, G, axis=2), jnp.repeat(value, G, axis=2)
        P = _common.next_power_of_2(max(call.H, call.Hv, 1 if self.interpret else 16))
        L = _common.round_up(S, self._tile())
        front = S - T if causal else 0          # dummy queries that align the causal rule to the end
        q = jnp.pad(query, ((0, 0), (front, L - S + (S - T - front)), (0, 0), (0, P - H)))
        k = jnp.pad(key, ((0, 0), (0, L - S), (0, 0), (0, P - H)))
        v = jnp.pad(value, ((0, 0), (0, L - S), (0, 0), (0, P - call.Hv)))
        ids = None
        if m.q_segments is not None:
            q_ids, k_ids = _common.rows(m.q_segments, B), _common.rows(m.k_segments, B)
            _checks.runtime_check(jnp.all(q_ids == k_ids),
                                  "implementation='pallas_triton' needs query_segment_ids equal to key_segment_ids "
                                  "(the kernel reads one id array); they differ in {count} places",
                                  count=jnp.sum(q_ids != k_ids))
            ids = _common.pad_axis(k_ids, 1, L, -1)
        elif not causal and L > S:
            ids = _common.pad_axis(jnp.zeros((B, S), jnp.int32), 1, L, -1)
        blocks = triton_attention.BlockSizes(block_q=self.block_q, block_k=self.block_k,
                                             block_q_dkv=self.block_bwd, block_kv_dkv=self.block_bwd,
                                             block_q_dq=self.block_bwd, block_kv_dq=self.block_bwd)
        kernel = _common.traced_in_32_bits(lambda q, k, v, ids: triton_attention.mha(
            q, k, v, ids, sm_scale=call.scale, causal=causal, block_sizes=blocks, interpret=self.interpret,
            return_residuals=call.return_residual), self.name, residual=call.return_residual)
        result = kernel(q, k, v, ids)
        out, lse2 = result if call.return_residual else (result, None)
        out = out[:, front:front + T, :, :call.Hv]
        visible = m.query_visible()
        if visible is not None:
            out = jnp.where(visible[:, :, None, None], out, jnp.zeros((), out.dtype))
        lse = None
        if call.return_residual:
            # the kernel's residual is log2 of the sum of 2^(log2(e) * logits)
            lse = jnp.transpose(lse2[:, :, front:front + T], (0, 2, 1)).astype(call.acc_dtype) * np.log(2.0)
            if visible is not None:
                lse = jnp.where(visible[:, :, None], lse, -jnp.inf)
        return Result(out=out, lse=lse)
