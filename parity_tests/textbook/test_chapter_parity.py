"""Parity of the chapter's modules: flax_attn against torch_ref with copied weights.

Random weights and inputs; outputs and gradients (to the input and to every parameter);
float64 (max relative error <= 1e-12) and float32 (<= 1e-5); jit equals eager.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, assert_close, run_parity

CONTEXT = 8
# (batch, num_tokens): length 1, a middle length, and the full context.
SHAPES = [(1, 1), (2, 5), (3, CONTEXT)]

MODULES = {
    "CausalAttention": (4, 3, CONTEXT, 0.0),
    "CausalAttention-qkv_bias": (4, 3, CONTEXT, 0.0, True),
    "MultiHeadAttentionWrapper": (4, 3, CONTEXT, 0.0, 3),
    "MultiHeadAttentionWrapper-qkv_bias": (4, 2, CONTEXT, 0.0, 2, True),
    "MultiHeadAttention": (4, 6, CONTEXT, 0.0, 2),
    "MultiHeadAttention-3-heads-qkv_bias": (5, 6, CONTEXT, 0.0, 3, True),
    "MultiHeadAttention-1-head": (4, 4, CONTEXT, 0.0, 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, tokens", SHAPES)
@pytest.mark.parametrize("case", sorted(MODULES))
def test_batched_modules(case, batch, tokens, dtype):
    name, args = case.split("-")[0], MODULES[case]
    torch.manual_seed(sum(map(ord, case)) + batch)
    torch_module = getattr(tr, name)(*args)
    x = np.random.default_rng(batch * 10 + tokens).standard_normal((batch, tokens, args[0]))
    run_parity(torch_module, getattr(fa, name)(*args), (x,), dtype, flax_kwargs={"deterministic": True},
               eager=(batch, tokens) == SHAPES[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 4, 7])
@pytest.mark.parametrize("name, args", [("SelfAttention_v1", (4, 3)), ("SelfAttention_v2", (4, 3)),
                                        ("SelfAttention_v2", (4, 3, True))])
def test_self_attention(name, args, tokens, dtype):
    torch.manual_seed(tokens)
    x = np.random.default_rng(tokens).standard_normal((tokens, args[0]))
    run_parity(getattr(tr, name)(*args), getattr(fa, name)(*args), (x,), dtype, eager=tokens == 4)


@pytest.mark.parametrize("name", ["SelfAttention_v1", "SelfAttention_v2"])
def test_self_attention_batched_equals_each_item(name):
    m = getattr(fa, name)(4, 3)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 4)), jnp.float32)
    v = m.init(jax.random.key(0), x)
    batched = m.apply(v, x)
    for i in range(3):
        assert_close(batched[i], m.apply(v, x[i]), np.float32, f"item {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, args", [("CausalAttention", (4, 3, CONTEXT, 0.3)),
                                        ("MultiHeadAttention", (4, 6, CONTEXT, 0.5, 2)),
                                        ("MultiHeadAttentionWrapper", (4, 3, CONTEXT, 0.2, 2))])
def test_dropout_modules_in_eval_mode_match_deterministic(name, args, dtype):
    # torch's eval() disables dropout; flax_attn's deterministic=True does the same.
    torch.manual_seed(1)
    torch_module = getattr(tr, name)(*args).eval()
    x = np.random.default_rng(2).standard_normal((2, 6, 4))
    run_parity(torch_module, getattr(fa, name)(*args), (x,), dtype, flax_kwargs={"deterministic": True})


def test_gpt2_sized_layer_float32():
    # The chapter's GPT-2-sized layer on a short input: 12 heads of 64.
    torch.manual_seed(0)
    torch_module = tr.MultiHeadAttention(768, 768, 1024, 0.0, 12)
    x = np.random.default_rng(0).standard_normal((2, 16, 768))
    run_parity(torch_module, fa.MultiHeadAttention(768, 768, 1024, 0.0, 12), (x,), np.float32,
               flax_kwargs={"deterministic": True})
