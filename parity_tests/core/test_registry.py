"""The registry: the automatic choice (decided from the call's description, platform included),
named implementations that refuse with their reason, a toy implementation added and removed,
and cuDNN held to the reference where an NVIDIA GPU exists."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn.core import Blockwise, Implementation, Result, Splash, XLA, registry, tuning
from flax_attn.core import mask as M
from flax_attn.core.call import describe
from torch_ref.compare import max_rel_error


def _call(T=1024, S=1024, H=64, dtype=jnp.float32, platform="cpu", **kw):
    q = jax.ShapeDtypeStruct((2, T, 4, H), dtype)
    k = jax.ShapeDtypeStruct((2, S, 4, H), dtype)
    return describe(q, k, k, platform=platform, **{"is_causal": True, **kw})


def _chosen(**kw):
    return registry.choose(_call(**kw)).name


NAMES = ["pallas_decode", "cudnn", "splash", "pallas_triton", "cpu_native", "key_blocks", "query_blocks", "blockwise",
         "xla"]


def test_registry_order_and_names():
    assert registry.names() == NAMES  # the plain path serves everything, last
    if jax.default_backend() == "cpu":  # the Pallas kernels need GPU/TPU
        assert [i.name for i in registry.available()] == ["cpu_native", "key_blocks", "query_blocks", "blockwise", "xla"]


@pytest.fixture
def without_the_compiled_kernel(monkeypatch):
    """The automatic choice on a CPU where the compiled kernel cannot run (no AVX2, no compiler)."""
    from flax_attn.core import native
    monkeypatch.setattr(native, "unavailable", lambda isa=None: "this CPU (the kernel needs AVX-512, or AVX2 with FMA)")


def test_automatic_choice_on_cpu_takes_the_compiled_kernel_where_it_serves():
    from flax_attn.core import native
    if native.unavailable() is not None:
        pytest.skip(f"the compiled kernel cannot run here: {native.unavailable()}")
    assert _chosen() == "cpu_native"
    assert _chosen(T=1, S=1024) == "cpu_native"   # any length, no mask beyond causal
    assert _chosen(T=64, S=64, is_causal=False) == "cpu_native"
    assert _chosen(return_residual=True) == "cpu_native"
    in_use = np.array([300, 1000], np.int32)
    assert _chosen(T=1, S=8192, key_value_seq_lengths=in_use) == "cpu_native"   # it reads only the keys in use
    assert _chosen(dtype=jnp.float64) == "query_blocks"                          # float32 only
    assert _chosen(H=72) == "query_blocks"                                       # head dims of multiples of 16
    assert _chosen(local_window_size=(16, 0)) == "query_blocks"
    positions = np.tile(np.arange(1024, dtype=np.int32), (2, 1))
    assert _chosen(query_positions=positions, key_positions=positions) == "blockwise"
    assert _chosen(dropout_rate=0.1, dropout_rng=jax.random.key(0)) == "xla"
    assert _chosen(platform="gpu") == "xla"


def test_automatic_choice_on_cpu(without_the_compiled_kernel):
    assert _chosen() == "query_blocks"             # 4 query blocks of 256, key ranges known at trace time
    assert _chosen(T=1, S=1024) == "xla"      # one decoding step
    in_use = np.array([300, 1000], np.int32)  # decoding over a cache of 8192 slots, its fill known at run time
    assert _chosen(T=1, S=8192, key_value_seq_lengths=in_use) == "key_blocks"
    assert _chosen(T=1, S=512, key_value_seq_lengths=in_use // 2) == "xla"  # 512 keys make one block
    assert _chosen(T=64, S=64) == "xla"       # below the measured crossover
    assert _chosen(T=128, S=128) == "query_blocks"
    qb = registry.get("query_blocks")
    longest = qb.max_blocks * qb._block_q(_call())  # 16 query blocks: the unrolled program's limit
    assert longest >= 2048  # blocks of 128 at least (256 with 64-dim float32 heads on a 1 MiB L2)
    assert _chosen(T=longest, S=longest) == "query_blocks"
    assert _chosen(T=longest + 1, S=longest + 1) == "blockwise"
    assert _chosen(dropout_rate=0.1, dropout_rng=jax.random.key(0)) == "xla"  # neither has dropout
    assert _chosen(return_weights=True) == "xla"
    positions = np.tile(np.arange(1024, dtype=np.int32), (2, 1))
    # positions as arrays: the key ranges are known only at run time, where blockwise skips blocks
    assert _chosen(query_positions=positions, key_positions=positions) == "blockwise"
    assert _chosen(query_segment_ids=np.zeros((2, 1024), np.int32), key_segment_ids=np.zeros((2, 1024), np.int32),
                   mask=np.ones((1024,), bool), logit_softcap=3.0) == "query_blocks"
    assert _chosen(is_causal=False, mask=np.ones((1024,), bool)) == "query_blocks"


@pytest.mark.parametrize("heads, kv_heads, T, block_q", [(4, 4, 1024, 256), (4, 4, 1023, 128), (4, 4, 4096, 256),
                                                         (8, 4, 1024, 128), (16, 1, 4096, 128), (4, 4, 100, 100)])
def test_query_blocks_block_size(monkeypatch, heads, kv_heads, T, block_q):
    """QueryBlocks' default block (64-dim float32 heads, a 1 MiB L2): the tile whose working set
    fits half the L2 (128), or the tile that fits the whole L2 (256) for multi-head attention over at least four
    such blocks; never more than the queries; a given block_q wins."""
    from flax_attn.core import tuning
    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 1 << 20)
    q = jax.ShapeDtypeStruct((2, T, heads, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((2, T, kv_heads, 64), jnp.float32)
    qb = registry.get("query_blocks")
    assert qb._block_q(describe(q, k, k, is_causal=True, platform="cpu")) == block_q
    assert dataclasses.replace(qb, block_q=32)._block_q(describe(q, k, k, platform="cpu")) == 32


def test_automatic_choice_on_gpu():
    bf16 = dict(dtype=jnp.bfloat16, platform="gpu")
    assert _chosen(**bf16) == "cudnn"
    assert _chosen(dtype=jnp.float32, platform="gpu") == "xla"           # 16-bit floats only on the GPU paths
    assert _chosen(**bf16, H=96 + 4) == "pallas_triton"                   # cuDNN: head dim not a multiple of 8
    assert _chosen(**bf16, T=512, S=1024) == "pallas_triton"              # cuDNN: causal with T != S
    seg = np.zeros((2, 1024), np.int32)
    assert _chosen(**bf16, query_segment_ids=seg, key_segment_ids=seg) == "pallas_triton"
    assert _chosen(**bf16, local_window_size=(16, 0)) == "xla"            # neither has windows
    assert _chosen(**bf16, logit_softcap=30.0) == "xla"                   # nor a soft-cap
    assert _chosen(**bf16, T=1024, S=512) == "xla"                        # Triton: T > S
    assert _chosen(**bf16, precision="highest") == "xla"                  # the kernels' precision is fixed
    assert _chosen(**bf16, T=1, S=1024) == "pallas_decode"                # one decoding step
    assert _chosen(**bf16, T=1, S=1024, local_window_size=(255, 0),
                   key_value_seq_lengths=np.array([1024, 7], np.int32)) == "pallas_decode"
    assert _chosen(**bf16, T=1, S=1024, logit_softcap=30.0) == "xla"      # decode: no soft-cap
    assert _chosen(**bf16, T=2, S=1024) == "pallas_triton"                # two queries: not a decoding step


def test_automatic_choice_on_tpu():
    bf16 = dict(dtype=jnp.bfloat16, platform="tpu")
    assert _chosen(**bf16) == "splash"
    seg = np.zeros((2, 1024), np.int32)
    assert _chosen(**bf16, T=512, local_window_size=(127, 0), logit_softcap=30.0, query_segment_ids=seg[:, :512],
                   key_segment_ids=seg, key_value_seq_lengths=np.array([1024, 9], np.int32)) == "splash"
    assert _chosen(platform="tpu") == "xla"                               # float32: not verified on TPUs
    assert _chosen(**bf16, mask=np.ones((1024,), bool)) == "xla"          # splash's masks are static patterns
    assert _chosen(**bf16, query_positions=np.arange(1024), key_positions=np.arange(1024)) == "xla"
    assert _chosen(**bf16, return_weights=True) == "xla"


def test_automatic_choice_serves_gradients_of_the_residual():
    """Splash and Triton give the log-sum-exp forward only, so the automatic choice takes them
    for no return_residual call (its gradients must work); the decoding kernel's backward pass
    serves it. Named, they still serve the call (forward)."""
    bf16 = dict(dtype=jnp.bfloat16, return_residual=True)
    assert _chosen(**bf16, platform="tpu") == "xla"
    assert _chosen(**bf16, platform="gpu") == "cudnn"
    assert _chosen(**bf16, platform="gpu", T=512, S=1024) == "xla"                     # Triton's case above
    assert _chosen(**bf16, platform="gpu", T=1, S=1024) == "pallas_decode"
    assert registry.get("splash").supports(_call(**bf16, platform="tpu")) is None
    assert registry.get("pallas_triton").supports(_call(**bf16, platform="gpu", T=512, S=1024)) is None


def test_platform_arguments_are_checked():
    for bad in ("cuda", "GPU", "metal"):
        with pytest.raises(ValueError, match=rf"platform must be one of \['cpu', 'gpu', 'tpu'\], got '{bad}'"):
            _call(platform=bad)
        with pytest.raises(ValueError, match="platform must be one of"):
            registry.available(bad)


def test_pallas_kernels_refuse_with_their_reason():
    """Named, each kernel says why it cannot serve a call; on CPU it points to interpret mode."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, 4, 8)), jnp.float32) for _ in range(3))
    for name in ("splash", "pallas_triton", "pallas_decode") if jax.default_backend() == "cpu" else ():
        with pytest.raises(ValueError, match=rf"implementation='{name}' does not support the 'cpu' backend "
                                             r".*\(interpret=True\) runs it on any backend"):
            fa.dot_product_attention(q, k, v, implementation=name)
    tpu = lambda **kw: dataclasses.replace(_call(dtype=jnp.bfloat16, **kw), platform="tpu")
    gpu = lambda **kw: dataclasses.replace(_call(dtype=jnp.bfloat16, **kw), platform="gpu")
    splash, triton, decode = (registry.get(n) for n in ("splash", "pallas_triton", "pallas_decode"))
    assert splash.supports(tpu(bias=np.zeros((1024, 1024), np.float32))) == "a bias"
    assert "dtype float32" in splash.supports(dataclasses.replace(_call(), platform="tpu"))
    assert "dropout" in splash.supports(tpu(dropout_rate=0.1, dropout_rng=jax.random.key(0)))
    assert triton.supports(gpu(local_window_size=3)) == "local_window_size"
    assert "key_value_seq_lengths" == triton.supports(gpu(key_value_seq_lengths=np.array([3, 4], np.int32)))
    assert "T=1024 > S=512" in triton.supports(gpu(T=1024, S=512))
    assert "T=2 queries" in decode.supports(gpu(T=2))
    assert "H=8 != Hv=4" in decode.supports(dataclasses.replace(gpu(T=1), H=8, Hv=4))
    # user-defined rules and chunks are refused by the kernels and by cuDNN, never ignored
    cudnn = registry.get("cudnn")
    for impl, call in ((splash, tpu), (triton, gpu), (decode, lambda **kw: gpu(T=1, **kw)), (cudnn, gpu)):
        assert "score_mod" in impl.supports(call(score_mod=lambda s, b, n, i, j: s)), impl.name
        assert "mask_mod" in impl.supports(call(mask=M.mask_mod(lambda b, n, i, j: i >= j))), impl.name
        assert "chunk" in impl.supports(call(mask=M.chunked(64))), impl.name
    assert Splash(interpret=True).runs_on("cpu") and not Splash().runs_on("cpu") and Splash().runs_on("tpu")


def test_automatic_choice_falls_back_silently_and_named_ones_say_why():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 300, 4, 8))) for _ in range(3))
    out, w = fa.dot_product_attention(q, k, v, is_causal=True, return_weights=True)  # xla serves it
    assert w.shape == (2, 4, 300, 300)
    fa.dot_product_attention(q, k, v, is_causal=True, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match=r"implementation='blockwise' does not support dropout"):
        fa.dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0), implementation="blockwise")
    with pytest.raises(ValueError, match=r"implementation='blockwise' does not support return_weights"):
        fa.dot_product_attention(q, k, v, return_weights=True, implementation="blockwise")
    with pytest.raises(ValueError, match=r"implementation='query_blocks' does not support dropout"):
        fa.dot_product_attention(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                                 implementation="query_blocks")
    with pytest.raises(ValueError, match=r"implementation='cudnn' does not support the 'cpu' backend"):
        fa.dot_product_attention(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match=r"implementation must be one of \[.*'blockwise', 'xla'\], got 'flash'"):
        fa.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(TypeError, match=r"implementation must be None, a name in"):
        fa.dot_product_attention(q, k, v, implementation=3)


def test_tuning_knobs_are_fields_not_globals():
    small = Blockwise(block_q=4, block_k=4, min_length=8)
    assert small.preferred(_call(T=8, S=8)) and not Blockwise().preferred(_call(T=8, S=8))
    assert registry.get("blockwise") == Blockwise()  # the registered one is untouched


@dataclasses.dataclass(frozen=True)
class _Chunked(Implementation):
    """A toy: the plain path run over chunks of queries (the mask description's block API)."""

    name: str = "toy-chunked"
    chunk: int = 5

    def supports(self, call):
        return "dropout" if call.dropout_rate > 0 else None

    def preferred(self, call):
        return False  # never the automatic choice

    def __call__(self, call, query, key, value, dropout_rng):
        from flax_attn.core import numerics
        outs, lses = [], []
        K = call.K
        for start in range(0, call.T, self.chunk):
            size = min(self.chunk, call.T - start)
            q = numerics.group_queries(query[:, start:start + size], K)               # (B, K, G, t, H)
            raw = jnp.einsum("BKGTH,BSKH->BKGTS", q, key, precision=call.precision,
                             preferred_element_type=call.acc_dtype)
            rows = jnp.arange(query.shape[0])
            allowed = jax.vmap(lambda b: call.mask.block(b, (0, call.N), start, size, 0, call.S))(rows)
            bias = None if call.mask.bias is None else jax.vmap(
                lambda b: call.mask.block_bias(b, (0, call.N), start, size, 0, call.S))(rows)
            group = lambda x: None if x is None else numerics.group_heads(x, K)
            logits = numerics.finish_logits(call, raw, group(bias))
            w, lse = numerics.softmax_parts(logits, jnp.broadcast_to(group(allowed), logits.shape))
            if call.return_weights:
                raise AssertionError("not asked in these tests")
            o = jnp.einsum("BKGTS,BSKH->BKGTH", w.astype(value.dtype), value, precision=call.precision,
                           preferred_element_type=call.acc_dtype)
            outs.append(numerics.ungroup(o))
            lses.append(numerics.ungroup(lse[..., None])[..., 0])
        return Result(out=jnp.concatenate(outs, axis=1).astype(query.dtype), lse=jnp.concatenate(lses, axis=1))


@pytest.fixture
def toy():
    impl = registry.register(_Chunked())
    yield impl
    registry.unregister(impl.name)


def test_a_toy_implementation_registers_serves_and_leaves(toy):
    assert registry.names() == NAMES[:-1] + ["toy-chunked", "xla"]
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((2, 13, 4, 8)))
    k, v = (jnp.asarray(rng.standard_normal((2, 17, 2, 8))) for _ in range(2))
    bias = jnp.asarray(rng.standard_normal((1, 4, 1, 17)))
    kw = dict(is_causal=True, local_window_size=(6, 0), key_value_seq_lengths=jnp.array([17, 9]))
    f = lambda impl: jax.jit(lambda q, k, v, b: fa.dot_product_attention(q, k, v, b, implementation=impl,
                                                                          return_residual=True, **kw))
    (out, lse), (ref, ref_lse) = f("toy-chunked")(q, k, v, bias), f("xla")(q, k, v, bias)
    assert max_rel_error(out, ref) <= 1e-12
    empty = np.isneginf(ref_lse)  # queries that see nothing (keys past length 9 in row 1)
    assert empty.any() and (np.isneginf(lse) == empty).all()
    assert max_rel_error(jnp.where(empty, 0, lse), jnp.where(empty, 0, ref_lse)) <= 1e-12
    loss = lambda impl: (lambda *a: jnp.sum(jnp.sin(f(impl)(*a)[0])))
    for g, rg in zip(jax.jit(jax.grad(loss(toy), argnums=(0, 1, 2, 3)))(q, k, v, bias),
                     jax.jit(jax.grad(loss("xla"), argnums=(0, 1, 2, 3)))(q, k, v, bias)):
        assert max_rel_error(g, rg) <= 1e-12
    registry.unregister("toy-chunked")
    before = _chosen()
    registry.register(toy)
    assert _chosen() == before  # not preferred: the automatic choice is unchanged
    with pytest.raises(ValueError, match="implementation='toy-chunked' does not support dropout"):
        fa.dot_product_attention(q, k, v, dropout_rate=0.5, dropout_rng=jax.random.key(0), implementation=toy)
    with pytest.raises(ValueError, match="already registered"):
        registry.register(_Chunked())


@dataclasses.dataclass(frozen=True)
class _ElsewhereOnly(registry.Implementation):
    """Serves every call and prefers it, but runs on no platform of this test (runs_on)."""

    name: str = "elsewhere-only"

    def runs_on(self, platform):
        return platform == "no-such-platform"

    def __call__(self, call, query, key, value, dropout_rng):  # pragma: no cover - must never run
        raise AssertionError("ran where runs_on says it does not")


def test_runs_on_decides_the_choice_and_register_takes_implementations_only():
    """An implementation that does not run on the call's platform is never chosen, and naming it
    is a ValueError saying so; register refuses what is not an Implementation (it broke every
    automatic call later)."""
    impl = registry.register(_ElsewhereOnly(), before=NAMES[0])
    try:
        q = jnp.ones((1, 4, 2, 8))
        call = describe(q, q, q, platform=jax.default_backend())
        assert registry.choose(call).name != impl.name and impl not in registry.available()
        fa.dot_product_attention(q, q, q)
        with pytest.raises(ValueError, match=rf"implementation='elsewhere-only' does not support the "
                                             rf"'{jax.default_backend()}' backend \(it does not run there"):
            fa.dot_product_attention(q, q, q, implementation="elsewhere-only")
    finally:
        registry.unregister(impl.name)

    class NotAnImplementation:
        name = "bogus"

    with pytest.raises(TypeError, match="register takes an Implementation .*, got NotAnImplementation"):
        registry.register(NotAnImplementation())
    assert "bogus" not in registry.names()


def test_the_toy_is_gone_after_unregistering():
    assert "toy-chunked" not in registry.names()


def test_xla_is_an_ordinary_registered_object():
    assert isinstance(registry.get("xla"), XLA)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU; this run has none")
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_equals_reference_on_gpu(causal):
    # cuDNN takes bfloat16 only here, so it is held to a float32 reference computed from the same
    # (exactly representable) bfloat16 inputs, at bfloat16's tolerance (relative 1e-2).
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 256, 8, 64))
    k, v = rng.standard_normal((2, 256, 2, 64)), rng.standard_normal((2, 256, 2, 64))
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
    f32 = [x.astype(jnp.float32) for x in bf16]
    f = lambda impl: (lambda *a: fa.dot_product_attention(*a, is_causal=causal, implementation=impl))
    assert max_rel_error(f("cudnn")(*bf16), f("xla")(*f32)) < 1e-2
    loss = lambda impl: (lambda *a: jnp.sum(f(impl)(*a).astype(jnp.float32) * jnp.cos(jnp.arange(64.0))))
    g = jax.grad(loss("cudnn"), argnums=(0, 1, 2))(*bf16)
    g_ref = jax.grad(loss("xla"), argnums=(0, 1, 2))(*f32)
    for a, b in zip(g, g_ref):
        assert max_rel_error(a, b) < 1e-2


def test_shifted_default_positions():
    """Positions whose rules are those of the default ones: every row the default positions
    (keys 0..S-1, queries the last T of them) plus one offset for both sides."""
    from flax_attn.core.attention import shifted_default_positions

    def shifted(q, k, T, S, chunk=None):
        m = M.Mask(q_positions=None if q is None else jnp.asarray(q, jnp.int32),
                   k_positions=None if k is None else jnp.asarray(k, jnp.int32), causal=True, chunk=chunk)
        return bool(shifted_default_positions(m, T, S))

    ar = np.arange(6)
    assert shifted([ar], [ar], 6, 6)
    assert shifted([ar + 7, ar + 2], [ar + 7, ar + 2], 6, 6)     # one offset a row
    assert shifted([ar[2:] + 3], [ar + 3], 4, 6)                  # queries at the last T keys
    assert shifted([ar], None, 6, 6) and shifted(None, [ar], 6, 6)
    assert not shifted([ar + 1], [ar], 6, 6)                       # queries shifted against the keys
    assert not shifted([ar[:4]], [ar], 4, 6)                       # queries at the first T keys
    assert not shifted([[0, 1, 2, 0, 1, 2]], [[0, 1, 2, 0, 1, 2]], 6, 6)  # packed documents
    assert not shifted([ar, ar + 1], [ar, ar], 6, 6)               # one row off
    assert not shifted([[0, 2, 4, 6, 8, 10]], [[0, 2, 4, 6, 8, 10]], 6, 6)
    assert shifted([ar + 8], [ar + 8], 6, 6, chunk=4) and not shifted([ar + 2], [ar + 2], 6, 6, chunk=4)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="query blocks are the CPU choice")
@pytest.mark.parametrize("positions", ["shifted", "packed"])
@pytest.mark.parametrize("rules", [dict(is_causal=True), dict(is_causal=True, local_window_size=(40, 0))])
def test_automatic_choice_takes_query_blocks_at_run_time_for_shifted_default_positions(positions, rules, monkeypatch):
    """Positions given as arrays: the automatic choice runs query blocks (the choice for default
    positions) where the positions are the default ones shifted, and blockwise otherwise, decided
    at run time; outputs and derivatives (reverse and forward mode, and under vmap) equal the
    plain path's in float64 either way."""
    B, T, N, H = 2, 256, 2, 8
    rng = np.random.default_rng(11)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H))) for _ in range(3))
    if positions == "shifted":
        pos = jnp.asarray(np.arange(T)[None] + np.array([[0], [37]]), jnp.int32)
    else:
        pos = jnp.asarray(np.tile(np.arange(T) % 100, (B, 1)), jnp.int32)
    attend = lambda q, k, v, implementation=None: fa.dot_product_attention(  # noqa: E731
        q, k, v, query_positions=pos, key_positions=pos, implementation=implementation, **rules)
    assert "cond[" in str(jax.make_jaxpr(attend)(q, k, v))
    # over a KV cache (a layer declares its layout) the choice is made at trace time: unwritten
    # slots hold position 0, and the conditional would copy the cache at every step
    from flax_attn.core import attention

    asked = []
    monkeypatch.setattr(attention, "shifted_default_positions",
                        lambda *a, real=attention.shifted_default_positions: asked.append(1) or real(*a))
    trace = lambda: jax.make_jaxpr(lambda *a: attend(*a))(q, k, v)  # noqa: E731 (a new function: traced anew)
    trace()
    assert len(asked) == 1
    for layout in ("BKSH", "BSKH"):
        with tuning.keys_stored(layout):
            trace()
    assert len(asked) == 1
    ref = lambda q, k, v: attend(q, k, v, "xla")  # noqa: E731
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))  # noqa: E731
    assert max_rel_error(attend(q, k, v), ref(q, k, v)) < 1e-12
    for got, want in zip(jax.grad(loss(attend), (0, 1, 2))(q, k, v), jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
        assert max_rel_error(got, want) < 1e-12
    tangents = (jnp.cos(q), jnp.sin(k), v)
    assert max_rel_error(jax.jvp(attend, (q, k, v), tangents)[1], jax.jvp(ref, (q, k, v), tangents)[1]) < 1e-12
    stacked = jnp.stack([q, -q])
    assert max_rel_error(jax.vmap(attend, (0, None, None))(stacked, k, v),
                         jax.vmap(ref, (0, None, None))(stacked, k, v)) < 1e-12
