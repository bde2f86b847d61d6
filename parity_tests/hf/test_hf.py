"""flax_attn.hf without transformers: the padding helper by hand, fused layouts by index, the
missing-feature errors, safetensors files written from NumPy, and the import boundary."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
import flax_attn.hf as fhf


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
    padded = layer.apply(params, x, pos, seg)
    alone = layer.apply(params, x[:, 2:], jnp.arange(3)[None])
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


@pytest.mark.parametrize("config, feature", [
    ({"model_type": "deepseek_v3"}, "multi-head latent attention"),
    ({"model_type": "llama4"}, "chunked attention"),
    ({"model_type": "falcon", "alibi": True}, "ALiBi added before the 1/sqrt"),
])
def test_missing_features_raise_naming_them(config, feature):
    with pytest.raises(NotImplementedError, match=feature):
        fhf.load_attention(config, {})


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
    with pytest.raises(ValueError, match=r"k_proj/kernel: shape \(8, 8\), the layer needs \(8, 4\)"):
        fhf.load_attention(config, weights)


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
