"""Bad input to the textbook's code (the chapter's modules, the Transformer notes' functions and
module, the basics) gets a clear error that names the argument and quotes the shapes or
values, before any computation, and the same under jax.jit."""
import re

import jax
import jax.numpy as jnp
import pytest

import flax_attn as fa

f32 = jnp.float32


def z(*shape, dtype=f32):
    return jnp.zeros(shape, dtype)


def init(module, *args, **kwargs):
    return module.init(jax.random.key(0), *args, **kwargs)


CASES = {
    "sdpa shapes": (lambda: fa.scaled_dot_product_attention(z(2, 3, 4), z(2, 5, 6), z(2, 5, 2)), ValueError,
                    "got Q (2, 3, 4), K (2, 5, 6), V (2, 5, 2)"),
    "create_causal_mask": (lambda: fa.create_causal_mask(0), ValueError, "seq_len must be a positive integer, got 0"),
    # modules
    "chapter d_out % heads": (lambda: init(fa.MultiHeadAttention(4, 6, 8, 0.0, 4), z(1, 2, 4), deterministic=True),
                              ValueError, "d_out (6) must be divisible by num_heads (4)"),
    "chapter too many tokens": (lambda: init(fa.CausalAttention(3, 2, 6, 0.0), z(1, 7, 3), deterministic=True),
                                ValueError, "CausalAttention input x has 7 tokens (shape (1, 7, 3)), more than "
                                            "context_length=6"),
    "chapter d_in": (lambda: init(fa.MultiHeadAttention(4, 4, 8, 0.0, 2), z(1, 2, 5), deterministic=True),
                     ValueError, "MultiHeadAttention input x has shape (1, 2, 5): its last dim must be d_in=4"),
    "chapter rank": (lambda: init(fa.MultiHeadAttention(4, 4, 8, 0.0, 2), z(2, 4), deterministic=True), ValueError,
                     "MultiHeadAttention input x must have rank 3 ((batch, num_tokens, d_in)), got shape (2, 4)"),
    "chapter dropout": (lambda: init(fa.CausalAttention(3, 2, 6, 1.5), z(1, 2, 3), deterministic=True), ValueError,
                        "CausalAttention dropout must be in [0, 1), got 1.5"),
    "chapter context_length": (lambda: init(fa.CausalAttention(3, 2, 0, 0.0), z(1, 2, 3), deterministic=True),
                               ValueError, "CausalAttention context_length must be a positive integer, got 0"),
    "chapter deterministic": (lambda: init(fa.CausalAttention(3, 2, 6, 0.1), z(1, 2, 3)), ValueError,
                              "CausalAttention has dropout=0.1: pass deterministic=True"),
    "chapter wrapper deterministic": (lambda: init(fa.MultiHeadAttentionWrapper(3, 2, 6, 0.1, 2), z(1, 2, 3)),
                                      ValueError, "MultiHeadAttentionWrapper has dropout=0.1: pass deterministic=True"),
    "chapter wrapper dropout": (lambda: init(fa.MultiHeadAttentionWrapper(3, 2, 6, 1.5, 2), z(1, 2, 3),
                                             deterministic=True),
                                ValueError, "MultiHeadAttentionWrapper dropout must be in [0, 1), got 1.5"),
    "transformer d_model": (lambda: init(fa.TransformerMultiHeadAttention(6, 4), z(1, 2, 6), z(1, 2, 6), z(1, 2, 6)),
                            ValueError, "d_model (6) must be divisible by num_heads (4)"),
    # basics
    "basics shapes": (lambda: fa.basics.attention_scores(z(4), z(6, 3)), ValueError,
                      "queries (4,) and inputs (6, 3) differ in the last dim"),
    "basics square": (lambda: fa.basics.causal_weights_by_masking(z(3, 4)), ValueError,
                      "scores must be square in the last two dims (..., T, T), got (3, 4)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_message(case):
    call, exc, message = CASES[case]
    with pytest.raises(exc, match=re.escape(message)):
        call()


JIT_CASES = {
    "chapter too many tokens": lambda q: init(fa.CausalAttention(8, 2, 4, 0.0), q[:, :, 0], deterministic=True),
}


@pytest.mark.parametrize("case", sorted(JIT_CASES))
def test_error_fires_under_jit(case):
    _, exc, message = CASES[case]
    if case == "chapter too many tokens":
        message = "CausalAttention input x has 5 tokens (shape (2, 5, 8)), more than context_length=4"
    with pytest.raises(exc, match=re.escape(message)):
        jax.jit(JIT_CASES[case])(z(2, 5, 4, 8))
