"""A Hugging Face checkpoint's attention layers in flax_attn, in one call.

Writes a tiny Llama-style checkpoint (config.json + model.safetensors) to a temporary directory:
with transformers installed, transformers writes it (LlamaForCausalLM.save_pretrained); without,
the same file layout is written from NumPy. Then:

    layers = fa.hf.load_attention(config, "model.safetensors")

gives each layer's AttentionConfig (MLAConfig for DeepSeek) and params, and
``layers[i].module()`` the flax_attn layer that runs them; a left-padded batch goes through layer 0 with
the HF attention_mask turned into segment ids and positions, once in full and once as prefill +
decode with the KV cache (they agree), and, with transformers, against transformers' own layer.

    python examples/hf_checkpoint.py            # --numpy: write the files from NumPy even with transformers
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import flax_attn as fa  # noqa: E402
import flax_attn.hf  # noqa: E402,F401  (the hf package)

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}


def write_with_transformers(directory):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("model_type", "architectures")})
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config).double().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def write_with_numpy(directory):
    """The same files without transformers: config.json and the attention weights in safetensors."""
    rng = np.random.default_rng(0)
    D, N, K = CONFIG["hidden_size"], CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    H = D // N
    weights = {}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        for name, rows in (("q_proj", N * H), ("k_proj", K * H), ("v_proj", K * H), ("o_proj", D)):
            weights[p + name + ".weight"] = rng.normal(0, 0.2, (rows, D if name != "o_proj" else N * H))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    try:
        from safetensors.numpy import save_file
    except ImportError:
        np.savez(os.path.join(directory, "weights.npz"), **weights)
        return None
    save_file(weights, os.path.join(directory, "model.safetensors"))
    return None


def main():
    try:
        import transformers  # noqa: F401
        have_transformers = "--numpy" not in sys.argv
    except ImportError:
        have_transformers = False
    with tempfile.TemporaryDirectory() as directory:
        model = write_with_transformers(directory) if have_transformers else write_with_numpy(directory)
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
        source = os.path.join(directory, "model.safetensors")
        if not os.path.exists(source):  # no safetensors package: the mapping form
            source = dict(np.load(os.path.join(directory, "weights.npz")))
        layers = fa.hf.load_attention(config, source)
    print(f"loaded {len(layers)} attention layers from a {config['model_type']} checkpoint"
          f" ({'written by transformers' if have_transformers else 'written from NumPy'})")
    first = layers[0]
    print(f"{first.name}: {first.config}")

    mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1],     # left padding, as for batched generation
                     [1, 1, 1, 1, 1, 1, 1, 1]])
    segment_ids, positions = fa.hf.segments_and_positions(mask)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, CONFIG["hidden_size"])))
    layer = first.module()  # fa.Attention here (MultiHeadLatentAttention for a DeepSeek checkpoint)
    variables = {"params": jax.tree_util.tree_map(jnp.asarray, first.params)}
    full = layer.apply(variables, x, positions, segment_ids)

    cache = first.config.init_cache(batch=2, max_len=8, dtype=jnp.float64)
    out, cache = layer.apply(variables, x[:, :5], positions[:, :5], segment_ids[:, :5], cache=cache)  # prefill
    steps = [out]
    for t in range(5, 8):                                                                             # decode
        out, cache = layer.apply(variables, x[:, t:t + 1], positions[:, t:t + 1], segment_ids[:, t:t + 1], cache=cache)
        steps.append(out)
    real = mask.astype(bool)
    decode_err = float(np.abs(np.asarray(jnp.concatenate(steps, axis=1) - full))[real].max())
    same = decode_err < 1e-12
    print(f"prefill + 3 decode steps vs full pass: max abs difference {decode_err:.1e} -> same: {same}")

    ok = same
    if have_transformers:
        import torch
        captured = {}
        attn = model.get_submodule(first.name)
        hook = attn.register_forward_hook(lambda m, a, k, o: captured.update(x=k["hidden_states"], y=o[0]),
                                          with_kwargs=True)
        m = torch.tensor(mask)
        position_ids = (m.cumsum(-1) - 1).masked_fill(m == 0, 1)
        with torch.no_grad():
            model(input_ids=torch.tensor(np.random.default_rng(2).integers(0, 64, (2, 8))), attention_mask=m,
                  position_ids=position_ids)
        hook.remove()
        ours = layer.apply(variables, captured["x"].numpy(), positions, segment_ids)
        theirs = captured["y"].numpy()
        err = float(np.abs(np.asarray(ours) - theirs)[real].max() / np.abs(theirs[real]).max())
        # transformers computes rotary angles in float32, so agreement is to float32 rounding here
        print(f"layer 0 vs transformers' LlamaAttention (float64 model, float32 rotary angles): "
              f"max relative error {err:.1e}")
        ok = ok and err < 1e-5
    back = fa.hf.to_hf_weights(config, layers)
    print(f"written back under {len(back)} Hugging Face names, e.g. {sorted(back)[0]}")
    print("checkpoint round trip: OK" if ok else "checkpoint round trip: FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
