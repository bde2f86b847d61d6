"""What the Pallas implementations share: the refusals every kernel makes, and padding.

Every kernel here computes its softmax in float32 whatever the input dtype, tiles the
sequence axes into fixed blocks, and differentiates through a ``jax.custom_vjp`` (so
``jax.jvp`` through it raises JAX's ``TypeError`` about custom_vjp functions). The checks
below turn each of these facts into a refusal phrase that completes "does not support ...".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Optional

import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core.registry import Implementation

# Parts of the call description that no kernel here serves (read with getattr, so that the
# description may grow without a kernel silently ignoring what it adds).
EXTRA_FIELDS = ("score_mod", "mask_mod", "sinks")

# The mask rules the kernels know how to translate (or refuse by name); any other field of the
# mask description that is set makes every kernel here refuse the call.
KNOWN_MASK_FIELDS = frozenset({"q_positions", "k_positions", "q_segments", "k_segments", "q_lengths", "kv_lengths",
                               "dense", "bias", "causal", "window", "shape", "mask_mods", "score_mod"})

LOW_PRECISION = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_power_of_2(name: str, value) -> None:
    _checks.check_positive_int(name, value)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Kernel(Implementation):
    """What the Pallas implementations share: a kernel native to one platform (``home``, needing
    ``hardware``) that runs anywhere through Pallas' interpreter when its ``interpret`` field is
    True, and is the automatic choice on its home platform where it serves the call."""

    home: ClassVar[str] = "?"
    hardware: ClassVar[str] = "?"
    interpret: bool = False

    def runs_on(self, platform: str) -> bool:
        return self.interpret or platform == self.home

    # the kernel cannot differentiate through its residuals: return_residual is forward only
    residual_forward_only: ClassVar[bool] = True

    def preferred(self, call) -> bool:
        """On its home platform, except for ``return_residual`` calls where the kernel serves
        them forward only (the automatic choice must serve gradients too)."""
        return call.platform == self.home and not (call.return_residual and self.residual_forward_only)

    def refusal(self, call) -> Optional[str]:
        """Why the kernel cannot take ``call`` whatever its mask: the platform, or what
        :func:`common_refusals` lists."""
        if not self.runs_on(call.platform):
            hint = "" if self.interpret else f"; {type(self).__name__}(interpret=True) runs it on any backend, slowly"
            return f"the '{call.platform}' backend ({self.name} needs {self.hardware}{hint})"
        return common_refusals(self, call)


def common_refusals(impl, call) -> Optional[str]:
    """Refusals every Pallas implementation makes: dropout, returned weights, fields it does not
    know, dtypes, precision, batch dims that are not integers."""
    if call.dropout_rate > 0.0:
        return "dropout (use implementation='xla' or None)"
    if call.return_weights:
        return "return_weights (use implementation='xla' or None)"
    for field in EXTRA_FIELDS:
        if getattr(call, field, None) is not None:
            return f"{field} (the Pallas kernels have none)"
    dtype = np.dtype(call.dtype)
    if impl.interpret:
        if dtype not in LOW_PRECISION + (np.dtype(np.float32),):
            return f"dtype {dtype} (the kernel accumulates in float32: float32, bfloat16 or float16 only)"
    elif dtype not in LOW_PRECISION:
        return (f"dtype {dtype} on the {call.platform} kernel (bfloat16 or float16; float32 only in interpret "
                f"mode, where its matmuls are exact float32)")
    if call.precision not in (None, "default", "DEFAULT", jax.lax.Precision.DEFAULT):
        return f"precision={call.precision!r} (the kernel computes in its own fixed precision)"
    if not isinstance(call.B, (int, np.integer)):
        return "a symbolic batch dimension (the kernel's grid needs concrete sizes)"
    return None


def mask_refusals(call, *, positions=False, segments=False, kv_lengths=False, window=False, softcap=False,
                  dense=False, bias=False) -> Optional[str]:
    """The first masking feature of ``call`` that the kernel does not serve (keywords: what it does)."""
    m = call.mask
    if getattr(m, "chunk", None) is not None:
        return "chunked attention"
    for field in dataclasses.fields(m):
        value = getattr(m, field.name)
        if field.name not in KNOWN_MASK_FIELDS and field.name != "chunk" and value is not None \
                and value is not False and value != ():
            return f"the mask rule '{field.name}' (not translated for this kernel)"
    for present, served, what in (
            (m.bias is not None, bias, "a bias"),
            (m.dense is not None, dense, "a boolean mask (the kernel's masks are patterns it computes itself)"),
            (m.q_positions is not None, positions, "explicit positions (the kernel masks by index)"),
            (m.q_segments is not None, segments, "segment ids"),
            (m.kv_lengths is not None, kv_lengths, "key_value_seq_lengths"),
            (m.window is not None, window, "local_window_size"),
            (call.softcap is not None, softcap, "logit_softcap")):
        if present and not served:
            return what
    return None


def pad_axis(x, axis: int, size: int, value=0):
    """``x`` padded with ``value`` at the end of ``axis`` up to ``size``."""
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad, constant_values=value)


def rows(x, B: int):
    """A ``(B|1, L)`` array of the bound mask as ``(B, L)``."""
    return jnp.broadcast_to(x, (B, x.shape[1]))


def traced_in_32_bits(f, name: str, *, residual: bool = False):
    """``f`` (a function of arrays) traced with ``jax_enable_x64`` off, in its forward and its
    backward pass. JAX's Pallas kernels mix Python integers with int32 program ids in
    ``lax.div``, which fails to trace when x64 is on; the inputs here are 16/32-bit anyway.
    Neither pass can itself be differentiated (second derivatives): doing so raises
    ``NotImplementedError`` naming implementation ``name``. ``residual``: ``f`` returns the
    kernel's residuals too, which the kernels cannot differentiate through; differentiating
    ``g`` at all then raises ``NotImplementedError`` saying so."""

    @jax.custom_vjp
    def g(*args):
        with jax.enable_x64(False):
            return f(*args)

    def fwd(*args):
        if residual:
            raise NotImplementedError(
                f"implementation='{name}' gives the log-sum-exp (return_residual=True) forward only: its kernel "
                f"cannot be differentiated with its residuals saved; differentiate a call without return_residual, "
                f"or use implementation='xla' or 'blockwise' (the automatic choice does not take '{name}' for such "
                f"calls)")
        args = no_second_order(name, args)
        with jax.enable_x64(False):
            return jax.vjp(f, *args)

    def bwd(pullback, cotangent):
        return first_order_only(pullback, cotangent, name=name)

    g.defvjp(fwd, bwd)
    return g


def _apply(pullback, cotangent):
    with jax.enable_x64(False):
        return pullback(cotangent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def first_order_only(pullback, cotangent, name):
    """``pullback(cotangent)``, whose own derivative raises a clear error."""
    return _apply(pullback, cotangent)


def _first_fwd(pullback, cotangent, name):
    return _apply(pullback, cotangent), None


def _second_order_error(name: str) -> NotImplementedError:
    return NotImplementedError(
        f"implementation='{name}' has no second derivatives (grad of grad, Hessians): its passes are "
        f"kernels; use implementation='blockwise' or 'xla' for those")


def _first_bwd(name, residuals, cotangents):
    raise _second_order_error(name)


first_order_only.defvjp(_first_fwd, _first_bwd)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def no_second_order(name, args):
    """``args`` unchanged. Put on the inputs of a custom_vjp's forward rule, which a first
    derivative runs on plain values and only a second one differentiates: that then raises a
    clear error naming implementation ``name`` instead of the kernel's own, from inside Pallas."""
    return args


@no_second_order.defjvp
def _no_second_order_jvp(name, primals, tangents):
    raise _second_order_error(name)
