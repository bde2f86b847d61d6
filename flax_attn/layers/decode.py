"""A compiled decoding step: one ``jax.jit`` of a layer's cached call, with the cache donated.

    step = flax_attn.decode_step(layer)                      # Linen: fa.Attention(config)
    cache = layer.init_cache(batch=B, max_len=S)
    out, cache = step(params, cache, prompt, positions)      # prefill: (B, T0, D), (B, T0)
    for t in range(T0, T0 + steps):
        out, cache = step(params, cache, x_t, jnp.full((B, 1), t))   # one token: (B, 1, D)

Donating the cache (``donate_argnums``) lets XLA write the new keys into the cache's own
buffers (``lax.dynamic_update_slice`` in place) instead of copying ``B * S * K * H`` keys and
values every step. The cache passed in is consumed: use only the one returned.

:func:`decode_loop` compiles a whole run of one-token steps into one program (a ``lax.scan``
feeding each step's output back as the next input on the device)::

    loop = flax_attn.decode_loop(model, next_input)          # next_input(out) -> (x_next, emitted)
    emitted, cache = loop(params, cache, x_t, positions_t, steps)
"""
from __future__ import annotations

import collections
import functools
import inspect
from typing import Any, Callable, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_attn import _checks
from flax_attn.core import tuning


CHECK_LAG = 4  # calls after which a one-token step's checks are read (decode_step's check_lag)


def decode_step(layer, *, donate: bool = True, check_lag: int = CHECK_LAG,
                compiler_options: Optional[dict] = None) -> Callable:
    """The jitted decoding step of ``layer``: ``(out, cache) = layer(x, positions, cache=cache)``.

    The step compiles once per input shape (one prefill shape, one step shape), runs
    deterministically (no dropout: a flax_attn layer is called with ``deterministic=True``;
    an NNX module in eval mode, ``module.eval()`` on the step's own copy, every submodule
    included; any Linen module whose call takes a ``deterministic`` argument is called with
    ``deterministic=True``, and a container must pass it on to its layers) and, with
    ``donate=True``, donates the cache so that it is updated in place. The cache given to a
    step must not be used again (JAX deletes its buffers): keep the one the step returns.

    **Run-time checks** (cache overflow, positions going backwards, ...) run inside the
    compiled step without host callbacks (which would keep JAX off its fast dispatch path:
    on a 2-core AMD EPYC, 1.1 ms against 0.5 ms per step of a 768-wide layer at batch 1).
    A call with more than one new token (a prefill) waits for its checks and raises their
    ``ValueError`` at once. A one-token call does not wait: the transfer of its checks to
    the host starts when it is dispatched, and they are read ``check_lag`` calls later, when
    they have long arrived, or by ``step.check()``; the ``ValueError`` names the failed
    condition, and the ``out`` of a failed step is NaN, so that a loop that stops right
    after it cannot use it unawares. Reading them at the next call (``check_lag=1``, a round
    trip to the device every step) made a step 4-20% slower on an NVIDIA H100 (0.35-0.50 ms
    against 0.31-0.41 ms, ``benchmarks.decode_gpu``).

    Args:
      layer: a Linen :class:`flax_attn.Attention` (or any Linen module called as
        ``module(x, positions, [segment_ids,] cache=cache)`` that returns ``(out, cache)``, e.g. a
        decoder stack taking a list of caches), or an NNX :class:`flax_attn.nnx.Attention` (or
        any NNX module with that call).
      donate: donate the cache to the step (default True).
      check_lag: a one-token step's checks are read this many calls after it (default
        ``CHECK_LAG``); 1 reads them at the next call.
      compiler_options: XLA compile options of the step (``jax.jit``'s ``compiler_options``).
        None (default): :func:`flax_attn.core.tuning.cpu_compiler_options`, which on a CPU
        without AVX-512 runs the step's matmuls on XLA's Eigen kernels instead of its YNNPACK
        fusions (3-25% faster steps measured there); ``{}``: XLA's defaults. The step is
        compiled by :func:`flax_attn.core.tuning.jit`, so that forms fast only under these
        options are taken (the key blocks' summed one-row units, the absorbed latent
        attention's in-place ``kv_b_proj``).

    Returns:
      Linen: ``step(variables, cache, x, positions, segment_ids=None) -> (out, cache)``;
      NNX: ``step(cache, x, positions, segment_ids=None) -> (out, cache)`` (reading the
      module's current parameters at each call). ``x`` is ``(B, T, D)``, ``positions`` and
      ``segment_ids`` int ``(B, T)``, ``out`` ``(B, T, D)``; ``cache`` a :class:`KVCache`
      (or the pytree of caches the module takes). ``step.check()`` raises the failed check of
      any step not yet read. ``step.jitted`` is the underlying ``jax.jit`` function (e.g.
      ``step.jitted._cache_size()`` counts its compilations); it returns ``((out, cache),
      checks)``, ``checks`` one int32 vector (the verdicts and values of the run-time checks),
      and ``step.raise_failed(checks)`` raises the ``ValueError`` of a failed one. It has no
      host callback, so it is the form of a cached call that ``jax.export`` takes
      (``jax.export.export(step.jitted)(variables, cache, x, positions, None)``; a layer called
      with ``cache=`` under a plain ``jax.jit`` carries its checks as callbacks, which an export
      refuses). An exported step's ``out`` is NaN where a check failed; its ``checks`` name the
      failure through ``step.raise_failed`` in the process that traced it.

    Raises:
      TypeError: at a call, for ``cache=None``, positions that are not integers, or traced
        arguments: the step is a compiled program of its own, called from Python; inside
        ``jax.jit`` (or ``vmap``, ``grad``) call the layer itself with ``cache=``.
      ValueError: a failed run-time check, as above.

    Example::

        layer = fa.Attention(fa.AttentionConfig(d_model=768, num_heads=12, position="rope"))
        params = layer.init(jax.random.key(0), x[:, :1], jnp.zeros((1, 1), jnp.int32))
        step = fa.decode_step(layer)
        cache = layer.init_cache(batch=1, max_len=2048)
        out, cache = step(params, cache, x[:, :100], jnp.arange(100)[None])        # prefill
        out, cache = step(params, cache, x[:, 100:101], jnp.full((1, 1), 100))     # one token
        step.check()                                                                # after a loop
    """
    _checks.check_positive_int("check_lag", check_lag)
    donate_argnums = (1,) if donate else ()
    _check_options(compiler_options, "decode_step")
    jit = functools.partial(tuning.jit, donate_argnums=donate_argnums, compiler_options=compiler_options)
    call, nnx_state = _cached_call(layer, "decode_step")
    jitted = jit(_checked(call))
    read = _Reader(check_lag)
    if nnx_state is None:
        def step(variables, cache, x, positions, segment_ids=None) -> Any:
            _check_call("decode_step", cache, x, positions, segment_ids)
            return read(jitted(variables, cache, x, positions, segment_ids), x)
    else:
        def step(cache, x, positions, segment_ids=None) -> Any:
            _check_call("decode_step", cache, x, positions, segment_ids)
            return read(jitted(nnx_state(), cache, x, positions, segment_ids), x)

    step.jitted = jitted
    step.check = read.check
    step.raise_failed = _checks.raise_failed
    return step


def decode_loop(layer, next_input: Callable, *, donate: bool = True,
                compiler_options: Optional[dict] = None) -> Callable:
    """A whole run of one-token decoding steps of ``layer`` as one compiled program: a
    ``lax.scan`` over the steps, each step's output turned into the next step's input by
    ``next_input`` on the device, the cache donated. A Python loop over :func:`decode_step`
    pays, every token, the host's dispatch and the runtime's handoffs of a compiled program;
    this pays them once per run.

        loop = flax_attn.decode_loop(model, lambda logits: (jnp.argmax(logits[:, -1], -1)[:, None],) * 2)
        tokens, cache = loop(variables, cache, first_token, first_position, steps=64)

    Args:
      layer: what :func:`decode_step` takes (Linen or NNX), called as ``layer(x, positions,
        cache=cache) -> (out, cache)``: e.g. a decoder from tokens to logits.
      next_input: ``next_input(out) -> (x_next, emitted)``, or ``next_input(out, key)`` when
        the loop is given a ``key`` (a step's key: ``jax.random.fold_in(key, t)``): ``x_next``
        the next step's input, of ``x``'s shape and dtype (e.g. the greedy token ``(B, 1)``),
        ``emitted`` any pytree of arrays to keep from the step (e.g. the token).
      donate: donate the cache (default True): it is consumed; keep the one returned.
      compiler_options: as :func:`decode_step`'s.

    Returns:
      Linen: ``loop(variables, cache, x, positions, steps, key=None) -> (emitted, cache)``;
      NNX: ``loop(cache, x, positions, steps, key=None)``. ``x`` is the first step's input (one
      token per sequence, ``(B, 1, ...)``), ``positions`` int ``(B, 1)`` its positions (step t
      runs at ``positions + t``), ``steps`` a Python int (one compilation per value);
      ``emitted`` has each leaf stacked over the steps on a new leading axis ``(steps, ...)``.
      The steps take no segment ids: each new token is a real one (segment 0, as a
      :func:`decode_step` call without them), after a prefill that may pad.
      After the run, the run-time checks of every step are read (one transfer): a failed one
      raises its ``ValueError`` naming the step; that step's ``out`` was NaN, and the rest of
      the run is not to be used.

    Raises:
      TypeError: as :func:`decode_step`'s (no cache, positions not integers, traced arguments).
      ValueError: ``steps`` not a positive integer, more than one token per sequence, a
        ``next_input`` whose ``x_next`` differs from ``x`` in shape or dtype, or a failed
        run-time check (after the run, naming the step).
    """
    _check_options(compiler_options, "decode_loop")
    call, nnx_state = _cached_call(layer, "decode_loop")

    def run(state, cache, x, positions, key, steps):
        # An NNX module's state goes through the scan's carry: a module that runs NNX transforms
        # of its own (nnx.scan over stacked layers, nnx.remat) cannot merge state closed over
        # from the trace outside the loop.
        def body(carry, t):
            carried, cache, x = carry
            (out, cache), checks = _checked(call)(state if carried is None else carried, cache, x, positions + t,
                                                  None)
            x_next, emitted = next_input(out) if key is None else next_input(out, jax.random.fold_in(key, t))
            if jnp.shape(x_next) != jnp.shape(x) or jnp.result_type(x_next) != jnp.result_type(x):
                raise ValueError(f"decode_loop's next_input must return the next input of x's shape and dtype "
                                 f"{jnp.shape(x)} {jnp.result_type(x)}, got {jnp.shape(x_next)} "
                                 f"{jnp.result_type(x_next)}")
            return (carried, cache, x_next), (emitted, checks)

        init = (None if nnx_state is None else state, cache, x)
        (_, cache, _), (emitted, checks) = jax.lax.scan(body, init, jnp.arange(steps, dtype=jnp.int32))
        return (emitted, cache), checks

    jitted = tuning.jit(run, static_argnums=(5,), donate_argnums=(1,) if donate else (),
                        compiler_options=compiler_options)

    def finish(answer):
        (emitted, cache), checks = answer
        for t, row in enumerate(np.asarray(checks)):
            _checks.raise_failed(row, f" (found after step {t} of the decoding loop ran; its output is NaN and the "
                                      f"rest of the run is not to be used)")
        return emitted, cache

    def checked(cache, x, positions, steps):
        """The loop's arguments checked, ``steps`` as a Python int (a NumPy integer would
        compile again: a static argument is keyed by its type as well as its value)."""
        _checks.check_positive_int("decode_loop steps", steps)
        _check_call("decode_loop", cache, x, positions)
        if jnp.ndim(x) < 2 or jnp.shape(x)[1] != 1 or jnp.shape(positions) != jnp.shape(x)[:1] + (1,):
            raise ValueError(f"decode_loop takes one token per sequence: x (B, 1, ...) and positions (B, 1), got x "
                             f"{jnp.shape(x)} and positions {jnp.shape(positions)}")
        return cache, x, jnp.asarray(positions), int(steps)

    if nnx_state is None:
        def loop(variables, cache, x, positions, steps: int, key=None):
            cache, x, positions, steps = checked(cache, x, positions, steps)
            return finish(jitted(variables, cache, x, positions, key, steps))
    else:
        def loop(cache, x, positions, steps: int, key=None):
            cache, x, positions, steps = checked(cache, x, positions, steps)
            return finish(jitted(nnx_state(), cache, x, positions, key, steps))
    loop.jitted = jitted
    return loop


def _check_call(who: str, cache, x, positions, segment_ids=None) -> None:
    """A clear error for what a compiled decoding call cannot take: no cache, positions that
    are not integers, or traced arguments (a call inside ``jax.jit``, ``vmap`` or ``grad``)."""
    if cache is None:
        raise TypeError(f"{who} needs the cache to write into, got cache=None: make one with "
                        f"layer.init_cache(batch=B, max_len=S) and pass the one each call returns")
    arrays = [("x", x), ("positions", positions), ("segment_ids", segment_ids)]
    arrays += [("cache", leaf) for leaf in jax.tree_util.tree_leaves(cache)]
    traced = list(dict.fromkeys(name for name, a in arrays if isinstance(a, jax.core.Tracer)))
    if traced:
        raise TypeError(f"{who} was called with traced {', '.join(traced)} (inside jax.jit, vmap, grad or a "
                        f"scan?): it is a compiled program of its own that reads its run-time checks on the "
                        f"host, so call it from Python; inside a traced function call the layer itself, "
                        f"layer.apply(variables, x, positions, cache=cache)")
    dtype = getattr(positions, "dtype", None)  # an array's, without jnp.result_type's cost on every step
    dtype = np.asarray(positions).dtype if dtype is None else np.dtype(dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{who} positions must be integers, got {dtype} of shape {jnp.shape(positions)}")


def _check_options(compiler_options, who: str) -> None:
    if compiler_options is not None and not isinstance(compiler_options, dict):
        raise TypeError(f"{who} compiler_options must be a dict or None, got {type(compiler_options).__name__}")


def _cached_call(layer, who: str):
    """``(call, nnx_state)``: ``call(state, cache, x, positions, segment_ids) -> (out, cache)``,
    the layer's cached call on its variables (Linen) or state (NNX), and for NNX a function
    giving the module's current state (None for Linen, whose variables the caller passes)."""
    if isinstance(layer, nn.Module):
        def call(variables, cache, x, positions, segment_ids):
            args = (x, positions) if segment_ids is None else (x, positions, segment_ids)
            try:
                return layer.apply(variables, *args, cache=cache, **_deterministic(layer, args))
            except flax.errors.InvalidRngError as e:
                raise TypeError(
                    f"{who} runs {type(layer).__name__} without RNGs (decoding never drops), but a submodule "
                    f"asked for one ({e}). Give its __call__ a `deterministic` argument passed on to its "
                    f"layers ({who} passes deterministic=True where the call takes one), or call them with "
                    "deterministic=True yourself") from None

        return call, None
    from flax import nnx  # imported here: Linen users need not load NNX

    if not isinstance(layer, nnx.Module):
        raise TypeError(f"{who} takes a Linen or NNX module, got {type(layer).__name__}")
    graphdef = nnx.graphdef(layer)

    def call_nnx(state, cache, x, positions, segment_ids):
        module = nnx.merge(graphdef, state)
        module.eval()  # this copy only: no dropout in any submodule (the caller's module keeps its mode)
        args = (x, positions) if segment_ids is None else (x, positions, segment_ids)
        return module(*args, cache=cache, **_deterministic(module, args))

    return call_nnx, lambda: nnx.state(layer)


def _checked(call):
    """``call`` returning ``(result, checks)``: its run-time checks packed into one int32 vector
    (:func:`flax_attn._checks.deferred_checks`, :meth:`~flax_attn._checks.Deferred.outputs`);
    when one fails, the floating leaves of ``result[0]`` (the step's ``out``) are NaN."""
    def run(*args):
        with _checks.deferred_checks() as deferred:
            out, *rest = call(*args)
        ok = deferred.all_ok()
        poison = lambda y: jnp.where(ok, y, jnp.nan) if jnp.issubdtype(y.dtype, jnp.inexact) else y
        return (jax.tree.map(poison, out), *rest), deferred.outputs()

    return run


class _Reader:
    """Reads the checks of a step's calls: a prefill's (more than one token) at once, a
    one-token step's ``lag`` calls later or at :meth:`check`. Each step's checks (one small
    int32 vector) start their way to the host when the step is dispatched."""

    def __init__(self, lag: int):
        self.lag = lag
        self.pending = collections.deque()

    def check(self) -> None:
        """Raise the ``ValueError`` of the first failed check among the steps not yet read."""
        self._read(keep=0)

    def _read(self, keep: int) -> None:
        while len(self.pending) > keep:
            checks = self.pending.popleft()
            try:
                _checks.raise_failed(checks, " (found after that decoding step ran; its output is NaN)")
            except ValueError:
                self.pending.clear()
                raise

    def __call__(self, answer, x):
        result, checks = answer
        checks.copy_to_host_async()
        self.pending.append(checks)
        self._read(keep=self.lag if jnp.shape(x)[1] == 1 else 0)
        return result


def _deterministic(module, args) -> dict:
    """``deterministic=True`` for a module whose call takes a ``deterministic`` argument beside
    ``args`` and the cache (Flax's convention: the flax_attn layers, a container passing it on to
    its layers), or a layer with attention dropout in its config (decoding never drops)."""
    try:
        inspect.signature(type(module).__call__).bind(module, *args, cache=None, deterministic=True)
        takes = True
    except (TypeError, ValueError):  # no such argument, or no signature to read
        takes = False
    config = getattr(module, "config", None)
    return {"deterministic": True} if takes or getattr(config, "dropout", 0.0) else {}
