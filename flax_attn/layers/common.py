"""Shared building blocks for the modules: parameter specs and the pure stages that use them
(PyTorch-equivalent initialisation), dropout plumbing, input checks.

Every module is written once as a pure function of ``(params, inputs)`` (a *stage*, in the
module's file). The Linen module declares its parameters from a nested dict of
:class:`ParamSpec` (:func:`declare` in ``setup``, :func:`declared` in ``__call__``) and calls
the stage; the NNX module (:mod:`flax_attn.nnx`) holds ``nnx.Param``s made from the same specs
and calls the same stage. So both have one parameter tree, with the same names:

    {'q_proj': {'kernel': (D, N*H), 'bias': (N*H,)}, 'q_norm': {'scale': (H,)}, 'W_query': (d_in, d_out)}

A dict of specs is a submodule (``q_proj``); a spec at the top is a raw parameter (``W_query``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from flax_attn import _checks
from flax_attn.core import tuning


def uniform_init(low: float, high: float):
    """Initializer drawing from U[low, high)."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, low, high)

    return init


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its ``shape`` and ``init(key, shape, dtype) -> array``."""

    shape: tuple
    init: Callable


def linear_params(fan_in: int, features: int, *, use_bias: bool = True) -> dict:
    """Specs of an ``nn.Linear``-initialised projection: ``kernel`` ``(fan_in, features)`` and
    ``bias`` ``(features,)``, both U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (PyTorch's ``nn.Linear``)."""
    bound = 1.0 / math.sqrt(fan_in)
    specs = {"kernel": ParamSpec((fan_in, features), uniform_init(-bound, bound))}
    if use_bias:
        specs["bias"] = ParamSpec((features,), uniform_init(-bound, bound))
    return specs


def scale_params(features: int) -> dict:
    """Specs of an RMSNorm: ``scale`` ``(features,)``, ones."""
    return {"scale": ParamSpec((features,), nn.initializers.ones)}


def norm_params(shape, *, bias: bool = False, zero_centered: bool = False) -> dict:
    """Specs of a normalisation's learned affine map: ``scale`` of ``shape`` (ones, or zeros when
    ``zero_centered``: stored as ``w`` and applied as ``1 + w``) and, with ``bias``, ``bias`` (zeros)."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    specs = {"scale": ParamSpec(shape, nn.initializers.zeros if zero_centered else nn.initializers.ones)}
    if bias:
        specs["bias"] = ParamSpec(shape, nn.initializers.zeros)
    return specs


def embed_params(num_embeddings: int, features: int) -> dict:
    """Specs of an embedding table: ``embedding`` ``(num_embeddings, features)``, N(0, 1) (``nn.Embedding``)."""
    return {"embedding": ParamSpec((num_embeddings, features), nn.initializers.normal(1.0))}



def dense(p: Mapping, x, precision: Any = None):
    """``x @ kernel + bias`` over the last axis: ``(..., in) -> (..., out)``; ``nn.Dense``'s numbers.

    ``p``: ``{'kernel': (in, out)}`` and optionally ``'bias': (out,)``. Inputs and parameters are
    promoted to one dtype (float32 inputs with float64 parameters compute in float64).

    On CPU, from :func:`flax_attn.core.tuning.large_projection_rows` rows of ``x`` on
    (:data:`flax_attn.core.tuning.LARGE_PROJECTION_ROWS`, 4,096; 1,024 on Intel's CPUs with
    AVX-512), the product takes one of two forms, both the same sums. Where
    :func:`flax_attn.core.tuning.projections_as_convolutions` says so (AMD's family 25 and
    Intel's CPUs, with AVX-512), it is written as a convolution of width 1 over the rows
    (:func:`rows_product`), which XLA's CPU compiler turns back into a dot after the pass that
    hands dots to YNNPACK, so that the matmul and both of its derivatives run on XLA's own
    (Eigen) matmul kernels, faster there at these sizes. Elsewhere it reads the kernel as ``(out,
    in)``, transposed once per call (a barrier keeps XLA from folding the transpose back into the
    matmul), whose reverse mode (the weight gradient comes out ``(out, in)``, then transposed) was
    measured faster than the plain dot's: four 768 x 768 projections of 8 x 1,024 tokens,
    float32, on an AMD EPYC whose family was not recorded, forward+backward 0.80 -> 0.77 s; the
    chapter's layer 1.25 -> 1.17 s and 1.30 -> 1.23 s.

    Measured on a 2-core AMD EPYC of family 25, model 17, one program per form, forward /
    reverse mode of one product in ms (as a dot; with the kernel read transposed; as the
    convolution):

    - float32, 8,192 x 768 x 768: 53.5 / 115.7; 55.0 / 104.7; 46.9 / 103.8
    - float32, 8,192 x 768 x 2,304: 218 / 351; 196 / 336; 162 / 305
    - float32, 4,096 x 2,048 x 2,048: 213 / 387; 205 / 398; 169 / 358
    - bfloat16, 8,192 x 768 x 768: 88 / 159; 81 / 138; 63 / 127
    - float64, 8,192 x 768 x 768: 133 / 256; 141 / 280; 138 / 256
    - float32, 2,048 x 768 x 768: 12.0 / 25.7; 12.4 / 29.6; 12.4 / 26.1

    GPT-2-small's causal attention layer (the chapter's ``MultiHeadAttention``, 8 x 1,024
    tokens), in turns with PyTorch's SDPA layer in one process, forward+backward against the
    transposed-kernel form: 1.054x -> 1.023x and 1.073x -> 0.986x PyTorch's time (12 and 16
    rounds); against the transposed-kernel form alone, 1,259 -> 1,175 ms (10 rounds).
    :class:`flax_attn.Attention` with RoPE, 8 x 512 tokens, 2,048 wide, 16 heads over 4
    key/value heads: 1,705 -> 1,600 ms; :class:`flax_attn.MultiHeadLatentAttention`
    (DeepSeek-V2-Lite's shapes) at 4 x 1,024 tokens: 2,917 -> 2,619 ms (8 rounds each). Inputs
    sharded over a mesh's explicit axes keep the transposed-kernel form: the convolution's batch
    is the rows, and merging sharded axes into them would need their sharding spelled out (a
    convolution over the axes as they lie, one batch and further spatial axes, stays a
    convolution in XLA: reverse mode of (8, 1,024, 768) by 768 x 2,304 331 ms against the flat
    rows' 305, of (2, 4, 1,024, 768) 1,301 ms). Forward alone, these layers run the rows in
    chunks of 1,024 tokens (:func:`by_row_chunks`), below the threshold but on Intel's CPUs
    with AVX-512, where the chunks' convolutions took the forward from 0.41-0.44 to 0.34 s. With
    few rows the product stays a plain dot: there the transposed kernel's copy cost more than the
    matmul (a decoding step, one row per sequence, went from 0.9 to 2.5 ms at batch 1).
    """
    kernel, bias = p["kernel"], p.get("bias")
    dtype = jnp.result_type(x, kernel, *(() if bias is None else (bias,)))
    x, kernel = jnp.asarray(x, dtype), jnp.asarray(kernel, dtype)
    large = lambda: math.prod(x.shape[:-1]) >= tuning.large_projection_rows()  # noqa: E731
    if jax.default_backend() == "cpu" and _checks.decided(large):
        if (tuning.projections_as_convolutions() and not jnp.issubdtype(dtype, jnp.complexfloating)
                and not _explicitly_sharded(x)):
            y = rows_product(x, kernel, precision)
        else:
            kt = lax.optimization_barrier(kernel.T)
            y = lax.dot_general(x, kt, (((x.ndim - 1,), (1,)), ((), ())), precision=precision)
    else:
        y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
    if bias is not None:
        y = y + jnp.reshape(jnp.asarray(bias, dtype), (1,) * (y.ndim - 1) + (-1,))
    return y


def _explicitly_sharded(x) -> bool:
    """Whether ``x``'s type carries a sharding over a mesh's explicit axes (under which merging
    its leading axes into rows, as :func:`rows_product` does, would need its sharding spelled
    out)."""
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def rows_product(x, kernel, precision: Any = None):
    """``x @ kernel`` for ``x (..., in)`` and ``kernel (in, out)``, written as a convolution of
    width 1 whose batch is the rows of ``x``: ``(rows, 1, in)`` by a ``(1, in, out)`` window.
    Forward and reverse mode are those of :func:`jax.lax.conv_general_dilated`."""
    flat = x.reshape(-1, 1, x.shape[-1])
    dims = lax.ConvDimensionNumbers(lhs_spec=(0, 2, 1), rhs_spec=(2, 1, 0), out_spec=(0, 2, 1))
    y = lax.conv_general_dilated(flat, kernel[None], (1,), [(0, 0)], dimension_numbers=dims, precision=precision)
    return y.reshape(x.shape[:-1] + kernel.shape[-1:])


def on_one_cpu_device(platform: Optional[str] = None) -> bool:
    """Whether programs run on a CPU (``platform``, default JAX's default backend) and JAX sees
    one device: where the layers may loop over batch rows (:func:`by_row_chunks`) or heads
    (latent attention's absorbed products). With more devices the batch or the heads may be
    sharded, and such a loop would cut across the shards."""
    return (platform or jax.default_backend()) == "cpu" and jax.device_count() == 1


ROW_CHUNK_TOKENS = 1024
"""Tokens a step of :func:`by_row_chunks` aims at: ``max(1, ROW_CHUNK_TOKENS // T)`` batch rows."""
ROW_CHUNK_MIN_TOKENS = 4096
"""From this many tokens a call on (B * T), :func:`by_row_chunks` computes in chunks of rows."""


def row_chunk(B, T, platform: Optional[str] = None) -> Optional[int]:
    """The batch rows of one step of :func:`by_row_chunks` for inputs of ``B`` rows of ``T``
    tokens on ``platform`` (default: JAX's default backend), or None for the whole batch at once.
    None too where JAX sees more than one device: the batch may be sharded there, and a loop
    over its rows would cut across the shards."""
    if not (isinstance(B, int) and isinstance(T, int)) or not on_one_cpu_device(platform):
        return None
    if B * T < ROW_CHUNK_MIN_TOKENS:
        return None
    rows = max(d for d in range(1, max(1, ROW_CHUNK_TOKENS // T) + 1) if B % d == 0)
    return None if rows == B else rows


def by_row_chunks(stage: Callable, params, *rows):
    """``stage(params, *rows)`` for a stage whose batch rows are independent, computed on CPU a
    few rows at a time when the call is not differentiated.

    ``rows``: pytrees of arrays whose leading axis is the batch ``B`` (None leaves allowed), the
    first an array ``(B, T, ...)``; ``stage`` returns one array ``(B, ...)``, each row of it a
    function of the same row of every input (and of ``params``). On CPU, from
    :data:`ROW_CHUNK_MIN_TOKENS` tokens (B * T) on, a call that is not differentiated runs the
    stage in a loop over chunks of ``max(1, ROW_CHUNK_TOKENS // T)`` rows (the largest divisor
    of B up to that), writing each chunk's rows into the output: the same function (float32
    results may differ in their last bits, as the matmuls' blocking follows their sizes), with
    the projections, the attention core and the output projection of a chunk working on data
    that stays in the caches, and temporaries a chunk's size instead of the batch's. The
    layers' stages call it where a call has no cache, mask or dropout
    (:func:`flax_attn.layers.attention.attention_forward`,
    :func:`flax_attn.layers.mla.mla_forward`, the chapter's
    :func:`flax_attn.textbook.chapter.multi_head_attention`), and with them their Linen and
    NNX modules. Derivatives
    of every order (forward and reverse mode) are those of the whole-batch stage, whose program
    they run unchanged: the loop is the primal of a ``jax.custom_jvp`` whose rule is
    ``jax.jvp`` of the stage. On GPU and TPU, with more than one device, for fewer tokens, or
    with a symbolic batch or length, the stage runs once on the whole batch.

    Measured on a 2-core AMD EPYC (family 26, model 2; 32 MiB L3), float32 forward, each form
    in turns in one process: GPT-2-small's causal attention layer (the chapter's
    ``MultiHeadAttention``, 8 x 1,024 tokens, 768 wide, 12 heads) 0.174 -> 0.139 s (one row a
    step; two rows 0.147, four 0.162); with glibc keeping its memory
    (:func:`flax_attn.keep_host_memory`) 0.154 -> 0.135 s, so most of the gain is locality,
    not page faults. 64 x 64 tokens 59 -> 45 ms (16 rows); 2 x 4,096 tokens 0.385 -> 0.370 s;
    :class:`flax_attn.Attention` with RoPE and 4 key/value heads, 8 x 512 tokens, 2,048 wide,
    16 heads 0.297 -> 0.257 s (two rows); :class:`flax_attn.MultiHeadLatentAttention`
    (DeepSeek-V2-Lite's shapes) at 4 x 1,024 tokens 0.511 -> 0.462 s. Below 4,096 tokens it was as fast or slower (16 x
    128 tokens: 26.5 ms whole, 27-29 ms in chunks). Forward+backward with the loop
    differentiated was 3% faster at 8 x 1,024 and even with two rows, so differentiated calls
    keep the whole-batch program.
    """
    first = rows[0]
    chunk = row_chunk(*first.shape[:2])
    if chunk is None:
        return stage(params, *rows)
    B = first.shape[0]

    def loop(params, *rows):
        cut = lambda i: jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, i * chunk, chunk, 0), rows)
        one = jax.eval_shape(stage, params, *cut(0))
        out = jnp.zeros((B,) + one.shape[1:], one.dtype)
        step = lambda i, out: lax.dynamic_update_slice_in_dim(out, stage(params, *cut(i)), i * chunk, 0)
        return lax.fori_loop(0, B // chunk, step, out)

    run = jax.custom_jvp(loop)
    run.defjvp(lambda primals, tangents: jax.jvp(stage, primals, tangents))
    with jax.named_scope("by_row_chunks"):  # the loop's name in profiles and programs
        return run(params, *rows)


def batched_positions(name: str, positions, batch: int, length: int):
    """Integer ``positions`` (or segment ids) of shape ``(length,)``, ``(1, length)`` or ``(batch,
    length)`` as ``(batch, length)``, in the integer type JAX holds them in (int64 where given so
    under ``jax_enable_x64``, else int32: :func:`flax_attn._checks.as_positions`): RoPE reads
    absolute positions, and none is wrapped here (a cache stores int32 and checks that they fit:
    :func:`flax_attn.layers.cache.stored_ints`). None stays None."""
    if positions is None:
        return None
    _checks.check_integer(name, positions)
    shape = _checks.shape_of(positions)
    if shape not in ((length,), (1, length), (batch, length)):
        raise ValueError(f"{name} must have shape ({length},) or ({batch}, {length}), got {shape}")
    return jnp.broadcast_to(_checks.as_positions(positions), (batch, length))


def rms_norm(p: Mapping, x, epsilon: float):
    """RMS normalisation over the last axis with a learned ``scale`` (``nn.RMSNorm``'s numbers):
    ``x / sqrt(mean(x^2) + eps) * scale``, the statistics in at least float32."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    var = jnp.mean(lax.square(x.astype(acc)), axis=-1, keepdims=True)
    y = x * (lax.rsqrt(var + epsilon) * p["scale"])
    return jnp.asarray(y, jnp.result_type(x, p["scale"]))


def norm(p: Mapping, x, epsilon: float, *, kind: str = "rms", zero_centered: bool = False):
    """Normalisation over the last axis with a learned affine map, the statistics in at least float32.

    ``kind='rms'``: ``x / sqrt(mean(x^2) + eps)``; ``kind='layer'``: ``(x - mean(x)) / sqrt(var(x) + eps)``
    (biased variance). The result is multiplied by ``scale`` (or ``1 + scale`` when
    ``zero_centered``), then ``bias`` is added when ``p`` has one. ``scale``/``bias`` broadcast
    against ``x`` from the right: ``(F,)`` for ``x`` ``(..., F)``, or ``(N, F)`` for ``(..., N, F)``
    (one row per head).
    """
    acc = jnp.promote_types(x.dtype, jnp.float32)
    xa = x.astype(acc)
    if kind == "layer":
        xa = xa - jnp.mean(xa, axis=-1, keepdims=True)
    elif kind != "rms":
        raise ValueError(f"kind must be 'rms' or 'layer', got {kind!r}")
    var = jnp.mean(lax.square(xa), axis=-1, keepdims=True)
    scale = p["scale"]
    weight = 1 + jnp.asarray(scale, acc) if zero_centered else scale
    y = xa * lax.rsqrt(var + epsilon) * weight
    if "bias" in p:
        y = y + p["bias"]
    return jnp.asarray(y, jnp.result_type(x, *p.values()))


def embed(p: Mapping, ids):
    """Rows of ``p['embedding']`` ``(num, features)`` at integer ``ids``: ``ids.shape + (features,)``."""
    return jnp.take(p["embedding"], ids, axis=0)


class Declare(nn.Module):
    """A Linen submodule that only declares parameters from specs and returns them as a dict.

    ``specs``: ``((name, ParamSpec | nested specs), ...)``; nested specs become submodules of
    that name, so the parameter tree mirrors the specs.
    """

    specs: tuple
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        out = {}
        for name, spec in self.specs:
            if isinstance(spec, ParamSpec):
                out[name] = self.param(name, spec.init, spec.shape, self.param_dtype)
            else:
                out[name] = Declare(spec, self.param_dtype, name=name)()
        return out

    def rng(self, name: str):
        """A PRNG key from this submodule's scope (``make_rng(name)``)."""
        return self.make_rng(name)


def _as_pairs(specs: Mapping) -> tuple:
    return tuple((k, v if isinstance(v, ParamSpec) else _as_pairs(v)) for k, v in specs.items())


def declare(module: nn.Module, specs: Mapping, param_dtype: Any) -> None:
    """In a Linen ``setup``: declare ``specs`` on ``module`` (raw parameters and submodules by name)."""
    for name, spec in specs.items():
        if isinstance(spec, ParamSpec):
            setattr(module, name, module.param(name, spec.init, spec.shape, param_dtype))
        else:
            setattr(module, name, Declare(_as_pairs(spec), param_dtype))


def declared(module: nn.Module, specs: Mapping) -> dict:
    """In a Linen ``__call__``: the parameters declared by :func:`declare`, as a nested dict."""
    return {name: getattr(module, name) if isinstance(spec, ParamSpec) else getattr(module, name)()
            for name, spec in specs.items()}


def dropout_on(rate: float, deterministic: Optional[bool], owner: str, how: str = "rngs={'dropout': key}") -> bool:
    """Whether dropout applies: ``rate > 0`` and ``deterministic`` is False.

    ``deterministic`` must be given when ``rate > 0``: randomness is never implicit. ``how``
    says where the key comes from (Linen: ``rngs={'dropout': key}`` in ``apply``).
    """
    _checks.check_rate(f"{owner} dropout", rate)
    if rate == 0.0:
        return False
    if deterministic is None:
        raise ValueError(
            f"{owner} has dropout={rate}: pass deterministic=True (no dropout) or "
            f"deterministic=False with {how} to apply"
        )
    return not deterministic


def dropout_rng(module: nn.Module, rate: float, deterministic: Optional[bool], owner: str):
    """The PRNG key for attention dropout in a Linen module, or None when dropout is off."""
    return module.make_rng("dropout") if dropout_on(rate, deterministic, owner) else None


def check_floating(owner: str, name: str, x) -> None:
    """Layers take floating-point activations: an integer ``x`` (token ids?) is a ``TypeError``."""
    dtype = _checks.dtype_of(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{owner} input {name} must be a floating-point array of shape {_checks.shape_of(x)}, "
                        f"got dtype {dtype} (token ids? embed them first)")


def check_tokens(owner: str, x, d_in: int, context_length: Optional[int] = None) -> None:
    """``x`` must be floating ``(B, T, d_in)`` with ``T <= context_length``."""
    _checks.check_rank(f"{owner} input x", x, 3, "(batch, num_tokens, d_in)")
    check_floating(owner, "x", x)
    if x.shape[-1] != d_in:
        raise ValueError(f"{owner} input x has shape {x.shape}: its last dim must be d_in={d_in}")
    if context_length is None:
        return
    too_long = _checks.decided(lambda: x.shape[1] > context_length)
    if too_long is None:  # a symbolic length (jax.export) without a bound
        raise ValueError(
            f"{owner} input x has a symbolic number of tokens {x.shape[1]} (shape {x.shape}) that may exceed "
            f"context_length={context_length}: bound it where the shape is made, e.g. "
            f"jax.export.symbolic_shape('{x.shape[1]}', constraints=('{x.shape[1]} <= {context_length}',))"
        )
    if too_long:
        raise ValueError(
            f"{owner} input x has {x.shape[1]} tokens (shape {x.shape}), more than "
            f"context_length={context_length}"
        )
