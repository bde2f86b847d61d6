"""The mask description: which (query, key) pairs may attend, and the additive bias.

A :class:`Mask` holds every rule that decides whether query ``t`` may attend to key ``s``:

* ``causal``: the key's position is at most the query's;
* ``window=(left, right)``: ``-right <= q_pos - k_pos <= left``;
* positions (``(B|1, T)``, ``(B|1, S)`` int): what causal and window compare. Default: keys
  at ``0..S-1``, queries at the *last* T of them (query t at ``t + S - T``);
* segment ids: equal ids only; a negative id is padding (never attended, attends to nothing);
* lengths ``(B,)``: query rows and key columns past a sequence's length are blocked;
* a dense boolean array broadcastable to ``(B, N, T, S)`` (True = may attend);
* a dense additive ``bias`` broadcastable to ``(B, N, T, S)``;
* ``chunk=C`` (:func:`chunked`): only keys in the query's chunk of C positions, ``q_pos // C ==
  k_pos // C`` (Llama 4's chunked attention is ``causal() & chunked(C)``);
* user rules (:func:`mask_mod`): ``mask_mod(b, n, q_idx, k_idx) -> bool``, in the spirit of
  PyTorch's FlexAttention, evaluated block by block;
* a user score modification (``score_mod=`` of :func:`flax_attn.dot_product_attention`):
  ``score_mod(score, b, n, q_idx, k_idx) -> score``, applied to the finished logits of each block.

User functions (``mask_mod``, ``score_mod``) are written for *scalars* and evaluated elementwise
(``jax.vmap``), as FlexAttention does: ``b`` is the batch row, ``n`` the query head (``0..N-1``;
its key/value head is ``n // G``), ``q_idx`` and ``k_idx`` the positions this description uses
(``query_positions`` / ``key_positions`` when given, else keys at ``0..S-1`` and queries at the
last T of them), all int32; ``score`` is the logit in the accumulation dtype (float32 or wider).
Traced floating arrays they close over become arguments of the description
(:func:`jax.closure_convert`), so gradients reach them (a learned bias table) through custom
derivative rules such as the blockwise path's.

This module is the only place where these rules are written. Every implementation asks the
description for what it needs: :meth:`Mask.block` gives the boolean mask of any block of
queries and keys (the whole ``(T, S)`` tile is one block), :meth:`Mask.block_bias` the bias
of a block, :meth:`Mask.block_scores` applies the score modification to a block of logits
(:meth:`Mask.block_scores_jvp` its tangent, for implementations with their own derivative
rule), :meth:`Mask.block_kind` whether a block is empty, full or partial (so that empty
blocks are skipped and full ones computed without a mask), and :meth:`Mask.key_visible` /
:meth:`Mask.query_visible` which keys and queries take part at all.

Users build one with the functions below and combine them with ``&``::

    m = causal() & window(127, 0) & segments(q_ids, k_ids) & dense(my_bool_array)
    out = flax_attn.dot_product_attention(q, k, v, mask=m)

A description made by these builders is *unbound*: it knows no shapes. Passing it to
:func:`flax_attn.dot_product_attention` validates it against the call and binds it to the
shapes ``(B, N, T, S)``; only a bound description answers block queries.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from flax_attn import _checks

Window = Union[int, Tuple[int, int]]
FAR = 1 << 28  # "no limit" in window arithmetic on int32 positions

EMPTY, FULL, PARTIAL = 0, 1, 2  # block kinds

_ARRAYS = ("q_positions", "k_positions", "q_segments", "k_segments", "q_lengths", "kv_lengths", "dense", "bias")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mod:
    """A user function (``mask_mod`` or ``score_mod``) and the arrays it closes over.

    Unbound: ``fn`` is the user's function and ``args`` is empty. Bound: ``fn`` is its closure
    conversion, called as ``fn(*scalars, *args)``, and ``args`` are the hoisted arrays (pytree
    leaves of the description, so derivatives reach them).
    """

    fn: Callable = dataclasses.field(metadata=dict(static=True))
    args: Tuple[Any, ...] = ()

    def __call__(self, *scalars):
        return self.fn(*scalars, *self.args)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mask:
    """Which (query, key) pairs may attend, and the bias; see the module docstring.

    Arrays of a bound description: positions and segment ids ``(B|1, T)`` / ``(B|1, S)`` int32,
    lengths ``(B,)`` int32, ``dense`` bool and ``bias`` float, both 4-D ``(B|1, N|1, T|1, S|1)``.
    ``shape`` is ``(B, N, T, S)`` once bound, None before.
    """

    q_positions: Any = None
    k_positions: Any = None
    q_segments: Any = None
    k_segments: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    dense: Any = None
    bias: Any = None
    mask_mods: Tuple[Mod, ...] = ()       # user rules, all must allow
    score_mod: Optional[Mod] = None        # set by dot_product_attention(score_mod=...)
    causal: bool = dataclasses.field(default=False, metadata=dict(static=True))
    window: Optional[Tuple[int, int]] = dataclasses.field(default=None, metadata=dict(static=True))
    chunk: Optional[int] = dataclasses.field(default=None, metadata=dict(static=True))
    # keys past kv_lengths hold finite values (a KV cache's unwritten slots): blocked, not zeroed first
    kv_finite: bool = dataclasses.field(default=False, metadata=dict(static=True))
    shape: Optional[Tuple[Any, ...]] = dataclasses.field(default=None, metadata=dict(static=True))

    # ------------------------------------------------------------------ composition

    def __and__(self, other: "Mask") -> "Mask":
        if not isinstance(other, Mask):
            return NotImplemented
        if self.shape is not None or other.shape is not None:
            raise ValueError("only unbound mask descriptions (from the builders) can be combined with &")
        fields = {}
        for name in _ARRAYS:
            a, b = getattr(self, name), getattr(other, name)
            if a is not None and b is not None:
                if name == "dense":
                    try:
                        np.broadcast_shapes(_checks.shape_of(a), _checks.shape_of(b))
                    except ValueError:
                        raise ValueError(f"both mask descriptions give a dense mask, of shapes {_checks.shape_of(a)} "
                                         f"and {_checks.shape_of(b)}, which do not broadcast together") from None
                    fields[name] = jnp.logical_and(a, b)
                    continue
                what = {"q_positions": "positions", "q_segments": "segment ids", "q_lengths": "query lengths",
                        "kv_lengths": "key/value lengths"}.get(name)
                if what is None:
                    continue  # the partner field of a pair already reported
                raise ValueError(f"both mask descriptions give {what}; combine them into one before '&'")
            fields[name] = a if a is not None else b
        if self.score_mod is not None or other.score_mod is not None:
            raise ValueError("a score_mod is not a mask rule; pass it as dot_product_attention(score_mod=...)")
        if self.chunk is not None and other.chunk is not None and self.chunk != other.chunk:
            raise ValueError(f"both mask descriptions give chunks, of {self.chunk} and {other.chunk} positions; "
                             "give one")
        return Mask(**fields, mask_mods=self.mask_mods + other.mask_mods, causal=self.causal or other.causal,
                    window=_intersect(self.window, other.window),
                    chunk=self.chunk if self.chunk is not None else other.chunk,
                    kv_finite=self.kv_finite if self.kv_lengths is not None else other.kv_finite)

    # ------------------------------------------------------------------ summary

    @property
    def bound(self) -> bool:
        return self.shape is not None

    @property
    def bounds(self) -> Tuple[int, int]:
        """``(lower, upper)``: a query at position p may see keys at ``p - lower .. p + upper``."""
        lower, upper = self.window if self.window is not None else (FAR, FAR)
        return lower, (min(upper, 0) if self.causal else upper)

    @property
    def has_rules(self) -> bool:
        """Whether anything is blocked at all (a bias alone blocks nothing)."""
        return (self.uses_positions or self.chunk is not None or bool(self.mask_mods)
                or any(getattr(self, f) is not None for f in _ARRAYS[2:7]))

    @property
    def uses_positions(self) -> bool:
        return self.causal or self.window is not None

    def describe(self) -> str:
        """The rules in words, for error messages."""
        parts = []
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk}")
        if self.mask_mods:
            parts.append("mask_mod")
        if self.score_mod is not None:
            parts.append("score_mod")
        for name, what in (("q_positions", "positions"), ("q_segments", "segment ids"), ("dense", "a boolean mask"),
                           ("bias", "a bias")):
            if getattr(self, name) is not None:
                parts.append(what)
        if self.q_lengths is not None or self.kv_lengths is not None:
            parts.append("lengths")
        return ", ".join(parts) or "no mask"

    # ------------------------------------------------------------------ block queries (bound only)

    def _dims(self):
        if self.shape is None:
            raise ValueError("this mask description is not bound to shapes; pass it to dot_product_attention")
        return self.shape

    def positions(self, b, q_start, bq: int, k_start, bk: int):
        """Positions of queries ``q_start + [0, bq)`` and keys ``k_start + [0, bk)`` of batch row ``b``."""
        _, _, T, S = self._dims()
        # default_positions: keys at 0..S-1, queries at the last T of them. A block's rows and
        # columns past T / S (padding, blocked) repeat the last real position, as the padded
        # position arrays do (:meth:`padded`): user rules only ever see positions that exist, so
        # a rule undefined past them cannot reach a derivative through the blocked pairs.
        qp = (jnp.minimum(q_start + jnp.arange(bq, dtype=jnp.int32), T - 1) + (S - T) if self.q_positions is None
              else _rows(self.q_positions, b, q_start, bq))
        kp = (jnp.minimum(k_start + jnp.arange(bk, dtype=jnp.int32), S - 1) if self.k_positions is None
              else _rows(self.k_positions, b, k_start, bk))
        return qp, kp

    def block(self, b, heads, q_start, bq: int, k_start, bk: int):
        """Boolean ``(n, bq, bk)``, True = may attend, for batch row ``b`` (an int or traced scalar).

        ``heads`` is ``(h0, n)``: the n query heads from h0 (the result has n rows or 1 if the
        rules do not depend on the head). Rows and columns outside ``T`` / ``S`` are blocked.
        Arrays must be padded (:meth:`padded`) to hold ``q_start + bq`` rows and ``k_start + bk``
        columns.
        """
        _, _, T, S = self._dims()
        qi = q_start + jnp.arange(bq, dtype=jnp.int32)
        ki = k_start + jnp.arange(bk, dtype=jnp.int32)
        q_ok = qi < T if self.q_lengths is None else qi < jnp.minimum(self.q_lengths[b], T)
        k_ok = ki < S if self.kv_lengths is None else ki < jnp.minimum(self.kv_lengths[b], S)
        allowed = q_ok[:, None] & k_ok[None, :]
        if self.uses_positions or self.chunk is not None or self.mask_mods:
            qp, kp = self.positions(b, q_start, bq, k_start, bk)
        if self.uses_positions:
            lower, upper = self.bounds  # FAR: no limit on that side, whatever the positions
            delta = qp[:, None] - kp[None, :]
            if lower < FAR:
                allowed = allowed & (delta <= lower)
            if upper < FAR:
                allowed = allowed & (delta >= -upper)
        if self.chunk is not None:
            allowed = allowed & ((qp // self.chunk)[:, None] == (kp // self.chunk)[None, :])
        if self.q_segments is not None:
            qs = _rows(self.q_segments, b, q_start, bq)
            ks = _rows(self.k_segments, b, k_start, bk)
            allowed = allowed & (qs[:, None] == ks[None, :]) & (ks >= 0)[None, :]
        allowed = allowed[None]
        if self.dense is not None:
            allowed = allowed & _tile(self.dense, b, heads, q_start, bq, k_start, bk)
        for mod in self.mask_mods:
            allowed = allowed & _elementwise(mod, *_grid(b, heads, qp, kp))
        return allowed

    def block_bias(self, b, heads, q_start, bq: int, k_start, bk: int):
        """The bias of a block, ``(n|1, bq|1, bk|1)``, or None."""
        if self.bias is None:
            return None
        return _tile(self.bias, b, heads, q_start, bq, k_start, bk)

    def block_scores(self, s, b, heads, q_start, bq: int, k_start, bk: int):
        """The score modification applied to the finished logits ``s`` ``(n, bq, bk)`` of a block
        (after scale, soft-cap and bias; before the mask); ``s`` itself when there is none.

        ``heads``, ``q_start`` etc. as in :meth:`block`. Implementations that work block by block
        call this on each block's logits; :meth:`scores` does the whole ``(T, S)`` tile.
        """
        if self.score_mod is None:
            return s
        qp, kp = self.positions(b, q_start, bq, k_start, bk)
        return _elementwise(self.score_mod, s, *_grid(b, heads, qp, kp, s.shape[0])).astype(s.dtype)

    def block_scores_jvp(self, mask_dot, spec, qi, kj, ds, b, heads, q_start, bq: int, k_start, bk: int):
        """The tangent of :meth:`block_scores`: ``ds`` (the tangent of the finished logits of a
        block, ``(n, bq, bk)``) carried through the score modification; ``ds`` itself when there
        is none.

        ``mask_dot`` is this description's tangent (:meth:`with_tangents`: its score_mod's
        ``args`` are the tangents of the arrays the score_mod closes over); ``spec`` gives
        ``scale``, ``softcap`` and ``precision``; ``qi`` ``(n, bq, H)`` and ``kj`` ``(bk, H)``
        are the block's queries and keys, from which the logits are recomputed.
        """
        if self.score_mod is None:
            return ds
        from flax_attn.core import numerics  # numerics does not import this module; keep it that way

        acc = jnp.promote_types(qi.dtype, jnp.float32)
        raw = jnp.einsum("gqh,kh->gqk", qi, kj, precision=spec.precision, preferred_element_type=acc)
        s = numerics.finish_logits(spec, raw, self.block_bias(b, heads, q_start, bq, k_start, bk))
        qp, kp = self.positions(b, q_start, bq, k_start, bk)
        idx = _grid(b, heads, qp, kp, s.shape[0])
        fn = self.score_mod.fn
        f = lambda s, args: _elementwise(Mod(fn, args), s, *idx).astype(s.dtype)
        args_dot = tuple(jnp.zeros_like(a) if t is None else t for a, t in
                         zip(self.score_mod.args, mask_dot.score_mod.args))
        return jax.jvp(f, (s, self.score_mod.args), (ds.astype(s.dtype), args_dot))[1]

    def with_tangents(self, tangent: "Mask") -> "Mask":
        """This description with the tangents of its differentiable arrays (the bias and the
        arrays the score_mod closes over) taken from ``tangent``, a description of the same
        structure whose leaves are tangents; the rest stays primal."""
        score = None if self.score_mod is None else Mod(self.score_mod.fn, tangent.score_mod.args)
        return dataclasses.replace(self, bias=tangent.bias, score_mod=score)

    def scores(self, s):
        """The score modification applied to all logits ``(B, K, G, T, S)`` or ``(B, N, T, S)``
        (batch 1 or B); ``s`` itself when there is none."""
        if self.score_mod is None:
            return s
        _, N, T, S = self._dims()
        flat = s.reshape(s.shape[0], N, T, S)
        out = jax.vmap(lambda b, x: self.block_scores(x, b, (0, N), 0, T, 0, S))(
            jnp.arange(s.shape[0], dtype=jnp.int32), flat)
        return out.reshape(s.shape)

    def block_kind(self, b, heads, q_start, bq: int, k_start, bk: int):
        """int32 scalar: ``EMPTY`` (no pair may attend), ``FULL`` (every pair may: no mask
        needed) or ``PARTIAL``. Found from position, chunk, segment and length ranges; a dense
        mask and the mask_mods are inspected over the block (a mask_mod is evaluated on the
        block's ``n x bq x bk`` pairs)."""
        _, _, T, S = self._dims()
        q_end, k_end = q_start + bq, k_start + bk  # exclusive
        q_lim = T if self.q_lengths is None else jnp.minimum(self.q_lengths[b], T)
        k_lim = S if self.kv_lengths is None else jnp.minimum(self.kv_lengths[b], S)
        empty = (q_start >= q_lim) | (k_start >= k_lim)
        full = (q_end <= q_lim) & (k_end <= k_lim)
        if self.uses_positions or self.chunk is not None or self.mask_mods:
            qp, kp = self.positions(b, q_start, bq, k_start, bk)
            # only rows/columns that exist can make a block non-empty
            q_valid = q_start + jnp.arange(bq) < q_lim
            k_valid = k_start + jnp.arange(bk) < k_lim
            lo = lambda x, valid: jnp.min(jnp.where(valid, x, jnp.iinfo(x.dtype).max))
            hi = lambda x, valid: jnp.max(jnp.where(valid, x, jnp.iinfo(x.dtype).min))
        if self.uses_positions:
            q_min, q_max, k_min, k_max = lo(qp, q_valid), hi(qp, q_valid), lo(kp, k_valid), hi(kp, k_valid)
            lower, upper = self.bounds
            if upper < FAR:
                empty = empty | (k_min > q_max + upper)
                full = full & (k_max <= q_min + upper)
            if lower < FAR:
                empty = empty | (k_max < q_min - lower)
                full = full & (k_min >= q_max - lower)
        if self.chunk is not None:
            qc, kc = qp // self.chunk, kp // self.chunk
            qc_min, qc_max, kc_min, kc_max = lo(qc, q_valid), hi(qc, q_valid), lo(kc, k_valid), hi(kc, k_valid)
            empty = empty | (kc_min > qc_max) | (kc_max < qc_min)
            full = full & (qc_min == qc_max) & (kc_min == kc_max) & (qc_min == kc_min)
        if self.q_segments is not None:
            qs = _rows(self.q_segments, b, q_start, bq)
            ks = _rows(self.k_segments, b, k_start, bk)
            empty = empty | (jnp.max(qs) < jnp.min(ks)) | (jnp.max(ks) < jnp.maximum(0, jnp.min(qs)))
            full = full & (jnp.min(qs) == jnp.max(qs)) & (jnp.min(ks) == jnp.max(ks)) & (qs[0] == ks[0]) & (ks[0] >= 0)
        if self.dense is not None:
            tile = _tile(self.dense, b, heads, q_start, bq, k_start, bk)
            empty = empty | ~jnp.any(tile)
            full = full & jnp.all(tile)
        for mod in self.mask_mods:
            tile = _elementwise(mod, *_grid(b, heads, qp, kp))
            empty = empty | ~jnp.any(tile & q_valid[:, None] & k_valid[None, :])
            full = full & jnp.all(tile)
        return jnp.where(empty, EMPTY, jnp.where(full, FULL, PARTIAL)).astype(jnp.int32)

    def key_visible(self):
        """``(B|1, S)`` bool: keys that some query may attend to by the key-wise rules (lengths,
        negative segment ids, all-False columns of the dense mask); None if all may be. Lengths
        given as ``finite_past_lengths`` (:func:`lengths`) do not count: their keys need no
        zeroing."""
        _, _, _, S = self._dims()
        return _visible(S, None if self.kv_finite else self.kv_lengths, self.k_segments, self.dense, keep=3)

    def query_visible(self):
        """``(B|1, T)`` bool: queries that may attend to something by the row-wise rules."""
        _, _, T, _ = self._dims()
        return _visible(T, self.q_lengths, self.q_segments, self.dense, keep=2)

    def dense_mask(self):
        """The whole mask as one ``(B|1, N|1, T, S)`` boolean block, or None if all is allowed."""
        B, N, T, S = self._dims()
        if not self.has_rules:
            return None
        rows = B if any(getattr(self, f) is not None and getattr(self, f).shape[0] != 1 for f in _ARRAYS[:7]) else 1
        heads = N if self.dense is not None and self.dense.shape[1] != 1 else 1
        if self.mask_mods:  # a user rule may depend on the batch row and the head
            rows, heads = B, N
        if rows == 1:
            return self.block(0, (0, heads), 0, T, 0, S)[None]
        return jax.vmap(lambda b: self.block(b, (0, heads), 0, T, 0, S))(jnp.arange(rows))

    def padded(self, Tp: int, Sp: int) -> "Mask":
        """The same description with arrays padded to ``Tp`` queries and ``Sp`` keys (the padding
        is blocked by :meth:`block`, since it lies past T and S)."""
        B, N, T, S = self._dims()
        rows = lambda x, n: None if x is None else jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge")

        def ts(x, fill):
            if x is None:
                return None
            pad = [(0, 0), (0, 0), (0, Tp - T if x.shape[2] != 1 else 0), (0, Sp - S if x.shape[3] != 1 else 0)]
            return jnp.pad(x, pad, constant_values=fill)

        return dataclasses.replace(
            self, q_positions=rows(self.q_positions, Tp), k_positions=rows(self.k_positions, Sp),
            q_segments=rows(self.q_segments, Tp), k_segments=rows(self.k_segments, Sp),
            dense=ts(self.dense, False), bias=ts(self.bias, 0))


# ---------------------------------------------------------------------- helpers


def _intersect(a, b):
    if a is None or b is None:
        return a if b is None else b
    return (min(a[0], b[0]), min(a[1], b[1]))


def _rows(x, b, start, size: int):
    """``x[b or 0, start:start + size]`` of a (B|1, L) array."""
    # one slice of the row's cut, not x[b] then a cut: under vmap over b, x[b] gathers whole rows
    # (a decoding step's key blocks gathered every row's 8,192 positions for each block)
    first = 0 if x.shape[0] == 1 else b  # "== 1", not "> 1": a symbolic batch (jax.export) is not 1
    starts = [jnp.asarray(st, jnp.int32) for st in (first, start)]
    return lax.dynamic_slice(x, starts, (1, size))[0]


def _tile(x, b, heads, q_start, bq: int, k_start, bk: int):
    """``x[b, h0:h0+n, q_start:+bq, k_start:+bk]`` of a 4-D array whose dims may be 1 (kept as 1)."""
    h0, n = heads
    starts, sizes = [], []
    # the batch row is one more start of the same slice (see _rows)
    for dim, start, size in ((0, b, 1), (1, h0, n), (2, q_start, bq), (3, k_start, bk)):
        if x.shape[dim] != 1:
            starts.append(start)
            sizes.append(size)
        else:
            starts.append(0)
            sizes.append(1)
    # one index dtype: under vmap the starts are concatenated (x64 may make some of them int64)
    return lax.dynamic_slice(x, [jnp.asarray(st, jnp.int32) for st in starts], sizes)[0]


def _grid(b, heads, qp, kp, n=None):
    """int32 ``(b, n, q_idx, k_idx)`` broadcast to ``(n, bq, bk)`` for the heads ``(h0, n)``."""
    h0, count = heads
    n = count if n is None else n
    h = jnp.asarray(h0, jnp.int32) + jnp.arange(n, dtype=jnp.int32)
    shape = (n, qp.shape[0], kp.shape[0])
    return (jnp.broadcast_to(jnp.asarray(b, jnp.int32), shape), jnp.broadcast_to(h[:, None, None], shape),
            jnp.broadcast_to(qp.astype(jnp.int32)[None, :, None], shape),
            jnp.broadcast_to(kp.astype(jnp.int32)[None, None, :], shape))


def _elementwise(mod: Mod, *xs):
    """``mod`` (a function of scalars) at every element of the equally shaped arrays ``xs``."""
    shape = xs[0].shape
    out = jax.vmap(mod)(*(x.reshape(-1) for x in xs))
    return out.reshape(shape)


def bind_mod(what: str, fn, example) -> Mod:
    """Check a user function on scalar ``example`` arguments and closure-convert it.

    ``what`` is ``'mask_mod'`` (must return a boolean scalar) or ``'score_mod'`` (a floating
    scalar; cast back to the score's dtype where applied).
    """
    if isinstance(fn, Mod):
        fn = fn.fn
    if not callable(fn):
        raise TypeError(f"{what} must be a function, got {fn!r}")
    sig = ("(b, n, q_idx, k_idx), int32 scalars" if what == "mask_mod"
           else "(score, b, n, q_idx, k_idx), a floating score and int32 scalars")
    try:
        inspect.signature(fn).bind(*example)
    except TypeError as e:
        raise TypeError(f"{what} must take {sig}: {e}") from e
    except ValueError:  # no signature to read (some builtins): the call below tells
        pass
    try:
        out = jax.eval_shape(fn, *example)
    except (TypeError, jax.errors.JAXTypeError) as e:
        raise TypeError(
            f"{what} failed on traced arguments {sig}: {type(e).__name__}: {e} (rules are traced by "
            f"JAX, so arrays they index with the arguments must be JAX arrays, e.g. jnp.asarray(...))") from e
    if not hasattr(out, "shape") or out.shape != ():
        raise ValueError(f"{what} must return one value for scalar arguments (it is evaluated elementwise), "
                         f"got {getattr(out, 'shape', out)!r}")
    if what == "mask_mod" and out.dtype != jnp.bool_:
        raise TypeError(f"mask_mod must return a boolean (True = may attend), got dtype {out.dtype}")
    if what == "score_mod" and not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"score_mod must return a floating score, got dtype {out.dtype}")
    converted, consts = jax.closure_convert(fn, *example)
    return Mod(converted, tuple(consts))


def _visible(length: int, lengths, segments, dense, keep: int):
    """Rows (keep=2) or columns (keep=3) of (B, N, T, S) not blocked outright; None if all are."""
    ok = None
    if lengths is not None:
        ok = _within(lengths, length)
    if segments is not None:
        ok = segments >= 0 if ok is None else ok & (segments >= 0)
    if dense is not None and dense.shape[keep] != 1:
        d = jnp.any(dense, axis=(1, 5 - keep))  # over heads and the other of T, S: (B|1, length)
        ok = d if ok is None else ok & d
    return ok


# ---------------------------------------------------------------------- builders


def causal() -> Mask:
    """A query may attend to keys at its own position or earlier: ``k_pos <= q_pos``.

    The positions compared are those of :func:`positions` (or ``query_positions`` /
    ``key_positions`` of :func:`flax_attn.dot_product_attention`); by default keys at ``0..S-1``
    and queries at the *last* T of them (query t at ``t + S - T``), so that with T < S (new
    tokens after cached ones) query t sees keys ``0..t + S - T``.
    """
    return Mask(causal=True)


def normalize_window(local_window_size: Optional[Window]) -> Optional[Tuple[int, int]]:
    """``int w`` -> ``(w, w)``; ``(left, right)`` is kept. Raises on negative or non-integer sizes.

    ``(left, right)`` admits ``left + 1 + right`` keys around the query (the
    ``jax.nn.dot_product_attention`` convention); a causal sliding window of W keys including
    the current one (Mistral) is ``(W - 1, 0)``.
    """
    if local_window_size is None:
        return None
    size = _checks.static_int(local_window_size)
    pair = (tuple(_checks.static_int(w) for w in local_window_size)
            if isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2 else None)
    if size is not None:
        window = (size, size)
    elif pair is not None and None not in pair:
        window = pair
    else:
        raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints known when the function "
                        f"is traced, got {local_window_size!r}")
    if window[0] < 0 or window[1] < 0:
        raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
    return window


def window(left: int, right: Optional[int] = None) -> Mask:
    """Keys at positions ``q_pos - left .. q_pos + right`` (``left + 1 + right`` keys; ``right``
    defaults to ``left``); ints >= 0. Combined with :func:`causal`, ``right`` counts as 0: a causal
    sliding window of W keys, the query's own included (Mistral), is ``causal() & window(W - 1, 0)``.

    Positions as in :func:`causal`: those of :func:`positions`, by default keys at ``0..S-1``
    and queries at the *last* T of them (query t at ``t + S - T``).
    """
    return Mask(window=normalize_window((left, left if right is None else right)))


def positions(query_positions, key_positions) -> Mask:
    """Integer positions ``(T,)``/``(B, T)`` and ``(S,)``/``(B, S)`` that causal and window compare."""
    _checks.check_integer("query_positions", query_positions)
    _checks.check_integer("key_positions", key_positions)
    return Mask(q_positions=query_positions, k_positions=key_positions)


def segments(query_segment_ids, key_segment_ids) -> Mask:
    """Packed sequences: query t may attend to key s only if their ids are equal and not negative.

    Args:
      query_segment_ids: int ``(B|1, T)`` or ``(T,)``.
      key_segment_ids: int ``(B|1, S)`` or ``(S,)``; for self-attention, the same ids again.
        Both are required; their shapes are checked when the description is bound (passed to
        :func:`flax_attn.dot_product_attention`).

    Ids are only compared for equality. A negative id (e.g. -1) marks padding: such a key is
    never attended to, and such a query attends to nothing (its output is zeros).
    """
    if query_segment_ids is None or key_segment_ids is None:
        raise ValueError("segments needs both query_segment_ids and key_segment_ids (pass the same ids twice "
                         "for self-attention)")
    _checks.check_integer("query_segment_ids", query_segment_ids)
    _checks.check_integer("key_segment_ids", key_segment_ids)
    return Mask(q_segments=query_segment_ids, k_segments=key_segment_ids)


def lengths(query_seq_lengths=None, key_value_seq_lengths=None, *, finite_past_lengths: bool = False) -> Mask:
    """Per-sequence lengths ``(B,)``: rows / columns past them are blocked.

    Keys and values past ``key_value_seq_lengths`` are zeroed, so that NaN or Inf there cannot
    leak: before attending (a pass over them), or by the key blocks in each block they visit.
    ``finite_past_lengths=True`` promises that they hold finite values, as a KV cache's
    unwritten slots do (zeros): they are then only blocked.
    Either way implementations may skip the key blocks past the longest length
    (``implementation='key_blocks'``: a decoding step's cost follows the fill of its cache).
    """
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None:
            _checks.check_integer(name, x)
    return Mask(q_lengths=query_seq_lengths, kv_lengths=key_value_seq_lengths,
                kv_finite=bool(finite_past_lengths) and key_value_seq_lengths is not None)


def chunked(chunk_size: int) -> Mask:
    """Chunks of ``chunk_size`` positions: a query at position p may attend to keys at positions
    in its own chunk, ``k // C == p // C``. Llama 4's chunked attention (causal within chunks) is
    ``causal() & chunked(C)``. Blocks of queries and keys in different chunks are skipped."""
    _checks.check_positive_int("chunk_size", chunk_size)
    return Mask(chunk=int(chunk_size))


def mask_mod(fn: Callable[..., Any]) -> Mask:
    """A user rule ``fn(b, n, q_idx, k_idx) -> bool`` (True = may attend), as PyTorch's
    FlexAttention ``mask_mod``; combine with the other rules by ``&``.

    ``fn`` is written for int32 scalars (batch row, query head, query and key position; see the
    module docstring) and evaluated elementwise over each block, never over the whole ``T x S``
    on the blockwise path. Each block's kind is found by evaluating ``fn`` over the block: a
    block where it is False everywhere is skipped, one where it is True everywhere is computed
    without a mask. Arrays ``fn`` closes over (document ids, a table) may be traced.
    """
    if not callable(fn):
        raise TypeError(f"mask_mod must be a function (b, n, q_idx, k_idx) -> bool, got {fn!r}")
    return Mask(mask_mods=(Mod(fn),))


def dense(mask) -> Mask:
    """A boolean array broadcastable to ``(B, N, T, S)``, True = may attend."""
    _checks.check_bool("mask", mask)
    return Mask(dense=mask)


# ---------------------------------------------------------------------- dense arrays from the rules
#
# Small pure functions returning boolean arrays, for users and tests. Each builds a description
# and asks it for its dense mask, so the rules above stay the only ones.


def default_positions(query_len: int, key_len: int):
    """Positions used when none are given: keys at ``0..S-1``, queries at the last T of them."""
    return jnp.arange(query_len, dtype=jnp.int32) + (key_len - query_len), jnp.arange(key_len, dtype=jnp.int32)


def check_position_pair(q_name, q, k_name, k):
    """Integer ``(T,)``/``(B, T)`` and ``(S,)``/``(B, S)`` arrays with compatible batches;
    returns them as :func:`flax_attn._checks.as_positions` (differences that do not wrap)."""
    _checks.check_integer(q_name, q)
    _checks.check_integer(k_name, k)
    _checks.check_rank(q_name, q, (1, 2), "(T,) or (B, T)")
    _checks.check_rank(k_name, k, (1, 2), "(S,) or (B, S)")
    qb, kb = _checks.shape_of(q)[:-1], _checks.shape_of(k)[:-1]
    if qb and kb and qb != kb and 1 not in (qb[0], kb[0]):
        raise ValueError(f"{q_name} {_checks.shape_of(q)} and {k_name} {_checks.shape_of(k)} have different batches")
    return _checks.as_positions(q), _checks.as_positions(k)


def _as_array(m: Mask, q_like, k_like, T: int, S: int):
    """The dense ``(..., T, S)`` mask of ``m``; batched iff ``q_like`` or ``k_like`` is 2-D."""
    batched = [x for x in (q_like, k_like) if x is not None and np.ndim(x) == 2]
    B = max((np.shape(x)[0] for x in batched), default=1)
    lift = lambda x: None if x is None else (jnp.asarray(x, jnp.int32)[None] if np.ndim(x) == 1 else jnp.asarray(x, jnp.int32))
    m = dataclasses.replace(m, q_positions=lift(m.q_positions), k_positions=lift(m.k_positions),
                            q_segments=lift(m.q_segments), k_segments=lift(m.k_segments), shape=(B, 1, T, S))
    out = m.dense_mask()
    out = jnp.ones((1, 1, T, S), bool) if out is None else out
    out = jnp.broadcast_to(out[:, 0], (B, T, S))
    return out if batched else out[0]


def causal_mask(query_positions, key_positions):
    """``mask[..., t, s] = key_positions[s] <= query_positions[t]``. Shape ``(..., T, S)``."""
    check_position_pair("query_positions", query_positions, "key_positions", key_positions)
    T, S = np.shape(query_positions)[-1], np.shape(key_positions)[-1]
    return _as_array(causal() & positions(query_positions, key_positions), query_positions, key_positions, T, S)


def window_mask(query_positions, key_positions, local_window_size: Window):
    """Keys within ``left`` positions before and ``right`` after the query. Shape ``(..., T, S)``."""
    left, right = normalize_window(local_window_size)
    check_position_pair("query_positions", query_positions, "key_positions", key_positions)
    T, S = np.shape(query_positions)[-1], np.shape(key_positions)[-1]
    return _as_array(window(left, right) & positions(query_positions, key_positions), query_positions,
                     key_positions, T, S)


def segment_mask(query_segment_ids, key_segment_ids):
    """Packed sequences: attend only within the same segment; negative ids are padding.
    Shape ``(..., T, S)``."""
    check_position_pair("query_segment_ids", query_segment_ids, "key_segment_ids", key_segment_ids)
    T, S = np.shape(query_segment_ids)[-1], np.shape(key_segment_ids)[-1]
    return _as_array(segments(query_segment_ids, key_segment_ids), query_segment_ids, key_segment_ids, T, S)


def padding_mask(lengths, seq_len: int, *, name: str = "lengths"):
    """``(B, seq_len)`` boolean, True where the position is inside the sequence's length."""
    _checks.check_integer(name, lengths)
    _checks.check_rank(name, lengths, 1, "(B,)")
    _checks.check_positive_int("seq_len", seq_len)
    return _within(jnp.asarray(lengths), seq_len)


def _within(lengths, n: int):
    """``(B, n)``: index < length."""
    return jnp.arange(n)[None, :] < lengths[:, None]


def length_mask(query_len: int, key_len: int, query_seq_lengths=None, key_value_seq_lengths=None):
    """Padding mask ``(B, T, S)`` from per-sequence lengths ``(B,)``; None when neither is given."""
    if query_seq_lengths is None and key_value_seq_lengths is None:
        return None
    for name, x in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is not None:
            _checks.check_integer(name, x)
            _checks.check_rank(name, x, 1, "(B,)")
    B = np.shape(query_seq_lengths if query_seq_lengths is not None else key_value_seq_lengths)[0]
    lift = lambda x: None if x is None else jnp.asarray(x, jnp.int32)
    m = Mask(q_lengths=lift(query_seq_lengths), kv_lengths=lift(key_value_seq_lengths), shape=(B, 1, query_len, key_len))
    return m.dense_mask()[:, 0]
