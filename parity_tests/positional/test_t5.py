"""T5 relative positions (flax_attn.positional.t5): buckets by hand and against the T5 code's
computation everywhere, the bias table lookup."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr

tm = tr.modern


@pytest.mark.parametrize("rel, bucket", [(0, 0), (-1, 1), (-7, 7), (-8, 8), (-12, 9), (-16, 10), (-32, 12), (-64, 14),
                                         (-127, 15), (-128, 15), (-5000, 15), (1, 17), (7, 23), (8, 24), (16, 26),
                                         (5000, 31)])
def test_t5_buckets_bidirectional_by_hand(rel, bucket):
    # 32 buckets, 16 per direction, 8 exact; beyond: 8 + floor(log(|r| / 8) / log(128 / 8) * 8),
    # e.g. |r| = 12: 8 + floor(0.1462 * 8) = 9; |r| = 16: 8 + 2 = 10. Keys after the query: + 16.
    assert int(fa.relative_position_bucket(jnp.array(rel), bidirectional=True)) == bucket


@pytest.mark.parametrize("rel, bucket", [(5, 0), (0, 0), (-1, 1), (-15, 15), (-16, 16), (-32, 21), (-64, 26),
                                         (-127, 31), (-128, 31), (-9999, 31)])
def test_t5_buckets_one_sided_by_hand(rel, bucket):
    # 32 buckets, 16 exact; beyond: 16 + floor(log(|r| / 16) / log(8) * 16): |r| = 32 -> 16 + 5 = 21.
    assert int(fa.relative_position_bucket(jnp.array(rel), bidirectional=False)) == bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 40), (64, 1000)])
def test_t5_buckets_agree_with_reference_everywhere(bidirectional, num_buckets, max_distance):
    rel = np.arange(-3000, 3001)
    ours = fa.relative_position_bucket(jnp.asarray(rel), bidirectional=bidirectional, num_buckets=num_buckets,
                                       max_distance=max_distance)
    theirs = tm.t5_relative_position_bucket(torch.from_numpy(rel), bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(ours, theirs.numpy())


def test_t5_bias_looks_up_the_table():
    table = jnp.arange(64.0).reshape(32, 2)
    bias = fa.t5_bias(table, jnp.arange(3), jnp.arange(3))
    assert bias.shape == (2, 3, 3)
    b = np.asarray(fa.relative_position_bucket(jnp.arange(3)[None, :] - jnp.arange(3)[:, None]))
    np.testing.assert_array_equal(bias[1], np.asarray(table)[b, 1])


def test_positions_past_int32_and_unsigned_positions():
    """With 64-bit integers on (as this suite runs), int64 relative positions are not cut to
    int32: 2**32 after the query is past max_distance (bucket 31), 2**32 before it too (15).
    Unsigned positions give the buckets of the same positions as int32 (no wrapped
    differences)."""
    rel = jnp.asarray(np.array([2**32, 2**32 + 3, -(2**32)], np.int64))
    np.testing.assert_array_equal(fa.relative_position_bucket(rel), [31, 31, 15])
    table = jnp.asarray(np.random.default_rng(0).standard_normal((32, 2)))
    q = k = np.arange(3)
    want = fa.t5_bias(table, q.astype(np.int32), k.astype(np.int32))
    for dtype in (np.uint8, np.uint32):
        np.testing.assert_array_equal(fa.t5_bias(table, q.astype(dtype), k.astype(dtype)), want)
    np.testing.assert_array_equal(fa.alibi_bias(fa.alibi_slopes(2), q.astype(np.uint32), k.astype(np.uint32)),
                                  fa.alibi_bias(fa.alibi_slopes(2), q.astype(np.int32), k.astype(np.int32)))
