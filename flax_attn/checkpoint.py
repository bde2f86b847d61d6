"""Saving and restoring a module's parameters with Orbax: bit-exact, atomic, checksummed, one writer.

    flax_attn.checkpoint.save("ckpt", step, module, variables)
    variables = flax_attn.checkpoint.restore("ckpt", module)           # the latest step

* Bit-exact: arrays come back with the dtype and bits they were saved with (bfloat16 too).
* Atomic: Orbax writes a step into a temporary directory and renames it when complete, so a
  save interrupted by a crash or a kill leaves the earlier steps restorable, and the
  unfinished one is never mistaken for a checkpoint.
* Checksummed: each step records a SHA-256 of every array (over its dtype, shape and bytes)
  and of the module description, and the record checks itself. ``restore`` recomputes them on
  what it read and raises ``CheckpointCorruptError`` naming the step and every damaged array
  (a flipped bit, a truncated or missing file, an unreadable record) instead of returning
  changed parameters. Damage to one step leaves the others restorable; ``restore`` never falls
  back to an older step on its own (pass ``step=``). :func:`verify` checks a step without a module.
* One writer at a time: ``save`` holds a lock file in the directory while it writes, so a
  second process (or thread) saving into the same directory meanwhile is refused with
  ``CheckpointLockedError`` and nothing it was asked to save is reported saved. The lock is
  created atomically (a hard link of a fully written file, or ``O_CREAT | O_EXCL`` where hard
  links are not supported) and holds the writer's host, pid and process start time. A lock
  left by a process that died on this host (a kill, a crash) is detected and taken over; one
  left on another host cannot be checked from here and must be deleted by hand (the error
  names the file). Unfinished temporary directories left by crashed saves are removed by the
  next save. A step is never replaced: saving a step that is not after the latest is an error.
* Checked: each step records the module's class and configuration. Restoring into a module
  of another class or configuration, or whose parameters have other names or shapes, raises
  ``CheckpointMismatchError`` listing every difference, instead of producing a wrong model
  (``num_heads`` can change the model while every parameter keeps its shape). Fields that do
  not change the model may differ: dropout rates, ``precision``, ``implementation`` (a name or
  an object), ``param_dtype`` (the saved dtype is restored), ``MLAConfig.absorb``. A field
  added to a configuration after a checkpoint was saved (absent from its record) stands for its
  default: the checkpoint restores into a module that keeps the default, and is refused by one
  that does not. ``save`` checks the variables against the module (names and shapes) first.

Readers need no lock: a step becomes visible only once complete. A reader can still fail if a
writer with ``keep=`` deletes the step it is reading (``FileNotFoundError``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, traverse_util

from flax_attn import _checks
from flax_attn.interop import is_floating, param_template

LOCK_NAME = ".flax_attn-save.lock"
CHECKSUM_FORMAT = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint holds another module than the one restored into; the message lists how."""


class CheckpointCorruptError(ValueError):
    """A saved step fails its checksums or cannot be read.

    Attributes:
      step: the damaged step.
      arrays: the parameter paths (``'W_query/kernel'``) found damaged; empty when the damage is
        to the step's records rather than to particular arrays.
    """

    def __init__(self, message: str, *, step: Optional[int] = None, arrays: tuple = ()):
        super().__init__(message)
        self.step = step
        self.arrays = tuple(arrays)


class CheckpointLockedError(RuntimeError):
    """Another writer holds the checkpoint directory's lock; nothing was saved."""


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


# ----------------------------------------------------------------------------------------------
# Checksums


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def array_digest(x) -> str:
    """SHA-256 (hex) of an array's dtype name, shape and C-order bytes."""
    x = np.asarray(x)
    h = hashlib.sha256(f"{x.dtype.name}|{','.join(map(str, x.shape))}|".encode())
    h.update(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
    return h.hexdigest()


def _checksum_record(description: dict, params) -> dict:
    flat = traverse_util.flatten_dict(_as_dict(params))
    arrays = [{"path": list(p), "dtype": np.asarray(x).dtype.name, "shape": list(np.shape(x)),
               "sha256": array_digest(x)} for p, x in sorted(flat.items())]
    record = {"format": CHECKSUM_FORMAT, "module_sha256": hashlib.sha256(_canonical(description)).hexdigest(),
              "arrays": arrays}
    return {**record, "sha256": hashlib.sha256(_canonical(record)).hexdigest()}


# ----------------------------------------------------------------------------------------------
# The writer's lock


def _process_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(holder: dict) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True  # cannot tell: assume it lives
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return False  # a zombie holds no lock
    except (OSError, IndexError):
        pass
    start = _process_start(pid)
    return not (start is not None and holder.get("start") is not None and start != holder["start"])


def _read_lock(path: Path) -> Optional[dict]:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # unreadable: treated as held by an unknown writer


def _create_lock(path: Path, content: bytes) -> bool:
    """Create ``path`` holding ``content`` atomically; False if it exists."""
    staging = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    try:
        with open(staging, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(staging, path)  # atomic, and the lock is complete the moment it appears
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system: O_EXCL, written right after
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
            return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staging)


@contextlib.contextmanager
def _takeover_guard(directory: Path):
    """Serialise stale-lock takeovers on this host (an advisory lock on the directory)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no guard
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # a file system without flock: no guard
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def _writer_lock(directory: Path):
    path = directory / LOCK_NAME
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S %z"), "token": uuid.uuid4().hex}
    for _ in range(100):
        if _create_lock(path, _canonical(me)):
            break
        holder = _read_lock(path)
        if holder is None:
            continue  # released meanwhile: try again
        if holder.get("host") == me["host"] and not _alive(holder):
            with _takeover_guard(directory):
                if _read_lock(path) == holder:  # nobody took it over before us
                    os.unlink(path)
            continue
        who = (f"pid {holder.get('pid')} on host {holder.get('host')!r} since {holder.get('since')}"
               if holder else "an unknown writer (the lock file is unreadable)")
        elsewhere = holder.get("host") not in (None, me["host"])
        raise CheckpointLockedError(
            f"checkpoint directory {directory} is being written by {who}; nothing was saved. "
            f"The lock is {path}" + (f"; a lock from another host is not checked for a live process: delete it "
                                     f"if no process on {holder.get('host')!r} is saving" if elsewhere else
                                     "; delete it only if that process is no longer saving"))
    else:
        raise CheckpointLockedError(f"could not take the lock {path}: it changed hands 100 times")
    try:
        yield
    finally:
        if (_read_lock(path) or {}).get("token") == me["token"]:
            os.unlink(path)


# ----------------------------------------------------------------------------------------------
# Saving


def _manager(directory, *, create: bool, keep: Optional[int] = None, cleanup: bool = False) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create, enable_async_checkpointing=False,
                                           cleanup_tmp_directories=cleanup)
    handlers = {"params": ocp.StandardCheckpointHandler(), "module": ocp.JsonCheckpointHandler(),
                "checksums": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(Path(directory).absolute(), options=options, item_handlers=handlers)


def save(directory, step: int, module, variables, *, keep: Optional[int] = None) -> Path:
    """Save ``variables`` of ``module`` as checkpoint ``step`` under ``directory``.

    Args:
      directory: the checkpoint directory (created if missing); each step is a subdirectory.
      step: a non-negative integer, larger than the steps already saved (a saved step is never
        replaced).
      module: the module the variables belong to (its configuration is recorded).
      variables: ``{'params': ...}`` as ``module.init`` returns.
      keep: keep only the newest ``keep`` steps (None: all).

    Returns:
      The step's directory, once the step is complete (written, renamed into place).

    Raises:
      CheckpointLockedError: another writer is saving into ``directory``; nothing was saved.
      CheckpointMismatchError: ``variables`` do not fit ``module`` (names or shapes, each listed);
        nothing was saved.
      ValueError: ``step`` is not after the latest saved step.
    """
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    _check_linen(module, "save")
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise TypeError("variables must be a dict with a 'params' collection, as module.init returns")
    variables = _as_dict(variables)  # a FrozenDict too
    problems = _param_differences(variables["params"], param_template(module), "variables")
    problems += [f"parameter {'/'.join(p)} has dtype {_checks.dtype_of(v)}; parameters are floating-point"
                 for p, v in sorted(traverse_util.flatten_dict(variables["params"]).items())
                 if not is_floating(_checks.dtype_of(v))]
    if problems:
        raise CheckpointMismatchError(f"variables do not fit {type(module).__name__} (nothing was saved):\n  "
                                      + "\n  ".join(problems))
    description = describe(module)
    checksums = _checksum_record(description, variables["params"])
    directory = Path(directory).absolute()
    directory.mkdir(parents=True, exist_ok=True)
    with _writer_lock(directory), _manager(directory, create=True, keep=keep, cleanup=True) as manager:
        latest = manager.latest_step()
        if latest is not None and step <= latest:
            exists = f" (step {step} exists; a saved step is never replaced)" if step in manager.all_steps() else ""
            raise ValueError(f"step {step} is not after the latest saved step {latest} in {directory}{exists}")
        manager.save(int(step), args=ocp.args.Composite(
            params=ocp.args.StandardSave(variables["params"]),
            module=ocp.args.JsonSave(description),
            checksums=ocp.args.JsonSave(checksums),
        ))
        manager.wait_until_finished()
    return directory / str(step)


def steps(directory) -> list[int]:
    """The complete steps saved under ``directory`` (an interrupted save is not among them).

    A complete step may still have been damaged since; :func:`verify` checks one.
    """
    with _manager(directory, create=False) as manager:
        return list(manager.all_steps())


# ----------------------------------------------------------------------------------------------
# Restoring


def _choose_step(directory: Path, manager, step: Optional[int]) -> tuple[int, list[int]]:
    available = list(manager.all_steps())
    if step is None:
        step = manager.latest_step()
    if step is None or step not in available:
        raise FileNotFoundError(f"no complete checkpoint {'' if step is None else f'step {step} '}in {directory}; "
                                f"complete steps: {available}")
    return int(step), available


def _read_verified(directory: Path, manager, step: int, available: list[int]) -> tuple[dict, dict]:
    """The step's module description and params (NumPy), every checksum verified."""
    step_dir = directory / str(step)
    others = [s for s in available if s != step]

    def corrupt(what: str, arrays=()) -> CheckpointCorruptError:
        if not step_dir.is_dir():
            raise FileNotFoundError(f"checkpoint {directory} step {step} was deleted while being read "
                                    f"(another process saving with keep=?)")
        return CheckpointCorruptError(
            f"checkpoint {directory} step {step} is damaged: {what}. Other steps: {others}"
            + (" (restore one with step=)" if others else ""), step=step, arrays=arrays)

    if not (step_dir / "checksums").is_dir():
        raise corrupt("it holds no checksums (written by a flax_attn that did not record them, or its "
                      "'checksums' item was lost); restore(..., verify_checksums=False) reads it unverified")
    try:
        items = manager.restore(step, args=ocp.args.Composite(module=ocp.args.JsonRestore(),
                                                              checksums=ocp.args.JsonRestore()))
        record, description = dict(items["checksums"]), dict(items["module"])
    except Exception as e:  # noqa: BLE001 - any failure to read is damage
        raise corrupt(f"its records cannot be read ({type(e).__name__}: {e})") from e
    claimed = record.pop("sha256", None)
    if claimed != hashlib.sha256(_canonical(record)).hexdigest() or record.get("format") != CHECKSUM_FORMAT:
        raise corrupt("its checksum record fails its own checksum")
    if record["module_sha256"] != hashlib.sha256(_canonical(description)).hexdigest():
        raise corrupt("the module description fails its checksum")

    entries = {tuple(a["path"]): a for a in record["arrays"]}
    target = traverse_util.unflatten_dict({p: jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"])) for p, a in entries.items()})
    numpy_args = jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    reader = ocp.PyTreeCheckpointer()
    try:
        params = reader.restore(step_dir / "params", args=ocp.args.PyTreeRestore(item=target, restore_args=numpy_args))
        flat = traverse_util.flatten_dict(_as_dict(params))
        if set(flat) != set(entries):
            raise ValueError(f"read arrays {sorted(flat)}, recorded {sorted(entries)}")
    except Exception as e:  # noqa: BLE001 - find which arrays cannot be read, one by one
        bad = []
        for p, a in sorted(entries.items()):
            one = traverse_util.unflatten_dict({p: jax.ShapeDtypeStruct(tuple(a["shape"]), jnp.dtype(a["dtype"]))})
            try:
                reader.restore(step_dir / "params", args=ocp.args.PyTreeRestore(
                    item=one, restore_args=jax.tree_util.tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), one),
                    partial_restore=True))
            except Exception:  # noqa: BLE001
                bad.append("/".join(p))
        names = f"arrays that cannot be read: {', '.join(bad)}" if bad else "its arrays cannot be read"
        raise corrupt(f"{names} ({type(e).__name__}: {str(e).splitlines()[0][:300]})", bad) from e
    damaged = [p for p, a in sorted(entries.items())
               if np.asarray(flat[p]).dtype.name != a["dtype"] or list(np.shape(flat[p])) != a["shape"]
               or array_digest(flat[p]) != a["sha256"]]
    if damaged:
        names = ["/".join(p) for p in damaged]
        raise corrupt(f"arrays whose contents differ from what was saved (SHA-256 mismatch): {', '.join(names)}", names)
    return description, params


def verify(directory, *, step: Optional[int] = None) -> int:
    """Check step ``step`` (default: the latest) against its checksums; return the step.

    Raises:
      FileNotFoundError: no complete checkpoint (or not that step) under ``directory``.
      CheckpointCorruptError: the step is damaged; the message names it and the damaged arrays.
    """
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    with _manager(directory, create=False) as manager:
        step, available = _choose_step(directory, manager, step)
        _read_verified(directory, manager, step, available)
    return step


def restore(directory, module, *, step: Optional[int] = None, verify_checksums: bool = True,
            shardings=None) -> dict:
    """Variables ``{'params': ...}`` for ``module`` from checkpoint ``step`` (default: the latest).

    Args:
      directory: the checkpoint directory.
      module: the module to restore into (its class and configuration are checked).
      step: which step (default: the latest complete one; never an older one in its place).
      verify_checksums: check every array against the SHA-256 recorded at save time (the default).
        ``False`` only to read a checkpoint written before checksums were recorded.
      shardings: where to put the arrays (default: JAX's default device): a tree of
        ``jax.sharding.Sharding`` over the parameters, ``{'params': ...}`` or the params alone,
        as ``flax_attn.parallel.named_shardings(flax_attn.parallel.partition_specs(module,
        template, mesh=mesh), mesh)`` gives (``template``: :func:`flax_attn.interop.param_template`).
        Each device receives its shard. Checksums are over whole arrays, so with
        ``verify_checksums`` each array is first read whole into host memory (one at a time is
        not promised: the host holds the parameters once); without, Orbax reads each device's
        shard directly.

    Raises:
      FileNotFoundError: no complete checkpoint (or not that step) under ``directory``.
      CheckpointCorruptError: the step is damaged (a changed, truncated or missing file); the
        message names the step and every damaged array; other steps are unaffected.
      CheckpointMismatchError: the checkpoint was saved from another class or configuration,
        or its parameters differ in names or shapes from ``module``'s; every difference is listed.
    """
    _check_linen(module, "restore")
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint directory at {directory}")
    with _manager(directory, create=False) as manager:
        step, available = _choose_step(directory, manager, step)
        if verify_checksums:
            saved, params = _read_verified(directory, manager, step, available)
            saved_leaves = traverse_util.flatten_dict(_as_dict(params))
        else:
            saved = manager.restore(step, args=ocp.args.Composite(module=ocp.args.JsonRestore()))["module"]
            saved_leaves = traverse_util.flatten_dict(_as_dict(manager.item_metadata(step)["params"]))
        problems = _config_differences(saved, describe(module), module)
        problems += _param_differences(saved_leaves, param_template(module), "the checkpoint")
        if problems:
            raise CheckpointMismatchError(
                f"checkpoint {directory} step {step} does not fit {type(module).__name__}:\n  " + "\n  ".join(problems))
        place = _placement(shardings, saved_leaves)
        if verify_checksums:
            if place is None:
                return {"params": jax.tree_util.tree_map(jnp.asarray, params)}
            flat = traverse_util.flatten_dict(_as_dict(params))
            return {"params": traverse_util.unflatten_dict({p: jax.device_put(x, place[p]) for p, x in flat.items()})}
        target = traverse_util.unflatten_dict(
            {p: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=None if place is None else place[p])
             for p, m in saved_leaves.items()})
        params = manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))["params"]
    return {"params": params}


def _placement(shardings, saved_leaves: dict) -> Optional[dict]:
    """``{path: Sharding}`` for every saved array, from :func:`restore`'s ``shardings``; a
    ValueError naming the arrays a sharding is missing for, given for no array, or cannot
    split."""
    if shardings is None:
        return None
    tree = shardings["params"] if isinstance(shardings, Mapping) and set(shardings) == {"params"} else shardings
    if not isinstance(tree, Mapping):
        raise TypeError(f"shardings must be a mapping (dict, FrozenDict) of jax.sharding.Sharding (the parameters' tree), "
                        f"got {type(tree).__name__}")
    place = traverse_util.flatten_dict(_as_dict(tree))
    problems = [f"no sharding for {'/'.join(p)}" for p in sorted(set(saved_leaves) - set(place))]
    problems += [f"a sharding for {'/'.join(p)}, which the checkpoint does not hold"
                 for p in sorted(set(place) - set(saved_leaves))]
    for p in sorted(set(place) & set(saved_leaves)):
        sharding, shape = place[p], tuple(saved_leaves[p].shape)
        if not isinstance(sharding, jax.sharding.Sharding):
            problems.append(f"{'/'.join(p)}: {sharding!r} is not a jax.sharding.Sharding "
                            f"(flax_attn.parallel.named_shardings turns PartitionSpecs into NamedShardings)")
            continue
        try:
            sharding.check_compatible_aval(shape)  # rank
            sharding.shard_shape(shape)            # divisibility
        except ValueError as e:
            problems.append(f"{'/'.join(p)} of shape {shape} cannot be split by {sharding}: {str(e).splitlines()[0]}")
    if problems:
        raise ValueError("restore's shardings do not fit the checkpoint's parameters:\n  " + "\n  ".join(problems))
    return place


def _check_linen(module, function: str) -> None:
    """A TypeError naming ``module`` unless it is a Linen module (an NNX module goes through its
    Linen twin)."""
    if isinstance(module, nn.Module):
        return
    if isinstance(module, nnx.Module):
        raise TypeError(f"checkpoint.{function} takes a Linen module, got the NNX module {type(module).__name__}: "
                        f"pass its Linen twin, fa.nnx.linen_twin(module), with fa.nnx.to_linen(module) as the "
                        f"variables to save; fa.nnx.from_linen(module, restored) loads restored ones into it")
    raise TypeError(f"checkpoint.{function}: module must be a flax_attn Linen module, got {type(module).__name__}")


def _param_differences(got, want, where: str) -> list[str]:
    """The parameters of ``got`` (nested or flat, found in ``where``) that ``want``'s (the
    module's template) do not match, by name and shape, as sentences."""
    got = got if all(isinstance(p, tuple) for p in got) else traverse_util.flatten_dict(_as_dict(got))
    want = traverse_util.flatten_dict(_as_dict(want))
    return ([f"parameter {'/'.join(p)} is missing from {where}" for p in sorted(set(want) - set(got))]
            + [f"{where} has parameter {'/'.join(p)} the module does not" for p in sorted(set(got) - set(want))]
            + [f"parameter {'/'.join(p)} has shape {tuple(np.shape(got[p]))} in {where}, {tuple(want[p].shape)} in "
               f"the module" for p in sorted(set(want) & set(got)) if tuple(np.shape(got[p])) != tuple(want[p].shape)])


def _as_dict(tree):
    """Orbax metadata and Flax params as plain nested dicts."""
    if hasattr(tree, "items"):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree


# Configuration fields that do not change the model a checkpoint holds.
# An implementation given as an object is recorded field by field (``implementation.block_q``, ...):
# a key under one of these is not the model either.
NOT_THE_MODEL = {"dropout", "precision", "implementation", "param_dtype", "config.dropout", "config.absorb"}


def _is_the_model(key: str) -> bool:
    return not any(key == name or key.startswith(name + ".") for name in NOT_THE_MODEL)


def _config_differences(saved: dict, current: dict, module=None) -> list[str]:
    """What differs between the saved and the current descriptions, as sentences.

    A field the checkpoint does not record (a field added to the configuration after it was
    saved) counts as the field's default: a checkpoint saved before ``chunk_size`` existed holds
    a model without chunks, so it restores into a module whose ``chunk_size`` is the default,
    and one whose value is not the default is a difference. ``module`` (the module restored
    into) tells the defaults; without it an absent field is a difference.
    """
    if saved["class"] != current["class"]:
        return [f"the checkpoint holds a {saved['class']}, not a {current['class']}"]
    out = []
    s_cfg, c_cfg = _flat(saved["config"]), _flat(current["config"])
    for key in sorted(k for k in set(s_cfg) | set(c_cfg) if _is_the_model(k)):
        a, b = s_cfg.get(key, "<absent>"), c_cfg.get(key, "<absent>")
        if key not in s_cfg and key in c_cfg:
            default = _field_default(module, key)
            if default is not _NO_DEFAULT:
                if default == b:
                    continue  # the field came later; the checkpoint's model had its default
                out.append(f"{key} is absent from the checkpoint (saved before the field existed: its default "
                           f"{default!r}), {b!r} in the module")
                continue
        if a != b:
            out.append(f"{key} is {a!r} in the checkpoint, {b!r} in the module")
    return out


_NO_DEFAULT = object()


def _field_default(module, dotted: str):
    """The default of the dataclass field at ``dotted`` (``'config.chunk_size'``) of ``module``,
    as :func:`describe` writes values, or ``_NO_DEFAULT`` when the path has no field with a default."""
    owner = module
    *parents, name = dotted.split(".")
    for part in parents:
        owner = getattr(owner, part, None)
    if owner is None or not dataclasses.is_dataclass(owner) or isinstance(owner, type):
        return _NO_DEFAULT
    fields = {f.name: f for f in dataclasses.fields(owner)}
    if name not in fields:
        return _NO_DEFAULT
    f = fields[name]
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return _NO_DEFAULT
    flat = _flat(_jsonable(value))
    return flat.get("", _NO_DEFAULT) if set(flat) == {""} else _NO_DEFAULT


def _flat(cfg, prefix=""):
    if isinstance(cfg, dict):
        out = {}
        for k, v in cfg.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: cfg}
