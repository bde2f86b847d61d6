"""Sinusoidal positions (flax_attn.positional.sinusoidal): the Transformer notes' positional_encoding
example derived by hand with Python's math module, parity with torch_ref, offsets."""
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, assert_close


def test_positional_encoding_example():
    emb = np.array([[[0.1 * (i + j + 1) for j in range(8)] for i in range(4)]], np.float32)
    by_hand = [[math.sin(p / 10000 ** (c / 8)) if c % 2 == 0 else math.cos(p / 10000 ** ((c - 1) / 8))
                for c in range(8)] for p in range(4)]
    t_pe, f_pe = tr.positional_encoding(4, 8).numpy(), fa.positional_encoding(4, 8)
    assert t_pe.shape == f_pe.shape == (4, 8)
    assert_close(t_pe, by_hand, np.float32, "torch_ref")
    assert_close(f_pe, by_hand, np.float32, "flax_attn")
    assert_close(emb + f_pe, emb + np.array(by_hand), np.float32, "embedding + PE")
    # Row 0 is sin(0), cos(0), ...; the notes' table begins 0, 1, 0, 1, ...
    np.testing.assert_array_equal(f_pe[0], [0, 1] * 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len, d_model", [(1, 2), (6, 8), (50, 7), (33, 128)])
def test_positional_encoding_parity(seq_len, d_model, dtype):
    t = tr.positional_encoding(seq_len, d_model, dtype=torch.float64 if dtype == np.float64 else torch.float32)
    f = fa.positional_encoding(seq_len, d_model, dtype=dtype)
    assert f.dtype == dtype
    assert_close(f, t.numpy(), dtype, "positional_encoding")
    if d_model % 2:  # odd widths: ceil(d/2) sines, floor(d/2) cosines, the last column a sine
        p = np.arange(seq_len)[:, None]
        np.testing.assert_allclose(f[:, -1], np.sin(p[:, 0] / 10000 ** ((d_model - 1) / d_model)), rtol=1e-5, atol=1e-6)


def test_sinusoidal_positions_with_offset_equal_table_rows():
    table = fa.positional_encoding(20, 16)
    np.testing.assert_array_equal(fa.sinusoidal_positions(jnp.arange(5, 9), 16), table[5:9])
    batched = fa.sinusoidal_positions(jnp.array([[0, 1], [7, 3]]), 16)
    assert batched.shape == (2, 2, 16)
    np.testing.assert_array_equal(batched[1, 0], table[7])
