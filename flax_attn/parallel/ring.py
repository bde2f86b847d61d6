"""Context parallelism: attention over a sequence split across devices along a mesh axis.

Queries ``(B, T, N, H)`` and keys/values ``(B, S, K, H)`` are split along their length over the
P devices of one mesh axis (device r holds queries ``r*T/P .. (r+1)*T/P`` and the same slice of
the keys); each device computes the outputs of its own queries. Two methods:

* **ring** (Liu et al. 2023, "Ring Attention with Blockwise Transformers"): inside
  ``jax.shard_map`` each device keeps its query block and an online softmax (running maximum
  ``m``, sum ``l``, accumulator), and the key/value blocks, with their positions and segment ids,
  travel around the ring (``jax.lax.ppermute`` to the next device) for P steps. At every step the
  mask description classifies the visiting block (:meth:`flax_attn.core.Mask.block_kind`): an
  empty one is skipped (``lax.cond``); inside a block, sub-blocks of ``block_q x block_k`` are
  skipped, computed without a mask or masked, as in the blockwise core. The derivative is a
  ``jax.custom_vjp`` whose backward is a second ring pass in the manner of FlashAttention-2
  (Dao 2023): ``p = exp(s - m) / l`` is recomputed per query row from the saved ``m`` and ``l``,
  ``dq`` stays home, and ``dK``/``dV`` of the visiting block are accumulated and travel with it,
  arriving back at their owner after the P-th step. Memory per device is linear in the local
  length, forward and backward (no ``T x S`` array unless the caller passes a dense mask or bias).
* **allgather**: ``jax.lax.all_gather`` the keys and values (and their positions and segment
  ids), then run the ordinary core (:func:`flax_attn.core.dot_product_attention`, any
  registered implementation) on the local queries against all keys; JAX differentiates it
  (the transpose of the all-gather is a reduce-scatter). Simpler; holds all S keys per device.

**Masks.** The rules stay in :mod:`flax_attn.core.mask`. Before splitting, the global
description gives every token what the masks need: explicit positions (the default ones are
:func:`flax_attn.core.mask.default_positions`), segment ids, and visibility
(:meth:`~flax_attn.core.Mask.query_visible`, :meth:`~flax_attn.core.Mask.key_visible`: lengths
and padding), the latter carried as segment id -1 (padding: never attended, attends to nothing,
the description's own rule). These per-token arrays are split with the tokens and travel with
the keys, so for a device's queries against a visiting key block a description is bound with
those tokens' own positions and segment ids and asked for the block; dense masks and biases are
split by query rows (each device holds its ``T/P x S`` rows) and the visiting block's columns
are sliced. Because positions are explicit, any reordering of the tokens (the load balancing of
:mod:`flax_attn.parallel.balance`) leaves the masks correct.

Lengths index tokens in the order given; with a reordered sequence pass padding as segment ids
(:func:`flax_attn.parallel.balance.padding_segment_ids`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from flax_attn import _checks
from flax_attn.core import mask as mask_lib
from flax_attn.core import numerics
from flax_attn.core.attention import dot_product_attention
from flax_attn.core.blockwise import BlockedLengths
from flax_attn.core.mask import EMPTY, FULL, PARTIAL, Mask
from flax_attn.core.registry import Implementation, Result

METHODS = ("ring", "allgather")


# ---------------------------------------------------------------------------- the implementation


@dataclasses.dataclass(frozen=True)
class ContextParallel(Implementation):
    """Context-parallel attention, an implementation for ``dot_product_attention(implementation=)``.

    Fields:
      axis_name: the mesh axis the sequence is split over (P devices; T and S divisible by P).
      method: ``'ring'`` or ``'allgather'`` (see the module docstring).
      mesh: a ``jax.sharding.Mesh``; None takes the ambient one (``jax.set_mesh(mesh)``, also as
        ``with jax.set_mesh(mesh):``), looked up when the call is traced.
      batch_axis, head_axis: optionally also split the batch (data parallel) and the heads
        (tensor parallel: N and K divisible by the axis size) over these mesh axes, in the same
        ``shard_map``; None keeps them whole on every device of the other axes.
      block_q, block_k: the ring's sub-blocks within a device's block (memory and skipping
        granularity), as in :class:`flax_attn.core.Blockwise`.
      inner: the implementation the all-gather method runs locally (None: the automatic choice).

    **With jit.** The implementation runs a ``jax.shard_map`` over the mesh. Under ``jax.jit`` the
    inputs may have any sharding: XLA moves them to the layout of the ``shard_map``
    (``P(batch_axis, axis_name, head_axis, None)`` for query/key/value) and the output comes back
    in it, so a whole model jitted with activations sharded along the sequence runs without
    extra copies. Eagerly it runs as its own compiled program. The object is a frozen, hashable
    dataclass: pass it as ``implementation=`` to :func:`flax_attn.dot_product_attention` or as the
    ``implementation`` field of :class:`flax_attn.Attention` / :class:`flax_attn.MultiHeadAttention`.
    Reverse-mode derivatives (``jax.grad``, ``jax.vjp``) work; the ring's is a ``custom_vjp``, so
    forward mode (``jax.jvp``) is not available for it (it is for ``'allgather'``).

    **Causal load balancing.** Split in order, a causal mask gives device P-1 about 2P-1 times
    device 0's work; reorder the tokens first (:func:`flax_attn.parallel.load_balance`, zig-zag or
    striped) and pass their positions explicitly: the masks follow the positions, the sub-blocks
    a mask empties are skipped, and every device does the same work.

    **Memory per device** (ring): the local queries, keys, values and their gradients, one
    visiting block in flight, and ``block_q x block_k`` logits per (batch, head): linear in the
    local length, forward and backward. The all-gather holds all S keys and values.

    Not served: dropout; ``return_weights`` with the ring (the all-gather method returns them).
    """

    axis_name: str = "seq"
    method: str = "ring"
    mesh: Any = None
    batch_axis: Optional[str] = None
    head_axis: Optional[str] = None
    block_q: int = 256
    block_k: int = 256
    inner: Any = None
    name: str = "context_parallel"

    def __post_init__(self):
        _checks.check_one_of("method", self.method, METHODS)
        _checks.check_positive_int("block_q", self.block_q)
        _checks.check_positive_int("block_k", self.block_k)
        axes = [a for a in (self.axis_name, self.batch_axis, self.head_axis) if a is not None]
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis_name={self.axis_name!r}, batch_axis={self.batch_axis!r} and "
                             f"head_axis={self.head_axis!r} must be different mesh axes")

    # -- the registry's interface

    def preferred(self, call) -> bool:
        return False  # never the automatic choice: it needs a mesh axis, named by the user

    def supports(self, call) -> Optional[str]:
        if call.dropout_rate > 0.0:
            return "dropout (each device would draw its own mask)"
        m = call.mask
        if m.chunk is not None or m.mask_mods or m.score_mod is not None:
            return ("chunked attention, a mask_mod or a score_mod (the ring rebuilds each block's mask from "
                    "causal, window, positions and segment ids)")
        if call.return_weights and self.method == "ring":
            return "return_weights with method='ring' (use method='allgather', which returns them)"
        mesh = self.resolved_mesh()
        if mesh is None:
            return "a call without a mesh: pass ContextParallel(mesh=...) or run under jax.set_mesh(mesh)"
        names = tuple(mesh.axis_names)
        for field, axis in (("axis_name", self.axis_name), ("batch_axis", self.batch_axis),
                            ("head_axis", self.head_axis)):
            if axis is not None and axis not in names:
                return f"{field}={axis!r}: the mesh has axes {names}"
        size = lambda a: 1 if a is None else mesh.shape[a]
        Pn, Bn, Hn = size(self.axis_name), size(self.batch_axis), size(self.head_axis)
        q = f"query (B, T, N, H) = {(call.B, call.T, call.N, call.H)}"
        k = f"key (B, S, K, H) = {(call.B, call.S, call.K, call.H)}"
        if call.T % Pn:
            return f"{q}: its length T={call.T} is not divisible by the {Pn} devices of mesh axis {self.axis_name!r}"
        if call.S % Pn:
            return f"{k}: its length S={call.S} is not divisible by the {Pn} devices of mesh axis {self.axis_name!r}"
        if self.batch_axis is not None and (not isinstance(call.B, int) or call.B % Bn):
            return f"{q}: its batch B={call.B} is not divisible by the {Bn} devices of mesh axis {self.batch_axis!r}"
        if call.N % Hn or call.K % Hn:
            return (f"{q} and {k}: the heads N={call.N} and K={call.K} must both be divisible by the {Hn} "
                    f"devices of mesh axis {self.head_axis!r}")
        return None

    def resolved_mesh(self):
        """The mesh to run on (None if there is none).

        Inside ``jax.set_mesh(mesh)``: the ambient mesh, with its axis types (on explicit axes
        the inputs are resharded to the ``shard_map``'s specs first). Otherwise: the ``mesh``
        field with its axes made ``Auto``, so that arrays of any sharding go in and come out as
        ordinary (GSPMD-sharded) arrays, eagerly or under jit.
        """
        ambient = jax.sharding.get_abstract_mesh()
        if ambient is not None and not ambient.empty:
            if self.mesh is not None and (tuple(self.mesh.axis_names) != tuple(ambient.axis_names)
                                          or tuple(self.mesh.axis_sizes) != tuple(ambient.axis_sizes)):
                raise ValueError(f"ContextParallel(mesh=) has axes {dict(self.mesh.shape)} but the ambient mesh "
                                 f"(jax.set_mesh) has {dict(ambient.shape)}; pass mesh=None to use the ambient one")
            return ambient
        if self.mesh is None:
            return None
        if isinstance(self.mesh, jax.sharding.Mesh):
            return self.mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(self.mesh.axis_names))
        return self.mesh

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        problem = self.supports(call)
        if problem:
            raise ValueError(f"implementation='{self.name}' does not support {problem}")
        mesh = self.resolved_mesh()
        meta = token_metadata(call)
        cfg = _Config.of(call, self, mesh, meta)
        # jitted (inlined under an outer jit): eagerly, a shard_map would otherwise run op by op
        if self.method == "ring":
            out, lse = _ring_jit(cfg, query, key, value, meta)
            return Result(out=out, lse=lse if call.return_residual else None)
        out, weights, lse = _allgather_jit(cfg, call.return_weights, call.return_residual, self.inner,
                                           query, key, value, meta)
        return Result(out=out, lse=lse, weights=weights)


def context_parallel(mesh=None, axis_name: str = "seq", method: str = "ring", **fields) -> ContextParallel:
    """``ContextParallel(axis_name=, method=, mesh=, ...)``: the object to pass as ``implementation=``.

    ``mesh`` may be None to take the ambient mesh (``jax.set_mesh``) when the call is traced;
    other fields (``batch_axis``, ``head_axis``, ``block_q``, ``block_k``, ``inner``) as in
    :class:`ContextParallel`.
    """
    return ContextParallel(axis_name=axis_name, method=method, mesh=mesh, **fields)


def ring_attention(query, key, value, bias=None, mask=None, *, mesh=None, axis_name: str = "seq",
                   batch_axis=None, head_axis=None, block_q: int = 256, block_k: int = 256, **kwargs):
    """Ring attention: :func:`flax_attn.dot_product_attention` with the sequence split over
    ``axis_name`` of ``mesh``.

    Args:
      query: ``(B, T, N, H)``; key, value: ``(B, S, K, H)``; T and S divisible by the number P of
        devices along ``axis_name``; device r computes queries ``r T/P .. (r+1) T/P - 1``.
      bias, mask: as in :func:`flax_attn.dot_product_attention` (dense: each device holds its
        ``T/P x S`` rows).
      mesh: a ``jax.sharding.Mesh`` (None: the ambient mesh of ``jax.set_mesh``).
      axis_name, batch_axis, head_axis, block_q, block_k: see :class:`ContextParallel`.
      **kwargs: every keyword of :func:`flax_attn.dot_product_attention` (is_causal,
        local_window_size, query_positions, key_positions, query_segment_ids, key_segment_ids,
        query_seq_lengths, key_value_seq_lengths, scale, logit_softcap, precision,
        return_residual), with the same meaning.

    Returns:
      As :func:`flax_attn.dot_product_attention`: ``(B, T, N, H)`` (and the log-sum-exp
      ``(B, T, N)`` with ``return_residual=True``), split over the mesh like the query.
    """
    impl = ContextParallel(axis_name=axis_name, method="ring", mesh=mesh, batch_axis=batch_axis,
                           head_axis=head_axis, block_q=block_q, block_k=block_k)
    return dot_product_attention(query, key, value, bias, mask, implementation=impl, **kwargs)


def all_gather_attention(query, key, value, bias=None, mask=None, *, mesh=None, axis_name: str = "seq",
                         batch_axis=None, head_axis=None, inner=None, **kwargs):
    """All-gather context parallelism: every device gathers all keys and values (and their
    positions and segment ids) and runs the core on its ``T/P`` queries. Arguments and result as
    :func:`ring_attention` (``inner``: the core implementation to run locally; ``return_weights``
    is served, ``(B, N, T, S)``)."""
    impl = ContextParallel(axis_name=axis_name, method="allgather", mesh=mesh, batch_axis=batch_axis,
                           head_axis=head_axis, inner=inner)
    return dot_product_attention(query, key, value, bias, mask, implementation=impl, **kwargs)


# ---------------------------------------------------------------------------- per-token metadata


def token_metadata(call) -> dict:
    """What the masks of a bound call need, per token, from its description (global arrays).

    Returns a dict holding some of: ``q_positions`` ``(B, T)`` and ``k_positions`` ``(B, S)``
    (int32; when causal or windowed: the given ones or the description's defaults);
    ``q_segments`` ``(B, T)`` and ``k_segments`` ``(B, S)`` (int32: the given ids, 0 without,
    and -1 for every token the description's lengths or padding leave out); ``dense``
    ``(B|1, N|1, T|1, S|1)`` bool and ``bias`` (as bound). Lengths are folded into the segment
    ids, so the arrays can be split and reordered with their tokens.
    """
    m = call.mask
    B, T, S = call.B, call.T, call.S
    rows = lambda x, L: jnp.broadcast_to(jnp.asarray(x, jnp.int32).reshape((-1, L)), (B, L))
    meta = {}
    if m.uses_positions:
        dq, dk = mask_lib.default_positions(T, S)
        meta["q_positions"] = rows(dq if m.q_positions is None else m.q_positions, T)
        meta["k_positions"] = rows(dk if m.k_positions is None else m.k_positions, S)
    q_vis, k_vis = m.query_visible(), m.key_visible()
    if m.q_segments is not None or q_vis is not None or k_vis is not None:
        qs = jnp.zeros((B, T), jnp.int32) if m.q_segments is None else rows(m.q_segments, T)
        ks = jnp.zeros((B, S), jnp.int32) if m.k_segments is None else rows(m.k_segments, S)
        if q_vis is not None:
            qs = jnp.where(jnp.broadcast_to(q_vis, (B, T)), qs, -1)
        if k_vis is not None:
            ks = jnp.where(jnp.broadcast_to(k_vis, (B, S)), ks, -1)
        meta["q_segments"], meta["k_segments"] = qs, ks
    if m.dense is not None:
        meta["dense"] = m.dense
    if m.bias is not None:
        meta["bias"] = m.bias
    return meta


@dataclasses.dataclass(frozen=True)
class _Config(BlockedLengths):
    """Static facts of one context-parallel call (hashable: a custom_vjp's static argument)."""

    mesh: Any
    axis: str
    batch_axis: Optional[str]
    head_axis: Optional[str]
    P: int
    B: int   # local sizes, per device
    T: int
    S: int
    N: int
    K: int
    G: int
    causal: bool
    window: Optional[tuple]
    scale: float
    softcap: Optional[float]
    precision: Any
    bq: int
    bk: int
    keys: tuple      # which metadata are present
    dense_shape: Optional[tuple]
    bias_shape: Optional[tuple]

    @classmethod
    def of(cls, call, impl: ContextParallel, mesh, meta) -> "_Config":
        size = lambda a: 1 if a is None else mesh.shape[a]
        Pn = size(impl.axis_name)
        T, S = call.T // Pn, call.S // Pn
        return cls(mesh=mesh, axis=impl.axis_name, batch_axis=impl.batch_axis, head_axis=impl.head_axis, P=Pn,
                   B=call.B // size(impl.batch_axis), T=T, S=S, N=call.N // size(impl.head_axis),
                   K=call.K // size(impl.head_axis), G=call.G, causal=call.mask.causal, window=call.mask.window,
                   scale=call.scale, softcap=call.softcap, precision=call.precision,
                   bq=min(T, impl.block_q), bk=min(S, impl.block_k), keys=tuple(sorted(meta)),
                   dense_shape=None if "dense" not in meta else tuple(meta["dense"].shape),
                   bias_shape=None if "bias" not in meta else tuple(meta["bias"].shape))

    # specs of the shard_map
    def tokens(self):            # (B, L, heads, H)
        return P(self.batch_axis, self.axis, self.head_axis, None)

    def rows(self):              # (B, L)
        return P(self.batch_axis, self.axis)

    def per_query(self):         # (B, T, N)
        return P(self.batch_axis, self.axis, self.head_axis)

    def dense_spec(self, shape):  # (B|1, N|1, T|1, S|1): rows split with the queries, all columns
        pick = lambda d, a: a if d != 1 else None
        return P(pick(shape[0], self.batch_axis), pick(shape[1], self.head_axis), pick(shape[2], self.axis), None)

    def meta_specs(self):
        specs = {}
        for name in self.keys:
            if name in ("dense", "bias"):
                specs[name] = self.dense_spec(self.dense_shape if name == "dense" else self.bias_shape)
            else:
                specs[name] = self.rows()
        return specs


def _shard_map(cfg, f, in_specs, out_specs, check_vma=False):
    """``jax.shard_map`` over the call's mesh. On a mesh with explicit axes (``jax.make_mesh``'s
    default) the inputs are first resharded to ``in_specs`` (``jax.reshard``), as shard_map
    requires there; with auto axes it reshards them itself."""
    mapped = jax.shard_map(f, mesh=cfg.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma)
    explicit = any(t == jax.sharding.AxisType.Explicit for t in getattr(cfg.mesh, "axis_types", ()))
    if not explicit:
        return mapped

    def run(*args):
        place = lambda x, spec: x if x is None else jax.reshard(x, _sharding(cfg.mesh, spec))
        args = jax.tree_util.tree_map(place, args, in_specs, is_leaf=lambda x: x is None)
        return mapped(*args)
    return run


def _sharding(mesh, spec):
    return jax.sharding.NamedSharding(mesh, spec) if isinstance(mesh, jax.sharding.Mesh) else spec


# ---------------------------------------------------------------------------- all-gather


def _allgather(cfg: _Config, return_weights: bool, return_residual: bool, inner, query, key, value, meta):
    """All-gather attention over global arrays: ``(out, weights or None, lse or None)``."""
    def body(q, k, v, meta):
        gather = lambda x: lax.all_gather(x, cfg.axis, axis=1, tiled=True)
        rules = Mask(causal=cfg.causal, window=cfg.window)
        if "q_positions" in meta:
            rules = rules & mask_lib.positions(meta["q_positions"], gather(meta["k_positions"]))
        if "q_segments" in meta:
            rules = rules & mask_lib.segments(meta["q_segments"], gather(meta["k_segments"]))
        if "dense" in meta:
            rules = rules & mask_lib.dense(meta["dense"])
        res = dot_product_attention(q, gather(k), gather(v), meta.get("bias"), rules, scale=cfg.scale,
                                    logit_softcap=cfg.softcap, precision=cfg.precision,
                                    return_weights=return_weights, return_residual=return_residual,
                                    implementation=inner)
        return res if isinstance(res, tuple) else (res,)

    out_specs = [cfg.tokens()]
    if return_weights:
        out_specs.append(P(cfg.batch_axis, cfg.head_axis, cfg.axis, None))
    if return_residual:
        out_specs.append(cfg.per_query())
    f = _shard_map(cfg, body, in_specs=(cfg.tokens(), cfg.tokens(), cfg.tokens(), cfg.meta_specs()),
                   out_specs=tuple(out_specs))
    outs = list(f(query, key, value, meta))
    out = outs.pop(0)
    weights = outs.pop(0) if return_weights else None
    lse = outs.pop(0) if return_residual else None
    return out, weights, lse


_allgather_jit = jax.jit(_allgather, static_argnums=(0, 1, 2, 3))


# ---------------------------------------------------------------------------- the ring


def _block_mask(cfg: _Config, meta, kmeta, j) -> Mask:
    """The description of this device's queries against the key block that started on device
    ``j``: bound to ``(B, N, T/P, S/P)`` with the tokens' own positions and segment ids, the
    dense mask's and bias's columns of that block; padded to whole sub-blocks."""
    cols = lambda x: x if x.shape[3] == 1 else lax.dynamic_slice_in_dim(x, j * cfg.S, cfg.S, axis=3)
    m = Mask(q_positions=meta.get("q_positions"), k_positions=kmeta.get("k_positions"),
             q_segments=meta.get("q_segments"), k_segments=kmeta.get("k_segments"),
             dense=None if "dense" not in meta else cols(meta["dense"]),
             bias=None if "bias" not in meta else cols(meta["bias"]),
             causal=cfg.causal, window=cfg.window, shape=(cfg.B, cfg.N, cfg.T, cfg.S))
    return m.padded(cfg.Tp, cfg.Sp)


def _kind(cfg: _Config, m: Mask, q_start, bq: int, k_start, bk: int):
    """The kind of a block over the whole local batch: EMPTY if empty for every row, FULL if full
    for every row, PARTIAL otherwise."""
    kinds = jax.vmap(lambda b: m.block_kind(b, (0, cfg.N), q_start, bq, k_start, bk))(jnp.arange(cfg.B))
    return jnp.where(jnp.all(kinds == EMPTY), EMPTY, jnp.where(jnp.all(kinds == FULL), FULL, PARTIAL))


def _bias_tile(cfg: _Config, m: Mask, q_start, k_start):
    """``(B|1, K|1, G|1, bq|1, bk|1)`` bias of a sub-block (grouped heads), or None."""
    if m.bias is None:
        return None
    t = jax.vmap(lambda b: m.block_bias(b, (0, cfg.N), q_start, cfg.bq, k_start, cfg.bk))(jnp.arange(cfg.B))
    return numerics.group_heads(t, cfg.K)


def _allowed(cfg: _Config, m: Mask, q_start, k_start):
    """``(B, K|1, G|1, bq, bk)`` bool of a sub-block."""
    a = jax.vmap(lambda b: m.block(b, (0, cfg.N), q_start, cfg.bq, k_start, cfg.bk))(jnp.arange(cfg.B))
    return numerics.group_heads(a, cfg.K)


def _raw(cfg, qi, kj):
    acc = jnp.promote_types(qi.dtype, jnp.float32)
    return jnp.einsum("bkgqh,bksh->bkgqs", qi, kj, precision=cfg.precision, preferred_element_type=acc)


def _logits(cfg, m, qi, kj, q_start, k_start, masked):
    s = numerics.finish_logits(cfg, _raw(cfg, qi, kj), _bias_tile(cfg, m, q_start, k_start))
    if masked:
        s = jnp.where(_allowed(cfg, m, q_start, k_start), s, -jnp.inf)
    return s


def _local_layout(cfg, q, k, v):
    """(B, T, N, H) -> (B, K, G, Tp, H); (B, S, K, H) -> (B, K, Sp, H), zero-padded."""
    q = jnp.pad(q, ((0, 0), (0, cfg.Tp - cfg.T), (0, 0), (0, 0)))
    pad_k = lambda x: jnp.pad(x, ((0, 0), (0, cfg.Sp - cfg.S), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
    return numerics.group_queries(q, cfg.K), pad_k(k), pad_k(v)


def _to_tokens(cfg, x):
    """(B, K, G, Tp, ...) -> (B, T, N, ...)."""
    if x.ndim == 4:
        return numerics.ungroup(x[..., None])[:, : cfg.T, :, 0]
    return numerics.ungroup(x)[:, : cfg.T]


def _ring_perm(cfg):
    return [(d, (d + 1) % cfg.P) for d in range(cfg.P)]


def _split_meta(meta):
    """Query-side (stays) and key-side (travels) metadata."""
    kside = {n: meta[n] for n in ("k_positions", "k_segments") if n in meta}
    return {n: x for n, x in meta.items() if n not in kside}, kside


def _visit_forward(cfg, m, qg, kb, vb, state):
    """Online softmax of every local query against one visiting key block (sub-block by sub-block)."""
    acc_t = jnp.promote_types(qg.dtype, jnp.float32)
    nq, nk = cfg.Tp // cfg.bq, cfg.Sp // cfg.bk
    sl = lambda x, start, size, axis: lax.dynamic_slice_in_dim(x, start, size, axis=axis)

    def q_block(i, state):
        m_, l_, acc_ = state
        qs = i * cfg.bq
        qi = sl(qg, qs, cfg.bq, 3)

        def visit(masked):
            def f(j, st):
                mi, li, ai = st
                ks = j * cfg.bk
                s = _logits(cfg, m, qi, sl(kb, ks, cfg.bk, 2), qs, ks, masked)
                m_new = jnp.maximum(mi, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(mi - m_safe)
                pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(vb.dtype), sl(vb, ks, cfg.bk, 2),
                                precision=cfg.precision, preferred_element_type=acc_t)
                return m_new, li * alpha + jnp.sum(p, axis=-1), ai * alpha[..., None] + pv
            return f

        def body(j, st):
            kind = _kind(cfg, m, qs, cfg.bq, j * cfg.bk, cfg.bk)
            return lax.switch(kind, [lambda j, st: st, visit(False), visit(True)], j, st)

        st = (sl(m_, qs, cfg.bq, 3), sl(l_, qs, cfg.bq, 3), sl(acc_, qs, cfg.bq, 3))
        mi, li, ai = lax.fori_loop(0, nk, body, st)
        put = lambda x, y: lax.dynamic_update_slice_in_dim(x, y, qs, axis=3)
        return put(m_, mi), put(l_, li), put(acc_, ai)

    return lax.fori_loop(0, nq, q_block, state)


def _ring_forward_local(cfg: _Config, q, k, v, meta):
    """One device: its queries against every key block of the ring. Returns out (B, T, N, Hv) and
    m, l (B, T, N) (m = 0 where l = 0)."""
    r = lax.axis_index(cfg.axis)
    qmeta, kmeta = _split_meta(meta)
    qg, kb, vb = _local_layout(cfg, q, k, v)
    acc_t = jnp.promote_types(q.dtype, jnp.float32)
    shape = (cfg.B, cfg.K, cfg.G, cfg.Tp)
    state = (jnp.full(shape, -jnp.inf, acc_t), jnp.zeros(shape, acc_t), jnp.zeros(shape + (vb.shape[-1],), acc_t))

    def visit(i, state, kb, vb, kmeta):
        j = (r - i) % cfg.P  # the device the visiting block started on
        m = _block_mask(cfg, qmeta, kmeta, j)
        skip = _kind(cfg, m, 0, cfg.T, 0, cfg.S) == EMPTY
        return lax.cond(skip, lambda s: s, lambda s: _visit_forward(cfg, m, qg, kb, vb, s), state)

    def step(i, carry):
        state, kb, vb, kmeta = carry
        nxt = lax.ppermute((kb, vb, kmeta), cfg.axis, _ring_perm(cfg))  # sent while this block is used
        return (visit(i, state, kb, vb, kmeta),) + nxt

    state, kb, vb, kmeta = lax.fori_loop(0, cfg.P - 1, step, (state, kb, vb, kmeta))
    m_, l_, acc = visit(cfg.P - 1, state, kb, vb, kmeta)
    out = acc / jnp.where(l_ == 0, 1.0, l_)[..., None]
    m_ = jnp.where(l_ > 0, m_, 0.0)
    return _to_tokens(cfg, out).astype(q.dtype), _to_tokens(cfg, m_), _to_tokens(cfg, l_)


def _visit_backward(cfg, m, qg, dog, mg, ilg, dg, kb, vb, carry):
    """FlashAttention-2's backward of every local query against one visiting key block:
    accumulates dq (stays), dk, dv (travel) and the bias gradient of the block's columns."""
    acc_t = jnp.promote_types(qg.dtype, jnp.float32)
    nq, nk = cfg.Tp // cfg.bq, cfg.Sp // cfg.bk
    sl = lambda x, start, size, axis: lax.dynamic_slice_in_dim(x, start, size, axis=axis)
    mm = functools.partial(jnp.einsum, precision=cfg.precision, preferred_element_type=acc_t)

    def q_block(i, carry):
        dq, dk, dv, db = carry
        qs = i * cfg.bq
        qi, doi, mi, ili, di = (sl(x, qs, cfg.bq, 3) for x in (qg, dog, mg, ilg, dg))

        def visit(masked):
            def f(j):
                """The contributions of sub-block (i, j): to dq_i, dk_j, dv_j and the bias tile."""
                ks = j * cfg.bk
                kj, vj = sl(kb, ks, cfg.bk, 2), sl(vb, ks, cfg.bk, 2)
                finish = lambda raw, bias: numerics.finish_logits(cfg, raw, bias)
                s, pullback = jax.vjp(finish, _raw(cfg, qi, kj), _bias_tile(cfg, m, qs, ks))
                if masked:
                    s = jnp.where(_allowed(cfg, m, qs, ks), s, -jnp.inf)
                p = jnp.exp(s - mi[..., None]) * ili[..., None]
                dv_j = mm("bkgqs,bkgqh->bksh", p.astype(doi.dtype), doi)
                ds = p * (mm("bkgqh,bksh->bkgqs", doi, vj) - di[..., None])
                draw, dbias = pullback(ds)
                dq_i = mm("bkgqs,bksh->bkgqh", draw.astype(kj.dtype), kj)
                dk_j = mm("bkgqs,bkgqh->bksh", draw.astype(qi.dtype), qi)
                return dq_i, dk_j, dv_j, dbias
            return f

        shapes = jax.eval_shape(visit(True), 0)
        zero = lambda j: jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)

        def body(j, st):
            # the branches return only the contributions; accumulating outside the switch keeps
            # the full dk/dv (and bias) accumulators out of the conditional, updated in place
            dqi, dk, dv, db = st
            ks = j * cfg.bk
            c_dq, c_dk, c_dv, c_db = lax.switch(_kind(cfg, m, qs, cfg.bq, ks, cfg.bk),
                                                [zero, visit(False), visit(True)], j)
            add = lambda x, y: lax.dynamic_update_slice_in_dim(x, sl(x, ks, cfg.bk, 2) + y, ks, axis=2)
            if db is not None:
                db = _add_bias_tile(cfg, db, c_db, qs, ks)
            return dqi + c_dq, add(dk, c_dk), add(dv, c_dv), db

        dqi, dk, dv, db = lax.fori_loop(0, nk, body, (sl(dq, qs, cfg.bq, 3), dk, dv, db))
        return lax.dynamic_update_slice_in_dim(dq, dqi, qs, axis=3), dk, dv, db

    return lax.fori_loop(0, nq, q_block, carry)


def _add_bias_tile(cfg, db, dtile, q_start, k_start):
    """Add a sub-block's bias gradient ``(B|1, K|1, G|1, bq|1, bk|1)`` into the block's
    ``(B|1, N|1, Tp|1, Sp|1)`` accumulator (summing over the dims the bias broadcasts)."""
    b, k, g, t, s = dtile.shape
    dtile = dtile.reshape(b, k * g, t, s)
    if db.shape[0] == 1 and b != 1:
        dtile = jnp.sum(dtile, axis=0, keepdims=True)
    starts = (0, 0, q_start if db.shape[2] != 1 else 0, k_start if db.shape[3] != 1 else 0)
    old = lax.dynamic_slice(db, starts, dtile.shape)
    return lax.dynamic_update_slice(db, old + dtile.astype(db.dtype), starts)


def _ring_backward_local(cfg: _Config, q, k, v, meta, out, m_, l_, dout, dlse):
    """One device's share of the backward ring: returns dq, dk, dv (of its own blocks) and the
    gradient of its rows of the bias (or None)."""
    r = lax.axis_index(cfg.axis)
    qmeta, kmeta = _split_meta(meta)
    acc_t = jnp.promote_types(q.dtype, jnp.float32)
    qg, kb, vb = _local_layout(cfg, q, k, v)
    dog = numerics.group_queries(jnp.pad(dout, ((0, 0), (0, cfg.Tp - cfg.T), (0, 0), (0, 0))), cfg.K)
    per_row = lambda x: numerics.group_queries(jnp.pad(x, ((0, 0), (0, cfg.Tp - cfg.T), (0, 0)))[..., None],
                                               cfg.K)[..., 0]
    inv_l = jnp.where(l_ > 0, 1.0 / jnp.where(l_ > 0, l_, 1.0), 0.0)
    delta = jnp.sum(dout.astype(acc_t) * out.astype(acc_t), axis=-1) - dlse.astype(acc_t)
    mg, ilg, dg = per_row(m_), per_row(inv_l), per_row(delta)

    dq = jnp.zeros(qg.shape, acc_t)
    dkv = (jnp.zeros(kb.shape, acc_t), jnp.zeros(vb.shape, acc_t))
    bias = meta.get("bias")
    # bias gradient of one visiting block: (B|1, N|1, Tp|1, Sp|1), added into the rows' (.., S) after
    block_db = None if bias is None else tuple(
        d if d == 1 else n for d, n in zip(bias.shape, (bias.shape[0], bias.shape[1], cfg.Tp, cfg.Sp)))
    db_all = None if bias is None else jnp.zeros(bias.shape, acc_t)

    def visit(i, dq, db_all, kb, vb, kmeta, dk, dv):
        j = (r - i) % cfg.P
        m = _block_mask(cfg, qmeta, kmeta, j)
        skip = _kind(cfg, m, 0, cfg.T, 0, cfg.S) == EMPTY

        def run(args):
            dq, dk, dv, db_all = args
            db = None if bias is None else jnp.zeros(block_db, acc_t)
            dq, dk, dv, db = _visit_backward(cfg, m, qg, dog, mg, ilg, dg, kb, vb, (dq, dk, dv, db))
            if db is not None:
                db = db[:, :, : min(db.shape[2], cfg.T), : min(db.shape[3], cfg.S)]
                if bias.shape[3] == 1:
                    db_all = db_all + db
                else:
                    old = lax.dynamic_slice_in_dim(db_all, j * cfg.S, cfg.S, axis=3)
                    db_all = lax.dynamic_update_slice_in_dim(db_all, old + db, j * cfg.S, axis=3)
            return dq, dk, dv, db_all

        return lax.cond(skip, lambda a: a, run, (dq, dk, dv, db_all))

    def step(i, carry):
        dq, db_all, kb, vb, kmeta, dk, dv = carry
        nxt = lax.ppermute((kb, vb, kmeta), cfg.axis, _ring_perm(cfg))
        dq, dk, dv, db_all = visit(i, dq, db_all, kb, vb, kmeta, dk, dv)
        dk, dv = lax.ppermute((dk, dv), cfg.axis, _ring_perm(cfg))  # the gradients travel with their block
        return (dq, db_all) + nxt + (dk, dv)

    carry = lax.fori_loop(0, cfg.P - 1, step, (dq, db_all, kb, vb, kmeta) + dkv)
    dq, db_all, kb, vb, kmeta, dk, dv = carry
    dq, dk, dv, db_all = visit(cfg.P - 1, dq, db_all, kb, vb, kmeta, dk, dv)
    if cfg.P > 1:
        dk, dv = lax.ppermute((dk, dv), cfg.axis, _ring_perm(cfg))  # the P-th move: home
    from_kv = lambda x: x.transpose(0, 2, 1, 3)[:, : cfg.S]
    dbias = None
    if bias is not None:
        # rows the bias broadcasts over (T, batch, heads) were summed here; sum over their devices
        shape = cfg.bias_shape  # the global shape: a local dim of 1 may just be a split one
        axes = tuple(a for a, d in ((cfg.axis, shape[2]), (cfg.batch_axis, shape[0]), (cfg.head_axis, shape[1]))
                     if a is not None and d == 1)
        dbias = (lax.psum(db_all, axes) if axes else db_all).astype(bias.dtype)
    return (_to_tokens(cfg, dq).astype(q.dtype), from_kv(dk).astype(k.dtype), from_kv(dv).astype(v.dtype), dbias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Config, q, k, v, meta):
    """Ring attention over global arrays: ``(out (B, T, N, Hv), lse (B, T, N))``."""
    return _ring_fwd(cfg, q, k, v, meta)[0]


def _ring_fwd(cfg, q, k, v, meta):
    f = _shard_map(cfg, functools.partial(_ring_forward_local, cfg),
                   in_specs=(cfg.tokens(),) * 3 + (cfg.meta_specs(),),
                   out_specs=(cfg.tokens(), cfg.per_query(), cfg.per_query()))
    out, m_, l_ = f(q, k, v, meta)
    lse = jnp.where(l_ > 0, m_ + jnp.log(jnp.where(l_ > 0, l_, 1.0)), -jnp.inf)
    return (out, lse), (q, k, v, meta, out, m_, l_)


def _ring_bwd(cfg, res, cotangents):
    q, k, v, meta, out, m_, l_ = res
    dout, dlse = cotangents
    has_bias = "bias" in meta
    f = _shard_map(cfg, functools.partial(_ring_backward_local, cfg),
                   in_specs=(cfg.tokens(),) * 3 + (cfg.meta_specs(), cfg.tokens(), cfg.per_query(), cfg.per_query(),
                                                   cfg.tokens(), cfg.per_query()),
                   out_specs=(cfg.tokens(),) * 3 + ((cfg.dense_spec(cfg.bias_shape),) if has_bias else (None,)))
    dlse = jnp.where(jnp.isfinite(dlse), dlse, 0.0) if dlse is not None else jnp.zeros_like(m_)
    dq, dk, dv, dbias = f(q, k, v, meta, out, m_, l_, dout.astype(q.dtype), dlse.astype(m_.dtype))
    dmeta = {name: (dbias if name == "bias" else None) for name in meta}
    return dq, dk, dv, dmeta


_ring.defvjp(_ring_fwd, _ring_bwd)
_ring_jit = jax.jit(_ring, static_argnums=0)
