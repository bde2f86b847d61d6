"""The decoding path: keys written into the cache in place, attention over the cache itself,
both cache layouts, the jitted step with the cache donated (flax_attn.decode_step, Linen and
NNX), the cache's dtype, and padding that never reaches the cache."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn
from flax import nnx

import flax_attn as fa
from conftest import assert_close

D, N = 16, 4


def _setup(cfg=None, T=10, B=2, dtype=jnp.float32, seed=0):
    config = fa.AttentionConfig(d_model=D, num_heads=N, **(cfg or {}))
    layer = fa.Attention(config, param_dtype=dtype)
    x = jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), dtype)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    params = layer.init(jax.random.key(seed), x, positions)
    return config, layer, params, x, positions


@pytest.mark.parametrize("cfg", [{"num_kv_heads": 2}, {"num_kv_heads": 1, "sliding_window": 3}],
                         ids=["gqa", "mqa-window"])
def test_bksh_layout_decodes_like_the_full_pass(cfg):
    config, layer, params, x, positions = _setup(cfg)
    apply = jax.jit(layer.apply)  # one program per shape, as below: this test is about the cache, not eager dispatch
    full = apply(params, x, positions)
    caches = {lay: layer.init_cache(2, 12, layout=lay) for lay in ("BSKH", "BKSH")}
    assert caches["BKSH"].key.shape == (2 * config.kv_heads, 12, D // N)  # (B*K, S, H), batch-major
    outs = {}
    for lay, cache in caches.items():
        out, cache = apply(params, x[:, :4], positions[:, :4], cache=cache)
        pieces = [out]
        for t in range(4, 10):
            out, cache = apply(params, x[:, t:t + 1], positions[:, t:t + 1], cache=cache)
            pieces.append(out)
        outs[lay] = jnp.concatenate(pieces, axis=1)
        caches[lay] = cache
        assert_close(outs[lay], full, np.float32, f"{lay} decode vs full pass")
    # the same keys in either order of axes
    np.testing.assert_array_equal(caches["BKSH"].keys(), caches["BSKH"].key)
    np.testing.assert_array_equal(caches["BKSH"].values(), caches["BSKH"].value)
    if config.sliding_window:
        # a rolling ring of max_len = window: the prompt is attended with the ring and its own keys,
        # each step writes its slot first and attends over the ring alone
        ring = layer.init_cache(2, config.sliding_window, rolling=True)
        out, ring = apply(params, x[:, :4], positions[:, :4], cache=ring)
        pieces = [out]
        for t in range(4, 10):
            out, ring = apply(params, x[:, t:t + 1], positions[:, t:t + 1], cache=ring)
            pieces.append(out)
        assert ring.key.shape == (2 * 1, config.sliding_window, D // N)
        assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, "rolling BKSH decode vs full pass")
    rolled = caches["BKSH"].truncate(5)
    np.testing.assert_array_equal(rolled.keys()[:, 5:], 0.0)
    np.testing.assert_array_equal(rolled.keys()[:, :5], caches["BSKH"].key[:, :5])


@pytest.mark.parametrize("cfg", [{"num_kv_heads": 2}, {"num_kv_heads": 1, "sliding_window": 3}],
                         ids=["gqa", "mqa-window"])
def test_blocks_layout_decodes_like_the_full_pass(cfg):
    """A ``layout='blocks'`` cache, ``(S // block, B*K, block, H)``: a prompt, a chunk of three
    and single tokens, Linen and NNX, give the full pass's outputs; its keys and values read as
    the default layout's; the fill passes half the slots, so both the blocks visited one by one
    and the one pass over all of them run; a rolling ring and ``truncate`` work the same way."""
    config, layer, params, x, positions = _setup(cfg)
    apply = jax.jit(layer.apply)  # one program per shape: this test is about the cache, not eager dispatch
    full = apply(params, x, positions)
    H = D // N
    blocks, bksh = layer.init_cache(2, 16, layout="blocks", block=4), layer.init_cache(2, 16)
    assert blocks.key.shape == (4, 2 * config.kv_heads, 4, H) and blocks.max_len == 16
    outs = {}
    for name, cache in (("blocks", blocks), ("BKSH", bksh)):
        pieces = []
        for a, b in ((0, 4), (4, 7), (7, 8), (8, 9), (9, 10)):
            out, cache = apply(params, x[:, a:b], positions[:, a:b], cache=cache)
            pieces.append(out)
        outs[name] = cache
        assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, f"{name} cache decode vs full pass")
    np.testing.assert_array_equal(outs["blocks"].keys(), outs["BKSH"].keys())
    np.testing.assert_array_equal(outs["blocks"].values(), outs["BKSH"].values())
    # derivatives of a step over either cache agree (a fill past half: the one pass over all blocks)
    grads = {name: jax.jit(jax.grad(lambda p, xs, c: jnp.sum(layer.apply(p, xs, positions[:, 9:], cache=c)[0] ** 2),
                                    argnums=(0, 1)))(params, x[:, 9:], c)
             for name, c in (("blocks", outs["blocks"].truncate(9)), ("BKSH", outs["BKSH"].truncate(9)))}
    for got, want in zip(jax.tree.leaves(grads["blocks"]), jax.tree.leaves(grads["BKSH"])):
        assert_close(got, want, np.float32, "gradient of a step over a blocks cache")
    rolled = outs["blocks"].truncate(5)
    np.testing.assert_array_equal(rolled.keys(), outs["BKSH"].truncate(5).keys())
    out, _ = apply(params, x[:, 5:6], positions[:, 5:6], cache=rolled)
    assert_close(out, full[:, 5:6], np.float32, "a step after truncate(5)")
    twin = fa.nnx.Attention(config, rngs=nnx.Rngs(0))
    nnx.update(twin, nnx.State(params["params"]))
    cache = twin.init_cache(2, 16, layout="blocks", block=4)
    out, cache = twin(x[:, :9], positions[:, :9], cache=cache)
    out, cache = twin(x[:, 9:], positions[:, 9:], cache=cache)
    assert_close(out, full[:, 9:], np.float32, "NNX blocks cache step")
    if config.sliding_window:
        ring = layer.init_cache(2, 4, rolling=True, layout="blocks", block=2)
        pieces = []
        for a, b in ((0, 4), (4, 5), (5, 7), (7, 8), (8, 9), (9, 10)):
            out, ring = apply(params, x[:, a:b], positions[:, a:b], cache=ring)
            pieces.append(out)
        assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, "rolling blocks decode vs full pass")


def test_blocks_layout_steps_read_and_write_the_cache_in_place():
    """A donated step over a ``'blocks'`` cache writes its buffers in place, and its compiled
    program makes no array of the cache's size but the in-place update: no copy, transpose or
    concatenation of all the keys or values, in either the blocks visited one by one (each
    block is copied out alone, a smaller array) or the one pass over all of them."""
    config, layer, params, x, positions = _setup({"num_kv_heads": 2}, T=13)
    B, S, c, K, H = 2, 16, 4, 2, D // N
    step = fa.decode_step(layer)
    for fill in (3, 11):  # below and above half of the 16 slots
        cache = layer.init_cache(B, S, layout="blocks", block=c)
        out, cache = step(params, cache, x[:, :fill], positions[:, :fill])
        pointer = cache.key.unsafe_buffer_pointer()
        before = cache
        out, cache = step(params, cache, x[:, fill:fill + 1], positions[:, fill:fill + 1])
        assert before.key.is_deleted() and cache.key.unsafe_buffer_pointer() == pointer
        hlo = step.jitted.lower(params, cache, x[:, :1], positions[:, fill + 1:fill + 2], None).compile().as_text()
        sized = {f"f32[{S // c},{B * K},{c},{H}]", f"f32[{B},{S},{K},{H}]", f"f32[{B * K},{S},{H}]",
                 f"f32[{B},{S // c},{c},{K},{H}]", f"f32[{B * K},{S // c},{c},{H}]"}
        made = [(shape, op, name) for name, shape, op in re.findall(r"%(\S+) = (f32\[[\d,]+\])\S* ([\w-]+)\(", hlo)
                if shape in sized]
        assert made, "the cache's arrays are in the program"
        for shape, op, name in made:
            assert op in ("parameter", "get-tuple-element", "tuple", "bitcast", "dynamic-update-slice", "scatter") or (
                op == "fusion" and ("dynamic-update-slice" in name or "scatter" in name)), (shape, op, name)


@pytest.mark.skipif(fa.core.native.unavailable() is not None, reason="the compiled CPU kernel cannot run here")
@pytest.mark.parametrize("layout", ["BKSH", "BSKH"])
@pytest.mark.parametrize("cfg", [{"num_kv_heads": 2}, {"num_kv_heads": 2, "sliding_window": 5}, {"num_kv_heads": 1}],
                         ids=["gqa", "window", "mqa"])
def test_steps_attend_through_the_kernel_over_the_cache_where_it_lies(layout, cfg):
    """On CPU a float32 decoding step over a ``'BKSH'`` or ``'BSKH'`` cache is served by the
    compiled kernel (its logits compared by the cache's positions): equal to the full pass, and
    its compiled program makes no array of the cache's size but the in-place update (the
    kernel reads a ``'BKSH'`` cache as it is stored, ``(B K, S, H)``; a reshape between the
    update and the kernel would be fused with the update into a copy of the cache)."""
    B, S, T, d, heads = 2, 24, 12, 64, 4  # heads of 16, as the kernel needs
    config = fa.AttentionConfig(d_model=d, num_heads=heads, **cfg)
    layer = fa.Attention(config)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, d)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(T) + 5, (B, T))
    params = layer.init(jax.random.key(3), x, positions)
    full = jax.jit(layer.apply)(params, x, positions)
    step = fa.decode_step(layer)
    cache = layer.init_cache(B, S, layout=layout)
    out, cache = step(params, cache, x[:, :7], positions[:, :7])
    pieces = [out]
    for t in range(7, T):
        out, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])
        pieces.append(out)
    assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, f"kernel steps over a {layout} cache")
    hlo = step.jitted.lower(params, cache, x[:, :1], positions[:, :1], None).compile().as_text()
    assert re.search(r'custom_call_target="flax_attn_cpu_\w+_forward"', hlo), "the step runs the kernel"
    K, H = config.kv_heads, d // heads
    sized = {f"f32[{B},{S},{K},{H}]", f"f32[{B * K},{S},{H}]", f"f32[{B},{K},{S},{H}]", f"f32[{B},{S},{H}]"}
    made = [(shape, op, name) for name, shape, op in re.findall(r"%(\S+) = (f32\[[\d,]+\])\S* ([\w-]+)\(", hlo)
            if shape in sized]
    assert made, "the cache's arrays are in the program"
    for shape, op, name in made:
        assert op in ("parameter", "get-tuple-element", "tuple", "bitcast", "dynamic-update-slice") or (
            op == "fusion" and "dynamic-update-slice" in name), (shape, op, name)


def test_blocks_layout_needs_whole_blocks():
    with pytest.raises(ValueError, match=r"max_len=10 is not a multiple of block=4 \(take max_len=12"):
        fa.KVCache.create(batch=1, max_len=10, num_kv_heads=1, head_dim=8, layout="blocks", block=4)
    with pytest.raises(ValueError, match="block"):
        fa.KVCache.create(batch=1, max_len=8, num_kv_heads=1, head_dim=8, layout="blocks", block=0)
    from flax_attn.core import tuning
    with pytest.raises(ValueError, match="a block size goes with layout 'blocks'"):
        with tuning.keys_stored("blocks"):
            pass


def test_decode_step_linen_jits_once_and_updates_in_place(monkeypatch):
    from flax_attn.layers import attention

    config, layer, params, x, positions = _setup({"num_kv_heads": 2})
    full = layer.apply(params, x, positions)
    traced = []  # the query length of every trace of the layer's computation from here on
    attend = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda c, p, x, *a: (traced.append(x.shape[1]), attend(c, p, x, *a))[1])
    step = fa.decode_step(layer)
    cache = layer.init_cache(2, 12, layout="BKSH")
    out, cache = step(params, cache, x[:, :4], positions[:, :4])  # prefill: its own compilation
    pieces = [out]
    for t in range(4, 10):
        before = cache
        pointer = cache.key.unsafe_buffer_pointer()
        out, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])
        pieces.append(out)
        assert before.key.is_deleted() and before.value.is_deleted()  # donated
        assert cache.key.unsafe_buffer_pointer() == pointer            # written in place, not copied
    assert_close(jnp.concatenate(pieces, axis=1), full, np.float32, "decode_step vs full pass")
    assert int(cache.length) == 10
    # one trace (so one compilation) for the prompt's shape, one for all steps; not the size of
    # JAX's compiled-call cache (`step.jitted._cache_size()`), which read 0 once in a full run of
    # the suite, its entries dropped by something else in the same process
    assert traced == [4, 1]
    # a layer with dropout decodes deterministically
    drop = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2, dropout=0.5))
    out, _ = fa.decode_step(drop, donate=False)(params, drop.init_cache(2, 4), x[:, :2], positions[:, :2])
    assert_close(out, full[:, :2], np.float32, "dropout layer decodes without dropout")


class _Container(nn.Module):
    """A decoder of one attention layer with dropout, as users write them: ``deterministic``
    defaults to False (training) and is passed on, or, without the argument, always False."""
    config: fa.AttentionConfig
    takes_deterministic: bool = True

    @nn.compact
    def __call__(self, x, positions, cache=None, deterministic=False):
        if not self.takes_deterministic:
            deterministic = False
        return fa.Attention(self.config, name="attn")(x, positions, cache=cache, deterministic=deterministic)


def test_decode_step_runs_a_linen_container_deterministically():
    """A container whose call takes ``deterministic`` is called with True (its dropout layer then
    equals the same layer without dropout); one that hides it gets a TypeError that says what to
    do, not Flax's missing-RNG error from inside the step."""
    config, layer, params, x, positions = _setup({"num_kv_heads": 2})
    full = layer.apply(params, x, positions)
    drop = dataclasses.replace(config, dropout=0.5)
    wrapped = {"params": {"attn": params["params"]}}
    out, _ = fa.decode_step(_Container(drop), donate=False)(wrapped, layer.init_cache(2, 4), x[:, :2], positions[:, :2])
    assert_close(out, full[:, :2], np.float32, "container decodes without dropout")
    step = fa.decode_step(_Container(drop, takes_deterministic=False), donate=False)
    with pytest.raises(TypeError, match=r"decode_step runs _Container without RNGs .*`deterministic` argument"):
        step(wrapped, layer.init_cache(2, 4), x[:, :2], positions[:, :2])


def test_decode_step_exports_with_its_checks_as_outputs():
    """``jax.export`` of ``step.jitted`` (checks as outputs, no callbacks): the exported program
    gives the step's output and cache; an overflowing call gives NaN and checks that
    ``step.raise_failed`` reads as the overflow."""
    config, layer, params, x, positions = _setup({"num_kv_heads": 2})
    step = fa.decode_step(layer, donate=False)
    cache = layer.init_cache(2, 3)
    exported = jax.export.export(step.jitted)(params, cache, x[:, :2], positions[:, :2], None)
    (out, new_cache), checks = exported.call(params, cache, x[:, :2], positions[:, :2], None)
    want, want_cache = step(params, cache, x[:, :2], positions[:, :2])
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(new_cache.key, want_cache.key)
    step.raise_failed(checks)  # all passed: no error
    (out, _), checks = exported.call(params, new_cache, x[:, 2:4], positions[:, 2:4], None)
    assert np.isnan(np.asarray(out)).all()
    with pytest.raises(ValueError, match=r"KV cache overflow: 2 cached \+ 2 new tokens > max_len=3"):
        step.raise_failed(checks)


def test_decode_step_nnx_equals_linen():
    config, layer, params, x, positions = _setup({"num_kv_heads": 2, "qk_norm": True})
    model = fa.nnx.from_linen(layer, params)
    step_l, step_n = fa.decode_step(layer), fa.decode_step(model)
    cache_l, cache_n = layer.init_cache(2, 12), model.init_cache(2, 12)
    for lo, hi in [(0, 3)] + [(t, t + 1) for t in range(3, 6)]:
        out_l, cache_l = step_l(params, cache_l, x[:, lo:hi], positions[:, lo:hi])
        out_n, cache_n = step_n(cache_n, x[:, lo:hi], positions[:, lo:hi])
        np.testing.assert_allclose(out_n, out_l, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(cache_n.key, cache_l.key)
    with pytest.raises(TypeError, match="decode_step takes a Linen or NNX module, got function"):
        fa.decode_step(lambda x: x)


def test_decode_step_checks_without_host_callbacks():
    """The step's run-time checks are outputs of the program, not host callbacks (which keep
    JAX off its fast dispatch path): a prefill raises at once, a one-token step `check_lag`
    calls later or at step.check(), and the failed step's out is NaN."""
    config, layer, params, x, positions = _setup({"num_kv_heads": 2})
    step = fa.decode_step(layer)
    cache = layer.init_cache(2, 6)
    hlo = step.jitted.lower(params, cache, x[:, :1], positions[:, :1], None).compile().as_text()
    assert not re.search(r'custom_call_target="[^"]*callback', hlo)
    out, cache = step(params, cache, x[:, :4], positions[:, :4])
    with pytest.raises(ValueError, match=r"KV cache overflow: 4 cached \+ 3 new tokens > max_len=6"):
        step(params, cache, x[:, 4:7], positions[:, 4:7])  # a prefill's checks are read at once

    cache = layer.init_cache(2, 6)
    out, cache = step(params, cache, x[:, :5], positions[:, :5])
    out, cache = step(params, cache, x[:, 5:6], positions[:, 5:6])
    assert np.isfinite(np.asarray(out)).all()
    out, cache = step(params, cache, x[:, 6:7], positions[:, 6:7])  # the seventh token of six slots
    assert np.isnan(np.asarray(out)).all()
    with pytest.raises(ValueError, match=r"KV cache overflow: 6 cached \+ 1 new tokens > max_len=6.*its output is NaN"):
        step.check()
    step.check()  # read once

    for lag in (1, 3):  # a one-token step's checks are read `check_lag` calls later
        step = fa.decode_step(layer, check_lag=lag)
        cache = layer.init_cache(2, 8)
        out, cache = step(params, cache, x[:, :3], positions[:, :3])
        out, cache = step(params, cache, x[:, 3:4], positions[:, 1:2])  # positions go backwards
        for t in range(4, 4 + lag - 1):
            out, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])  # not read yet
        with pytest.raises(ValueError, match="KV cache positions go backwards"):
            step(params, cache, x[:, 7:8], positions[:, 7:8])
        step.check()  # nothing left unread
    with pytest.raises(ValueError, match=r"check_lag must be a positive integer, got 0"):
        fa.decode_step(layer, check_lag=0)


def _feedback(out):
    """A decode_loop's next_input for a layer: the next input from the output (bounded, (B, 1, D)), and
    the output itself kept."""
    return jnp.tanh(out), out


def test_decode_loop_equals_a_loop_of_steps():
    """decode_loop's steps (one program: a scan, the next input computed on the device) give a
    Python loop of decode_step's outputs and cache; Linen and NNX; the cache donated."""
    config, layer, params, x, positions = _setup({"num_kv_heads": 2})
    step = fa.decode_step(layer)
    cache = layer.init_cache(2, 12)
    _, cache = step(params, cache, x[:, :4], positions[:, :4])
    keep = jax.tree.map(jnp.copy, cache)
    want, xt = [], x[:, 4:5]
    for t in range(4, 10):
        out, cache = step(params, cache, xt, positions[:, t:t + 1])
        xt, kept = _feedback(out)
        want.append(kept)
    loop = fa.decode_loop(layer, _feedback)
    before = jax.tree.map(jnp.copy, keep)
    got, got_cache = loop(params, before, x[:, 4:5], positions[:, 4:5], 6)
    assert before.key.is_deleted()                                   # donated
    assert got.shape == (6, 2, 1, D)                                 # stacked over the steps
    assert_close(got, jnp.stack(want), np.float32, "decode_loop vs decode_step")
    assert_close(got_cache.key, cache.key, np.float32, "the caches")
    assert int(got_cache.length) == 10

    model = fa.nnx.from_linen(layer, params)
    got_nnx, _ = fa.decode_loop(model, _feedback)(jax.tree.map(jnp.copy, keep), x[:, 4:5], positions[:, 4:5], 6)
    np.testing.assert_allclose(got_nnx, got, rtol=1e-6, atol=1e-6)


class _NNXStack(nnx.Module):
    """Two fa.nnx.Attention layers made by nnx.vmap and applied by nnx.scan (the stacked-layer
    pattern of NNX), a residual around each; its caches stacked on a leading layer axis."""

    def __init__(self, config, rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return fa.nnx.Attention(config, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x, positions, cache=None):
        if cache is None:
            @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
            def full(layer, h, positions):
                return h + layer(h, positions)

            return full(self.layers, x, positions)

        @nnx.scan(in_axes=(0, nnx.Carry, None, 0), out_axes=(nnx.Carry, 0))
        def cached(layer, h, positions, c):
            out, c = layer(h, positions, cache=c)
            return h + out, c

        return cached(self.layers, x, positions, cache)


def test_nnx_containers_decode_in_eval_mode_through_their_own_transforms():
    """An NNX model that runs NNX transforms itself (nnx.scan over nnx.vmap-made layers) decodes
    through decode_step and decode_loop alike, equal to its uncached pass; left in training mode
    with attention dropout, its steps still drop nothing (the step's copy runs in eval mode),
    and the model itself stays in training mode."""
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=2, position="rope", dropout=0.5)
    model = _NNXStack(config, nnx.Rngs(params=0, dropout=1))
    model.train()
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 8, D)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    caches = lambda: jax.tree.map(lambda a: jnp.stack([a, a]),  # noqa: E731 - one cache per layer
                                  config.init_cache(2, 12, dtype=jnp.float32))
    model.eval()
    full = model(x, positions)
    model.train()
    step = fa.decode_step(model)
    out, cache = step(caches(), x[:, :5], positions[:, :5])
    assert_close(out, full[:, :5], np.float32, "prefill in training mode")
    outs = []
    for t in range(5, 8):
        o, cache = step(cache, x[:, t:t + 1], positions[:, t:t + 1])
        outs.append(o)
    step.check()
    assert_close(jnp.concatenate(outs, axis=1), full[:, 5:], np.float32, "steps in training mode")
    _, cache = step(caches(), x[:, :5], positions[:, :5])
    got, _ = fa.decode_loop(model, lambda out: (out, out))(cache, x[:, 5:6], positions[:, 5:6], 3)
    want = [full[:, 5:6]]  # the loop feeds each output back as the next input: compare with steps doing so
    _, cache = step(caches(), x[:, :5], positions[:, :5])
    xt = x[:, 5:6]
    for t in range(5, 8):
        xt, cache = step(cache, xt, positions[:, t:t + 1])
        want.append(xt)
    assert_close(got, jnp.stack(want[1:]), np.float32, "decode_loop vs decode_step")
    dropped = model(x, positions)  # the model itself is still in training mode: its own calls drop
    assert float(jnp.max(jnp.abs(dropped - full))) > 0.1


def test_decode_loop_keys_and_errors():
    config, layer, params, x, positions = _setup({"num_kv_heads": 2})
    key = jax.random.key(3)
    loop = fa.decode_loop(layer, lambda out, k: (out, jax.random.key_data(k)), donate=False)
    cache = layer.init_cache(2, 12)
    keys, _ = loop(params, cache, x[:, :1], positions[:, :1], 3, key=key)  # step t gets fold_in(key, t)
    np.testing.assert_array_equal(keys, np.stack([jax.random.key_data(jax.random.fold_in(key, t)) for t in range(3)]))

    loop = fa.decode_loop(layer, _feedback, donate=False)
    with pytest.raises(ValueError, match=r"decode_loop steps must be a positive integer, got 0"):
        loop(params, cache, x[:, :1], positions[:, :1], 0)
    with pytest.raises(ValueError, match=r"one token per sequence: x \(B, 1, ...\) and positions \(B, 1\), got x "
                                         r"\(2, 2, 16\) and positions \(2, 2\)"):
        loop(params, cache, x[:, :2], positions[:, :2], 3)
    bad = fa.decode_loop(layer, lambda out: (out[..., :3], out), donate=False)
    with pytest.raises(ValueError, match=r"next_input must return the next input of x's shape and dtype \(2, 1, 16\) "
                                         r"float32, got \(2, 1, 3\) float32"):
        bad(params, cache, x[:, :1], positions[:, :1], 3)
    with pytest.raises(TypeError, match="decode_loop takes a Linen or NNX module, got function"):
        fa.decode_loop(lambda x: x, _feedback)

    # run-time checks: the first failed step named after the run; its output is NaN
    cache = layer.init_cache(2, 6)
    _, cache = fa.decode_step(layer)(params, cache, x[:, :4], positions[:, :4])
    with pytest.raises(ValueError, match=r"KV cache overflow: 6 cached \+ 1 new tokens > max_len=6;.*step 2 of the "
                                         r"decoding loop"):
        loop(params, cache, x[:, 4:5], positions[:, 4:5], 4)          # steps 0 and 1 fill slots 5 and 6


def test_decode_calls_refuse_what_they_cannot_take():
    """No cache, positions that are not integers, traced arguments (a call inside jax.jit):
    each a TypeError naming the function; a NumPy ``steps`` compiles once with the int."""
    config, layer, params, x, positions = _setup({})
    step = fa.decode_step(layer, donate=False)
    loop = fa.decode_loop(layer, _feedback, donate=False)
    cache = layer.init_cache(2, 12)
    x, positions = x[:, :1], positions[:, :1]  # one token per sequence, sliced outside the traced functions
    for who, call in (("decode_step", lambda c, x, p: step(params, c, x, p)),
                      ("decode_loop", lambda c, x, p: loop(params, c, x, p, 2))):
        with pytest.raises(TypeError, match=rf"{who} needs the cache to write into, got cache=None: .*init_cache"):
            call(None, x, positions)
        with pytest.raises(TypeError, match=rf"{who} positions must be integers, got bool of shape \(2, 1\)"):
            call(cache, x, positions > 0)
        with pytest.raises(TypeError, match=rf"{who} positions must be integers, got float32"):
            call(cache, x, positions.astype(jnp.float32))
        with pytest.raises(TypeError, match=rf"{who} was called with traced x \(inside jax.jit.*call the layer itself"):
            jax.jit(lambda x: call(cache, x, positions))(x)
        with pytest.raises(TypeError, match=rf"{who} was called with traced positions, cache \(inside"):
            jax.jit(lambda c, p: call(c, x, p))(cache, positions)
    first, _ = loop(params, cache, x, positions, 3)
    again, _ = loop(params, cache, x, positions, np.int64(3))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert loop.jitted._cache_size() == 1


def test_deferred_checks_are_one_packed_output():
    """A program's deferred checks leave it as one int32 vector (a step returns out, the cache's
    leaves and that vector); the message of the first failed check gets its values back exactly,
    whatever their dtype and shape, and values known at trace time as given."""
    from flax_attn import _checks

    config, layer, params, x, positions = _setup({})
    step = fa.decode_step(layer)
    answer = step.jitted(params, layer.init_cache(2, 6), x[:, :2], positions[:, :2], None)
    (out, cache), checks = answer
    assert len(jax.tree.leaves(answer)) == 1 + len(jax.tree.leaves(cache)) + 1
    assert checks.dtype == jnp.int32 and checks.ndim == 1

    values = {"b": jnp.array([True, False]), "i8": jnp.array([-7, 100], jnp.int8), "u32": jnp.uint32(4_000_000_000),
              "f": jnp.float32(-0.125), "bf": jnp.array([[1.5, -3.0]], jnp.bfloat16), "i": jnp.arange(6).reshape(2, 3)}

    def program(flag, values):
        with _checks.deferred_checks() as deferred:
            _checks.runtime_check(flag > 0, "first: {n}", n=flag)
            _checks.runtime_check(flag > 1, "second: {b} {i8} {u32} {f} {bf} {i} {static}", static=7, **values)
        return deferred.outputs()

    packed = jax.jit(program)(jnp.int32(2), values)
    _checks.raise_failed(packed)  # both held
    with pytest.raises(ValueError, match=r"^second: \[True, False\] \[-7, 100\] 4000000000 -0.125 \[\[1.5, -3.0\]\] "
                                         r"\[\[0, 1, 2\], \[3, 4, 5\]\] 7 after$"):
        _checks.raise_failed(jax.jit(program)(jnp.int32(1), values), " after")
    with pytest.raises(ValueError, match=r"^first: 0$"):
        _checks.raise_failed(jax.jit(program)(jnp.int32(0), values))


def test_cache_dtype_follows_the_layer_and_a_mismatch_is_an_error():
    for dtype in (jnp.float64, jnp.bfloat16, jnp.float32):
        layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N), param_dtype=dtype)
        assert layer.init_cache(1, 4).key.dtype == dtype
        assert fa.nnx.Attention(layer.config, param_dtype=dtype, rngs=nnx.Rngs(0)).init_cache(1, 4).value.dtype == dtype
    assert fa.AttentionConfig(d_model=D, num_heads=N).init_cache(1, 4).key.dtype == jnp.float32
    # float64 layer, float32 cache: an error naming both dtypes, never a silent rounding
    config, layer, params, x, positions = _setup(dtype=jnp.float64)
    with pytest.raises(TypeError, match="KV cache dtype float32 does not match the keys' dtype float64"):
        layer.apply(params, x[:, :2], positions[:, :2], cache=config.init_cache(2, 8))
    # bfloat16 layer with the default cache of its dtype: decodes like its full pass (bf16 rounding)
    config, layer, params, x, positions = _setup(dtype=jnp.bfloat16, T=6)
    full = layer.apply(params, x, positions).astype(np.float32)
    cache, pieces = layer.init_cache(2, 8), []
    for lo, hi in [(0, 3), (3, 4), (4, 5), (5, 6)]:
        out, cache = layer.apply(params, x[:, lo:hi], positions[:, lo:hi], cache=cache)
        pieces.append(out)
    assert cache.key.dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(jnp.concatenate(pieces, 1).astype(np.float32) - full)) / jnp.max(jnp.abs(full)))
    assert err <= 2 * 2.0 ** -8, f"bfloat16 decode vs full pass: {err:.2e}"


def test_padding_never_reaches_the_cache():
    # Left padding with NaN embeddings: the padded slots hold zeros and the real tokens decode
    # as if alone (the padded keys are blocked, and 0 * NaN cannot leak).
    config, layer, params, x, _ = _setup({"num_kv_heads": 2})
    segments = jnp.array([[0] * 10, [-1, -1, -1] + [0] * 7])
    positions = jnp.array([list(range(10)), [0, 0, 0] + list(range(7))])
    x = x.at[1, :3].set(jnp.nan)
    cache = layer.init_cache(2, 10, layout="BKSH")
    out, cache = layer.apply(params, x[:, :5], positions[:, :5], segments[:, :5], cache=cache)
    pieces = [out]
    for t in range(5, 10):
        out, cache = layer.apply(params, x[:, t:t + 1], positions[:, t:t + 1], cache=cache)  # no segment ids
        pieces.append(out)
    assert np.isfinite(np.asarray(cache.key)).all() and np.isfinite(np.asarray(cache.value)).all()
    np.testing.assert_array_equal(cache.keys()[1, :3], 0.0)
    alone = layer.apply(params, x[1:, 3:], positions[1:, 3:])
    assert_close(jnp.concatenate(pieces, 1)[1, 3:], alone[0], np.float32, "left-padded row")


def test_steps_keep_to_their_segment():
    # A row holding two packed sequences (segments 0 then 1): steps of segment 1 do not see
    # segment 0, exactly as the full pass with segment ids.
    config, layer, params, x, _ = _setup({"num_kv_heads": 2})
    segments = jnp.array([[0] * 4 + [1] * 6, [0] * 10])
    positions = jnp.broadcast_to(jnp.arange(10), (2, 10))  # a linear cache's positions only go forward
    full = layer.apply(params, x, positions, segments)
    cache = layer.init_cache(2, 10)
    out, cache = layer.apply(params, x[:, :6], positions[:, :6], segments[:, :6], cache=cache)
    pieces = [out]
    for t in range(6, 10):
        out, cache = layer.apply(params, x[:, t:t + 1], positions[:, t:t + 1], segments[:, t:t + 1], cache=cache)
        pieces.append(out)
    assert_close(jnp.concatenate(pieces, 1), full, np.float32, "packed decode vs full pass")


def test_benchmark_rows_and_report(monkeypatch):
    # benchmarks/decode.py at the smallest cell it runs: the contenders agree before timing
    from benchmarks import decode as bench  # the repository root is on sys.path (conftest.py)

    # each timed step is cold: read an eviction buffer of twice the last-level cache first. No
    # time is judged here, so a 1 MiB cache (as in test_benchmarks.py's test of the cold timing):
    # the same reads of a 2 MiB buffer instead of 600 MiB (a 300 MiB L3) 25 times a cell
    monkeypatch.setattr(bench.cpu, "last_level_cache_bytes", lambda: 1 << 20)
    rows = bench.cell(batch=1, prefix=64, repeats=1)
    assert {"flax_attn BKSH", "flax_attn BSKH", "flax_attn blocks", "torch eager"} <= {r["contender"] for r in rows}
    assert min(r["ratio_vs_torch"] for r in rows if r["contender"].startswith("torch")) == 1.0
    floor = 4 * 768 * 768 * 4 + 2 * 64 * 768 * 4  # the weights and the 64 cached keys and values, float32
    assert all(r["ms_per_step"] > 0 and floor < r["floor_bytes_per_step"] < floor + 2 * 16 * 768 * 4 for r in rows)
    # 64 + 2 x (1 + 2) rounds x 4 steps + 2 = 90 slots, rounded up to one block of 128
    assert "| 1 | 64 | 128 | 12 | 1 | torch eager |" in bench.report(rows)
    # a cache of 2048 slots holding about 64 tokens: the layer's step visits key blocks (4 of 512:
    # the automatic choice), and agrees with PyTorch before anything is timed
    sparse = bench.cell(batch=1, prefix=64, repeats=1, capacity=2048)
    assert {r["capacity"] for r in sparse} == {2048} and "| 1 | 64 | 2048 | 12 | 1 | flax_attn BKSH |" in bench.report(sparse)
    # grouped-query attention, 12 query heads over 2 key/value heads: the floor counts the
    # smaller key/value projections and cache
    grouped = bench.cell(batch=1, prefix=64, repeats=1, kv_heads=2)
    floor = (2 * 768 * 768 + 2 * 768 * 128) * 4 + 2 * 64 * 128 * 4
    assert all(floor < r["floor_bytes_per_step"] < floor + 2 * 16 * 128 * 4 for r in grouped)
    assert "| 1 | 64 | 128 | 2 | 1 | flax_attn BKSH |" in bench.report(grouped)
    # chunks of 8 tokens a step, causal among themselves, against PyTorch's explicit mask: the
    # floor is per step (the weights and the cache read once for the chunk), a token's share of it
    chunks = bench.cell(batch=1, prefix=64, repeats=1, capacity=1024, tokens=8)
    assert {r["tokens"] for r in chunks} == {8} and "| 1 | 64 | 1024 | 12 | 8 | flax_attn BKSH |" in bench.report(chunks)
    floor = 4 * 768 * 768 * 4 + 2 * (64 + 8) * 768 * 4
    assert all(floor <= r["floor_bytes_per_step"] < floor + 2 * 16 * 8 * 768 * 4 for r in chunks)
    assert all(r["ms_per_token"] * 8 == pytest.approx(r["ms_per_step"]) for r in chunks)


def test_loop_benchmark_rows():
    # benchmarks/decode.py's runs of steps at their smallest: the three contenders agree on the
    # last step before anything is timed (the check raises otherwise)
    from benchmarks import decode as bench

    rows = bench.loop(batch=1, prefix=16, tokens=3, repeats=1)
    assert [r["contender"] for r in rows] == ["torch eager", "flax_attn decode_step", "flax_attn decode_loop"]
    assert rows[0]["ratio_vs_torch"] == 1.0 and all(r["ms_per_token"] > 0 and r["tokens"] == 3 for r in rows)


def test_mla_benchmark_rows_and_report(monkeypatch):
    # benchmarks/decode_mla.py at tiny shapes: the absorbed layer and the PyTorch eager twin agree
    # on the first step (the cell raises otherwise), in a right-sized cache and in one of 2,048
    # slots holding 64 tokens (the key-blocks path itself: layers/test_mla.py)
    from benchmarks import decode_mla as bench

    monkeypatch.setattr(bench.cpu, "last_level_cache_bytes", lambda: 1 << 20)  # cold steps, small reads (above)
    for capacity in (0, 2048):
        rows = bench.cell(batch=2, prefix=64, repeats=1, capacity=capacity, shapes=bench.SMOKE_SHAPES)
        assert {"flax_attn absorbed", "torch eager"} <= {r["contender"] for r in rows}
        assert min(r["ratio_vs_torch"] for r in rows if r["contender"].startswith("torch")) == 1.0
        weights = 64 * 4 * 12 + 64 * 20 + 16 * 4 * 16 + 4 * 8 * 64  # q_proj, kv_a, kv_b, o_proj
        fill = 64 + 1 + 2 * 4 // 2
        assert all(r["floor_bytes_per_step"] == 4 * (weights + 2 * fill * 20) for r in rows)
        slots = 2048 if capacity else 90
        assert f"| 2 | 64 | {slots} | 1 | 1 | flax_attn absorbed |" in bench.report(rows, bench.TITLE)


def test_cpu_compiler_options_follow_the_cpu(monkeypatch):
    from flax_attn.core import tuning

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(tuning, "has_avx512", lambda: False)
    assert tuning.cpu_compiler_options() == ({"xla_cpu_experimental_ynn_fusion_type": ""}
                                                if tuning._ynnpack_off_accepted() else {})
    monkeypatch.setattr(tuning, "_ynnpack_off_accepted", lambda: False)  # a jaxlib without the option
    assert tuning.cpu_compiler_options() == {}
    monkeypatch.setattr(tuning, "_ynnpack_off_accepted", lambda: True)
    assert tuning.cpu_compiler_options() == tuning.YNNPACK_OFF
    monkeypatch.setattr(tuning, "has_avx512", lambda: True)
    assert tuning.cpu_compiler_options() == {}
    monkeypatch.setattr(tuning, "has_avx512", lambda: False)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert tuning.cpu_compiler_options() == {}


def test_decode_step_declares_its_compile_options_while_tracing():
    """Forms that depend on the compile options (tuning.ynnpack_fusions_off, read by the key
    blocks) see the step's own options while it is traced, and nothing outside it."""
    import flax.linen as nn

    from flax_attn.core import tuning

    if not tuning._ynnpack_off_accepted():
        pytest.skip("this jaxlib has no YNNPACK fusion option")
    seen = []

    class Probe(nn.Module):
        @nn.compact
        def __call__(self, x, positions, cache=None):
            seen.append(tuning.ynnpack_fusions_off())
            return x, cache

    x, positions = jnp.ones((1, 1, 4)), jnp.zeros((1, 1), jnp.int32)
    for options, declared in (({}, False), (tuning.YNNPACK_OFF, True)):
        step = fa.decode_step(Probe(), compiler_options=options)
        out, _ = step({}, jnp.zeros(2), x, positions)
        assert seen[-1] is declared, options
        np.testing.assert_array_equal(out, x)
    assert not tuning.ynnpack_fusions_off()


def test_decode_step_compiler_options():
    """A step compiled without YNNPACK's fusions decodes as one with XLA's defaults and as the
    full pass; the options reach the compiled program."""
    from flax_attn.core import tuning

    if not tuning._ynnpack_off_accepted():
        pytest.skip("this jaxlib has no YNNPACK fusion option")
    config, layer, params, x, positions = _setup({"num_kv_heads": 2}, T=8)
    full = layer.apply(params, x, positions)
    outs, texts = {}, {}
    for name, options in (("default", {}), ("off", tuning.YNNPACK_OFF)):
        step = fa.decode_step(layer, compiler_options=options)
        cache = layer.init_cache(2, 12)
        out, cache = step(params, cache, x[:, :5], positions[:, :5])
        pieces = [out]
        texts[name] = step.jitted.lower(params, cache, x[:, 5:6], positions[:, 5:6], None).compile().as_text()
        for t in range(5, 8):
            out, cache = step(params, cache, x[:, t:t + 1], positions[:, t:t + 1])
            pieces.append(out)
        outs[name] = jnp.concatenate(pieces, axis=1)
        assert_close(outs[name], full, np.float32, f"decode_step ({name} options) vs full pass")
    # XLA's default fuses the step's matmuls with YNNPACK (if a jaxlib stops doing so, the option
    # has nothing left to turn off: see tuning.cpu_compiler_options)
    assert "__ynn_fusion" in texts["default"]
    assert "__ynn_fusion" not in texts["off"]
    with pytest.raises(TypeError, match="decode_step compiler_options must be a dict or None, got list"):
        fa.decode_step(layer, compiler_options=[])
