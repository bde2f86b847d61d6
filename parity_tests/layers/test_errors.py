"""Bad input to the layers (AttentionConfig, Attention, LearnedPositionalEmbedding, KVCache)
gets a clear error that names the argument and quotes the shapes or values, before any
computation; conditions on values known only when a jitted program runs raise when it runs."""
import re

import jax
import jax.numpy as jnp
import pytest

import flax_attn as fa

f32 = jnp.float32


def z(*shape, dtype=f32):
    return jnp.zeros(shape, dtype)


def init(module, *args, **kwargs):
    return module.init(jax.random.key(0), *args, **kwargs)


CASES = {
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
    "config qk_norm_type": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm=True, qk_norm_type="l2"),
                            ValueError, "qk_norm_type must be one of ['rms', 'layer'], got 'l2'"),
    "config qk_norm_scope": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm=True, qk_norm_scope="all"),
                             ValueError, "qk_norm_scope must be one of ['head', 'per_head', 'projection'], got 'all'"),
    "config qk_norm options without qk_norm": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm_zero_centered=True), ValueError,
        "qk_norm_zero_centered=True configure the QK-norm, but qk_norm=False: set qk_norm=True"),
    "config qk_norm_bias with rms": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm=True, qk_norm_bias=True), ValueError,
        "qk_norm_bias=True needs qk_norm_type='layer' (LayerNorm), got qk_norm_type='rms'"),
    "config qkv_bias": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, qkv_bias=(True, False)), ValueError,
                        "qkv_bias must be a bool or three bools (q, k, v), got (True, False)"),
    "config sinks": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, sinks=1.0), TypeError,
                     "sinks must be a bool, got 1.0"),
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
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_error_message(case):
    call, exc, message = CASES[case]
    with pytest.raises(exc, match=re.escape(message)):
        call()


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
