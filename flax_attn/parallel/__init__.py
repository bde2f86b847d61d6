"""Past one device, on JAX's own SPMD machinery.

* :mod:`~flax_attn.parallel.sharding`: every flax_attn module under ``jax.jit`` with parameters
  and activations sharded over a ``jax.sharding.Mesh``: data parallel over the batch, tensor
  parallel over the heads (:func:`make_mesh`, :func:`partition_specs`, :func:`shard_params`,
  :func:`shard_batch`, :func:`cache_partition_specs` for a sharded KV cache).
* :mod:`~flax_attn.parallel.ring`: context parallelism, the sequence split over a mesh axis:
  :func:`ring_attention` (key/value blocks passed around a ring, online softmax, a second ring
  for the backward), :func:`all_gather_attention`, and :func:`context_parallel`, an
  implementation object for ``dot_product_attention(implementation=...)`` and the layers'
  ``implementation`` field.
* :mod:`~flax_attn.parallel.volume`: :func:`bytes_sent`, the bytes a device sends, counted in
  the traced program.
* :mod:`~flax_attn.parallel.balance`: zig-zag / striped reordering of the sequence so that a
  causal mask leaves no device idle (:func:`load_balance`, :func:`restore_order`).

    mesh = jax.make_mesh((8,), ("seq",))
    out = ring_attention(q, k, v, mesh=mesh, axis_name="seq", is_causal=True)   # (B, T, N, H)
    layer = fa.Attention(config, implementation=context_parallel(mesh, "seq"))
"""
from flax_attn.parallel.balance import load_balance, padding_segment_ids, permutation, restore_order
from flax_attn.parallel.ring import (ContextParallel, all_gather_attention, context_parallel, ring_attention,
                                     token_metadata)
from flax_attn.parallel.sharding import (batch_specs, cache_partition_specs, make_mesh, named_shardings,
                                         partition_specs, shard_batch, shard_params)
from flax_attn.parallel.volume import bytes_sent

__all__ = [
    "ContextParallel",
    "all_gather_attention",
    "batch_specs",
    "bytes_sent",
    "cache_partition_specs",
    "context_parallel",
    "load_balance",
    "make_mesh",
    "named_shardings",
    "padding_segment_ids",
    "partition_specs",
    "permutation",
    "restore_order",
    "ring_attention",
    "shard_batch",
    "shard_params",
    "token_metadata",
]
