"""Causal load balancing (flax_attn.parallel.balance): the permutations written out by hand, their
inverse, and the work they leave each device under a causal mask (counted from the mask
description: the allowed (query, key) pairs of each device's queries)."""
import numpy as np
import pytest

import flax_attn as fa
from flax_attn import parallel as fp


def test_zigzag_and_striped_by_hand():
    # 8 tokens over 2 devices. zig-zag: chunks of 2, device 0 takes chunks 0 and 3, device 1 chunks 1 and 2
    assert fp.permutation(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    # striped: device 0 takes the even tokens, device 1 the odd ones
    assert fp.permutation(8, 2, "striped").tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert fp.permutation(12, 3).tolist() == [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
    assert fp.permutation(6, 1, "striped").tolist() == list(range(6))


@pytest.mark.parametrize("scheme", ["zigzag", "striped"])
def test_restore_order_inverts_load_balance(scheme):
    x = {"a": np.arange(2 * 32 * 3).reshape(2, 32, 3), "pos": np.broadcast_to(np.arange(32), (2, 32))}
    y = fp.load_balance(x, 4, scheme=scheme)
    assert not np.array_equal(y["a"], x["a"])
    np.testing.assert_array_equal(y["pos"][0], fp.permutation(32, 4, scheme))  # positions travel with tokens
    back = fp.restore_order(y, 4, scheme=scheme)
    np.testing.assert_array_equal(back["a"], x["a"])
    np.testing.assert_array_equal(back["pos"], x["pos"])


def _causal_work(positions, P):
    """Allowed causal (query, key) pairs per device, by the mask description."""
    allowed = np.asarray(fa.masks.causal_mask(positions, positions))   # (T, T) in the given order
    return allowed.reshape(P, -1, allowed.shape[-1]).sum(axis=(1, 2))


def test_balancing_evens_causal_work():
    T, P = 64, 8
    contiguous = _causal_work(np.arange(T), P)
    zigzag = _causal_work(fp.permutation(T, P), P)
    striped = _causal_work(fp.permutation(T, P, "striped"), P)
    # in order, device r's 8 queries at 8r..8r+7 see 8r+1..8r+8 keys each: 36 + 64 r pairs
    assert contiguous.tolist() == [36 + 64 * r for r in range(P)]  # device 7 does 13.4 x device 0's work
    assert zigzag.min() == zigzag.max() == T * (T + 1) // 2 // P  # exactly even
    assert striped.max() - striped.min() == T // P * (P - 1)        # off by one pair per query row at most
    assert zigzag.sum() == striped.sum() == contiguous.sum() == T * (T + 1) // 2


def test_padding_segment_ids():
    ids = fp.padding_segment_ids(np.array([3, 5]), 5)
    np.testing.assert_array_equal(ids, [[0, 0, 0, -1, -1], [0, 0, 0, 0, 0]])
    ids = fp.padding_segment_ids(np.array([4]), 5, np.array([[0, 0, 1, 1, 1]]))
    np.testing.assert_array_equal(ids, [[0, 0, 1, 1, -1]])
    with pytest.raises(ValueError, match=r"segment_ids of shape \(1, 4\) must have shape \(1, 5\)"):
        fp.padding_segment_ids(np.array([4]), 5, np.zeros((1, 4), int))


def test_lengths_as_segment_ids_are_the_same_mask():
    # padding_segment_ids gives the mask the lengths give, so it can be reordered with its tokens
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 16, 2, 4))
    lengths = np.array([16, 9])
    by_lengths = fa.dot_product_attention(q, q, q, is_causal=True, query_seq_lengths=lengths,
                                          key_value_seq_lengths=lengths)
    ids = fp.padding_segment_ids(lengths, 16)
    by_ids = fa.dot_product_attention(q, q, q, is_causal=True, query_segment_ids=ids, key_segment_ids=ids)
    np.testing.assert_array_equal(np.asarray(by_ids), np.asarray(by_lengths))


def test_lengths_not_divisible_raise():
    with pytest.raises(ValueError, match="length 60 must be divisible by 16"):
        fp.permutation(60, 8)
    with pytest.raises(ValueError, match="length 10 must be divisible by 4"):
        fp.permutation(10, 4, "striped")
    with pytest.raises(ValueError, match="scheme must be one of"):
        fp.permutation(8, 2, "random")
