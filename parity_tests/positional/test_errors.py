"""Bad input to the positional encodings (flax_attn.positional: RoPE and its scalings, ALiBi,
T5 buckets, sinusoidal) gets a clear error that names the argument and quotes the shapes or
values, before any computation, and the same under jax.jit."""
import re

import jax
import jax.numpy as jnp
import numpy as np
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
                            "RopeScaling factor must be a finite positive number, got 0"),
    "rope scaling factor inf": (lambda: fa.RopeScaling(kind="linear", factor=float("inf")), ValueError,
                                "RopeScaling factor must be a finite positive number, got inf"),
    "rope odd head dim": (lambda: fa.apply_rope(z(2, 5, 3, 7), jnp.arange(5)), ValueError,
                          "RoPE rotates pairs of features: the head dim H=7 of x (2, 5, 3, 7) is odd; "
                          "rotate an even part of it with rotary_dim="),
    "rope unbatched positions shape": (lambda: fa.apply_rope(z(5, 3, 8), z(2, 5, dtype=jnp.int32)), ValueError,
                                       "positions must have shape (5,) for x of shape (5, 3, 8), got (2, 5)"),
    "sinusoidal integer dtype": (lambda: fa.sinusoidal_positions(jnp.arange(3), 4, dtype=jnp.int32), TypeError,
                                 "sinusoidal_positions dtype must be a floating dtype, got int32"),
    "sinusoidal base": (lambda: fa.sinusoidal_positions(jnp.arange(3), 4, base=0.0), ValueError,
                        "sinusoidal_positions base must be a finite positive number, got 0.0"),
    "alibi integer dtype": (lambda: fa.alibi_bias(fa.alibi_slopes(4), jnp.arange(3), jnp.arange(4), dtype=jnp.int32),
                            TypeError, "alibi_bias dtype must be a floating dtype, got int32"),
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


def test_scaling_factor_takes_numpy_numbers():
    """A factor read from a config as a NumPy scalar is a number like any other."""
    for factor in (np.float32(2.0), np.int64(2), 2, 2.0):
        assert fa.RopeScaling(kind="linear", factor=factor) == fa.RopeScaling(kind="linear", factor=2.0)
