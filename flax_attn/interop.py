"""PyTorch ``state_dict`` to Flax params and back, with NumPy arrays: torch is never imported.

One generic, strict mechanism serves every module. The Flax parameter tree is the template,
and each leaf has one PyTorch name:

* a module path ``('heads_0', 'W_query')`` is ``heads.0.W_query`` (Linen names list members
  ``name_i``, PyTorch ``name.i``);
* ``kernel`` (Dense, ``(in, out)``) is ``weight`` transposed (``nn.Linear``, ``(out, in)``);
* ``embedding`` (Embed) and ``scale`` (norms) are ``weight`` as they are;
* any other leaf (``bias``, a raw ``nn.Parameter`` such as ``W_query``) keeps its name and layout.

Registered buffers (the chapter's causal ``mask``) are not parameters in flax_attn: masks are
computed. A module declares the buffers its PyTorch twin carries; on the way in each is
checked against the expected value and skipped on purpose, on the way out it is written back
so that ``load_state_dict(strict=True)`` accepts the result.

Missing, unexpected, mis-shaped and wrongly typed entries are collected and raised together
in one :class:`StateDictError`. Values are copied bit for bit (transposes only).
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

_LEAF_TO_TORCH = {"kernel": "weight", "embedding": "weight", "scale": "weight"}


class StateDictError(ValueError):
    """A state_dict that does not fit the module; the message lists every problem."""


class TorchConvertible:
    """Mixin for modules with a PyTorch twin in ``torch_ref``.

    ``example_inputs`` gives arguments that initialise the module (any values: only shapes
    matter); ``torch_buffers`` the buffers the twin registers, by state_dict name.
    """

    def example_inputs(self) -> tuple:
        raise NotImplementedError

    def example_kwargs(self) -> dict:
        return {}

    def torch_buffers(self) -> dict[str, np.ndarray]:
        return {}


def torch_name(path: tuple[str, ...]) -> str:
    """The state_dict name of the Flax parameter at ``path`` (inside the 'params' collection)."""
    *modules, leaf = path
    modules = [re.sub(r"_(\d+)$", r".\1", m) for m in modules]
    leaf = _LEAF_TO_TORCH.get(leaf, leaf) if modules else leaf
    return ".".join(modules + [leaf])


def _is_kernel(path) -> bool:
    return len(path) > 1 and path[-1] == "kernel"


def _as_numpy(value) -> np.ndarray:
    try:
        return np.asarray(value)
    except (TypeError, RuntimeError, ValueError) as e:  # e.g. a bfloat16 torch tensor
        raise TypeError(f"{e} (torch_ref.state_dict_to_numpy converts any torch state_dict)") from None


def params_from_state_dict(state_dict: Mapping[str, Any], template, *,
                           buffers: Mapping[str, np.ndarray] | None = None) -> dict:
    """Convert ``state_dict`` to a Flax ``params`` tree shaped like ``template``.

    Args:
      state_dict: mapping of PyTorch names to arrays (NumPy or anything ``np.asarray`` takes).
      template: the Flax params tree (arrays or ``jax.ShapeDtypeStruct``), without the
        'params' collection key.
      buffers: expected buffers by name; present ones must equal these, and are skipped.

    Returns:
      A nested dict of ``jnp`` arrays with the state_dict's dtypes.

    Raises:
      StateDictError: listing every missing, unexpected, mis-shaped or wrongly typed entry.
    """
    buffers = dict(buffers or {})
    flat_template = traverse_util.flatten_dict(template)
    expected = {torch_name(p): p for p in flat_template}
    problems = []
    for name in sorted(set(state_dict) - set(expected) - set(buffers)):
        problems.append(f"unexpected entry '{name}' with shape {tuple(np.shape(state_dict[name]))}")
    for name in sorted(set(expected) - set(state_dict)):
        path = expected[name]
        want = tuple(np.shape(flat_template[path]))
        problems.append(f"missing entry '{name}' (expected shape {want[::-1] if _is_kernel(path) else want})")
    flat_params = {}
    for name, path in expected.items():
        if name not in state_dict:
            continue
        try:
            value = _as_numpy(state_dict[name])
        except (TypeError, ValueError) as e:
            problems.append(f"entry '{name}' is not an array: {e}")
            continue
        if not (np.issubdtype(value.dtype, np.floating) or value.dtype.name == "bfloat16"):
            problems.append(f"entry '{name}' has dtype {value.dtype}, expected a floating dtype")
            continue
        want = tuple(np.shape(flat_template[path]))
        torch_shape = want[::-1] if _is_kernel(path) else want
        if value.shape != torch_shape:
            problems.append(f"entry '{name}' has shape {value.shape}, expected {torch_shape}")
            continue
        flat_params[path] = jnp.asarray(value.T if _is_kernel(path) else value)
    for name, expected_value in buffers.items():
        if name not in state_dict:
            continue
        try:
            value = _as_numpy(state_dict[name])
        except TypeError as e:
            problems.append(f"buffer '{name}' is not an array: {e}")
            continue
        if value.shape != expected_value.shape:
            problems.append(f"buffer '{name}' has shape {value.shape}, expected {expected_value.shape}")
        elif not np.array_equal(value, expected_value):
            problems.append(f"buffer '{name}' does not hold the expected values (a causal mask "
                            f"triu(ones({expected_value.shape[0]}, {expected_value.shape[1]}), 1))")
    if problems:
        raise StateDictError("state_dict does not fit the module:\n  " + "\n  ".join(problems))
    return traverse_util.unflatten_dict(flat_params)


def params_to_state_dict(params, *, buffers: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Convert a Flax ``params`` tree (without the 'params' key) to a state_dict of NumPy arrays.

    Buffers are written in the parameters' dtype, as ``module.to(dtype)`` leaves them in PyTorch.
    """
    out = {}
    for path, value in traverse_util.flatten_dict(params).items():
        value = np.array(value)  # a writable copy, so that torch.from_numpy takes it as it is
        out[torch_name(path)] = np.ascontiguousarray(value.T) if _is_kernel(path) else value
    if buffers:
        dtype = np.result_type(*(v.dtype for v in out.values())) if out else np.float32
        for name, value in buffers.items():
            out[name] = np.asarray(value).astype(dtype)
    return out


def param_template(module) -> dict:
    """Shapes and dtypes of ``module``'s params, computed without running it (``jax.eval_shape``)."""
    variables = jax.eval_shape(
        lambda: module.init(jax.random.key(0), *module.example_inputs(), **module.example_kwargs())
    )
    return variables["params"]


def from_torch_state_dict(module: TorchConvertible, state_dict: Mapping[str, Any]) -> dict:
    """Variables ``{'params': ...}`` for ``module`` from its PyTorch twin's ``state_dict``.

    ``state_dict`` holds NumPy arrays (``torch_ref.state_dict_to_numpy`` makes them).
    Strict: see :func:`params_from_state_dict`.
    """
    return {"params": params_from_state_dict(state_dict, param_template(module),
                                             buffers=module.torch_buffers())}


def to_torch_state_dict(module: TorchConvertible, variables) -> dict[str, np.ndarray]:
    """The PyTorch twin's ``state_dict`` (NumPy arrays, buffers included) from ``variables``."""
    params = variables["params"] if "params" in variables else variables
    template = param_template(module)
    got = traverse_util.flatten_dict(params)
    want = traverse_util.flatten_dict(template)
    problems = [f"missing parameter {'/'.join(p)}" for p in sorted(set(want) - set(got))]
    problems += [f"unexpected parameter {'/'.join(p)}" for p in sorted(set(got) - set(want))]
    problems += [
        f"parameter {'/'.join(p)} has shape {tuple(np.shape(got[p]))}, expected {tuple(want[p].shape)}"
        for p in sorted(set(got) & set(want)) if tuple(np.shape(got[p])) != tuple(want[p].shape)
    ]
    if problems:
        raise StateDictError("params do not fit the module:\n  " + "\n  ".join(problems))
    return params_to_state_dict(params, buffers=module.torch_buffers())
