"""The attention chapter, step by step, in JAX with flax_attn.

Each step prints what flax_attn computes next to what the chapter printed. The trainable
examples need the chapter's weights, which it draws with ``torch.manual_seed``; PyTorch
(through ``torch_ref``) is used for that alone, and the weights are converted with
``flax_attn.from_torch_state_dict``. Everything else runs in JAX.

    python examples/chapter_walkthrough.py
"""
import jax
import jax.numpy as jnp
import numpy as np
import torch

import flax_attn as fa
import torch_ref

np.set_printoptions(precision=4, suppress=True)
CHECKS = []


def show(label, ours, printed):
    ours = np.round(np.asarray(ours, np.float64), 4)
    ok = bool(np.all(np.abs(ours - np.asarray(printed)) <= 0.5e-4 + 1e-7))
    CHECKS.append(ok)
    flat = ours.reshape(-1)[:6]
    more = " ..." if ours.size > 6 else ""
    print(f"  {'ok ' if ok else 'BAD'} {label:<44} {np.array2string(flat, separator=', ')}{more}")


def chapter_weights(seed, torch_cls, flax_module, *args):
    torch.manual_seed(seed)
    twin = torch_cls(*args)
    return fa.from_torch_state_dict(flax_module, torch_ref.state_dict_to_numpy(twin.state_dict()))


inputs = jnp.array([[0.43, 0.15, 0.89],   # Your
                    [0.55, 0.87, 0.66],   # journey
                    [0.57, 0.85, 0.64],   # starts
                    [0.22, 0.58, 0.33],   # with
                    [0.77, 0.25, 0.10],   # one
                    [0.05, 0.80, 0.55]])  # step
batch = jnp.stack([inputs, inputs])

print("3.3 Attention without trainable weights (query: 'journey')")
scores_2 = fa.basics.attention_scores(inputs[1], inputs)
show("scores, matrix form", scores_2, [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
show("scores, loop form", fa.basics.attention_scores_loop(inputs[1], inputs), [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])
show("weights, normalised by the sum", fa.basics.normalize_by_sum(scores_2), [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])
show("weights, naive softmax", fa.basics.softmax_naive(scores_2), [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
show("weights, softmax", fa.basics.softmax(scores_2), [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])
print("     naive softmax of [89, 88] in float32:", fa.basics.softmax_naive(jnp.array([89.0, 88.0])),
      " stable:", fa.basics.softmax(jnp.array([89.0, 88.0])))
weights_2 = fa.basics.softmax(scores_2)
show("context z2, loop form", fa.basics.context_vectors_loop(weights_2, inputs), [0.4419, 0.6515, 0.5683])
contexts, weights = fa.basics.self_attention_without_weights(inputs)
show("all contexts (row 2)", contexts[1], [0.4419, 0.6515, 0.5683])
show("all weights (row 1)", weights[0], [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452])

print("\n'Hello shiny sun': context for 'shiny'")
hello = jnp.array([[0.34, 0.22, 0.54], [0.53, 0.34, 0.98], [0.29, 0.54, 0.93]])
show("context (page, hand-rounded: .3992 .3858 .861)",
     fa.basics.context_vectors(fa.basics.softmax(fa.basics.attention_scores(hello[1], hello)), hello),
     [0.3990, 0.3854, 0.8610])

print("\n3.4 Self-attention with trainable weights (torch.manual_seed(123) weights)")
v1 = fa.SelfAttention_v1(3, 2)
v1_vars = chapter_weights(123, torch_ref.SelfAttention_v1, v1, 3, 2)
W = v1_vars["params"]
query_2 = inputs[1] @ W["W_query"]
keys, values = inputs @ W["W_key"], inputs @ W["W_value"]
show("query_2", query_2, [0.4306, 1.4551])
show("attn_score_22", query_2 @ keys[1], 1.8524)
weights_2 = fa.basics.softmax(query_2 @ keys.T / 2 ** 0.5)
show("attn_weights_2", weights_2, [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820])
show("context_vec_2", weights_2 @ values, [0.3061, 0.8210])
show("SelfAttention_v1 (row 1)", v1.apply(v1_vars, inputs)[0], [0.2996, 0.8053])

v2 = fa.SelfAttention_v2(3, 2)
v2_vars = chapter_weights(789, torch_ref.SelfAttention_v2, v2, 3, 2)
show("SelfAttention_v2, seed 789 (row 1)", v2.apply(v2_vars, inputs)[0], [-0.0739, 0.0713])
v1_from_v2 = {"params": {n: v2_vars["params"][n]["kernel"] for n in ("W_query", "W_key", "W_value")}}
show("v1 with v2's weights (row 1)", v1.apply(v1_from_v2, inputs)[0], [-0.0739, 0.0713])

print("\n3.5 Causal attention (v2's weights)")
P = v2_vars["params"]
scores = (inputs @ P["W_query"]["kernel"]) @ (inputs @ P["W_key"]["kernel"]).T
by_renormalizing = fa.basics.causal_weights_by_renormalizing(fa.basics.softmax(scores / 2 ** 0.5))
by_masking = fa.basics.causal_weights_by_masking(scores, scale=2 ** -0.5)
show("zero above the diagonal, renormalise (row 2)", by_renormalizing[1], [0.5517, 0.4483, 0, 0, 0, 0])
show("block before softmax (row 3)", by_masking[2], [0.3800, 0.3097, 0.3103, 0, 0, 0])
print("     the two ways agree to", float(jnp.abs(by_renormalizing - by_masking).max()))
drop = fa.dropout(jnp.ones((6, 6)), 0.5, jax.random.key(0))
print(f"     dropout(0.5) on ones: {float((drop == 0).mean()):.2f} of entries zeroed, the rest = {float(drop.max())}")

ca = fa.CausalAttention(3, 2, 6, 0.0)
ca_vars = chapter_weights(123, torch_ref.CausalAttention, ca, 3, 2, 6, 0.0)
out = ca.apply(ca_vars, batch)
print("     CausalAttention output shape", out.shape)
show("CausalAttention, seed 123 (row 1)", out[0, 0], [-0.4519, 0.2216])
show("CausalAttention, seed 123 (row 6)", out[0, 5], [-0.5299, -0.1081])

print("\n3.6 Multi-head attention")
wrapper = fa.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2)
out = wrapper.apply(chapter_weights(123, torch_ref.MultiHeadAttentionWrapper, wrapper, 3, 2, 6, 0.0, 2),
                    batch, deterministic=True)
print("     MultiHeadAttentionWrapper output shape", out.shape)
show("MultiHeadAttentionWrapper (row 1)", out[0, 0], [-0.4519, 0.2216, 0.4772, 0.1063])
mha = fa.MultiHeadAttention(3, 2, 6, 0.0, 2)
out = mha.apply(chapter_weights(123, torch_ref.MultiHeadAttention, mha, 3, 2, 6, 0.0, 2), batch, deterministic=True)
show("MultiHeadAttention (rows 1-3)", out[0, :3], [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593]])
gpt2 = fa.MultiHeadAttention(768, 768, 1024, 0.0, 12)
shapes = jax.eval_shape(lambda: gpt2.init(jax.random.key(0), jnp.zeros((1, 1, 768)), deterministic=True))
print(f"     GPT-2-sized MultiHeadAttention(768, 768, 1024, 0.0, 12): {fa.count_parameters(shapes):,} parameters")

print("\nTransformer notes: scaled_dot_product_attention, causal mask, positional encoding")
Q = jnp.array([[[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]])
V = jnp.array([[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]]])
output, attn = fa.scaled_dot_product_attention(Q, Q, V, fa.create_causal_mask(4))
print("     causal weights, row 2:", attn[0, 1], " output row 1:", output[0, 0])
print("     positional_encoding(4, 8), row 1:", fa.positional_encoding(4, 8)[1])
layer = fa.TransformerMultiHeadAttention(d_model=4, num_heads=2)
cross_k = jnp.ones((1, 5, 4))
variables = layer.init(jax.random.key(42), Q, cross_k, cross_k)
o, w = layer.apply(variables, Q, cross_k, cross_k)
print("     TransformerMultiHeadAttention as cross-attention: output", o.shape, "weights", w.shape)

print(f"\n{sum(CHECKS)} of {len(CHECKS)} printed numbers reproduced.")
if not all(CHECKS):
    raise SystemExit(1)
