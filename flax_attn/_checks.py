"""Validation helpers: each raises before any computation, naming the argument and quoting shapes.

All checks read static information only (shapes, dtypes, Python numbers), so they fire
the same way eagerly and under ``jax.jit``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def shape_of(x) -> tuple[int, ...]:
    return tuple(np.shape(x))


def check_rank(name: str, x, ranks: int | Sequence[int], layout: str) -> None:
    """Raise unless ``x`` has one of ``ranks`` dimensions; ``layout`` names them (e.g. 'BTNH')."""
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if np.ndim(x) not in ranks:
        want = " or ".join(str(r) for r in ranks)
        raise ValueError(f"{name} must have rank {want} ({layout}), got shape {shape_of(x)}")


def dtype_of(x) -> np.dtype:
    """The dtype JAX gives an array, tracer or array-like, without converting tracers: a NumPy
    float64 array is float32 where ``jax_enable_x64`` is off, as JAX computes it."""
    return jax.dtypes.canonicalize_dtype(np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype)


def as_positions(x):
    """Integer positions (or segment ids) as JAX arrays to compute differences with: int64 where
    given so and JAX holds it (``jax_enable_x64``), else int32, so that unsigned or narrow
    integers do not wrap when subtracted."""
    return jnp.asarray(x, jnp.int64 if dtype_of(x) == np.dtype(np.int64) else jnp.int32)


def check_floating(name: str, x) -> None:
    dtype = dtype_of(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def check_floating_dtype(name: str, dtype) -> None:
    """``TypeError`` unless ``dtype`` (a dtype argument, not an array) is a floating dtype."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating dtype, got {np.dtype(dtype).name}")


def check_bool(name: str, x) -> None:
    dtype = dtype_of(x)
    if dtype != np.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = may attend), got dtype {dtype}; "
            f"convert a 0/1 mask with `{name}.astype(bool)`, pass an additive mask as `bias`"
        )


def check_integer(name: str, x) -> None:
    dtype = dtype_of(x)
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {dtype}")


def dim_is(d, choices) -> bool:
    """``d`` equals one of ``choices``; symbolic dimensions (``jax.export``) compare without ``int()``."""
    return any(d is c or d == c for c in choices)


def static_bool(name: str, x) -> bool:
    """``x`` as a Python bool: a bool, a NumPy bool or a concrete 0-d boolean array. A traced
    value is a ``TypeError`` naming the argument: it decides the program's form, which must be
    known when the function is traced."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"{name} must be known when the function is traced (it decides the program), got a traced "
                        f"value {x}: pass it as a static argument (jax.jit's static_argnames) or a Python bool")
    return bool(x)


def static_int(x) -> Optional[int]:
    """``x`` as a Python int where it is one: an int (not a bool), a NumPy integer or a concrete
    0-d integer array; None otherwise (a tracer, a float, a sequence)."""
    if isinstance(x, (bool, np.bool_, jax.core.Tracer)):
        return None
    if isinstance(x, (int, np.integer)):
        return int(x)
    if getattr(x, "shape", None) == () and jnp.issubdtype(getattr(x, "dtype", np.float64), jnp.integer):
        return int(x)
    return None


def decided(comparison: Callable[[], Any]) -> Optional[bool]:
    """``comparison()`` (e.g. ``lambda: T >= 128``) as a bool, or None where it compares symbolic
    dimensions (``jax.export``) whose constraints do not decide it: a size threshold then takes
    the form that serves any size."""
    try:
        return bool(comparison())
    except jax.errors.InconclusiveDimensionOperation:
        return None


def dims_equal(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(dim_is(x, (y,)) for x, y in zip(a, b))


def check_broadcast(name: str, x, target: Sequence, layout: str) -> tuple:
    """Raise unless ``x`` broadcasts to ``target`` (each dim 1 or equal, rank at most len(target)).

    Returns the shape left-padded with ones to the target's rank.
    """
    shape = shape_of(x)
    target = tuple(target)
    padded = (1,) * (len(target) - len(shape)) + shape
    if len(shape) > len(target) or not all(dim_is(s, (1, t)) for s, t in zip(padded, target)):
        raise ValueError(
            f"{name} of shape {shape} does not broadcast to {layout} = {target}"
        )
    return padded


# The platforms the automatic choice knows (jax.default_backend()'s names).
PLATFORMS = ("cpu", "gpu", "tpu")


def check_platform(platform) -> None:
    """A ``platform`` given as an argument must be one of :data:`PLATFORMS` (a misspelt one,
    e.g. 'cuda', would otherwise be treated as a platform no kernel runs on)."""
    check_one_of("platform", platform, PLATFORMS)


def check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_divides(num_name: str, num: int, den_name: str, den: int) -> None:
    if den < 1 or num % den != 0:
        raise ValueError(f"{num_name} ({num}) must be divisible by {den_name} ({den})")


def check_rate(name: str, rate) -> None:
    if not isinstance(rate, (int, float, np.floating, np.integer)) or isinstance(rate, bool):
        raise TypeError(f"{name} must be a float in [0, 1), got {rate!r}")
    if not 0.0 <= float(rate) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {rate!r}")


def check_one_of(name: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _raise_unless(ok, *, message: str, **values) -> None:
    if not bool(ok):
        raise ValueError(message.format(**{k: np.asarray(v).tolist() for k, v in values.items()}))


class Deferred:
    """The run-time checks met while tracing inside :func:`deferred_checks`: ``records`` a list
    of ``(ok, message_id, values)`` with traced ``ok`` and ``values``. :meth:`outputs` packs
    them into one int32 vector, a program's extra output; :func:`raise_failed` reads it on the
    host."""

    def __init__(self, trace_state):
        self.trace_state = trace_state
        self.records: list = []

    def outputs(self):
        """One int32 vector: the id of this program's layout of checks (message ids, value names,
        shapes and dtypes, and the values known at trace time, kept on the host), each check's
        verdict, then the traced values' 32-bit words. One output instead of one per check and
        value: every output of a compiled program costs its dispatch a buffer (0.8 us each on a
        2-core AMD EPYC of family 26, JAX 0.10). There a ``decode_step`` of a 64-wide layer went
        from 73-99 to 32-60 us with its nine outputs of checks packed into one; a 768-wide
        layer's step (0.2-2.5 ms) and an NVIDIA H100's (0.3-0.7 ms) moved less than their noise."""
        layout, words = [], []
        for _, message_id, values in self.records:
            entries = []
            for name, value in values.items():
                if isinstance(value, (bool, int, float, np.generic, np.ndarray)):
                    entries.append((name, None, None, np.asarray(value).tolist()))  # whole in the layout's repr
                else:
                    value = jnp.asarray(value)
                    entries.append((name, value.shape, value.dtype, None))
                    words.append(_words(value))
            layout.append((message_id, tuple(entries)))
        layout = tuple(layout)
        key = repr(layout)
        if key not in _LAYOUT_KEYS:
            _LAYOUT_KEYS.append(key)
            _LAYOUTS.append(layout)
        verdicts = [jnp.asarray(ok, jnp.int32).reshape(1) for ok, _, _ in self.records]
        return jnp.concatenate([jnp.full((1,), _LAYOUT_KEYS.index(key), jnp.int32), *verdicts, *words])

    def all_ok(self):
        return jnp.all(jnp.stack([jnp.asarray(ok) for ok, _, _ in self.records])) if self.records else jnp.bool_(True)


def _words(value):
    """``value``'s elements as int32 words, flattened: bools and narrow types widened to 32
    bits first, 64-bit types as two words each (:func:`_unwords` undoes it)."""
    from jax import lax

    if value.dtype == jnp.bool_:
        value = value.astype(jnp.int32)
    elif value.dtype.itemsize < 4:
        value = value.astype(jnp.float32 if jnp.issubdtype(value.dtype, jnp.inexact) else jnp.int32)
    return lax.bitcast_convert_type(value, jnp.int32).reshape(-1)


def _unwords(words: np.ndarray, shape, dtype) -> tuple[np.ndarray, int]:
    """The value of ``shape`` and ``dtype`` at the start of ``words`` (int32, from :func:`_words`),
    and the number of words it took."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        wide = np.dtype(np.int32)
    elif dtype.itemsize < 4:
        wide = np.dtype(np.float32 if jnp.issubdtype(dtype, jnp.inexact) else np.int32)  # numpy's own misses bfloat16
    else:
        wide = dtype
    size = int(np.prod(shape, dtype=np.int64)) * max(1, wide.itemsize // 4)
    value = words[:size].copy().view(wide).astype(dtype).reshape(shape)
    return value, size


_MESSAGES: list = []      # the messages of deferred checks; a record carries its index
_LAYOUTS: list = []       # the layouts of packed checks (Deferred.outputs); a packed vector starts with its index
_LAYOUT_KEYS: list = []   # their reprs, to find a layout met before
_DEFERRING: list = []     # the Deferred collections open now, innermost last


def _trace_state():
    import jax.extend.core

    return jax.extend.core.get_opaque_trace_state(convention="flax")


@contextlib.contextmanager
def deferred_checks():
    """Within it, while tracing a program, :func:`runtime_check` on traced values records the
    condition in the :class:`Deferred` it yields instead of planting a host callback; the
    program returns :meth:`Deferred.outputs` and the caller passes them to
    :func:`raise_failed`. A program with a host callback in it cannot take JAX's C++
    dispatch path: on a 2-core AMD EPYC a decoding step of GPT-2-small's attention took 1.1 ms
    with the callbacks and 0.5 ms without. Checks met under a nested transformation (a scan
    or vmap inside the program) keep their callbacks: their values cannot leave that trace."""
    collected = Deferred(_trace_state())
    _DEFERRING.append(collected)
    try:
        yield collected
    finally:
        _DEFERRING.pop()


def raise_failed(outputs, when: str = "") -> None:
    """Raise the ``ValueError`` of the first failed check in :meth:`Deferred.outputs` (the
    packed vector a program returned); ``when`` is appended to the message."""
    words = np.asarray(outputs)
    layout = _LAYOUTS[int(words[0])]
    verdicts, rest = words[1:1 + len(layout)], words[1 + len(layout):]
    for (message_id, entries), ok in zip(layout, verdicts):
        values = {}
        for name, shape, dtype, static in entries:
            if dtype is None:
                values[name] = static
            else:
                values[name], used = _unwords(rest, shape, dtype)
                rest = rest[used:]
        if not ok:
            message = _MESSAGES[message_id].format(**{k: np.asarray(v).tolist() for k, v in values.items()})
            raise ValueError(message + when)


def runtime_check(ok, message: str, **values) -> None:
    """Raise ``ValueError(message.format(**values))`` unless ``ok``.

    For conditions on values that are only known when the program runs (a cache's fill level
    under ``jax.jit``): with concrete values it raises at once; with traced ones it plants a
    callback that raises when the compiled program runs (surfacing as a runtime error that
    carries the message). The callback sits in the failing branch of a ``lax.cond``, so a
    program in which all is well never calls back to the host; its presence still keeps JAX
    on its slower Python dispatch path, which :func:`deferred_checks` avoids (as
    :func:`flax_attn.decode_step` does).
    """
    import jax

    if isinstance(ok, jax.core.Tracer) or any(isinstance(v, jax.core.Tracer) for v in values.values()):
        if _DEFERRING and _DEFERRING[-1].trace_state == _trace_state():
            if message not in _MESSAGES:
                _MESSAGES.append(message)
            _DEFERRING[-1].records.append((ok, _MESSAGES.index(message), dict(values)))
            return
        jax.lax.cond(ok, lambda: None,
                     lambda: jax.debug.callback(_raise_unless, ok, message=message, **values))
    else:
        _raise_unless(ok, message=message, **values)
