"""Saving and restoring a module's parameters with Orbax: bit-exact, atomic, checked.

    flax_attn.checkpoint.save("ckpt", step, module, variables)
    variables = flax_attn.checkpoint.restore("ckpt", module)           # the latest step

* Bit-exact: arrays come back with the dtype and bits they were saved with (bfloat16 too).
* Atomic: Orbax writes a step into a temporary directory and renames it when complete, so a
  save interrupted by a crash or a kill leaves the earlier steps restorable, and the
  unfinished one is never mistaken for a checkpoint.
* Checked: each step records the module's class and configuration. Restoring into a module
  of another class or configuration, or whose parameters have other names or shapes, raises
  ``CheckpointMismatchError`` listing every difference, instead of producing a wrong model
  (``num_heads`` can change the model while every parameter keeps its shape). Fields that do
  not change the model may differ: dropout rates, ``precision``, ``implementation``,
  ``param_dtype`` (the saved dtype is restored).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from flax_attn.interop import param_template


class CheckpointMismatchError(ValueError):
    """The checkpoint holds another module than the one restored into; the message lists how."""


def _jsonable(value: Any):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__class__": type(value).__name__,
                **{f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    try:
        return np.dtype(value).name  # dtypes such as jnp.float32
    except TypeError:
        return repr(value)


def describe(module) -> dict:
    """The module's class and configuration (its dataclass fields), as JSON."""
    fields = {f.name: _jsonable(getattr(module, f.name)) for f in dataclasses.fields(module)
              if f.name not in ("parent", "name")}
    return {"class": type(module).__name__, "config": fields}


def _manager(directory, *, create: bool, keep: Optional[int] = None) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=False)
    handlers = {"params": ocp.StandardCheckpointHandler(), "module": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_handlers=handlers)


def save(directory, step: int, module, variables, *, keep: Optional[int] = None) -> Path:
    """Save ``variables`` of ``module`` as checkpoint ``step`` under ``directory``.

    Args:
      directory: the checkpoint directory (created if missing); each step is a subdirectory.
      step: a non-negative integer, larger than the steps already saved.
      module: the module the variables belong to (its configuration is recorded).
      variables: ``{'params': ...}`` as ``module.init`` returns.
      keep: keep only the newest ``keep`` steps (None: all).

    Returns:
      The step's directory.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if not isinstance(variables, dict) or "params" not in variables:
        raise TypeError("variables must be a dict with a 'params' collection, as module.init returns")
    with _manager(directory, create=True, keep=keep) as manager:
        if manager.latest_step() is not None and step <= manager.latest_step():
            raise ValueError(f"step {step} is not after the latest saved step {manager.latest_step()} in {directory}")
        manager.save(int(step), args=ocp.args.Composite(
            params=ocp.args.StandardSave(variables["params"]),
            module=ocp.args.JsonSave(describe(module)),
        ))
        manager.wait_until_finished()
    return Path(directory).absolute() / str(step)


def steps(directory) -> list[int]:
    """The complete steps saved under ``directory`` (an interrupted save is not among them)."""
    with _manager(directory, create=False) as manager:
        return list(manager.all_steps())


def restore(directory, module, *, step: Optional[int] = None) -> dict:
    """Variables ``{'params': ...}`` for ``module`` from checkpoint ``step`` (default: the latest).

    Raises:
      FileNotFoundError: no complete checkpoint (or not that step) under ``directory``.
      CheckpointMismatchError: the checkpoint was saved from another class or configuration,
        or its parameters differ in names or shapes from ``module``'s; every difference is listed.
    """
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    with _manager(directory, create=False) as manager:
        available = list(manager.all_steps())
        if step is None:
            step = manager.latest_step()
        if step is None or step not in available:
            raise FileNotFoundError(f"no complete checkpoint {'' if step is None else f'step {step} '}in {directory}; "
                                    f"complete steps: {available}")
        saved = manager.restore(step, args=ocp.args.Composite(module=ocp.args.JsonRestore()))["module"]
        problems = _config_differences(saved, describe(module))
        metadata = manager.item_metadata(step)["params"]
        saved_leaves = traverse_util.flatten_dict(_as_dict(metadata))
        want = traverse_util.flatten_dict(_as_dict(param_template(module)))
        problems += [f"parameter {'/'.join(p)} is missing from the checkpoint" for p in sorted(set(want) - set(saved_leaves))]
        problems += [f"checkpoint has parameter {'/'.join(p)} the module does not" for p in sorted(set(saved_leaves) - set(want))]
        problems += [f"parameter {'/'.join(p)} has shape {tuple(saved_leaves[p].shape)} in the checkpoint, "
                     f"{tuple(want[p].shape)} in the module"
                     for p in sorted(set(want) & set(saved_leaves)) if tuple(saved_leaves[p].shape) != tuple(want[p].shape)]
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {directory} step {step} does not fit {type(module).__name__}:\n  " + "\n  ".join(problems))
        target = traverse_util.unflatten_dict(
            {p: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype) for p, m in saved_leaves.items()})
        params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
    return {"params": params}


def _as_dict(tree):
    """Orbax metadata and Flax params as plain nested dicts."""
    if hasattr(tree, "items"):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree


# Configuration fields that do not change the model a checkpoint holds.
NOT_THE_MODEL = {"dropout", "precision", "implementation", "param_dtype", "config.dropout"}


def _config_differences(saved: dict, current: dict) -> list[str]:
    if saved["class"] != current["class"]:
        return [f"the checkpoint holds a {saved['class']}, not a {current['class']}"]
    out = []
    s_cfg, c_cfg = _flat(saved["config"]), _flat(current["config"])
    for key in sorted((set(s_cfg) | set(c_cfg)) - NOT_THE_MODEL):
        a, b = s_cfg.get(key, "<absent>"), c_cfg.get(key, "<absent>")
        if a != b:
            out.append(f"{key} is {a!r} in the checkpoint, {b!r} in the module")
    return out


def _flat(cfg, prefix=""):
    if isinstance(cfg, dict):
        out = {}
        for k, v in cfg.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: cfg}
