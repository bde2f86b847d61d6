"""Key blocks up to the filled length: a few queries against a long key axis of which only a
prefix is in use, known at run time (a KV cache of ``max_len`` slots holding ``length`` tokens).

Every (batch row, key/value head) unit is computed at once: the queries of a unit are its
``G * T`` rows (one row per head when decoding a token). The keys are visited in blocks of
``block_k`` with an online softmax, and only the blocks below the longest row's key/value
length (``key_value_seq_lengths``, or :func:`flax_attn.core.mask.lengths`) are computed: the
others are skipped at run time.

**Where the keys lie.** A block's keys are copied out of the keys before its matmul. Keys
that lie as ``(B*K, S, H)`` (a ``'BKSH'`` :class:`flax_attn.KVCache`, declared by the layer
around its attention, :func:`flax_attn.core.tuning.keys_stored`; or one key/value head) are
read where they lie by one plain pass over all of them, which is cheaper than the blocks once
more than half of them are in use, and runs then instead (for at most ``max_queries``
query tokens, with lengths declared finite past them: see below). Any other keys (a ``'BSKH'`` cache,
arrays as given) would be transposed whole for that pass: they go by blocks however full,
each block cut and regrouped in the same copy. A decoding step of a 768-wide, 12-head float32
layer with a ``'BSKH'`` cache, batch 8, on a 2-core AMD EPYC of family 25, before / after:
1,024 of 8,192 slots filled 252 / 8.9 ms, of 1,202 slots 54.8 / 6.4 ms (a ``'BKSH'`` cache:
8.0 and 6.2 ms); batch 1, 1,024 of 1,202, 3.5 / 1.8 ms (40 steps each, separate runs).

**Block-major keys.** Keys declared as a ``'blocks'`` cache (``(S // c, B*K, c, H)``, seen
through a transpose that the blocks' reshape undoes) are visited in the cache's own blocks:
each is one contiguous piece of the cache, copied out whole for its matmuls (a slice of the
leading axis; XLA's CPU matmul still reads whole arrays), where a block of a ``'BKSH'`` cache
is gathered from ``B*K`` separate runs of slots. Past half the keys one pass reads every block
in place, no copy, its logits and weighted values matmuls batched over (block, unit). A
visited block costs about eight operations of XLA's CPU runtime (two copies, two matmuls, the
softmax's steps): alone, 12 units and 9 of 64 blocks of 128 took 0.24-0.30 ms (96 units: 2.1-2.3
ms), a skipped block about 0.5 us. A decoding step of a 768-wide,
12-head float32 layer with 1,024 tokens in 8,192 slots, 2-core AMD EPYC of family 26, in turns
in one process, a ``'BKSH'`` cache / a ``'blocks'`` cache of 128-slot blocks: batch 1 0.79-1.07
/ 0.63-0.82 ms, batch 8 3.9-4.1 / 3.1-3.2 ms; with the cache full (8,192 of 8,704 slots) the
blocks one by one took 2.9-3.4 ms at batch 1 and 17.3-17.5 ms at batch 8, the one pass 2.2 and
14.8 ms (a ``'BKSH'`` cache: 1.8-2.3 and 12.5-13.1 ms).

**Block-diagonal queries, on a CPU with AVX-512.** There keys not in units order are read
where they lie instead, as ``(B, S, K*H)`` rows (a free reshape): each batch row's queries
become a block-diagonal ``(K*G*T, K*H)`` matrix, unit (b, k)'s rows over its own head's
columns and zeros elsewhere, so one matmul gives every unit's logits against a block as cut
(no regrouping copy), and past half the keys against all of them in one pass with no copy at
all; the values' matmul gives ``(K*G*T, K*Hv)``, of which each unit keeps its own head's
columns (:func:`flax_attn.core.numerics.reads_heads_in_place`). It does K times the
multiplications of the per-unit matmuls, so it is taken while ``K*G*T <=
DIAGONAL_MAX_COLUMNS`` (16: a multi-head decoding step of up to 16 heads, grouped queries of up
to 16 rows in all). A decoding step of a 768-wide, 12-head float32 layer with
a ``'BSKH'`` cache on a 2-core AMD EPYC of family 26 (AVX-512), before / after, in turns in one
process (ms): batch 1 / 8 after 1,024 tokens 0.98 / 0.75 and 4.98 / 3.27; after 8,192 tokens
4.97 / 2.72 and 27.4 / 18.9; 1,024 of 8,192 slots 1.40 / 1.30 and 5.00 / 4.51; 2 key/value
heads, batch 8, 8,192 tokens 5.55 / 4.36 (batch 1, 1,024 tokens 0.33 / 0.37). CPUs without
AVX-512 keep the regrouped blocks (not measured there).

**Why.** The plain path reads every key of the cache whatever its fill. On a 2-core AMD EPYC a
decoding step of a 768-wide, 12-head float32 layer with 1,100 tokens in an 8,192-slot cache
took 2.5 ms at batch 1 and 18.5 ms at batch 8 over the whole cache, and 1.0 and 5.6 ms by key
blocks. A step's cost follows the fill, not the capacity (at up to twice the bytes in use:
the blocks' copies, and the last block's slots past the fill).

**One row per unit, without YNNPACK.** In a program compiled with XLA's YNNPACK fusions off
(declared while tracing, :func:`flax_attn.core.tuning.compiled_with`: a decoding step of
:func:`flax_attn.decode_step` on a CPU without AVX-512), a unit with a single query row (a
multi-head decoding step) computes each block's logits and weighted values as products summed
in place: XLA fuses the block's slice into the sums, where a matmul needs the block copied out
first. 2-core AMD EPYC of family 25, in turns in one process: alone, 96 units, 1,024 keys in
blocks of 128, 7.0 -> 5.3 ms; a decoding step of a 768-wide, 12-head layer with 1,025 /
3,000 of 8,192 slots filled: 9.59 -> 8.22 / 21.3 -> 17.1 ms at batch 8, 1.91 -> 1.84 ms at
batch 1. With YNNPACK's fusions on, XLA's default, the same sums were seven times slower than
the matmuls (hence the declaration); with 6 or 16 rows per unit (grouped queries, latent
attention) they were slower than the matmuls. Keys that are not regrouped in place (see above)
are summed over each block as it is cut, ``(B, c, K, H)``, instead of over a regrouped copy:
the same layer with a ``'BSKH'`` cache, batch 8, 8,192 of 8,370 / 1,024 of 1,202 slots filled,
54 -> 42 / 9.4 -> 7.5-8.6 ms a step (two runs each, in turns).

**Garbage past the lengths.** Keys and values that no query may use (past
``key_value_seq_lengths``, under a negative key segment id, an all-False column of a dense
mask) are zeroed in each visited block as it is read, so that NaN or Inf there reaches neither
the output nor a gradient (:attr:`~flax_attn.core.registry.Implementation.zeroes_blocked_keys`):
the zeroing pass over every key and value that other implementations get first is skipped,
and so is the plain-pass branch, which would need it (lengths declared finite past them,
:func:`flax_attn.core.mask.lengths`, as the layers' caches do, keep that branch). A call in
``jax.nn.dot_product_attention``'s terms, ``key_value_seq_lengths`` over keys and values given
as ``(B, S, K, H)`` arrays of 8,192 slots, 768 wide, 12 heads, float32, on a 2-core AMD EPYC of
family 26, before / after (ms): 1,025 in use, batch 8: 102-105 / 3.9-6.2; batch 1: 15-16 /
0.5-1.1; 2 key/value heads, batch 8: 19.5 / 0.8-0.9; 7,000 in use, batch 8: 116-118 / 21-36
(within the noise of declaring them finite).

**Derivatives.** The blocks are a ``lax.scan`` whose steps past the length are a ``lax.cond``
that passes the softmax state through, and the choice between blocks and the plain pass (keys
in ``(B*K, S, H)`` order) is a ``lax.cond``: JAX differentiates both in every mode. Under
``jax.vmap`` with batched lengths both branches of each ``cond`` run (correct, not faster).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from flax_attn import _checks
from flax_attn.core import numerics, tuning
from flax_attn.core.registry import Implementation, Result, refuses_dropout_and_weights
from flax_attn.core.xla import XLA

BLOCK_L2S = 3  # keys + values of one block over all units fit this many per-core L2 caches (see KeyBlocks.block_k)
MIN_BLOCK = 128


@dataclasses.dataclass(frozen=True)
class KeyBlocks(Implementation):
    """Attention over the key blocks that the key/value lengths leave in use; no dropout, no
    returned weights. Serves calls with ``key_value_seq_lengths`` (a lengths rule in the mask),
    or with a boolean mask over the keys, whose last allowed key then bounds the blocks (a
    padding mask ``(B, 1, 1, S)`` over a cache, as Flax's decoding builds; batch 8, 12 heads of
    64, 1,025 of 8,192 slots allowed, 2-core AMD EPYC of family 26: 128 -> 4.7 ms a call,
    ``jax.nn.dot_product_attention`` 123 ms; every row allowed between half and all of 8,192
    slots: 125 -> 23 ms; 8 queries against 1,024 keys so padded: 21 -> 4.3 ms).

    Fields are tuning knobs; every setting computes the same function.

    Fields:
      block_k: keys per block. None: the largest power of two from 128 whose keys and values
        over all units (``B*K * block_k * (H + Hv) * itemsize`` bytes) fit three per-core L2
        caches (:func:`flax_attn.core.tuning.l2_cache_bytes`), else 128: each block's keys are
        copied out of the cache (XLA's matmul reads whole arrays), so a small block wastes less
        past the fill, while each block costs a step of the loop. A 768-wide, 12-head float32
        layer decoding (a step of ``decode_step``), 1,100 of 8,192 slots filled, on 2-core AMD
        EPYCs: with 1 MiB of L2 a core (family 26; 2.5 ms at batch 1 and 18.5 ms at batch 8
        over the whole cache), batch 1, 128 / 256 / 512 / 1,024 keys a block: 1.38 / 1.24 /
        1.04 / 1.49 ms a step; batch 8, 64 / 128 / 256 keys: 6.9 / 5.6 / 6.1 ms. With 512 KiB
        (family 25, in turns in one process), batch 1 with 1,025 slots filled, 64 / 128 / 256
        / 512 keys: 2.46 / 2.12 / 2.27 / 2.58 ms, with 3,000 filled 6.59 / 4.61 / 4.30 / 4.45
        ms (a fixed 3 MiB had taken 512 there).
      max_queries: the automatic choice takes it on CPU for at most this many query tokens
        (T: decoding and short speculative steps), whatever the number of query heads per
        key/value head: more rows per block only make each block's matmul larger. On a 2-core
        AMD EPYC, multi-query attention of 128 heads 576 wide over 1,025 of 8,192 slots (an
        absorbed multi-head latent attention step), plain path against key blocks: batch 1,
        T = 1: 18.8 / 3.1 ms; batch 8, T = 1: 158 / 30 ms; batch 8, T = 16: 2,094 / 404 ms;
        grouped 32 heads over 4 (batch 8, 64 wide), T = 1 / 16: 46 / 32 ms and 231 / 66 ms;
        past half the cache both take the plain pass (within 2%) ...
      keys_per_query: ... and for more query tokens over a KV cache (keys declared by the
        layer to lie in its cache, :func:`flax_attn.core.tuning.keys_stored`) of at least this
        many times as many slots (``T * keys_per_query <= S``): a chunk of a prompt, or draft
        tokens to verify, whose other paths read the whole cache (and zero it first, the
        chunk's segment ids blocking its unwritten slots). Other calls keep query blocks or the
        plain path past ``max_queries``: with every key in use, 8 x 256 queries against 1,024
        keys with lengths, the key blocks took 83 / 293 ms forward / forward+backward against
        query blocks' 54 / 189 (64 queries: 19 / 131 against the plain path's 47 / 152). Steps of
        ``decode_step`` on a 768-wide, 12-head float32 layer (2-core AMD EPYC of family 26,
        ms a step, the automatic choice before / after): 32 tokens after 1,024 in about 9,300
        slots, batch 1 / 8: 27.7 / 2.8 and 221 / 16.7; 32 tokens after 7,000 in 8,000 slots:
        25.9 / 8.0 and 188 / 56; 128 tokens after 1,024 in 12,800 slots: 71 / 10.6 and 636 /
        90; 256 tokens from an empty cache of 13,144 slots, batch 8: 677 / 179; 1,024 tokens
        from an empty cache of 31,576 slots, batch 1: 335 / 166 (the steps' fills grow by T
        a step). Past ``max_queries`` tokens the plain-pass branch (past half the keys) is
        not taken: its logits would be ``(B*K, G*T, S)`` at once.
      min_blocks: ... when the keys make at least this many blocks.
    """

    name: str = "key_blocks"
    zeroes_blocked_keys = True  # each visited block's blocked keys and values are zeroed as it is read
    block_k: Optional[int] = None
    max_queries: int = 16
    keys_per_query: int = 4
    min_blocks: int = 4

    def __post_init__(self):
        for field in ("block_k", "max_queries", "keys_per_query", "min_blocks"):
            value = getattr(self, field)
            if value is not None:
                _checks.check_positive_int(f"KeyBlocks {field}", value)

    def supports(self, call) -> Optional[str]:
        reason = refuses_dropout_and_weights(call)
        if reason is None and call.mask.kv_lengths is None and not _masks_keys(call.mask):
            reason = ("calls without key/value lengths or a boolean mask over the keys (nothing bounds the keys "
                      "in use: use implementation='xla')")
        if reason is None and not isinstance(call.S, int):
            reason = "a symbolic key length"
        return reason

    def preferred(self, call) -> bool:
        # A symbolic query length (jax.export) is few only where its constraints say so.
        chunk = _checks.decided(lambda: call.T * self.keys_per_query <= call.S) and tuning.keys_stored_as() is not None
        few = _checks.decided(lambda: call.T <= self.max_queries) or chunk
        return bool(call.platform == "cpu" and few and call.S >= self.min_blocks * self._block_k(call))

    def _block_k(self, call) -> int:
        if tuning.keys_stored_as() == "blocks":  # the cache's own blocks
            return tuning.keys_block()
        if self.block_k is not None:
            return min(self.block_k, call.S)
        units = call.B * call.K if isinstance(call.B, int) else call.K
        per_key = units * (call.H + call.Hv) * jnp.dtype(call.dtype).itemsize
        c, budget = MIN_BLOCK, BLOCK_L2S * tuning.l2_cache_bytes()
        while c * 2 * per_key <= budget:
            c *= 2
        return min(c, call.S)

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        S, K, G, T = call.S, call.K, call.G, call.T
        B, H, Hv = query.shape[0], query.shape[-1], value.shape[-1]
        c = self._block_k(call)
        mask = call.mask
        in_use = keys_in_use(mask, S)
        plain = dataclasses.replace(call, return_residual=True)
        block_major = tuning.keys_stored_as() == "blocks"  # (S // c, B*K, c, H) seen through a transpose
        stored_as_units = numerics.keys_in_units_order(K) and not block_major
        # (B|1, S): keys some query may use (None: all, or lengths promised finite past them);
        # the others are zeroed in each visited block's keys and values, so that NaN or Inf
        # there cannot reach the result or a gradient through 0 * NaN
        visible = mask.key_visible()

        def all_keys(query, key, value):
            result = XLA()(plain, query, key, value, None)
            return result.out, result.lse

        U, R = B * K, G * T
        # block-major keys (S // c, B*K, c, .) from the (B, S, K, .) view the layer passes: the two
        # reshapes and transposes cancel, so XLA reads the stored array
        as_stored = lambda x: x.reshape(B, S // c, c, K, x.shape[-1]).transpose(1, 0, 3, 2, 4).reshape(
            S // c, U, c, x.shape[-1])
        if call.platform == "cpu" and R == 1 and tuning.ynnpack_fusions_off() and not block_major:
            form = "summed"
        elif numerics.reads_heads_in_place(call):
            form = "diagonal"
        else:
            form = "matmul"

        def by_blocks(query, key, value):
            q = numerics.group_queries(query, K).reshape(U, R, H)
            units = lambda x: jnp.swapaxes(x, 1, 2).reshape(U, x.shape[1], x.shape[-1])  # (B, s, K, .) -> (B*K, s, .)
            as_cut = form == "summed" and not stored_as_units  # products summed over each block as cut, (B, c, K, .)
            if block_major:  # the stored blocks, each (B*K, c, .) one contiguous piece, copied whole
                kb, vb = as_stored(key), as_stored(value)
                cut = lambda start: (kb[start // c], vb[start // c])
            elif stored_as_units:  # regrouped in place, then cut
                ku, vu = units(key), units(value)
                cut = lambda start: tuple(lax.dynamic_slice_in_dim(x, start, c, axis=1) for x in (ku, vu))
            else:  # cut as given (and regrouped in the same copy): the keys are not transposed whole
                regroup = {"summed": lambda x: x, "diagonal": lambda x: x.reshape(B, c, -1)}.get(form, units)
                cut = lambda start: tuple(regroup(lax.dynamic_slice_in_dim(x, start, c, axis=1)) for x in (key, value))
            if form == "diagonal":  # (B, K*R, K*H): unit (b, k)'s rows r at k*R + r, over its columns k*H ...
                q = numerics.diagonal_queries(q.reshape(B, K, R, H))
            acc = call.acc_dtype
            blocks = -(-in_use // c)
            rows = jnp.arange(B, dtype=jnp.int32)

            def visit(state, j):
                def step(state):
                    m, l, o = state
                    # block j holds keys [j c, j c + c); where that would pass S (S not a multiple
                    # of c) it is cut at [S - c, S) and the keys before j c, already visited, blocked
                    first = j * c
                    start = jnp.minimum(first, S - c) if S % c else first
                    kj, vj = cut(start)
                    if visible is not None:
                        seen = lax.dynamic_slice_in_dim(visible, start, c, axis=1)
                        kj, vj = (_zero_blocked(x, seen, B, K, form, as_cut) for x in (kj, vj))
                    s, allowed = _logits(call, mask, q, kj, rows, start, c, G, T, form)
                    if S % c:
                        allowed = allowed & (start + jnp.arange(c) >= first)
                    s = jnp.where(allowed, s, -jnp.inf)
                    # the running max only shifts exponents that the softmax cancels, so no
                    # derivative goes through it: JAX's derivative of a max finds the maxima by
                    # equality with logits that XLA may round differently where it recomputes
                    # them (seen at -O0 with a bias: no maximum found, 0 / 0 in forward mode)
                    m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True)))
                    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row with nothing allowed yet
                    p = jnp.exp(s - shift)
                    rescale = jnp.exp(m - shift)
                    if as_cut:  # (B, c, K, 1) x (B, c, K, Hv), summed over the block's keys
                        w = jnp.swapaxes(p.reshape(B, K, c), 1, 2)[..., None]
                        pv = jnp.sum(w * vj.astype(acc), axis=1).reshape(U, 1, Hv)
                    elif form == "summed":  # (U, 1, c) x (U, c, Hv): summed over the block's keys where they lie
                        pv = jnp.sum(p[..., None] * vj.astype(acc)[:, None], axis=2)
                    elif form == "diagonal":  # (B, K*R, c) x (B, c, K*Hv), then each unit's own columns
                        pv = numerics.diagonal_values(p.reshape(B, K * R, c), vj, K, call.precision, acc)
                        pv = pv.reshape(U, R, Hv)
                    else:  # the one-row matmul, not the CPU two-row form: blocks are shorter than ONE_ROW_PAD_KEYS
                        pv = numerics.weighted_values(p, vj, call.precision, acc)
                    return m_new, l * rescale + jnp.sum(p, axis=-1, keepdims=True), o * rescale + pv
                return lax.cond(j < blocks, step, lambda state: state, state), None

            start = (jnp.full((U, R, 1), -jnp.inf, acc), jnp.zeros((U, R, 1), acc), jnp.zeros((U, R, Hv), acc))
            (m, l, o), _ = lax.scan(visit, start, jnp.arange(-(-S // c), dtype=jnp.int32))
            return _normalized(m, l, o, query.dtype, B, K, G, T)

        def all_blocks(query, key, value):
            """Every block of block-major keys where it lies, in one pass: the logits and the
            weighted values as matmuls batched over (block, unit), so that no block is copied."""
            acc, n = call.acc_dtype, S // c
            q = numerics.group_queries(query, K).reshape(U, R, H)
            kb, vb = as_stored(key), as_stored(value)
            qb = jnp.broadcast_to(q, (n,) + q.shape)
            if R == 1:
                raw = lax.dot_general(qb, kb, (((3,), (3,)), ((0, 1), (0, 1))),
                                      precision=call.precision, preferred_element_type=acc)  # (n, U, R, c)
            else:  # keys-major, as numerics.key_logits takes for a few rows over many keys per unit,
                # which its rule does not see here (128-key blocks); rows-major, a step with 6 rows a
                # unit at batch 8 over 8,192 keys took 19.8 ms (benchmarks.decode), keys-major 5.3 ms
                # (timed apart), AMD EPYC family 26: (n, U, c, R), then regrouped
                raw = lax.optimization_barrier(lax.dot_general(kb, qb, (((3,), (3,)), ((0, 1), (0, 1))),
                                                               precision=call.precision, preferred_element_type=acc))
                raw = jnp.swapaxes(raw, 2, 3)
            raw = jnp.moveaxis(raw, 0, 2).reshape(U, R, S)
            s, allowed = _finished(call, mask, raw, jnp.arange(B, dtype=jnp.int32), 0, S, T)
            s = jnp.where(allowed, s, -jnp.inf)
            m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))  # as in the blocks: the softmax cancels it
            p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
            l = jnp.sum(p, axis=-1, keepdims=True)
            pb = jnp.moveaxis(p.reshape(U, R, n, c), 2, 0).reshape(n * U, R, c)  # (block, unit) batches
            o = numerics.weighted_values(pb, vb.reshape(n * U, c, -1), call.precision, acc, call.platform)
            o = jnp.sum(o.reshape(n, U, R, -1), axis=0)
            return _normalized(m, l, o, query.dtype, B, K, G, T)

        if (stored_as_units or form == "diagonal") and visible is None and T <= self.max_queries and not block_major:
            # past half the keys, one pass where they lie is cheaper
            out, lse = lax.cond(2 * in_use > S, all_keys, by_blocks, query, key, value)
        elif block_major and visible is None and T <= self.max_queries:
            out, lse = lax.cond(2 * in_use > S, all_blocks, by_blocks, query, key, value)
        else:  # blocks copy only the keys in use (the plain pass would transpose, zero or hold (B*K, G*T, S) logits of all)
            out, lse = by_blocks(query, key, value)
        return Result(out=out, lse=lse if call.return_residual else None)


def _normalized(m, l, o, dtype, B: int, K: int, G: int, T: int):
    """The output ``(B, T, N, Hv)`` and log-sum-exp ``(B, T, N)`` from a softmax's running max
    ``m``, sum ``l`` and weighted values ``o`` over units; rows with nothing allowed give zeros
    and ``-inf``."""
    some = l > 0
    o = jnp.where(some, o / jnp.where(some, l, 1.0), 0.0)
    lse = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)
    back = lambda x: numerics.ungroup(x.reshape(B, K, G, T, x.shape[-1]))
    return back(o).astype(dtype), back(lse)[..., 0]


def keys_in_use(mask, S: int):
    """An int32 scalar: the keys at or past it are blocked for every row, by the key/value
    lengths, else by what a boolean mask's columns (and negative key segment ids) leave
    visible: one past the last key some query may use, 0 if none."""
    if mask.kv_lengths is not None:
        return jnp.max(jnp.minimum(mask.kv_lengths, S)).astype(jnp.int32)
    columns = jnp.any(mask.key_visible(), axis=0)  # (S,)
    return jnp.max(jnp.where(columns, jnp.arange(1, S + 1, dtype=jnp.int32), 0))


def _masks_keys(mask) -> bool:
    """Whether ``mask`` holds a boolean mask with a key axis, whose last allowed key bounds the
    keys in use (a padding mask over a cache, ``(B, 1, 1, S)``)."""
    return mask.dense is not None and mask.dense.shape[3] != 1


def _zero_blocked(vj, visible, B: int, K: int, form: str, as_cut: bool):
    """A block's keys or values with the slots no query may use zeroed; ``visible`` ``(B|1,
    c)``, the block in its form's frame: ``(B, c, K*Hv)`` (diagonal), ``(B, c, K, Hv)`` (as cut), else
    units ``(B*K, c, Hv)``."""
    if form == "diagonal":
        keep = visible[:, :, None]
    elif as_cut:
        keep = visible[:, :, None, None]
    else:
        keep = jnp.repeat(jnp.broadcast_to(visible, (B,) + visible.shape[1:]), K, axis=0)[:, :, None]
    return lax.select(jnp.broadcast_to(keep, vj.shape), vj, jnp.zeros_like(vj))


def _logits(call, mask, q, kj, rows, start, c: int, G: int, T: int, form: str):
    """Every unit's finished logits ``(U, G*T, c)`` against keys ``[start, start + c)`` and what
    the mask description allows there, asked of it once per batch row (all N heads together).
    ``form``: ``'matmul'``; ``'summed'``, products summed over the head dim (one row per unit);
    ``'diagonal'``, block-diagonal queries ``(B, K*G*T, K*H)`` against the block as cut,
    ``(B, c, K*H)``."""
    summed = form == "summed"
    if form == "diagonal":
        raw = numerics.diagonal_logits(q, kj, call.precision, call.acc_dtype)
        raw = raw.reshape(raw.shape[0] * raw.shape[1] // (G * T), G * T, c)
    elif summed and kj.ndim == 4:  # a block as cut, (B, c, K, H): one row per unit
        acc = call.acc_dtype
        Bk, _, K, H = kj.shape
        raw = jnp.sum(q.astype(acc).reshape(Bk, 1, K, H) * kj.astype(acc), axis=-1)  # (B, c, K)
        raw = jnp.swapaxes(raw, 1, 2).reshape(Bk * K, 1, c)
    elif summed:
        acc = call.acc_dtype
        raw = jnp.sum(q.astype(acc)[:, :, None, :] * kj.astype(acc)[:, None], axis=-1)
    else:
        raw = jnp.einsum("urh,ukh->urk", q, kj, precision=call.precision, preferred_element_type=call.acc_dtype)
    return _finished(call, mask, raw, rows, start, c, T)


def _finished(call, mask, raw, rows, start, c: int, T: int):
    """Raw logits ``(U, G*T, c)`` against keys ``[start, start + c)`` finished (scale, soft-cap,
    bias, score rules) and what the mask description allows there."""
    N = call.N

    def row(b, raw):
        s = numerics.finish_logits(_Scale(call.scale, call.softcap), raw, mask.block_bias(b, (0, N), 0, T, start, c))
        s = mask.block_scores(s, b, (0, N), 0, T, start, c)
        return s, jnp.broadcast_to(mask.block(b, (0, N), 0, T, start, c), (N, T, c))

    # units (b, k) hold heads k*G .. k*G + G - 1: (B*K, G*T, c) is (B, N, T, c) in the same order
    s, allowed = jax.vmap(row)(rows, raw.reshape(rows.shape[0], N, T, c))
    return s.reshape(raw.shape), allowed.reshape(raw.shape)


@dataclasses.dataclass(frozen=True)
class _Scale:
    """What :func:`flax_attn.core.numerics.finish_logits` needs of a call, without its mask (the
    score_mod is applied block by block)."""

    scale: float
    softcap: Optional[float]
