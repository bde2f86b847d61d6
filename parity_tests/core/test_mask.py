"""The mask description's rules as dense arrays, against literal matrices; composing descriptions."""
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn.core import mask as masks


def test_causal_mask_literal():
    np.testing.assert_array_equal(fa.create_causal_mask(3), [[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    q, k = masks.default_positions(2, 4)  # queries are the last two of four positions
    np.testing.assert_array_equal(masks.causal_mask(q, k), [[1, 1, 1, 0], [1, 1, 1, 1]])


def test_window_mask_literal():
    p = jnp.arange(5)
    np.testing.assert_array_equal(masks.window_mask(p, p, (1, 0)),
                                  [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(masks.window_mask(p, p, 1),
                                  [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1]])


def test_segment_and_length_masks_literal():
    seg = jnp.array([0, 0, 1, 1, 1])
    np.testing.assert_array_equal(masks.segment_mask(seg, seg),
                                  [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(masks.length_mask(2, 3, jnp.array([1]), jnp.array([2])), [[[1, 1, 0], [0, 0, 0]]])
    np.testing.assert_array_equal(masks.padding_mask(jnp.array([2, 0]), 3), [[1, 1, 0], [0, 0, 0]])


def test_descriptions_compose_and_refuse_ambiguity():
    p = jnp.arange(5)
    both = masks.causal() & masks.window(1, 3) & masks.positions(p, p)
    assert both.causal and both.window == (1, 3) and both.bounds == (1, 0)
    assert (masks.window(2, 0) & masks.window(1, 4)).window == (1, 0)
    with pytest.raises(ValueError, match="both mask descriptions give segment ids"):
        masks.segments(p, p) & masks.segments(p, p)
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        masks.dense(jnp.ones((5, 5)))
    dense = masks.dense(jnp.ones((5,), bool)) & masks.dense(jnp.arange(5) < 3)
    np.testing.assert_array_equal(dense.dense, [1, 1, 1, 0, 0])
