"""flax_attn.hf without transformers: the padding helper by hand, fused layouts by index, the
missing-feature errors, safetensors files written from NumPy, and the import boundary."""
import dataclasses
import json
import math
import os
import subprocess
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
import flax_attn.hf as fhf
from flax_attn.layers.mla import MLAConfig, MultiHeadLatentAttention


# ----------------------------------------------------------------------------- attention_mask helper

def test_segments_and_positions_by_hand():
    mask = np.array([[0, 0, 1, 1, 1],    # left padding
                     [1, 1, 1, 0, 0],    # right padding
                     [1, 1, 1, 1, 1]])
    seg, pos = fhf.segments_and_positions(mask)
    np.testing.assert_array_equal(seg, [[-1, -1, 0, 0, 0], [0, 0, 0, -1, -1], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(pos, [[0, 0, 0, 1, 2], [0, 1, 2, 0, 0], [0, 1, 2, 3, 4]])
    seg2, pos2 = fhf.segments_and_positions(mask.astype(bool), convention="index")
    np.testing.assert_array_equal(seg2, seg)
    np.testing.assert_array_equal(pos2, [[0, 0, 2, 3, 4], [0, 1, 2, 0, 0], [0, 1, 2, 3, 4]])
    assert seg.dtype == pos.dtype == jnp.int32


def test_segments_and_positions_under_jit():
    mask = jnp.array([[0, 1, 1], [1, 1, 0]])
    seg, pos = jax.jit(fhf.segments_and_positions)(mask)
    np.testing.assert_array_equal(pos, [[0, 0, 1], [0, 1, 0]])
    np.testing.assert_array_equal(seg, [[-1, 0, 0], [0, 0, -1]])


def test_padded_row_equals_the_unpadded_sequence():
    # A left-padded row through the layer gives the unpadded sequence's outputs on its real tokens.
    config = fa.AttentionConfig(d_model=8, num_heads=2, rope_scaling={"kind": "dynamic", "factor": 2.0,
                                                                      "original_max_position_embeddings": 2})
    layer = fa.Attention(config)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 5, 8)))
    params = layer.init(jax.random.key(0), x, jnp.arange(5)[None])
    seg, pos = fhf.segments_and_positions(np.array([[0, 0, 1, 1, 1]]))
    apply = jax.jit(layer.apply)  # one compilation per shape (eagerly, every op compiles)
    padded = apply(params, x, pos, seg)
    alone = apply(params, x[:, 2:], jnp.arange(3)[None])
    np.testing.assert_allclose(padded[:, 2:], alone, rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(padded[:, :2], 0.0)  # padding queries return zeros


@pytest.mark.parametrize("bad, error, match", [
    (np.array([[0, 2, 1]]), ValueError, "only 0 and 1"),
    (np.array([[0.0, 1.0]]), TypeError, "0/1 integers or booleans"),
    (np.array([0, 1]), ValueError, r"\(B, S\)"),
])
def test_segments_and_positions_errors(bad, error, match):
    with pytest.raises(error, match=match):
        fhf.segments_and_positions(bad)
    with pytest.raises(ValueError, match="convention"):
        fhf.segments_and_positions(np.ones((1, 2), int), convention="absolute")


def test_conventions_by_family():
    assert fhf.convention_of({"model_type": "llama"}) == "cumsum"
    assert fhf.convention_of({"model_type": "bloom"}) == "cumsum"
    assert fhf.convention_of({"model_type": "t5"}) == "index"
    assert fhf.convention_of({"model_type": "whisper"}) == "index"


# ----------------------------------------------------------------------------- layouts and errors

def test_fused_indices_by_hand():
    # N = 2, K = 1, H = 2: 8 outputs.
    q, k, v = fhf.fused_indices("concat", 2, 1, 2)
    np.testing.assert_array_equal(q, [0, 1, 2, 3])
    np.testing.assert_array_equal(k, [4, 5])
    np.testing.assert_array_equal(v, [6, 7])
    q, k, v = fhf.fused_indices("per_group", 2, 1, 2)   # one group: q0 q1 k v
    np.testing.assert_array_equal(q, [0, 1, 2, 3])
    np.testing.assert_array_equal(k, [4, 5])
    np.testing.assert_array_equal(v, [6, 7])
    q, k, v = fhf.fused_indices("per_group", 4, 2, 1)   # two groups of (q, q, k, v)
    np.testing.assert_array_equal(q, [0, 1, 4, 5])
    np.testing.assert_array_equal(k, [2, 6])
    np.testing.assert_array_equal(v, [3, 7])
    q, k, v = fhf.fused_indices("per_head", 2, 2, 2)    # head 0: q q k k v v, head 1: ...
    np.testing.assert_array_equal(q, [0, 1, 6, 7])
    np.testing.assert_array_equal(k, [2, 3, 8, 9])
    np.testing.assert_array_equal(v, [4, 5, 10, 11])
    for layout, (N, K) in (("concat", (4, 2)), ("per_head", (3, 3)), ("per_group", (6, 2))):
        allidx = np.concatenate(fhf.fused_indices(layout, N, K, 5))
        np.testing.assert_array_equal(np.sort(allidx), np.arange((N + 2 * K) * 5))  # a permutation
    with pytest.raises(ValueError, match="per_head layout has one key/value head per query head"):
        fhf.fused_indices("per_head", 4, 2, 2)


def test_missing_features_name_them():
    # No family lacks a feature today; the mechanism still names what a config would need.
    assert fhf.MISSING_FEATURES == {}
    family = dataclasses.replace(fhf.family_of({"model_type": "llama"}), missing=lambda c: ["sketch"])
    with mock.patch.dict(fhf.MISSING_FEATURES, {"sketch": "a feature flax_attn lacks"}):
        with pytest.raises(NotImplementedError, match="sketch: a feature flax_attn lacks"):
            fhf.families.check_supported(family, {"model_type": "llama"})


def test_unknown_family_and_bad_weights():
    with pytest.raises(NotImplementedError, match="no flax_attn.hf family for model_type='mamba'"):
        fhf.load_attention({"model_type": "mamba"}, {})
    config = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
              "max_position_embeddings": 16, "rope_theta": 100.0}
    with pytest.raises(KeyError, match="layers.0.self_attn.q_proj.weight"):
        fhf.load_attention(config, {"lm_head.weight": np.zeros((3, 8))})
    weights = _llama_weights(np.random.default_rng(0))
    with pytest.raises(KeyError, match="missing weight 'model.layers.0.self_attn.o_proj.weight'"):
        fhf.load_attention(config, {k: v for k, v in weights.items() if "o_proj" not in k})
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 8))
    with pytest.raises(ValueError, match=r"k_proj/kernel: shape \(8, 8\) \(the checkpoint's "
                                         r"model.layers.0.self_attn.k_proj.weight, stored \(8, 8\)\), the layer needs "
                                         r"\(8, 4\)"):
        fhf.load_attention(config, weights)


def test_layer_counts_dtypes_and_written_shapes_are_checked():
    """The weights must hold the layers the config declares; weights must be floating-point;
    to_hf_weights checks the params it writes against their config."""
    weights = _llama_weights(np.random.default_rng(0), layers=2)
    with pytest.raises(ValueError, match=r"declares num_hidden_layers=3 but the weights hold 2 layers of "
                                         r"model.layers.\{i\}.self_attn"):
        fhf.load_attention({**LLAMA, "num_hidden_layers": 3}, weights)
    with pytest.raises(ValueError, match="declares n_layer=1"):
        fhf.load_attention({**LLAMA, "n_layer": 1}, weights)
    assert len(fhf.load_attention({**LLAMA, "num_hidden_layers": 2}, weights)) == 2
    # DeepSeek's multi-token-prediction layer past num_hidden_layers is left out, as transformers does
    deep = _deepseek_weights(np.random.default_rng(1))
    deep.update({k.replace("layers.0.", "layers.1."): v for k, v in deep.items()})
    assert len(fhf.load_attention({**DEEPSEEK, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}, deep)) == 1
    with pytest.raises(ValueError, match="declares num_hidden_layers=1 but the weights hold 2"):
        fhf.load_attention({**DEEPSEEK, "num_hidden_layers": 1}, deep)
    ints = {**weights, "model.layers.1.self_attn.q_proj.weight": np.ones((8, 8), np.int64)}
    with pytest.raises(TypeError, match="'model.layers.1.self_attn.q_proj.weight' has dtype int64, not a floating"):
        fhf.load_attention(LLAMA, ints)
    layers = fhf.load_attention(LLAMA, weights)
    narrow = dataclasses.replace(layers[0], params={**layers[0].params, "q_proj": {"kernel": np.zeros((8, 4))}})
    with pytest.raises(ValueError, match=r"q_proj/kernel: shape \(8, 4\), the layer needs \(8, 8\)"):
        fhf.to_hf_weights(LLAMA, [narrow])
    without_k = dataclasses.replace(layers[0], params={k: v for k, v in layers[0].params.items() if k != "k_proj"})
    with pytest.raises(ValueError, match="k_proj: missing"):
        fhf.to_hf_weights(LLAMA, [without_k])


def test_rope_types_without_equivalent_raise():
    with pytest.raises(NotImplementedError, match="RoPE type 'mrope'"):
        fhf.rope_fields({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1.0}}, 8)


# ----------------------------------------------------------------------------- loading by hand

LLAMA = {"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
         "max_position_embeddings": 16, "rope_theta": 100.0,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}}


def _llama_weights(rng, layers=1):
    out = {}
    for i in range(layers):
        p = f"model.layers.{i}.self_attn."
        out[p + "q_proj.weight"] = rng.standard_normal((8, 8))
        out[p + "k_proj.weight"] = rng.standard_normal((4, 8))
        out[p + "v_proj.weight"] = rng.standard_normal((4, 8))
        out[p + "o_proj.weight"] = rng.standard_normal((8, 8))
    return out


def test_llama_by_hand():
    weights = _llama_weights(np.random.default_rng(0), layers=2)
    layers = fhf.load_attention(LLAMA, weights)
    assert [l.name for l in layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    c = layers[0].config
    assert (c.d_model, c.num_heads, c.kv_heads, c.kv_head_dim, c.rope_theta, c.rope_layout) == (8, 2, 1, 4, 100.0,
                                                                                                 "rotate_half")
    assert c.rope_scaling == fa.RopeScaling(kind="linear", factor=2.0) and not c.qkv_bias and not c.out_bias
    np.testing.assert_array_equal(layers[1].params["q_proj"]["kernel"], weights["model.layers.1.self_attn.q_proj.weight"].T)
    back = fhf.to_hf_weights(LLAMA, layers)
    assert back.keys() == weights.keys()
    for k in weights:
        np.testing.assert_array_equal(back[k], weights[k])


def test_safetensors_file_and_dtype(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    weights = {k: v.astype(np.float32) for k, v in _llama_weights(np.random.default_rng(1)).items()}
    path = tmp_path / "model.safetensors"
    safetensors.save_file(weights, str(path))
    layers = fhf.load_attention(LLAMA, path)
    assert layers[0].params["o_proj"]["kernel"].dtype == np.float32
    np.testing.assert_array_equal(layers[0].params["o_proj"]["kernel"], weights["model.layers.0.self_attn.o_proj.weight"].T)
    as64 = fhf.load_attention(LLAMA, str(tmp_path), dtype=np.float64)  # a directory of shards
    assert as64[0].params["q_proj"]["kernel"].dtype == np.float64


def test_sharded_checkpoints_follow_their_index(tmp_path):
    """A directory with a shard index reads each weight from the shard it names (a stray file
    beside it is not read); the index file itself may be given; a shard it lists must exist.
    Without an index, two files holding one name are refused."""
    safetensors = pytest.importorskip("safetensors.numpy")
    weights = {k: v.astype(np.float32) for k, v in _llama_weights(np.random.default_rng(2), layers=2).items()}
    shards = {"model-00001-of-00002.safetensors": [k for k in weights if ".0." in k],
              "model-00002-of-00002.safetensors": [k for k in weights if ".1." in k]}
    for shard, names in shards.items():
        safetensors.save_file({k: weights[k] for k in names}, str(tmp_path / shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: s for s, ns in shards.items() for k in ns}}))
    stray = "model.layers.0.self_attn.q_proj.weight"
    safetensors.save_file({stray: np.zeros((8, 8), np.float32)}, str(tmp_path / "model.safetensors"))
    config = {**LLAMA, "num_hidden_layers": 2}
    for source in (tmp_path, index):
        layers = fhf.load_attention(config, source)
        np.testing.assert_array_equal(layers[0].params["q_proj"]["kernel"], weights[stray].T)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="lists shard model-00002-of-00002.safetensors, which is not in"):
        fhf.load_attention(config, tmp_path)
    os.remove(index)
    with pytest.raises(ValueError, match=rf"weight '{stray}' is in both model-00001-of-00002.safetensors and "
                                         rf"model.safetensors"):
        fhf.load_attention(config, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers of model.layers.\{i\}.self_attn are not numbered 0..0|declares "
                                         r"num_hidden_layers=2 but the weights hold 1"):
        fhf.load_attention(config, tmp_path)


def test_weights_inside_attention_that_the_config_leaves_unused_are_refused():
    """Loading is strict inside the attention modules: a QK-norm the config does not enable, or
    an unknown weight, is listed; the buffers older checkpoints kept there (causal-mask
    buffers, rotary inv_freq) and the weights of other modules are not."""
    weights = _llama_weights(np.random.default_rng(3))
    p = "model.layers.0.self_attn."
    extra = {p + "q_norm.weight": np.ones(4), p + "k_norm.weight": np.ones(4), p + "gate.weight": np.ones((2, 8))}
    with pytest.raises(ValueError, match=r"the config does not use .*:\n  model.layers.0.self_attn.gate.weight \(2, 8\)"
                                         r"\n  model.layers.0.self_attn.k_norm.weight \(4,\)\n  "
                                         r"model.layers.0.self_attn.q_norm.weight \(4,\)$"):
        fhf.load_attention(LLAMA, {**weights, **extra})
    buffers = {p + "rotary_emb.inv_freq": np.ones(2), p + "bias": np.ones((1, 1, 4, 4)), p + "masked_bias": np.ones(()),
               "model.layers.0.mlp.up_proj.weight": np.ones((8, 8)), "model.layers.0.self_attn_norm.weight": np.ones(8)}
    assert len(fhf.load_attention(LLAMA, {**weights, **buffers})) == 1


def test_fused_bias_dtype_and_torch_tensors_are_checked():
    """A fused projection's bias must have its (N + 2K) H features (it was cut, or indexed past
    its end); dtype= must be floating; an array NumPy cannot read is named with the fix."""
    rng = np.random.default_rng(4)
    gpt2 = {"model_type": "gpt2", "n_embd": 8, "n_head": 2, "n_layer": 1, "n_positions": 16}
    weights = {"h.0.attn.c_attn.weight": rng.standard_normal((8, 24)), "h.0.attn.c_attn.bias": rng.standard_normal(24),
               "h.0.attn.c_proj.weight": rng.standard_normal((8, 8)), "h.0.attn.c_proj.bias": rng.standard_normal(8)}
    assert len(fhf.load_attention(gpt2, weights)) == 1
    for n in (30, 20):
        with pytest.raises(ValueError, match=rf"h.0.attn.c_attn.bias has shape \({n},\); N=2, K=2, H=4 need \(24,\)"):
            fhf.load_attention(gpt2, {**weights, "h.0.attn.c_attn.bias": rng.standard_normal(n)})
    with pytest.raises(TypeError, match="dtype must be a floating dtype such as jnp.float32, got int8"):
        fhf.load_attention(gpt2, weights, dtype=np.int8)

    class Unreadable:  # a torch tensor NumPy cannot take (bfloat16, or one that requires grad)
        def __array__(self, *args, **kwargs):
            raise RuntimeError("Can't call numpy() on Tensor that requires grad")

    with pytest.raises(TypeError, match=r"weight 'h.0.attn.c_proj.bias' is not an array NumPy can read \(RuntimeError: "
                                        r"Can't call numpy\(\).*v.detach\(\).float\(\).numpy\(\)"):
        fhf.load_attention(gpt2, {**weights, "h.0.attn.c_proj.bias": Unreadable()})


def test_gemma_norms_and_whisper_missing_bias():
    rng = np.random.default_rng(2)
    gemma = {"model_type": "gemma3_text", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 1,
             "head_dim": 4, "max_position_embeddings": 16, "sliding_window": 2, "query_pre_attn_scalar": 16,
             "layer_types": ["sliding_attention", "full_attention"], "rms_norm_eps": 1e-6,
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}}
    w = _llama_weights(rng, layers=2)
    for i in range(2):
        w[f"model.layers.{i}.self_attn.q_norm.weight"] = np.array([0.5, -0.25, 0.0, 1.0])
        w[f"model.layers.{i}.self_attn.k_norm.weight"] = np.zeros(4)
    sliding, full = fhf.load_attention(gemma, w)
    # Held as stored (w), in a layer that applies 1 + w.
    np.testing.assert_array_equal(sliding.params["q_norm"]["scale"], [0.5, -0.25, 0.0, 1.0])
    assert sliding.config.qk_norm_zero_centered and full.config.qk_norm_zero_centered
    # A layer holding plain weights (1 + w) is written back in Gemma's convention (w).
    plain = dataclasses.replace(sliding.config, qk_norm_zero_centered=False)
    plain_params = {**sliding.params, "q_norm": {"scale": np.array([1.5, 0.75, 1.0, 2.0])},
                    "k_norm": {"scale": np.ones(4)}}
    back = fhf.to_hf_weights(gemma, [(sliding.name, plain, plain_params)])
    np.testing.assert_array_equal(back["model.layers.0.self_attn.q_norm.weight"], [0.5, -0.25, 0.0, 1.0])
    np.testing.assert_array_equal(back["model.layers.0.self_attn.k_norm.weight"], np.zeros(4))
    assert (sliding.config.sliding_window, sliding.config.rope_theta) == (2, 10.0)
    assert (full.config.sliding_window, full.config.rope_theta) == (None, 1000.0)
    assert sliding.config.scale == 0.25 and sliding.config.qk_norm
    whisper = {"model_type": "whisper", "d_model": 4, "encoder_attention_heads": 2, "decoder_attention_heads": 2}
    w = {}
    for path in ("model.encoder.layers.0.self_attn", "model.decoder.layers.0.self_attn",
                 "model.decoder.layers.0.encoder_attn"):
        for n in ("q_proj", "k_proj", "v_proj", "out_proj"):
            w[f"{path}.{n}.weight"] = rng.standard_normal((4, 4))
            if n != "k_proj":
                w[f"{path}.{n}.bias"] = rng.standard_normal(4)
    layers = fhf.load_attention(whisper, w)
    assert [(l.stack, l.kind) for l in layers] == [("encoder", "self"), ("decoder", "self"), ("decoder", "cross")]
    assert [l.config.causal for l in layers] == [False, True, False]
    assert "bias" not in layers[0].params["k_proj"] and "bias" in layers[0].params["v_proj"]
    assert all(l.config.qkv_bias == (True, False, True) for l in layers)
    assert fhf.to_hf_weights(whisper, layers).keys() == w.keys()
    layers[0].params["k_proj"]["bias"] = np.ones(4)
    with pytest.raises(ValueError, match="Whisper's k_proj has no bias"):
        fhf.to_hf_weights(whisper, layers)


def test_flax_attn_hf_imports_neither_torch_nor_transformers():
    code = ("import sys, flax_attn, flax_attn.hf; "
            "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True, text=True,
                         check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# ----------------------------------------------------------------------------- DeepSeek, Llama 4, Falcon-RW

# DeepSeek-V3's config.json keys (its own sizes shrunk): rope_scaling in the pre-v5 form.
DEEPSEEK = {"model_type": "deepseek_v3", "hidden_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2,
            "q_lora_rank": 6, "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 4, "v_head_dim": 3,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "attention_bias": False,
            "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def _deepseek_weights(rng, q_lora=True, bias=False):
    p = "model.layers.0.self_attn."
    shapes = {"kv_a_proj_with_mqa.weight": (8, 8), "kv_a_layernorm.weight": (4,), "kv_b_proj.weight": (10, 4),
              "o_proj.weight": (8, 6)}
    shapes.update({"q_a_proj.weight": (6, 8), "q_a_layernorm.weight": (6,), "q_b_proj.weight": (12, 6)} if q_lora
                  else {"q_proj.weight": (12, 8)})
    if bias:
        shapes.update({"q_a_proj.bias": (6,), "kv_a_proj_with_mqa.bias": (8,), "o_proj.bias": (8,)})
    out = {p + k: rng.standard_normal(v) for k, v in shapes.items()}
    out["model.layers.0.mlp.gate_proj.weight"] = rng.standard_normal((3, 8))  # not attention: ignored
    return out


def test_deepseek_by_hand():
    rng = np.random.default_rng(3)
    weights = _deepseek_weights(rng, bias=True)
    (layer,) = fhf.load_attention(DEEPSEEK, weights)
    c = layer.config
    assert isinstance(c, MLAConfig) and isinstance(layer.module(), MultiHeadLatentAttention)
    assert (c.d_model, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
            c.v_head_dim) == (8, 2, 6, 4, 2, 4, 3)
    assert c.rope_layout == "interleaved" and c.attention_bias and c.causal
    assert c.rms_norm_eps == 1e-6  # q_a_layernorm/kv_a_layernorm take their default, not rms_norm_eps
    assert (c.rope_scaling.kind, c.rope_scaling.factor, c.rope_scaling.mscale_all_dim) == ("yarn", 40.0, 1.0)
    m = 0.1 * 1.0 * math.log(40.0) + 1.0                      # DeepSeek's yarn_get_mscale(40, 1)
    assert c.softmax_scale == pytest.approx(m * m / math.sqrt(2 + 4), rel=1e-15)
    p = "model.layers.0.self_attn."
    np.testing.assert_array_equal(layer.params["kv_b_proj"]["kernel"], weights[p + "kv_b_proj.weight"].T)
    np.testing.assert_array_equal(layer.params["q_a_layernorm"]["scale"], weights[p + "q_a_layernorm.weight"])
    np.testing.assert_array_equal(layer.params["o_proj"]["bias"], weights[p + "o_proj.bias"])
    back = fhf.to_hf_weights(DEEPSEEK, [layer])
    assert back.keys() == {k for k in weights if ".self_attn." in k}
    for k, v in back.items():
        np.testing.assert_array_equal(v, weights[k])
    # Without q_lora_rank: one q_proj; rope_interleave=False: rotate-half; no bias in the checkpoint.
    plain = {**DEEPSEEK, "q_lora_rank": None, "rope_interleave": False}
    weights = _deepseek_weights(rng, q_lora=False)
    (layer,) = fhf.load_attention(plain, weights)
    assert layer.config.q_lora_rank is None and layer.config.rope_layout == "rotate_half"
    assert not layer.config.attention_bias and set(layer.params) == {"q_proj", "kv_a_proj_with_mqa",
                                                                      "kv_a_layernorm", "kv_b_proj", "o_proj"}
    assert fhf.to_hf_weights(plain, [layer]).keys() == {k for k in weights if ".self_attn." in k}
    # DeepSeek-V2 rotates interleaved pairs always (complex multiplication).
    assert fhf.load_attention({**plain, "model_type": "deepseek_v2"}, weights)[0].config.rope_layout == "interleaved"
    weights[p + "kv_b_proj.weight"] = np.zeros((9, 4))
    with pytest.raises(ValueError, match=r"kv_b_proj/kernel: shape \(4, 9\), the layer needs \(4, 10\)"):
        fhf.load_attention(plain, weights)
    with pytest.raises(KeyError, match="q_a_proj.weight"):  # a q_lora_rank config needs the low-rank query
        fhf.load_attention(DEEPSEEK, _deepseek_weights(rng, q_lora=False))


# Llama 4's composite config (text_config inside), 4 layers: no_rope_layers by its default interval.
LLAMA4 = {"model_type": "llama4", "vision_config": {"hidden_size": 8},
          "text_config": {"model_type": "llama4_text", "hidden_size": 8, "num_attention_heads": 2,
                          "num_key_value_heads": 1, "head_dim": 4, "num_hidden_layers": 4, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 64, "attention_chunk_size": 16, "use_qk_norm": True,
                          "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                          "rope_theta": 500000.0}}


def test_llama4_by_hand():
    rng = np.random.default_rng(4)
    weights = {f"language_model.{k}": v for k, v in _llama_weights(rng, layers=4).items()}
    # The vision tower has attention modules of the same shape under the same template: skipped.
    weights.update({f"vision_model.{k}": v for k, v in _llama_weights(rng, layers=1).items()})
    layers = fhf.load_attention(LLAMA4, weights)
    assert [l.name for l in layers] == [f"language_model.model.layers.{i}.self_attn" for i in range(4)]
    for rope in layers[:3]:  # no_rope_layer_interval = 4: layers 0, 1, 2 rotate, layer 3 does not
        c = rope.config
        assert (c.position, c.rope_layout, c.rope_theta, c.rope_scaling.kind) == ("rope", "interleaved", 500000.0,
                                                                                  "llama3")
        assert (c.chunk_size, c.qk_norm, c.qk_norm_weight, c.qk_norm_eps) == (16, True, False, 1e-5)
        assert c.temperature_tuning is None and "q_norm" not in rope.params  # the L2 norm has no weight
    nope = layers[3].config
    assert (nope.position, nope.chunk_size, nope.qk_norm, nope.temperature_tuning) == ("none", None, False,
                                                                                      (8192.0, 0.1))
    back = fhf.to_hf_weights(LLAMA4, layers)
    assert back.keys() == {k for k in weights if k.startswith("language_model.")}
    # The text model alone, with explicit flags: no QK-norm, no temperature tuning, NoPE first.
    text = {**LLAMA4["text_config"], "use_qk_norm": False, "attn_temperature_tuning": False,
            "no_rope_layers": [0, 1], "num_hidden_layers": 2}
    a, b = fhf.load_attention(text, _llama_weights(rng, layers=2))
    assert (a.config.position, a.config.temperature_tuning, b.config.position, b.config.qk_norm) == \
        ("none", None, "rope", False)


def test_falcon_rw_alibi_fields():
    config = {"model_type": "falcon", "hidden_size": 8, "num_attention_heads": 2, "alibi": True,
              "multi_query": False, "new_decoder_architecture": False, "bias": True}
    w = {"transformer.h.0.self_attention.query_key_value.weight": np.random.default_rng(5).standard_normal((24, 8)),
         "transformer.h.0.self_attention.dense.weight": np.zeros((8, 8))}
    (layer,) = fhf.load_attention(config, w)
    assert (layer.config.position, layer.config.alibi_scaled, layer.config.kv_heads) == ("alibi", True, 2)
    # per_head layout: head 0's q, k, v rows, then head 1's.
    np.testing.assert_array_equal(layer.params["k_proj"]["kernel"][:, :4], w[
        "transformer.h.0.self_attention.query_key_value.weight"][4:8].T)
