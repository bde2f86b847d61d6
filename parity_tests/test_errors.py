"""Bad input gets a clear error that names the argument and quotes the shapes or values, before
any computation, and the same under jax.jit (the checks read static shapes)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa

f32 = jnp.float32


def z(*shape, dtype=f32):
    return jnp.zeros(shape, dtype)


def init(module, *args, **kwargs):
    return module.init(jax.random.key(0), *args, **kwargs)


Q, K, V = z(2, 5, 4, 8), z(2, 7, 2, 8), z(2, 7, 2, 8)
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
    "one segment id array": (lambda: fa.dot_product_attention(Q, K, V, query_segment_ids=jnp.zeros(5, jnp.int32)),
                             ValueError, "query_segment_ids and key_segment_ids must be given together"),
    "negative window": (lambda: fa.dot_product_attention(Q, K, V, local_window_size=(-1, 0)), ValueError,
                        "local_window_size must be non-negative, got (-1, 0)"),
    "window not ints": (lambda: fa.dot_product_attention(Q, K, V, local_window_size=2.5), TypeError,
                        "local_window_size must be an int or a (left, right) pair of ints, got 2.5"),
    "unknown implementation": (lambda: fa.dot_product_attention(Q, K, V, implementation="pallas"), ValueError,
                               "implementation must be one of ['xla', 'blockwise', 'cudnn'], got 'pallas'"),
    "dropout rate 1": (lambda: fa.dot_product_attention(Q, K, V, dropout_rate=1.0, dropout_rng=jax.random.key(0)),
                       ValueError, "dropout_rate must be in [0, 1), got 1.0"),
    "dropout without key": (lambda: fa.dot_product_attention(Q, K, V, dropout_rate=0.1), ValueError,
                            "dropout_rate > 0 needs dropout_rng (or deterministic=True)"),
    "softcap not positive": (lambda: fa.dot_product_attention(Q, K, V, logit_softcap=0.0), ValueError,
                             "logit_softcap must be a positive number, got 0.0"),
    "scale not finite": (lambda: fa.dot_product_attention(Q, K, V, scale=float("nan")), TypeError,
                         "scale must be a finite Python number, got nan"),
    "masked_softmax mask": (lambda: fa.masked_softmax(z(3, 4), jnp.ones((3, 5), bool)), ValueError,
                            "mask of shape (3, 5) does not broadcast to logits' shape = (3, 4)"),
    "sdpa shapes": (lambda: fa.scaled_dot_product_attention(z(2, 3, 4), z(2, 5, 6), z(2, 5, 2)), ValueError,
                    "got Q (2, 3, 4), K (2, 5, 6), V (2, 5, 2)"),
    # masks and positional encodings
    "causal mask positions": (lambda: fa.masks.causal_mask(z(3), jnp.arange(3)), TypeError,
                              "query_positions must be an integer array, got dtype float32"),
    "segment batches": (lambda: fa.masks.segment_mask(jnp.zeros((2, 3), jnp.int32), jnp.zeros((3, 3), jnp.int32)),
                        ValueError, "query_segment_ids (2, 3) and key_segment_ids (3, 3) have different batches"),
    "create_causal_mask": (lambda: fa.create_causal_mask(0), ValueError, "seq_len must be a positive integer, got 0"),
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
    "rope scaling kind": (lambda: fa.RopeScaling(kind="dynamic", factor=2.0), ValueError,
                          "RopeScaling kind must be one of ['linear', 'ntk', 'llama3', 'yarn'], got 'dynamic'"),
    "rope scaling factor": (lambda: fa.RopeScaling(kind="linear", factor=0), ValueError,
                            "RopeScaling factor must be a positive number, got 0"),
    "yarn needs original length": (lambda: fa.RopeScaling(kind="yarn", factor=4.0), ValueError,
                                   "RopeScaling original_max_position_embeddings must be a positive integer, got None"),
    "rope scaling unknown field": (lambda: fa.rope.as_scaling({"kind": "linear", "factor": 2, "type": "x"}),
                                   ValueError, "unknown RopeScaling fields ['type']"),
    "alibi heads": (lambda: fa.alibi_slopes(0), ValueError, "num_heads must be a positive integer, got 0"),
    "t5 buckets": (lambda: fa.relative_position_bucket(jnp.arange(3), num_buckets=2), ValueError,
                   "need num_buckets >= 4 and max_distance > 0"),
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
    "transformer d_model": (lambda: init(fa.TransformerMultiHeadAttention(6, 4), z(1, 2, 6), z(1, 2, 6), z(1, 2, 6)),
                            ValueError, "d_model (6) must be divisible by num_heads (4)"),
    "config kv heads": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=3), ValueError,
                        "num_heads (4) must be divisible by num_kv_heads (3)"),
    "config window": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, sliding_window=0), ValueError,
                      "sliding_window must be an integer >= 1, got 0"),
    "config position": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, position="learned"), ValueError,
                        "position must be one of ['rope', 'alibi', 't5', 'none'], got 'learned'"),
    "config dropout": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, dropout=-0.1), ValueError,
                       "dropout must be in [0, 1), got -0.1"),
    "config rotary_dim": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, rotary_dim=6), ValueError,
                          "rotary_dim must be an even number in [2, head_dim=4], got 6"),
    "layer positions missing": (lambda: init(fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4)), z(2, 3, 16)),
                                ValueError, "positions are required with position='rope': pass positions of shape (2, 3)"),
    "layer positions shape": (lambda: init(fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4)), z(2, 3, 16),
                                           jnp.zeros((2, 4), jnp.int32)),
                              ValueError, "positions must have shape (3,) or (2, 3), got (2, 4)"),
    "layer x width": (lambda: init(fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4)), z(2, 3, 8),
                                   jnp.arange(3)), ValueError, "x has shape (2, 3, 8): its last dim must be d_model=16"),
    "layer cache and context": (lambda: init(fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4, causal=False)),
                                             z(1, 3, 16), jnp.arange(3), None, z(1, 4, 16), jnp.arange(4),
                                             cache=fa.KVCache.create(batch=1, max_len=8, num_kv_heads=4, head_dim=4)),
                                ValueError, "cache is for self-attention; pass either context or cache"),
    "learned positions": (lambda: init(fa.LearnedPositionalEmbedding(8, 4), z(1, 2)), TypeError,
                          "positions must be an integer array, got dtype float32"),
    # cache
    "cache shapes": (lambda: fa.KVCache.create(batch=1, max_len=4, num_kv_heads=2, head_dim=4).update(
        z(1, 1, 2, 8), z(1, 1, 2, 8), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32)), ValueError,
        r"new keys (1, 1, 2, 8) / values (1, 1, 2, 8) do not fit the cache's keys (1, 4, 2, 4)"),
    "cache too small": (lambda: fa.KVCache.create(batch=1, max_len=2, num_kv_heads=1, head_dim=4).update(
        z(1, 3, 1, 4), z(1, 3, 1, 4), jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32)), ValueError,
        "3 new tokens do not fit a cache of max_len=2"),
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
    "query rank": lambda q: fa.dot_product_attention(q[0, :, 0], K, V),
    "mask does not broadcast": lambda q: fa.dot_product_attention(q, K, V, mask=jnp.ones((5, 5), bool)),
    "heads do not divide": lambda q: fa.dot_product_attention(q, z(2, 7, 3, 8), z(2, 7, 3, 8)),
    "chapter too many tokens": lambda q: init(fa.CausalAttention(8, 2, 4, 0.0), q[:, :, 0], deterministic=True),
    "rope positions shape": lambda q: fa.apply_rope(q, jnp.arange(6)),
}


@pytest.mark.parametrize("case", sorted(JIT_CASES))
def test_error_fires_under_jit(case):
    _, exc, message = CASES[case]
    if case == "chapter too many tokens":
        message = "CausalAttention input x has 5 tokens (shape (2, 5, 8)), more than context_length=4"
    if case == "rope positions shape":
        message = "positions must have shape (5,) or (2, 5) for x of shape (2, 5, 4, 8), got (6,)"
    with pytest.raises(exc, match=re.escape(message)):
        jax.jit(JIT_CASES[case])(Q)


def test_runtime_errors_fire_under_jit():
    # Conditions on values known only when the program runs: raised when it runs.
    m = fa.LearnedPositionalEmbedding(8, 4)
    v = init(m, jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(Exception, match=re.escape("positions must lie in [0, 8), got min 0 and max 9")):
        jax.block_until_ready(jax.jit(m.apply)(v, jnp.array([[0, 9]])))
    cache = fa.KVCache.create(batch=1, max_len=4, num_kv_heads=1, head_dim=2)
    kv = z(1, 3, 1, 2)
    full = cache.update(kv, kv, jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(Exception, match=re.escape("KV cache overflow: 3 cached + 3 new tokens > max_len=4")):
        jax.block_until_ready(jax.jit(lambda c: c.update(kv, kv, jnp.zeros((1, 3), jnp.int32),
                                                         jnp.zeros((1, 3), jnp.int32)))(full))


def test_every_public_name_is_documented():
    for name in fa.__all__:
        obj = getattr(fa, name)
        assert (obj.__doc__ or "").strip(), f"flax_attn.{name} has no docstring"
