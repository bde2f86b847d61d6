"""Measure flax_attn against torch_ref: the same weights and inputs in both, outputs and gradients.

The bridge between the two packages, used by ``parity_tests`` (which assert on the numbers)
and by ``examples/parity_table.py`` (which prints them). It imports JAX and flax_attn.

Error measure: ``max_rel_error(a, b) = max|a - b| / max|b|`` over a whole tensor, relative to
the reference's largest magnitude, so that entries near zero do not divide by ~0.

A gradient that is zero analytically (the key bias: ``q . b_k`` shifts a whole row of logits
and softmax ignores shifts) comes back from both frameworks as rounding noise, where a
relative error means nothing; such a gradient is measured against the largest parameter
gradient of the same loss instead, and reported as ``(zero)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TOLERANCE = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
TORCH_DTYPE = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}


@dataclass
class Measurement:
    what: str      # "output 0", "d loss / d input 0", "d loss / d W_query/kernel (zero)", "jit vs eager"
    error: float   # max relative error (see the module docstring)
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(self.error <= self.tolerance)


def max_rel_error(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape} != {expected.shape}")
    if not expected.size:
        return 0.0
    if np.isnan(actual).any() or np.isnan(expected).any():
        return float("nan")
    scale = np.max(np.abs(expected))
    diff = np.max(np.abs(actual - expected))
    return float(diff / scale) if scale > 0 else float(diff)


def _split(inputs, dtype):
    """Indices of the floating inputs (they get gradients) and the inputs as NumPy (None stays None)."""
    float_idx = [i for i, x in enumerate(inputs)
                 if x is not None and np.issubdtype(np.asarray(x).dtype, np.floating)]
    cast = [None if x is None else np.asarray(x, dtype if i in float_idx else None) for i, x in enumerate(inputs)]
    return float_idx, cast


def _torch_forward_backward(fn, inputs, float_idx, dtype, seed):
    t_inputs = [None if x is None else torch.from_numpy(x.copy()) for x in inputs]
    for i in float_idx:
        t_inputs[i].requires_grad_(True)
    out = fn(*t_inputs)
    outs = out if isinstance(out, tuple) else (out,)
    rng = np.random.default_rng(seed)
    cotangents = [rng.standard_normal(tuple(o.shape)).astype(dtype) for o in outs]
    sum((o * torch.from_numpy(c)).sum() for o, c in zip(outs, cotangents)).backward()
    return [o.detach().numpy() for o in outs], [t_inputs[i].grad.numpy() for i in float_idx], cotangents


def _jax_forward_backward(fn, inputs, float_idx, cotangents, extra_args=()):
    """fn(*extra_args, *inputs) -> outputs, and gradients w.r.t. extra_args and the float inputs.

    Outputs and gradients come from one ``jax.jit`` program (one compilation). Returns the
    un-jitted ``apply`` with its arguments too, for the jit-versus-eager check.
    """
    import jax
    import jax.numpy as jnp

    j_inputs = [None if x is None else jnp.asarray(x) for x in inputs]

    def apply(*args):
        n = len(extra_args)
        full = list(j_inputs)
        for i, a in zip(float_idx, args[n:]):
            full[i] = a
        out = fn(*args[:n], *full)
        return out if isinstance(out, tuple) else (out,)

    def loss(*args):
        return sum(jnp.sum(o * jnp.asarray(c)) for o, c in zip(apply(*args), cotangents))

    args = tuple(extra_args) + tuple(j_inputs[i] for i in float_idx)
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    outs, grads = jax.jit(lambda *a: (apply(*a), grad(*a)))(*args)
    return apply, args, outs, grads


def _check_outputs(j_outs, t_outs, dtype, tol):
    result = []
    for k, (jo, to) in enumerate(zip(j_outs, t_outs)):
        if np.dtype(jo.dtype) != dtype:
            raise AssertionError(f"output {k} has dtype {jo.dtype}, expected {dtype}")
        result.append(Measurement(f"output {k}", max_rel_error(jo, to), tol))
    return result


def _jit_vs_eager(apply, args, jitted_outs, tol):
    eager = apply(*args)
    err = max(max_rel_error(j, e) for j, e in zip(jitted_outs, eager))
    return Measurement("jit vs eager", err, tol)


def compare_function(torch_fn, jax_fn, inputs, dtype, *, seed=0, eager=False) -> list[Measurement]:
    """``jax_fn(*inputs)`` against ``torch_fn(*inputs)``: outputs and gradients w.r.t. float inputs.

    Computed under ``jax.jit``; ``eager=True`` also runs the forward pass op by op and
    reports its difference from the jitted one.
    """
    dtype = np.dtype(dtype)
    tol = TOLERANCE[dtype]
    float_idx, inputs = _split(inputs, dtype)
    t_outs, t_grads, cots = _torch_forward_backward(torch_fn, inputs, float_idx, dtype, seed)
    apply, args, j_outs, j_grads = _jax_forward_backward(jax_fn, inputs, float_idx, cots)
    result = _check_outputs(j_outs, t_outs, dtype, tol)
    result += [Measurement(f"d loss / d input {i}", max_rel_error(g, tg), tol)
               for i, g, tg in zip(float_idx, j_grads, t_grads)]
    if eager:
        result.append(_jit_vs_eager(apply, args, j_outs, tol))
    return result


def compare_module(torch_module, flax_module, inputs, dtype, *, torch_call_kwargs=None, flax_kwargs=None,
                   seed=0, eager=False) -> list[Measurement]:
    """Copy ``torch_module``'s weights into ``flax_module`` (through ``flax_attn.from_torch_state_dict``)
    and compare outputs and gradients w.r.t. the float inputs and every parameter.

    The loss is ``sum_i <output_i, cotangent_i>`` with random cotangents, so every output's
    gradient is checked. ``torch_module`` is moved to ``dtype``. Computed under ``jax.jit``;
    ``eager=True`` also runs the forward pass op by op and reports its difference.
    """
    import jax
    from flax import traverse_util

    import flax_attn
    from torch_ref import state_dict_to_numpy

    dtype = np.dtype(dtype)
    tol = TOLERANCE[dtype]
    torch_call_kwargs, flax_kwargs = torch_call_kwargs or {}, flax_kwargs or {}
    torch_module = torch_module.to(TORCH_DTYPE[dtype])
    torch_module.zero_grad(set_to_none=True)  # gradients of an earlier comparison would accumulate
    variables = flax_attn.from_torch_state_dict(flax_module, state_dict_to_numpy(torch_module.state_dict()))
    float_idx, inputs = _split(inputs, dtype)
    t_outs, t_grads, cots = _torch_forward_backward(
        lambda *a: torch_module(*a, **torch_call_kwargs), inputs, float_idx, dtype, seed)
    apply, args, j_outs, j_grads = _jax_forward_backward(
        lambda params, *a: flax_module.apply({"params": params}, *a, **flax_kwargs),
        inputs, float_idx, cots, extra_args=(variables["params"],))
    result = _check_outputs(j_outs, t_outs, dtype, tol)
    result += [Measurement(f"d loss / d input {i}", max_rel_error(g, tg), tol)
               for i, g, tg in zip(float_idx, j_grads[1:], t_grads)]

    template = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), variables["params"])
    torch_param_grads = {n: p.grad.detach().numpy() for n, p in torch_module.named_parameters()}
    flat_t = traverse_util.flatten_dict(flax_attn.interop.params_from_state_dict(torch_param_grads, template))
    flat_j = traverse_util.flatten_dict(j_grads[0])
    if set(flat_j) != set(flat_t):
        raise AssertionError(f"parameter trees differ: {sorted(flat_j)} vs {sorted(flat_t)}")
    scale = max(float(np.max(np.abs(np.asarray(g)))) for g in flat_t.values())
    for path in sorted(flat_j):
        what = f"d loss / d {'/'.join(path)}"
        ref = np.asarray(flat_t[path], np.float64)
        if np.max(np.abs(ref)) <= tol * scale:  # zero analytically: measure against the scale
            got = np.asarray(flat_j[path], np.float64)
            err = float(np.max(np.abs(got - ref)) / scale)
            result.append(Measurement(what + " (zero)", err, tol))
        else:
            result.append(Measurement(what, max_rel_error(flat_j[path], ref), tol))
    if eager:
        result.append(_jit_vs_eager(apply, args, j_outs, tol))
    return result
