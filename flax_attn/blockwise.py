"""Blockwise (flash-style) attention in pure JAX: memory linear in the sequence length.

For each (batch, key/value head) in turn and each block of queries, the key/value blocks are
visited with an online softmax (running maximum m, normaliser l, accumulator):

    m' = max(m, rowmax(s)),   l' = l e^(m - m') + rowsum(e^(s - m')),   acc' = acc e^(m - m') + e^(s - m') V

so the T x S weights are never stored. Blocks that a causal or window mask removes entirely
are not visited (the range of blocks is found by interval arithmetic on positions), and
blocks it keeps entirely are computed without building a mask. Working one head at a time
keeps each block in cache, which is what makes this fast on CPUs.

The backward pass is a custom VJP that recomputes each block's weights from the saved
log-sum-exp (FlashAttention-2's scheme, Dao 2023): outer loop over key blocks accumulating
dK and dV, inner loop over the query blocks that see them, dQ carried along. Memory stays
linear forward and backward; a dense ``bias`` or ``mask`` given by the caller is the only
T x S array, and the gradient of a bias is returned in its own (broadcast) shape.

Called through :func:`flax_attn.dot_product_attention` (``implementation='blockwise'``),
which validates inputs; this module assumes valid 4-D inputs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_FAR = 1 << 28  # "no limit" for window arithmetic on int32 positions

# Block sizes: on a 2-core AVX-512 CPU with 64-dim heads, 512 x 512 was fastest forward and
# 512 x 256 backward (benchmarks/). The backward uses the smaller key block when it divides the
# forward's.
BLOCK_Q = 512
BLOCK_K = 512
BLOCK_K_BACKWARD = 256


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Static description of one blockwise call."""

    T: int
    S: int
    block_q: int
    block_k: int
    G: int                      # query heads per key/value head
    scale: float
    softcap: Optional[float]
    lower: int                  # a query at p may see keys in [p - lower, p + upper]
    upper: int
    static_positions: bool      # positions are the defaults: block ranges are known statically
    dynamic_masking: bool       # segments, lengths or a dense mask: every visited block is masked
    precision: Any

    @property
    def Tp(self):
        return -(-self.T // self.block_q) * self.block_q

    @property
    def Sp(self):
        return -(-self.S // self.block_k) * self.block_k

    @property
    def offset(self):  # default query positions are t + S - T
        return self.S - self.T


def _partner_blocks(own_min, own_max, minus, plus, base, block, n, n_full):
    """Blocks of partner positions ``base + x*block + [0, block)`` for own positions in
    [own_min, own_max], where own position p may pair with partner positions [p - minus, p + plus].

    Returns ``(lo, full_lo, full_hi, hi)``: blocks in [lo, hi) meet some allowed pair, blocks in
    [full_lo, full_hi) are allowed for every own position (and lie below ``n_full``).
    """
    union_lo, union_hi = own_min - minus, own_max + plus
    inter_lo, inter_hi = own_max - minus, own_min + plus
    lo = jnp.clip((union_lo - base) // block, 0, n)
    hi = jnp.clip((union_hi - base) // block + 1, lo, n)
    full_lo = jnp.clip(-((base - inter_lo) // block), lo, hi)
    cap = jnp.maximum(full_lo, jnp.minimum(hi, n_full))  # never below full_lo: no block is visited twice
    full_hi = jnp.clip((inter_hi - base + 1) // block, full_lo, cap)
    return lo, full_lo, full_hi, hi


class _Unit:
    """The per-(batch, kv head) view of the masking inputs, and block masks built from them."""

    def __init__(self, spec: _Spec, aux, b, kh):
        self.spec = spec
        q_pos, k_pos, q_seg, k_seg, q_len, kv_len, mask = aux
        row = lambda a: None if a is None else a[b if a.shape[0] > 1 else 0]
        self.q_pos, self.k_pos = row(q_pos), row(k_pos)
        self.q_seg, self.k_seg = row(q_seg), row(k_seg)
        self.q_len, self.kv_len = row(q_len), row(kv_len)
        self.mask = None
        if mask is not None:  # (bb, bn, Tp, Sp) -> (G or 1, Tp, Sp)
            mask = mask[b if mask.shape[0] > 1 else 0]
            self.mask = lax.dynamic_slice_in_dim(mask, kh * spec.G, spec.G, 0) if mask.shape[0] > 1 else mask

    def block_mask(self, i, j):
        """Boolean ``(1 or G, bq, bk)``: which (query, key) pairs of block (i, j) may attend."""
        s = self.spec
        qi = i * s.block_q + jnp.arange(s.block_q)
        kj = j * s.block_k + jnp.arange(s.block_k)
        allowed = (kj < s.S)[None, :]
        if s.lower < _FAR or s.upper < _FAR:
            qp = qi + s.offset if self.q_pos is None else lax.dynamic_slice_in_dim(self.q_pos, i * s.block_q, s.block_q)
            kp = kj if self.k_pos is None else lax.dynamic_slice_in_dim(self.k_pos, j * s.block_k, s.block_k)
            delta = qp[:, None] - kp[None, :]
            allowed = allowed & (delta <= s.lower) & (delta >= -s.upper)
        if self.q_len is not None:
            allowed = allowed & (qi < self.q_len)[:, None]
        if self.kv_len is not None:
            allowed = allowed & (kj < self.kv_len)[None, :]
        if self.q_seg is not None:
            qs = lax.dynamic_slice_in_dim(self.q_seg, i * s.block_q, s.block_q)
            ks = lax.dynamic_slice_in_dim(self.k_seg, j * s.block_k, s.block_k)
            allowed = allowed & (qs[:, None] == ks[None, :]) & (ks >= 0)[None, :]
        allowed = allowed[None]
        if self.mask is not None:
            allowed = allowed & lax.dynamic_slice(self.mask, (0, i * s.block_q, j * s.block_k),
                                                  (self.mask.shape[0], s.block_q, s.block_k))
        return allowed

    def key_blocks(self, i):
        """(lo, full_lo, full_hi, hi) of key blocks for query block i."""
        s = self.spec
        nk = s.Sp // s.block_k
        if not s.static_positions:
            return 0, 0, 0, nk
        q_min = s.offset + i * s.block_q
        r = _partner_blocks(q_min, q_min + s.block_q - 1, s.lower, s.upper, 0, s.block_k, nk, s.S // s.block_k)
        return r if not s.dynamic_masking else (r[0], r[0], r[0], r[3])

    def query_blocks(self, j):
        """(lo, full_lo, full_hi, hi) of query blocks that see key block j."""
        s = self.spec
        nq = s.Tp // s.block_q
        if not s.static_positions:
            return 0, 0, 0, nq
        k_min = j * s.block_k
        k_max = jnp.minimum(k_min + s.block_k - 1, s.S - 1)  # padded keys are never full
        n_full = jnp.where(k_min + s.block_k <= s.S, nq, 0)
        r = _partner_blocks(k_min, k_max, s.upper, s.lower, s.offset, s.block_q, nq, n_full)
        return r if not s.dynamic_masking else (r[0], r[0], r[0], r[3])


def _logits(spec, qi, kj, bias_blk):
    """Scaled (soft-capped, biased) logits of a block, float32+; also tanh for the backward."""
    acc = jnp.promote_types(qi.dtype, jnp.float32)
    s = jnp.einsum("gqh,kh->gqk", qi, kj, precision=spec.precision, preferred_element_type=acc)
    s = s * jnp.asarray(spec.scale, acc)
    t = None
    if spec.softcap is not None:
        t = jnp.tanh(s / spec.softcap)
        s = spec.softcap * t
    if bias_blk is not None:
        s = s + bias_blk.astype(acc)
    return s, t


def _bias_block(bias_u, spec, i, j):
    if bias_u is None:
        return None
    return lax.dynamic_slice(bias_u, (0, i * spec.block_q, j * spec.block_k),
                             (bias_u.shape[0], spec.block_q, spec.block_k))


def _unit_views(spec, bias, b, kh):
    if bias is None:
        return None
    bias = bias[b if bias.shape[0] > 1 else 0]
    return lax.dynamic_slice_in_dim(bias, kh * spec.G, spec.G, 0) if bias.shape[0] > 1 else bias


def _forward_unit(spec, q, k, v, bias_u, unit):
    """q (G, Tp, H), k (Sp, H), v (Sp, Hv) -> out (G, Tp, Hv), lse (G, Tp)."""
    G, bq, bk = spec.G, spec.block_q, spec.block_k
    acc_t = jnp.promote_types(q.dtype, jnp.float32)

    def q_block(_, i):
        qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)

        def visit(masked):
            def body(j, state):
                m, l, acc = state
                kj = lax.dynamic_slice_in_dim(k, j * bk, bk)
                vj = lax.dynamic_slice_in_dim(v, j * bk, bk)
                s, _ = _logits(spec, qi, kj, _bias_block(bias_u, spec, i, j))
                if masked:
                    s = jnp.where(unit.block_mask(i, j), s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("gqk,kh->gqh", p.astype(v.dtype), vj, precision=spec.precision,
                                preferred_element_type=acc_t)
                return m_new, l * alpha + jnp.sum(p, axis=-1), acc * alpha[..., None] + pv
            return body

        state = (jnp.full((G, bq), -jnp.inf, acc_t), jnp.zeros((G, bq), acc_t),
                 jnp.zeros((G, bq, v.shape[-1]), acc_t))
        lo, full_lo, full_hi, hi = unit.key_blocks(i)
        state = lax.fori_loop(lo, full_lo, visit(True), state)
        state = lax.fori_loop(full_lo, full_hi, visit(False), state)
        m, l, acc = lax.fori_loop(full_hi, hi, visit(True), state)
        out = acc / jnp.where(l == 0, 1.0, l)[..., None]
        lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), jnp.inf)  # +inf: nothing attended
        return None, (out, lse)

    _, (out, lse) = lax.scan(q_block, None, jnp.arange(spec.Tp // bq))
    out = jnp.moveaxis(out, 0, 1).reshape(G, spec.Tp, -1)
    return out.astype(q.dtype), jnp.moveaxis(lse, 0, 1).reshape(G, spec.Tp)


def _backward_unit(spec, q, k, v, bias_u, unit, out, lse, dout):
    """Gradients for one unit: dq (G, Tp, H), dk (Sp, H), dv (Sp, Hv), dbias_u like bias_u."""
    G, bq, bk = spec.G, spec.block_q, spec.block_k
    acc_t = jnp.promote_types(q.dtype, jnp.float32)
    delta = jnp.sum(dout.astype(acc_t) * out.astype(acc_t), axis=-1)  # (G, Tp): rowsum(dO * O)
    mm = functools.partial(jnp.einsum, precision=spec.precision, preferred_element_type=acc_t)

    def kv_block(carry, j):
        dq, dbias = carry
        kj = lax.dynamic_slice_in_dim(k, j * bk, bk)
        vj = lax.dynamic_slice_in_dim(v, j * bk, bk)

        def visit(masked):
            def body(i, state):
                dq, dbias, dk_j, dv_j = state
                qi = lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
                doi = lax.dynamic_slice_in_dim(dout, i * bq, bq, axis=1)
                lse_i = lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=1)
                delta_i = lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=1)
                s, t = _logits(spec, qi, kj, _bias_block(bias_u, spec, i, j))
                if masked:
                    s = jnp.where(unit.block_mask(i, j), s, -jnp.inf)
                p = jnp.exp(s - lse_i[..., None])  # the forward's weights, recomputed
                dv_j = dv_j + mm("gqk,gqh->kh", p.astype(doi.dtype), doi)
                dp = mm("gqh,kh->gqk", doi, vj)
                ds = p * (dp - delta_i[..., None])  # d loss / d (biased) logits
                if dbias is not None:
                    blk = ds if dbias.shape[0] == G else jnp.sum(ds, axis=0, keepdims=True)
                    dbias = lax.dynamic_update_slice(
                        dbias, _bias_block(dbias, spec, i, j) + blk.astype(dbias.dtype), (0, i * bq, j * bk))
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds * jnp.asarray(spec.scale, acc_t)
                dq_i = lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1) + mm("gqk,kh->gqh", ds.astype(kj.dtype), kj)
                dq = lax.dynamic_update_slice_in_dim(dq, dq_i, i * bq, axis=1)
                dk_j = dk_j + mm("gqk,gqh->kh", ds.astype(qi.dtype), qi)
                return dq, dbias, dk_j, dv_j
            return body

        state = (dq, dbias, jnp.zeros((bk, k.shape[-1]), acc_t), jnp.zeros((bk, v.shape[-1]), acc_t))
        lo, full_lo, full_hi, hi = unit.query_blocks(j)
        state = lax.fori_loop(lo, full_lo, visit(True), state)
        state = lax.fori_loop(full_lo, full_hi, visit(False), state)
        dq, dbias, dk_j, dv_j = lax.fori_loop(full_hi, hi, visit(True), state)
        return (dq, dbias), (dk_j, dv_j)

    dbias0 = None if bias_u is None else jnp.zeros(bias_u.shape, acc_t)
    (dq, dbias), (dk, dv) = lax.scan(kv_block, (jnp.zeros(q.shape, acc_t), dbias0), jnp.arange(spec.Sp // bk))
    return dq, dk.reshape(spec.Sp, -1), dv.reshape(spec.Sp, -1), dbias


def _to_units(spec, q, k, v):
    """(B, T, N, H) -> (B*K, G, Tp, H); (B, S, K, H) -> (B*K, Sp, H); zero-padded to whole blocks."""
    B, T, N, H = q.shape
    K = k.shape[2]
    q = jnp.pad(q, ((0, 0), (0, spec.Tp - T), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, spec.Sp - spec.S), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, spec.Sp - spec.S), (0, 0), (0, 0)))
    q = q.reshape(B, spec.Tp, K, spec.G, H).transpose(0, 2, 3, 1, 4).reshape(B * K, spec.G, spec.Tp, H)
    k = k.transpose(0, 2, 1, 3).reshape(B * K, spec.Sp, H)
    v = v.transpose(0, 2, 1, 3).reshape(B * K, spec.Sp, -1)
    return q, k, v


def _from_units(spec, x, B, K):
    """(B*K, G, Tp, Hv) -> (B, T, N, Hv)."""
    x = x.reshape(B, K, spec.G, spec.Tp, -1).transpose(0, 3, 1, 2, 4)
    return x.reshape(B, spec.Tp, K * spec.G, -1)[:, : spec.T]


def _pad_ts(x, spec):
    """Pad the last two dims of a (.., T, S) array to (Tp, Sp)."""
    if x is None:
        return None
    pad = [(0, 0)] * (x.ndim - 2) + [(0, spec.Tp - spec.T), (0, spec.Sp - spec.S)]
    return jnp.pad(x, pad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec, q, k, v, bias, aux):
    return _forward(spec, q, k, v, bias, aux)[0]


def _forward(spec, q, k, v, bias, aux):
    B, K = q.shape[0], k.shape[2]
    qu, ku, vu = _to_units(spec, q, k, v)
    bias_p = _pad_ts(bias, spec)

    def unit(args):
        u, qx, kx, vx = args
        b, kh = u // K, u % K
        return _forward_unit(spec, qx, kx, vx, _unit_views(spec, bias_p, b, kh), _Unit(spec, aux, b, kh))

    out, lse = lax.map(unit, (jnp.arange(B * K), qu, ku, vu))
    return _from_units(spec, out, B, K), (q, k, v, bias, aux, out, lse)


def _attention_fwd(spec, q, k, v, bias, aux):
    return _forward(spec, q, k, v, bias, aux)


def _backward_spec(spec: _Spec) -> _Spec:
    """The forward's blocks, with key blocks of BLOCK_K_BACKWARD where that divides them."""
    bk = min(spec.block_k, BLOCK_K_BACKWARD)
    return spec if spec.block_k % bk else dataclasses.replace(spec, block_k=bk)


def _attention_bwd(spec, residuals, dout):
    spec = _backward_spec(spec)
    q, k, v, bias, aux, out, lse = residuals
    B, S, K = k.shape[0], k.shape[1], k.shape[2]
    qu, ku, vu = _to_units(spec, q, k, v)
    do = jnp.pad(dout, ((0, 0), (0, spec.Tp - spec.T), (0, 0), (0, 0)))
    do = do.reshape(B, spec.Tp, K, spec.G, -1).transpose(0, 2, 3, 1, 4).reshape(B * K, spec.G, spec.Tp, -1)
    bias_p = _pad_ts(bias, spec)

    def unit(dbias, args):
        u, qx, kx, vx, ox, lx, dox = args
        b, kh = u // K, u % K
        bias_u = _unit_views(spec, bias_p, b, kh)
        dq, dk, dv, dbias_u = _backward_unit(spec, qx, kx, vx, bias_u, _Unit(spec, aux, b, kh), ox, lx, dox)
        if dbias is not None:  # add this unit's share into the bias's own (broadcast) shape
            bb = b if dbias.shape[0] > 1 else 0
            hh = kh * spec.G if dbias.shape[1] > 1 else 0
            cur = lax.dynamic_slice(dbias, (bb, hh, 0, 0), (1, dbias_u.shape[0]) + dbias.shape[2:])
            dbias = lax.dynamic_update_slice(dbias, cur + dbias_u[None].astype(dbias.dtype), (bb, hh, 0, 0))
        return dbias, (dq, dk, dv)

    dbias0 = None if bias is None else jnp.zeros(bias_p.shape, jnp.promote_types(bias.dtype, jnp.float32))
    dbias, (dq, dk, dv) = lax.scan(unit, dbias0, (jnp.arange(B * K), qu, ku, vu, out, lse, do))
    dq = _from_units(spec, dq, B, K).astype(q.dtype)
    unflat = lambda x: x.reshape(B, K, spec.Sp, -1).transpose(0, 2, 1, 3)[:, :S]
    dk, dv = unflat(dk).astype(k.dtype), unflat(dv).astype(v.dtype)
    if dbias is not None:
        dbias = dbias[..., : spec.T, : spec.S].astype(bias.dtype)
    return dq, dk, dv, dbias, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(query, key, value, bias, mask, *, scale, is_causal, window, query_positions,
                        key_positions, query_segment_ids, key_segment_ids, query_seq_lengths,
                        key_value_seq_lengths, logit_softcap, precision, block_q: Optional[int] = None,
                        block_k: Optional[int] = None):
    """Blockwise attention; arguments as :func:`flax_attn.dot_product_attention` (validated, 4-D).

    ``bias``/``mask``: 4-D, each dim 1 or full; ``window``: (left, right) or None. Positions,
    segment ids: ``(B|1, T)`` / ``(B|1, S)`` int32 or None; lengths ``(B,)`` or None.
    """
    B, T, N, _ = query.shape
    S, K = key.shape[1], key.shape[2]
    lower = upper = _FAR
    if window is not None:
        lower, upper = window
    if is_causal:
        upper = 0
    block_q, block_k = block_q or BLOCK_Q, block_k or BLOCK_K
    bq = T if T <= block_q else block_q
    bk = S if S <= block_k else block_k
    static_positions = query_positions is None and key_positions is None
    dynamic = any(x is not None for x in (query_segment_ids, query_seq_lengths, key_value_seq_lengths, mask))
    spec = _Spec(T=T, S=S, block_q=bq, block_k=bk, G=N // K, scale=float(scale), softcap=logit_softcap,
                 lower=int(lower), upper=int(upper), static_positions=static_positions,
                 dynamic_masking=dynamic, precision=precision)
    pad_rows = lambda x, n, to: None if x is None else jnp.pad(x, ((0, 0), (0, to - n)), mode="edge")
    aux = (
        pad_rows(query_positions, T, spec.Tp), pad_rows(key_positions, S, spec.Sp),
        pad_rows(query_segment_ids, T, spec.Tp), pad_rows(key_segment_ids, S, spec.Sp),
        query_seq_lengths, key_value_seq_lengths, _pad_ts(mask, spec),
    )
    return _attention(spec, query, key, value, bias, aux)
