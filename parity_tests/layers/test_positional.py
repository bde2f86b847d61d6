"""Learned absolute positions (flax_attn.layers.positional.LearnedPositionalEmbedding): parity
with torch_ref.modern.LearnedPositionalEmbedding, out-of-range positions are errors."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, run_parity

tm = tr.modern


@pytest.mark.parametrize("dtype", DTYPES)
def test_learned_positions_parity(dtype):
    torch.manual_seed(0)
    pos = np.array([[0, 1, 2, 3], [7, 8, 9, 10]])  # the second row decodes at an offset
    # A float input is needed for the comparison: the embedding plus a shift.
    t = tm.LearnedPositionalEmbedding(16, 6)
    f = fa.LearnedPositionalEmbedding(16, 6)
    run_parity(t, f, (pos,), dtype, eager=True)


def test_learned_positions_out_of_range_is_an_error():
    m = fa.LearnedPositionalEmbedding(8, 4)
    v = m.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 8\), got min 0 and max 8"):
        m.apply(v, jnp.array([[0, 8]]))
    with pytest.raises(Exception, match=r"positions must lie in \[0, 8\)"):
        jax.jit(m.apply)(v, jnp.array([[-1, 3]])).block_until_ready()
