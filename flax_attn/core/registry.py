"""The registry of attention implementations.

An implementation is an object with

* ``name``: what users pass as ``implementation='...'``;
* ``supports(call) -> str | None``: why it cannot serve a :class:`~flax_attn.core.call.Call`
  (a phrase completing "does not support ..."), or None;
* ``runs_on(platform) -> bool``: whether it can run at all on ``'cpu'``, ``'gpu'`` or ``'tpu'``;
* ``preferred(call) -> bool``: whether the automatic choice should take it for this call when
  it supports it (speed, not correctness: e.g. "on CPU from 128 tokens");
* ``__call__(call, query, key, value, dropout_rng) -> Result``.

Its tuning knobs (block sizes, thresholds) are its own fields. The automatic choice walks the
registry in order and takes the first implementation that supports the call and prefers it;
the last entry, the plain XLA path, serves everything. Adding an implementation is one file
and one :func:`register` call.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from flax_attn import _checks


@dataclasses.dataclass
class Result:
    """What an implementation returns: ``out`` ``(B, T, N, Hv)``; ``lse`` ``(B, T, N)`` (float32+,
    -inf where nothing is attended) when ``call.return_residual``; ``weights`` ``(B, N, T, S)``
    when ``call.return_weights``."""

    out: Any
    lse: Any = None
    weights: Any = None


class Implementation:
    """Base class: serves nothing unless told otherwise. Subclasses are frozen dataclasses."""

    name: str = "?"
    # True: keys and values that no query may use (past the lengths, negative segment ids, an
    # all-False column of the mask) cannot reach the result even if they hold NaN or Inf, because
    # the implementation zeroes what it reads of them itself (or never reads them); the caller's
    # zeroing pass over every key and value (a read and a write of the whole key/value arrays) is
    # then skipped
    zeroes_blocked_keys: bool = False

    def supports(self, call) -> Optional[str]:
        return None

    def runs_on(self, platform: str) -> bool:
        return True

    def preferred(self, call) -> bool:
        return True

    def __call__(self, call, query, key, value, dropout_rng) -> Result:  # pragma: no cover - interface
        raise NotImplementedError


def refuses_dropout_and_weights(call) -> Optional[str]:
    """The reason an implementation without dropout and without returned weights (the plain
    path has both) gives for a call that asks for either, else None."""
    if call.dropout_rate > 0.0:
        return "dropout (use implementation='xla' or None)"
    if call.return_weights:
        return "return_weights (use implementation='xla' or None)"
    return None


_REGISTRY: list[Implementation] = []


def register(impl: Implementation, *, before: Optional[str] = None) -> Implementation:
    """Add ``impl`` to the registry (before the one named ``before``, else before the plain path,
    which stays last). Raises if it is not an :class:`Implementation` (TypeError) or its name is
    taken."""
    if not isinstance(impl, Implementation):
        raise TypeError(f"register takes an Implementation (a subclass of flax_attn.core.registry.Implementation), "
                        f"got {type(impl).__name__}")
    if any(r.name == impl.name for r in _REGISTRY):
        raise ValueError(f"an implementation named {impl.name!r} is already registered")
    names = [r.name for r in _REGISTRY]
    if before is not None:
        _checks.check_one_of("before", before, names)
        _REGISTRY.insert(names.index(before), impl)
    elif "xla" in names:
        _REGISTRY.insert(names.index("xla"), impl)
    else:
        _REGISTRY.append(impl)
    return impl


def unregister(name: str) -> None:
    """Remove the implementation called ``name``."""
    _checks.check_one_of("implementation", name, names())
    _REGISTRY[:] = [r for r in _REGISTRY if r.name != name]


def names() -> list[str]:
    return [r.name for r in _REGISTRY]


def implementations() -> list[Implementation]:
    """The registered implementations, in the order the automatic choice tries them."""
    return list(_REGISTRY)


def available(platform: Optional[str] = None) -> list[Implementation]:
    """The registered implementations that run on ``platform`` (``'cpu'``, ``'gpu'`` or
    ``'tpu'``; default: JAX's default backend)."""
    import jax

    if platform is not None:
        _checks.check_platform(platform)
    platform = platform or jax.default_backend()
    return [r for r in _REGISTRY if r.runs_on(platform)]


def get(name: str) -> Implementation:
    _checks.check_one_of("implementation", name, names())
    return next(r for r in _REGISTRY if r.name == name)


def choose(call) -> Implementation:
    """The first registered implementation that serves ``call`` and prefers it.

    ``call.platform`` decides for platform-specific ones: replace it
    (``dataclasses.replace(call, platform='gpu')``) to ask what would run elsewhere.
    """
    for impl in _REGISTRY:
        if impl.runs_on(call.platform) and impl.supports(call) is None and impl.preferred(call):
            return impl
    raise ValueError(f"no registered implementation serves this call ({call.mask.describe()})")


def resolve(implementation: Union[None, str, Implementation], call) -> Implementation:
    """The implementation to run: the automatic choice for None; a name or object must serve
    ``call``, else ``ValueError`` says why."""
    if implementation is None:
        return choose(call)
    impl = get(implementation) if isinstance(implementation, str) else implementation
    if not isinstance(impl, Implementation):
        raise TypeError(f"implementation must be None, a name in {names()} or an Implementation, "
                        f"got {implementation!r}")
    problem = impl.supports(call)
    if not problem and not impl.runs_on(call.platform):
        problem = f"the '{call.platform}' backend (it does not run there: runs_on('{call.platform}') is False)"
    if problem:
        raise ValueError(f"implementation='{impl.name}' does not support {problem}")
    return impl
