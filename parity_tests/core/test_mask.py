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


def _bound(m, B=1, N=1, T=6, S=6):
    from flax_attn.core.call import bind_mask
    return bind_mask(m, None, B, N, T, S)


def test_chunked_literal_and_block_kinds():
    p = jnp.arange(6)
    llama4 = _bound(masks.causal() & masks.chunked(2) & masks.positions(p, p))
    np.testing.assert_array_equal(llama4.dense_mask()[0, 0], [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0],
                                                                [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                                                                [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]])
    shifted = _bound(masks.chunked(2) & masks.positions(p + 1, p + 1))  # chunks {1}, {2, 3}, {4, 5}, {6}
    np.testing.assert_array_equal(shifted.dense_mask()[0, 0, 0], [1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(shifted.dense_mask()[0, 0, 1], [0, 1, 1, 0, 0, 0])
    chunks = _bound(masks.chunked(2))
    kind = lambda m, q0, k0, size=2: int(m.block_kind(0, (0, 1), q0, size, k0, size))
    assert kind(chunks, 2, 2) == masks.FULL          # one chunk: computed without a mask
    assert kind(chunks, 2, 0) == masks.EMPTY         # different chunks: skipped
    assert kind(chunks, 1, 1) == masks.PARTIAL       # straddles two chunks
    assert kind(llama4, 2, 2) == masks.PARTIAL       # one chunk, causal inside it
    assert kind(llama4, 0, 4, 2) == masks.EMPTY


def test_mask_mod_uses_positions_heads_and_rows():
    p = jnp.arange(4)
    causal_mod = _bound(masks.mask_mod(lambda b, n, qi, ki: ki <= qi), T=4, S=4)
    np.testing.assert_array_equal(causal_mod.dense_mask()[0, 0], np.tril(np.ones((4, 4))))
    # q_idx / k_idx are the description's positions, not indices
    later = _bound(masks.mask_mod(lambda b, n, qi, ki: (qi >= 10) & (ki == 12)) & masks.positions(p + 10, p + 10),
                   T=4, S=4)
    np.testing.assert_array_equal(later.dense_mask()[0, 0], np.tile([0, 0, 1, 0], (4, 1)))
    # batch row and head reach the function; two mask_mods must both allow. Without positions
    # the 2 queries sit at the last 2 of the 4 key positions: q_idx is 2, 3.
    per = _bound(masks.mask_mod(lambda b, n, qi, ki: ki == b + n) & masks.mask_mod(lambda b, n, qi, ki: qi == 2),
                 B=2, N=2, T=2, S=4)
    expected = np.zeros((2, 2, 2, 4), bool)
    for b in range(2):
        for n in range(2):
            expected[b, n, 0, b + n] = True
    np.testing.assert_array_equal(per.dense_mask(), expected)


def test_mask_mod_block_kinds_skip_empty_blocks():
    m = _bound(masks.mask_mod(lambda b, n, qi, ki: ki <= qi), T=8, S=8)
    kind = lambda q0, k0: int(m.block_kind(0, (0, 1), q0, 4, k0, 4))
    assert (kind(0, 4), kind(4, 0), kind(0, 0)) == (masks.EMPTY, masks.FULL, masks.PARTIAL)
    by_head = _bound(masks.mask_mod(lambda b, n, qi, ki: n == 1), N=2, T=8, S=8)
    assert int(by_head.block_kind(0, (0, 1), 0, 4, 0, 4)) == masks.EMPTY
    assert int(by_head.block_kind(0, (1, 1), 0, 4, 0, 4)) == masks.FULL
    assert int(by_head.block_kind(0, (0, 2), 0, 4, 0, 4)) == masks.PARTIAL
    # rows past T (padding of the last block) cannot make a block non-empty
    pad = _bound(masks.mask_mod(lambda b, n, qi, ki: qi >= 6), T=6, S=6).padded(8, 8)
    assert int(pad.block_kind(0, (0, 1), 4, 4, 0, 4)) == masks.EMPTY
