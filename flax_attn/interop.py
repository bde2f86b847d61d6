"""PyTorch ``state_dict`` to Flax params and back, with NumPy arrays: torch is never imported.

One generic, strict mechanism serves every module. The Flax parameter tree is the template,
and each leaf has one PyTorch name:

* a module path ``('heads_0', 'W_query')`` is ``heads.0.W_query`` (Linen names list members
  ``name_i``, PyTorch ``name.i``);
* ``kernel`` (Dense, ``(in, out)``) is ``weight`` transposed (``nn.Linear``, ``(out, in)``);
* ``embedding`` (Embed) and ``scale`` (norms) are ``weight`` as they are;
* any other leaf (``bias``, a raw ``nn.Parameter`` such as ``W_query``) keeps its name and layout.

Registered buffers (the chapter's causal ``mask``) are not parameters in flax_attn: masks are
computed. The twin registry says which buffers a module's PyTorch twin carries; on the way in
each is checked against the expected value and skipped on purpose, on the way out it is
written back so that ``load_state_dict(strict=True)`` accepts the result.

The twin registry: modules do not know about PyTorch. For each flax_attn module class one
:class:`Twin` record (:func:`register_twin`, looked up with :func:`twin_of`) names its twin in
``torch_ref`` as a dotted string, says how to build the twin's constructor arguments from the
module, which inputs initialise the module (for :func:`param_template`) and which buffers the
twin registers. ``torch_ref.twin(module)`` builds the twin from the record. The registrations
of flax_attn's own modules are at the end of this file.

Missing, unexpected, mis-shaped and wrongly typed entries are collected and raised together
in one :class:`StateDictError`. Values are copied bit for bit (transposes only): a dtype JAX
cannot hold as it is (float64 while JAX runs in 32-bit mode, where ``jnp.asarray`` would round
to float32) is an error naming the entry, unless the caller chose a ``dtype=`` to convert to.

NNX modules (:mod:`flax_attn.nnx`) are served through their Linen twins, which have the same
parameter names: ``from_torch_state_dict(nnx_module, sd)`` loads the weights into the NNX
module and returns it; ``to_torch_state_dict(nnx_module)`` reads them from it;
``twin_of(nnx_module)`` is its Linen twin's record, so ``torch_ref.twin(nnx_module)`` works.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from flax_attn import _checks
from flax_attn.layers import Attention, LearnedPositionalEmbedding, MultiHeadLatentAttention
from flax_attn.textbook import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    TransformerMultiHeadAttention,
)

_LEAF_TO_TORCH = {"kernel": "weight", "embedding": "weight", "scale": "weight"}


class StateDictError(ValueError):
    """A state_dict that does not fit the module; the message lists every problem."""


def _no_kwargs(module) -> dict:
    return {}


def _no_buffers(module) -> dict[str, np.ndarray]:
    return {}


@dataclasses.dataclass(frozen=True)
class Twin:
    """A flax_attn module class and its PyTorch twin in ``torch_ref``.

    Each callable takes the flax module (an instance of ``module``) and reads its fields.

    Attributes:
      module: the flax_attn module class.
      torch: the twin's class as a dotted name, e.g. ``'torch_ref.modern.Attention'`` (a string:
        flax_attn never imports torch; ``torch_ref.twin`` imports it).
      kwargs: module -> the twin's constructor keyword arguments.
      example_inputs: module -> positional arguments that initialise the module (any values:
        only shapes and dtypes matter).
      example_kwargs: module -> keyword arguments for that initialisation.
      buffers: module -> the buffers the twin registers, by state_dict name.
    """

    module: type
    torch: str
    kwargs: Callable[[Any], dict]
    example_inputs: Callable[[Any], tuple]
    example_kwargs: Callable[[Any], dict] = _no_kwargs
    buffers: Callable[[Any], dict[str, np.ndarray]] = _no_buffers


_TWINS: dict[type, Twin] = {}


def register_twin(module: type, *, torch: str, kwargs: Callable[[Any], dict],
                  example_inputs: Callable[[Any], tuple], example_kwargs: Optional[Callable[[Any], dict]] = None,
                  buffers: Optional[Callable[[Any], dict[str, np.ndarray]]] = None) -> Twin:
    """Register ``module``'s (a class) PyTorch twin; see :class:`Twin`. Returns the record.

    Registering a class again replaces its record. Subclasses share their base's record
    unless they register their own.
    """
    if not isinstance(module, type):
        raise TypeError(f"register_twin takes a module class, got {module!r}")
    if not (isinstance(torch, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", torch)):
        raise ValueError(f"torch must be the twin's class as a dotted name such as 'torch_ref.modern.Attention', "
                         f"got {torch!r}")
    record = Twin(module, torch, kwargs, example_inputs, example_kwargs or _no_kwargs, buffers or _no_buffers)
    _TWINS[module] = record
    return record


def twin_of(module) -> Twin:
    """The :class:`Twin` record of a module (an instance or a class), or of its nearest registered base.

    A flax_attn NNX module (a class with a ``linen_class``) has its Linen twin's record: the
    NNX module has the same fields, so the record's callables read it as they read the Linen one.
    """
    cls = module if isinstance(module, type) else type(module)
    for base in cls.__mro__:
        if base in _TWINS:
            return _TWINS[base]
    linen_class = getattr(cls, "linen_class", None)
    if isinstance(linen_class, type) and linen_class is not cls:
        return twin_of(linen_class)
    raise TypeError(f"{cls.__name__} has no PyTorch twin: register one with "
                    f"flax_attn.interop.register_twin({cls.__name__}, torch='torch_ref....', ...)")


def _linen(module):
    """``module``, or the Linen twin of a flax_attn NNX module."""
    if isinstance(module, nnx.Module):
        from flax_attn.nnx.convert import linen_twin

        return linen_twin(module)
    return module


def init_example(module, rng=None):
    """``module.init`` on its registered example inputs: variables with real values
    (of the Linen twin, for an NNX module).

    ``rng``: a PRNG key (default ``jax.random.key(0)``).
    """
    module = _linen(module)
    twin = twin_of(module)
    rng = jax.random.key(0) if rng is None else rng
    module = _default_implementation(module)
    return module.init(rng, *twin.example_inputs(module), **twin.example_kwargs(module))


def _default_implementation(module):
    """``module`` with its attention implementation (if it has one) back to the default: the
    parameters do not depend on it, and an implementation may refuse the few-token example
    inputs (a context-parallel one needs the tokens to divide by its devices)."""
    if getattr(module, "implementation", None) is not None and dataclasses.is_dataclass(module):
        return module.clone(implementation=None)
    return module


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


def check_floating_dtype(dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype: a floating dtype JAX holds as it is (TypeError otherwise)."""
    try:
        want = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be a floating dtype such as jnp.float32, got {dtype!r}") from None
    if not is_floating(want):
        raise TypeError(f"dtype must be a floating dtype such as jnp.float32, got {want}")
    if np.dtype(jax.dtypes.canonicalize_dtype(want)) != want:
        raise TypeError(f"dtype={want} cannot be held while 64-bit types are off (jax_enable_x64 is False): "
                        f"enable them or choose dtype=jnp.{jax.dtypes.canonicalize_dtype(want)}")
    return want


def is_floating(dtype) -> bool:
    """A floating NumPy dtype, bfloat16 included."""
    return np.issubdtype(dtype, np.floating) or np.dtype(dtype).name == "bfloat16"


def _kept_dtype(value_dtype: np.dtype, dtype) -> tuple[Optional[np.dtype], Optional[str]]:
    """The dtype an entry becomes and, if it cannot be kept silently, why (a problem to list)."""
    if dtype is None:
        stored = np.dtype(jax.dtypes.canonicalize_dtype(value_dtype))
        if stored != value_dtype:
            return None, (f"has dtype {value_dtype}, which JAX would store as {stored} (64-bit types are off: "
                          f"jax_enable_x64 is False); enable them with jax.config.update('jax_enable_x64', True) "
                          f"or convert on purpose with dtype=jnp.{stored}")
        return value_dtype, None
    return np.dtype(dtype), None


def params_from_state_dict(state_dict: Mapping[str, Any], template, *,
                           buffers: Mapping[str, np.ndarray] | None = None, dtype=None) -> dict:
    """Convert ``state_dict`` to a Flax ``params`` tree shaped like ``template``.

    Args:
      state_dict: mapping of PyTorch names to arrays (NumPy or anything ``np.asarray`` takes).
      template: the Flax params tree (arrays or ``jax.ShapeDtypeStruct``), without the
        'params' collection key.
      buffers: expected buffers by name; present ones must equal these, and are skipped.
      dtype: None (default) keeps every entry's dtype, bit for bit; a dtype JAX cannot hold
        (float64 in 32-bit mode) is then an error naming the entry. A floating dtype converts
        every parameter to it, on purpose (e.g. ``jnp.float32`` or ``jnp.bfloat16``).

    Returns:
      A nested dict of ``jnp`` arrays with the state_dict's dtypes (or ``dtype``).

    Raises:
      StateDictError: listing every missing, unexpected, mis-shaped, wrongly typed entry or
        one whose dtype would change.
      TypeError: ``dtype`` is not a floating dtype JAX holds as it is.
    """
    if dtype is not None:
        check_floating_dtype(dtype)
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
        if not is_floating(value.dtype):
            problems.append(f"entry '{name}' has dtype {value.dtype}, expected a floating dtype")
            continue
        want = tuple(np.shape(flat_template[path]))
        torch_shape = want[::-1] if _is_kernel(path) else want
        if value.shape != torch_shape:
            problems.append(f"entry '{name}' has shape {value.shape}, expected {torch_shape}")
            continue
        target, problem = _kept_dtype(value.dtype, dtype)
        if problem:
            problems.append(f"entry '{name}' {problem}")
            continue
        value = value.T if _is_kernel(path) else value
        flat_params[path] = jnp.asarray(value.astype(target, copy=False))
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
    variables = jax.eval_shape(lambda: init_example(module))
    return variables["params"]


def from_torch_state_dict(module, state_dict: Mapping[str, Any], *, dtype=None):
    """Variables ``{'params': ...}`` for ``module`` from its PyTorch twin's ``state_dict``.

    ``state_dict`` holds NumPy arrays (``torch_ref.state_dict_to_numpy`` makes them).
    Strict: see :func:`params_from_state_dict`. Values are kept bit for bit in their dtype;
    ``dtype=`` (e.g. ``jnp.float32`` for float64 weights in JAX's 32-bit mode) converts them,
    and only then.

    For a flax_attn NNX module (:mod:`flax_attn.nnx`) the weights are loaded into ``module``
    (in place) and the module is returned.
    """
    linen = _linen(module)
    params = params_from_state_dict(state_dict, param_template(linen), buffers=twin_of(linen).buffers(linen),
                                    dtype=dtype)
    if linen is not module:
        from flax_attn.nnx.convert import from_linen

        return from_linen(module, {"params": params})
    return {"params": params}


def to_torch_state_dict(module, variables=None) -> dict[str, np.ndarray]:
    """The PyTorch twin's ``state_dict`` (NumPy arrays, buffers included) from ``variables``
    (for an NNX module: from the module's own parameters when ``variables`` is None)."""
    if isinstance(module, nnx.Module):
        if variables is None:
            from flax_attn.nnx.convert import to_linen

            variables = to_linen(module)
        module = _linen(module)
    if variables is None:
        raise TypeError("to_torch_state_dict(module, variables): a Linen module needs its variables")
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
    problems += [f"parameter {'/'.join(p)} has dtype {_checks.dtype_of(got[p])}, expected a floating dtype"
                 for p in sorted(set(got) & set(want)) if not is_floating(_checks.dtype_of(got[p]))]
    if problems:
        raise StateDictError("params do not fit the module:\n  " + "\n  ".join(problems))
    return params_to_state_dict(params, buffers=twin_of(module).buffers(module))


# --------------------------------------------------------------------------- flax_attn's twins

def _fields(*names):
    """kwargs: the module's fields of these names (the twin's constructor takes the same names)."""
    return lambda m: {name: getattr(m, name) for name in names}


def _tokens(width: str, *, batched: bool = True):
    """example_inputs: one token of ``getattr(m, width)`` features (in a batch of one), in ``m.param_dtype``."""

    def example_inputs(m) -> tuple:
        shape = (1, getattr(m, width))
        return (jnp.zeros((1,) + shape if batched else shape, m.param_dtype),)

    return example_inputs


def _deterministic(m) -> dict:
    return {"deterministic": True}


def _causal_mask_buffer(context_length: int) -> np.ndarray:
    """The chapter's registered buffer: ``triu(ones(C, C), diagonal=1)`` (1 = blocked)."""
    return np.triu(np.ones((context_length, context_length), np.float32), k=1)


register_twin(SelfAttention_v1, torch="torch_ref.chapter.SelfAttention_v1", kwargs=_fields("d_in", "d_out"),
              example_inputs=_tokens("d_in", batched=False))
register_twin(SelfAttention_v2, torch="torch_ref.chapter.SelfAttention_v2",
              kwargs=_fields("d_in", "d_out", "qkv_bias"), example_inputs=_tokens("d_in", batched=False))
register_twin(CausalAttention, torch="torch_ref.chapter.CausalAttention",
              kwargs=_fields("d_in", "d_out", "context_length", "dropout", "qkv_bias"),
              example_inputs=_tokens("d_in"), example_kwargs=_deterministic,
              buffers=lambda m: {"mask": _causal_mask_buffer(m.context_length)})
register_twin(MultiHeadAttentionWrapper, torch="torch_ref.chapter.MultiHeadAttentionWrapper",
              kwargs=_fields("d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias"),
              example_inputs=_tokens("d_in"), example_kwargs=_deterministic,
              buffers=lambda m: {f"heads.{i}.mask": _causal_mask_buffer(m.context_length)
                                 for i in range(m.num_heads)})
register_twin(MultiHeadAttention, torch="torch_ref.chapter.MultiHeadAttention",
              kwargs=_fields("d_in", "d_out", "context_length", "dropout", "num_heads", "qkv_bias"),
              example_inputs=_tokens("d_in"), example_kwargs=_deterministic,
              buffers=lambda m: {"mask": _causal_mask_buffer(m.context_length)})
register_twin(TransformerMultiHeadAttention, torch="torch_ref.transformer.MultiHeadAttention",
              kwargs=_fields("d_model", "num_heads"), example_inputs=lambda m: _tokens("d_model")(m) * 3)
register_twin(LearnedPositionalEmbedding, torch="torch_ref.modern.LearnedPositionalEmbedding",
              kwargs=_fields("num_positions", "features"),
              example_inputs=lambda m: (jnp.zeros((1, 1), jnp.int32),))
# AttentionConfig's fields are torch_ref.modern.Attention's keyword arguments (asdict turns a
# RopeScaling into a dict of its fields).
register_twin(Attention, torch="torch_ref.modern.Attention", kwargs=lambda m: dataclasses.asdict(m.config),
              example_inputs=lambda m: (jnp.zeros((1, 1, m.config.d_model), m.param_dtype),),
              example_kwargs=lambda m: {"positions": jnp.zeros((1, 1), jnp.int32), "deterministic": True})
# MLAConfig's fields are torch_ref.mla.MultiHeadLatentAttention's keyword arguments.
register_twin(MultiHeadLatentAttention, torch="torch_ref.mla.MultiHeadLatentAttention",
              kwargs=lambda m: dataclasses.asdict(m.config),
              example_inputs=lambda m: (jnp.zeros((1, 1, m.config.d_model), m.param_dtype),
                                        jnp.zeros((1, 1), jnp.int32)),
              example_kwargs=_deterministic)
