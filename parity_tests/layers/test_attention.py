"""The configurable Attention layer (flax_attn.layers.attention): parity with its twin
torch_ref.modern.Attention over a grid of configurations (outputs and gradients, float64 and
float32), and the properties that define each variant in the layer (causality, windows,
segments, relative positions). The same properties of dot_product_attention alone are in
test_attention_variants.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, assert_close, run_parity

D, N = 16, 4
CONFIGS = {
    "mha-rope": {},
    "gqa-rope": {"num_kv_heads": 2},
    "mqa-rope-interleaved": {"num_kv_heads": 1, "rope_layout": "interleaved"},
    "partial-rotary": {"rotary_dim": 2, "rope_layout": "interleaved"},
    "rope-linear": {"rope_scaling": {"kind": "linear", "factor": 2.0}},
    "rope-ntk": {"rope_scaling": {"kind": "ntk", "factor": 2.0}},
    "rope-llama3": {"rope_scaling": {"kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 4}},
    "rope-yarn": {"rope_scaling": {"kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}},
    "alibi": {"position": "alibi", "num_kv_heads": 2},
    "alibi-bidirectional": {"position": "alibi", "causal": False},
    "t5-decoder": {"position": "t5", "t5_num_buckets": 8, "t5_max_distance": 6, "scale": 1.0},
    "t5-encoder": {"position": "t5", "causal": False, "t5_num_buckets": 8, "t5_max_distance": 6},
    "nope": {"position": "none"},
    "nope-bidirectional": {"position": "none", "causal": False},
    "sliding-window": {"sliding_window": 3, "num_kv_heads": 2},
    "sliding-window-bidirectional": {"sliding_window": 2, "causal": False},
    "qk-norm": {"qk_norm": True},
    "softcap": {"logit_softcap": 2.0},
    "biases-head_dim": {"qkv_bias": True, "out_bias": True, "head_dim": 6},
    "everything": {"num_kv_heads": 2, "rope_layout": "interleaved", "sliding_window": 4, "qk_norm": True,
                   "logit_softcap": 3.0, "qkv_bias": True, "out_bias": True},
    # Hugging Face models' variants (their torch twins are written from each model's description).
    "qk-norm-projection-olmo2": {"qk_norm": True, "qk_norm_scope": "projection", "num_kv_heads": 2},
    "qk-layernorm-bias-phi": {"qk_norm": True, "qk_norm_type": "layer", "qk_norm_bias": True, "rotary_dim": 2,
                              "qkv_bias": True, "out_bias": True},
    "qk-norm-per-head-cohere": {"qk_norm": True, "qk_norm_type": "layer", "qk_norm_scope": "per_head",
                                "num_kv_heads": 2, "rope_layout": "interleaved"},
    "qk-norm-zero-centered-gemma": {"qk_norm": True, "qk_norm_zero_centered": True, "num_kv_heads": 2},
    "qk-norm-mixed": {"qk_norm": True, "qk_norm_type": "layer", "qk_norm_scope": "projection",
                      "qk_norm_bias": True, "qk_norm_zero_centered": True, "num_kv_heads": 1},
    "bias-q-v-whisper": {"qkv_bias": (True, False, True), "out_bias": True, "position": "none", "causal": False},
    "sinks-gpt-oss": {"sinks": True, "num_kv_heads": 2, "sliding_window": 3, "qkv_bias": True, "out_bias": True},
    # Llama 4: chunks of 4 positions (straddled by both rows), its weightless QK-norm (applied after
    # RoPE by the twin, before it by the layer: the same function), interleaved RoPE, and the
    # temperature tuning of its NoPE layers (here on a RoPE layer, so one case covers all four).
    "chunked-l2norm-temperature-llama4": {"chunk_size": 4, "num_kv_heads": 2, "qk_norm": True,
                                          "qk_norm_weight": False, "rope_layout": "interleaved",
                                          "temperature_tuning": (2.0, 0.5)},
    # Falcon-RW: ALiBi added to q.k before the scale 1/sqrt(H) = 1/2 multiplies both.
    "alibi-scaled-falcon": {"position": "alibi", "alibi_scaled": True, "qkv_bias": True, "out_bias": True},
}
# Norm weights start at ones (zeros when zero-centred) and sinks at random: these cases move every
# parameter off its initial value, so that a weight applied to the wrong head or feature shows.
PERTURBED = {name for name in CONFIGS if name.endswith(("-olmo2", "-phi", "-cohere", "-gemma", "-mixed",
                                                       "-whisper", "-gpt-oss"))}


def pair(cfg, seed=0, perturb=False):
    torch.manual_seed(seed)
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, **cfg))
    twin = tr.twin(layer)
    if perturb:
        with torch.no_grad():
            for p in twin.parameters():
                p.add_(0.5 * torch.randn_like(p))
    return twin, layer


def inputs(B=2, T=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, D))
    positions = np.arange(T)[None] + np.array([[0], [3]])[:B]  # the second row starts at an offset
    return x, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_parity(name, dtype):
    x, positions = inputs()
    t, f = pair(CONFIGS[name], perturb=name in PERTURBED)
    run_parity(t, f, (x, positions), dtype, flax_kwargs={"deterministic": True}, eager=name == "everything")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["mha-rope", "gqa-rope", "alibi", "t5-decoder", "sliding-window", "everything",
                                  "sinks-gpt-oss"])
def test_layer_parity_packed_and_padded(name, dtype):
    # Two sequences packed in row 0; row 1 is one sequence right-padded with -1 (padding).
    x, _ = inputs()
    segments = np.array([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, -1, -1]])
    positions = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 0, 0]])  # restart per segment
    t, f = pair(CONFIGS[name], perturb=name in PERTURBED)
    run_parity(t, f, (x, positions, segments), dtype, flax_kwargs={"deterministic": True})


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_parity_extra_mask(dtype):
    x, positions = inputs()
    mask = np.random.default_rng(5).random((2, 1, 6, 6)) < 0.5
    mask |= np.eye(6, dtype=bool)
    t, f = pair(CONFIGS["gqa-rope"])
    run_parity(t, f, (x, positions, None, None, None, None, mask), dtype, flax_kwargs={"deterministic": True})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("position", ["rope", "alibi", "t5", "none"])
def test_cross_attention_parity(position, dtype):
    # T = 4 queries attend to S = 9 context tokens of another sequence, with their own positions.
    rng = np.random.default_rng(6)
    x, context = rng.standard_normal((2, 4, D)), rng.standard_normal((2, 9, D))
    positions = np.arange(4)[None].repeat(2, 0)
    context_positions = np.arange(9)[None].repeat(2, 0)
    t, f = pair({"position": position, "causal": False, "num_kv_heads": 2})
    run_parity(t, f, (x, positions, None, context, context_positions), dtype,
               flax_kwargs={"deterministic": True}, eager=position == "rope")


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_layer_in_eval_mode(dtype):
    x, positions = inputs()
    t, f = pair({"dropout": 0.3})
    run_parity(t.eval(), f, (x, positions), dtype, flax_kwargs={"deterministic": True})


# ----------------------------------------------------------------------------- properties

def _layer(cfg, T=8, B=1, seed=0):
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, **cfg))
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)))
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    return layer, layer.init(jax.random.key(seed), x, positions), x, positions


def _jacobian(layer, params, x, positions, **kw):
    """d out[0, t, :] / d x[0, s, :], summed over features: (T, S) of max |entries|."""
    jac = jax.jit(jax.jacrev(lambda a: layer.apply(params, a, positions, **kw)))(x)  # (1, T, D, 1, T, D)
    return np.abs(np.asarray(jac[0, :, :, 0])).max(axis=(1, 3))


@pytest.mark.parametrize("name", ["mha-rope", "gqa-rope", "alibi", "t5-decoder", "nope", "everything"])
def test_causality_by_gradients(name):
    layer, params, x, positions = _layer(CONFIGS[name])
    dep = _jacobian(layer, params, x, positions)
    t, s = np.indices(dep.shape)
    future = s > t
    visible = ~future & (t - s < CONFIGS[name].get("sliding_window", dep.shape[0]))
    assert (dep[future] == 0).all(), "an output depends on a later input"
    assert (dep[visible] > 0).all(), "an output ignores an input it may see"


@pytest.mark.parametrize("window, causal", [(1, True), (3, True), (2, False), (4, False)])
def test_window_never_attends_outside_itself(window, causal):
    layer, params, x, positions = _layer({"sliding_window": window, "causal": causal})
    dep = _jacobian(layer, params, x, positions)
    t, s = np.indices(dep.shape)
    inside = (t - s < window) & (t - s >= 0) if causal else np.abs(t - s) < window
    assert (dep[~inside] == 0).all()
    assert (dep[inside] > 0).all()


@pytest.mark.parametrize("name", ["mha-rope", "alibi", "t5-encoder", "sliding-window", "everything"])
def test_segment_ids_never_leak(name):
    layer, params, x, _ = _layer(CONFIGS[name], T=8)
    segments = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = jnp.array([[0, 1, 2, 0, 1, 0, 1, 2]])
    dep = _jacobian(layer, params, x, positions, segment_ids=segments)
    same = np.equal.outer(np.asarray(segments[0]), np.asarray(segments[0]))
    assert (dep[~same] == 0).all()
    # Packed equals each sequence run on its own (compiled: one program per length, not op by op).
    apply = jax.jit(layer.apply)
    packed = apply(params, x, positions, segments)
    for seg in range(3):
        idx = np.flatnonzero(np.asarray(segments[0]) == seg)
        alone = apply(params, x[:, idx], positions[:, idx])
        assert_close(packed[:, idx], alone, np.float64, f"segment {seg}")


@pytest.mark.parametrize("name", ["mha-rope", "rope-yarn", "alibi", "t5-decoder", "nope", "everything"])
def test_layer_depends_only_on_relative_positions(name):
    layer, params, x, positions = _layer(CONFIGS[name])
    assert_close(layer.apply(params, x, positions + 17), layer.apply(params, x, positions), np.float64, "shifted")


def test_chunks_follow_positions():
    # Llama 4's chunked attention: positions 2..9 in chunks of 3 are the chunks 0 | 1 1 1 | 2 2 2 | 3
    # (by position, not by index); a query sees the keys of its chunk up to itself.
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, chunk_size=3))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, D)))
    positions = jnp.arange(8)[None] + 2
    params = jax.jit(layer.init)(jax.random.key(0), x, positions)
    jac = jax.jit(jax.jacrev(lambda a: layer.apply(params, a, positions)))(x)  # (1, T, D, 1, T, D)
    dep = np.abs(np.asarray(jac[0, :, :, 0])).max(axis=(1, 3))
    chunk = np.array([0, 1, 1, 1, 2, 2, 2, 3])
    t, s = np.indices(dep.shape)
    inside = (s <= t) & (chunk[t] == chunk[s])
    assert (dep[~inside] == 0).all(), "a query sees a key of another chunk (or a later one)"
    assert (dep[inside] > 0).all()


def test_temperature_factor_numbers():
    # Llama 4's defaults floor_scale=8192, attn_scale=0.1: 1 below position 8191, then 1 + 0.1 ln(1 + k)
    # from position k * 8192 - 1 on.
    from flax_attn.layers.attention import temperature_factor
    p = jnp.array([[0, 8190, 8191, 16382, 16383, 24575]])
    want = [1.0, 1.0, 1 + 0.1 * np.log(2), 1 + 0.1 * np.log(2), 1 + 0.1 * np.log(3), 1 + 0.1 * np.log(4)]
    np.testing.assert_allclose(temperature_factor((8192.0, 0.1), p, jnp.float64)[0], want, rtol=1e-15)


def test_weightless_qk_norm_has_no_parameters():
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, qk_norm=True, qk_norm_weight=False))
    params = jax.eval_shape(layer.init, jax.random.key(0), jnp.zeros((1, 2, D)), jnp.arange(2)[None])
    assert sorted(params["params"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_rope_layer_takes_int64_positions_past_int32():
    """With 64-bit integers on (as this suite runs), the layer rotates by int64 positions as
    given, past 2**31 too: equal to its twin in float64 (they were cut to int32)."""
    layer = fa.Attention(fa.AttentionConfig(d_model=8, num_heads=2, position="rope"))
    x = np.random.default_rng(0).standard_normal((1, 3, 8))
    twin = tr.twin(layer).double()
    params = fa.from_torch_state_dict(layer, tr.state_dict_to_numpy(twin.state_dict()), dtype=jnp.float64)
    for start in (2**31 - 2, 2**33):
        positions = np.arange(start, start + 3, dtype=np.int64)[None]
        got = layer.apply(params, jnp.asarray(x), jnp.asarray(positions))
        want = twin(torch.tensor(x), torch.tensor(positions)).detach().numpy()
        assert_close(got, want, np.float64, f"positions from {start}")
