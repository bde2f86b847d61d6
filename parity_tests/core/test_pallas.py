"""JAX's Pallas kernels as implementations: the translations of the mask description into each
kernel's terms, checked against the description's own dense mask without running a kernel
(cheap), and the run-time check of the Triton kernel's shared segment ids. The kernels
themselves are held to the float64 reference by ``core/test_conformance.py`` (section 7,
interpret mode)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from flax_attn.core import PallasDecode, PallasTriton, Splash
from flax_attn.core.call import describe
from flax_attn.core.pallas import splash as splash_lib


def _call(B=2, T=20, S=37, N=2, K=2, H=8, dtype=jnp.float32, **kw):
    q = jax.ShapeDtypeStruct((B, T, N, H), dtype)
    k = jax.ShapeDtypeStruct((B, S, K, H), dtype)
    return describe(q, k, k, platform="cpu", **kw)


def _splash_allowed(call, Tp, Sp):
    """What splash would let attend, ``(B, N, T, S)``: its static pattern and its segment ids."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    B, N, T, S = call.B, call.N, call.T, call.S
    pattern = splash_lib._pattern(sa, call.mask, N, T, S, Tp, Sp)
    static = np.stack([pattern[h, :, :] for h in range(N)])                       # (N, Tp, Sp)
    q_ids, k_ids = jax.jit(lambda m: splash_lib._segment_ids(m, B, T, S, Tp, Sp))(call.mask)  # one compile
    same = (np.ones((B, Tp, Sp), bool) if q_ids is None
            else np.asarray(q_ids)[:, :, None] == np.asarray(k_ids)[:, None, :])
    return (static[None] & same[:, None])[:, :, :T, :S]


def _expected(call):
    dense = jax.jit(lambda m: m.dense_mask())(call.mask)  # one compile, not one per operation
    return np.broadcast_to(np.ones((1, 1, call.T, call.S), bool) if dense is None else np.asarray(dense),
                           (call.B, call.N, call.T, call.S))


SPLASH_RULES = {
    "none": {},
    "causal T<S": dict(is_causal=True),
    "causal T>S": dict(is_causal=True, T=37, S=20),
    "window (3, 2) T>S": dict(local_window_size=(3, 2), T=37, S=20),
    "causal window (5, 0)": dict(is_causal=True, local_window_size=(5, 0)),
    "window (0, 0)": dict(local_window_size=(0, 0)),
    "left window only": dict(local_window_size=(4, 100)),
}


@pytest.mark.parametrize("rules", list(SPLASH_RULES))
def test_splash_pattern_equals_the_mask_rules(rules):
    """Splash's causal/local mask objects (offset S - T) on padded grids allow exactly what the
    mask description allows, including rows that may attend to nothing."""
    kw = dict(SPLASH_RULES[rules])
    call = _call(**kw)
    for Tp, Sp in ((128, 128), (256, 128)):
        np.testing.assert_array_equal(_splash_allowed(call, Tp, Sp), _expected(call), err_msg=f"{rules} {Tp}x{Sp}")


def test_splash_segment_ids_carry_segments_and_lengths():
    """Segment ids (negative = padding), query and key lengths (one of them 0) and the padding
    of S become ids that meet exactly where the description allows; padding ids never meet."""
    rng = np.random.default_rng(0)
    q_seg = rng.integers(-1, 3, (2, 20)).astype(np.int32)
    k_seg = rng.integers(-1, 3, (2, 37)).astype(np.int32)
    call = _call(query_segment_ids=q_seg, key_segment_ids=k_seg, is_causal=True,
                 query_seq_lengths=np.array([20, 11], np.int32), key_value_seq_lengths=np.array([0, 30], np.int32))
    np.testing.assert_array_equal(_splash_allowed(call, 128, 128), _expected(call))
    q_ids, k_ids = splash_lib._segment_ids(call.mask, 2, 20, 37, 128, 128)
    assert (np.asarray(q_ids)[:, 20:] == -2).all() and (np.asarray(k_ids)[:, 37:] == -1).all()
    # nothing to translate: no ids at all
    assert splash_lib._segment_ids(_call(is_causal=True, S=128).mask, 2, 20, 128, 128, 128) == (None, None)


def test_triton_needs_equal_query_and_key_segment_ids():
    """The Triton kernel reads one id array: differing query and key ids raise (here eagerly;
    under jit when the program runs), naming the count of differences."""
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 2, 8)), jnp.float32) for _ in range(3))
    ids = np.zeros((1, 16), np.int32)
    other = ids.copy()
    other[0, 3:5] = 1
    impl = PallasTriton(interpret=True, block_q=16, block_k=16, block_bwd=16)
    with pytest.raises(ValueError, match="needs query_segment_ids equal to key_segment_ids .* differ in 2 places"):
        fa.dot_product_attention(q, k, v, query_segment_ids=ids, key_segment_ids=other, implementation=impl)


def test_interpret_mode_is_what_runs_on_cpu():
    """Without interpret mode a kernel refuses the CPU, naming the way to run it there."""
    call = _call()
    for impl in (Splash(), PallasTriton(), PallasDecode()):
        assert not impl.runs_on("cpu")
        assert f"{type(impl).__name__}(interpret=True)" in impl.supports(call)
        interpreted = dataclasses.replace(impl, interpret=True)
        assert interpreted.runs_on("cpu")
        assert "backend" not in (interpreted.supports(call) or "")
    assert "dtype float64" in Splash(interpret=True).supports(_call(dtype=jnp.float64))


def _newer_rules():
    """Calls using parts of the description that no kernel here translates (those this
    version of flax_attn has): chunks, user mask and score functions, sinks."""
    from flax_attn.core import mask as M

    q1 = jax.ShapeDtypeStruct((2, 1, 4, 8), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.bfloat16)
    calls = {}
    for name, kw in (("chunked", lambda: dict(mask=M.causal() & M.chunked(4))),
                     ("mask_mod", lambda: dict(mask=M.mask_mod(lambda b, h, t, s: s <= t))),
                     ("score_mod", lambda: dict(score_mod=lambda x, b, h, t, s: x)),
                     ("sinks", lambda: dict(sinks=jnp.zeros(4)))):
        try:
            calls[name] = [describe(x, x, x, platform="cpu", **kw()) for x in (q, q1)]
        except (AttributeError, TypeError):  # this version has no such argument
            continue
    return calls


def test_kernels_refuse_rules_they_do_not_translate():
    """Chunked attention, mask_mod/score_mod functions and sinks are refused by every kernel
    (by name), never ignored; so is any mask rule the kernels do not know."""
    calls = _newer_rules()
    for name, pair in calls.items():
        for impl in (Splash(interpret=True), PallasTriton(interpret=True), PallasDecode(interpret=True)):
            call = pair[1] if isinstance(impl, PallasDecode) else pair[0]
            reason = impl.supports(call)
            assert reason and (name.split("_")[0] in reason or "chunk" in reason), (name, impl.name, reason)


def test_kernel_fields_are_checked_when_built():
    """Block sizes the kernels cannot take are refused by name when the object is built, not as
    a ZeroDivisionError (or a silent change) inside the call."""
    for field in ("block_q", "block_k", "block_bwd"):
        for value, what in ((0, "a positive integer"), (24, "a power of two"), (True, "a positive integer")):
            with pytest.raises(ValueError, match=f"PallasTriton {field} must be {what}"):
                PallasTriton(interpret=True, **{field: value})
    with pytest.raises(ValueError, match="PallasDecode k_splits must be a positive integer, got 0"):
        PallasDecode(k_splits=0)
    with pytest.raises(ValueError, match="PallasDecode block_h must be a positive integer, got 0"):
        PallasDecode(block_h=0)
    with pytest.raises(ValueError, match="PallasDecode block_k must be at least 16 .*got 8"):
        PallasDecode(block_k=8)
    with pytest.raises(ValueError, match="PallasDecode block_k must be a power of two, got 48"):
        PallasDecode(block_k=48)
    assert PallasDecode(block_k=16, k_splits=1, block_h=1).block_k == 16

