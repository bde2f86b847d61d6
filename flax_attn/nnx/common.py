"""What every flax_attn NNX module shares: parameters made from the Linen twin's specs, and
dropout keys.

Parameters: :func:`declare` turns the specs of a stage (:class:`flax_attn.layers.common.ParamSpec`,
nested dicts for submodules) into ``nnx.Param`` attributes (nested dicts into :class:`Params`
submodules), so ``nnx.state(module, nnx.Param)`` has the Linen params' tree and names;
:func:`params_of` reads it back as a plain dict for the stage.

Dropout (the NNX way, with flax_attn's explicit randomness): a module with ``dropout > 0``
keeps a fork of ``rngs.dropout`` from its constructor; a call takes ``deterministic`` (else the
module's ``deterministic`` attribute, set by the constructor, ``module.eval()``/``train()`` or
``nnx.view``) and optionally ``rngs`` (an ``nnx.Rngs``, an ``nnx.RngStream`` or a key), which
takes precedence over the stored stream. ``deterministic`` must be known when ``dropout > 0``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
from flax import nnx

from flax_attn.layers.common import ParamSpec, dropout_on

DROPOUT_HOW = "rngs=nnx.Rngs(dropout=key) (in the constructor or the call)"


class Params(nnx.Module):
    """A group of ``nnx.Param``s made from specs: a Linen submodule's parameters (``q_proj``
    with ``kernel`` and ``bias``). Holds parameters only; the owning module's stage uses them."""

    def __init__(self, specs: Mapping, *, param_dtype: Any, rngs: nnx.Rngs):
        declare(self, specs, param_dtype, rngs)


def declare(module: nnx.Module, specs: Mapping, param_dtype: Any, rngs: nnx.Rngs) -> None:
    """Make ``specs`` attributes of ``module``: a spec is an ``nnx.Param`` initialised from
    ``rngs.params()``, a nested dict a :class:`Params` submodule."""
    for name, spec in specs.items():
        if isinstance(spec, ParamSpec):
            setattr(module, name, nnx.Param(spec.init(rngs.params(), spec.shape, param_dtype)))
        else:
            setattr(module, name, Params(spec, param_dtype=param_dtype, rngs=rngs))


def params_of(module: nnx.Module) -> dict:
    """The module's parameters as the nested dict its stage (and its Linen twin) takes."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


class Dropout:
    """Mixin for modules with dropout on the attention weights (see the module docstring)."""

    def _init_dropout(self, rate: float, deterministic: Optional[bool], rngs) -> None:
        """Keep a fork of ``rngs``' dropout stream; none when ``rngs`` has none (an
        ``nnx.Rngs(params=...)``): the calls that drop must then pass ``rngs``."""
        self.deterministic = deterministic
        stream = None
        if rate > 0 and isinstance(rngs, nnx.Rngs):
            try:
                stream = rngs.dropout  # the 'dropout' stream, or the 'default' one
            except AttributeError:
                stream = None
        elif rate > 0 and rngs is not None:
            stream = rngs
        self.rngs = stream.fork() if stream is not None else nnx.data(None)

    def _resolve_deterministic(self, deterministic: Optional[bool]) -> Optional[bool]:
        return self.deterministic if deterministic is None else deterministic

    def _dropout_key(self, rate: float, deterministic: Optional[bool], rngs, owner: str):
        """The dropout key for this call, or None when dropout is off."""
        if not dropout_on(rate, self._resolve_deterministic(deterministic), owner, DROPOUT_HOW):
            return None
        source = self.rngs if rngs is None else rngs
        if source is None:
            raise ValueError(f"{owner} applies dropout (deterministic=False) but has no dropout key: pass {DROPOUT_HOW}")
        if isinstance(source, nnx.Rngs):
            return source.dropout()
        if isinstance(source, nnx.RngStream):
            return source()
        if isinstance(source, jax.Array):
            return source
        raise TypeError(f"{owner} rngs must be an nnx.Rngs, an nnx.RngStream or a PRNG key, got {type(source)}")

    def set_view(self, deterministic: Optional[bool] = None):
        """For ``nnx.view(module, deterministic=...)``."""
        if deterministic is not None:
            self.deterministic = deterministic
