"""Context parallelism (flax_attn.parallel.ring) held to one device's flax_attn.dot_product_attention.

A child process with 8 virtual CPU devices runs ring and all-gather attention over a mesh axis,
under jax.jit, for causal masks, windows, GQA/MQA, segment ids, lengths, explicit positions
(T != S), zig-zag and striped load balancing, a bias with a dense mask and soft-cap (and the
log-sum-exp with its gradient), and batch x sequence x heads on a 3-D mesh; it measures outputs
and gradients (query, key, value, bias) against the single-device function (max|a - b| / max|b|;
tolerances float64 1e-12, float32 1e-5). It also shows that key blocks the mask empties are
skipped (NaN values there never reach the output, where masking them would), that the layers
take the ring as ``implementation=``, and that the ring's backward needs memory linear in the
local length (XLA's memory analysis of the compiled gradient).
"""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

TOL = {"float64": 1e-12, "float32": 1e-5}

# name: (mesh shape, mesh axes, context-parallel fields, T, S, N, K, balance, features)
CASES = {
    "causal-gqa-8dev": ((8,), ("seq",), dict(block_q=4, block_k=4), 64, 64, 4, 2, None, "causal"),
    "window2-segments-lengths": ((4,), ("seq",), dict(block_q=6, block_k=5), 64, 64, 4, 4, None,
                                 "window2 segments lengths"),
    "cross-positions-mqa": ((4,), ("seq",), dict(block_q=8, block_k=8), 32, 64, 4, 1, None, "causal window positions"),
    "zigzag-causal-window-segments": ((8,), ("seq",), dict(block_q=4, block_k=4), 64, 64, 4, 2, "zigzag",
                                      "causal window segments"),
    "striped-causal": ((4,), ("seq",), dict(block_q=8, block_k=8), 64, 64, 4, 2, "striped", "causal"),
    "bias-mask-softcap-lse": ((4,), ("seq",), dict(block_q=8, block_k=8), 64, 64, 4, 2, None,
                              "causal bias mask softcap lse"),
    "data-seq-model-3d-mesh": ((2, 2, 2), ("data", "seq", "model"),
                               dict(batch_axis="data", head_axis="model", block_q=8, block_k=8), 64, 64, 4, 2, None,
                               "causal"),
}
FLOAT32 = ("causal-gqa-8dev", "zigzag-causal-window-segments")
RUNS = [(c, m, d) for c in CASES for m in ("ring", "allgather") for d in ("float64",)] + \
       [(c, m, "float32") for c in FLOAT32 for m in ("ring", "allgather")]

pytestmark = pytest.mark.slow  # a child process with 8 virtual devices


# ------------------------------------------------------------------------------------ child


def _measure_case(name, method, dtype):
    import jax
    import jax.numpy as jnp

    import flax_attn as fa
    from flax_attn import parallel as fp
    from torch_ref.compare import max_rel_error

    shape, axes, fields, T, S, N, K, balance, features = CASES[name]
    features = features.split()
    mesh = jax.make_mesh(shape, axes)
    P = mesh.shape["seq"]
    B, H = 2, 8
    rng = np.random.default_rng(0)
    a = lambda *s: rng.standard_normal(s).astype(dtype)
    q, k, v = a(B, T, N, H), a(B, S, K, H), a(B, S, K, H)
    bias = a(1, N, T, S) if "bias" in features else None
    kw = {}
    if "causal" in features:
        kw["is_causal"] = True
    if "window" in features:
        kw["local_window_size"] = (20, 0)
    if "window2" in features:
        kw["local_window_size"] = (5, 11)
    seg_q = np.repeat([[0, 1, 2], [0, 0, 1]], [T // 4, T // 2, T - T // 4 - T // 2], axis=1).astype(np.int32)
    seg_k = np.repeat([[0, 1, 2], [0, 0, 1]], [S // 4, S // 2, S - S // 4 - S // 2], axis=1).astype(np.int32)
    if "lengths" in features:
        kw["query_seq_lengths"] = np.array([T, T - 21], np.int32)
        kw["key_value_seq_lengths"] = np.array([S - 9, S], np.int32)
    if "positions" in features:  # the queries are the last T of the S keys, given explicitly, per row
        kw["query_positions"] = np.stack([np.arange(S - T, S), np.arange(S - T, S) + 3]).astype(np.int32)
        kw["key_positions"] = np.stack([np.arange(S), np.arange(S)]).astype(np.int32)
    if "mask" in features:
        kw["mask"] = rng.random((B, 1, T, S)) < 0.7
    if "softcap" in features:
        kw["logit_softcap"] = 2.0
    lse = "lse" in features
    if lse:
        kw["return_residual"] = True
    impl = fp.context_parallel(mesh, "seq", method, **fields)

    def attend(q, k, v, bias, implementation):
        extra = dict(kw)
        if "segments" in features:
            extra.update(query_segment_ids=seg_q, key_segment_ids=seg_k)
        if balance is None or implementation is None:
            return fa.dot_product_attention(q, k, v, bias, implementation=implementation, **extra)
        # reorder tokens, positions and segment ids; pass positions explicitly; restore the order
        order = lambda x: fp.load_balance(x, P, scheme=balance)
        pos = order(np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)))
        extra.update(query_positions=pos, key_positions=pos)
        if "segments" in features:
            extra.update(query_segment_ids=order(seg_q), key_segment_ids=order(seg_k))
        out = fa.dot_product_attention(order(q), order(k), order(v), bias, implementation=implementation, **extra)
        return fp.restore_order(out, P, scheme=balance)

    cot = a(B, T, N, H)

    def loss(q, k, v, bias, implementation):
        res = attend(q, k, v, bias, implementation)
        out, lse_ = res if lse else (res, None)
        total = jnp.sum(jnp.sin(out) * cot)
        if lse:
            total = total + jnp.sum(jnp.where(jnp.isfinite(lse_), lse_, 0.0) * cot[..., 0])
        return total, res

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    run = lambda implementation: jax.jit(jax.value_and_grad(loss, argnums, has_aux=True),
                                         static_argnums=4)(q, k, v, bias, implementation)
    (_, res), grads = run(impl)
    (_, ref), ref_grads = run(None)  # one device: the pytest-free reference
    outs, refs = (res, ref) if lse else ((res,), (ref,))
    errors = {"out": max_rel_error(outs[0], refs[0])}
    if lse:
        finite = np.isfinite(np.asarray(refs[1]))
        errors["lse"] = max_rel_error(np.where(finite, outs[1], 0), np.where(finite, refs[1], 0))
        errors["lse_inf_same"] = bool(np.array_equal(finite, np.isfinite(np.asarray(outs[1]))))
    for what, g, r in zip(("d_query", "d_key", "d_value", "d_bias"), grads, ref_grads):
        errors[what] = max_rel_error(g, r)
    errors["out_sharding"] = str(getattr(outs[0].sharding, "spec", ""))
    return errors


def _measure_skipping():
    """Key blocks whose segment no query has hold NaN values: skipped (EMPTY) blocks never touch
    them; a masked block would give 0 * NaN = NaN (as the plain path does)."""
    import jax

    import flax_attn as fa
    from flax_attn import parallel as fp
    from torch_ref.compare import max_rel_error

    mesh = jax.make_mesh((4,), ("seq",))
    B, T, N, H = 2, 64, 4, 8
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((B, T, N, H)) for _ in range(3))
    seg_q = np.zeros((B, T), np.int32)
    result = {}
    for level, start in (("ring step (a whole device's block)", 48), ("sub-block inside a device's block", 56)):
        seg_k = np.zeros((B, T), np.int32)
        seg_k[:, start:] = 5                      # no query is in segment 5
        poisoned = v.copy()
        poisoned[:, start:] = np.nan
        clean = v.copy()
        clean[:, start:] = 0.0
        kw = dict(is_causal=False, query_segment_ids=seg_q, key_segment_ids=seg_k)
        ring = fp.ring_attention(q, k, poisoned, mesh=mesh, axis_name="seq", block_q=8, block_k=8, **kw)
        ref = fa.dot_product_attention(q, k, clean, implementation="xla", **kw)
        plain = fa.dot_product_attention(q, k, poisoned, implementation="xla", **kw)
        grad = jax.grad(lambda v: fp.ring_attention(q, k, v, mesh=mesh, axis_name="seq", block_q=8, block_k=8,
                                                    **kw).sum())(poisoned)
        result[level] = {"finite": bool(np.isfinite(np.asarray(ring)).all()),
                         "error": max_rel_error(ring, ref),
                         "plain_path_is_nan": bool(np.isnan(np.asarray(plain)).any()),
                         "grad_finite": bool(np.isfinite(np.asarray(grad)).all())}
    return result


def _measure_layers():
    """fa.Attention (zig-zag, GQA, RoPE, sliding window) and the chapter's MultiHeadAttention with
    implementation=context_parallel(...), under jit with x split along the sequence, against the
    same layers on one device: outputs, d x and every parameter gradient."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp
    from torch_ref.compare import max_rel_error

    mesh = jax.make_mesh((8,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    B, T, D = 2, 64, 32
    rng = np.random.default_rng(2)
    x = rng.standard_normal((B, T, D))
    results = {}
    for method in ("ring", "allgather"):
        impl = fp.context_parallel(mesh, "seq", method, block_q=4, block_k=4)
        config = fa.AttentionConfig(d_model=D, num_heads=4, num_kv_heads=2, position="rope", sliding_window=24,
                                    qkv_bias=True)
        for name, layer, one in (
                ("Attention zigzag", fa.Attention(config, param_dtype=jnp.float64, implementation=impl),
                 fa.Attention(config, param_dtype=jnp.float64)),
                ("MultiHeadAttention", fa.MultiHeadAttention(D, D, T, 0.0, 4, param_dtype=jnp.float64,
                                                             implementation=impl),
                 fa.MultiHeadAttention(D, D, T, 0.0, 4, param_dtype=jnp.float64))):
            pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
            if name.startswith("Attention"):
                params = one.init(jax.random.key(0), x, pos)

                def apply_cp(p, x, layer=layer):
                    xs = jax.lax.with_sharding_constraint(fp.load_balance(x, 8), NamedSharding(mesh, P(None, "seq")))
                    return fp.restore_order(layer.apply(p, xs, fp.load_balance(pos, 8)), 8)

                apply_one = lambda p, x, one=one: one.apply(p, x, pos)
            else:
                params = one.init(jax.random.key(0), x, deterministic=True)

                def apply_cp(p, x, layer=layer):
                    xs = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "seq")))
                    return layer.apply(p, xs, deterministic=True)

                apply_one = lambda p, x, one=one: one.apply(p, x, deterministic=True)
            grad = lambda f: jax.jit(jax.value_and_grad(lambda p, x: (jnp.sum(jnp.sin(f(p, x))), f(p, x)),
                                                        (0, 1), has_aux=True))
            (_, y), g = grad(apply_cp)(params, x)
            (_, y0), g0 = grad(apply_one)(params, x)
            flat, flat0 = jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g0)
            scale = max(float(np.max(np.abs(r))) for r in flat0)
            grad_err = max(max_rel_error(gi, ri) if np.max(np.abs(ri)) > 1e-12 * scale
                           else float(np.max(np.abs(np.asarray(gi) - ri)) / scale) for gi, ri in zip(flat, flat0))
            results[f"{name} / {method}"] = {"out": max_rel_error(y, y0), "grads": grad_err}
    return results


def _measure_memory():
    """XLA's memory analysis (per device) of the compiled gradient of causal attention over 4
    devices at local lengths L, 2L, 4L: the ring (fixed 32 x 32 sub-blocks) against the
    all-gather with the plain core (T/P x S logits) as a control."""
    import jax
    import jax.numpy as jnp

    import flax_attn as fa
    from flax_attn import parallel as fp

    mesh = jax.make_mesh((4,), ("seq",))
    out = {}
    for label, impl in (("ring", fp.context_parallel(mesh, "seq", "ring", block_q=32, block_k=32)),
                        ("allgather-xla", fp.context_parallel(mesh, "seq", "allgather", inner="xla"))):
        sizes = {}
        for local in (64, 128, 256):
            s = jax.ShapeDtypeStruct((1, 4 * local, 2, 16), jnp.float32)
            loss = lambda q, k, v: jnp.sum(fa.dot_product_attention(q, k, v, is_causal=True, implementation=impl))
            stats = jax.jit(jax.grad(loss, (0, 1, 2))).lower(s, s, s).compile().memory_analysis()
            sizes[local] = int(stats.temp_size_in_bytes)
        out[label] = sizes
    return out


def _measure_volume():
    """Bytes one device sends (flax_attn.parallel.bytes_sent) for ring and all-gather attention
    over 4 devices, forward and forward+backward, without and with a causal mask."""
    import jax
    import jax.numpy as jnp

    import flax_attn as fa
    from flax_attn import parallel as fp

    mesh = jax.make_mesh((4,), ("seq",))
    q = jax.ShapeDtypeStruct((1, 4 * VOLUME_L, 4, VOLUME_H), jnp.float32)
    k = jax.ShapeDtypeStruct((1, 4 * VOLUME_L, VOLUME_K, VOLUME_H), jnp.float32)
    out = {}
    for method in ("ring", "allgather"):
        for causal in (False, True):
            impl = fp.context_parallel(mesh, "seq", method, block_q=8, block_k=8)
            f = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=causal, implementation=impl)
            g = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2))
            out[f"{method} causal={causal}"] = {"forward": fp.bytes_sent(f, q, k, k, axis_size=4),
                                                "backward": fp.bytes_sent(g, q, k, k, axis_size=4)}
    return out


VOLUME_L, VOLUME_K, VOLUME_H = 32, 2, 16  # local length, key/value heads, head size (float32)


def child(part):
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    if part == "parity":
        return {f"{c}|{m}|{d}": _measure_case(c, m, d) for c, m, d in RUNS}
    return {"skipping": _measure_skipping(), "layers": _measure_layers(), "memory": _measure_memory(),
            "volume": _measure_volume()}


# ------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def parity():
    from . import run_child

    return run_child(__file__, "parity")


@pytest.fixture(scope="module")
def other():
    from . import run_child

    return run_child(__file__, "other")


@pytest.mark.parametrize("case, method, dtype", RUNS, ids=["-".join(r) for r in RUNS])
def test_matches_one_device(parity, case, method, dtype):
    errors = parity[f"{case}|{method}|{dtype}"]
    tol = TOL[dtype]
    measured = {k: v for k, v in errors.items() if isinstance(v, float)}
    assert {"out", "d_query", "d_key", "d_value"} <= set(measured)
    bad = {k: v for k, v in measured.items() if not v <= tol}
    assert not bad, f"{case} {method} {dtype}: errors above {tol:.0e}: {bad}"
    if "lse_inf_same" in errors:
        assert errors["lse_inf_same"], "the log-sum-exp is -inf at other queries than one device's"
    if CASES[case][7] is None:  # (a reordered output is gathered back by restore_order)
        # the output comes back split like the query: its sequence dimension over 'seq'
        assert "'seq'" in errors["out_sharding"], errors["out_sharding"]


@pytest.mark.parametrize("level", ["ring step (a whole device's block)", "sub-block inside a device's block"])
def test_empty_blocks_are_skipped_not_masked(other, level):
    r = other["skipping"][level]
    assert r["plain_path_is_nan"], "control: masking (not skipping) the poisoned keys gives NaN"
    assert r["finite"] and r["grad_finite"], f"{level}: NaN values of an empty key block reached the result"
    assert r["error"] <= TOL["float64"], r


@pytest.mark.parametrize("name", ["Attention zigzag / ring", "Attention zigzag / allgather",
                                  "MultiHeadAttention / ring", "MultiHeadAttention / allgather"])
def test_layers_take_context_parallel_as_implementation(other, name):
    r = other["layers"][name]
    assert r["out"] <= TOL["float64"] and r["grads"] <= TOL["float64"], r


def test_ring_backward_memory_is_linear_in_the_local_length(other):
    ring, control = other["memory"]["ring"], other["memory"]["allgather-xla"]
    growth = lambda m: (m["256"] - m["128"]) / (m["128"] - m["64"])  # 2 if linear, 4 if quadratic
    assert 1.5 <= growth(ring) <= 2.5, ring
    assert growth(control) >= 3.0, control  # the measure sees quadratic memory where there is some
    assert ring["256"] < control["256"] / 4, (ring, control)


@pytest.mark.parametrize("causal", [False, True])
def test_communication_is_what_the_ring_should_send(other, causal):
    """Counted in the traced program, a device of a ring of P = 4 sends P - 1 key/value blocks
    forward (with their key positions when causal), and backward those again plus P float32
    dK/dV blocks (the last one brings them home); the all-gather sends its block to P - 1
    devices and reduce-scatters the full dK/dV: the figures of the README's cluster table."""
    P, L, K, H = 4, VOLUME_L, VOLUME_K, VOLUME_H
    kv = 2 * L * K * H * 4 + (L * 4 if causal else 0)   # K and V blocks (+ int32 key positions)
    dkdv = 2 * L * K * H * 4
    ring = other["volume"][f"ring causal={causal}"]
    assert ring["forward"] == {"ppermute": (P - 1) * kv}
    assert ring["backward"] == {"ppermute": 2 * (P - 1) * kv + P * dkdv}
    gather = other["volume"][f"allgather causal={causal}"]
    assert gather["forward"] == {"all_gather": (P - 1) * kv}
    assert gather["backward"] == {"all_gather": (P - 1) * kv, "reduce_scatter": (P - 1) / P * (P * dkdv)}


def test_bytes_sent_refuses_a_bad_axis_size():
    from flax_attn import parallel as fp

    with pytest.raises(ValueError, match="axis_size must be a positive int, got 0"):
        fp.bytes_sent(lambda x: x, np.zeros(2), axis_size=0)


# errors: checked on an abstract mesh in this process (no devices needed to trace the checks)


def _abstract(shape=(8,), names=("seq",)):
    import jax

    return jax.sharding.AbstractMesh(shape, names)


def test_length_not_divisible_names_argument_and_shapes():
    import flax_attn as fa
    from flax_attn import parallel as fp

    q = np.zeros((2, 60, 4, 8))
    with pytest.raises(ValueError, match=r"query \(B, T, N, H\) = \(2, 60, 4, 8\): its length T=60 is not divisible "
                                         r"by the 8 devices of mesh axis 'seq'"):
        fa.dot_product_attention(q, q, q, implementation=fp.context_parallel(_abstract(), "seq"))
    k = np.zeros((2, 36, 4, 8))
    with pytest.raises(ValueError, match=r"key \(B, S, K, H\) = \(2, 36, 4, 8\): its length S=36"):
        fp.all_gather_attention(np.zeros((2, 64, 4, 8)), k, k, mesh=_abstract(), axis_name="seq")


def test_other_refusals_say_why():
    import flax_attn as fa
    from flax_attn import parallel as fp

    q = np.zeros((2, 64, 4, 8))
    k = np.zeros((2, 64, 2, 8))
    with pytest.raises(ValueError, match="without a mesh"):
        fa.dot_product_attention(q, k, k, implementation=fp.ContextParallel())
    with pytest.raises(ValueError, match="dropout"):
        fa.dot_product_attention(q, k, k, dropout_rate=0.1, dropout_rng=np.zeros(2, np.uint32),
                                 implementation=fp.context_parallel(_abstract()))
    with pytest.raises(ValueError, match="return_weights with method='ring'"):
        fa.dot_product_attention(q, k, k, return_weights=True, implementation=fp.context_parallel(_abstract()))
    with pytest.raises(ValueError, match=r"heads N=4 and K=2 must both be divisible by the 4 devices of mesh "
                                         r"axis 'model'"):
        fp.ring_attention(q, k, k, mesh=_abstract((2, 4), ("seq", "model")), axis_name="seq", head_axis="model")
    with pytest.raises(ValueError, match=r"axis_name='sequence': the mesh has axes \('seq',\)"):
        fp.ring_attention(q, k, k, mesh=_abstract(), axis_name="sequence")
    with pytest.raises(ValueError, match="method must be one of"):
        fp.context_parallel(_abstract(), "seq", "ulysses")
    for rule in ({"mask": fa.masks.chunked(8)}, {"mask": fa.masks.mask_mod(lambda b, n, i, j: i >= j)},
                 {"score_mod": lambda s, b, n, i, j: s}):
        with pytest.raises(ValueError, match="chunked attention, a mask_mod or a score_mod"):
            fa.dot_product_attention(q, k, k, implementation=fp.context_parallel(_abstract()), **rule)


def test_ambient_mesh_is_used_when_none_is_stored():
    import jax

    import flax_attn as fa
    from flax_attn import parallel as fp

    q = np.zeros((2, 60, 4, 8))
    impl = fp.context_parallel(None, "seq")
    with jax.sharding.use_abstract_mesh(_abstract()):
        assert impl.resolved_mesh().shape["seq"] == 8
        with pytest.raises(ValueError, match="T=60 is not divisible by the 8 devices"):
            jax.eval_shape(lambda q: fa.dot_product_attention(q, q, q, implementation=impl), q)
    assert impl.resolved_mesh() is None
    hash(fp.context_parallel(_abstract(), "seq"))  # hashable: usable as a static jit argument / module field


if __name__ == "__main__" and "--child" in sys.argv:
    print(json.dumps(child(sys.argv[-1])))
