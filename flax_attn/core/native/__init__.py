"""A fused attention kernel for x86-64 CPUs (AVX-512, or AVX2 with FMA), written in C++ and
called through XLA's FFI (``jax.ffi``): implementation ``'cpu_native'``.

    out = softmax(scale * Q K^T [masked]) V     forward and backward each one kernel call

The source (``attention.cc`` beside this file) is compiled with the system's C++ compiler at
first use (``$CXX``, else ``g++``; about 5 s) into a cache directory (``$FLAX_ATTN_CACHE``,
else ``~/.cache/flax_attn``), keyed by the source, the instruction set, the compiler and
jaxlib's version, and loaded from there afterwards. One source serves two instruction sets
(:data:`ISAS`): ``'avx512'`` (16 floats a vector, built with ``-march=x86-64-v4``) and
``'avx2'`` (8 floats, ``-mavx2 -mfma``); the kernel takes the first the CPU runs
(:func:`best_isa`; ``$FLAX_ATTN_CPU_ISA`` names the default), and ``CpuNative(isa=...)``
names one per call. Nothing is downloaded; where there is
no compiler, the CPU is not x86-64 with AVX2 and FMA or the build fails, the implementation
refuses every call and says why (:func:`unavailable`).

**What it serves.** float32 queries, keys and values, grouped-query heads, causal masking with
the default positions (query ``t`` sees keys ``s <= t + S - T``) or no mask, per-sequence
lengths (``query_seq_lengths``, ``key_value_seq_lengths``: padding), head dims that are
multiples of 16, the scale. Every row sees a prefix of the keys, so a block of queries computes
its logits against the longest prefix any of its rows sees; keys past it are never read, so
the caller does not zero padding for it. Where the queries are few (a decoding step: at most 16
query rows a task), the keys and values are read where they lie instead of packed first. In a
decoding step (at most :data:`FEW_ROWS` query rows a key/value head, ``T x N/K``) it also serves
explicit positions and windows: each logit is compared by positions, as a KV cache's layer step
asks; its reverse mode then differentiates the query-block path in JAX. Keys and values stored
``(B K, S, .)`` (a ``'BKSH'`` KV cache, declared by the layer) are read where they lie.
Refused, each by name: other dtypes, a bias, boolean masks, explicit positions and windows
beyond a decoding step, segment ids, chunks, soft-capping, sinks, score and mask rules,
dropout, returned weights, symbolic shapes. ``return_residual`` is served.

**Derivatives and transformations.** Every order of both modes, under ``jit``, ``vmap`` and
``checkpoint``. Reverse mode runs the kernel's backward entry point (the weights recomputed
from the saved log-sum-exp, whose own cotangent it takes too); forward mode and second and
higher derivatives differentiate the query-block path in JAX (slower, linear memory). The three
primitives below say how. Under ``vmap`` the mapped axis joins the batch axis: one kernel call.

**The automatic choice** takes it on CPU for the float32 calls it serves from ``min_length``
tokens (queries and keys) where JAX sees one device (:meth:`CpuNative.preferred`), decoding
steps included; ``jax.export`` refuses programs holding it (its FFI target has no
compatibility guarantee): export with ``implementation='query_blocks'``, or pass
``disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(name)]`` for the two
:data:`TARGETS` of the build it holds, where the exported program runs in a process that loaded
that build.

**Speed.** GPT-2-small's core (8 x 12 heads x 1,024 tokens, causal, float32) on a 2-core Intel
Xeon of family 6, model 207, in turns with PyTorch's ``scaled_dot_product_attention``: forward
0.74-0.82x PyTorch's time, forward+backward 0.64-0.89x over four runs (the query-block path
1.45-1.79x and 1.15-1.44x); the AVX2 build there about 1.8x the AVX-512 build's time, and, with
PyTorch held to AVX2 too (``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``),
0.80-0.89x / 0.66-0.71x PyTorch's time over three runs; ``python -m benchmarks.core`` and the
README's tables.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform as _platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from flax_attn.core import mask as mask_lib
from flax_attn.core import tuning
from flax_attn.core.registry import Implementation, Result, refuses_dropout_and_weights

SOURCE = Path(__file__).with_name("attention.cc")
FLAGS = ("-std=c++17", "-O3", "-fopenmp", "-fPIC", "-shared")
# instruction set: (its compiler flags, the /proc/cpuinfo flags a CPU needs to run that build),
# the preferred first
ISAS = {
    "avx512": (("-march=x86-64-v4",), ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma")),
    "avx2": (("-mavx2", "-mfma"), ("avx2", "fma")),
}
# the FFI targets of each build, e.g. TARGETS["avx512"]["forward"]
TARGETS = {isa: {"forward": f"flax_attn_cpu_{isa}_forward", "backward": f"flax_attn_cpu_{isa}_backward"}
           for isa in ISAS}


def cache_dir() -> Path:
    """Where the compiled kernel is kept: ``$FLAX_ATTN_CACHE``, else ``~/.cache/flax_attn``."""
    return Path(os.environ.get("FLAX_ATTN_CACHE") or Path.home() / ".cache" / "flax_attn")


def _on_x86_linux() -> bool:
    return _platform.system() == "Linux" and _platform.machine() in ("x86_64", "AMD64")


def _forced() -> Optional[str]:
    isa = os.environ.get("FLAX_ATTN_CPU_ISA") or None
    _check_isa(isa, "$FLAX_ATTN_CPU_ISA")
    return isa


def best_isa() -> Optional[str]:
    """The build the kernel runs by default: ``$FLAX_ATTN_CPU_ISA`` where set (``avx2`` gives an
    AVX-512 machine the AVX2 build, e.g. to compare them), else the first of :data:`ISAS` this
    CPU runs (``'avx512'``, else ``'avx2'``); None where the CPU runs none (or not the one
    named)."""
    forced = _forced()
    if not _on_x86_linux():
        return None
    if forced:
        return None if _cpu_refusal(forced) else forced
    flags = tuning.cpu_flags()
    return next((isa for isa, (_, needs) in ISAS.items() if all(f in flags for f in needs)), None)


def _cpu_refusal(isa: Optional[str] = None) -> Optional[str]:
    """Why this CPU cannot run the build for ``isa`` (None: the default build), or None."""
    if not _on_x86_linux():
        return f"{_platform.system()} on {_platform.machine()} (the kernel needs Linux on x86-64)"
    isa = isa or _forced()
    if isa is None:
        return None if best_isa() else "this CPU (the kernel needs AVX-512, or AVX2 with FMA)"
    flags = tuning.cpu_flags()
    missing = [f for f in ISAS[isa][1] if f not in flags]
    return f"this CPU for the {isa} build (it lacks {', '.join(missing)})" if missing else None


def _check_isa(isa, name: str = "isa") -> None:
    if isa is not None and isa not in ISAS:
        raise ValueError(f"{name} must be None or one of {sorted(ISAS)}, got {isa!r}")


def _build(isa: str) -> Path:
    """The compiled library's path for ``isa``, compiling it first if the cache lacks it. Raises
    ``RuntimeError`` with the compiler's output if that fails."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'g++')!r} is not on PATH; set $CXX)")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    include = jax.ffi.include_dir()
    flags = FLAGS + ISAS[isa][0]
    key = hashlib.sha256(SOURCE.read_bytes() + repr((flags, version, jax.__version__, jax.lib.__version__,
                                                      include)).encode()).hexdigest()[:16]
    target = cache_dir() / f"cpu_attention-{isa}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # compile into a fresh name, then rename: processes building at once never load half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, "-isystem", include, str(SOURCE), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} for {isa} failed ({compiler}, exit {done.returncode}):\n"
                               f"{done.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.lru_cache(maxsize=None)
def _load(isa: str) -> tuple:
    """``(library, None)`` once the build for ``isa`` is compiled, loaded and registered with
    XLA, else ``(None, reason)``."""
    reason = _cpu_refusal(isa)
    if reason:
        return None, reason
    try:
        lib = ctypes.CDLL(str(_build(isa)))
    except (RuntimeError, OSError) as e:
        return None, f"a kernel that could not be built or loaded: {e}"
    for entry, symbol in (("forward", lib.FlaxAttnCpuForward), ("backward", lib.FlaxAttnCpuBackward)):
        jax.ffi.register_ffi_target(TARGETS[isa][entry], jax.ffi.pycapsule(symbol), platform="cpu")
    return lib, None


def unavailable(isa: Optional[str] = None) -> Optional[str]:
    """Why the kernel's build for ``isa`` (None: :func:`best_isa`) cannot run here (a phrase
    completing "does not support ..."), or None once it is compiled and loaded."""
    _check_isa(isa)
    isa = isa or best_isa()
    return _cpu_refusal() if isa is None else (_cpu_refusal(isa) or _load(isa)[1])


# ---------------------------------------------------------------------------- the primitives
#
# Three primitives carry the kernel through JAX's transformations; ``p`` is their parameters
# (causal, scale, block_q, the build's isa, heads_major, positions and window), ``res`` the
# residuals ``q, k, v, q_len, kv_len, q_pos, k_pos, out, lse`` (the lengths (B,) and positions
# (B, T) / (B, S) int32, never differentiated; without ``positions`` the positions are (B, 1)
# placeholders):
#
#   forward_p(q, k, v, q_len, kv_len, q_pos, k_pos) -> out, lse   the kernel's forward entry point
#   tangent_p(*res, dq, dk, dv)      -> dout, dlse        linear in dq, dk, dv (pure JAX)
#   backward_p(*res, ct_out, ct_lse) -> ct_q, ct_k, ct_v  linear in ct_out, ct_lse: the kernel's
#                                                         backward entry point (with positions,
#                                                         the query-block path's, in JAX)
#
# forward_p's JVP is forward_p and tangent_p; tangent_p and backward_p are each other's
# transposes, so reverse mode runs the two kernel entry points and forward mode the tangent in
# JAX. The JVPs of tangent_p and backward_p (second and higher derivatives) differentiate the
# query-block path's own derivatives in JAX. Every rule treats out and lse as the functions of
# q, k and v that they are. Under vmap the mapped axis joins the batch axis (each batch row is
# independent), so the kernel runs once. Keys and values are always (B, S, K, .) here;
# ``heads_major`` makes the kernel read them transposed, (B K, S, .), as a 'BKSH' KV cache
# stores them: XLA then cancels the layer's transpose of the cache against the kernel's.

RESIDUALS = 9  # q, k, v, q_len, kv_len, q_pos, k_pos, out, lse
# A decoding step's rows: the kernel serves positions and windows where a key/value head has at
# most this many query rows (T x N/K); it reads keys and values where they lie for them.
FEW_ROWS = 16


def _attrs(p: dict) -> dict:
    return dict(causal=np.int64(p["causal"]), scale=np.float32(p["scale"]), block_q=np.int64(p["block_q"]),
                heads_major=np.int64(p["heads_major"]))


def _heads_major(p: dict, *xs):
    """``xs`` (B, S, K, .) as the kernel reads them: with ``heads_major`` transposed to ``(B K, S,
    .)``, the shape of a ``'BKSH'`` cache's arrays (so that XLA hands the kernel the cache
    itself: a reshape in between would be fused with the cache's update into a copy)."""
    if not p["heads_major"]:
        return list(xs)
    return [jnp.swapaxes(x, 1, 2).reshape((-1,) + (x.shape[1], x.shape[3])) for x in xs]


def _heads_major_back(p: dict, B: int, *xs):
    """The inverse of :func:`_heads_major`: ``(B K, S, .)`` back to ``(B, S, K, .)``."""
    if not p["heads_major"]:
        return list(xs)
    return [jnp.swapaxes(x.reshape((B, -1) + x.shape[1:]), 1, 2) for x in xs]


def _bounds(p: dict) -> dict:
    """The positions' rule as the kernel's attributes: key s is seen where ``-upper <= q_pos -
    k_pos[s] <= lower`` (:attr:`flax_attn.core.mask.Mask.bounds`; no limit: 2**62)."""
    m = mask_lib.Mask(causal=p["causal"], window=p["window"])
    lower, upper = (b if b < mask_lib.FAR else 1 << 62 for b in m.bounds)
    return dict(positions=np.int64(p["positions"]), lower=np.int64(lower), upper=np.int64(upper))


def _kernel_forward(q, k, v, q_len, kv_len, q_pos, k_pos, **p):
    B, T, N, _ = q.shape
    shapes = (jax.ShapeDtypeStruct((B, T, N, v.shape[3]), jnp.float32), jax.ShapeDtypeStruct((B, N, T), jnp.float32))
    k, v = _heads_major(p, k, v)
    return jax.ffi.ffi_call(TARGETS[p["isa"]]["forward"], shapes)(q, k, v, q_len, kv_len, q_pos, k_pos,
                                                                  **_attrs(p), **_bounds(p))


def _kernel_backward(q, k, v, q_len, kv_len, q_pos, k_pos, out, lse, ct_out, ct_lse, **p):
    if p["positions"]:  # the kernel's backward pass has no positions
        return _reference_backward(q, k, v, q_len, kv_len, q_pos, k_pos, out, lse, ct_out, ct_lse, **p)
    k, v = _heads_major(p, k, v)
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (q, k, v))
    ct_q, ct_k, ct_v = jax.ffi.ffi_call(TARGETS[p["isa"]]["backward"], shapes)(
        q, k, v, q_len, kv_len, out, lse, ct_out, ct_lse, **_attrs(p))
    return [ct_q, *_heads_major_back(p, q.shape[0], ct_k, ct_v)]


def _reference(q, k, v, q_len, kv_len, q_pos, k_pos, **p):
    """``(out, lse (B, N, T))`` by the query-block path, which every transformation and order serves."""
    from flax_attn.core.attention import dot_product_attention

    positions = dict(query_positions=q_pos, key_positions=k_pos) if p["positions"] else {}
    out, lse = dot_product_attention(q, k, v, is_causal=p["causal"], scale=p["scale"], return_residual=True,
                                     query_seq_lengths=q_len, key_value_seq_lengths=kv_len,
                                     local_window_size=p["window"], **positions, implementation="query_blocks")
    return out, jnp.transpose(lse, (0, 2, 1))


def _reference_tangent(q, k, v, q_len, kv_len, q_pos, k_pos, out, lse, dq, dk, dv, **p):
    return jax.jvp(lambda q, k, v: _reference(q, k, v, q_len, kv_len, q_pos, k_pos, **p), (q, k, v),
                   (dq, dk, dv))[1]


def _reference_backward(q, k, v, q_len, kv_len, q_pos, k_pos, out, lse, ct_out, ct_lse, **p):
    return jax.vjp(lambda q, k, v: _reference(q, k, v, q_len, kv_len, q_pos, k_pos, **p), q, k, v)[1](
        (ct_out, ct_lse))


def _primitive(name: str, function, shapes):
    """A primitive with several results, run and lowered as ``function`` (a JAX function of
    arrays and the parameters), its results shaped as ``shapes(*avals, **params)`` says."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_impl(lambda *args, **p: _jitted(function, tuple(sorted(p.items())))(*args))
    prim.def_abstract_eval(lambda *avals, **p: [jax.core.ShapedArray(s, jnp.float32) for s in shapes(*avals)])
    mlir.register_lowering(prim, mlir.lower_fun(function, multiple_results=True))
    return prim


@functools.lru_cache(maxsize=None)
def _jitted(function, params: tuple):
    return jax.jit(functools.partial(function, **dict(params)))


def _forward_shapes(q, k, v, q_len, kv_len, q_pos, k_pos):
    B, T, N, _ = q.shape
    return (B, T, N, v.shape[3]), (B, N, T)


forward_p = _primitive("flax_attn_cpu_native_forward", _kernel_forward, _forward_shapes)
tangent_p = _primitive("flax_attn_cpu_native_tangent", _reference_tangent,
                       lambda q, k, v, ql, kl, qp, kp, out, lse, *_: (out.shape, lse.shape))
backward_p = _primitive("flax_attn_cpu_native_backward", _kernel_backward, lambda q, k, v, *_: (
    q.shape, k.shape, v.shape))


def _dense(tangents, values):
    """Symbolic zeros made arrays: float32, or float0 for the integer lengths."""
    def zero(v):
        return (np.zeros(v.shape, jax.dtypes.float0) if jnp.issubdtype(v.dtype, jnp.integer)
                else jnp.zeros(v.shape, jnp.float32))
    return [zero(v) if type(t) is ad.Zero else t for t, v in zip(tangents, values)]


def _forward_jvp(primals, tangents, **p):
    out, lse = forward_p.bind(*primals, **p)
    if all(type(t) is ad.Zero for t in tangents[:3]):
        return (out, lse), (ad.Zero.from_primal_value(out), ad.Zero.from_primal_value(lse))
    return (out, lse), tuple(tangent_p.bind(*primals, out, lse, *_dense(tangents[:3], primals[:3]), **p))


def _transposer(linear_to, outputs_like):
    """The transpose rule of a primitive whose arguments after the residuals are linear: their
    cotangents are ``linear_to`` bound on the residuals and the cotangents of the primitive's
    results (shaped as the residuals ``outputs_like`` picks, e.g. ``out, lse``)."""
    def transpose(cts, *args, **p):
        res, linear = args[:RESIDUALS], args[RESIDUALS:]
        assert not any(ad.is_undefined_primal(x) for x in res), "the residuals are never linear inputs"
        got = linear_to.bind(*res, *_dense(cts, [res[i] for i in outputs_like]), **p)
        return [None] * RESIDUALS + [g if ad.is_undefined_primal(x) else None for g, x in zip(got, linear)]
    return transpose


def _jvp_in_jax(function):
    """The JVP rule of a primitive computed by JAX's own differentiation of ``function``."""
    def jvp(primals, tangents, **p):
        out, tan = jax.jvp(functools.partial(function, **p), tuple(primals), tuple(_dense(tangents, primals)))
        return tuple(out), tuple(tan)
    return jvp


def _batched(prim):
    """The vmap rule: the mapped axis joins the batch axis of every argument and result."""
    def rule(args, dims, **p):
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        joined = [(jnp.broadcast_to(a, (size,) + a.shape) if d is None else jnp.moveaxis(a, d, 0))
                  for a, d in zip(args, dims)]
        joined = [a.reshape((-1,) + a.shape[2:]) for a in joined]
        outs = prim.bind(*joined, **p)
        return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)
    return rule


ad.primitive_jvps[forward_p] = _forward_jvp
ad.primitive_jvps[tangent_p] = _jvp_in_jax(_reference_tangent)
ad.primitive_jvps[backward_p] = _jvp_in_jax(_reference_backward)
ad.primitive_transposes[tangent_p] = _transposer(backward_p, (7, 8))   # results: dout, dlse
ad.primitive_transposes[backward_p] = _transposer(tangent_p, (0, 1, 2))  # results: ct_q, ct_k, ct_v
for _prim in (forward_p, tangent_p, backward_p):
    batching.primitive_batchers[_prim] = _batched(_prim)


def attend(q, k, v, *, causal: bool, scale: float, block_q: int, isa: Optional[str] = None, q_len=None,
           kv_len=None, q_pos=None, k_pos=None, window: Optional[tuple] = None, heads_major: bool = False):
    """``(out (B, T, N, Hv), lse (B, N, T))`` of float32 ``q`` ``(B, T, N, H)``, ``k`` ``(B, S, K,
    H)``, ``v`` ``(B, S, K, Hv)`` through the kernel's build for ``isa`` (None: :func:`best_isa`),
    which must be loaded (:func:`unavailable`).

    ``q_len``, ``kv_len``: ``(B,)`` integer lengths (queries from ``q_len[b]`` on see nothing,
    keys from ``kv_len[b]`` on are never read); None: every query and key. ``q_pos`` ``(B|1,
    T)``, ``k_pos`` ``(B|1, S)``: integer positions that the causal rule and ``window`` (``(left,
    right)``, :func:`flax_attn.core.mask.window`) compare (a side not given: the default
    positions, keys at ``0..S-1`` and queries at the last T of them); served where a key/value
    head has at most :data:`FEW_ROWS` query rows (``ValueError`` otherwise). ``heads_major``:
    the kernel reads keys and values transposed, ``(B K, S, .)`` (the same results; free where
    they are a transposed view of such an array, as of a ``'BKSH'`` KV cache: XLA then hands
    the kernel the cache's own buffer, where a reshape in between would be fused with the
    cache's update into a copy of the cache; so with one key/value head too, as ``(B, S, .)``,
    the shape of a ``'BKSH'`` or latent cache of one head)."""
    _check_isa(isa)
    isa = isa or best_isa()
    reason = unavailable(isa)
    if reason:
        raise RuntimeError(f"the compiled CPU kernel cannot run: it does not support {reason}")
    B, T, N = q.shape[:3]
    S, K = k.shape[1], k.shape[2]
    lengths = [jnp.full((B,), n, jnp.int32) if x is None else jnp.asarray(x, jnp.int32) for x, n in
               ((q_len, T), (kv_len, S))]
    window = None if window is None else tuple(int(w) for w in window)
    positions = (causal or window is not None) and (q_pos is not None or k_pos is not None or window is not None)
    if positions:
        if T * (N // K) > FEW_ROWS:
            raise ValueError(f"the kernel serves positions and windows where a key/value head has at most {FEW_ROWS} "
                             f"query rows (T x N/K), got T={T}, N={N}, K={K}")
        q_pos, k_pos = [jnp.broadcast_to(default if x is None else jnp.asarray(x, jnp.int32), (B, n))
                        for x, default, n in zip((q_pos, k_pos), mask_lib.default_positions(T, S), (T, S))]
    else:
        q_pos = k_pos = jnp.zeros((B, 1), jnp.int32)
    return tuple(forward_p.bind(q, k, v, *lengths, q_pos, k_pos, causal=bool(causal), scale=float(scale),
                                block_q=int(block_q), isa=isa, heads_major=bool(heads_major),
                                positions=bool(positions), window=window))


@dataclasses.dataclass(frozen=True)
class CpuNative(Implementation):
    """The compiled CPU kernel (see the module docstring for what it serves and how it is built).

    Fields:
      isa: the build to run, ``'avx512'`` or ``'avx2'`` (:data:`ISAS`); None (the default) takes
        the first this CPU runs (:func:`best_isa`).
      block_q: queries per block: each block's logits against all its keys, ``block_q * S``
        floats, are one thread's working set. 64 was the fastest of 64, 128 and 256 at
        GPT-2-small's core on a 2-core Intel Xeon of family 6, model 207 (forward 0.72x, 0.89x
        and 0.93x PyTorch's SDPA; the diagonal blocks' masked half is computed and discarded,
        so smaller blocks waste less), and 16 and 32 were no faster at 4,096 and 8,192 keys,
        where a block's logits outgrow that CPU's 2 MiB L2 (``benchmarks/HISTORY.md``).
    """

    name: str = "cpu_native"
    block_q: int = 64
    min_length: int = 1
    isa: Optional[str] = None
    # Keys past a row's length are neither packed nor read (each task takes the prefix that its
    # rows see), so NaN or Inf there cannot reach the result: the caller's zeroing pass over every
    # key and value, which cost more than the kernel itself on a decoding step, is skipped.
    zeroes_blocked_keys = True

    def __post_init__(self):
        _check_isa(self.isa)
        for field in ("block_q", "min_length"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CpuNative {field} must be a positive int, got {value!r}")

    def runs_on(self, platform: str) -> bool:
        return platform == "cpu"

    def preferred(self, call) -> bool:
        """On CPU from ``min_length`` tokens, where JAX sees one device: with more, the inputs
        may be sharded, and XLA would gather them onto every device for the kernel (its SPMD
        partitioner has no rule for it; named inside ``shard_map``, it runs per device).

        Calls with lengths too, a decoding step's included: a task reads only the keys its rows
        see, and a few query rows read them where they lie. On a 2-core Intel Xeon of family 6,
        model 207, 12 heads of 64, float32, one query over 1,024 of 8,192 keys: 0.21 ms (batch
        1) and 1.6 ms (batch 8) through the kernel, against 1.6 and 14.5 ms in key blocks. Over
        a KV cache declared ``'BSKH'`` or ``'BKSH'`` (:func:`flax_attn.core.tuning.keys_stored`;
        the kernel reads either where it lies), not ``'blocks'``, which it would read only after a
        transposed copy of the whole cache."""
        return (call.platform == "cpu" and min(call.T, call.S) >= self.min_length and jax.device_count() == 1
                and tuning.keys_stored_as() in (None, "BSKH", "BKSH"))

    def supports(self, call) -> Optional[str]:
        reason = refuses_dropout_and_weights(call)
        if reason:
            return reason
        if call.platform != "cpu":
            return f"the '{call.platform}' backend (the kernel runs on CPU)"
        if np.dtype(call.dtype) != np.float32:
            return f"dtype {np.dtype(call.dtype)} (the kernel computes in float32 only)"
        for field in ("softcap", "sinks", "score_mod", "mask_mod"):
            if getattr(call, field, None) is not None:
                return f"{field} (the kernel has none)"
        if not all(isinstance(d, (int, np.integer)) for d in (call.B, call.T, call.S)):
            return "symbolic shapes (the kernel needs concrete sizes)"
        if call.H % 16 or call.Hv % 16:
            return f"head dims H={call.H}, Hv={call.Hv} (multiples of 16 only)"
        m = call.mask
        rows = call.T * (call.N // call.K)
        few = rows <= FEW_ROWS and call.T <= self.block_q
        served = ("causal", "shape", "kv_finite", "q_lengths", "kv_lengths")  # kv_finite: a promise
        for field in dataclasses.fields(m):
            if field.name in served:
                continue
            value = getattr(m, field.name)
            if value is None or value is False or (isinstance(value, tuple) and not value):
                continue
            if field.name in ("q_positions", "k_positions", "window"):
                if few or not m.uses_positions:  # positions without a causal or window rule: unused
                    continue
                return (f"{'a window' if field.name == 'window' else 'explicit positions'} with {rows} query rows "
                        f"a key/value head (T x N/K; the kernel serves positions and windows in a decoding step, "
                        f"up to {FEW_ROWS} rows and block_q={self.block_q} queries)")
            return (f"the mask rule '{field.name}' (the kernel serves causal masking, windows where the queries are "
                    "few, and lengths only)")
        return unavailable(self.isa)

    def __call__(self, call, query, key, value, dropout_rng) -> Result:
        m = call.mask
        out, lse = attend(query, key, value, causal=m.causal, scale=call.scale, block_q=self.block_q,
                          isa=self.isa, q_len=m.q_lengths, kv_len=m.kv_lengths, q_pos=m.q_positions,
                          k_pos=m.k_positions, window=m.window,
                          heads_major=tuning.keys_stored_as() == "BKSH")
        return Result(out=out, lse=jnp.transpose(lse, (0, 2, 1)) if call.return_residual else None)
