"""Parity of every system: flax_attn against torch_ref, the same weights and inputs.

For each system and dtype it prints the largest relative error (max|a - b| / max|b|) over the
outputs, over the gradients (w.r.t. the inputs and every parameter), and between jit and
eager, against the tolerance: 1e-12 in float64, 1e-5 in float32 (matmul precision 'highest').

    python examples/parity_table.py
"""
import jax

jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import flax_attn as fa  # noqa: E402
import torch_ref as tr  # noqa: E402
from torch_ref.compare import compare_function, compare_module  # noqa: E402

rng = np.random.default_rng(0)
x2d = rng.standard_normal((7, 4))
x3d = rng.standard_normal((3, 8, 4))
q, kv = rng.standard_normal((2, 5, 12)), rng.standard_normal((2, 9, 12))
causal = np.tril(np.ones((5, 9)), 9 - 5)


def module_case(name, args, inputs, **kw):
    def run(dtype):
        torch.manual_seed(0)
        return compare_module(getattr(tr, name)(*args), getattr(fa, name)(*args), inputs, dtype, eager=True, **kw)
    return run


def layer_case(cfg, packed=False, cross=False):
    """The configurable layer against torch_ref.modern.Attention; x (3, 8, 16)."""
    config = fa.AttentionConfig(d_model=16, num_heads=4, **cfg)
    positions = np.tile(np.arange(8), (3, 1))
    inputs = (x3d.repeat(4, axis=-1), positions)
    if packed:  # row 0 packs two sequences; row 1 is right-padded (segment id -1)
        segments = np.array([[0] * 4 + [1] * 4, [0] * 6 + [-1] * 2, [0] * 8])
        inputs = (inputs[0], np.where(segments == 1, positions - 4, positions), segments)
    if cross:
        inputs = (inputs[0], positions, None, rng.standard_normal((3, 5, 16)), np.tile(np.arange(5), (3, 1)))

    def run(dtype):
        torch.manual_seed(0)
        layer = fa.Attention(config)
        return compare_module(tr.twin(layer), layer, inputs, dtype, flax_kwargs={"deterministic": True}, eager=True)
    return run


CASES = [
    ("attention without weights", lambda d: compare_function(
        tr.basics.self_attention_without_weights, fa.basics.self_attention_without_weights, (x2d,), d, eager=True)),
    ("SelfAttention_v1", module_case("SelfAttention_v1", (4, 3), (x2d,))),
    ("SelfAttention_v2 (qkv_bias)", module_case("SelfAttention_v2", (4, 3, True), (x2d,))),
    ("causal weights, renormalised", lambda d: compare_function(
        tr.basics.causal_weights_by_renormalizing, fa.basics.causal_weights_by_renormalizing, (np.abs(x2d[:4, :4]) + .1,), d, eager=True)),
    ("causal weights, masked", lambda d: compare_function(
        tr.basics.causal_weights_by_masking, fa.basics.causal_weights_by_masking, (x2d[:4, :4],), d, eager=True)),
    ("CausalAttention", module_case("CausalAttention", (4, 3, 8, 0.0), (x3d,),
                                    flax_kwargs={"deterministic": True})),
    ("MultiHeadAttentionWrapper", module_case("MultiHeadAttentionWrapper", (4, 3, 8, 0.0, 2), (x3d,),
                                              flax_kwargs={"deterministic": True})),
    ("MultiHeadAttention", module_case("MultiHeadAttention", (4, 6, 8, 0.0, 3), (x3d,),
                                       flax_kwargs={"deterministic": True})),
    ("scaled_dot_product_attention", lambda d: compare_function(
        lambda a, b, c: tr.scaled_dot_product_attention(a, b, c, torch.from_numpy(causal)),
        lambda a, b, c: fa.scaled_dot_product_attention(a, b, c, jnp.asarray(causal, bool)), (q, kv, kv), d, eager=True)),
    ("TransformerMHA (cross, masked)", module_case(
        "TransformerMultiHeadAttention", (12, 3), (q, kv, kv),
        torch_call_kwargs={"mask": torch.from_numpy(causal)}, flax_kwargs={"mask": jnp.asarray(causal, bool)})),
    ("Attention: GQA + RoPE", layer_case({"num_kv_heads": 2})),
    ("Attention: MQA + interleaved RoPE", layer_case({"num_kv_heads": 1, "rope_layout": "interleaved"})),
    ("Attention: RoPE partial + YaRN", layer_case({"rotary_dim": 2, "rope_scaling": {
        "kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}})),
    ("Attention: RoPE Llama 3 scaling", layer_case({"rope_scaling": {
        "kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 4}})),
    ("Attention: sliding window 3", layer_case({"sliding_window": 3})),
    ("Attention: ALiBi", layer_case({"position": "alibi"})),
    ("Attention: T5 bias (encoder)", layer_case({"position": "t5", "causal": False, "t5_num_buckets": 8,
                                                "t5_max_distance": 6})),
    ("Attention: QK-norm + soft-cap", layer_case({"qk_norm": True, "logit_softcap": 2.0})),
    ("Attention: packed + padded", layer_case({"num_kv_heads": 2}, packed=True)),
    ("Attention: cross, NoPE", layer_case({"position": "none", "causal": False}, cross=True)),
    ("positional_encoding (d=7)", lambda d: compare_function(
        lambda p: tr.positional_encoding(50, 7, dtype=p.dtype) + p, lambda p: fa.positional_encoding(50, 7, dtype=p.dtype) + p,
        (np.zeros((50, 7)),), d, eager=True)),
]

print(f"{'system':<34} {'dtype':<8} {'outputs':>9} {'gradients':>10} {'jit':>9} {'tolerance':>9}  result")
all_ok = True
for label, run in CASES:
    for dtype in (np.float64, np.float32):
        ms = run(dtype)
        worst = lambda pred: max((m.error for m in ms if pred(m.what)), default=0.0)
        ok = all(m.ok for m in ms)
        all_ok &= ok
        print(f"{label:<34} {np.dtype(dtype).name:<8} {worst(lambda w: w.startswith('output')):9.1e} "
              f"{worst(lambda w: w.startswith('d loss')):10.1e} {worst(lambda w: w == 'jit vs eager'):9.1e} "
              f"{ms[0].tolerance:9.0e}  {'pass' if ok else 'FAIL'}")
print("\nall within tolerance" if all_ok else "\nSOME SYSTEMS EXCEED THE TOLERANCE")
raise SystemExit(0 if all_ok else 1)
