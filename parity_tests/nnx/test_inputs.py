"""Inputs that cannot lie: an integer array (token ids passed where embeddings belong) given to
a layer is a TypeError naming the argument and its shape, in the Linen modules and their NNX
twins alike, eagerly and under jit (dtypes are static, so it raises while tracing)."""
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import flax_attn as fa
import flax_attn.nnx as fnnx

x16 = jnp.zeros((2, 3, 16))
ids = jnp.zeros((2, 3), jnp.int32)
CONFIG = fa.AttentionConfig(d_model=16, num_heads=4, causal=False)

# name: (Linen module, NNX module, float arguments, (argument index to make integer, its name))
CASES = {
    "Attention x": (fa.Attention(CONFIG), (x16, jnp.arange(3)), 0, "Attention input x", (2, 3, 16)),
    "Attention context": (fa.Attention(CONFIG), (x16, jnp.arange(3), None, jnp.zeros((2, 5, 16)), jnp.arange(5)),
                          3, "Attention input context", (2, 5, 16)),
    "SelfAttention_v1": (fa.SelfAttention_v1(16, 4), (x16[0],), 0, "SelfAttention_v1 input x", (3, 16)),
    "SelfAttention_v2": (fa.SelfAttention_v2(16, 4), (x16,), 0, "SelfAttention_v2 input x", (2, 3, 16)),
    "CausalAttention": (fa.CausalAttention(16, 4, 8, 0.0), (x16,), 0, "CausalAttention input x", (2, 3, 16)),
    "MultiHeadAttentionWrapper": (fa.MultiHeadAttentionWrapper(16, 4, 8, 0.0, 2), (x16,), 0,
                                  "MultiHeadAttentionWrapper input x", (2, 3, 16)),
    "MultiHeadAttention": (fa.MultiHeadAttention(16, 16, 8, 0.0, 2), (x16,), 0, "MultiHeadAttention input x",
                           (2, 3, 16)),
    "TransformerMultiHeadAttention Q": (fa.TransformerMultiHeadAttention(16, 2), (x16, x16, x16), 0,
                                        "TransformerMultiHeadAttention input Q", (2, 3, 16)),
    "TransformerMultiHeadAttention K": (fa.TransformerMultiHeadAttention(16, 2), (x16, x16, x16), 1,
                                        "TransformerMultiHeadAttention input K", (2, 3, 16)),
    "TransformerMultiHeadAttention V": (fa.TransformerMultiHeadAttention(16, 2), (x16, x16, x16), 2,
                                        "TransformerMultiHeadAttention input V", (2, 3, 16)),
}


def _integer(args, i):
    args = list(args)
    args[i] = args[i].astype(jnp.int32)
    return tuple(args)


@pytest.mark.parametrize("case", sorted(CASES))
def test_integer_inputs_are_a_type_error_naming_the_argument(case):
    linen, args, i, name, shape = CASES[case]
    message = re.escape(f"{name} must be a floating-point array of shape {shape}, got dtype int32")
    variables = linen.init(jax.random.key(0), *args)  # the float inputs work
    bad = _integer(args, i)
    with pytest.raises(TypeError, match=message):
        linen.apply(variables, *bad)
    with pytest.raises(TypeError, match=message):
        jax.jit(linen.apply)(variables, *bad)
    with pytest.raises(TypeError, match=message):
        linen.init(jax.random.key(0), *bad)
    model = fnnx.from_linen(linen, variables)
    assert model(*args) is not None
    with pytest.raises(TypeError, match=message):
        model(*bad)
    with pytest.raises(TypeError, match=message):
        nnx.jit(lambda m, *a: m(*a))(model, *bad)


def test_token_ids_are_named_as_such():
    tokens = jnp.broadcast_to(ids[..., None], (2, 3, 16))  # ids where embeddings belong
    with pytest.raises(TypeError, match=r"input x must be a floating-point array of shape \(2, 3, 16\), got dtype "
                                        r"int32 \(token ids\? embed them first\)"):
        fnnx.MultiHeadAttention(16, 16, 8, 0.0, 2, rngs=nnx.Rngs(0))(tokens)
    with pytest.raises(TypeError, match="Attention input x must be a floating-point array .* got dtype bool"):
        fnnx.Attention(CONFIG, rngs=nnx.Rngs(0))(x16 > 0, jnp.arange(3))
