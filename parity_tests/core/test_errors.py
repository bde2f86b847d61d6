"""Bad input to the attention core (dot_product_attention, masked_softmax, the masks) gets a
clear error that names the argument and quotes the shapes or values, before any computation,
and the same under jax.jit (the checks read static shapes).

The other rooms' error messages: positional/, layers/ and textbook/test_errors.py."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa

f32 = jnp.float32


def z(*shape, dtype=f32):
    return jnp.zeros(shape, dtype)


Q, K, V = z(2, 5, 4, 8), z(2, 7, 2, 8), z(2, 7, 2, 8)
_DOCS = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 2, 2]])  # a NumPy array: a rule must index JAX arrays
CASES = {
    # dot_product_attention
    "query rank": (lambda: fa.dot_product_attention(z(5, 8), K, V), ValueError,
                   "query must have rank 3 or 4 (BTNH or TNH), got shape (5, 8)"),
    "key rank": (lambda: fa.dot_product_attention(Q, z(7, 2, 8), V), ValueError,
                 "key must have rank 4 (BSKH), got shape (7, 2, 8)"),
    "heads do not divide": (lambda: fa.dot_product_attention(Q, z(2, 7, 3, 8), z(2, 7, 3, 8)), ValueError,
                            "number of query heads N (4) must be divisible by number of key/value heads K (3)"),
    "head dims differ": (lambda: fa.dot_product_attention(Q, z(2, 7, 2, 6), z(2, 7, 2, 6)), ValueError,
                         "query and key head dims differ: query (2, 5, 4, 8), key (2, 7, 2, 6)"),
    "key and value lengths differ": (lambda: fa.dot_product_attention(Q, K, z(2, 6, 2, 8)), ValueError,
                                     "key (2, 7, 2, 8), value (2, 6, 2, 8)"),
    "batches differ": (lambda: fa.dot_product_attention(z(3, 5, 4, 8), K, V), ValueError,
                       "query (3, 5, 4, 8), key (2, 7, 2, 8)"),
    "dtypes differ": (lambda: fa.dot_product_attention(Q, K.astype(jnp.bfloat16), V), TypeError,
                      "query, key and value must have one dtype, got query float32, key bfloat16, value float32"),
    "integer query": (lambda: fa.dot_product_attention(Q.astype(jnp.int32), K, V), TypeError,
                      "query must be a floating-point array, got dtype int32"),
    "mask does not broadcast": (lambda: fa.dot_product_attention(Q, K, V, mask=jnp.ones((5, 5), bool)), ValueError,
                                r"mask of shape (5, 5) does not broadcast to (B, N, T, S) = (2, 4, 5, 7)"),
    "mask not boolean": (lambda: fa.dot_product_attention(Q, K, V, mask=jnp.ones((5, 7), f32)), TypeError,
                         "mask must be a boolean array (True = may attend), got dtype float32"),
    "bias does not broadcast": (lambda: fa.dot_product_attention(Q, K, V, z(2, 3, 5, 7)), ValueError,
                                "bias of shape (2, 3, 5, 7) does not broadcast to (B, N, T, S) = (2, 4, 5, 7)"),
    "positions wrong shape": (lambda: fa.dot_product_attention(Q, K, V, is_causal=True, query_positions=jnp.arange(4)),
                              ValueError, "query_positions must have shape (5,) or (2, 5), got (4,)"),
    "positions not integer": (lambda: fa.dot_product_attention(Q, K, V, is_causal=True, key_positions=z(7)),
                              TypeError, "key_positions must be an integer array, got dtype float32"),
    "lengths wrong shape": (lambda: fa.dot_product_attention(Q, K, V, key_value_seq_lengths=jnp.array([3, 4, 5])),
                            ValueError, "key_value_seq_lengths must have shape (2,), got (3,)"),
    "lengths out of range": (lambda: fa.dot_product_attention(Q, K, V, key_value_seq_lengths=jnp.array([3, 8])),
                             ValueError, "key_value_seq_lengths must lie in [0, 7] (the axis they count), got [3, 8]"),
    "negative lengths": (lambda: fa.dot_product_attention(Q, K, V, query_seq_lengths=jnp.array([-1, 2])),
                         ValueError, "query_seq_lengths must lie in [0, 5] (the axis they count), got [-1, 2]"),
    "no head dim": (lambda: fa.dot_product_attention(Q[..., :0], K[..., :0], V), ValueError,
                    "the head dim H is 0: query (2, 5, 4, 0), key (2, 7, 2, 0); attention needs at least one"),
    "no query heads": (lambda: fa.dot_product_attention(Q[:, :, :0], K, V), ValueError,
                       "the number of query heads N is 0: query (2, 5, 0, 8), key (2, 7, 2, 8)"),
    "splash blocks": (lambda: fa.core.Splash(interpret=True, block_kv=16), ValueError,
                      "Splash block_kv must be a multiple of 128 (the kernel tiles sequences in the TPU's 128 lanes), "
                      "got 16"),
    "one segment id array": (lambda: fa.dot_product_attention(Q, K, V, query_segment_ids=jnp.zeros(5, jnp.int32)),
                             ValueError, "query_segment_ids and key_segment_ids must be given together"),
    "negative window": (lambda: fa.dot_product_attention(Q, K, V, local_window_size=(-1, 0)), ValueError,
                        "local_window_size must be non-negative, got (-1, 0)"),
    "window not ints": (lambda: fa.dot_product_attention(Q, K, V, local_window_size=2.5), TypeError,
                        "local_window_size must be an int or a (left, right) pair of ints known when the function "
                        "is traced, got 2.5"),
    "window traced": (lambda: jax.jit(lambda w: fa.dot_product_attention(Q, K, V, local_window_size=w))(2), TypeError,
                      "local_window_size must be an int or a (left, right) pair of ints known when the function "
                      "is traced, got JitTracer"),
    "is_causal traced": (lambda: jax.jit(lambda c: fa.dot_product_attention(Q, K, V, is_causal=c))(True), TypeError,
                         "is_causal must be known when the function is traced (it decides the program), got a traced "
                         "value"),
    "mask_mod indexes a NumPy array": (
        lambda: fa.dot_product_attention(Q, K, V, mask=fa.masks.mask_mod(lambda b, n, q, k: _DOCS[b, q] == _DOCS[b, k])),
        TypeError, "mask_mod failed on traced arguments (b, n, q_idx, k_idx), int32 scalars: "
                   "TracerArrayConversionError"),
    "mask_mod takes three": (
        lambda: fa.dot_product_attention(Q, K, V, mask=fa.masks.mask_mod(lambda b, qi, ki: qi >= ki)),
        TypeError, "mask_mod must take (b, n, q_idx, k_idx), int32 scalars: too many positional arguments"),
    "unknown implementation": (lambda: fa.dot_product_attention(Q, K, V, implementation="pallas"), ValueError,
                               "implementation must be one of ['pallas_decode', 'cudnn', 'splash', 'pallas_triton', 'cpu_native', 'key_blocks', "
                               "'query_blocks', 'blockwise', 'xla'], got 'pallas'"),
    "dropout rate 1": (lambda: fa.dot_product_attention(Q, K, V, dropout_rate=1.0, dropout_rng=jax.random.key(0)),
                       ValueError, "dropout_rate must be in [0, 1), got 1.0"),
    "dropout without key": (lambda: fa.dot_product_attention(Q, K, V, dropout_rate=0.1), ValueError,
                            "dropout_rate > 0 needs dropout_rng (or deterministic=True)"),
    "softcap not positive": (lambda: fa.dot_product_attention(Q, K, V, logit_softcap=0.0), ValueError,
                             "logit_softcap must be a positive number, got 0.0"),
    "scale not finite": (lambda: fa.dot_product_attention(Q, K, V, scale=float("nan")), TypeError,
                         "scale must be a finite Python number, got nan"),
    # masked_softmax and masks
    "masked_softmax mask": (lambda: fa.masked_softmax(z(3, 4), jnp.ones((3, 5), bool)), ValueError,
                            "mask of shape (3, 5) does not broadcast to logits' shape = (3, 4)"),
    "causal mask positions": (lambda: fa.masks.causal_mask(z(3), jnp.arange(3)), TypeError,
                              "query_positions must be an integer array, got dtype float32"),
    "segment batches": (lambda: fa.masks.segment_mask(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32)),
                        ValueError, "query_segment_ids (2, 3) and key_segment_ids (3, 3) have different batches"),
    # mask descriptions
    "description and keyword positions": (
        lambda: fa.dot_product_attention(Q, K, V, mask=fa.masks.causal() & fa.masks.positions(jnp.arange(5), jnp.arange(7)),
                                         query_positions=jnp.arange(5)),
        ValueError, "mask= gives positions and so does query_positions=/key_positions=: give them once"),
    "description and keyword lengths": (
        lambda: fa.dot_product_attention(Q, K, V, mask=fa.masks.lengths(None, jnp.array([3, 4])),
                                         key_value_seq_lengths=jnp.array([2, 2])),
        ValueError, "mask= gives key/value lengths and so does key_value_seq_lengths=: give them once"),
    "dense descriptions do not broadcast": (
        lambda: fa.masks.dense(jnp.ones((7,), bool)) & fa.masks.dense(jnp.ones((8,), bool)), ValueError,
        "both mask descriptions give a dense mask, of shapes (7,) and (8,), which do not broadcast together"),
    "segments need both": (lambda: fa.masks.segments(jnp.zeros((2, 5), jnp.int32), None), ValueError,
                           "segments needs both query_segment_ids and key_segment_ids"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_message(case):
    call, exc, message = CASES[case]
    with pytest.raises(exc, match=re.escape(message)):
        call()


JIT_CASES = {
    "query rank": lambda q: fa.dot_product_attention(q[0, :, 0], K, V),
    "mask does not broadcast": lambda q: fa.dot_product_attention(q, K, V, mask=jnp.ones((5, 5), bool)),
    "heads do not divide": lambda q: fa.dot_product_attention(q, z(2, 7, 3, 8), z(2, 7, 3, 8)),
}


@pytest.mark.parametrize("case", sorted(JIT_CASES))
def test_error_fires_under_jit(case):
    _, exc, message = CASES[case]
    with pytest.raises(exc, match=re.escape(message)):
        jax.jit(JIT_CASES[case])(Q)
