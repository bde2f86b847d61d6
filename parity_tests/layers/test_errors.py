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


def traced_init(module, *args, **kwargs):
    """``module.init`` traced only (errors raised while tracing, no parameters drawn)."""
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *args, **kwargs))


def zeros_like_tree(tree):
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


CROSS = fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=2, causal=False))


def KV(B, S, K, H, dtype=f32):
    """A ContextKV of zeros with positions 0..S-1."""
    return fa.layers.ContextKV(key=z(B, S, K, H, dtype=dtype), value=z(B, S, K, H, dtype=dtype),
                               positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)))


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
    # Llama 4, Falcon-RW
    "config chunk_size": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, chunk_size=0), ValueError,
                          "chunk_size must be an integer >= 1 or None, got 0"),
    "config temperature_tuning": (lambda: fa.AttentionConfig(d_model=16, num_heads=4, temperature_tuning=(8192,)),
                                  ValueError, "temperature_tuning must be None or (floor_scale, attn_scale), two "
                                  "numbers, got (8192,)"),
    "config temperature_tuning floor_scale": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, temperature_tuning=(0, 0.1)), ValueError,
        "temperature_tuning floor_scale must be a positive number, got 0"),
    "config qk_norm_weight without qk_norm": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm_weight=False), ValueError,
        "qk_norm_weight=False configures the QK-norm, but qk_norm=False: set qk_norm=True"),
    "config qk_norm_weight layer": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm=True, qk_norm_weight=False, qk_norm_type="layer"),
        ValueError, "qk_norm_weight=False (a QK-norm without learned weight, Llama 4's L2Norm) needs "
                    "qk_norm_type='rms' and qk_norm_zero_centered=False, got qk_norm_type='layer'"),
    "config qk_norm_weight yarn": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, qk_norm=True, qk_norm_weight=False, rope_scaling={
            "kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 4}), ValueError,
        "qk_norm_weight=False with a RoPE scaling whose attention factor is"),
    "config alibi_scaled without alibi": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, alibi_scaled=True), ValueError,
        "alibi_scaled=True scales the ALiBi bias: it needs position='alibi', got position='rope'"),
    "config alibi_scaled softcap": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, position="alibi", alibi_scaled=True, logit_softcap=5.0),
        ValueError, "alibi_scaled=True and logit_softcap"),
    "config alibi_scaled bool": (
        lambda: fa.AttentionConfig(d_model=16, num_heads=4, position="alibi", alibi_scaled=1), TypeError,
        "alibi_scaled must be a bool, got 1"),
    "layer temperature_tuning positions": (
        lambda: traced_init(fa.Attention(fa.AttentionConfig(d_model=16, num_heads=4, position="none",
                                                            temperature_tuning=(8192, 0.1))), z(2, 3, 16)),
        ValueError, "positions are required with temperature_tuning: pass positions of shape (2, 3)"),
    # cross-attention keys and values computed once
    "context_kv batch": (lambda: traced_init(CROSS, z(2, 3, 16), jnp.arange(3), context=KV(1, 5, 2, 4)), ValueError,
                         "ContextKV keys (1, 5, 2, 4) / values (1, 5, 2, 4) do not fit this layer and x: expected "
                         "(B, S, K, H) = (2, 5, 2, 4) (batch 2, 2 key/value heads of 4)"),
    "context_kv heads": (lambda: traced_init(CROSS, z(2, 3, 16), jnp.arange(3), context=KV(2, 5, 4, 4)), ValueError,
                         "ContextKV keys (2, 5, 4, 4) / values (2, 5, 4, 4) do not fit this layer and x: expected "
                         "(B, S, K, H) = (2, 5, 2, 4)"),
    "context_kv dtype": (lambda: traced_init(CROSS, z(2, 3, 16), jnp.arange(3),
                                             context=KV(2, 5, 2, 4, dtype=jnp.float64)),
                         TypeError, "ContextKV keys/values of dtype float64/float64 do not match the layer's queries' "
                                    "dtype float32"),
    "context_kv positions given": (
        lambda: traced_init(CROSS, z(2, 3, 16), jnp.arange(3), context=KV(2, 5, 2, 4), context_positions=jnp.arange(5)),
        ValueError, "context is a ContextKV, which holds its positions and segment ids: do not pass "
                    "context_positions or context_segment_ids"),
    "context_kv segment ids": (
        lambda: traced_init(CROSS, z(2, 3, 16), jnp.arange(3), jnp.zeros((2, 3), jnp.int32), context=KV(2, 5, 2, 4)),
        ValueError, "segment_ids and context_segment_ids must be given together (the ContextKV was made with "
                    "context_segment_ids=None)"),
    "context_kv context width": (
        lambda: CROSS.apply(zeros_like_tree(traced_init(CROSS, z(2, 3, 16), jnp.arange(3), context=z(2, 5, 16),
                                                    context_positions=jnp.arange(5))),
                            z(2, 5, 8), jnp.arange(5), method="context_kv"),
        ValueError, "context has shape (2, 5, 8): its last dim must be d_model=16"),
    "context_kv positions missing": (
        lambda: CROSS.apply(zeros_like_tree(traced_init(CROSS, z(2, 3, 16), jnp.arange(3), context=z(2, 5, 16),
                                                    context_positions=jnp.arange(5))),
                            z(2, 5, 16), method="context_kv"),
        ValueError, "context_positions are required with position='rope': pass positions of shape (2, 5)"),
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
