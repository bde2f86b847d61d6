"""flax_attn.interop: the registry of PyTorch twins and the state_dict converter (one generic,
strict mechanism, bit-exact round trips)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import linen as nn
from flax import nnx, traverse_util

import flax_attn as fa
import flax_attn.nnx as fnnx
import torch_ref as tr
from conftest import assert_close
from flax_attn import interop

CASES = {
    "SelfAttention_v1": (3, 2),
    "SelfAttention_v2": (3, 2, True),
    "CausalAttention": (3, 2, 6, 0.0, True),
    "MultiHeadAttentionWrapper": (3, 2, 6, 0.0, 3),
    "MultiHeadAttention": (4, 6, 5, 0.0, 2),
    "TransformerMultiHeadAttention": (8, 2),
}


def _pair(name, dtype=torch.float32):
    f = getattr(fa, name)(*CASES[name])
    torch.manual_seed(0)
    return tr.twin(f).to(dtype), f


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_torch_flax_torch_is_bit_exact(name, dtype):
    t, f = _pair(name, dtype)
    sd = tr.state_dict_to_numpy(t.state_dict())
    back = fa.to_torch_state_dict(f, fa.from_torch_state_dict(f, sd))
    assert set(back) == set(sd)
    for key in sd:
        assert back[key].dtype == sd[key].dtype, key
        np.testing.assert_array_equal(back[key], sd[key], err_msg=key)
    # torch takes it back strictly, buffers included.
    fresh = getattr(tr, name)(*CASES[name]).to(dtype)
    fresh.load_state_dict(tr.state_dict_from_numpy(back), strict=True)


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip_flax_torch_flax_is_bit_exact(name):
    _, f = _pair(name)
    variables = interop.init_example(f, jax.random.key(1))
    again = fa.from_torch_state_dict(f, fa.to_torch_state_dict(f, variables))
    for a, b in zip(jax.tree_util.tree_leaves(variables), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(a, b)
    assert jax.tree_util.tree_structure(variables) == jax.tree_util.tree_structure(again)


def test_names_follow_one_rule():
    assert interop.torch_name(("heads_0", "W_query", "kernel")) == "heads.0.W_query.weight"
    assert interop.torch_name(("out_proj", "bias")) == "out_proj.bias"
    assert interop.torch_name(("W_query",)) == "W_query"  # a raw nn.Parameter keeps its name
    assert interop.torch_name(("rel_bias", "embedding")) == "rel_bias.weight"
    assert interop.torch_name(("q_norm", "scale")) == "q_norm.weight"


def test_twins_are_registered_by_name_and_built_by_torch_ref():
    # flax_attn names each twin as a string (it never imports torch); torch_ref.twin builds it.
    assert interop.twin_of(fa.MultiHeadAttention).torch == "torch_ref.chapter.MultiHeadAttention"
    assert interop.twin_of(fa.TransformerMultiHeadAttention).torch == "torch_ref.transformer.MultiHeadAttention"
    assert interop.twin_of(fa.Attention).torch == "torch_ref.modern.Attention"
    for name in CASES:
        assert type(tr.twin(getattr(fa, name)(*CASES[name]))) is getattr(tr, name), name
    scaled = fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4, rope_scaling=fa.RopeScaling("linear", 2.0)))
    assert interop.twin_of(scaled).kwargs(scaled)["rope_scaling"] == {
        "kind": "linear", "factor": 2.0, "original_max_position_embeddings": None, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": None, "mscale": None,
        "mscale_all_dim": None, "truncate": True, "short_factor": None, "long_factor": None}

    class Subclass(fa.MultiHeadAttention):
        pass

    assert interop.twin_of(Subclass(4, 6, 5, 0.0, 2)) is interop.twin_of(fa.MultiHeadAttention)
    with pytest.raises(TypeError, match="Dense has no PyTorch twin: register one with "
                                        r"flax_attn.interop.register_twin\(Dense, torch="):
        fa.from_torch_state_dict(nn.Dense(3), {})
    with pytest.raises(ValueError, match="torch must be the twin's class as a dotted name"):
        interop.register_twin(nn.Dense, torch="Linear", kwargs=dict, example_inputs=tuple)


def test_linear_weights_are_transposed_raw_parameters_are_not():
    t, f = _pair("SelfAttention_v2")
    v = fa.from_torch_state_dict(f, tr.state_dict_to_numpy(t.state_dict()))
    np.testing.assert_array_equal(v["params"]["W_query"]["kernel"], t.W_query.weight.detach().numpy().T)
    t1, f1 = _pair("SelfAttention_v1")
    v1 = fa.from_torch_state_dict(f1, tr.state_dict_to_numpy(t1.state_dict()))
    np.testing.assert_array_equal(v1["params"]["W_query"], t1.W_query.detach().numpy())


def test_accepts_torch_tensors_directly():
    t, f = _pair("MultiHeadAttention")
    v = fa.from_torch_state_dict(f, t.state_dict())
    np.testing.assert_array_equal(v["params"]["out_proj"]["bias"], t.out_proj.bias.detach().numpy())


def test_every_problem_is_listed_in_one_error():
    t, f = _pair("MultiHeadAttention")
    sd = tr.state_dict_to_numpy(t.state_dict())
    del sd["W_key.weight"]                       # missing
    sd["W_query.weight"] = sd["W_query.weight"][:, :3]  # mis-shaped
    sd["extra.weight"] = np.zeros((2, 2), np.float32)  # unexpected
    sd["out_proj.bias"] = np.arange(6)           # wrongly typed (integers)
    with pytest.raises(fa.StateDictError) as err:
        fa.from_torch_state_dict(f, sd)
    msg = str(err.value)
    assert "missing entry 'W_key.weight' (expected shape (6, 4))" in msg
    assert "entry 'W_query.weight' has shape (6, 3), expected (6, 4)" in msg
    assert "unexpected entry 'extra.weight' with shape (2, 2)" in msg
    assert "entry 'out_proj.bias' has dtype int64, expected a floating dtype" in msg


def test_causal_mask_buffer_is_checked_and_skipped():
    t, f = _pair("MultiHeadAttention")
    sd = tr.state_dict_to_numpy(t.state_dict())
    assert "mask" in sd
    fa.from_torch_state_dict(f, sd)  # the expected buffer is accepted
    no_buffer = {k: v for k, v in sd.items() if k != "mask"}
    fa.from_torch_state_dict(f, no_buffer)  # and may be absent: masks are computed
    bad = dict(sd, mask=np.tril(np.ones((5, 5), np.float32)))
    with pytest.raises(fa.StateDictError, match="buffer 'mask' does not hold the expected values"):
        fa.from_torch_state_dict(f, bad)
    other_context = dict(sd, mask=np.triu(np.ones((7, 7), np.float32), 1))
    with pytest.raises(fa.StateDictError, match=r"buffer 'mask' has shape \(7, 7\), expected \(5, 5\)"):
        fa.from_torch_state_dict(f, other_context)


def test_wrapper_buffers_per_head():
    t, f = _pair("MultiHeadAttentionWrapper")
    sd = tr.state_dict_to_numpy(t.state_dict())
    assert {"heads.0.mask", "heads.1.mask", "heads.2.mask"} <= set(sd)
    assert set(interop.twin_of(f).buffers(f)) == {"heads.0.mask", "heads.1.mask", "heads.2.mask"}
    fa.from_torch_state_dict(f, sd)


def test_to_torch_rejects_params_of_another_configuration():
    _, f = _pair("MultiHeadAttention")
    other = fa.MultiHeadAttention(4, 8, 5, 0.0, 2)
    variables = interop.init_example(other, jax.random.key(0))
    with pytest.raises(fa.StateDictError, match="parameter W_query/kernel has shape"):
        fa.to_torch_state_dict(f, variables)
    ints = jax.tree.map(lambda x: x.astype(jnp.int32), interop.init_example(f, jax.random.key(0)))
    with pytest.raises(fa.StateDictError, match="parameter W_key/kernel has dtype int32, expected a floating dtype"):
        fa.to_torch_state_dict(f, ints)


@pytest.mark.parametrize("cfg", [
    {"num_kv_heads": 2, "qk_norm": True, "qkv_bias": True, "out_bias": True},
    {"position": "t5", "causal": False},
    {"num_kv_heads": 2, "sinks": True, "qkv_bias": (True, False, True), "qk_norm": True, "qk_norm_type": "layer",
     "qk_norm_scope": "per_head", "qk_norm_bias": True, "qk_norm_zero_centered": True},
    {"qk_norm": True, "qk_norm_scope": "projection"},
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_layer_round_trip(cfg, dtype):
    layer = fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4, **cfg))
    torch.manual_seed(0)
    twin = tr.twin(layer).to(dtype)
    with torch.no_grad():  # RMSNorm weights start at 1: make them distinguishable
        for p in twin.parameters():
            p.add_(torch.rand_like(p))
    sd = tr.state_dict_to_numpy(twin.state_dict())
    variables = fa.from_torch_state_dict(layer, sd)
    if cfg.get("qk_norm"):
        np.testing.assert_array_equal(variables["params"]["q_norm"]["scale"], sd["q_norm.weight"])
    if cfg.get("qk_norm_bias"):
        np.testing.assert_array_equal(variables["params"]["k_norm"]["bias"], sd["k_norm.bias"])
    if cfg.get("sinks"):
        np.testing.assert_array_equal(variables["params"]["sinks"], sd["sinks"])
    if cfg.get("position") == "t5":
        np.testing.assert_array_equal(variables["params"]["rel_bias"]["embedding"], sd["rel_bias.weight"])
    back = fa.to_torch_state_dict(layer, variables)
    assert set(back) == set(sd)
    for key in sd:
        np.testing.assert_array_equal(back[key], sd[key], err_msg=key)
    twin.load_state_dict(tr.state_dict_from_numpy(back), strict=True)


def test_learned_positions_round_trip():
    torch.manual_seed(0)
    m = fa.LearnedPositionalEmbedding(10, 4)
    twin = tr.twin(m)
    assert type(twin) is tr.modern.LearnedPositionalEmbedding
    sd = tr.state_dict_to_numpy(twin.state_dict())
    assert set(sd) == {"wpe.weight"}
    back = fa.to_torch_state_dict(m, fa.from_torch_state_dict(m, sd))
    np.testing.assert_array_equal(back["wpe.weight"], sd["wpe.weight"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_round_trips_are_bit_exact(name):
    t, f = _pair(name, torch.bfloat16)
    sd = tr.state_dict_to_numpy(t.state_dict())
    assert all(a.dtype.name == "bfloat16" for a in sd.values())
    variables = fa.from_torch_state_dict(f, sd)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(variables))
    back = fa.to_torch_state_dict(f, variables)
    for key in sd:
        assert back[key].dtype == sd[key].dtype, key
        np.testing.assert_array_equal(back[key].view(np.uint16), sd[key].view(np.uint16), err_msg=key)
    fresh = getattr(tr, name)(*CASES[name]).to(torch.bfloat16)
    fresh.load_state_dict(tr.state_dict_from_numpy(back), strict=True)
    for (n1, p1), (n2, p2) in zip(t.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(p1.view(torch.int16), p2.view(torch.int16)), n1


def test_bfloat16_torch_tensors_need_the_numpy_helper():
    t, f = _pair("MultiHeadAttention", torch.bfloat16)
    with pytest.raises(fa.StateDictError, match="state_dict_to_numpy converts any torch state_dict"):
        fa.from_torch_state_dict(f, t.state_dict())


# ---------------------------------------------------------------- no silent dtype changes

def test_float64_weights_in_32_bit_mode_are_an_error_naming_the_entry():
    t, f = _pair("MultiHeadAttention", torch.float64)
    sd = tr.state_dict_to_numpy(t.state_dict())
    with jax.enable_x64(False):
        with pytest.raises(fa.StateDictError) as err:
            fa.from_torch_state_dict(f, sd)
        msg = str(err.value)
        for name in ("W_query.weight", "W_key.weight", "W_value.weight", "out_proj.weight", "out_proj.bias"):
            assert (f"entry '{name}' has dtype float64, which JAX would store as float32 (64-bit types are off: "
                    f"jax_enable_x64 is False)") in msg
        assert "or convert on purpose with dtype=jnp.float32" in msg
        # the explicit choice converts, and says so by being there
        variables = fa.from_torch_state_dict(f, sd, dtype=jnp.float32)
        kernel = variables["params"]["W_query"]["kernel"]
        assert kernel.dtype == jnp.float32
        np.testing.assert_array_equal(kernel, sd["W_query.weight"].T.astype(np.float32))
        with pytest.raises(TypeError, match="dtype=float64 cannot be held while 64-bit types are off"):
            fa.from_torch_state_dict(f, sd, dtype=np.float64)
        # float32 weights need no choice
        sd32 = tr.state_dict_to_numpy(t.float().state_dict())
        assert fa.from_torch_state_dict(f, sd32)["params"]["out_proj"]["bias"].dtype == jnp.float32


def test_dtypes_are_kept_unless_a_dtype_is_chosen():
    t, f = _pair("SelfAttention_v2", torch.float64)
    sd = tr.state_dict_to_numpy(t.state_dict())
    kept = fa.from_torch_state_dict(f, sd)  # x64 on (conftest): float64 stays float64, bit for bit
    np.testing.assert_array_equal(kept["params"]["W_key"]["kernel"], sd["W_key.weight"].T)
    assert kept["params"]["W_key"]["kernel"].dtype == jnp.float64
    chosen = fa.from_torch_state_dict(f, sd, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(chosen))
    np.testing.assert_array_equal(chosen["params"]["W_key"]["bias"], sd["W_key.bias"].astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="dtype must be a floating dtype such as jnp.float32, got int32"):
        fa.from_torch_state_dict(f, sd, dtype=jnp.int32)


# ---------------------------------------------------------------- NNX modules share the converter

@pytest.mark.parametrize("name", sorted(CASES))
def test_nnx_modules_load_torch_weights_and_give_them_back(name):
    t, f = _pair(name, torch.float64)
    model = getattr(fnnx, name)(*CASES[name], rngs=nnx.Rngs(0))
    assert type(tr.twin(model)) is type(t)  # torch_ref builds the twin of an NNX module too
    assert interop.twin_of(model) is interop.twin_of(f)
    sd = tr.state_dict_to_numpy(t.state_dict())
    assert fa.from_torch_state_dict(model, sd) is model  # loaded in place
    linen = fa.from_torch_state_dict(f, sd)
    for path, value in traverse_util.flatten_dict(fnnx.to_linen(model)["params"]).items():
        want = traverse_util.flatten_dict(linen["params"])[path]
        assert value.dtype == want.dtype == jnp.float64
        np.testing.assert_array_equal(value, want, err_msg=str(path))
    back = fa.to_torch_state_dict(model)
    assert set(back) == set(sd)
    for key in sd:
        np.testing.assert_array_equal(back[key], sd[key], err_msg=key)
    fresh = getattr(tr, name)(*CASES[name]).double()
    fresh.load_state_dict(tr.state_dict_from_numpy(back), strict=True)


def test_nnx_attention_matches_its_torch_twin():
    config = fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=2, qk_norm=True, position="rope")
    model = fnnx.Attention(config, rngs=nnx.Rngs(0))
    torch.manual_seed(0)
    twin = tr.twin(model).double()
    fa.from_torch_state_dict(model, tr.state_dict_to_numpy(twin.state_dict()))
    x = np.random.default_rng(0).standard_normal((2, 5, 16))
    positions = np.broadcast_to(np.arange(5), (2, 5))
    with torch.no_grad():
        want = twin(torch.from_numpy(x), torch.from_numpy(positions.copy()).long()).numpy()
    got = nnx.jit(lambda m, x, p: m(x, p))(model, jnp.asarray(x), jnp.asarray(positions))
    assert_close(got, want, np.float64, "nnx Attention vs torch_ref.modern.Attention")
