"""The compiled CPU kernel (``implementation='cpu_native'``, :mod:`flax_attn.core.native`).

Outputs and gradients of float32 calls against the float64 reference of the conformance suite
(relative 1e-5, exact zeros on rows that see nothing and on keys nobody sees); every
transformation (jit, eager, vmap, checkpoint, forward mode, second derivatives) against the
same transformation of the reference; the refusals, the automatic choice, and what happens where
the kernel cannot be built. The numerical tests run every build of the kernel this CPU runs
(``avx512`` and ``avx2`` on an AVX-512 machine). On a machine whose CPU runs none (not Linux on
x86-64 with AVX2 and FMA) or without a C++ compiler the kernel's tests skip; with both, a kernel
that fails to build fails them.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn.core import CpuNative, native, registry, tuning
from flax_attn.core.call import describe

from .test_conformance import Case, case_args, check_cases, reference_fn, rel_error

HAS_COMPILER = shutil.which(os.environ.get("CXX", "g++")) is not None
CANNOT_RUN = native._cpu_refusal() or (None if HAS_COMPILER else "no C++ compiler")
needs_kernel = pytest.mark.skipif(CANNOT_RUN is not None, reason=f"the kernel cannot run here: {CANNOT_RUN}")
# every build this CPU runs; a test parametrized over them skips where there is none
BUILDS = [isa for isa in native.ISAS if HAS_COMPILER and native._cpu_refusal(isa) is None] or [
    pytest.param(None, marks=pytest.mark.skip(reason=f"the kernel cannot run here: {CANNOT_RUN}"))]

CASES = [
    # grouped queries, causal with T < S (aligned at the end), Hv != H, lengths no multiple of 16
    Case("causal-gqa-T<S-Hv=32", (2, 20, 37, 4, 2, 16, 32), dict(is_causal=True), dtype=np.float32),
    # no mask, multi-query, T > S, a scale
    Case("mqa-T>S-scale", (2, 33, 21, 4, 1, 16, 16), dict(scale=0.3), dtype=np.float32),
    # causal with T > S: the first 10 queries see nothing (zeros, zero gradients)
    Case("causal-T>S", (2, 30, 20, 2, 2, 32, 16), dict(is_causal=True), dtype=np.float32),
    # several query blocks of 64, the last one short; heads of 64
    Case("causal-130", (1, 130, 130, 2, 1, 64, 64), dict(is_causal=True), dtype=np.float32),
    # lengths (padding) with causal, T < S: a row without queries, one whose keys end before the
    # causal limit of most of its queries, one whose queries end inside a block
    Case("causal-lengths-gqa", (3, 40, 50, 4, 2, 16, 16),
         dict(is_causal=True, query_seq_lengths=np.array([40, 25, 0], np.int32),
              key_value_seq_lengths=np.array([50, 7, 30], np.int32)), dtype=np.float32),
    # lengths without a causal mask, T > S, several query blocks: a row without keys (zeros)
    Case("lengths-T>S-70", (2, 70, 33, 2, 1, 32, 16),
         dict(query_seq_lengths=np.array([70, 66], np.int32), key_value_seq_lengths=np.array([0, 20], np.int32)),
         dtype=np.float32),
    # A few query rows a task (kernel.cc's forward_few: keys and values read where they lie).
    # One query, grouped heads, causal: a row whose keys end early, one without keys (zeros)
    Case("few-decode-gqa-lengths", (3, 1, 50, 8, 2, 16, 32),
         dict(is_causal=True, key_value_seq_lengths=np.array([50, 7, 0], np.int32)), dtype=np.float32),
    # causal with T < S: each query its own limit; heads of 64 over keys in several L1 chunks
    Case("few-causal-T<S-H=64", (2, 3, 150, 2, 2, 64, 64), dict(is_causal=True), dtype=np.float32),
    # multi-query, four query heads in a task, a row with two of its four queries (zeros after)
    Case("few-mqa-query-lengths", (2, 4, 37, 4, 1, 16, 16),
         dict(query_seq_lengths=np.array([2, 4], np.int32)), dtype=np.float32),
    # causal with T > S: the first two queries see nothing
    Case("few-causal-T>S", (2, 5, 3, 2, 1, 16, 16), dict(is_causal=True), dtype=np.float32),
    # Positions and windows, served where a key/value head has at most 16 query rows: a KV cache's
    # decoding step. Keys in shuffled order, some out of every query's reach (a cache's slots of
    # other segments), a window, a row whose keys end early, one without keys.
    Case("few-positions-window-gqa", (3, 1, 60, 8, 2, 16, 16),
         dict(is_causal=True, local_window_size=(12, 0), query_positions=np.array([[40], [59], [7]], np.int32),
              key_positions=np.stack([np.random.default_rng(i).permutation(60) for i in range(3)]).astype(np.int32)
              + np.where(np.arange(60) % 7 == 3, 1 << 30, 0).astype(np.int32),
              key_value_seq_lengths=np.array([60, 33, 0], np.int32)), dtype=np.float32),
    # causal over explicit positions, four queries (T x G = 8 rows), heads of 64: a query before
    # every key of its row sees nothing
    Case("few-positions-causal-T=4", (2, 4, 70, 4, 2, 64, 64),
         dict(is_causal=True, query_positions=np.array([[3, 30, 31, 90], [-5, 10, 50, 69]], np.int32),
              key_positions=np.arange(70, dtype=np.int32)[None].repeat(2, 0) * np.array([[1], [2]], np.int32)),
         dtype=np.float32),
    # a two-sided window over the default positions, no causal rule, multi-query
    Case("few-window-default-positions", (2, 2, 30, 4, 1, 16, 16), dict(local_window_size=(5, 3)),
         dtype=np.float32),
]


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernel_builds_and_loads_here(isa):
    assert native.unavailable(isa) is None


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("block_q", [64, 16, 7])
def test_outputs_and_gradients_match_the_float64_reference(block_q, isa):
    failures, declines = check_cases(CpuNative(block_q=block_q, isa=isa), CASES)
    assert not declines and not failures, failures + declines


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("block_q", [64, 7])
def test_keys_stored_heads_major_are_read_where_they_lie(block_q, isa):
    """Under ``keys_stored('BKSH')`` (a KV cache of that order, as the layers declare it) the
    kernel reads keys and values as ``(B K, S, .)`` (the transposes on either side cancel):
    the same cases against the float64 reference, gradients included (one key/value head
    too: then ``(B, S, .)``)."""
    impl = CpuNative(block_q=block_q, isa=isa)
    q, k = jnp.ones((1, 3, 4, 16), jnp.float32), jnp.ones((1, 9, 2, 16), jnp.float32)
    jaxpr = lambda k: str(jax.make_jaxpr(  # noqa: E731
        lambda q, k: fa.dot_product_attention(q, k, k, implementation=impl))(q, k))
    with tuning.keys_stored("BKSH"):
        failures, declines = check_cases(impl, CASES)
        stored = [jaxpr(k), jaxpr(k[:, :, :1])]
    assert not declines and not failures, failures + declines
    assert all("heads_major=True" in j for j in stored) and "heads_major=False" in jaxpr(k)


TRANSFORMS = {
    "eager": lambda f, a, c: jax.vjp(f, *a)[1](c) + (f(*a),),
    "jvp": lambda f, a, c: jax.jvp(f, tuple(a), tuple(0.5 * x for x in a)),
    "vmap": lambda f, a, c: jax.vjp(jax.vmap(f), *[jnp.stack([x, x[::-1]]) for x in a])[1](jnp.stack([c, -c])),
    "vmap-one-argument": lambda f, a, c: jax.vmap(f, in_axes=(0, None, None))(jnp.stack([a[0], -a[0]]), *a[1:]),
    "checkpoint": lambda f, a, c: jax.vjp(jax.checkpoint(f), *a)[1](c),
    "grad-of-grad": lambda f, a, c: jax.grad(
        lambda *x: jnp.sum(jax.grad(lambda *y: jnp.sum(f(*y) * c))(*x) ** 2), argnums=(0, 1, 2))(*a),
    "jvp-of-grad": lambda f, a, c: jax.jvp(jax.grad(lambda *y: jnp.sum(f(*y) * c), argnums=(0, 1, 2)),
                                           tuple(a), tuple(0.3 * x for x in a))[1],
    "jacfwd-of-grad": lambda f, a, c: jax.jacfwd(jax.grad(lambda q: jnp.sum(f(q, *a[1:]) * c)))(a[0])[1, 3],
}


TRANSFORM_SHAPE = (2, 12, 17, 2, 1, 16, 16)
TRANSFORM_MASKS = {
    "causal": (TRANSFORM_SHAPE, dict(is_causal=True)),
    "causal-lengths": (TRANSFORM_SHAPE, dict(is_causal=True, query_seq_lengths=np.array([12, 7], np.int32),
                                             key_value_seq_lengths=np.array([9, 17], np.int32))),
    # a decoding step's positions and window (reverse mode through the query-block path)
    "step-positions-window": ((2, 2, 17, 4, 2, 16, 16), dict(
        is_causal=True, local_window_size=(6, 0), query_positions=np.array([[9, 10], [15, 16]], np.int32),
        key_positions=np.arange(17, dtype=np.int32)[None].repeat(2, 0)[:, ::-1].copy(),
        key_value_seq_lengths=np.array([17, 12], np.int32))),
}


@needs_kernel
@pytest.mark.parametrize("mask", list(TRANSFORM_MASKS))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_transformations_match_the_reference(transform, mask):
    """Each transformation of the kernel (jitted, but 'eager') against the same transformation
    of the float64 reference on the same float32 inputs: relative 1e-5. Reverse mode runs the
    kernel's backward; forward mode and higher orders differentiate the query-block path. Under
    vmap the lengths stay those of each batch row."""
    shape, kw = TRANSFORM_MASKS[mask]
    case = Case("transform", shape, kw, dtype=np.float32)
    args, cot = case_args(case)
    apply = TRANSFORMS[transform]
    f = lambda q, k, v: fa.dot_product_attention(q, k, v, **kw, implementation="cpu_native")
    run = (lambda *a: apply(f, a, cot)) if transform == "eager" else jax.jit(lambda *a: apply(f, a, cot))
    got = run(*args)
    want = jax.jit(lambda *a: apply(reference_fn(case), a, cot.astype(np.float64)))(
        *[x.astype(np.float64) for x in args])
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want) > 0
    errors = [rel_error(a, b) for a, b in zip(got, want)]
    assert all(e <= 1e-5 for e in errors), errors
    assert all(np.dtype(x.dtype) == np.float32 for x in got)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("shape, causal", [((2, 70, 70, 4, 2, 64, 64), True), ((1, 33, 50, 2, 1, 32, 16), False)])
def test_equals_pytorch_outputs_and_gradients(shape, causal, isa):
    """The same float32 inputs through the kernel and through PyTorch: ``torch_ref``'s reference
    attention and ``F.scaled_dot_product_attention`` (heads first, key/value heads repeated),
    outputs and the gradients of ``sum(out * w)``, within float32's 1e-5 (``torch_ref.compare``)."""
    import torch
    import torch.nn.functional as F
    from torch_ref import modern
    from torch_ref.compare import max_rel_error

    B, T, S, N, K, H, Hv = shape
    rng = np.random.default_rng(2)
    q, k, v, w = (rng.standard_normal(s).astype(np.float32) for s in
                  ((B, T, N, H), (B, S, K, H), (B, S, K, Hv), (B, T, N, Hv)))
    kernel = CpuNative(isa=isa)
    loss = lambda q, k, v: jnp.sum(fa.dot_product_attention(q, k, v, is_causal=causal, implementation=kernel) * w)
    out = fa.dot_product_attention(q, k, v, is_causal=causal, implementation=kernel)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T) if causal else None  # aligned at the end

    def sdpa(q, k, v):
        heads_first = lambda x: x.transpose(1, 2)
        kk, vv = (x.repeat_interleave(N // K, dim=2) for x in (k, v))
        o = F.scaled_dot_product_attention(heads_first(q), heads_first(kk), heads_first(vv), attn_mask=allowed)
        return o.transpose(1, 2)

    for name, torch_fn in (("torch_ref", lambda q, k, v: modern.reference_attention(q, k, v, allowed=allowed)[0]),
                           ("SDPA", sdpa)):
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        t_out = torch_fn(tq, tk, tv)
        (t_out * torch.from_numpy(w)).sum().backward()
        errors = [max_rel_error(np.asarray(a), b.detach().numpy())
                  for a, b in zip((out,) + grads, (t_out, tq.grad, tk.grad, tv.grad))]
        assert all(e <= 1e-5 for e in errors), (name, errors)


@needs_kernel
def test_reverse_mode_runs_the_kernels_backward_and_forward_mode_does_not():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    f = lambda q: jnp.sum(fa.dot_product_attention(q, q, q, is_causal=True, implementation="cpu_native"))
    grad = str(jax.make_jaxpr(jax.grad(f))(q))
    assert "flax_attn_cpu_native_forward" in grad and "flax_attn_cpu_native_backward" in grad
    assert "flax_attn_cpu_native_tangent" not in grad
    jvp = str(jax.make_jaxpr(lambda q: jax.jvp(f, (q,), (q,)))(q))
    assert "flax_attn_cpu_native_tangent" in jvp and "flax_attn_cpu_native_backward" not in jvp


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("T", [3, 40], ids=["few-queries", "blocks"])
def test_nan_and_inf_in_padding_never_leak(T, isa):
    """Keys and values past ``key_value_seq_lengths`` reach the kernel as they are (the caller
    does not zero them for it: ``zeroes_blocked_keys``), and queries past ``query_seq_lengths``
    hold NaN: outputs and gradients are finite and bit for bit those of clean inputs."""
    assert CpuNative.zeroes_blocked_keys
    B, S, N, K, H = 2, 50, 4, 2, 16
    kv_len, q_len = np.array([50, 21], np.int32), np.array([T, T - 2], np.int32)
    case = Case("padding", (B, T, S, N, K, H, H), dict(is_causal=True), dtype=np.float32)
    (q, k, v), cot = case_args(case)
    kpad = np.arange(S)[None, :] >= kv_len[:, None]
    qpad = np.arange(T)[None, :] >= q_len[:, None]
    poison = lambda x, where, value: jnp.asarray(np.where(where[:, :, None, None], value, np.asarray(x)))
    f = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True, key_value_seq_lengths=kv_len,
                                                 query_seq_lengths=q_len, implementation=CpuNative(isa=isa))
    run = jax.jit(lambda *a: jax.vjp(f, *a)[1](cot) + (f(*a),))
    clean = run(q, k, v)
    dirty = run(poison(q, qpad, np.nan), poison(k, kpad, np.nan), poison(v, kpad, np.inf))
    for name, a, b in zip(("dq", "dk", "dv", "output"), dirty, clean):
        assert np.isfinite(np.asarray(a)).all(), f"{name} is not finite"
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} differs from the clean run")


@pytest.mark.parametrize("isa", BUILDS)
def test_the_log_sum_exp_and_its_gradient(isa):
    """``return_residual=True``: the lse (B, T, N) equals the reference's, -inf where a row sees
    nothing, and gradients through it (the kernel's backward takes the lse's cotangent) match."""
    case = Case("residual", (2, 14, 9, 2, 2, 16, 16), dict(is_causal=True), dtype=np.float32)
    (q, k, v), _ = case_args(case)
    rng = np.random.default_rng(3)
    w_out, w_lse = rng.standard_normal((2, 14, 2, 16)), rng.standard_normal((2, 14, 2))
    visible = np.arange(14) >= 5  # query t sees keys s <= t - 5

    def loss(attend):
        def f(q, k, v):
            out, lse = attend(q, k, v)
            return jnp.sum(out * w_out) + jnp.sum(jnp.where(visible[None, :, None], lse, 0.0) * w_lse)
        return f

    native_attend = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                                             implementation=CpuNative(isa=isa))
    xla_attend = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True, return_residual=True,
                                                          implementation="xla")
    _, lse = jax.jit(native_attend)(q, k, v)
    _, ref_lse = xla_attend(*(x.astype(np.float64) for x in (q, k, v)))
    assert np.all(np.isneginf(np.asarray(lse)[:, :5])) and np.all(np.isfinite(np.asarray(lse)[:, 5:]))
    assert rel_error(np.asarray(lse)[:, 5:], np.asarray(ref_lse)[:, 5:]) <= 1e-5
    got = jax.jit(jax.grad(loss(native_attend), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(loss(xla_attend), argnums=(0, 1, 2))(*(x.astype(np.float64) for x in (q, k, v)))
    errors = [rel_error(a, b) for a, b in zip(got, want)]
    assert all(e <= 1e-5 for e in errors), errors


def _call(dtype=jnp.float32, B=2, T=64, S=64, N=4, K=2, H=16, Hv=16, platform="cpu", **kw):
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((B, S, K, H), dtype)
    v = jax.ShapeDtypeStruct((B, S, K, Hv), dtype)
    return describe(q, k, v, platform=platform, **kw)


REFUSED = {
    "float64": (dict(dtype=jnp.float64), "dtype float64"),
    "bfloat16": (dict(dtype=jnp.bfloat16), "dtype bfloat16"),
    "head dim 8": (dict(H=8), "head dims H=8"),
    "value head dim 24": (dict(Hv=24), "Hv=24"),
    # positions and windows are served in a decoding step only: here 64 queries x 2 query heads a key head
    "window": (dict(local_window_size=(3, 0)), "a window with 128 query rows a key/value head"),
    "positions": (dict(query_positions=np.arange(64), key_positions=np.arange(64), is_causal=True),
                  "explicit positions with 128 query rows a key/value head"),
    "positions, 17 rows": (dict(T=17, N=2, K=2, query_positions=np.arange(17), key_positions=np.arange(64),
                                is_causal=True), "explicit positions with 17 query rows"),
    "chunks": (dict(mask=fa.masks.causal() & fa.masks.chunked(8)), "the mask rule 'chunk'"),
    "segments": (dict(query_segment_ids=np.zeros((2, 64), np.int32), key_segment_ids=np.zeros((2, 64), np.int32)),
                 "the mask rule 'q_segments'"),
    "boolean mask": (dict(mask=np.ones((64, 64), bool)), "the mask rule 'dense'"),
    "soft-cap": (dict(logit_softcap=5.0), "softcap"),
    "dropout": (dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), "dropout"),
    "weights": (dict(return_weights=True), "return_weights"),
    "gpu": (dict(platform="gpu"), "the 'gpu' backend"),
}


@pytest.mark.parametrize("what", list(REFUSED))
def test_refusals_say_what_is_not_served(what):
    kw, phrase = REFUSED[what]
    reason = CpuNative().supports(_call(**kw))
    assert reason is not None and phrase in reason, reason


def test_calls_naming_it_for_what_it_refuses_raise_with_the_reason(monkeypatch):
    q = jnp.ones((1, 40, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match=r"implementation='cpu_native' does not support a window with 40 query rows"):
        fa.dot_product_attention(q, q, q, local_window_size=(2, 0), implementation="cpu_native")
    _cpu_with(monkeypatch, AVX2_ONLY)
    with pytest.raises(ValueError, match=r"does not support this CPU for the avx512 build \(it lacks avx512f"):
        fa.dot_product_attention(q, q, q, implementation=CpuNative(isa="avx512"))


@needs_kernel
def test_the_automatic_choice_takes_it_for_the_float32_calls_it_serves_on_cpu():
    assert registry.choose(_call(T=128, S=128, is_causal=True)).name == "cpu_native"
    padded = dict(query_seq_lengths=np.array([128, 90]), key_value_seq_lengths=np.array([100, 128]))
    assert registry.choose(_call(T=128, S=128, is_causal=True, **padded)).name == "cpu_native"
    # decoding steps with lengths, over a large buffer of keys and a small one
    assert registry.choose(_call(T=1, S=16384, H=64, Hv=64, key_value_seq_lengths=np.array([1024, 3000]))
                           ).name == "cpu_native"
    assert registry.choose(_call(T=1, S=256, is_causal=True, key_value_seq_lengths=np.array([100, 256]))
                           ).name == "cpu_native"
    # a KV cache's 'blocks' would reach the kernel only through a transposed copy; the others it reads in place
    with tuning.keys_stored("blocks", 16):
        assert registry.choose(_call(T=1, S=256, key_value_seq_lengths=np.array([100, 256]))).name != "cpu_native"
    for layout in ("BSKH", "BKSH"):
        with tuning.keys_stored(layout):
            assert registry.choose(_call(T=1, S=256, key_value_seq_lengths=np.array([100, 256]))).name == "cpu_native"
    # a layer's decoding step: positions (the cache's slots), a window, lengths; not for 17 rows
    step = dict(is_causal=True, local_window_size=(63, 0), query_positions=np.array([[100], [7]]),
                key_positions=np.arange(256)[None].repeat(2, 0), key_value_seq_lengths=np.array([101, 8]))
    assert registry.choose(_call(T=1, S=256, N=8, K=2, **step)).name == "cpu_native"
    assert registry.choose(_call(T=1, S=256, N=17, K=1, **step)).name != "cpu_native"
    assert registry.choose(_call(T=128, S=128, dtype=jnp.float64, is_causal=True)).name != "cpu_native"
    assert registry.choose(_call(T=128, S=128, local_window_size=(8, 0))).name != "cpu_native"
    assert registry.choose(_call(T=128, S=128, platform="gpu", is_causal=True)).name != "cpu_native"


@needs_kernel
def test_the_automatic_choice_leaves_it_where_jax_sees_several_devices(monkeypatch):
    """Inputs may be sharded there, and XLA would gather them onto every device for the kernel."""
    monkeypatch.setattr(jax, "device_count", lambda *a: 2)
    assert registry.choose(_call(T=128, S=128, is_causal=True)).name != "cpu_native"
    assert CpuNative().supports(_call(T=128, S=128, is_causal=True)) is None  # named, it still serves


def test_block_q_and_isa_are_checked():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="CpuNative block_q must be a positive int"):
            CpuNative(block_q=bad)
    with pytest.raises(ValueError, match=r"isa must be None or one of \['avx2', 'avx512'\], got 'sse4'"):
        CpuNative(isa="sse4")


def _cpu_with(monkeypatch, flags):
    monkeypatch.setattr(native, "_on_x86_linux", lambda: True)
    monkeypatch.setattr(native.tuning, "cpu_flags", lambda: frozenset(flags))


AVX2_ONLY = ("sse4_2", "avx", "avx2", "fma", "bmi2")  # e.g. AMD's Zen 2 and 3


def test_the_build_follows_the_cpu(monkeypatch):
    """AVX-512 CPUs get the avx512 build, AVX2-only ones the avx2 build and the reason the
    other cannot run; a CPU with neither is refused with what the kernel needs."""
    monkeypatch.delenv("FLAX_ATTN_CPU_ISA", raising=False)
    _cpu_with(monkeypatch, AVX2_ONLY + native.ISAS["avx512"][1])
    assert native.best_isa() == "avx512"
    _cpu_with(monkeypatch, AVX2_ONLY)
    assert native.best_isa() == "avx2" and native._cpu_refusal() is None
    assert native._cpu_refusal("avx512") == ("this CPU for the avx512 build "
                                             "(it lacks avx512f, avx512bw, avx512cd, avx512dq, avx512vl)")
    _cpu_with(monkeypatch, ("sse4_2", "avx"))
    assert native.best_isa() is None
    assert native.unavailable() == "this CPU (the kernel needs AVX-512, or AVX2 with FMA)"
    reason = CpuNative().supports(_call(is_causal=True))
    assert reason == "this CPU (the kernel needs AVX-512, or AVX2 with FMA)"


def test_the_environment_names_the_default_build(monkeypatch):
    _cpu_with(monkeypatch, AVX2_ONLY + native.ISAS["avx512"][1])
    monkeypatch.setenv("FLAX_ATTN_CPU_ISA", "avx2")
    assert native.best_isa() == "avx2"
    _cpu_with(monkeypatch, AVX2_ONLY)
    monkeypatch.setenv("FLAX_ATTN_CPU_ISA", "avx512")
    assert native.best_isa() is None
    assert native.unavailable().startswith("this CPU for the avx512 build (it lacks avx512f")
    monkeypatch.setenv("FLAX_ATTN_CPU_ISA", "avx1024")
    with pytest.raises(ValueError, match=r"\$FLAX_ATTN_CPU_ISA must be None or one of .*got 'avx1024'"):
        native.best_isa()


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the library's instructions")
@pytest.mark.parametrize("isa", BUILDS)
def test_only_the_avx512_build_holds_avx512_instructions(isa):
    """What an AVX2-only CPU will run: no zmm register, no mask register, no ymm16-31 (each of
    them needs AVX-512's EVEX encoding). The AVX-512 build, read the same way, holds them."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(native._build(isa))],
                             capture_output=True, text=True, check=True).stdout
    evex = re.findall(r"%zmm\d+|%k[1-7]\b|%ymm(?:1[6-9]|2\d|3[01])\b", listing)
    assert (len(evex) == 0) == (isa == "avx2"), (isa, evex[:5])


@needs_kernel
def test_a_failed_build_reports_the_compilers_error(tmp_path, monkeypatch):
    broken = tmp_path / "attention.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "SOURCE", broken)
    monkeypatch.setenv("FLAX_ATTN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match=r"compiling attention.cc for avx2 failed \(.*exit 1\):\n.*error"):
        native._build("avx2")
    assert not list((tmp_path / "cache").iterdir())  # no half-written library left behind


def test_without_a_compiler_the_kernel_refuses_and_the_automatic_choice_falls_back(tmp_path):
    """A fresh process with no compiler and an empty cache: ``unavailable()`` says why, a call
    naming the kernel raises with that reason, and the automatic choice computes the same
    numbers by another path."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        import flax_attn as fa
        from flax_attn.core import native, registry
        from flax_attn.core.call import describe
        print("REASON", native.unavailable())
        q = jnp.asarray(np.random.default_rng(0).standard_normal((1, 128, 2, 16)), jnp.float32)
        print("AUTO", registry.choose(describe(q, q, q, is_causal=True, platform="cpu")).name)
        out = fa.dot_product_attention(q, q, q, is_causal=True)
        ref = fa.dot_product_attention(q, q, q, is_causal=True, implementation="xla")
        print("ERR", float(jnp.max(jnp.abs(out - ref))))
        try:
            fa.dot_product_attention(q, q, q, is_causal=True, implementation="cpu_native")
        except ValueError as e:
            print("RAISED", e)
    """)
    env = {**os.environ, "CXX": "no-such-compiler-here", "FLAX_ATTN_CACHE": str(tmp_path), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    expected = ("no C++ compiler ('no-such-compiler-here' is not on PATH; set $CXX)" if CANNOT_RUN is None
                else CANNOT_RUN)
    assert expected in lines["REASON"], done.stdout
    assert lines["AUTO"] != "cpu_native"
    assert float(lines["ERR"]) < 1e-5
    assert "implementation='cpu_native' does not support" in lines["RAISED"] and expected in lines["RAISED"]
