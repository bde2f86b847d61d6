"""Blockwise (flash-style) attention in pure JAX: memory linear in the sequence length.

For each (batch row, key/value head) -- a *unit* -- and each block of queries, the key/value
blocks are visited with an online softmax (running maximum m, normaliser l, accumulator):

    m' = max(m, rowmax(s)),   l' = l e^(m - m') + rowsum(e^(s - m')),   acc' = acc e^(m - m') + e^(s - m') V

so the T x S weights are never stored. The mask description classifies every block as empty
(skipped), full (computed without a mask) or partial (masked).

**Parallelism.** The units may be split into ``streams`` runs (default 1; None: one per core), each an
independent loop, which a runtime may run concurrently (XLA's CPU runtime in JAX 0.10 runs
them one after another: on an idle 2-core CPU four independent loops took 3.8 times as long
as one); within a run, ``unit_chunk``
units may be computed together as one batched step (a block is then skipped only if it is
empty for all of them, and masked if it is partial for any). Tile sizes default to the
largest square tile whose logits fit the L2 caches of two cores (:mod:`flax_attn.core.tuning`):
steps large enough for XLA to spread each matmul over the cores.
The forward visits, for each query block, only the key blocks from the first to the last
non-empty one; a power-of-two scale (1/8 for 64-dim heads) is applied to the queries before
the loops, which gives the same logits bit for bit and saves a pass over every block.
The per-unit step is written once and ``jax.vmap``-ed over a chunk, so each unit still asks
the mask description for its own block.

**Derivatives.** The function is a ``jax.custom_jvp`` whose tangent rule is itself blockwise.
With ``p = e^(s - m) / l`` recomputed from the saved ``m`` and ``l`` and ``ds`` the tangent of
the logits,

    out' = sum_j p_j (v'_j + ds_j v_j) - c out,    c = sum_j p_j ds_j   (the tangent of the lse)

Forward mode (``jax.jvp``, ``jax.jacfwd``) runs this pass; reverse mode is JAX's transpose of
it, which is FlashAttention-2's backward (Dao 2023): ``dv += p^T do``, ``ds = p (do.v - do.out)``.
The tangent pass loops over blocks with static bounds and recomputes every block inside
``jax.checkpoint``, so both directions keep memory linear in the length, and every order of
derivative (grad of grad, Hessians) is ordinary JAX. Recomputing ``p`` from ``s - m`` (not
from ``s - lse``) keeps gradients as accurate as the plain path's at extreme logits.

**Reverse mode of vmap.** The tangent pass picks each block's kind with a ``lax.switch`` whose
operands include tangents. Under ``jax.vmap`` with per-example lengths, segment ids or
positions, the index is batched and JAX (0.10) turns the switch into a select over every
branch, wrapping each operand in ``lax.stop_gradient``, which has no transpose rule: reverse
mode of the vmapped function then fails to transpose (JAX's issues #22011 and #39219). This
module registers the rule that ``stop_gradient``'s own derivative implies (a zero cotangent, as
its tangent is zero), only where JAX has none (:func:`_transpose_stop_gradient`).

A dense ``bias`` or boolean mask given by the caller is the only T x S array; causal and window
masks, positions, segment ids and lengths are evaluated block by block.
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
from flax_attn.core.mask import EMPTY, FULL, PARTIAL
from flax_attn.core.registry import Implementation, Result, refuses_dropout_and_weights


ACCELERATOR_STEP_BYTES = 128 << 20


def _transpose_stop_gradient() -> None:
    """Give ``lax.stop_gradient`` a transpose rule where JAX has none: its cotangent is zero, as
    its tangent is. Reverse mode of a vmapped blockwise call with batched mask arrays transposes
    the ``stop_gradient`` that JAX's batching of ``lax.switch`` puts on tangent operands of the
    branches not taken (see the module docstring); the selected branch gets the operand itself."""
    from jax.interpreters import ad

    if lax.stop_gradient_p not in ad.primitive_transposes:
        ad.primitive_transposes[lax.stop_gradient_p] = lambda ct, x: [ad.Zero(x.aval)]


_transpose_stop_gradient()
"""On a GPU or TPU, the default ``unit_chunk`` takes as many units a step as keep the step's
logits (units x query heads per unit x ``block_q`` x ``block_k``) within this many bytes: 128
units of multi-head float32 attention at tiles of 512 x 512. Not measured on a device (none
was available); on CPU the path runs one unit a step."""


@dataclasses.dataclass(frozen=True)
class Blockwise(Implementation):
    """Flash-style attention; no dropout, no returned weights.

    Fields are the tuning knobs; every setting computes the same function. The derivative
    passes use the forward's blocks, so that they recompute bit for bit the logits the forward
    saw (at logits of 6e4 one rounding step of a logit moves a weight by 0.4%, and gradients
    are differences of weights).

    Fields:
      block_q, block_k: the tile of queries x keys visited per step. None: the largest square
        tile whose logits over a unit's query heads fit the L2 caches of two cores, at most an
        eighth of padding (:func:`flax_attn.core.tuning.blockwise_tiles`; 512 x 512 for
        multi-head float32 attention on a 1 MiB L2, 256 x 256 with 6 query heads per key/value
        head). A call that is not differentiated takes larger tiles where they pad the lengths
        alike (:func:`flax_attn.core.tuning.blockwise_forward_tiles`: 1,024 x 1,024 and 512 x
        512 there); derivatives keep these, so that their passes recompute the forward's logits
        bit for bit.
      unit_chunk: how many (batch row, key/value head) units one step computes together (one
        batched matmul over them); the largest divisor of B*K up to this. None: one unit a step
        on CPU (more gave no speed-up there: XLA spreads each matmul over the cores already);
        on a GPU or TPU, as many units as keep a step's logits within
        :data:`ACCELERATOR_STEP_BYTES` (every unit, for most calls), so that a step is one
        launch over the batch and the heads rather than one per unit.
      streams: the units split into this many independent loops, which a runtime may run
        concurrently (default 1: XLA's CPU runtime in JAX 0.10 runs them one after another);
        None: the cores this process may use (:func:`flax_attn.core.tuning.cpu_cores`).
      min_length: the automatic choice takes it on CPU once T and S reach this.
    """

    name: str = "blockwise"
    block_q: Optional[int] = None
    block_k: Optional[int] = None
    unit_chunk: Optional[int] = None
    streams: Optional[int] = 1
    min_length: int = 128         # the automatic choice takes it on CPU once T and S reach this

    def __post_init__(self):
        for field in ("block_q", "block_k", "unit_chunk", "streams"):
            value = getattr(self, field)
            if value is not None:
                _checks.check_positive_int(f"Blockwise {field}", value)

    def supports(self, call) -> Optional[str]:
        return refuses_dropout_and_weights(call)

    def preferred(self, call) -> bool:
        # Measured on a 2-core AVX-512 CPU (causal, 64-dim heads), forward / forward+backward
        # speed-up over the plain path: 8192 tokens in 8 x 12 heads: 0.71x / 0.77x at 32 tokens a
        # sequence, 1.23x / 1.06x at 64, 1.97x / 1.44x at 128. On GPUs the plain path or a fused
        # kernel is chosen instead. A symbolic length (jax.export) whose constraints do not
        # bound it below min_length may be any length: blockwise serves them all in linear memory.
        short = _checks.decided(lambda: call.T < self.min_length or call.S < self.min_length)
        return call.platform == "cpu" and not short

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        spec = _Spec.of(call, self)
        mask = call.mask.padded(spec.Tp, spec.Sp)
        if numerics.scale_is_exact(spec.scale, query.dtype):
            # (scale q) . k is scale (q . k) bit for bit: the blocks then skip one pass over their logits
            query = query * jnp.asarray(spec.scale, query.dtype)
            spec = dataclasses.replace(spec, scale=1.0)
        qu, ku, vu = _to_units(spec, query, key, value)
        leaves, treedef = jax.tree_util.tree_flatten(mask)
        ou, m, l = _attention(spec, spec.undifferentiated(call, self), treedef, qu, ku, vu, *leaves)
        out = _from_units(spec, ou).astype(query.dtype)
        lse = None
        if call.return_residual:
            lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            lse = _from_units(spec, lse[..., None])[..., 0]
        return Result(out=out, lse=lse)


class BlockedLengths:
    """For a dataclass with lengths ``T``, ``S`` and blocks ``bq``, ``bk``: the lengths padded to
    whole blocks, ``Tp`` and ``Sp`` (the blockwise path's and the ring's)."""

    @property
    def Tp(self):
        return -(-self.T // self.bq) * self.bq

    @property
    def Sp(self):
        return -(-self.S // self.bk) * self.bk


@dataclasses.dataclass(frozen=True)
class _Spec(BlockedLengths):
    """Static facts of one blockwise call."""

    scale: float
    softcap: Optional[float]
    precision: object
    T: int
    S: int
    K: int
    G: int
    bq: int
    bk: int
    chunk: int
    streams: int
    platform: str

    @classmethod
    def of(cls, call, impl: Blockwise) -> "_Spec":
        tq, tk = tuning.blockwise_tiles(call.T, call.S, call.G, jnp.dtype(call.acc_dtype).itemsize)
        given = lambda block, length: block if not isinstance(length, int) else min(length, block)  # noqa: E731
        bq = tq if impl.block_q is None else given(impl.block_q, call.T)  # a symbolic length: padded to blocks
        bk = tk if impl.block_k is None else given(impl.block_k, call.S)
        return cls(call.scale, call.softcap, call.precision, call.T, call.S, call.K, call.G, bq, bk,
                   _unit_chunk(call, impl, bq, bk),
                   tuning.cpu_cores() if impl.streams is None else impl.streams, call.platform)

    def undifferentiated(self, call, impl: Blockwise) -> "_Spec":
        """This spec with the tiles of a call that is not differentiated
        (:func:`flax_attn.core.tuning.blockwise_forward_tiles`), where neither tile was given and
        they pad the lengths as this spec's do; else this spec."""
        fq, fk = tuning.blockwise_forward_tiles(call.T, call.S, call.G, jnp.dtype(call.acc_dtype).itemsize)
        if impl.block_q is not None or impl.block_k is not None or (fq, fk) == (self.bq, self.bk):
            return self
        forward = dataclasses.replace(self, bq=fq, bk=fk, chunk=_unit_chunk(call, impl, fq, fk))
        return forward if (forward.Tp, forward.Sp) == (self.Tp, self.Sp) else self


def _unit_chunk(call, impl: Blockwise, bq: int, bk: int) -> int:
    """Units a step: ``impl.unit_chunk`` if given, else 1 on CPU and elsewhere as many as keep a
    step's logits at tiles ``bq x bk`` within :data:`ACCELERATOR_STEP_BYTES`."""
    chunk = impl.unit_chunk
    if chunk is None:
        step_bytes = call.G * bq * bk * jnp.dtype(call.acc_dtype).itemsize
        chunk = 1 if call.platform == "cpu" else max(1, ACCELERATOR_STEP_BYTES // step_bytes)
    return tuning.unit_chunk(call.B, call.K, chunk)


def _to_units(spec, q, k, v):
    """(B, T, N, H) -> (B*K, G, Tp, H); (B, S, K, H) -> (B*K, Sp, H); zero-padded to whole blocks."""
    B = q.shape[0]
    q = jnp.pad(q, ((0, 0), (0, spec.Tp - spec.T), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, spec.Sp - spec.S), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, spec.Sp - spec.S), (0, 0), (0, 0)))
    qu = numerics.group_queries(q, spec.K).reshape(B * spec.K, spec.G, spec.Tp, q.shape[-1])
    units = lambda x: x.transpose(0, 2, 1, 3).reshape(B * spec.K, spec.Sp, x.shape[-1])
    return qu, units(k), units(v)


def _from_units(spec, x):
    """(B*K, G, Tp, Hv) -> (B, T, N, Hv)."""
    x = x.reshape(-1, spec.K, spec.G, spec.Tp, x.shape[-1])
    return numerics.ungroup(x)[:, : spec.T]


def _block_logits(spec, mask, u, qi, kj, i, j, bk, masked):
    """Logits of query block i against key block j (of size bk) for unit u: (G, bq, bk)."""
    acc = jnp.promote_types(qi.dtype, jnp.float32)
    b, heads = u // spec.K, ((u % spec.K) * spec.G, spec.G)
    raw = jnp.einsum("gqh,kh->gqk", qi, kj, precision=spec.precision, preferred_element_type=acc)
    s = numerics.finish_logits(spec, raw, mask.block_bias(b, heads, i * spec.bq, spec.bq, j * bk, bk))
    s = mask.block_scores(s, b, heads, i * spec.bq, spec.bq, j * bk, bk)  # a user's score_mod, if any
    if masked:
        s = jnp.where(mask.block(b, heads, i * spec.bq, spec.bq, j * bk, bk), s, -jnp.inf)
    return s


def _kind(spec, mask, u, i, j, bk):
    b, heads = u // spec.K, ((u % spec.K) * spec.G, spec.G)
    return mask.block_kind(b, heads, i * spec.bq, spec.bq, j * bk, bk)


def _chunk_kind(spec, mask, uc, i, j, bk):
    """The kind of block (i, j) for a chunk of units ``uc`` (C,): EMPTY if it is empty for every
    unit, FULL if full for every unit, else PARTIAL (the mask then blocks what each unit may not see)."""
    kinds = jax.vmap(lambda u: _kind(spec, mask, u, i, j, bk))(uc)
    return jnp.where(jnp.all(kinds == EMPTY), EMPTY, jnp.where(jnp.all(kinds == FULL), FULL, PARTIAL))


def _chunked(spec, *xs):
    """(U, ...) -> (U // C, C, ...): the units in chunks of ``spec.chunk``, computed together."""
    return tuple(x.reshape((-1, spec.chunk) + x.shape[1:]) for x in xs)


def _unchunked(*xs):
    return tuple(x.reshape((-1,) + x.shape[2:]) for x in xs)


def _map_units(spec, f, xs):
    """``f`` over the units in chunks of ``spec.chunk``, as ``spec.streams`` independent loops
    over consecutive runs of chunks (XLA's CPU runtime runs independent loops concurrently,
    on the threads of its pool)."""
    chunks = _chunked(spec, *xs)
    n = chunks[0].shape[0]
    P = min(spec.streams, n) if isinstance(n, int) else 1  # a symbolic batch: one loop
    if P == 1:
        return _unchunked(*lax.map(f, chunks))
    edges = [round(p * n / P) for p in range(P + 1)]
    parts = [lax.map(f, tuple(x[a:b] for x in chunks)) for a, b in zip(edges[:-1], edges[1:])]
    return _unchunked(*(jnp.concatenate(outs, axis=0) for outs in zip(*parts)))


def _forward(spec, mask, qu, ku, vu):
    """Online softmax over every unit: out (U, G, Tp, Hv), m and l (U, G, Tp)."""
    G, bq, bk = spec.G, spec.bq, spec.bk
    acc_t = jnp.promote_types(qu.dtype, jnp.float32)

    def update(i, j, masked):
        """Key block j for one unit's query block i: the online-softmax update of its (G, bq) rows."""
        def f(u, qi, k, v, m, l, acc):
            kj = lax.dynamic_slice_in_dim(k, j * bk, bk)
            vj = lax.dynamic_slice_in_dim(v, j * bk, bk)
            s = _block_logits(spec, mask, u, qi, kj, i, j, bk, masked)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            pv = jnp.einsum("gqk,kh->gqh", p.astype(v.dtype), vj, precision=spec.precision,
                            preferred_element_type=acc_t)
            return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv
        return f

    def chunk(args):
        uc, q, k, v = args  # (C,), (C, G, Tp, H), (C, Sp, H), (C, Sp, Hv)

        def q_block(i):
            qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=2)

            def visit(masked):
                def f(j, state):
                    return jax.vmap(update(i, j, masked))(uc, qi, k, v, *state)
                return f

            def body(j, state):
                return lax.switch(_chunk_kind(spec, mask, uc, i, j, bk),
                                  [lambda j, st: st, visit(False), visit(True)], j, state)

            C = uc.shape[0]
            state = (jnp.full((C, G, bq), -jnp.inf, acc_t), jnp.zeros((C, G, bq), acc_t),
                     jnp.zeros((C, G, bq, v.shape[-1]), acc_t))
            # only the key blocks from the first to the last non-empty one are visited
            nk = spec.Sp // bk
            seen = jax.vmap(lambda j: _chunk_kind(spec, mask, uc, i, j, bk))(jnp.arange(nk)) != EMPTY
            lo = jnp.argmax(seen)
            hi = jnp.where(jnp.any(seen), nk - jnp.argmax(seen[::-1]), lo)
            m, l, acc = lax.fori_loop(lo, hi, body, state)
            out = acc / jnp.where(l == 0, 1.0, l)[..., None]
            return out, jnp.where(l > 0, m, 0.0), l

        out, m, l = lax.map(q_block, jnp.arange(spec.Tp // bq))
        join = lambda x: jnp.moveaxis(x, 0, 2).reshape(x.shape[1:3] + (spec.Tp,) + x.shape[4:])
        return join(out).astype(q.dtype), join(m), join(l)

    units = jnp.arange(qu.shape[0], dtype=jnp.int32)
    return _map_units(spec, chunk, (units, qu, ku, vu))


KEYS_MAJOR_MIN_TILE = 128
"""On CPU, tiles of at least this many queries and keys write the keys' tangent term keys-major
(:func:`flax_attn.core.numerics.keys_major_product`): reverse mode then computes each block's key
gradient as ``(q^T ds)^T`` from a small transposed copy of the queries, where the plain form
had XLA write ``ds^T``, a transposed copy of the whole block, before its matmul. Measured
forward+backward on a 2-core AMD EPYC (family 26), causal, float32, 64-dim heads, in turns in
one process: 1 x 8 heads, 4,096 tokens 0.481 -> 0.385 s, 8,192 tokens 1.85 -> 1.38 s; 12 query
heads over 2, 4,096 tokens 0.588 -> 0.425 s; 8 x 12 heads, 1,024 tokens 0.522 -> 0.433 s; tiles
of 128 (1 x 8 x 1,024) 0.049 -> 0.041 s; tiles of 64: 0.056 -> 0.060 s (slower), hence 128."""


def _tangent(spec, mask, mask_dot, qu, ku, vu, m, l, ou, qd, kd, vd):
    """The blockwise tangent: (out', c) per unit, c = sum_j p_j ds_j (the tangent of the lse).

    Key blocks are scanned as sequences (not sliced from loop constants), and both loop bodies
    are recomputed in the transposed pass (``jax.checkpoint``): reverse mode then stores nothing
    per block and accumulates each key block's gradient once per query block. On CPU, from
    tiles of :data:`KEYS_MAJOR_MIN_TILE` on, the keys' tangent enters through
    :func:`flax_attn.core.numerics.keys_major_product`.
    """
    G, bq, bk = spec.G, spec.bq, spec.bk
    nk = spec.Sp // bk
    keys_major = spec.platform == "cpu" and min(bq, bk) >= KEYS_MAJOR_MIN_TILE
    acc_t = jnp.promote_types(qu.dtype, jnp.float32)
    mm = functools.partial(jnp.einsum, precision=spec.precision, preferred_element_type=acc_t)
    inv_l = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
    blocks = lambda x: jnp.moveaxis(x.reshape((x.shape[0], nk, bk) + x.shape[2:]), 1, 0)  # (nk, C, bk, ...)

    def visit(i, masked):
        """Key block j for one unit's query block i: its part of (out', c)."""
        def f(u, qi, qdi, mi, ili, j, kj, vj, kdj, vdj):
            b, heads = u // spec.K, ((u % spec.K) * G, G)
            s = _block_logits(spec, mask, u, qi, kj, i, j, bk, masked)
            p = jnp.exp(s - mi[..., None]) * ili[..., None]
            if keys_major:
                keys_term = numerics.keys_major_product(qi.reshape(G * bq, -1), kdj, spec.precision, acc_t,
                                                        rows_out=False).reshape(G, bq, bk)
            else:
                keys_term = mm("gqh,kh->gqk", qi, kdj)
            ds = (mm("gqh,kh->gqk", qdi, kj) + keys_term) * jnp.asarray(spec.scale, acc_t)
            if spec.softcap is not None:
                raw = mm("gqh,kh->gqk", qi, kj) * jnp.asarray(spec.scale, acc_t)
                ds = ds * (1.0 - jnp.tanh(raw / spec.softcap) ** 2)
            bias_d = mask_dot.block_bias(b, heads, i * bq, bq, j * bk, bk)
            if bias_d is not None:
                ds = ds + bias_d.astype(acc_t)
            ds = mask.block_scores_jvp(mask_dot, spec, qi, kj, ds, b, heads, i * bq, bq, j * bk, bk)
            pds = p * ds
            a = mm("gqk,kh->gqh", p.astype(vdj.dtype), vdj) + mm("gqk,kh->gqh", pds.astype(vj.dtype), vj)
            return a, jnp.sum(pds, axis=-1)
        return f

    def chunk(args):
        uc, q, k, v, m_u, il_u, o_u, q_d, k_d, v_d = args  # C units each
        C = uc.shape[0]

        @jax.checkpoint
        def q_block(i):
            sl = lambda x: lax.dynamic_slice_in_dim(x, i * bq, bq, axis=2)
            qi, qdi, mi, ili = sl(q), sl(q_d), sl(m_u), sl(il_u)

            def run(masked):
                def f(j, kj, vj, kdj, vdj):
                    return jax.vmap(visit(i, masked), in_axes=(0, 0, 0, 0, 0, None, 0, 0, 0, 0))(
                        uc, qi, qdi, mi, ili, j, kj, vj, kdj, vdj)
                return f

            def zero(*_):
                return jnp.zeros((C, G, bq, v.shape[-1]), acc_t), jnp.zeros((C, G, bq), acc_t)

            @jax.checkpoint
            def body(carry, xs):
                j = xs[0]
                a, c = lax.switch(_chunk_kind(spec, mask, uc, i, j, bk), [zero, run(False), run(True)], *xs)
                return (carry[0] + a, carry[1] + c), None

            (a, c), _ = lax.scan(body, zero(), (jnp.arange(nk), blocks(k), blocks(v), blocks(k_d), blocks(v_d)))
            return a - c[..., None] * sl(o_u).astype(acc_t), c

        od, c = lax.map(q_block, jnp.arange(spec.Tp // bq))
        join = lambda x: jnp.moveaxis(x, 0, 2).reshape(x.shape[1:3] + (spec.Tp,) + x.shape[4:])
        return join(od), join(c)

    units = jnp.arange(qu.shape[0], dtype=jnp.int32)
    return _map_units(spec, chunk, (units, qu, ku, vu, m, inv_l, ou, qd, kd, vd))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _attention(spec, primal_spec, treedef, qu, ku, vu, *leaves):
    """The blockwise attention of the units: ``primal_spec``'s tiles where the call is not
    differentiated, ``spec``'s in the forward and tangent passes of a derivative (which then
    recompute the forward's logits bit for bit). Both pad the lengths alike."""
    return _forward(primal_spec, jax.tree_util.tree_unflatten(treedef, leaves), qu, ku, vu)


@_attention.defjvp
def _attention_jvp(spec, primal_spec, treedef, primals, tangents):
    qu, ku, vu, *leaves = primals
    qd, kd, vd, *leaves_dot = tangents
    ou, m, l = _attention(spec, spec, treedef, qu, ku, vu, *leaves)
    mask = jax.tree_util.tree_unflatten(treedef, leaves)
    mask_dot = mask.with_tangents(jax.tree_util.tree_unflatten(treedef, leaves_dot))
    od, c = _tangent(spec, mask, mask_dot, qu, ku, vu, m, l, ou, qd, kd, vd)
    return (ou, m, l), (od.astype(ou.dtype), jnp.zeros_like(m), c * l)
