"""Bad input to the positional encodings (flax_attn.positional: RoPE and its scalings, ALiBi,
T5 buckets, sinusoidal) gets a clear error that names the argument and quotes the shapes or
values, before any computation, and the same under jax.jit."""
import re

import jax
import jax.numpy as jnp
import pytest

import flax_attn as fa

f32 = jnp.float32


def z(*shape, dtype=f32):
    return jnp.zeros(shape, dtype)


CASES = {
    "sinusoidal float positions": (lambda: fa.sinusoidal_positions(z(4), 8), TypeError,
                                   "positions must be an integer array, got dtype float32"),
    "positional_encoding d_model": (lambda: fa.positional_encoding(4, 0), ValueError,
                                    "d_model must be a positive integer, got 0"),
    "rope layout": (lambda: fa.apply_rope(z(1, 4, 2, 8), jnp.arange(4), layout="neox"), ValueError,
                    "layout must be one of ['rotate_half', 'interleaved'], got 'neox'"),
    "rope positions shape": (lambda: fa.apply_rope(z(1, 4, 2, 8), jnp.arange(5)), ValueError,
                             "positions must have shape (4,) or (1, 4) for x of shape (1, 4, 2, 8), got (5,)"),
    "rope rotary_dim odd": (lambda: fa.apply_rope(z(1, 4, 2, 8), jnp.arange(4), rotary_dim=3), ValueError,
                            "rotary_dim must be an even number in [2, H=8], got 3"),
    "rope scaling kind": (lambda: fa.RopeScaling(kind="ntk-by-parts", factor=2.0), ValueError,
                          "RopeScaling kind must be one of ['linear', 'ntk', 'dynamic', 'llama3', 'yarn', 'longrope'], "
                          "got 'ntk-by-parts'"),
    "dynamic needs original length": (lambda: fa.RopeScaling(kind="dynamic", factor=2.0), ValueError,
                                      "RopeScaling original_max_position_embeddings must be a positive integer, got None"),
    "longrope factors": (lambda: fa.RopeScaling(kind="longrope", factor=2.0, original_max_position_embeddings=4,
                                                short_factor=(1.0, -1.0), long_factor=(1.0, 2.0)), ValueError,
                         "longrope needs short_factor: positive numbers, one per frequency, got (1.0, -1.0)"),
    "rope scaling factor": (lambda: fa.RopeScaling(kind="linear", factor=0), ValueError,
                            "RopeScaling factor must be a positive number, got 0"),
    "yarn needs original length": (lambda: fa.RopeScaling(kind="yarn", factor=4.0), ValueError,
                                   "RopeScaling original_max_position_embeddings must be a positive integer, got None"),
    "rope scaling unknown field": (lambda: fa.rope.as_scaling({"kind": "linear", "factor": 2, "type": "x"}),
                                   ValueError, "unknown RopeScaling fields ['type']"),
    "alibi heads": (lambda: fa.alibi_slopes(0), ValueError, "num_heads must be a positive integer, got 0"),
    "t5 buckets": (lambda: fa.relative_position_bucket(jnp.arange(3), num_buckets=2), ValueError,
                   "need num_buckets >= 4 and max_distance > 0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_message(case):
    call, exc, message = CASES[case]
    with pytest.raises(exc, match=re.escape(message)):
        call()


JIT_CASES = {
    "rope positions shape": lambda q: fa.apply_rope(q, jnp.arange(6)),
}


@pytest.mark.parametrize("case", sorted(JIT_CASES))
def test_error_fires_under_jit(case):
    _, exc, message = CASES[case]
    if case == "rope positions shape":
        message = "positions must have shape (5,) or (2, 5) for x of shape (2, 5, 4, 8), got (6,)"
    with pytest.raises(exc, match=re.escape(message)):
        jax.jit(JIT_CASES[case])(z(2, 5, 4, 8))
