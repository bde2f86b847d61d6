"""How many bytes a device sends: counted in the traced program, not estimated.

:func:`bytes_sent` traces a function (``jax.make_jaxpr``; nothing runs or compiles) and adds up
the per-device operands of its collectives, inside ``shard_map`` bodies, loops (a ``scan`` body
counts ``length`` times) and derivative rules. Collectives that XLA implements itself are
counted with the usual ring algorithms over an axis of P devices:

=================================  =====================================
collective                         bytes one device sends
=================================  =====================================
``ppermute``                       its operand
``all_gather``                     its shard, to each of the P - 1 others
``reduce_scatter`` / ``psum_scatter``  (P - 1) / P of its operand
``psum`` (all-reduce)              2 (P - 1) / P of its operand
=================================  =====================================

Use it to check a sharding plan before running it: e.g. the ring of
:func:`flax_attn.parallel.ring_attention` sends, per device, P - 1 key/value blocks (with their
positions and segment ids) forward, and those again plus P float32 dK/dV blocks backward.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

_SENT = {
    "ppermute": lambda b, P: b,
    "all_gather": lambda b, P: (P - 1) * b,
    "reduce_scatter": lambda b, P: (P - 1) * b / P,
    "psum_scatter": lambda b, P: (P - 1) * b / P,
    "psum": lambda b, P: 2 * (P - 1) * b / P,
}


def bytes_sent(fn: Callable, *args, axis_size: int) -> dict:
    """Bytes one device sends while running ``fn(*args)``, by collective.

    Args:
      fn: a function of arrays (e.g. ``lambda q, k, v: ring_attention(q, k, v, mesh=mesh)``, or
        its ``jax.grad``).
      *args: arrays or ``jax.ShapeDtypeStruct``s (global shapes, as ``fn`` takes them).
      axis_size: P, the number of devices of the mesh axis the collectives run over.

    Returns:
      ``{collective name: bytes}`` (floats; empty if ``fn`` communicates nothing). A ``cond``
      counts its largest branch.

    Raises:
      ValueError: a collective inside a ``while`` loop (its trip count is unknown when traced).
    """
    import jax
    from jax.extend import core as jcore

    if not isinstance(axis_size, int) or axis_size < 1:
        raise ValueError(f"axis_size must be a positive int, got {axis_size!r}")

    def walk(jaxpr, times):
        found = {}
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name in _SENT:
                size = sum(int(np.prod(v.aval.shape)) * v.aval.dtype.itemsize for v in eqn.invars)
                found[name] = found.get(name, 0) + times * _SENT[name](size, axis_size)
            inner_times = times * (eqn.params["length"] if name == "scan" else 1)
            inner = [walk(s.jaxpr if isinstance(s, jcore.ClosedJaxpr) else s, inner_times)
                     for v in eqn.params.values() for s in (v if isinstance(v, (tuple, list)) else (v,))
                     if isinstance(s, (jcore.ClosedJaxpr, jcore.Jaxpr))]
            if name == "while" and any(inner):
                raise ValueError("a collective inside a while loop: its trip count is unknown when traced")
            if name == "cond" and inner:
                inner = [max(inner, key=lambda d: sum(d.values()))]
            for d in inner:
                for k, v in d.items():
                    found[k] = found.get(k, 0) + v
        return found

    return walk(jax.make_jaxpr(fn)(*args).jaxpr, 1)
