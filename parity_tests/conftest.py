"""Shared helpers for the parity suite.

JAX runs with x64 enabled so float64 comparisons are real; float32 tests build float32
arrays explicitly. Matmul precision is 'highest' for float32.

Error measure: ``max_rel_error(a, b) = max|a - b| / max|b|`` over the whole tensor (relative
to the reference's largest magnitude), so that entries near zero do not divide by ~0.
Tolerances (the project's numbers): float64 1e-12, float32 1e-5.
"""
from __future__ import annotations

import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from flax import traverse_util  # noqa: E402

import flax_attn  # noqa: E402
import torch_ref  # noqa: E402

TOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5}
DTYPES = [np.float64, np.float32]
TORCH_DTYPE = {np.dtype(np.float64): torch.float64, np.dtype(np.float32): torch.float32}

# "Your journey starts with one step": the chapter's six 3-d token embeddings.
CHAPTER_INPUTS = np.array(
    [[0.43, 0.15, 0.89],
     [0.55, 0.87, 0.66],
     [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33],
     [0.77, 0.25, 0.10],
     [0.05, 0.80, 0.55]],
    dtype=np.float32,
)


def max_rel_error(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    scale = np.max(np.abs(expected)) if expected.size else 0.0
    diff = np.max(np.abs(actual - expected)) if expected.size else 0.0
    return float(diff / scale) if scale > 0 else float(diff)


def assert_close(actual, expected, dtype, what: str = "") -> float:
    tol = TOL[np.dtype(dtype)]
    assert not np.any(np.isnan(np.asarray(actual, np.float64))), f"{what}: NaN in result"
    err = max_rel_error(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.3e} > {tol:.0e}"
    return err


def assert_printed(actual, printed, what: str = "") -> None:
    """Equal to a printed table at its four decimals (rounding half away from zero)."""
    actual = np.asarray(actual, np.float64)
    printed = np.asarray(printed, np.float64)
    assert actual.shape == printed.shape, f"{what}: shape {actual.shape} != printed {printed.shape}"
    # A printed x.xxxx means the value lies within half a unit of the last digit (plus float slack).
    bad = np.abs(actual - printed) > 0.5e-4 + 1e-7
    assert not bad.any(), f"{what}: {actual[bad]} differ from printed {printed[bad]}"


def torch_module_grads(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: p.grad.detach().numpy() for n, p in module.named_parameters()}


def run_parity(torch_module, flax_module, inputs, dtype, *, torch_kwargs=None, flax_kwargs=None,
               seed=0, jit_check=True):
    """Copy torch_module's weights into flax_module and compare outputs and gradients.

    ``inputs``: tuple of NumPy arrays (floating ones get gradients, others pass through).
    Outputs may be one array or a tuple; the loss is ``sum_i <out_i, cotangent_i>`` with random
    cotangents, so the gradients of every output are checked. Returns the largest error seen.
    """
    dtype = np.dtype(dtype)
    torch_kwargs, flax_kwargs = torch_kwargs or {}, flax_kwargs or {}
    torch_module = torch_module.to(TORCH_DTYPE[dtype])
    variables = flax_attn.from_torch_state_dict(flax_module, torch_ref.state_dict_to_numpy(torch_module.state_dict()))
    float_idx = [i for i, x in enumerate(inputs) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    t_inputs = [torch.from_numpy(np.asarray(x, dtype if i in float_idx else None)) for i, x in enumerate(inputs)]
    for i in float_idx:
        t_inputs[i].requires_grad_(True)
    t_out = torch_module(*t_inputs, **torch_kwargs)
    t_outs = t_out if isinstance(t_out, tuple) else (t_out,)
    rng = np.random.default_rng(seed + 1)
    cotangents = [rng.standard_normal(tuple(o.shape)).astype(dtype) for o in t_outs]
    loss = sum((o * torch.from_numpy(c)).sum() for o, c in zip(t_outs, cotangents))
    loss.backward()

    j_inputs = [jnp.asarray(np.asarray(x, dtype if i in float_idx else None)) for i, x in enumerate(inputs)]

    def apply(params, *float_args):
        args = list(j_inputs)
        for i, a in zip(float_idx, float_args):
            args[i] = a
        out = flax_module.apply({"params": params}, *args, **flax_kwargs)
        return out if isinstance(out, tuple) else (out,)

    def loss_fn(params, *float_args):
        outs = apply(params, *float_args)
        return sum(jnp.sum(o * jnp.asarray(c)) for o, c in zip(outs, cotangents))

    float_args = [j_inputs[i] for i in float_idx]
    j_outs = apply(variables["params"], *float_args)
    grads = jax.grad(loss_fn, argnums=tuple(range(1 + len(float_idx))))(variables["params"], *float_args)

    worst = 0.0
    for k, (jo, to) in enumerate(zip(j_outs, t_outs)):
        assert jo.dtype == dtype, f"output {k} dtype {jo.dtype} != {dtype}"
        worst = max(worst, assert_close(jo, to.detach().numpy(), dtype, f"output {k}"))
    for g, i in zip(grads[1:], float_idx):
        worst = max(worst, assert_close(g, t_inputs[i].grad.numpy(), dtype, f"d loss / d input {i}"))
    template = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), variables["params"])
    t_grads = flax_attn.interop.params_from_state_dict(torch_module_grads(torch_module), template)
    flat_j = traverse_util.flatten_dict(grads[0])
    flat_t = traverse_util.flatten_dict(t_grads)
    assert set(flat_j) == set(flat_t)
    # Some gradients are zero analytically (the key bias: q.b_k shifts a whole row of logits,
    # and softmax ignores shifts); both frameworks then return rounding noise, where a relative
    # error means nothing. Such a gradient must be zero in both, measured against the largest
    # parameter gradient of the same loss.
    scale = max(float(np.max(np.abs(np.asarray(g)))) for g in flat_t.values())
    tol = TOL[dtype]
    for path in flat_j:
        what = f"d loss / d {'/'.join(path)}"
        ref = np.asarray(flat_t[path], np.float64)
        if np.max(np.abs(ref)) <= tol * scale:
            got = np.max(np.abs(np.asarray(flat_j[path], np.float64)))
            assert got <= tol * scale, f"{what}: should be zero, got {got:.3e} (scale {scale:.3e})"
            continue
        worst = max(worst, assert_close(flat_j[path], ref, dtype, what))

    if jit_check:
        jitted = jax.jit(apply)(variables["params"], *float_args)
        for jo, eo in zip(jitted, j_outs):
            assert_close(jo, eo, dtype, "jit vs eager")
    return worst


@pytest.fixture
def chapter_inputs():
    return CHAPTER_INPUTS.copy()


def run_function_parity(torch_fn, jax_fn, inputs, dtype, *, seed=0, jit_check=True):
    """Compare ``jax_fn(*inputs)`` with ``torch_fn(*inputs)``: outputs and input gradients.

    Non-floating inputs are passed through unchanged (as tensors / arrays). Returns the worst error.
    """
    dtype = np.dtype(dtype)
    float_idx = [i for i, x in enumerate(inputs) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    cast = lambda i, x: np.asarray(x, dtype if i in float_idx else None)
    t_inputs = [torch.from_numpy(cast(i, x).copy()) for i, x in enumerate(inputs)]
    for i in float_idx:
        t_inputs[i].requires_grad_(True)
    t_out = torch_fn(*t_inputs)
    t_outs = t_out if isinstance(t_out, tuple) else (t_out,)
    rng = np.random.default_rng(seed + 7)
    cots = [rng.standard_normal(tuple(o.shape)).astype(dtype) for o in t_outs]
    sum((o * torch.from_numpy(c)).sum() for o, c in zip(t_outs, cots)).backward()

    j_inputs = [jnp.asarray(cast(i, x)) for i, x in enumerate(inputs)]

    def apply(*float_args):
        args = list(j_inputs)
        for i, a in zip(float_idx, float_args):
            args[i] = a
        out = jax_fn(*args)
        return out if isinstance(out, tuple) else (out,)

    float_args = [j_inputs[i] for i in float_idx]
    j_outs = apply(*float_args)
    loss = lambda *a: sum(jnp.sum(o * jnp.asarray(c)) for o, c in zip(apply(*a), cots))
    grads = jax.grad(loss, argnums=tuple(range(len(float_idx))))(*float_args)
    worst = 0.0
    for k, (jo, to) in enumerate(zip(j_outs, t_outs)):
        assert jo.dtype == dtype, f"output {k} dtype {jo.dtype} != {dtype}"
        worst = max(worst, assert_close(jo, to.detach().numpy(), dtype, f"output {k}"))
    for g, i in zip(grads, float_idx):
        worst = max(worst, assert_close(g, t_inputs[i].grad.numpy(), dtype, f"d loss / d input {i}"))
    if jit_check:
        for jo, eo in zip(jax.jit(apply)(*float_args), j_outs):
            assert_close(jo, eo, dtype, "jit vs eager")
    return worst
