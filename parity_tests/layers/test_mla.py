"""Multi-head latent attention (flax_attn.layers.mla): parity with torch_ref.mla (outputs and
gradients to the input and every parameter, float64 and float32), the absorbed form equal to
the plain one, the latent cache (prefill + steps equal the full pass, one compilation, memory
per token, loud overflow, positions going forward and truncate), the NNX twin, PyTorch weights with
Hugging Face names, and errors."""
import contextlib
import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, assert_close, run_parity
from flax_attn import interop
from flax_attn.layers.mla import (LatentKVCache, MLAConfig, MultiHeadLatentAttention, from_torch_state_dict,
                                  mla_forward, to_torch_state_dict)
from torch_ref.mla import MultiHeadLatentAttention as TorchMLA

D = 16
BASE = dict(d_model=D, num_heads=4, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
YARN = {"kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 4, "mscale": 1.0, "mscale_all_dim": 0.5}
VARIANTS = {
    "q-lora": {"q_lora_rank": 6},
    "q-proj-rotate-half-bidirectional": {"rope_layout": "rotate_half", "causal": False},
    "q-lora-bias-yarn": {"q_lora_rank": 6, "attention_bias": True, "rope_scaling": YARN},
    "absorbed": {"q_lora_rank": 6, "absorb": True, "rope_scaling": YARN},
}


def pair(cfg, seed=0):
    torch.manual_seed(seed)
    config = MLAConfig(**BASE, **cfg)
    twin = TorchMLA(**dataclasses.asdict(config))
    with torch.no_grad():  # norm weights away from their initial ones, so that they matter
        for p in twin.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape))
    return twin, MultiHeadLatentAttention(config)


def params_of(config):
    """Variables of a layer with its torch twin's initial weights (no JAX computation)."""
    torch.manual_seed(0)
    return from_torch_state_dict(config, tr.state_dict_to_numpy(TorchMLA(**dataclasses.asdict(config)).state_dict()))


def inputs(B=2, T=6, seed=0):
    x = np.random.default_rng(seed).standard_normal((B, T, D))
    positions = np.arange(T)[None] + np.array([[0], [3]])[:B]  # the second row starts at an offset
    return x, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_parity(name, dtype):
    t, f = pair(VARIANTS[name])
    run_parity(t, f, inputs(), dtype, flax_kwargs={"deterministic": True})


ABSORBED_FORMS = ("head by head", "in place", "batched matmuls")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("form", ABSORBED_FORMS)
@pytest.mark.parametrize("B, T", [(1, 1), (1, 2), (2, 1)])
def test_absorbed_forms_of_the_kv_b_products(B, T, form, dtype):
    # The absorbed form's products with kv_b_proj, outputs and gradients against torch_ref, in
    # each of its three forms: on CPU up to mla.ROWS_LOOPING_OVER_HEADS query rows (batch x
    # tokens) a loop over the heads reading kv_b_proj where it lies (two scans); at most
    # mla.ROWS_READING_KV_B_IN_PLACE rows, traced for a program without YNNPACK's fusions, sums
    # where it lies (no scan); more rows: kv_b_proj rearranged into per-head blocks (no scan, one
    # transpose more) for two batched matmuls.
    from flax_attn.core import tuning
    from flax_attn.layers import mla

    assert B * T <= min(mla.ROWS_READING_KV_B_IN_PLACE, mla.ROWS_LOOPING_OVER_HEADS)
    t, f = pair(VARIANTS["absorbed"])
    x, positions = inputs(B, T)
    params = f.init(jax.random.key(0), jnp.asarray(x), positions)

    @contextlib.contextmanager
    def traced_as(form):
        with pytest.MonkeyPatch.context() as patch, \
                tuning.compiled_with(tuning.YNNPACK_OFF if form == "in place" else {}):
            if form == "batched matmuls":
                patch.setattr(mla, "ROWS_LOOPING_OVER_HEADS", 0)
            yield

    def counts(form):  # (scans, transposes) of the program traced in that form
        with traced_as(form):
            jaxpr = str(jax.make_jaxpr(f.apply)(params, x, positions))
        return jaxpr.count("scan["), jaxpr.count("transpose[")

    scans, transposes = counts("batched matmuls")
    assert counts("head by head") == (scans + 2, transposes - 1)
    assert counts("in place") == (scans, transposes - 1)
    with traced_as(form):
        run_parity(t, f, (x, positions), dtype, flax_kwargs={"deterministic": True})


def test_absorbed_bfloat16_rows_in_place_equal_the_matmuls():
    # The in-place sums and the batched matmuls, bfloat16 parameters and inputs: both within
    # bfloat16's rounding of the float64 result, and their outputs are bfloat16.
    from flax_attn.core import tuning

    config = MLAConfig(**BASE, **VARIANTS["absorbed"])
    params = params_of(config)["params"]
    x, positions = inputs(1, 1)
    want = np.asarray(mla_forward(config, params, x, positions))
    low = jax.tree.map(lambda a: jnp.asarray(a, jnp.bfloat16), params)
    run = lambda: mla_forward(config, low, jnp.asarray(x, jnp.bfloat16), positions)  # noqa: E731
    with tuning.compiled_with(tuning.YNNPACK_OFF):
        in_place = run()
    for out in (run(), in_place):
        assert out.dtype == jnp.bfloat16
        err = float(np.max(np.abs(np.asarray(out, np.float64) - want)) / np.max(np.abs(want)))
        assert err < 3e-2, err


@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_packed_padded_masked(dtype):
    # Row 0: two packed sequences; row 1: one sequence right-padded (segment id -1); an extra mask.
    x, _ = inputs()
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, -1, -1]])
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 0]])
    mask = (np.random.default_rng(5).random((2, 1, 6, 6)) < 0.5) | np.eye(6, dtype=bool)
    t, f = pair(VARIANTS["q-lora"])
    run_parity(t, f, (x, positions, segments, mask), dtype, flax_kwargs={"deterministic": True})


def test_softmax_scale():
    # The paper's 1/sqrt(d_n + d_r); DeepSeek-V3's YaRN (s = 40, mscale_all_dim = 1) squares
    # 0.1 ln(40) + 1 = 1.36889 into it; an explicit scale wins.
    v3 = dict(d_model=8, num_heads=1, kv_lora_rank=4, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=4)
    assert MLAConfig(**v3).softmax_scale == pytest.approx(1 / math.sqrt(192), rel=1e-15)
    yarn = {"kind": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
            "mscale_all_dim": 1.0}
    assert MLAConfig(**v3, rope_scaling=yarn).softmax_scale == pytest.approx(1.36889 ** 2 / 192 ** 0.5, rel=1e-5)
    assert MLAConfig(**v3, rope_scaling=yarn, scale=0.5).softmax_scale == 0.5
    linear = {"kind": "linear", "factor": 4.0}
    assert MLAConfig(**v3, rope_scaling=linear).softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)


# ----------------------------------------------------------------------------- latent cache

@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
def test_prefill_and_steps_equal_full_pass(absorb):
    # Row 1's prompt is 2 tokens shorter: left-padded with segment id -1. Prefill 4 tokens, then
    # 3 single steps (one jitted function: one program for the prefill, one for every step),
    # against the plain full pass (float64) and against torch_ref's concatenating cache.
    t, _ = pair(VARIANTS["q-lora-bias-yarn"])
    t = t.double()
    config = MLAConfig(**BASE, **{**VARIANTS["q-lora-bias-yarn"], "absorb": absorb})
    plain = MLAConfig(**BASE, **VARIANTS["q-lora-bias-yarn"])
    params = from_torch_state_dict(config, tr.state_dict_to_numpy(t.state_dict()))["params"]
    T, P = 7, 4
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, T, D)))
    segments = jnp.array([[0] * T, [-1, -1] + [0] * (T - 2)])
    positions = jnp.array([list(range(T)), [0, 0] + list(range(T - 2))])
    full = jax.jit(lambda a, p, s: mla_forward(plain, params, a, p, s))(x, positions, segments)

    traced = []

    def run(c, a, p, s):
        traced.append(a.shape[1])
        return mla_forward(config, params, a, p, s, cache=c)[::-1]

    step = jax.jit(run)
    cache, out = step(config.init_cache(2, 8, dtype=jnp.float64), x[:, :P], positions[:, :P], segments[:, :P])
    outs = [out]
    for i in range(P, T):
        cache, out = step(cache, x[:, i:i + 1], positions[:, i:i + 1], segments[:, i:i + 1])
        outs.append(out)
    # one trace (so one compilation) for the prefill, one for every step; not the size of JAX's
    # compiled-call cache, whose entries something else in the same process may drop
    assert traced == [P, 1]
    assert int(cache.length) == T
    np.testing.assert_array_equal(np.asarray(cache.segment_ids[:, T:]), -1)  # the unwritten slot stays empty
    assert_close(jnp.concatenate(outs, axis=1), full, np.float64, "prefill + steps vs full pass")

    to_t = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    t_full = t(to_t(x), to_t(positions), to_t(segments))
    t_cache, t_outs = t.empty_cache(2, torch.float64), []
    for lo, hi in ((0, P),) + tuple((i, i + 1) for i in range(P, T)):
        o, t_cache = t(to_t(x[:, lo:hi]), to_t(positions[:, lo:hi]), to_t(segments[:, lo:hi]), cache=t_cache)
        t_outs.append(o)
    assert_close(torch.cat(t_outs, 1).detach().numpy(), t_full.detach().numpy(), np.float64, "torch_ref cache")
    assert_close(jnp.concatenate(outs, axis=1), t_full.detach().numpy(), np.float64, "flax cache vs torch_ref")
    real = np.asarray(segments)[..., None] >= 0  # flax_attn keeps zeros in padding slots
    assert_close(cache.c_kv[:, :T], np.where(real, t_cache["c_kv"].detach().numpy(), 0), np.float64, "cached c_kv")
    assert_close(cache.k_pe[:, :T], np.where(real, t_cache["k_pe"].detach().numpy(), 0), np.float64, "cached k_pe")


@pytest.mark.parametrize("absorb", [False, True], ids=["plain", "absorbed"])
def test_decoding_over_a_large_cache_by_key_blocks(absorb):
    # A 64-slot cache filled to 40: the core is told the filled length (finite past it), a
    # one-token step folds its segment rule into the key positions, and key blocks of 8 (blocks
    # while at most 32 slots are filled, then the plain pass) give the full pass's outputs.
    # Row 1 starts with 2 padding tokens and pads one decoding step (segment id -1).
    from flax_attn.core.key_blocks import KeyBlocks

    config = MLAConfig(**BASE, q_lora_rank=6, absorb=absorb)
    params = params_of(config)["params"]
    T, P = 40, 3
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, T, D)))
    segments = np.zeros((2, T), np.int32)
    segments[1, :2] = segments[1, 20] = -1
    positions = np.broadcast_to(np.arange(T), (2, T))
    full = mla_forward(MLAConfig(**BASE, q_lora_rank=6), params, x, positions, segments)
    step = jax.jit(lambda c, a, p, s: mla_forward(config, params, a, p, s, cache=c,
                                                  implementation=KeyBlocks(block_k=8))[::-1])
    cache, out = step(config.init_cache(2, 64, dtype=jnp.float64), x[:, :P], positions[:, :P], segments[:, :P])
    outs = [out]
    for i in range(P, T):
        cache, out = step(cache, x[:, i:i + 1], positions[:, i:i + 1], segments[:, i:i + 1])
        outs.append(out)
    assert_close(jnp.concatenate(outs, axis=1), full, np.float64, "key-block steps vs full pass")
    np.testing.assert_array_equal(np.asarray(cache.latent[1, 20]), 0.0)  # the padded step cached zeros


@pytest.mark.skipif(fa.core.native.unavailable() is not None, reason="the compiled CPU kernel cannot run here")
def test_absorbed_steps_read_the_latent_cache_in_place_through_the_kernel():
    """On CPU an absorbed float32 decoding step attends over the latent cache through the
    compiled kernel (one latent head of r_kv + d_r = 32, the cache's positions): equal to the
    full pass, and its compiled program makes no array of the cache's size but the in-place
    update (the kernel is handed the cache's own buffer, ``(B, S, r_kv + d_r)``; a reshape
    between the update and the kernel would be fused with the update into a copy)."""
    config = MLAConfig(d_model=32, num_heads=4, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                       v_head_dim=8, absorb=True)
    layer = MultiHeadLatentAttention(config)
    B, S, T = 2, 40, 9
    x = jnp.asarray(np.random.default_rng(4).standard_normal((B, T, 32)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = layer.init(jax.random.key(4), x, positions)
    full = jax.jit(layer.apply)(params, x, positions)
    step = fa.decode_step(layer)
    cache = layer.init_cache(B, S)
    out, cache = step(params, cache, x[:, :5], positions[:, :5])
    outs = [out]
    for t in range(5, T):
        out, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])
        outs.append(out)
    assert_close(jnp.concatenate(outs, axis=1), full, np.float32, "absorbed kernel steps vs full pass")
    hlo = step.jitted.lower(params, cache, x[:, :1], positions[:, :1], None).compile().as_text()
    assert re.search(r'custom_call_target="flax_attn_cpu_\w+_forward"', hlo), "the step runs the kernel"
    sized = {f"f32[{B},{S},32]", f"f32[{B},{S},1,32]", f"f32[{B},1,{S},32]"}
    made = [(op, name) for name, shape, op in re.findall(r"%(\S+) = (f32\[[\d,]+\])\S* ([\w-]+)\(", hlo)
            if shape in sized]
    assert made, "the cache's arrays are in the program"
    for op, name in made:
        assert op in ("parameter", "get-tuple-element", "tuple", "bitcast", "dynamic-update-slice") or (
            op == "fusion" and "dynamic-update-slice" in name), (op, name)


def test_cache_memory_per_token():
    # DeepSeek-V3: N = 128, d_n = 128, d_r = 64, d_v = 128, r_kv = 512. The latent cache holds
    # r_kv + d_r = 576 numbers per token (the paper's (d_c + d_h^R) = 4.5 d_h, d_h = 128); every
    # head's keys and values would be 128 (128 + 64 + 128) = 40960: 71.1 times more.
    v3 = MLAConfig(d_model=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
    S = 1000
    latent = jax.eval_shape(lambda: v3.init_cache(1, S, dtype=jnp.bfloat16))
    full = jax.eval_shape(lambda: fa.KVCache.create(batch=1, max_len=S, num_kv_heads=128, head_dim=192,
                                                    value_dim=128, dtype=jnp.bfloat16))
    latent_bytes = latent.latent.size * 2 / S  # [c_kv, k_pe] side by side
    full_bytes = (full.key.size + full.value.size) * 2 / S
    assert latent_bytes == 576 * 2 == 4.5 * 128 * 2
    assert full_bytes == 40960 * 2
    assert full_bytes / latent_bytes == pytest.approx(71.11, abs=0.01)
    assert (v3.cache_width, v3.full_cache_width) == (576, 40960)


def test_cache_overflow_is_a_clear_error():
    config = MLAConfig(**BASE)
    layer, params = MultiHeadLatentAttention(config), params_of(config)
    x = jnp.ones((2, 2, D), jnp.float32)
    step = jax.jit(lambda c, p: layer.apply(params, x, p, cache=c))
    cache = config.init_cache(2, 5)
    for start in (0, 2):
        _, cache = step(cache, jnp.full((2, 2), start) + jnp.arange(2))
    message = r"latent KV cache overflow: 4 cached \+ 2 new tokens > max_len=5"
    with pytest.raises(Exception, match=message):  # when the compiled program runs
        jax.block_until_ready(step(cache, jnp.full((2, 2), 4) + jnp.arange(2)))
    latents = jnp.zeros((2, 2, 8)), jnp.zeros((2, 2, 4)), jnp.zeros((2, 2), jnp.int32), jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match=message):  # eagerly
        cache.update(*latents)
    with pytest.raises(ValueError, match="2 new tokens do not fit a latent cache of max_len=1"):
        config.init_cache(2, 1).update(*latents)


def test_cache_positions_go_forward_and_truncate_rolls_back():
    # As KVCache: a row's new positions must come after its cached ones (eagerly and under jit);
    # truncate(length) empties the later slots, after which the rewound token is accepted and
    # gives the full pass's output again.
    config = MLAConfig(**BASE, q_lora_rank=6)
    layer, params = MultiHeadLatentAttention(config), params_of(config)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((1, 4, D)), jnp.float32)
    step = jax.jit(lambda c, a, p: layer.apply(params, a, p, cache=c))
    full = jax.jit(layer.apply)(params, x, jnp.arange(4)[None])
    _, cache = step(config.init_cache(1, 4), x[:, :3], jnp.arange(3)[None])
    message = r"latent KV cache positions go backwards: new positions \(smallest per row \[1\]\) must come after"
    with pytest.raises(Exception, match=message):  # when the compiled program runs
        jax.block_until_ready(step(cache, x[:, 1:2], jnp.array([[1]])))
    with pytest.raises(ValueError, match=message):  # eagerly
        cache.update(jnp.zeros((1, 1, 8)), jnp.zeros((1, 1, 4)), jnp.array([[1]]), jnp.array([[0]]))
    rewound = jax.jit(lambda c: c.truncate(1))(cache)
    assert int(rewound.length) == 1
    np.testing.assert_array_equal(np.asarray(rewound.segment_ids), [[0, -1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(rewound.c_kv[:, 1:]), 0.0)
    out, rewound = step(rewound, x[:, 1:2], jnp.array([[1]]))
    assert_close(out, full[:, 1:2], np.float32, "step after truncate vs full pass")
    assert int(rewound.length) == 2
    with pytest.raises(ValueError, match=r"truncate\(length=3\): length must lie in \[0, 2\]"):
        rewound.truncate(3)
    with pytest.raises(TypeError, match="length must be an integer scalar"):
        rewound.truncate(1.0)


def test_nnx_twin_equals_linen():
    # The NNX twin holds the same params (by from_linen) and runs the same stage: outputs and a
    # cached step equal the Linen layer's; to_linen gives the params back; nnx_twin finds it.
    from flax import nnx
    from flax_attn.nnx.mla import MultiHeadLatentAttention as NNXMLA
    config = MLAConfig(**BASE, q_lora_rank=6, attention_bias=True)
    linen, variables = MultiHeadLatentAttention(config), params_of(config)
    twin = fa.nnx.from_linen(linen, variables, rngs=nnx.Rngs(0))
    assert isinstance(twin, NNXMLA) and fa.nnx.nnx_class_of(linen) is NNXMLA
    x, positions = inputs(B=1, T=3)
    x = jnp.asarray(x, jnp.float32)
    step = jax.jit(lambda c, a, p: linen.apply(variables, a, p, cache=c))
    nnx_step = nnx.jit(lambda m, c, a, p: m(a, p, cache=c))
    want, want_cache = step(linen.init_cache(1, 4), x, positions)
    got, got_cache = nnx_step(twin, twin.init_cache(1, 4), x, positions)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_cache.c_kv, want_cache.c_kv)
    back = fa.nnx.to_linen(twin)["params"]
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, back, variables["params"]))
    with pytest.raises(TypeError, match="config must be a flax_attn.layers.mla.MLAConfig"):
        NNXMLA(fa.AttentionConfig(d_model=8, num_heads=2), rngs=nnx.Rngs(0))


# ----------------------------------------------------------------------------- weights

def test_state_dict_round_trip_with_hf_names():
    t, _ = pair(VARIANTS["q-lora-bias-yarn"])
    config = MLAConfig(**BASE, **VARIANTS["q-lora-bias-yarn"])
    sd = tr.state_dict_to_numpy(t.state_dict())
    assert set(sd) == {"q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight", "q_b_proj.weight",
                       "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
                       "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"}
    params = from_torch_state_dict(config, sd)["params"]
    np.testing.assert_array_equal(params["kv_b_proj"]["kernel"], sd["kv_b_proj.weight"].T)
    back = to_torch_state_dict(config, {"params": params})
    assert set(back) == set(sd) and all(np.array_equal(back[k], sd[k]) for k in sd)
    t.load_state_dict(tr.state_dict_from_numpy(back), strict=True)
    # One layer of a model's state_dict, by prefix; other layers are ignored.
    model = {f"model.layers.{i}.self_attn.{k}": v for i in (0, 1) for k, v in sd.items()}
    one = from_torch_state_dict(config, model, prefix="model.layers.1.self_attn.")
    assert set(to_torch_state_dict(config, one, prefix="model.layers.1.self_attn.")) == \
        {k for k in model if k.startswith("model.layers.1.")}


def test_state_dict_errors_list_every_problem():
    config = MLAConfig(**BASE, q_lora_rank=6)
    sd = tr.state_dict_to_numpy(pair({"q_lora_rank": 6})[0].state_dict())
    del sd["q_b_proj.weight"]
    sd["kv_b_proj.weight"] = sd["kv_b_proj.weight"][:-1]
    sd["q_proj.weight"] = np.zeros((24, 16), np.float32)
    with pytest.raises(interop.StateDictError) as e:
        from_torch_state_dict(config, sd)
    for needle in ("missing entry 'q_b_proj.weight'", "'kv_b_proj.weight' has shape (39, 8), expected (40, 8)",
                   "unexpected entry 'q_proj.weight'"):
        assert needle in str(e.value)
    with pytest.raises(interop.StateDictError, match="missing parameter q_a_proj/kernel"):
        to_torch_state_dict(MLAConfig(**BASE, q_lora_rank=6), {"params": {}})


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("change, error, message", [
    ({"qk_rope_head_dim": 3}, ValueError, "qk_rope_head_dim must be even"),
    ({"q_lora_rank": 0}, ValueError, "q_lora_rank must be a positive integer, got 0"),
    ({"kv_lora_rank": None}, ValueError, "kv_lora_rank must be a positive integer, got None"),
    ({"rope_layout": "pairs"}, ValueError, "rope_layout must be one of"),
    ({"rope_scaling": {"kind": "stretch", "factor": 2.0}}, ValueError, "kind must be one of"),
    ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\)"),
    ({"scale": -1.0}, ValueError, "scale must be a positive number"),
])
def test_config_errors(change, error, message):
    with pytest.raises(error, match=message):
        MLAConfig(**{**BASE, **change})


def test_call_errors():
    config = MLAConfig(**BASE)
    layer = MultiHeadLatentAttention(config)
    x, positions = jnp.zeros((2, 3, D)), jnp.zeros((2, 3), jnp.int32)
    params = params_of(config)
    with pytest.raises(ValueError, match=r"x has shape \(2, 3, 8\): its last dim must be d_model=16"):
        layer.apply(params, jnp.zeros((2, 3, 8)), positions)
    with pytest.raises(ValueError, match=r"positions are required .* shape \(2, 3\)"):
        layer.apply(params, x)
    with pytest.raises(ValueError, match=r"positions must have shape \(3,\) or \(2, 3\), got \(2, 4\)"):
        layer.apply(params, x, jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(TypeError, match="positions must be an integer array"):
        layer.apply(params, x, jnp.zeros((2, 3)))
    with pytest.raises(TypeError, match="must be a floating-point array"):
        layer.apply(params, jnp.zeros((2, 3, D), jnp.int32), positions)
    with pytest.raises(TypeError, match="latent cache dtype float64 does not match the latents' dtype float32"):
        layer.apply(params, x.astype(jnp.float32), positions, cache=config.init_cache(2, 4, dtype=jnp.float64))
    with pytest.raises(TypeError, match="cache must be a LatentKVCache"):
        layer.apply(params, x, positions, cache=fa.KVCache.create(batch=2, max_len=4, num_kv_heads=4, head_dim=8))
    with pytest.raises(ValueError, match=r"new latents c_kv \(1, 2, 8\) / k_pe \(1, 2, 4\) do not fit"):
        config.init_cache(2, 4).update(jnp.zeros((1, 2, 8)), jnp.zeros((1, 2, 4)), jnp.zeros((1, 2), int),
                                       jnp.zeros((1, 2), int))
    with pytest.raises(ValueError, match="has dropout=0.1: pass deterministic"):
        MultiHeadLatentAttention(MLAConfig(**BASE, dropout=0.1)).apply(params, x, positions)
    assert isinstance(config.init_cache(1, 2), LatentKVCache)


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate_half"])
def test_matches_hugging_face_deepseek_v3(interleave):
    # The published implementation (when transformers >= 5 is installed): HF's weights load into
    # flax_attn by name, and the layouts and YaRN scale agree (float32; HF computes RoPE's
    # angles in float32).
    transformers = pytest.importorskip("transformers", minversion="5.0",
                                       reason="compares with transformers' DeepseekV3Attention")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mla

    hf_config = transformers.DeepseekV3Config(
        hidden_size=D, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=6, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, rope_interleave=interleave, attention_bias=True,
        max_position_embeddings=16, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                     "original_max_position_embeddings": 4, "mscale": 1.0,
                                                     "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0})
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = hf_mla.DeepseekV3Attention(hf_config, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn(p.shape))
    x, positions = inputs()
    x = x.astype(np.float32)
    t_x, t_pos = torch.from_numpy(x), torch.from_numpy(positions)
    causal = torch.full((6, 6), float("-inf")).triu(1)[None, None]
    expected = hf(t_x, hf_mla.DeepseekV3RotaryEmbedding(hf_config)(t_x, t_pos), causal)[0].detach().numpy()
    config = MLAConfig(**BASE, q_lora_rank=6, attention_bias=True, rope_scaling=YARN,
                       rope_layout="interleaved" if interleave else "rotate_half")
    assert config.softmax_scale == pytest.approx(hf.scaling, rel=1e-15)
    variables = from_torch_state_dict(config, tr.state_dict_to_numpy(hf.state_dict()))
    got = jax.jit(MultiHeadLatentAttention(config).apply)(variables, jnp.asarray(x), jnp.asarray(positions))
    assert_close(got, expected, np.float32, "flax_attn vs transformers")


def test_latent_cache_grows_by_reserve():
    # A latent cache sized for the prompt, grown by reserve before each step: the outputs equal
    # the full pass, the cached latents are kept, the new slots empty.
    config = MLAConfig(**BASE, q_lora_rank=6)
    layer, params = MultiHeadLatentAttention(config), params_of(config)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((1, 7, D)), jnp.float32)
    full = jax.jit(layer.apply)(params, x, jnp.arange(7)[None])
    step = jax.jit(lambda c, a, p: layer.apply(params, a, p, cache=c))
    out, cache = step(config.init_cache(1, 3), x[:, :3], jnp.arange(3)[None])
    pieces = [out]
    for t in range(3, 7):
        before, cache = cache, cache.reserve(t + 1, growth=2.0)
        if cache is not before:
            np.testing.assert_array_equal(np.asarray(cache.latent[:, :before.max_len]), np.asarray(before.latent))
            np.testing.assert_array_equal(np.asarray(cache.segment_ids[:, before.max_len:]), -1)
        out, cache = step(cache, x[:, t:t + 1], jnp.array([[t]]))
        pieces.append(out)
    assert cache.max_len == 128
    assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, "latent cache grown by reserve vs full pass")
