"""Sharded layers (flax_attn.parallel.sharding) held to one device.

A child process with 8 virtual CPU devices (mesh 2 x 4: 'data' x 'model') shards every flax_attn
Linen module's parameters by :func:`partition_specs` (heads over 'model') and its inputs over the
batch ('data'), runs it under jax.jit, and measures outputs and gradients (to the inputs and every
parameter) against the same module on one device (max|a - b| / max|b|; a gradient that is zero
analytically, like a key bias's, against the largest parameter gradient). It records how each
parameter was split (the shape of one device's shard). A sharded KV cache (batch over 'data',
key/value heads over 'model') decodes greedily and must give one device's tokens and outputs.
"""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

TOL = {"float64": 1e-12, "float32": 1e-5}
MODULES = ["Attention gqa-rope-window-qknorm-biases-packed", "Attention t5 kv-replicated", "Attention fsdp",
           "MultiHeadAttention", "TransformerMultiHeadAttention cross-masked", "SelfAttention_v1", "SelfAttention_v2",
           "CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadLatentAttention qlora-bias",
           "MultiHeadLatentAttention absorbed"]
RUNS = [(m, "float64") for m in MODULES] + [(MODULES[0], "float32"), ("MultiHeadAttention", "float32")]

pytestmark = pytest.mark.slow  # a child process with 8 virtual devices


# ------------------------------------------------------------------------------------ child


def _module(name, dtype):
    """(module, inputs (positional), batch-split flags, kwargs) for one module."""
    import jax.numpy as jnp

    import flax_attn as fa

    pd = jnp.dtype(dtype)
    rng = np.random.default_rng(0)
    B, T, D = 4, 16, 64
    x = rng.standard_normal((B, T, D)).astype(dtype)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    seg = np.repeat([[0, 1], [0, 0], [2, 3], [1, -1]], [10, 6], axis=1).astype(np.int32)
    if name.startswith("Attention gqa") or name == "Attention fsdp":
        c = fa.AttentionConfig(d_model=D, num_heads=8, num_kv_heads=4, position="rope", sliding_window=12,
                               qk_norm=True, qkv_bias=True, out_bias=True)
        return fa.Attention(c, param_dtype=pd), (x, pos, seg), {}
    if name.startswith("Attention t5"):
        c = fa.AttentionConfig(d_model=D, num_heads=8, num_kv_heads=2, position="t5", causal=False)
        return fa.Attention(c, param_dtype=pd), (x, pos), {}
    if name.startswith("MultiHeadLatentAttention"):
        qlora = name.endswith("qlora-bias")
        c = fa.MLAConfig(d_model=D, num_heads=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                         v_head_dim=8, q_lora_rank=16 if qlora else None, attention_bias=qlora, absorb=not qlora)
        return fa.MultiHeadLatentAttention(c, param_dtype=pd), (x, pos), {}
    if name == "MultiHeadAttention":
        return fa.MultiHeadAttention(32, D, T, 0.0, 8, qkv_bias=True, param_dtype=pd), (x[..., :32],), \
            {"deterministic": True}
    if name.startswith("TransformerMultiHeadAttention"):
        ctx = rng.standard_normal((B, 12, D)).astype(dtype)
        mask = rng.random((B, 1, T, 12)) < 0.8
        return fa.TransformerMultiHeadAttention(D, 8, param_dtype=pd), (x, ctx, ctx, mask), {}
    small = x[..., :32]
    if name == "SelfAttention_v1":
        return fa.SelfAttention_v1(32, 16, param_dtype=pd), (small,), {}
    if name == "SelfAttention_v2":
        return fa.SelfAttention_v2(32, 16, qkv_bias=True, param_dtype=pd), (small,), {}
    if name == "CausalAttention":
        return fa.CausalAttention(32, 16, T, 0.0, param_dtype=pd), (small,), {"deterministic": True}
    if name == "MultiHeadAttentionWrapper":
        return fa.MultiHeadAttentionWrapper(32, 8, T, 0.0, 4, param_dtype=pd), (small,), {"deterministic": True}
    raise ValueError(name)


def _grad_error(grads, refs, tol):
    """Worst relative error over a tree; a reference gradient that is zero analytically (at most
    ``tol`` times the largest, e.g. a key bias's: it shifts whole rows of logits) is measured
    against the largest gradient instead, as torch_ref.compare does."""
    import jax

    from torch_ref.compare import max_rel_error

    flat, flat0 = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(refs)
    assert len(flat) == len(flat0)
    scale = max(float(np.max(np.abs(np.asarray(r)))) for r in flat0)
    errs = [max_rel_error(g, r) if np.max(np.abs(np.asarray(r))) > tol * scale
            else float(np.max(np.abs(np.asarray(g) - np.asarray(r))) / scale) for g, r in zip(flat, flat0)]
    return max(errs)


def _measure_module(name, dtype):
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    from flax_attn import parallel as fp
    from torch_ref.compare import max_rel_error

    mesh = fp.make_mesh((2, 4), ("data", "model"))
    module, inputs, kwargs = _module(name, dtype)
    variables = module.init(jax.random.key(0), *inputs, **kwargs)
    specs = fp.partition_specs(module, variables, mesh=mesh, fsdp=name.endswith("fsdp"))
    sharded = fp.shard_params(variables, specs, mesh)
    sharded_inputs = fp.shard_batch(inputs, mesh)
    rng = np.random.default_rng(1)
    out_shape = jax.eval_shape(lambda v, *a: module.apply(v, *a, **kwargs), variables, *inputs)
    cots = jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), out_shape)
    floats = tuple(i for i, a in enumerate(inputs) if np.issubdtype(np.asarray(a).dtype, np.floating))

    def loss(v, *args):
        out = module.apply(v, *args, **kwargs)
        total = sum(jnp.sum(jnp.sin(o) * c) for o, c in zip(jax.tree_util.tree_leaves(out),
                                                              jax.tree_util.tree_leaves(cots)))
        return total, out

    run = jax.jit(jax.value_and_grad(loss, (0,) + tuple(i + 1 for i in floats), has_aux=True))
    (_, out), grads = run(sharded, *sharded_inputs)
    (_, ref), ref_grads = run(variables, *inputs)  # one device: nothing sharded
    split = {"/".join(k): [list(x.shape), list(x.addressable_shards[0].data.shape)]
             for k, x in traverse_util.flatten_dict(sharded["params"]).items()}
    return {"out": max(max_rel_error(o, r) for o, r in zip(jax.tree_util.tree_leaves(out),
                                                           jax.tree_util.tree_leaves(ref))),
            "params_grads": _grad_error(grads[0], ref_grads[0], TOL[dtype]),
            "inputs_grads": _grad_error(grads[1:], ref_grads[1:], TOL[dtype]),
            "param_grads_sharding": sorted({str(g.sharding.spec) for g in jax.tree_util.tree_leaves(grads[0])}),
            "split": split}


def _measure_cache(layout):
    """Greedy decoding with a sharded KV cache against one device: prefill 8 tokens, 6 steps.
    ``layout``: a KVCache layout, or 'latent' (multi-head latent attention's cache)."""
    import jax
    import jax.numpy as jnp

    import flax_attn as fa
    from flax_attn import parallel as fp
    from torch_ref.compare import max_rel_error

    mesh = fp.make_mesh((2, 4), ("data", "model"))
    B, D, V, prefix, steps = 4, 64, 50, 8, 6
    if layout == "latent":
        config = fa.MLAConfig(d_model=D, num_heads=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                              v_head_dim=8, absorb=True)
        layer = fa.MultiHeadLatentAttention(config, param_dtype=jnp.float64)
    else:
        config = fa.AttentionConfig(d_model=D, num_heads=8, num_kv_heads=4, position="rope", qk_norm=True)
        layer = fa.Attention(config, param_dtype=jnp.float64)
    rng = np.random.default_rng(3)
    table = rng.standard_normal((V, D))                    # token embeddings, tied read-out
    tokens = rng.integers(0, V, (B, prefix))
    variables = layer.init(jax.random.key(0), table[tokens], np.broadcast_to(np.arange(prefix), (B, prefix)))

    def step(variables, cache, tokens, positions):
        y, cache = layer.apply(variables, jnp.asarray(table)[tokens], positions, cache=cache)
        logits = y[:, -1] @ jnp.asarray(table).T
        return jnp.argmax(logits, -1), y, cache

    def decode(variables, cache, place, jitted):
        out, toks = [], []
        nxt, y, cache = jitted(variables, cache, place(tokens), place(np.broadcast_to(np.arange(prefix), (B, prefix))))
        out.append(y)
        for t in range(steps):
            toks.append(nxt)
            nxt, y, cache = jitted(variables, cache, place(nxt[:, None]), place(np.full((B, 1), prefix + t)))
            out.append(y)
        toks.append(nxt)
        return np.stack([np.asarray(t) for t in toks], 1), out, cache

    if layout == "latent":
        cache = config.init_cache(B, 32, dtype=jnp.float64)
    else:
        blocks = {"block": 8} if layout == "blocks" else {}
        cache = config.init_cache(batch=B, max_len=32, dtype=jnp.float64, layout=layout, **blocks)  # 'BSKH': heads split
    one_tokens, one_out, _ = decode(variables, cache, lambda a: a, jax.jit(step))

    cache_specs = fp.cache_partition_specs(cache, data_axis="data", model_axis="model")
    param_specs = fp.partition_specs(layer, variables, mesh=mesh)
    batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    sharded_step = jax.jit(step, out_shardings=(batch, batch, fp.named_shardings(cache_specs, mesh)))
    place = lambda a: jax.device_put(np.asarray(a), batch)
    tokens_, out, final = decode(fp.shard_params(variables, param_specs, mesh),
                                 fp.shard_params(cache, cache_specs, mesh), place, sharded_step)
    keys = final.latent if layout == "latent" else final.key
    return {"same_tokens": bool(np.array_equal(tokens_, one_tokens)),
            "tokens": tokens_.tolist(),
            "out": max(max_rel_error(a, b) for a, b in zip(out, one_out)),
            "cache_key_spec": str(keys.sharding.spec),
            "cache_key_shard": list(keys.addressable_shards[0].data.shape),
            "cache_key_shape": list(keys.shape),
            "cache_positions_spec": str(final.positions.sharding.spec)}


def _measure_decoder():
    """A user's decoder (:func:`_decoder`) split by partition_specs(model, ..., inputs=) over a
    (2, 2, 2) mesh, heads over ('x', 'y'): outputs and gradients against one device."""
    import jax
    import jax.numpy as jnp
    from flax import traverse_util

    import flax_attn as fa
    from flax_attn import parallel as fp
    from torch_ref.compare import max_rel_error

    mesh = fp.make_mesh((2, 2, 2), ("data", "x", "y"))
    config = fa.AttentionConfig(d_model=64, num_heads=8, num_kv_heads=4, position="rope", qkv_bias=True)
    model = _decoder(config)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 16, 64))
    positions = np.broadcast_to(np.arange(16), (4, 16))
    variables = model.init(jax.random.key(0), x, positions)
    specs = fp.partition_specs(model, variables, model_axis=("x", "y"), mesh=mesh, inputs=(x, positions))
    cot = rng.standard_normal(x.shape)
    run = jax.jit(jax.value_and_grad(lambda v, x: jnp.sum(jnp.sin(model.apply(v, x, positions)) * cot), (0, 1)))
    out, grads = run(fp.shard_params(variables, specs, mesh), fp.shard_batch(x, mesh))
    ref, ref_grads = run(variables, x)
    split = {"/".join(k): [list(a.shape), list(a.addressable_shards[0].data.shape)]
             for k, a in traverse_util.flatten_dict(fp.shard_params(variables, specs, mesh)["params"]).items()}
    return {"out": max_rel_error(out, ref), "params_grads": _grad_error(grads[0], ref_grads[0], TOL["float64"]),
            "inputs_grads": _grad_error(grads[1], ref_grads[1], TOL["float64"]),
            "split": {k: v for k, v in split.items() if v[0] != v[1]}}


def _measure_errors():
    import jax

    import flax_attn as fa
    from flax_attn import parallel as fp

    mesh = fp.make_mesh((2, 4), ("data", "model"))
    layer = fa.MultiHeadAttention(32, 30, 16, 0.0, 6)      # 6 heads of 5: 30 features, not divisible by 4
    variables = jax.eval_shape(lambda: layer.init(jax.random.key(0), np.zeros((2, 16, 32)), deterministic=True))
    messages = {}
    try:
        fp.shard_params(variables, fp.partition_specs(layer, variables), mesh)
    except ValueError as e:
        messages["shard_params"] = str(e)
    try:
        fp.partition_specs(layer, variables, mesh=mesh)
    except ValueError as e:
        messages["partition_specs"] = str(e)
    return messages


def _measure_checkpoint():
    """Sharded parameters saved, then restored straight into their shardings (checksums verified
    and not): the bits, and where each array lies."""
    import tempfile

    import jax

    import flax_attn as fa
    from flax_attn import checkpoint
    from flax_attn import parallel as fp
    from flax_attn.interop import param_template

    mesh = fp.make_mesh((2, 4), ("data", "model"))
    layer = fa.Attention(fa.AttentionConfig(d_model=64, num_heads=8, num_kv_heads=2, position="rope"))
    variables = layer.init(jax.random.key(0), np.zeros((2, 8, 64)), np.zeros((2, 8), np.int32))
    specs = fp.partition_specs(layer, variables, mesh=mesh)
    shardings = fp.named_shardings(fp.partition_specs(layer, param_template(layer), mesh=mesh), mesh)
    results = {}
    with tempfile.TemporaryDirectory() as d:
        checkpoint.save(d, 1, layer, fp.shard_params(variables, specs, mesh))
        for verify in (True, False):
            got = checkpoint.restore(d, layer, verify_checksums=verify, shardings=shardings)
            pairs = list(zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(variables)))
            results[f"verify={verify}"] = {
                "bit_exact": all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs),
                "specs": sorted({str(a.sharding.spec) for a, _ in pairs}),
                "placed": all(a.sharding.is_equivalent_to(s, a.ndim)
                              for (a, _), s in zip(pairs, jax.tree_util.tree_leaves(shardings))),
                "k_proj_shard": list(got["params"]["k_proj"]["kernel"].addressable_shards[0].data.shape),
                "q_proj_shard": list(got["params"]["q_proj"]["kernel"].addressable_shards[0].data.shape)}
    return results


def _measure_large_projection():
    """``dense`` on 4,096 rows (the large-product forms) with its inputs sharded over 'data' and
    its kernel over 'model', on a mesh of each axis type, the convolution form forced on:
    outputs and gradients against NumPy's products, and the form the trace took."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from flax_attn.core import tuning
    from flax_attn.layers.common import dense

    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, tuning.LARGE_PROJECTION_ROWS // 4, 16))
    kernel = rng.standard_normal((16, 8))
    ct = rng.standard_normal((4, tuning.LARGE_PROJECTION_ROWS // 4, 8))
    want = {"out": x @ kernel, "d_kernel": np.einsum("btd,bto->do", x, ct), "d_x": ct @ kernel.T}
    results = {}
    with tuning.projections_as("convolution"):
        for kind in (AxisType.Explicit, AxisType.Auto):
            mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))
            xs = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("data")))
            ks = jax.device_put(jnp.asarray(kernel), NamedSharding(mesh, P(None, "model")))
            cts = jax.device_put(jnp.asarray(ct), NamedSharding(mesh, P("data", None, "model")))
            f = lambda k, x: dense({"kernel": k}, x)  # noqa: E731
            with jax.set_mesh(mesh):
                out, pullback = jax.jit(lambda k, x: jax.vjp(f, k, x))(ks, xs)
                d_kernel, d_x = jax.jit(pullback)(cts)
                convolution = "conv_general_dilated" in str(jax.make_jaxpr(f)(ks, xs))
            got = {"out": out, "d_kernel": d_kernel, "d_x": d_x}
            results[str(kind).split(".")[-1]] = {
                "errors": {n: float(np.max(np.abs(np.asarray(got[n]) - want[n])) / np.max(np.abs(want[n])))
                           for n in want},
                "convolution": convolution}
    return results


def child():
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    return {"modules": {f"{m}|{d}": _measure_module(m, d) for m, d in RUNS},
            "cache": {layout: _measure_cache(layout) for layout in CACHE_SPLIT},
            "errors": _measure_errors(), "checkpoint": _measure_checkpoint(), "decoder": _measure_decoder(),
            "large_projection": _measure_large_projection()}


# ------------------------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def measured():
    from . import run_child

    return run_child(__file__)


@pytest.mark.parametrize("name, dtype", RUNS, ids=[f"{m}-{d}" for m, d in RUNS])
def test_sharded_module_matches_one_device(measured, name, dtype):
    r = measured["modules"][f"{name}|{dtype}"]
    tol = TOL[dtype]
    errors = {k: r[k] for k in ("out", "params_grads", "inputs_grads")}
    assert all(v <= tol for v in errors.values()), f"{name} {dtype}: {errors} (tolerance {tol:.0e})"


# (global shape, one device's shard) of the parameters that split; every other one is whole
SPLIT = {
    "Attention gqa-rope-window-qknorm-biases-packed": {
        "q_proj/kernel": [[64, 64], [64, 16]], "q_proj/bias": [[64], [16]], "k_proj/kernel": [[64, 32], [64, 8]],
        "k_proj/bias": [[32], [8]], "v_proj/kernel": [[64, 32], [64, 8]], "v_proj/bias": [[32], [8]],
        "o_proj/kernel": [[64, 64], [16, 64]]},
    # 2 key/value heads cannot split over 4 devices: k_proj and v_proj stay whole
    "Attention t5 kv-replicated": {"q_proj/kernel": [[64, 64], [64, 16]], "o_proj/kernel": [[64, 64], [16, 64]],
                                   "rel_bias/embedding": [[32, 8], [32, 2]]},
    # fsdp: the other dimension over 'data' as well
    "Attention fsdp": {
        "q_proj/kernel": [[64, 64], [32, 16]], "q_proj/bias": [[64], [16]], "k_proj/kernel": [[64, 32], [32, 8]],
        "k_proj/bias": [[32], [8]], "v_proj/kernel": [[64, 32], [32, 8]], "v_proj/bias": [[32], [8]],
        "o_proj/kernel": [[64, 64], [16, 32]]},
    "MultiHeadAttention": {
        "W_query/kernel": [[32, 64], [32, 16]], "W_query/bias": [[64], [16]], "W_key/kernel": [[32, 64], [32, 16]],
        "W_key/bias": [[64], [16]], "W_value/kernel": [[32, 64], [32, 16]], "W_value/bias": [[64], [16]],
        "out_proj/kernel": [[64, 64], [16, 64]]},
    # the heads' projections split, the latent ones (q_a_proj, kv_a_proj_with_mqa) whole
    "MultiHeadLatentAttention qlora-bias": {
        "q_b_proj/kernel": [[16, 96], [16, 24]], "kv_b_proj/kernel": [[16, 128], [16, 32]],
        "o_proj/kernel": [[64, 64], [16, 64]]},
    "MultiHeadLatentAttention absorbed": {
        "q_proj/kernel": [[64, 96], [64, 24]], "kv_b_proj/kernel": [[16, 128], [16, 32]],
        "o_proj/kernel": [[64, 64], [16, 64]]},
    "TransformerMultiHeadAttention cross-masked": {
        "W_q/kernel": [[64, 64], [64, 16]], "W_q/bias": [[64], [16]], "W_k/kernel": [[64, 64], [64, 16]],
        "W_k/bias": [[64], [16]], "W_v/kernel": [[64, 64], [64, 16]], "W_v/bias": [[64], [16]],
        "W_o/kernel": [[64, 64], [16, 64]]},
}


@pytest.mark.parametrize("name", MODULES)
def test_parameters_are_split_by_heads(measured, name):
    split = measured["modules"][f"{name}|float64"]["split"]
    expected = SPLIT.get(name, {})
    actually_split = {k: v for k, v in split.items() if v[0] != v[1]}
    assert actually_split == expected
    assert len(split) > len(expected) or not expected  # the rest exist and stay whole


def test_gradients_come_back_split_like_the_parameters(measured):
    specs = measured["modules"][f"{MODULES[0]}|float64"]["param_grads_sharding"]
    assert "PartitionSpec(None, 'model')" in specs or "P(None, 'model')" in specs, specs


# each cache layout's keys: (spec, global shape, one device's shard); batch 4 over 'data' (2 devices),
# for 'BSKH' the 4 key/value heads over 'model' (4 devices); the 32 slots whole
CACHE_SPLIT = {
    "BSKH": ("P('data', None, 'model', None)", [4, 32, 4, 8], [2, 32, 1, 8]),
    "BKSH": ("P('data', None, None)", [16, 32, 8], [8, 32, 8]),                 # (B*K, S, H)
    "blocks": ("P(None, 'data', None, None)", [4, 16, 8, 8], [4, 8, 8, 8]),     # (S // 8, B*K, 8, H)
    "latent": ("P('data', None, None)", [4, 32, 20], [2, 32, 20]),             # (B, S, r_kv + d_r)
}


@pytest.mark.parametrize("layout", list(CACHE_SPLIT))
def test_sharded_kv_cache_decodes_the_same_tokens(measured, layout):
    r = measured["cache"][layout]
    assert r["same_tokens"], r["tokens"]
    assert r["out"] <= TOL["float64"], r["out"]
    spec, shape, shard = CACHE_SPLIT[layout]
    assert r["cache_key_spec"].replace("PartitionSpec", "P") == spec
    assert r["cache_key_shape"] == shape and r["cache_key_shard"] == shard
    assert r["cache_positions_spec"].replace("PartitionSpec", "P") == "P('data', None)"


def test_a_user_decoder_split_over_two_model_axes_matches_one_device(measured):
    r = measured["decoder"]
    errors = {k: r[k] for k in ("out", "params_grads", "inputs_grads")}
    assert all(v <= TOL["float64"] for v in errors.values()), errors
    # 8 heads over x * y = 4 devices; the 4 key/value heads too; nn.scan's layer axis whole
    heads = {"q_proj/kernel": [[64, 64], [64, 16]], "q_proj/bias": [[64], [16]], "k_proj/kernel": [[64, 32], [64, 8]],
             "k_proj/bias": [[32], [8]], "v_proj/kernel": [[64, 32], [64, 8]], "v_proj/bias": [[32], [8]],
             "o_proj/kernel": [[64, 64], [16, 64]]}
    expected = {f"first/attn/{k}": v for k, v in heads.items()}
    expected |= {f"layers/attn/{k}": [[3] + a, [3] + b] for k, (a, b) in heads.items()}
    expected |= {f"chapter/{w}/kernel": [[64, 64], [64, 16]] for w in ("W_query", "W_key", "W_value")}
    expected["chapter/out_proj/kernel"] = [[64, 64], [16, 64]]
    assert r["split"] == expected


def test_errors_name_the_parameter_and_shapes(measured):
    m = measured["errors"]
    assert re.search(r"\['params'\]\['W_(query|key|value)'\]\['kernel'\] of shape \(32, 30\): dim 1 \(30\) is not "
                     r"divisible by the 4 devices of mesh axis 'model'", m["shard_params"]), m["shard_params"]
    assert "MultiHeadAttention has N=6 query heads, not divisible by the 4 devices of mesh axis 'model'" \
           in m["partition_specs"]


@pytest.mark.parametrize("verify", [True, False])
def test_checkpoint_restores_into_the_shardings(measured, verify):
    r = measured["checkpoint"][f"verify={verify}"]
    assert r["bit_exact"] and r["placed"], r
    assert r["q_proj_shard"] == [64, 16]          # (D, 8 heads of 8) over 4 devices of 'model'
    assert r["k_proj_shard"] == [64, 16]          # 2 key/value heads on a model axis of 4: replicated
    assert sorted(s.replace("PartitionSpec", "P") for s in r["specs"]) == ["P('model', None)", "P()", "P(None, 'model')"]


def test_a_large_projection_is_sharded_like_a_small_one(measured):
    """On a mesh of explicit axes the rows' convolution would merge sharded axes, so the product
    stays a dot there; on an automatic mesh it is the convolution. Both are the matmul."""
    r = measured["large_projection"]
    assert r["Explicit"]["convolution"] is False and r["Auto"]["convolution"] is True, r
    for kind in r.values():
        assert max(kind["errors"].values()) < TOL["float64"], r


# in this process: no devices needed


def test_partition_specs_refuses_what_it_does_not_know():
    import jax

    import flax_attn as fa
    from flax_attn import parallel as fp

    layer = fa.MultiHeadAttention(32, 64, 16, 0.0, 8)
    variables = jax.eval_shape(lambda: layer.init(jax.random.key(0), np.zeros((2, 16, 32)), deterministic=True))
    wrong = {"params": {**variables["params"], "W_extra": variables["params"]["W_query"]}}
    with pytest.raises(ValueError, match=r"no entries \['W_extra'\]"):
        fp.partition_specs(layer, wrong)
    with pytest.raises(TypeError, match=r"takes a flax_attn module or a Flax model \(Linen or NNX\), got object"):
        fp.partition_specs(object(), variables)
    explicit = jax.sharding.AbstractMesh((2, 4), ("data", "model"), (jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match=r"mesh axes \['model'\] are Explicit"):
        fp.partition_specs(layer, variables, mesh=explicit)
    with pytest.raises(ValueError, match="data_axis and model_axis must differ"):
        fp.partition_specs(layer, variables, data_axis="x", model_axis="x")


def test_partition_specs_of_nnx_twin_and_unwrapped_params():
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    config = fa.AttentionConfig(d_model=32, num_heads=4, num_kv_heads=2)
    linen = fa.Attention(config)
    variables = jax.eval_shape(lambda: linen.init(jax.random.key(0), np.zeros((1, 4, 32)), np.zeros((1, 4), int)))
    twin = fa.nnx.Attention(config, rngs=nnx.Rngs(0))
    specs = fp.partition_specs(linen, variables)
    assert fp.partition_specs(twin, fa.nnx.to_linen(twin)) == specs
    assert fp.partition_specs(linen, variables["params"]) == specs["params"]
    assert specs["params"]["k_proj"]["kernel"] == P(None, "model")
    assert specs["params"]["o_proj"]["kernel"] == P("model", None)


def _decoder(config):
    """A user's Linen decoder: a block, the chapter's multi-head attention, three blocks stacked by
    nn.scan; each block a flax_attn Attention, a LayerNorm and a Dense of its own."""
    import flax.linen as nn

    import flax_attn as fa

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, positions):
            x = x + fa.Attention(config, param_dtype=x.dtype, name="attn")(nn.LayerNorm(param_dtype=x.dtype)(x),
                                                                            positions)
            return x + nn.Dense(config.d_model, param_dtype=x.dtype)(x), None

    class Decoder(nn.Module):
        @nn.compact
        def __call__(self, x, positions, deterministic=True):
            x = Block(name="first")(x, positions)[0]
            x = x + fa.MultiHeadAttention(config.d_model, config.d_model, x.shape[1], 0.0, config.num_heads,
                                          param_dtype=x.dtype, name="chapter")(x, deterministic=deterministic)
            stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
                            in_axes=nn.broadcast)
            return stack(name="layers")(x, positions)[0]

    return Decoder()


def test_partition_specs_of_a_linen_model_built_of_flax_attn_modules():
    """Each flax_attn module inside a user's model gets the specs it gets alone (a None in front
    for layers stacked by nn.scan); the model's own parameters are replicated."""
    import jax
    from flax import traverse_util
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    config = fa.AttentionConfig(d_model=32, num_heads=4, num_kv_heads=2, position="rope", qkv_bias=True)
    model = _decoder(config)
    x, positions = np.zeros((2, 8, 32), np.float32), np.broadcast_to(np.arange(8), (2, 8))
    variables = jax.eval_shape(model.init, jax.random.key(0), x, positions)
    specs = fp.partition_specs(model, variables, inputs=(x, positions), input_kwargs={"deterministic": True})
    attention = fa.Attention(config)
    alone = fp.partition_specs(attention, jax.eval_shape(attention.init, jax.random.key(0), x, positions))["params"]
    chapter = fa.MultiHeadAttention(32, 32, 8, 0.0, 4)
    chapter_alone = fp.partition_specs(chapter, jax.eval_shape(
        lambda: chapter.init(jax.random.key(0), x, deterministic=True)))["params"]
    params = specs["params"]
    assert params["first"]["attn"] == alone and params["chapter"] == chapter_alone
    stacked = jax.tree_util.tree_map(lambda s: P(None, *s) if len(s) else s, alone,
                                     is_leaf=lambda s: isinstance(s, P))
    assert params["layers"]["attn"] == stacked
    assert params["layers"]["attn"]["q_proj"]["kernel"] == P(None, None, "model")
    own = {k: v for k, v in traverse_util.flatten_dict(params).items() if "attn" not in k and "chapter" not in k}
    assert own and set(own.values()) == {P()}, own                       # LayerNorm, Dense: replicated
    assert jax.tree_util.tree_structure(specs, is_leaf=lambda s: isinstance(s, P)) == \
        jax.tree_util.tree_structure(variables)

    with pytest.raises(TypeError, match=r"Decoder is not one: to find the flax_attn modules inside it, pass inputs="):
        fp.partition_specs(model, variables)
    with pytest.raises(ValueError, match=r"traced Decoder.apply\(params, \*inputs, \*\*input_kwargs\).*failed"):
        fp.partition_specs(model, variables, inputs=(x,))                 # positions missing
    import flax.linen as nn

    with pytest.raises(ValueError, match="Dense runs no flax_attn module"):
        dense = nn.Dense(4)
        fp.partition_specs(dense, jax.eval_shape(dense.init, jax.random.key(0), x), inputs=(x,))


def test_partition_specs_of_a_model_with_flags_and_other_collections():
    """A Python flag among the inputs stays a Python value while the call is traced (an `if` on
    it works); arrays may be ShapeDtypeStructs; other collections (batch statistics) come back
    replicated, beside the params."""
    import flax.linen as nn
    import jax
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, positions, deterministic):
            if not deterministic:
                x = nn.Dropout(0.1)(x, deterministic=False)
            x = nn.BatchNorm(use_running_average=True)(x)
            return fa.Attention(fa.AttentionConfig(d_model=32, num_heads=4))(x, positions)

    model = Model()
    x, positions = np.zeros((2, 4, 32), np.float32), np.zeros((2, 4), np.int32)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), x, positions, True))
    for inputs, kwargs in (((jax.ShapeDtypeStruct(x.shape, x.dtype), positions), {"deterministic": True}),
                           ((x, positions, False), {})):
        specs = fp.partition_specs(model, variables, inputs=inputs, input_kwargs=kwargs)
        assert specs["batch_stats"] == {"BatchNorm_0": {"mean": P(), "var": P()}}
        assert specs["params"]["Attention_0"]["q_proj"]["kernel"] == P(None, "model")
        assert specs["params"]["BatchNorm_0"] == {"bias": P(), "scale": P()}


def test_partition_specs_of_an_nnx_model_built_of_flax_attn_modules():
    import jax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    config = fa.AttentionConfig(d_model=32, num_heads=4, num_kv_heads=2, qkv_bias=True)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = fa.nnx.Attention(config, rngs=rngs)
            self.mlp = nnx.Linear(32, 32, rngs=rngs)

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(10, 32, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])
            self.stacked = nnx.vmap(lambda key: Block(nnx.Rngs(key)))(jax.random.split(jax.random.key(1), 3))

    model = Decoder(nnx.Rngs(0))
    specs = fp.partition_specs(model, fa.nnx.to_linen(model))["params"]
    alone = fp.partition_specs(model.blocks[0].attn, fa.nnx.to_linen(model.blocks[0].attn))["params"]
    assert specs["blocks"][0]["attn"] == specs["blocks"][1]["attn"] == alone
    assert specs["stacked"]["attn"]["k_proj"] == {"kernel": P(None, None, "model"), "bias": P(None, "model")}
    assert specs["stacked"]["attn"]["o_proj"]["kernel"] == P(None, "model", None)
    assert specs["embed"]["embedding"] == specs["blocks"][0]["mlp"]["kernel"] == P()
    with pytest.raises(ValueError, match="runs no flax_attn module"):
        fp.partition_specs(model.blocks[0].mlp, fa.nnx.to_linen(model.blocks[0].mlp))


def test_axes_may_be_tuples_of_mesh_axes():
    """model_axis=('x', 'y') splits heads over both axes (4 devices); a tuple data_axis too."""
    import jax
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    mesh = jax.sharding.AbstractMesh((2, 2, 2), ("data", "x", "y"), (jax.sharding.AxisType.Auto,) * 3)
    x, positions = np.zeros((1, 4, 32)), np.zeros((1, 4), int)
    for kv_heads, kv_spec in ((2, P()), (4, P(None, ("x", "y")))):
        config = fa.AttentionConfig(d_model=32, num_heads=8, num_kv_heads=kv_heads)
        layer = fa.Attention(config)
        variables = jax.eval_shape(layer.init, jax.random.key(0), x, positions)
        specs = fp.partition_specs(layer, variables, model_axis=("x", "y"), mesh=mesh)["params"]
        assert specs["q_proj"]["kernel"] == P(None, ("x", "y")) and specs["k_proj"]["kernel"] == kv_spec
        assert specs["o_proj"]["kernel"] == P(("x", "y"), None)
        cache = config.init_cache(batch=2, max_len=8, layout="BSKH")
        heads = None if kv_heads % 4 else ("x", "y")
        assert fp.cache_partition_specs(cache, model_axis=("x", "y"), mesh=mesh).key == P("data", None, heads, None)
    fsdp = fp.partition_specs(layer, variables, data_axis=("data",), model_axis=("x", "y"), mesh=mesh, fsdp=True)
    assert fsdp["params"]["q_proj"]["kernel"] == P(("data",), ("x", "y"))
    with pytest.raises(ValueError, match=r"data_axis \('data', 'x'\) and model_axis \('x', 'y'\) share mesh axes \['x'\]"):
        fp.partition_specs(layer, variables, data_axis=("data", "x"), model_axis=("x", "y"))
    with pytest.raises(ValueError, match="has N=6 query heads, not divisible by the 4 devices of mesh axis \\('x', 'y'\\)"):
        six = fa.Attention(fa.AttentionConfig(d_model=24, num_heads=6))
        fp.partition_specs(six, jax.eval_shape(six.init, jax.random.key(0), np.zeros((1, 4, 24)), positions),
                           model_axis=("x", "y"), mesh=mesh)
    with pytest.raises(ValueError, match=r"mesh has axes \('data', 'x', 'y'\), not 'z'"):
        fp.partition_specs(layer, variables, model_axis=("x", "z"), mesh=mesh)
    with pytest.raises(TypeError, match="model_axis must be a mesh axis name or a tuple of them, got 3"):
        fp.partition_specs(layer, variables, model_axis=3)


def test_cache_specs():
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    config = fa.AttentionConfig(d_model=32, num_heads=4, num_kv_heads=2)
    cache = config.init_cache(batch=2, max_len=8, layout="BSKH")                   # (B, S, K, H)
    specs = fp.cache_partition_specs(cache, model_axis=None)
    assert specs.key == P("data", None, None, None) and specs.length == P() and specs.rolling == cache.rolling
    assert fp.cache_partition_specs(cache).value == P("data", None, "model", None)
    flat = config.init_cache(batch=2, max_len=8, layout="BKSH")                    # (B*K, S, H), batch-major
    assert fp.cache_partition_specs(flat).key == P("data", None, None)   # whole sequences, all heads
    assert fp.cache_partition_specs(flat, data_axis=None).value == P(None, None, None)
    assert fp.cache_partition_specs(flat).positions == P("data", None)
    blocks = config.init_cache(batch=2, max_len=8, layout="blocks", block=4)      # (S // 4, B*K, 4, H)
    assert fp.cache_partition_specs(blocks).key == P(None, "data", None, None)
    latent = fa.MLAConfig(d_model=32, num_heads=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
                          v_head_dim=4).init_cache(2, 8)
    latent_specs = fp.cache_partition_specs(latent)
    assert latent_specs.latent == P("data", None, None) and latent_specs.positions == P("data", None)
    with pytest.raises(TypeError, match="takes a KVCache or a LatentKVCache"):
        fp.cache_partition_specs({"key": 1})


def test_cache_specs_with_a_mesh_keep_heads_whole_where_they_do_not_divide():
    """As partition_specs replicates key/value projections whose K heads do not divide the model
    axis, so cache_partition_specs(mesh=) keeps such a 'BSKH' cache's heads whole."""
    import jax
    from jax.sharding import PartitionSpec as P

    import flax_attn as fa
    from flax_attn import parallel as fp

    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"), (jax.sharding.AxisType.Auto,) * 2)
    for kv_heads, heads_spec in ((2, None), (4, "model"), (8, "model")):
        config = fa.AttentionConfig(d_model=64, num_heads=8, num_kv_heads=kv_heads)
        cache = config.init_cache(batch=2, max_len=8, layout="BSKH")
        specs = fp.cache_partition_specs(cache, mesh=mesh)
        assert specs.key == specs.value == P("data", None, heads_spec, None), kv_heads
        layer = fa.Attention(config)
        params = jax.eval_shape(lambda: layer.init(jax.random.key(0), np.zeros((1, 4, 64)), np.zeros((1, 4), int)))
        kernel = fp.partition_specs(layer, params, mesh=mesh)["params"]["k_proj"]["kernel"]
        assert kernel == (P() if heads_spec is None else P(None, heads_spec))  # the cache follows its projection
    with pytest.raises(ValueError, match=r"mesh has axes \('data', 'model'\), not 'heads'"):
        fp.cache_partition_specs(cache, mesh=mesh, model_axis="heads")
    explicit = jax.sharding.AbstractMesh((2, 4), ("data", "model"), (jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(ValueError, match="are Explicit"):
        fp.cache_partition_specs(cache, mesh=explicit)


def test_shard_params_names_a_bare_array():
    import jax
    from jax.sharding import PartitionSpec as P

    from flax_attn import parallel as fp

    mesh = jax.sharding.AbstractMesh((8, 1), ("data", "model"), (jax.sharding.AxisType.Auto,) * 2)
    with pytest.raises(ValueError, match=r"^the array of shape \(3, 4, 24\): dim 0 \(3\) is not divisible by "
                                         r"the 8 devices of mesh axis 'data'"):
        fp.shard_batch(np.ones((3, 4, 24)), mesh)
    with pytest.raises(ValueError, match=r"^the array of shape \(3,\) has fewer dims than its spec"):
        fp.shard_params(np.ones(3), P("data", None), mesh)


if __name__ == "__main__" and "--child" in sys.argv:
    print(json.dumps(child()))
