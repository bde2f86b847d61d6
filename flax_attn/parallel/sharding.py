"""Sharded layers: data parallel over the batch, tensor parallel over the heads, under ``jax.jit``.

Megatron-style tensor parallelism for attention (Shoeybi et al. 2019): the query, key and value
projections are split by their *output* features, which are the heads, so each device computes
whole heads; the output projection is split by its *input* features (the same heads), so each
device multiplies its heads' outputs and XLA sums the partial products (one all-reduce per
layer). Activations ``(B, T, D)`` are split over the batch.

    mesh = make_mesh((2, 4), ("data", "model"))             # jax.make_mesh with Auto axes
    specs = partition_specs(layer, variables)               # PartitionSpecs, named by the module
    variables = shard_params(variables, specs, mesh)        # jax.device_put with NamedShardings
    x = shard_batch(x, mesh)                                # (B, T, D): B over 'data'
    y = jax.jit(layer.apply)(variables, x, positions)       # XLA partitions the program (GSPMD)

The layers themselves are unchanged: under ``jax.jit`` XLA's SPMD partitioner (GSPMD) propagates
the shardings of the parameters and inputs through the program, so the results are those of one
device (up to the order of floating-point sums). That needs mesh axes of type ``Auto``
(:func:`make_mesh`): on ``Explicit`` axes (``jax.make_mesh``'s default in recent JAX, "sharding in
types") JAX asks every ambiguous operation inside the layers (gathers, contractions over a split
dimension) for an ``out_sharding``, which they do not give. A KV cache is split the same way
(:func:`cache_partition_specs`: batch over ``data_axis``, key/value heads over ``model_axis``).

Which parameters split (``kernel`` is ``(in, out)``):

* ``Attention``: ``q_proj``, ``k_proj``, ``v_proj`` by output features (``kernel (D, heads*H)``
  and ``bias``), ``rel_bias`` ``(buckets, N)`` by N; ``o_proj.kernel (N*H, D)`` by input
  features; ``o_proj.bias``, ``q_norm``, ``k_norm``, ``sinks`` replicated.
* ``MultiHeadAttention`` (the chapter's): ``W_query``, ``W_key``, ``W_value`` by output
  features; ``out_proj.kernel`` by input features; ``out_proj.bias`` replicated.
* ``TransformerMultiHeadAttention``: ``W_q``, ``W_k``, ``W_v`` by output features; ``W_o.kernel``
  by input features; ``W_o.bias`` replicated.
* ``MultiHeadLatentAttention``: ``q_proj`` or ``q_b_proj`` and ``kv_b_proj`` by output features
  (per-head query, key and value dims), ``o_proj.kernel`` by input features; the latent
  projections ``q_a_proj`` and ``kv_a_proj_with_mqa``, the norms and ``o_proj.bias`` replicated
  (each device computes the whole latent, shared by its heads).
* ``SelfAttention_v1/v2``, ``CausalAttention``, ``MultiHeadAttentionWrapper``,
  ``LearnedPositionalEmbedding``: replicated (one head per array: nothing to split by heads;
  their inputs are still split over the batch).

With ``mesh`` given, :func:`partition_specs` checks the head counts: N must be divisible by the
``model_axis`` size; key/value projections whose K heads are not (grouped-query attention with
few key/value heads) are replicated instead, as is usual. ``fsdp=True`` also splits the other
dimension of every split kernel over ``data_axis`` (ZeRO-3 / FSDP style: XLA gathers the weights
when used).
"""
from __future__ import annotations

from typing import Mapping, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_attn import _checks
from flax_attn.layers import Attention, KVCache, LatentKVCache, LearnedPositionalEmbedding, MultiHeadLatentAttention
from flax_attn.textbook import (CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttention_v1,
                                SelfAttention_v2, TransformerMultiHeadAttention)

# How each top-level parameter of a module splits: 'q' (output features = query heads),
# 'kv' (output features = key/value heads), 'out' (input features = heads), 'heads' (an
# embedding (buckets, N) whose columns are heads), 'rep' (replicated).
_RULES = {
    Attention: {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "o_proj": "out", "q_norm": "rep", "k_norm": "rep",
                "sinks": "rep",
                "rel_bias": "heads"},
    MultiHeadAttention: {"W_query": "q", "W_key": "q", "W_value": "q", "out_proj": "out"},
    TransformerMultiHeadAttention: {"W_q": "q", "W_k": "q", "W_v": "q", "W_o": "out"},
    # the latent projections (q_a_proj, kv_a_proj_with_mqa) are shared by every head
    MultiHeadLatentAttention: {"q_proj": "q", "q_a_proj": "rep", "q_a_layernorm": "rep", "q_b_proj": "q",
                               "kv_a_proj_with_mqa": "rep", "kv_a_layernorm": "rep", "kv_b_proj": "q",
                               "o_proj": "out"},
}
_REPLICATED = (SelfAttention_v1, SelfAttention_v2, CausalAttention, MultiHeadAttentionWrapper,
               LearnedPositionalEmbedding)


def _heads(module):
    """(N, K) of a module with heads."""
    if isinstance(module, Attention):
        return module.config.num_heads, module.config.kv_heads
    if isinstance(module, MultiHeadLatentAttention):
        return module.config.num_heads, module.config.num_heads
    return module.num_heads, module.num_heads


def partition_specs(module, params, *, data_axis: str = "data", model_axis: str = "model", mesh=None,
                    fsdp: bool = False):
    """``PartitionSpec``s for a flax_attn module's parameters: tensor parallel over heads.

    Args:
      module: a flax_attn Linen module (``Attention``, ``MultiHeadLatentAttention``,
        ``MultiHeadAttention``, ``TransformerMultiHeadAttention``, the other chapter modules,
        ``LearnedPositionalEmbedding``)
        or its NNX twin (``flax_attn.nnx.*``; then ``params`` is ``flax_attn.nnx.to_linen(module)``).
      params: the module's variables ``{'params': {...}}`` or the params dict itself (arrays or
        ``jax.ShapeDtypeStruct``s, e.g. from ``jax.eval_shape(module.init, ...)``).
      data_axis: the mesh axis of the batch (used by parameters only with ``fsdp=True``).
      model_axis: the mesh axis the heads are split over.
      mesh: optional; checks that the heads divide by the axis sizes (see the module docstring).
      fsdp: also split each split kernel's other dimension over ``data_axis``.

    Returns:
      The same tree as ``params`` with a ``PartitionSpec`` at every leaf (pass it to
      :func:`shard_params`, or turn it into ``NamedSharding``s with :func:`named_shardings`).

    Raises:
      TypeError for a module that is not flax_attn's; ValueError for parameter names the module
      does not have, or N not divisible by the size of ``model_axis`` (with ``mesh``).
    """
    module = _as_linen(module)
    if data_axis == model_axis:
        raise ValueError(f"data_axis and model_axis must differ, both are {data_axis!r}")
    wrapped = isinstance(params, Mapping) and set(params) == {"params"}
    tree = params["params"] if wrapped else params
    if not isinstance(tree, Mapping):
        raise TypeError(f"params must be a dict of the module's parameters, got {type(tree).__name__}")
    if isinstance(module, _REPLICATED):
        specs = jax.tree_util.tree_map(lambda _: P(), dict(tree))
        return {"params": specs} if wrapped else specs
    rules = next((r for cls, r in _RULES.items() if isinstance(module, cls)), None)
    if rules is None:
        known = ", ".join(c.__name__ for c in (*_RULES, *_REPLICATED))
        raise TypeError(f"partition_specs knows flax_attn's modules ({known}), got {type(module).__name__}")
    unknown = sorted(set(tree) - set(rules))
    if unknown:
        raise ValueError(f"params of {type(module).__name__} have no entries {unknown}; "
                         f"expected names among {sorted(rules)}")
    N, K = _heads(module)
    _check_auto(mesh, (data_axis, model_axis) if fsdp else (model_axis,))
    model = _axis_size(mesh, model_axis)
    if model is not None and N % model:
        raise ValueError(f"{type(module).__name__} has N={N} query heads, not divisible by the {model} devices of "
                         f"mesh axis {model_axis!r}: tensor parallelism splits whole heads")
    kv_split = model is None or K % model == 0
    fs = data_axis if fsdp else None
    if fsdp and mesh is not None:
        data = _axis_size(mesh, data_axis)

    def other(dim):  # the non-head dimension of a kernel: split over data_axis with fsdp when it divides
        if fs is None or (mesh is not None and dim % data):
            return None
        return fs

    def spec(rule, path, leaf):
        shape = np.shape(leaf)
        name = path[-1]
        if rule == "rep" or (rule == "kv" and not kv_split):
            return P()
        if rule in ("q", "kv"):  # kernel (in, heads*H), bias (heads*H,)
            return P(other(shape[0]), model_axis) if name == "kernel" else P(model_axis)
        if rule == "out":        # kernel (heads*H, out), bias (out,)
            return P(model_axis, other(shape[1])) if name == "kernel" else P()
        if rule == "heads":      # embedding (buckets, N)
            return P(None, model_axis)
        raise AssertionError(rule)

    specs = {top: jax.tree_util.tree_map_with_path(
        lambda path, leaf, top=top: spec(rules[top], (top,) + tuple(_key(p) for p in path), leaf), sub)
        for top, sub in tree.items()}
    return {"params": specs} if wrapped else specs


def _key(p):
    return getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))


def _as_linen(module):
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax always has nnx here
        return module
    if isinstance(module, nnx.Module):
        from flax_attn.nnx import linen_twin

        return linen_twin(module)
    return module


def _axis_size(mesh, axis) -> Optional[int]:
    if mesh is None:
        return None
    if axis not in mesh.axis_names:
        raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}, not {axis!r}")
    return mesh.shape[axis]


def _check_auto(mesh, axes) -> None:
    if mesh is None:
        return
    types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
    explicit = [a for a in axes if a in types and types[a] == jax.sharding.AxisType.Explicit]
    if explicit:
        raise ValueError(f"mesh axes {explicit} are Explicit: flax_attn's layers are partitioned by XLA (GSPMD), "
                         f"which needs Auto axes; make the mesh with flax_attn.parallel.make_mesh(...) or "
                         f"jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)")


def make_mesh(axis_shapes, axis_names, *, devices=None):
    """``jax.make_mesh(axis_shapes, axis_names)`` with every axis of type ``Auto``: the mesh for
    sharded layers (XLA propagates the shardings; see the module docstring). E.g.
    ``make_mesh((2, 4), ('data', 'model'))`` over 8 devices."""
    types = (jax.sharding.AxisType.Auto,) * len(axis_names)
    return jax.make_mesh(tuple(axis_shapes), tuple(axis_names), axis_types=types, devices=devices)


def _is_spec(x) -> bool:
    return isinstance(x, P)


def named_shardings(specs, mesh):
    """``NamedSharding(mesh, spec)`` at every ``PartitionSpec`` leaf (for ``jax.jit``'s
    ``in_shardings``/``out_shardings`` or ``jax.device_put``)."""
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def shard_params(tree, specs, mesh):
    """Place a pytree (parameters, inputs, a :class:`flax_attn.KVCache`) on ``mesh`` by ``specs``
    (the same tree with ``PartitionSpec`` leaves): ``jax.device_put`` with ``NamedSharding``s.

    Raises ValueError naming the array when a split dimension is not divisible by its mesh axes.
    """
    flat_specs = jax.tree_util.tree_flatten_with_path(specs, is_leaf=_is_spec)[0]
    leaves = jax.tree_util.tree_structure(specs, is_leaf=_is_spec).flatten_up_to(tree)
    for (path, spec), x in zip(flat_specs, leaves):
        shape, name = np.shape(x), jax.tree_util.keystr(path) or "the array"
        if len(spec) > len(shape):
            raise ValueError(f"{name} of shape {shape} has fewer dims than its spec {spec}")
        for d, axes in enumerate(spec):
            if axes is None:
                continue
            names = axes if isinstance(axes, tuple) else (axes,)
            n = int(np.prod([_axis_size(mesh, a) for a in names]))
            if shape[d] % n:
                raise ValueError(f"{name} of shape {shape}: dim {d} ({shape[d]}) is not "
                                 f"divisible by the {n} devices of mesh axis {axes!r} (spec {spec})")
    return jax.device_put(tree, named_shardings(specs, mesh))


def batch_specs(tree, *, data_axis: str = "data"):
    """``P(data_axis)`` for every array of ``tree`` (inputs ``(B, ...)``: split over the batch);
    scalars are replicated."""
    return jax.tree_util.tree_map(lambda x: P(data_axis) if np.ndim(x) else P(), tree)


def shard_batch(tree, mesh, *, data_axis: str = "data"):
    """Split every array of ``tree`` (``(B, ...)``: activations, positions, segment ids) over the
    batch along ``data_axis`` (data parallelism)."""
    return shard_params(tree, batch_specs(tree, data_axis=data_axis), mesh)


def cache_partition_specs(cache, *, data_axis: Optional[str] = "data",
                          model_axis: Optional[str] = "model", mesh=None):
    """A :class:`flax_attn.KVCache` of ``PartitionSpec``s: keys and values split over the batch
    (``data_axis``) and, for ``layout='BSKH'`` (``(B, S, K, H)``), over the key/value heads
    (``model_axis``); the default layout ``'BKSH'`` stores ``(B*K, S, H)``, whose merged axis is
    split over the batch only (each device holds all heads of its sequences: for tensor-parallel
    decoding over heads create the cache with ``layout='BSKH'``), as is ``layout='blocks'``'s
    ``(S // block, B*K, block, H)`` on its second axis. Positions and segment ids ``(B, S)`` over
    the batch; the length replicated. Either axis may be None (not split).

    With ``mesh`` given, a ``'BSKH'`` cache whose K key/value heads are not divisible by the
    size of ``model_axis`` keeps its heads whole (replicated over that axis), as
    :func:`partition_specs` does for the key/value projections that fill it; without ``mesh``
    the heads are split and :func:`shard_params` refuses a K that does not divide.

    A :class:`flax_attn.LatentKVCache` (multi-head latent attention) gives one of
    ``PartitionSpec``s: its latents ``(B, S, r_kv + d_r)``, shared by all heads, split over the
    batch only.

    The sequence axis S stays whole: each device holds all cached positions of its sequences and
    heads, so a decoding step needs no communication inside attention.
    """
    rows = dict(positions=P(data_axis, None), segment_ids=P(data_axis, None), length=P())
    if isinstance(cache, LatentKVCache):
        return cache.replace(latent=P(data_axis, None, None), **rows)
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache_partition_specs takes a KVCache or a LatentKVCache, got {type(cache).__name__}")
    _check_auto(mesh, tuple(a for a in (data_axis, model_axis) if a is not None))
    if cache.layout == "BSKH":
        _checks.check_rank("cache.key", cache.key, 4, "(B, S, K, H)")
        model = _axis_size(mesh, model_axis) if model_axis is not None else None
        heads = None if model is not None and cache.key.shape[2] % model else model_axis  # as the k/v projections
        kv = P(data_axis, None, heads, None)
    elif cache.layout == "blocks":  # (S // block, B*K, block, H): the batch-major units of every block
        kv = P(None, data_axis, None, None)
    else:  # (B*K, S, H), batch-major: whole sequences (all their heads) per shard of the batch
        kv = P(data_axis, None, None)
    return cache.replace(key=kv, value=kv, **rows)


__all__ = ["batch_specs", "cache_partition_specs", "make_mesh", "named_shardings", "partition_specs", "shard_batch",
           "shard_params"]
