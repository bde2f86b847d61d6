"""The layers' shared pieces (flax_attn.layers.common). The projection (dense): on CPU, from
the CPU's threshold of rows on (tuning.LARGE_PROJECTION_ROWS, or fewer: tuning.large_projection_rows), it is a 1-wide convolution over the rows, which XLA compiles into its own
dot, or (on other CPUs) reads its kernel transposed; every form is x @ kernel + bias, in outputs
and in reverse and forward mode. The loop over batch rows (by_row_chunks): its decision per
platform, and the same numbers as the whole batch, the derivatives' programs unchanged."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from flax_attn.core import tuning
from flax_attn.layers.common import dense, rows_product

LARGE_ROWS = tuning.LARGE_PROJECTION_ROWS


@pytest.mark.parametrize("threshold", [tuning.INTEL_LARGE_PROJECTION_ROWS, LARGE_ROWS])
@pytest.mark.parametrize("convolutions", [True, False])
@pytest.mark.parametrize("rows", [3, tuning.INTEL_LARGE_PROJECTION_ROWS, LARGE_ROWS])
def test_dense_is_the_matmul(rows, convolutions, threshold, monkeypatch):
    """dense is x @ kernel + bias in every form, and takes the large form from the CPU's
    threshold (tuning.large_projection_rows) on."""
    monkeypatch.setattr(tuning, "projections_as_convolutions", lambda: convolutions)
    monkeypatch.setattr(tuning, "large_projection_rows", lambda: threshold)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((2, rows // 2 if rows > 3 else rows, 5)))
    p = {"kernel": jnp.asarray(rng.standard_normal((5, 3))), "bias": jnp.asarray(rng.standard_normal(3))}
    want = lambda p, x: x @ p["kernel"] + p["bias"]  # noqa: E731
    jaxpr = str(jax.make_jaxpr(lambda p, x: dense(p, x))(p, x))
    large = jax.default_backend() == "cpu" and rows >= threshold
    assert ("conv_general_dilated" in jaxpr) == (large and convolutions)
    assert ("optimization_barrier" in jaxpr) == (large and not convolutions)
    assert_close(dense(p, x), want(p, x), np.float64, "dense")
    ct = jnp.asarray(rng.standard_normal(x.shape[:-1] + (3,)))
    for got, exp, name in zip(jax.vjp(dense, p, x)[1](ct), jax.vjp(want, p, x)[1](ct), ("params", "x")):
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(exp)):
            assert_close(g, e, np.float64, f"reverse mode, {name}")
    tangents = (jax.tree.map(jnp.ones_like, p), jnp.ones_like(x))
    assert_close(jax.jvp(dense, (p, x), tangents)[1], jax.jvp(want, (p, x), tangents)[1], np.float64, "forward mode")



@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the convolution form is CPU-only")
def test_the_convolution_form_compiles_to_xlas_dot_in_both_directions():
    """The reason for the convolution form: with YNNPACK's fusions on (XLA's default on CPU), a
    plain dot of this size becomes a YNNPACK fusion, the convolution becomes XLA's own dot, and
    so do the two products of its reverse mode."""
    x = jnp.zeros((2, LARGE_ROWS // 2, 64), jnp.float32)
    kernel = jnp.zeros((64, 48), jnp.float32)
    ct = jnp.zeros((2, LARGE_ROWS // 2, 48), jnp.float32)

    def ops(f, *args):
        text = jax.jit(f).lower(*args).compile().as_text()
        return text.count(" dot("), text.count("ynn_fusion") > 0, text.count("convolution(")

    plain = ops(lambda k, x: x @ k, kernel, x)
    if not plain[1]:
        pytest.skip("this XLA does not hand the plain dot to YNNPACK")
    assert ops(lambda k, x: rows_product(x, k), kernel, x) == (1, False, 0)
    reverse = lambda k, x, ct: jax.vjp(lambda k, x: rows_product(x, k), k, x)[1](ct)  # noqa: E731
    assert ops(reverse, kernel, x, ct) == (2, False, 0)


def test_projections_as_convolutions_on_amd_family_25_and_intel_with_avx512():
    amd = "vendor_id\t: AuthenticAMD\ncpu family\t: {}\nmodel\t\t: 17\nflags\t\t: fpu sse2 avx2 {}\n"
    assert tuning._projections_as_convolutions(amd.format(25, "avx512f avx512bw"))
    assert not tuning._projections_as_convolutions(amd.format(25, ""))        # family 25, model 1: AVX2
    assert not tuning._projections_as_convolutions(amd.format(26, "avx512f"))  # full-width AVX-512
    intel = amd.replace("AuthenticAMD", "GenuineIntel")
    assert tuning._projections_as_convolutions(intel.format(6, "avx512f"))  # Intel with AVX-512
    assert not tuning._projections_as_convolutions(intel.format(6, ""))
    assert not tuning._projections_as_convolutions("")


def test_large_projection_rows_follow_the_cpu():
    """The large form starts at 1,024 rows on Intel's CPUs with AVX-512, at LARGE_ROWS (4,096)
    on AMD's, on Intel's without AVX-512 and where /proc/cpuinfo cannot be read."""
    cpu = "vendor_id\t: {}\ncpu family\t: {}\nflags\t\t: fpu sse2 avx2 {}\n"
    assert tuning._large_projection_rows(cpu.format("GenuineIntel", 6, "avx512f")) == 1024
    for vendor, family, flags in (("GenuineIntel", 6, ""), ("AuthenticAMD", 25, "avx512f"), ("AuthenticAMD", 26, "avx512f")):
        assert tuning._large_projection_rows(cpu.format(vendor, family, flags)) == LARGE_ROWS
    assert tuning._large_projection_rows("") == LARGE_ROWS


@pytest.mark.parametrize("setting, expected", [("1", True), ("0", False), ("yes", ValueError)])
def test_projections_as_convolutions_follows_its_environment_variable(setting, expected, monkeypatch):
    monkeypatch.setenv(tuning.PROJECTIONS_ENV, setting)
    tuning._machine_projections_as_convolutions.cache_clear()
    try:
        if expected is ValueError:
            with pytest.raises(ValueError, match=tuning.PROJECTIONS_ENV):
                tuning.projections_as_convolutions()
        else:
            assert tuning.projections_as_convolutions() is expected
    finally:
        monkeypatch.delenv(tuning.PROJECTIONS_ENV)
        tuning._machine_projections_as_convolutions.cache_clear()


def test_projections_as_chooses_the_form_of_a_trace():
    """Inside ``projections_as(form)`` a trace of a large projection takes that form, whatever the
    machine's default; the default returns on leaving it, inner contexts win over outer ones, the
    form is fixed when a jitted function is traced, and an unknown form is refused by name."""
    import flax_attn as fa

    x, p = jnp.ones((LARGE_ROWS, 4)), {"kernel": jnp.ones((4, 2))}
    form = lambda: "conv_general_dilated" in str(jax.make_jaxpr(lambda p, x: dense(p, x))(p, x))  # noqa: E731
    default = tuning.projections_as_convolutions()
    if jax.default_backend() != "cpu":
        pytest.skip("the large-projection forms are CPU forms")
    with fa.projections_as("convolution"):
        assert tuning.projections_as_convolutions() and form()
        with fa.projections_as("dot"):
            assert not tuning.projections_as_convolutions() and not form()
            traced = jax.jit(lambda p, x: dense(p, x)).lower(p, x).as_text()
        assert form()
    assert tuning.projections_as_convolutions() is default and form() is default
    assert "convolution" not in traced and "dot_general" in traced
    # an ensemble (vmap over kernels and inputs): a grouped convolution as 'convolution', a dot as 'dot'
    kernels, xs = jnp.ones((3, 4, 2)), jnp.ones((3, LARGE_ROWS, 4))
    ensemble = lambda: str(jax.make_jaxpr(jax.vmap(lambda k, x: dense({"kernel": k}, x)))(kernels, xs))  # noqa: E731
    with fa.projections_as("convolution"):
        assert "feature_group_count=3" in ensemble()
    with fa.projections_as("dot"):
        assert "conv_general_dilated" not in ensemble()
    with pytest.raises(ValueError, match=r"projections_as\(form=...\).*'conv'"):
        with fa.projections_as("conv"):
            pass

def test_row_chunk_takes_about_a_thousand_tokens_a_step_on_cpu_only():
    from flax_attn.layers.common import ROW_CHUNK_MIN_TOKENS, row_chunk

    assert ROW_CHUNK_MIN_TOKENS == 4096
    assert row_chunk(8, 1024, "cpu") == 1
    assert row_chunk(32, 128, "cpu") == 8
    assert row_chunk(6, 1000, "cpu") == 1
    assert row_chunk(12, 400, "cpu") == 2     # 1024 // 400 = 2 rows, dividing 12
    assert row_chunk(9, 512, "cpu") == 1      # 2 rows would not divide 9
    assert row_chunk(2, 8192, "cpu") == 1
    assert row_chunk(16, 128, "cpu") is None  # 2,048 tokens: the whole batch
    assert row_chunk(1, 65536, "cpu") is None  # one row: nothing to cut
    assert row_chunk(4, 256, "cpu") is None   # one step would hold the whole batch
    for platform in ("gpu", "tpu"):
        assert row_chunk(8, 1024, platform) is None


def _chapter_layer(B, T):
    import flax_attn as fa

    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((B, T, 16)))
    layer = fa.MultiHeadAttention(16, 16, T, 0.0, 2, param_dtype=jnp.float64)
    return layer, layer.init(jax.random.key(0), x, deterministic=True), x


def _row_loops(closed_jaxpr):
    """Trip counts of the loops over rows: the scans of the top-level ``by_row_chunks`` calls."""
    return [inner.params["length"] for eqn in closed_jaxpr.jaxpr.eqns
            if eqn.primitive.name == "custom_jvp_call" and "by_row_chunks" in str(eqn.source_info.name_stack)
            for inner in eqn.params["call_jaxpr"].jaxpr.eqns if inner.primitive.name == "scan"]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="rows are chunked on CPU only")
def test_by_row_chunks_runs_a_loop_forward_and_the_whole_batch_when_differentiated():
    """The chapter's layer at 8 x 512 tokens (two rows a step) against the same layer with the
    loop turned off: equal outputs, forward- and reverse-mode derivatives; the loop appears in
    the undifferentiated program only, the derivatives' programs are the whole batch's."""
    from flax_attn.layers import common

    layer, params, x = _chapter_layer(8, 512)
    tangents = (jax.tree.map(jnp.ones_like, params), jnp.cos(x))

    def run():  # new functions each time: JAX caches traces by function
        apply = lambda p, x: layer.apply(p, x, deterministic=True)  # noqa: E731
        loss = lambda p, x: jnp.sum(jnp.sin(apply(p, x)))  # noqa: E731
        jvp = lambda p, x: jax.jvp(apply, (p, x), tangents)  # noqa: E731
        values = (apply(params, x), jax.grad(loss, (0, 1))(params, x), jvp(params, x))
        programs = [jax.jit(f).lower(params, x).as_text() for f in (jax.grad(loss, (0, 1)), jvp)]
        return values, programs, _row_loops(jax.make_jaxpr(apply)(params, x))

    chunked, chunked_programs, loops = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "row_chunk", lambda B, T, platform=None: None)
        whole, whole_programs, whole_loops = run()
    assert loops == [4] and whole_loops == []  # 8 rows, 2 a step
    assert chunked_programs == whole_programs
    for got, want in zip(jax.tree.leaves(chunked), jax.tree.leaves(whole)):
        assert_close(got, want, np.float64, "chunked rows vs the whole batch")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="rows are chunked on CPU only")
@pytest.mark.parametrize("case", ["packed self-attention", "cross-attention", "mask given"])
def test_attention_layer_in_row_chunks_equals_the_whole_batch(case):
    """flax_attn.Attention at 8 x 512 tokens: positions, segment ids and a context are cut by
    rows with the queries (the same outputs as the whole batch, under vmap too); a mask (which
    may broadcast over the batch) keeps the whole batch."""
    import flax_attn as fa
    from flax_attn.layers import common

    B, T = 8, 512
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((B, T, 16)))
    positions = jnp.asarray(np.tile(np.arange(T) % 300, (B, 1)), jnp.int32)  # two packed documents a row
    kwargs = {"positions": positions, "segment_ids": jnp.asarray(np.tile(np.arange(T) >= 300, (B, 1)), jnp.int32)}
    config = dict(d_model=16, num_heads=4, num_kv_heads=2, position="rope", causal=True)
    if case == "cross-attention":
        config["causal"] = False
        kwargs = {"positions": positions, "context": jnp.asarray(rng.standard_normal((B, 384, 16))),
                  "context_positions": jnp.broadcast_to(jnp.arange(384, dtype=jnp.int32), (B, 384))}
    if case == "mask given":
        kwargs["mask"] = jnp.asarray(rng.random((1, 1, T, T)) < 0.9)
    layer = fa.Attention(fa.AttentionConfig(**config), param_dtype=jnp.float64)
    params = layer.init(jax.random.key(1), x, **kwargs)

    def run():
        apply = lambda p, x: layer.apply(p, x, **kwargs)  # noqa: E731
        return apply(params, x), jax.vmap(apply, (None, 0))(params, jnp.stack([x, -x])), \
            _row_loops(jax.make_jaxpr(apply)(params, x))

    out, mapped, loops = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "row_chunk", lambda B, T, platform=None: None)
        whole, whole_mapped, _ = run()
    assert loops == ([] if case == "mask given" else [4])  # 2 rows a step
    assert_close(out, whole, np.float64, case)
    assert_close(mapped, whole_mapped, np.float64, f"{case}, vmapped")


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="rows are chunked on CPU only")
@pytest.mark.parametrize("absorb", [False, True])
def test_latent_attention_in_row_chunks_equals_the_whole_batch(absorb):
    """flax_attn.MultiHeadLatentAttention at 8 x 512 tokens with packed documents: in chunks
    of two rows, the whole batch's outputs."""
    import flax_attn as fa
    from flax_attn.layers import common

    B, T = 8, 512
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((B, T, 16)))
    positions = jnp.asarray(np.tile(np.arange(T) % 300, (B, 1)), jnp.int32)
    segments = jnp.asarray(np.tile(np.arange(T) >= 300, (B, 1)), jnp.int32)
    layer = fa.MultiHeadLatentAttention(fa.MLAConfig(d_model=16, num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4,
                                                     qk_rope_head_dim=2, v_head_dim=4, q_lora_rank=6, absorb=absorb),
                                        param_dtype=jnp.float64)
    params = layer.init(jax.random.key(2), x, positions, segments)

    def run():
        apply = lambda p, x: layer.apply(p, x, positions, segments)  # noqa: E731
        return apply(params, x), _row_loops(jax.make_jaxpr(apply)(params, x))

    out, loops = run()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(common, "row_chunk", lambda B, T, platform=None: None)
        whole, _ = run()
    assert loops == [4]
    assert_close(out, whole, np.float64, "latent attention")


def _chapter(m):
    """(init, apply) of a chapter layer without dropout."""
    return (lambda key, x: m.init(key, x, deterministic=True)), (lambda p, x: m.apply(p, x, deterministic=True))


EXPORT_LAYERS = {
    "Attention gqa-rope-window-qknorm": lambda fa: fa.Attention(fa.AttentionConfig(
        d_model=32, num_heads=4, num_kv_heads=2, position="rope", sliding_window=3, qk_norm=True)),
    "Attention alibi-softcap-sinks": lambda fa: fa.Attention(fa.AttentionConfig(
        d_model=32, num_heads=4, position="alibi", logit_softcap=20.0, sinks=True)),
    "MLA": lambda fa: fa.MultiHeadLatentAttention(fa.MLAConfig(
        d_model=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
    "MLA absorbed": lambda fa: fa.MultiHeadLatentAttention(fa.MLAConfig(
        d_model=32, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, absorb=True)),
    "chapter MultiHeadAttention": lambda fa: fa.MultiHeadAttention(32, 32, 16, 0.0, 4),
}


@pytest.mark.parametrize("bounded", [False, True], ids=["unbounded", "bounded"])
@pytest.mark.parametrize("name", list(EXPORT_LAYERS))
def test_layers_export_with_symbolic_batch_and_length(name, bounded):
    """``jax.export`` of a layer's output and gradients with the batch and the length symbolic
    (unbounded, and bounded below every size threshold the layers and the core decide by:
    the loops over rows or heads, the projections' form, the automatic choice). Run at 3 x 5
    tokens, it equals the jitted layer at those shapes. The chapter's layers, whose length is
    bounded by ``context_length``, refuse an unbounded one with a ValueError saying how to bound
    it."""
    import flax_attn as fa

    module = EXPORT_LAYERS[name](fa)
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((3, 5, 32)))
    positions = jnp.broadcast_to(jnp.arange(5), (3, 5))
    chapter = name.startswith("chapter")
    if chapter:
        init, apply = _chapter(module)
        args, specs_of = (x,), lambda b, t: (jax.ShapeDtypeStruct((b, t, 32), x.dtype),)
    else:
        init, apply = (lambda key, x, pos: module.init(key, x, pos)), module.apply
        args = (x, positions)
        specs_of = lambda b, t: (jax.ShapeDtypeStruct((b, t, 32), x.dtype),  # noqa: E731
                                 jax.ShapeDtypeStruct((b, t), positions.dtype))
    params = init(jax.random.key(0), *args)
    program = jax.jit(lambda p, x, *rest: jax.value_and_grad(lambda p, x: jnp.sum(apply(p, x, *rest) ** 2),
                                                              argnums=(0, 1))(p, x))
    b, t = jax.export.symbolic_shape("b, t", constraints=("b <= 8", "t <= 16") if bounded else ())
    if chapter and not bounded:
        with pytest.raises(ValueError, match=r"symbolic number of tokens t .* context_length=16.*constraints"):
            jax.export.export(program)(params, *specs_of(b, t))
        return
    exported = jax.export.export(program)(params, *specs_of(b, t))
    got, want = exported.call(params, *args), program(params, *args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, np.float64, name)
