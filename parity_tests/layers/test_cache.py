"""KV-cache decoding (flax_attn.layers.cache.KVCache in the Attention layer): pure (cache in,
cache out), prefill then single steps equal to the full causal pass, one compilation for all
steps, loud overflow, grouped-query and sliding window."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import assert_close

D, N = 16, 4
DECODE_CONFIGS = {
    "mha-rope": {},
    "gqa-rope-window": {"num_kv_heads": 2, "sliding_window": 4},
    "mqa-interleaved-qknorm-softcap": {"num_kv_heads": 1, "rope_layout": "interleaved", "qk_norm": True,
                                       "logit_softcap": 3.0},
    "alibi": {"position": "alibi"},
    "t5-decoder": {"position": "t5", "t5_num_buckets": 8, "t5_max_distance": 6},
    "nope": {"position": "none"},
}


def _setup(cfg, T=12, B=2, dtype=jnp.float32, seed=0):
    config = fa.AttentionConfig(d_model=D, num_heads=N, **cfg)
    layer = fa.Attention(config)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), dtype)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = layer.init(jax.random.key(seed), x, positions)
    return config, layer, params, x, positions


def _decode(layer, params, cache, x, positions, prefill, step=1, jit=True):
    apply = jax.jit(layer.apply) if jit else layer.apply
    out, cache = apply(params, x[:, :prefill], positions[:, :prefill], cache=cache)
    outs = [out]
    for t in range(prefill, x.shape[1], step):
        out, cache = apply(params, x[:, t:t + step], positions[:, t:t + step], cache=cache)
        outs.append(out)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("name", sorted(DECODE_CONFIGS))
@pytest.mark.parametrize("prefill, step", [(5, 1), (1, 1), (3, 3)])
def test_prefill_then_steps_equals_full_pass(name, prefill, step):
    config, layer, params, x, positions = _setup(DECODE_CONFIGS[name])
    full = layer.apply(params, x, positions)
    cache = config.init_cache(batch=2, max_len=16)
    decoded, cache = _decode(layer, params, cache, x, positions, prefill, step)
    assert_close(decoded, full, np.float32, "decoded vs full")
    assert int(cache.length) == 12


@pytest.mark.parametrize("max_len", [3, 5, 8])
def test_rolling_cache_for_a_sliding_window(max_len):
    # Window 4 needs the 3 previous keys: a rolling cache of 3 slots is enough for any length.
    config, layer, params, x, positions = _setup({"num_kv_heads": 2, "sliding_window": 4}, T=20)
    full = layer.apply(params, x, positions)
    cache = config.init_cache(batch=2, max_len=max_len, rolling=True)
    decoded, cache = _decode(layer, params, cache, x, positions, prefill=6)
    assert_close(decoded, full, np.float32, "rolling decode vs full")
    assert cache.key.shape[1] == max_len


def test_rolling_cache_needs_a_window_that_fits():
    config = fa.AttentionConfig(d_model=D, num_heads=N, sliding_window=4)
    with pytest.raises(ValueError, match="needs max_len >= 3, got 2"):
        config.init_cache(batch=1, max_len=2, rolling=True)
    with pytest.raises(ValueError, match="a rolling cache drops old keys: it needs a sliding_window"):
        fa.AttentionConfig(d_model=D, num_heads=N).init_cache(batch=1, max_len=8, rolling=True)
    _, layer, params, x, positions = _setup({})
    small = fa.KVCache.create(batch=2, max_len=4, num_kv_heads=N, head_dim=D // N, rolling=True)
    with pytest.raises(ValueError, match="too small for sliding_window=None"):
        layer.apply(params, x[:, :1], positions[:, :1], cache=small)


@pytest.mark.parametrize("jit", [False, True])
def test_right_padding_into_a_rolling_cache_needs_room_behind_it(jit):
    """Padding after a row's real tokens fills ring slots without moving the row's positions on:
    a ring of at least padding + window slots keeps what the next tokens see (and equals the
    unpadded pass); a smaller one is refused instead of dropping those keys."""
    config, layer, params, x, _ = _setup({"sliding_window": 4}, T=12, B=1)
    seg = jnp.array([[0, 0, 0, -1, -1, -1, -1, -1]])                 # 3 real tokens, 5 padding
    pos = jnp.array([[0, 1, 2, 0, 0, 0, 0, 0]])
    real = jnp.concatenate([x[:, :3], x[:, 8:]], axis=1)             # the row without its padding
    full = layer.apply(params, real, jnp.arange(7)[None])
    apply = jax.jit(layer.apply) if jit else layer.apply
    _, cache = apply(params, x[:, :8], pos, seg, cache=config.init_cache(batch=1, max_len=9, rolling=True))
    for t in range(3, 7):
        out, cache = apply(params, real[:, t:t + 1], jnp.array([[t]]), cache=cache)
        assert_close(out[:, 0], full[:, t], np.float32, f"step at position {t}")
    error = jax.errors.JaxRuntimeError if jit else ValueError
    with pytest.raises(error, match=r"max_len=8 cannot take 5 padding tokens after a row's real ones .* max_len >= 9"):
        jax.block_until_ready(apply(params, x[:, :8], pos, seg, cache=config.init_cache(batch=1, max_len=8, rolling=True)))
    # left padding costs nothing: the real tokens are the newest
    left = jnp.array([[-1, -1, -1, -1, -1, 0, 0, 0]])
    apply(params, x[:, :8], jnp.array([[0, 0, 0, 0, 0, 0, 1, 2]]), left,
          cache=config.init_cache(batch=1, max_len=3, rolling=True))


@pytest.mark.parametrize("pads, real, chunk", [(5, 1, 3), (1, 3, 2), (3, 3, 4), (2, 4, 3)])
def test_a_chunk_after_right_padding_into_a_rolling_cache_equals_the_unpadded_pass_or_is_refused(pads, real, chunk):
    """A chunk of several tokens after right padding in a ring: the padding's slots are not
    keys, so the chunk's writes may overwrite keys its first queries still see. Where they would,
    the call is refused (naming a max_len that suffices); with that max_len the chunk equals
    the pass over the row without its padding, and so do the tokens fed one at a time."""
    config, layer, params, x, _ = _setup({"sliding_window": 3}, T=pads + real + chunk, B=1)
    seg = jnp.array([[0] * real + [-1] * pads])
    pos = jnp.array([list(range(real)) + [0] * pads])
    new = x[:, real + pads:]
    new_pos, new_seg = jnp.arange(real, real + chunk)[None], jnp.zeros((1, chunk), jnp.int32)
    full = layer.apply(params, jnp.concatenate([x[:, :real], new], axis=1), jnp.arange(real + chunk)[None])
    smallest = pads + config.cache_window  # what the padded call itself needs
    step = fa.decode_step(layer)
    prefill = lambda max_len: step(params, config.init_cache(batch=1, max_len=max_len, rolling=True),  # noqa: E731
                                   x[:, :real + pads], pos, seg)[1]
    with pytest.raises(ValueError, match=rf"max_len={smallest} cannot take {chunk} tokens at once here: padding "
                                         rf"after a row's real tokens \({pads} slots\).* max_len >= "
                                         rf"{pads + config.cache_window + chunk - 1}"):
        step(params, prefill(smallest), new, new_pos, new_seg)
        step.check()
    cache = prefill(smallest)
    for t in range(chunk):  # one token at a time fits the same ring
        out, cache = step(params, cache, new[:, t:t + 1], new_pos[:, t:t + 1], new_seg[:, t:t + 1])
        assert_close(out[:, 0], full[:, real + t], np.float32, f"one token at position {real + t}")
    step.check()
    need = pads + config.cache_window + chunk - 1
    out, _ = step(params, prefill(need), new, new_pos, new_seg)
    step.check()
    assert_close(out, full[:, real:], np.float32, f"a chunk of {chunk} in a ring of {need}")


def test_a_cache_of_another_kind_is_refused():
    config, layer, params, x, positions = _setup({})
    latent = fa.MLAConfig(d_model=D, num_heads=2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2,
                          v_head_dim=4).init_cache(2, 16)
    for cache in (latent, {"key": 1}):
        with pytest.raises(TypeError, match=f"cache must be a KVCache .*, got {type(cache).__name__}"):
            layer.apply(params, x, positions, cache=cache)


def test_steps_compile_once():
    config, layer, params, x, positions = _setup({"num_kv_heads": 2, "sliding_window": 4})
    traces = []

    @jax.jit
    def step(params, cache, token, position):
        traces.append(1)  # runs only when jax traces (compiles) the function
        return layer.apply(params, token, position, cache=cache)

    cache = config.init_cache(batch=2, max_len=16)
    _, cache = layer.apply(params, x[:, :4], positions[:, :4], cache=cache)
    for t in range(4, 12):
        _, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])
    assert len(traces) == 1  # traced (so compiled) once for the eight steps


def test_cache_overflow_is_a_clear_error():
    config, layer, params, x, positions = _setup({})
    cache = config.init_cache(batch=2, max_len=6)
    _, cache = layer.apply(params, x[:, :5], positions[:, :5], cache=cache)
    with pytest.raises(ValueError, match=r"KV cache overflow: 5 cached \+ 2 new tokens > max_len=6"):
        layer.apply(params, x[:, 5:7], positions[:, 5:7], cache=cache)
    with pytest.raises(Exception, match=r"KV cache overflow: 5 cached \+ 2 new tokens > max_len=6"):
        jax.block_until_ready(jax.jit(layer.apply)(params, x[:, 5:7], positions[:, 5:7], cache=cache))
    with pytest.raises(ValueError, match="7 new tokens do not fit a cache of max_len=6"):
        layer.apply(params, x[:, :7], positions[:, :7], cache=config.init_cache(batch=2, max_len=6))


def test_positions_beyond_int32_are_refused_not_wrapped():
    """A cache stores int32 positions and segment ids; int64 ones (the suite runs with
    ``jax_enable_x64``) outside int32's range are an error naming them, eagerly and under jit,
    for both cache kinds, and int64 ones within it are stored as they are."""
    assert jax.config.jax_enable_x64
    config, layer, params, x, positions = _setup({})
    big = jnp.full((2, 2), 2**31, jnp.int64)
    with pytest.raises(ValueError, match=r"positions must fit int32 to be stored in a KV cache, got values from "
                                         r"2147483648 to 2147483648"):
        layer.apply(params, x[:, :2], big, cache=config.init_cache(batch=2, max_len=6))
    with pytest.raises(Exception, match="segment_ids must fit int32"):
        jax.block_until_ready(jax.jit(layer.apply)(params, x[:, :2], positions[:, :2], -big - 1,
                                                   cache=config.init_cache(batch=2, max_len=6)))
    _, cache = layer.apply(params, x[:, :2], positions[:, :2].astype(jnp.int64), cache=config.init_cache(2, 6))
    assert cache.positions.dtype == jnp.int32 and cache.positions[:, :2].tolist() == [[0, 1], [0, 1]]
    mla = fa.MLAConfig(d_model=D, num_heads=2, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    latent = fa.MultiHeadLatentAttention(mla)
    latent_params = latent.init(jax.random.key(0), x[:, :2], positions[:, :2])
    with pytest.raises(ValueError, match="positions must fit int32"):
        latent.apply(latent_params, x[:, :2], big, cache=mla.init_cache(2, 6))


def test_cache_takes_left_padded_prompts():
    # Row 1's prompt is 2 tokens shorter: left-padded with segment id -1, positions from 0 at
    # its first real token. Its decoded tokens equal decoding it alone.
    config, layer, params, x, _ = _setup({"num_kv_heads": 2})
    segments = jnp.array([[0] * 12, [-1, -1] + [0] * 10])
    positions = jnp.array([list(range(12)), [0, 0] + list(range(10))])
    cache = config.init_cache(batch=2, max_len=12)
    out, cache = layer.apply(params, x[:, :5], positions[:, :5], segments[:, :5], cache=cache)
    outs = [out]
    for t in range(5, 12):
        out, cache = layer.apply(params, x[:, t:t + 1], positions[:, t:t + 1], segments[:, t:t + 1], cache=cache)
        outs.append(out)
    batched = jnp.concatenate(outs, axis=1)
    alone = layer.apply(params, x[1:, 2:], positions[1:, 2:])
    assert_close(batched[1, 2:], alone[0], np.float32, "left-padded row")
    np.testing.assert_array_equal(batched[1, :2], 0.0)  # padding queries attend to nothing (and no out_bias)


@pytest.mark.parametrize("name", ["gqa-rope-window", "alibi", "t5-decoder"])
def test_decode_steps_match_torch_reference(name):
    config, layer, params, x, positions = _setup(DECODE_CONFIGS[name], dtype=jnp.float64)
    torch.manual_seed(0)
    twin = tr.twin(layer).double()
    params = fa.from_torch_state_dict(layer, tr.state_dict_to_numpy(twin.state_dict()))
    cache, t_cache = config.init_cache(batch=2, max_len=12, dtype=jnp.float64), {}
    tx, tp = torch.from_numpy(np.array(x)), torch.from_numpy(np.array(positions)).long()
    for lo, hi in [(0, 5)] + [(t, t + 1) for t in range(5, 12)]:
        out, cache = layer.apply(params, x[:, lo:hi], positions[:, lo:hi], cache=cache)
        with torch.no_grad():
            t_out, t_cache = twin(tx[:, lo:hi], tp[:, lo:hi], cache=t_cache)
        assert_close(out, t_out.numpy(), np.float64, f"tokens {lo}:{hi}")


def test_cache_is_a_pytree_and_create_validates():
    cache = fa.KVCache.create(batch=2, max_len=8, num_kv_heads=2, head_dim=4)
    leaves = jax.tree_util.tree_leaves(cache)
    assert len(leaves) == 5 and int(cache.length) == 0
    assert (np.asarray(cache.segment_ids) == -1).all()
    with pytest.raises(ValueError, match="max_len must be a positive integer"):
        fa.KVCache.create(batch=2, max_len=0, num_kv_heads=2, head_dim=4)


# ---------------------------------------------------------------- rolling back, on purpose only

def _filled(T=6, max_len=10):
    config, layer, params, x, positions = _setup({"num_kv_heads": 2}, T=T)
    _, cache = layer.apply(params, x, positions, cache=config.init_cache(batch=2, max_len=max_len))
    return config, layer, params, x, positions, cache


def test_positions_that_go_backwards_raise():
    config, layer, params, x, positions, cache = _filled()
    message = r"KV cache positions go backwards: new positions \(smallest per row \[{}\]\) .* \(largest per row \[5, 5\]\)"
    with pytest.raises(ValueError, match=message.format("3, 3") + ".*cache.truncate"):
        layer.apply(params, x[:, :1], jnp.full((2, 1), 3), cache=cache)
    with pytest.raises(ValueError, match=message.format("5, 6")):  # a repeated position is not after the cache
        layer.apply(params, x[:, :1], jnp.array([[5], [6]]), cache=cache)
    with pytest.raises(Exception, match=message.format("4, 4")):  # under jit: when the program runs
        jax.block_until_ready(jax.jit(layer.apply)(params, x[:, :1], jnp.full((2, 1), 4), cache=cache))
    out, _ = layer.apply(params, x[:, :1], jnp.full((2, 1), 9), cache=cache)  # a gap forward is fine
    assert out.shape == (2, 1, D)


def test_padding_positions_are_not_checked():
    # left padding (segment id -1) may repeat positions; only real tokens must move forward
    config, layer, params, x, _ = _setup({})
    segments = jnp.array([[0, 0, 0], [-1, -1, 0]])
    positions = jnp.array([[0, 1, 2], [7, 7, 0]])
    _, cache = layer.apply(params, x[:, :3], positions, segments, cache=config.init_cache(batch=2, max_len=8))
    out, cache = layer.apply(params, x[:, 3:4], jnp.array([[3], [1]]), jnp.zeros((2, 1), jnp.int32), cache=cache)
    assert int(cache.length) == 4 and np.isfinite(np.asarray(out)).all()
    with pytest.raises(ValueError, match="positions go backwards"):
        layer.apply(params, x[:, 3:4], jnp.array([[3], [0]]), jnp.zeros((2, 1), jnp.int32), cache=cache)


@pytest.mark.parametrize("jit", [False, True])
def test_truncate_rolls_back_exactly(jit):
    # Cache 6 tokens, roll back to 4 and decode 2 others. The first 4 slots are kept bit for bit
    # and the rest emptied; the result is a cache that only ever saw the first 4 (its bookkeeping
    # exactly; its keys and values up to float32 rounding: they are projections of 4 rows instead
    # of 6, and a CPU's matmul blocking may follow the row count); decoding on from it equals the
    # full pass over the new sequence.
    config, layer, params, x, positions, cache = _filled()
    truncate = jax.jit(lambda c, n: c.truncate(n)) if jit else (lambda c, n: c.truncate(n))
    rolled = truncate(cache, jnp.int32(4) if jit else 4)
    _, fresh = layer.apply(params, x[:, :4], positions[:, :4], cache=config.init_cache(batch=2, max_len=10))
    assert int(rolled.length) == int(fresh.length) == 4
    for name, fill in (("key", 0), ("value", 0), ("positions", 0), ("segment_ids", -1)):
        kept, before = np.asarray(getattr(rolled, name)), np.asarray(getattr(cache, name))
        np.testing.assert_array_equal(kept[:, :4], before[:, :4], err_msg=name)  # slots on axis 1
        assert (kept[:, 4:] == fill).all(), f"{name}: slots past the length not emptied"
    for name in ("positions", "segment_ids"):
        np.testing.assert_array_equal(getattr(rolled, name), getattr(fresh, name), err_msg=name)
    for name in ("key", "value"):
        assert_close(getattr(rolled, name), getattr(fresh, name), np.float32, name)
    other = x[:, ::-1][:, :2]
    out, rolled = layer.apply(params, other, positions[:, 4:6], cache=rolled)
    full = layer.apply(params, jnp.concatenate([x[:, :4], other], axis=1), positions[:, :6])
    assert_close(out, full[:, 4:], np.float32, "after rolling back")
    assert int(rolled.length) == 6


def test_truncate_checks_its_argument():
    config, layer, params, x, positions, cache = _filled()
    with pytest.raises(ValueError, match=r"truncate\(length=7\): length must lie in \[0, 6\], the tokens cached"):
        cache.truncate(7)
    with pytest.raises(Exception, match=r"truncate\(length=-1\): length must lie in \[0, 6\]"):
        jax.block_until_ready(jax.jit(lambda c, n: c.truncate(n))(cache, jnp.int32(-1)))
    with pytest.raises(TypeError, match="length must be an integer scalar, got 2.0"):
        cache.truncate(2.0)
    empty = cache.truncate(0)
    assert int(empty.length) == 0 and (np.asarray(empty.segment_ids) == -1).all()
    rolling = fa.AttentionConfig(d_model=D, num_heads=N, sliding_window=4).init_cache(batch=1, max_len=4, rolling=True)
    with pytest.raises(ValueError, match="a rolling cache cannot be truncated"):
        rolling.truncate(0)


# ---------------------------------------------------------------- Llama 4 and Falcon-RW layers, cached

@pytest.mark.parametrize("name, cfg", [
    ("llama4", {"chunk_size": 4, "num_kv_heads": 2, "qk_norm": True, "qk_norm_weight": False,
                "rope_layout": "interleaved", "temperature_tuning": (2.0, 0.5)}),
    ("falcon-rw", {"position": "alibi", "alibi_scaled": True, "qkv_bias": True}),
])
def test_cached_decoding_of_llama4_and_falcon_layers(name, cfg):
    # Prefill 5 tokens, then one per step, the second row at an offset (chunk boundaries and the
    # temperature follow positions): equal to the full pass (itself equal to the torch twin, see
    # test_attention.py). Llama 4's chunked layer also decodes token by token with a rolling cache
    # of chunk_size slots.
    config = fa.AttentionConfig(d_model=D, num_heads=N, **cfg)
    layer = fa.Attention(config)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 9, D)))
    positions = jnp.arange(9)[None] + jnp.array([[0], [3]])
    params = jax.jit(layer.init)(jax.random.key(0), x, positions)
    full = jax.jit(layer.apply)(params, x, positions)
    decoded, _ = _decode(layer, params, config.init_cache(batch=2, max_len=9, dtype=jnp.float64), x, positions,
                         prefill=5)
    assert_close(decoded, full, np.float64, f"{name}, linear cache")
    if config.chunk_size is not None:
        rolling = config.init_cache(batch=2, max_len=4, dtype=jnp.float64, rolling=True)
        decoded, rolling = _decode(layer, params, rolling, x, positions, prefill=1)
        assert_close(decoded, full, np.float64, f"{name}, rolling cache")
        assert rolling.key.shape[1] == 4


def test_rolling_cache_for_chunks_needs_chunk_minus_one_slots():
    config = fa.AttentionConfig(d_model=D, num_heads=N, chunk_size=4)
    assert config.cache_window == 4
    assert fa.AttentionConfig(d_model=D, num_heads=N, chunk_size=4, sliding_window=2).cache_window == 2
    with pytest.raises(ValueError, match=r"sliding_window=None, chunk_size=4 needs max_len >= 3, got 2"):
        config.init_cache(batch=1, max_len=2, rolling=True)


# ---------------------------------------------------------------- cross-attention keys and values, once

def test_context_kv_decoder_equals_the_raw_context():
    # A decoder block: causal self-attention with a KV cache, then cross-attention to an encoder's
    # output. The cross-attention's keys and values are computed once (a ContextKV) and reused at
    # every jitted step; the result equals the full pass, which projects the raw context.
    B, T, S = 2, 5, 5
    self_layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2))
    cross = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2, causal=False, qk_norm=True,
                                            qkv_bias=True))
    rng = np.random.default_rng(2)
    x, context = jnp.asarray(rng.standard_normal((B, T, D))), jnp.asarray(rng.standard_normal((B, S, D)))
    positions, c_positions = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.arange(S)[None] + jnp.array([[0], [2]])
    c_segments = jnp.array([[0, 0, 0, 0, 0], [0, 0, 0, -1, -1]])  # row 1's context is padded
    segments = jnp.zeros((B, T), jnp.int32)
    p_self, p_cross = jax.jit(lambda k1, k2: (
        self_layer.init(k1, x, positions),
        cross.init(k2, x, positions, segments, context, c_positions, c_segments)))(jax.random.key(0), jax.random.key(1))

    @jax.jit
    def full_pass(x):
        h = x + self_layer.apply(p_self, x, positions)
        return h + cross.apply(p_cross, h, positions, segments, context, c_positions, c_segments)

    ckv = jax.jit(lambda c, p, s: cross.apply(p_cross, c, p, s, method="context_kv"))(context, c_positions, c_segments)
    assert isinstance(ckv, fa.layers.ContextKV) and ckv.key.shape == (B, S, 2, D // N)

    @jax.jit
    def step(cache, ckv, x_t, pos_t, seg_t):
        a, cache = self_layer.apply(p_self, x_t, pos_t, seg_t, cache=cache)
        h = x_t + a
        return h + cross.apply(p_cross, h, pos_t, seg_t, context=ckv), cache

    cache = self_layer.init_cache(B, T, dtype=jnp.float64)
    outs = []
    for t in range(T):
        out, cache = step(cache, ckv, x[:, t:t + 1], positions[:, t:t + 1], segments[:, t:t + 1])
        outs.append(out)
    assert_close(jnp.concatenate(outs, axis=1), full_pass(x), np.float64, "decoded with a ContextKV vs full pass")


@pytest.mark.parametrize("layout, block", [("BKSH", None), ("BSKH", None), ("blocks", 2)])
def test_reserve_grows_the_cache_as_tokens_arrive(layout, block):
    # A cache sized for the prompt, grown by reserve(t + 1) before each step through the jitted
    # step: the outputs equal the full pass; each growth keeps the tokens bit for bit, its new
    # slots empty, and is at least growth x the slots, a whole number of blocks.
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2)
    layer = fa.Attention(config)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 11, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(11), (2, 11))
    params = layer.init(jax.random.key(0), x, positions)
    full = layer.apply(params, x, positions)
    step = fa.decode_step(layer)
    extra = {"block": block} if block else {}
    cache = layer.init_cache(2, 4, layout=layout, **extra)
    out, cache = step(params, cache, x[:, :4], positions[:, :4])
    from flax_attn.layers.cache import BLOCK
    pieces, sizes, multiple = [out], [cache.max_len], block or BLOCK
    for t in range(4, 11):
        before = cache
        cache = cache.reserve(t + 1, growth=1.5)
        if cache is not before:
            assert cache.max_len >= 1.5 * before.max_len and cache.max_len % multiple == 0, (before.max_len, cache.max_len)
            for name, fill in (("positions", 0), ("segment_ids", -1)):
                grown, kept = np.asarray(getattr(cache, name)), np.asarray(getattr(before, name))
                np.testing.assert_array_equal(grown[:, :before.max_len], kept, err_msg=name)
                assert (grown[:, before.max_len:] == fill).all(), name
            np.testing.assert_array_equal(cache.keys()[:, :before.max_len], before.keys())
            np.testing.assert_array_equal(cache.values()[:, before.max_len:], 0.0)
            assert int(cache.length) == int(before.length) and cache.layout == layout
        sizes.append(cache.max_len)
        out, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])
        pieces.append(out)
    # one growth to a whole block of 128 slots; blocks of 2 grow 4 -> 6 -> 10 -> 16
    assert sizes[0] == 4 and sizes[-1] >= 11 and len(set(sizes)) == (2 if multiple == BLOCK else 4), sizes
    assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, f"{layout}: decoding through reserve vs full pass")
    assert cache.reserve(11) is cache  # room already: the same cache
    shrunk = cache.resize(11 if layout != "blocks" else 12)
    np.testing.assert_array_equal(shrunk.keys()[:, :11], cache.keys()[:, :11])
    out, _ = layer.apply(params, x[:, 10:], positions[:, 10:], cache=shrunk.truncate(10))
    assert_close(out, full[:, 10:], np.float32, "after resizing down")
    # resize gives a copy, to any size: a step that donates it leaves the original whole
    for size in (cache.max_len, 2 * cache.max_len):
        _, stepped = step(params, cache.resize(size), x[:, 10:], positions[:, 10:] + 1)
        assert int(cache.length) == 11 and int(stepped.length) == 12
        np.testing.assert_array_equal(cache.keys()[:, :11], stepped.keys()[:, :11])


def test_resize_and_reserve_check_their_arguments():
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2)
    layer = fa.Attention(config)
    x = jnp.ones((1, 5, D), jnp.float32)
    params = layer.init(jax.random.key(0), x, jnp.arange(5)[None])
    _, cache = layer.apply(params, x, jnp.arange(5)[None], cache=layer.init_cache(1, 6))
    with pytest.raises(ValueError, match=r"resize\(max_len=4\): the cache holds 5 tokens, more than max_len"):
        cache.resize(4)
    with pytest.raises(Exception, match=r"resize\(max_len=4\): the cache holds 5 tokens"):  # when the compiled program runs
        jax.block_until_ready(jax.jit(lambda c: c.resize(4))(cache).key)
    with pytest.raises(ValueError, match="resize max_len"):
        cache.resize(0)
    with pytest.raises(TypeError, match=r"tokens must be an int .* got 7.0"):
        cache.reserve(7.0)
    with pytest.raises(ValueError, match="growth must be a number above 1"):
        cache.reserve(7, growth=1.0)
    assert cache.reserve(7).max_len == 128  # 1.25 x 6 slots at least, rounded up to whole blocks of 128
    blocks = layer.init_cache(1, 8, layout="blocks", block=4)
    with pytest.raises(ValueError, match=r"resize\(max_len=10\) is not a multiple of block=4 \(take max_len=12\)"):
        blocks.resize(10)
    assert blocks.reserve(9).max_len == 12 and blocks.reserve(9).key.shape == (3, 2, 4, D // N)
    rolling = fa.AttentionConfig(d_model=D, num_heads=N, sliding_window=4).init_cache(batch=1, max_len=4, rolling=True)
    with pytest.raises(ValueError, match="a rolling cache cannot be resized"):
        rolling.reserve(8)
