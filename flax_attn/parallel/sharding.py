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

A model of one's own that contains these modules (a decoder, layers stacked by ``nn.scan``)
gets the same specs for each of them, with ``None`` for the stacked axis, and ``P()``
(replicated) for its other parameters: for Linen give the arguments of one call, which is
traced (``jax.eval_shape``) to find which flax_attn modules it runs and where their parameters
lie; an NNX model is walked as a graph:

    specs = partition_specs(model, variables, mesh=mesh, inputs=(x, positions))   # Linen
    specs = partition_specs(model, flax_attn.nnx.to_linen(model), mesh=mesh)      # NNX

Either axis may be a tuple of mesh axes (``model_axis=('x', 'y')``: heads over their product).
With ``mesh`` given, :func:`partition_specs` checks the head counts: N must be divisible by the
``model_axis`` size; key/value projections whose K heads are not (grouped-query attention with
few key/value heads) are replicated instead, as is usual. ``fsdp=True`` also splits the other
dimension of every split kernel over ``data_axis`` (ZeRO-3 / FSDP style: XLA gathers the weights
when used).
"""
from __future__ import annotations

from typing import Mapping, Optional, Tuple, Union

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


Axes = Union[str, Tuple[str, ...]]  # a mesh axis name, or several (split over their product)


def _heads(module):
    """(N, K) of a module with heads."""
    if isinstance(module, Attention):
        return module.config.num_heads, module.config.kv_heads
    if isinstance(module, MultiHeadLatentAttention):
        return module.config.num_heads, module.config.num_heads
    return module.num_heads, module.num_heads


def partition_specs(module, params, *, data_axis: Axes = "data", model_axis: Axes = "model", mesh=None,
                    fsdp: bool = False, inputs: Optional[tuple] = None, input_kwargs: Optional[Mapping] = None):
    """``PartitionSpec``s for the parameters of a flax_attn module, or of a model built of them:
    tensor parallel over heads.

    Args:
      module: a flax_attn Linen module (``Attention``, ``MultiHeadLatentAttention``,
        ``MultiHeadAttention``, ``TransformerMultiHeadAttention``, the other chapter modules,
        ``LearnedPositionalEmbedding``) or its NNX twin (``flax_attn.nnx.*``; then ``params`` is
        ``flax_attn.nnx.to_linen(module)``); or a model of your own that contains them: a Linen
        module (give ``inputs``, see below) or an NNX module (``params`` is
        ``flax_attn.nnx.to_linen(model)``, i.e. ``{'params': nnx.to_pure_dict(nnx.state(model,
        nnx.Param))}``). Each flax_attn module inside it gets the specs it would get alone, with
        ``None`` for leading axes its parameters have there (layers stacked by ``nn.scan`` or
        ``nnx.vmap`` along axis 0); every other parameter is replicated (``P()``: replace
        those you split yourself).
      params: the module's variables ``{'params': {...}}`` or the params dict itself (arrays or
        ``jax.ShapeDtypeStruct``s, e.g. from ``jax.eval_shape(module.init, ...)``).
      data_axis: the mesh axis (or tuple of axes) of the batch (used by parameters only with
        ``fsdp=True``).
      model_axis: the mesh axis (or tuple of axes, e.g. ``('x', 'y')``: split over their
        product) the heads are split over.
      mesh: optional; checks that the heads divide by the axis sizes (see the module docstring).
      fsdp: also split each split kernel's other dimension over ``data_axis``.
      inputs: for a Linen model that is not itself a flax_attn module: the positional arguments of
        one call of ``module.apply`` (arrays or ``jax.ShapeDtypeStruct``s; nothing is computed:
        the call is traced under ``jax.eval_shape`` to find which flax_attn modules it runs and
        where their parameters lie). ``input_kwargs``: its keyword arguments.

    Returns:
      The same tree as ``params`` with a ``PartitionSpec`` at every leaf (pass it to
      :func:`shard_params`, or turn it into ``NamedSharding``s with :func:`named_shardings`).

    Raises:
      TypeError for a Linen model that is not flax_attn's given without ``inputs``; ValueError
      for parameter names a flax_attn module does not have, a model that runs no flax_attn
      module, or N not divisible by the size of ``model_axis`` (with ``mesh``).
    """
    data_names, model_names = _names("data_axis", data_axis), _names("model_axis", model_axis)
    shared = sorted(set(data_names) & set(model_names))
    if shared:
        raise ValueError(f"data_axis and model_axis must differ, both are {data_axis!r}" if data_axis == model_axis
                         else f"data_axis {data_axis!r} and model_axis {model_axis!r} share mesh axes {shared}")
    # variables {'params': ..., other collections (replicated)} or the params dict itself
    wrapped = isinstance(params, Mapping) and "params" in params and all(isinstance(v, Mapping)
                                                                        for v in params.values())
    tree = params["params"] if wrapped else params
    if not isinstance(tree, Mapping):
        raise TypeError(f"params must be a dict of the module's parameters, got {type(tree).__name__}")
    _check_auto(mesh, (data_names + model_names) if fsdp else model_names)
    specs = jax.tree_util.tree_map(lambda _: P(), _plain(tree))
    variables = params if wrapped else {"params": tree}
    for path, sub, own in _flax_attn_modules(module, variables, inputs, input_kwargs):
        where = "/".join(str(k) for k in path)
        node, holder = tree, specs
        for k in path:
            if not isinstance(node, Mapping) or k not in node:
                raise ValueError(f"params have no entry {where!r}, where {type(module).__name__} runs "
                                 f"{type(sub).__name__}")
            node = node[k]
        for k in path[:-1]:
            holder = holder[k]
        sub_specs = _module_specs(sub, node, own, where, data_axis, model_axis, mesh, fsdp)
        if path:
            holder[path[-1]] = sub_specs
        else:
            specs = sub_specs
    if not wrapped:
        return specs
    return {c: specs if c == "params" else jax.tree_util.tree_map(lambda _: P(), _plain(v)) for c, v in params.items()}


def _names(arg: str, axes) -> tuple:
    """The mesh axis names of ``data_axis``/``model_axis``: a name or a tuple of names."""
    names = axes if isinstance(axes, tuple) else (axes,)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{arg} must be a mesh axis name or a tuple of them, got {axes!r}")
    return names


def _plain(tree):
    """``tree`` as nested dicts (a FrozenDict's or other Mapping's structure), to fill in."""
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in tree.items()}


def _flax_attn_modules(module, variables, inputs, input_kwargs):
    """``[(path, linen module, its own params' shapes or None)]``: the outermost flax_attn
    modules of ``module`` and where their parameters lie in ``variables['params']``."""
    own = _as_linen(module)
    if isinstance(own, (*_RULES, *_REPLICATED)):
        return [((), own, None)]
    from flax import nnx
    import flax.linen as nn

    if isinstance(module, nnx.Module):
        from flax_attn.nnx import linen_twin

        found = [(tuple(path), linen_twin(node), None) for path, node in nnx.iter_graph(module)
                 if isinstance(node, nnx.Module) and isinstance(getattr(type(node), "linen_class", None), type)
                 and issubclass(type(node).linen_class, (*_RULES, *_REPLICATED))]
    elif isinstance(module, nn.Module):
        if inputs is None:
            known = ", ".join(c.__name__ for c in (*_RULES, *_REPLICATED))
            raise TypeError(f"partition_specs knows flax_attn's modules ({known}); {type(module).__name__} is not one: "
                            f"to find the flax_attn modules inside it, pass inputs=(...), the positional arguments "
                            f"of one call (and input_kwargs={{...}})")
        found = _traced_modules(module, variables, tuple(inputs), dict(input_kwargs or {}))
    else:
        raise TypeError(f"partition_specs takes a flax_attn module or a Flax model (Linen or NNX), "
                        f"got {type(module).__name__}")
    found = sorted({path: (path, sub, shapes) for path, sub, shapes in found}.values(), key=lambda f: len(f[0]))
    outermost = []
    for path, sub, shapes in found:  # a flax_attn module inside another (the chapter's wrapper) goes with it
        if not any(path[:len(p)] == p for p, _, _ in outermost):
            outermost.append((path, sub, shapes))
    if not outermost:
        raise ValueError(f"{type(module).__name__} runs no flax_attn module: partition_specs splits flax_attn's "
                         f"modules by heads and nothing else")
    return outermost


def _traced_modules(module, variables, inputs, input_kwargs):
    """Trace one call of a Linen model (``jax.eval_shape``) and note each flax_attn module it runs."""
    import flax.linen as nn

    found = []

    def note(call, args, kwargs, context):
        result = call(*args, **kwargs)
        sub = context.module
        if isinstance(sub, (*_RULES, *_REPLICATED)) and context.method_name != "setup":
            shapes = jax.tree_util.tree_map(np.shape, sub.variables.get("params", {}))
            found.append((tuple(sub.scope.path), sub.clone(parent=None), shapes))
        return result

    shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _checks.dtype_of(x)),
                                    _plain(variables))
    # arrays (and ShapeDtypeStructs) are traced; other arguments (flags like deterministic=True) stay Python values
    leaves, structure = jax.tree_util.tree_flatten((inputs, input_kwargs))
    is_array = [isinstance(leaf, (np.ndarray, jax.Array, jax.ShapeDtypeStruct)) for leaf in leaves]

    def call(v, arrays):
        it = iter(arrays)
        args, kwargs = jax.tree_util.tree_unflatten(structure, [next(it) if a else leaf
                                                                for leaf, a in zip(leaves, is_array)])
        return module.apply(v, *args, **kwargs, rngs={"dropout": jax.random.key(0)})

    try:
        with nn.intercept_methods(note):
            jax.eval_shape(call, shapes, [leaf for leaf, a in zip(leaves, is_array) if a])
    except Exception as e:  # the model's own error, with what partition_specs was doing
        raise ValueError(f"partition_specs traced {type(module).__name__}.apply(params, *inputs, **input_kwargs) to "
                         f"find its flax_attn modules, and that call failed: {type(e).__name__}: {e}") from e
    return found


def _module_specs(module, tree, own, where, data_axis, model_axis, mesh, fsdp):
    """The specs of one flax_attn module's parameters ``tree`` (``own``: the shapes the module
    itself sees, when they may differ by leading stacked axes)."""
    name = type(module).__name__ + (f" at {where!r}" if where else "")
    if not isinstance(tree, Mapping):
        raise TypeError(f"params of {name} must be a dict, got {type(tree).__name__}")
    if isinstance(module, _REPLICATED):
        return jax.tree_util.tree_map(lambda _: P(), _plain(tree))
    rules = next(r for cls, r in _RULES.items() if isinstance(module, cls))
    unknown = sorted(set(tree) - set(rules))
    if unknown:
        raise ValueError(f"params of {name} have no entries {unknown}; expected names among {sorted(rules)}")
    N, K = _heads(module)
    model = _axis_size(mesh, model_axis)
    if model is not None and N % model:
        raise ValueError(f"{name} has N={N} query heads, not divisible by the {model} devices of "
                         f"mesh axis {model_axis!r}: tensor parallelism splits whole heads")
    kv_split = model is None or K % model == 0
    fs = data_axis if fsdp else None
    data = _axis_size(mesh, data_axis) if fsdp else None

    def other(dim):  # the non-head dimension of a kernel: split over data_axis with fsdp when it divides
        if fs is None or (data is not None and dim % data):
            return None
        return fs

    def spec(rule, path, leaf):
        if rule == "rep" or (rule == "kv" and not kv_split):
            return P()
        shape = np.shape(leaf)
        inner = _inner_shape(own, path, shape, name)
        lead = (None,) * (len(shape) - len(inner))  # stacked layers' axes
        if rule in ("q", "kv"):  # kernel (in, heads*H), bias (heads*H,)
            return P(*lead, other(inner[0]), model_axis) if path[-1] == "kernel" else P(*lead, model_axis)
        if rule == "out":        # kernel (heads*H, out), bias (out,)
            return P(*lead, model_axis, other(inner[1])) if path[-1] == "kernel" else P()
        if rule == "heads":      # embedding (buckets, N)
            return P(*lead, None, model_axis)
        raise AssertionError(rule)

    return {top: jax.tree_util.tree_map_with_path(
        lambda path, leaf, top=top: spec(rules[top], (top,) + tuple(_key(p) for p in path), leaf), _plain(sub)
        if isinstance(sub, Mapping) else sub)
        for top, sub in tree.items()}


def _inner_shape(own, path, shape, name):
    """A parameter's shape as its module sees it: ``shape`` less leading stacked axes, checked
    against what the module saw when traced (``own``), or by the rank its kind has (kernels 2,
    biases, scales and sinks 1, embeddings 2)."""
    if own is not None:
        node = own
        for k in path:
            node = node.get(k) if isinstance(node, Mapping) else None
        if node is not None:
            inner = tuple(node)
            if tuple(shape[len(shape) - len(inner):]) != inner:
                raise ValueError(f"parameter {'/'.join(map(str, path))} of {name} has shape {tuple(shape)}, which does "
                                 f"not end in the shape {inner} the module sees: only layers stacked along axis 0 "
                                 f"(nn.scan's variable_axes={{'params': 0}}) are understood")
            return inner
    rank = 2 if path[-1] in ("kernel", "embedding") else 1
    if len(shape) < rank:
        raise ValueError(f"parameter {'/'.join(map(str, path))} of {name} has shape {tuple(shape)}, fewer than the "
                         f"{rank} dims of a {path[-1]}")
    return tuple(shape[len(shape) - rank:])


def _key(p):
    return getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))


def _as_linen(module):
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax always has nnx here
        return module
    if isinstance(module, nnx.Module) and hasattr(type(module), "linen_class"):
        from flax_attn.nnx import linen_twin

        return linen_twin(module)
    return module


def _axis_size(mesh, axis) -> Optional[int]:
    """The number of devices along mesh axis ``axis`` (a name, or a tuple of names: their product)."""
    if mesh is None:
        return None
    size = 1
    for name in (axis if isinstance(axis, tuple) else (axis,)):
        if name not in mesh.axis_names:
            raise ValueError(f"mesh has axes {tuple(mesh.axis_names)}, not {name!r}")
        size *= mesh.shape[name]
    return size


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


def cache_partition_specs(cache, *, data_axis: Optional[Axes] = "data",
                          model_axis: Optional[Axes] = "model", mesh=None):
    """A :class:`flax_attn.KVCache` of ``PartitionSpec``s: keys and values split over the batch
    (``data_axis``) and, for ``layout='BSKH'`` (``(B, S, K, H)``), over the key/value heads
    (``model_axis``); the default layout ``'BKSH'`` stores ``(B*K, S, H)``, whose merged axis is
    split over the batch only (each device holds all heads of its sequences: for tensor-parallel
    decoding over heads create the cache with ``layout='BSKH'``), as is ``layout='blocks'``'s
    ``(S // block, B*K, block, H)`` on its second axis. Positions and segment ids ``(B, S)`` over
    the batch; the length replicated. Either axis may be None (not split), a mesh axis name or a
    tuple of names (split over their product).

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
    named = [_names(arg, a) for arg, a in (("data_axis", data_axis), ("model_axis", model_axis)) if a is not None]
    _check_auto(mesh, tuple(n for names in named for n in names))
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
