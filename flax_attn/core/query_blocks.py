"""Query blocks: the queries cut into blocks, each block attending to all the keys it may see at
once (one matmul, one softmax, one matmul), with no online softmax.

For query block ``[q0, q0 + bq)`` the key range ``[k0, k1)`` that its rules allow is found at
trace time when the mask description says it (causal, windows and chunks over default
positions: keys at ``0..S-1``, queries at the last T of them); otherwise it is every key. The
block's logits ``(C, G, bq, k1 - k0)`` are then computed for a chunk of C (batch row, key/value
head) units together, masked by the mask description's dense tile of the block, and
normalised in one pass, as in the plain path (:func:`flax_attn.core.numerics.softmax_parts`).
The block loop is unrolled (static shapes: causal attention skips the blocks above the
diagonal without branches) and the units run in chunks under ``lax.map``.

**Layout.** An outer ``lax.map`` visits the batch rows (or groups of whole rows) in the inputs'
own ``(B, T, N, H)`` layout; each is regrouped into ``(unit, T, H)`` arrays there and its output
put back the same way. The regrouping copies one row at a time, into buffers that every row
reuses, instead of transposing the whole inputs into fresh buffers: at GPT-2-small's core (8 x
12 heads x 1024 tokens, causal, float32, a 2-core AMD EPYC) the whole-array transposes took
about 50 of 190 ms forward, most of it faulting in their new memory, and the program's
temporaries went from 119 MB to 31 MB (forward 0.18-0.19 s -> 0.15 s).

**Why.** On CPU the work of a step must be large for XLA to spread it over the cores: a
flash-style step on one 128 x 128 tile runs on one core. Here a step is one query block of C
units against all its keys (``C * bq * S`` logits, bounded by ``chunk_bytes``), and the
program has no loop-carried softmax state to rescale.

**Memory and derivatives.** Each block is a ``jax.checkpoint`` that keeps the block's inputs
and its softmax's row maxima and sums (:data:`flax_attn.core.numerics.SOFTMAX_STATS`); reverse
mode recomputes its logits and weights, so memory is linear in S for a given block (``C * bq *
S`` logits at a time), not quadratic. The softmax and the values' matmul are
:func:`flax_attn.core.numerics.softmax_values`, whose derivative is written once with the
weights (three passes over a block's logits in reverse mode where the softmax's own derivative
took about seven); the rows' map is checkpointed too, so reverse mode keeps the inputs' rows
where they lie instead of stacking copies of their units. Forward mode, reverse mode and every
higher order work, with the plain path's accuracy at extreme logits. At GPT-2-small's core
(8 x 12 heads x 1024 tokens, causal, float32, a 2-core AMD EPYC) this took a forward+backward
from 0.67 to 0.56 s.

**Limits.** The program grows with the number of query blocks (unrolled), so the automatic
choice takes it only up to ``max_blocks`` of them and only where the key ranges are known at
trace time (with positions given as arrays, the automatic choice runs them where at run time
the positions are the default ones shifted, and the blockwise path, which skips empty blocks at
run time, elsewhere: :func:`flax_attn.core.attention.shifted_default_positions`). Sequence
lengths must be static.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from flax_attn import _checks
from flax_attn.core import numerics, tuning
from flax_attn.core.mask import FAR
from flax_attn.core.registry import Implementation, Result, refuses_dropout_and_weights


MAX_CHUNK_BYTES = 2 << 20
"""The most block logits one step of :class:`QueryBlocks` takes by default. On a 2-core Intel
Xeon of family 6, model 207 (2 MiB L2 per core), GPT-2-small's layer (8 x 1,024 tokens, 12
heads, causal, float32) in turns with PyTorch's SDPA layer, twice the L2 (4 MiB) against 2 MiB:
forward 1.126x / 1.095x and 1.250x / 1.220x PyTorch's time, forward+backward 1.329x / 1.203x
and 1.347x / 1.185x (two processes); the core alone forward 174 / 162 ms, forward+backward 542
/ 532 ms. With 1 MiB L2 (AMD EPYC, family 25, model 17) twice the L2 is this, and was the
fastest of 1, 2 and 4 MiB."""


@dataclasses.dataclass(frozen=True)
class QueryBlocks(Implementation):
    """Attention by blocks of queries, each against its whole key range; no dropout, no
    returned weights.

    Fields are tuning knobs; every setting computes the same function.

    Fields:
      block_q: queries per block. None: the largest tile whose working set fits half the
        per-core L2 (:func:`flax_attn.core.tuning.block_sizes`; 128 for 64-dim float32 heads on
        a 1 MiB L2)
        or, for multi-head attention (G = 1) over at least four blocks of it, the largest tile
        whose working set fits the whole per-core L2 (256 there). Measured, one key/value head
        per query head, causal (8 x 12 heads of 1024 tokens): blocks of 256 forward 0.125 s,
        forward+backward 0.48 s; of 128, 0.117 and 0.51 s. With 256 tokens (4 x 12 heads) one
        block of 256 took 45% longer forward than two of 128 (causal attention skips less), with
        512, 30%; grouped queries (G times the rows a block) were not faster with larger blocks.
      chunk_bytes: the (batch row, key/value head) units of one step are as many as keep the
        block's logits (``C * G * block_q * keys * 4`` bytes) within this, dividing the units,
        and at least ``min_units``. None: twice the per-core L2 cache
        (:func:`flax_attn.core.tuning.l2_cache_bytes`), so that a step's logits fit the L2
        caches of two cores, but at most :data:`MAX_CHUNK_BYTES` (one L2 in a program compiled
        by :func:`flax_attn.jit` without YNNPACK, where ``min_units`` defaults to 1: measured
        faster there).
      min_units: the fewest units a step takes (where the units allow). None: 2 for
        multi-head attention, 1 with grouped queries (G > 1). Two units a step made reverse
        mode faster in both cases, but the forward of grouped queries slower (their blocks
        have G times the rows): 12 query heads over 4 key/value heads (8 x 1024 tokens,
        causal), one unit vs two: forward 0.11 vs 0.13 s, forward+backward 0.56 vs 0.44 s;
        16 over 4: 0.16 vs 0.19 s, 0.76 vs 0.59 s. A training loop over grouped queries can
        take ``QueryBlocks(min_units=2)``.
      min_length: the automatic choice takes it on CPU once T and S reach this ...
      max_blocks: ... while T needs at most this many query blocks (the unrolled program grows
        with them), and the key ranges are known at trace time.

    The defaults were measured on a 2-core AMD EPYC (1 MiB L2 per core), causal, float32,
    64-dim heads, forward / forward+backward, against the earlier defaults (block_q 128, one
    unit a step allowed) and before the CPU matmul forms of the derivative
    (:func:`flax_attn.core.numerics.key_logits`,
    :func:`~flax_attn.core.numerics.softmax_values`), each side in its own process in turns:
    GPT-2-small's 8 x 12 heads of 1024 tokens 0.14-0.15 -> 0.13 s / 0.56 -> 0.50 s; one
    sequence of 2048 tokens in 8 heads 0.056 s both / 0.18-0.19 -> 0.17 s; of 4096 tokens
    (blockwise before, 32 blocks of 128 being over ``max_blocks``) 0.26 -> 0.20 s / 1.05-1.08
    -> 0.62-0.65 s.
    """

    name: str = "query_blocks"
    block_q: Optional[int] = None
    chunk_bytes: Optional[int] = None
    min_units: Optional[int] = None
    min_length: int = 128
    max_blocks: int = 16

    def __post_init__(self):
        if self.block_q is not None:
            _checks.check_positive_int("QueryBlocks block_q", self.block_q)
        if self.chunk_bytes is not None:
            _checks.check_positive_int("QueryBlocks chunk_bytes", self.chunk_bytes)
        if self.min_units is not None:
            _checks.check_positive_int("QueryBlocks min_units", self.min_units)

    def supports(self, call) -> Optional[str]:
        reason = refuses_dropout_and_weights(call)
        if reason is None and not (isinstance(call.T, int) and isinstance(call.S, int)):
            reason = "symbolic sequence lengths (use implementation='blockwise')"
        return reason

    def preferred(self, call) -> bool:
        mask = call.mask
        static_ranges = not (mask.uses_positions or mask.chunk is not None) or (
            mask.q_positions is None and mask.k_positions is None)
        return (call.platform == "cpu" and min(call.T, call.S) >= self.min_length and static_ranges
                and -(-call.T // self._block_q(call)) <= self.max_blocks)

    def _step_units(self, call, B, bq: int, widest: int) -> tuple:
        """``(rows, chunk)``: the batch rows of one chunk of the layer's rows and the units of
        one step (dividing ``rows * K``), from ``chunk_bytes`` and ``min_units``. Their
        defaults: twice the per-core L2 (at most :data:`MAX_CHUNK_BYTES`) and 2 units for
        multi-head attention; in a program
        declared to compile without YNNPACK (:func:`flax_attn.core.tuning.compiled_with`) one
        L2 and one unit, measured faster there (GPT-2-small's layer on a 2-core AMD EPYC of
        family 25, 512 KiB L2, in turns with PyTorch's: forward+backward 1.125x -> 1.067x and
        1.162x -> 1.068x PyTorch's time, forward 1.046x -> 1.008x and 1.008x -> 0.998x)."""
        K, G = call.K, call.G
        lean = call.platform == "cpu" and tuning.ynnpack_fusions_off()
        l2 = tuning.l2_cache_bytes()
        budget = (l2 if lean else min(2 * l2, MAX_CHUNK_BYTES)) if self.chunk_bytes is None else self.chunk_bytes
        fewest = self.min_units or (2 if G == 1 and not lean else 1)
        want = max(fewest, budget // max(1, 4 * G * bq * widest))  # units whose block logits fit the budget
        rows = tuning.unit_chunk(B, 1, want // K) if want >= K and isinstance(B, int) else 1
        return rows, tuning.unit_chunk(rows, K, want)  # units of one step, dividing the rows' rows * K

    def _block_q(self, call) -> int:
        if self.block_q is not None:
            return min(call.T, self.block_q)
        itemsize = jnp.dtype(call.dtype).itemsize
        bq = tuning.block_sizes(call.H, call.Hv, itemsize)[0]
        large = tuning.block_sizes(call.H, call.Hv, itemsize, tuning.l2_cache_bytes())[0]
        if call.G == 1 and call.T >= 4 * large:
            bq = large
        return min(call.T, bq)

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        B, T, N, H = query.shape
        S, K, G = call.S, call.K, call.G
        Hv = value.shape[-1]
        bq = self._block_q(call)
        logits = _Logits(call.scale, call.softcap, call.precision, K, G, call.platform)
        scale = None
        if numerics.scale_is_exact(call.scale, query.dtype):  # (scale q) . k is scale (q . k) bit for bit
            scale = jnp.asarray(call.scale, query.dtype)
            logits = dataclasses.replace(logits, scale=1.0)
        ranges = key_ranges(call.mask, T, S, bq)
        widest = max(k1 - k0 for _, _, k0, k1 in ranges)
        rows, chunk = self._step_units(call, B, bq, widest)
        acc = call.acc_dtype

        def run_chunk(args):
            u, qc, kc, vc = args
            outs, lses = [], []
            for q0, q1, k0, k1 in ranges:
                if k1 <= k0:  # no key may be seen by this block
                    outs.append(jnp.zeros((chunk, G, q1 - q0, Hv), acc))
                    lses.append(jnp.full((chunk, G, q1 - q0), -jnp.inf, acc))
                    continue
                # a block's inputs are the step's whole qc, kc, vc (cut inside): reverse mode keeps
                # those once per step, not a cut of them per block
                block = jax.checkpoint(functools.partial(_cut_block, logits, call.mask, q0, q1, k0, k1),
                                       policy=_KEEP_STATS)
                out, lse = block(u, qc, kc, vc)
                outs.append(out)
                lses.append(lse)
            return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)

        def run_rows(args):
            """``rows`` batch rows, in the inputs' layout: regrouped into (row, key/value head)
            units here, a row at a time, and back."""
            first, qr, kr, vr = args
            if rows == 1:  # mapped over the batch axis itself (a size-1 axis in the inputs made XLA copy them)
                qr, kr, vr = qr[None], kr[None], vr[None]
            U = rows * K
            q = numerics.group_queries(qr if scale is None else qr * scale, K).reshape(U // chunk, chunk, G, T, H)
            units = lambda x: jnp.swapaxes(x, 1, 2).reshape(U // chunk, chunk, S, x.shape[-1])
            ids = (first * K + jnp.arange(U, dtype=jnp.int32)).reshape(U // chunk, chunk)
            out, lse = lax.map(run_chunk, (ids, q, units(kr), units(vr)))
            out = numerics.ungroup(out.reshape(rows, K, G, T, Hv)).astype(query.dtype)
            lse = numerics.ungroup(lse.reshape(rows, K, G, T, 1))[..., 0] if call.return_residual else None
            return (out[0], None if lse is None else lse[0]) if rows == 1 else (out, lse)

        by_rows = lambda x: x if rows == 1 else x.reshape((B // rows, rows) + x.shape[1:])
        firsts = jnp.arange(B, dtype=jnp.int32).reshape(B // rows, rows)[:, 0]
        # checkpointed rows: reverse mode keeps the inputs' own rows, not stacked copies of their units
        rows_step = jax.checkpoint(run_rows, policy=_KEEP_STATS)
        out, lse = lax.map(rows_step, (firsts, by_rows(query), by_rows(key), by_rows(value)))
        out = out.reshape(B, T, N, Hv)
        return Result(out=out, lse=None if lse is None else lse.reshape(B, T, N))


@dataclasses.dataclass(frozen=True)
class _Logits:
    """What the logit pipeline needs (:func:`flax_attn.core.numerics.finish_logits`), and the
    grouping of heads."""

    scale: float
    softcap: Optional[float]
    precision: object
    K: int
    G: int
    platform: str


_KEEP_STATS = jax.checkpoint_policies.save_only_these_names(numerics.SOFTMAX_STATS)
_PER_UNIT = ("q_positions", "k_positions", "q_segments", "k_segments", "q_lengths", "kv_lengths", "dense")


def key_ranges(mask, T: int, S: int, bq: int):
    """``[(q0, q1, k0, k1)]``: each query block and the key range its rules allow, known at trace
    time (every key unless causal, window or chunk rules hold over default positions)."""
    lower, upper = mask.bounds
    static = mask.q_positions is None and mask.k_positions is None
    ranges = []
    for q0 in range(0, T, bq):
        q1 = min(T, q0 + bq)
        k0, k1 = 0, S
        if static and (mask.uses_positions or mask.chunk is not None):
            p0, p1 = q0 + S - T, q1 - 1 + S - T  # the block's first and last query positions
            if lower < FAR:
                k0 = max(k0, p0 - lower)
            if upper < FAR:
                k1 = min(k1, p1 + upper + 1)
            if mask.chunk is not None:
                k0 = max(k0, (p0 // mask.chunk) * mask.chunk)
                k1 = min(k1, (p1 // mask.chunk + 1) * mask.chunk)
        ranges.append((q0, q1, k0, max(k0, k1)))
    return ranges


def _cut_block(logits, mask, q0, q1, k0, k1, u, qc, kc, vc):
    """:func:`_block` on queries ``[q0, q1)`` and keys ``[k0, k1)`` of a step's units."""
    return _block(logits, mask, q0, q1 - q0, k0, k1 - k0, u, qc[:, :, q0:q1], kc[:, k0:k1], vc[:, k0:k1])


def _block(logits, mask, q0, bq, k0, bk, u, qi, kj, vj):
    """One query block of C units against keys ``[k0, k0 + bk)``: out ``(C, G, bq, Hv)`` and the
    log-sum-exp ``(C, G, bq)``. Computed on ``(C, G*bq, bk)`` logits: with a size-1 G axis in
    the way, XLA's CPU code for the softmax and the matmuls took 20% longer."""
    acc = jnp.promote_types(qi.dtype, jnp.float32)
    C, G = qi.shape[:2]
    R = G * bq  # rows: the block's queries of the unit's G heads
    raw = numerics.key_logits(qi.reshape(C, R, -1), kj, logits.precision, acc, logits.platform)
    where = lambda u: (u // logits.K, ((u % logits.K) * logits.G, logits.G))  # batch row, heads
    if mask.bias is None and mask.score_mod is None:
        s = numerics.finish_logits(logits, raw)
    else:
        def unit_logits(u, raw):
            b, heads = where(u)
            s = numerics.finish_logits(logits, raw.reshape(G, bq, bk), mask.block_bias(b, heads, q0, bq, k0, bk))
            return mask.block_scores(s, b, heads, q0, bq, k0, bk).reshape(R, bk)  # a user's score_mod, if any
        s = jax.vmap(unit_logits)(u, raw)
    rows = lambda m: jnp.broadcast_to(m, (G, bq, bk)).reshape(R, bk)  # (1|G, bq, bk) -> (R, bk)
    allowed = None
    if mask.has_rules:
        if not mask.mask_mods and all(getattr(mask, f) is None for f in _PER_UNIT):
            # causal, window and chunk rules over default positions: the same pairs for every unit
            allowed = rows(mask.block(0, (0, 1), q0, bq, k0, bk))[None]
        else:
            allowed = jax.vmap(lambda u: rows(mask.block(*where(u), q0, bq, k0, bk)))(u)
    out, lse = numerics.softmax_values(s, allowed, vj, logits.precision, logits.platform)
    return out.reshape(C, G, bq, -1), lse.reshape(C, G, bq)
