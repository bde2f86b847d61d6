"""Between Linen and NNX: the same parameters under the same names, so one set of weights (and
one converter, one checkpoint format, one PyTorch twin) serves both.

    variables = fa.nnx.to_linen(nnx_layer)                  # {'params': {...}}: Linen's tree
    nnx_layer = fa.nnx.from_linen(nnx_layer, variables)     # loads into an NNX module (in place)
    nnx_layer = fa.nnx.from_linen(linen_layer, variables)   # builds the NNX twin of a Linen module
    linen_layer = fa.nnx.linen_twin(nnx_layer)              # the Linen module with the same fields
    nnx_layer = fa.nnx.nnx_twin(linen_layer, rngs=nnx.Rngs(0))

Arrays are moved as they are (no copy, no dtype change). Loading is strict: missing,
unexpected and mis-shaped parameters are listed together in one
:class:`flax_attn.StateDictError`.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from flax_attn import _checks
from flax_attn.interop import StateDictError
from flax_attn.nnx import layers, textbook

_LINEN_TO_NNX: dict[type, type] = {}


def register(nnx_class: type) -> type:
    """Register an NNX class whose ``linen_class`` attribute names its Linen twin; its
    constructor takes the Linen twin's fields by name, plus ``rngs``."""
    if not (isinstance(nnx_class, type) and issubclass(nnx_class, nnx.Module)
            and isinstance(getattr(nnx_class, "linen_class", None), type)):
        raise TypeError(f"register takes an nnx.Module class with a linen_class attribute, got {nnx_class!r}")
    _LINEN_TO_NNX[nnx_class.linen_class] = nnx_class
    return nnx_class


for _cls in (layers.Attention, layers.LearnedPositionalEmbedding, textbook.SelfAttention_v1,
             textbook.SelfAttention_v2, textbook.CausalAttention, textbook.MultiHeadAttentionWrapper,
             textbook.MultiHeadAttention, textbook.TransformerMultiHeadAttention):
    register(_cls)


def _linen_fields(linen_class: type) -> list[str]:
    return [f.name for f in dataclasses.fields(linen_class) if f.name not in ("parent", "name")]


def nnx_class_of(linen_module) -> type:
    """The NNX twin class of a flax_attn Linen module (an instance or a class)."""
    cls = linen_module if isinstance(linen_module, type) else type(linen_module)
    for base in cls.__mro__:
        if base in _LINEN_TO_NNX:
            return _LINEN_TO_NNX[base]
    raise TypeError(f"{cls.__name__} has no NNX twin in flax_attn.nnx (register one with flax_attn.nnx.register)")


def linen_twin(module: nnx.Module) -> nn.Module:
    """The Linen module with ``module``'s configuration (its ``linen_class``, the same fields)."""
    cls = getattr(type(module), "linen_class", None)
    if cls is None:
        raise TypeError(f"{type(module).__name__} is not a flax_attn NNX module (no linen_class)")
    return cls(**{name: getattr(module, name) for name in _linen_fields(cls)})


def nnx_twin(linen_module: nn.Module, *, rngs: nnx.Rngs, **kwargs) -> nnx.Module:
    """A fresh NNX module with ``linen_module``'s configuration, initialised from ``rngs``.
    ``kwargs`` go to the constructor as well (``deterministic=``)."""
    cls = nnx_class_of(linen_module)
    fields = {name: getattr(linen_module, name) for name in _linen_fields(type(linen_module))}
    return cls(**fields, **kwargs, rngs=rngs)


def to_linen(module: nnx.Module) -> dict:
    """``{'params': ...}``: the module's ``nnx.Param``s as the nested dict its Linen twin takes
    (the same names: ``{'q_proj': {'kernel': ...}}``). The arrays themselves, not copies."""
    if not isinstance(module, nnx.Module):
        raise TypeError(f"to_linen takes an nnx.Module, got {type(module).__name__}")
    return {"params": nnx.to_pure_dict(nnx.state(module, nnx.Param))}


def _load(module: nnx.Module, params: Mapping) -> nnx.Module:
    state = nnx.state(module, nnx.Param)
    want = traverse_util.flatten_dict(nnx.to_pure_dict(state))
    got = traverse_util.flatten_dict(dict(params))
    name = lambda p: "/".join(str(k) for k in p)
    problems = [f"missing parameter {name(p)} (expected shape {tuple(np.shape(want[p]))})"
                for p in sorted(set(want) - set(got), key=name)]
    problems += [f"unexpected parameter {name(p)} with shape {tuple(np.shape(got[p]))}"
                 for p in sorted(set(got) - set(want), key=name)]
    problems += [f"parameter {name(p)} has shape {tuple(np.shape(got[p]))}, expected {tuple(np.shape(want[p]))}"
                 for p in sorted(set(got) & set(want), key=name) if tuple(np.shape(got[p])) != tuple(np.shape(want[p]))]
    floating = lambda x: jnp.issubdtype(_checks.dtype_of(x), jnp.floating)
    problems += [f"parameter {name(p)} has dtype {_checks.dtype_of(got[p])}, expected a floating dtype as the module's"
                 for p in sorted(set(got) & set(want), key=name) if floating(want[p]) and not floating(got[p])]
    if problems:
        raise StateDictError(f"params do not fit {type(module).__name__}:\n  " + "\n  ".join(problems))
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(got))
    nnx.update(module, state)
    return module


def from_linen(target, variables: Mapping, *, rngs: Optional[nnx.Rngs] = None, **kwargs) -> nnx.Module:
    """An NNX module holding Linen ``variables`` (``{'params': ...}`` or the params themselves).

    Args:
      target: an NNX module (any, not only flax_attn's): its parameters are replaced in place
        and it is returned; or an NNX class, built with ``kwargs`` and ``rngs``; or a flax_attn
        Linen module, whose NNX twin (the same fields, plus ``kwargs``) is built.
      variables: the Linen module's variables; the arrays are used as they are (dtype kept).
      rngs: for a module built here: its initialisation (overwritten) and its dropout stream.
        Default ``nnx.Rngs(0)``.

    Raises:
      StateDictError: listing every missing, unexpected or mis-shaped parameter, and every
        non-floating one where the module's is floating.
    """
    params = variables["params"] if "params" in variables else variables
    if isinstance(target, nnx.Module):
        if kwargs or rngs is not None:
            raise TypeError("from_linen: rngs and constructor arguments are for a class or a Linen module, "
                            "not for an NNX module that already exists")
        module = target
    elif isinstance(target, type) and issubclass(target, nnx.Module):
        module = target(**kwargs, rngs=nnx.Rngs(0) if rngs is None else rngs)
    elif isinstance(target, nn.Module):
        module = nnx_twin(target, rngs=nnx.Rngs(0) if rngs is None else rngs, **kwargs)
    else:
        raise TypeError(f"from_linen takes an NNX module or class or a flax_attn Linen module, got {target!r}")
    return _load(module, params)
