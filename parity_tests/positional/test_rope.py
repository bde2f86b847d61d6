"""RoPE (flax_attn.positional.rope): both layouts, partial rotary, frequency scalings. Literal
values derived by hand, then parity with torch_ref.modern and properties."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
import torch_ref as tr
from conftest import DTYPES, assert_close, run_function_parity

tm = tr.modern

SCALINGS = {
    "none": None,
    "linear": {"kind": "linear", "factor": 4.0},
    "ntk": {"kind": "ntk", "factor": 4.0},
    "llama3": {"kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 64,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "yarn": {"kind": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-deepseek": {"kind": "yarn", "factor": 40.0, "original_max_position_embeddings": 64, "mscale": 1.0,
                      "mscale_all_dim": 0.5, "beta_fast": 32.0, "beta_slow": 1.0},
    "yarn-untruncated": {"kind": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False},
}

# Scalings whose frequencies depend on the sequence length (max position + 1): original context 64.
LONGROPE_SHORT = (1.0, 1.25, 2.0, 3.5)
LONGROPE_LONG = (1.5, 3.0, 7.0, 16.0)
LENGTH_SCALINGS = {
    "dynamic": {"kind": "dynamic", "factor": 4.0, "original_max_position_embeddings": 64},
    "longrope": {"kind": "longrope", "factor": 8.0, "original_max_position_embeddings": 64,
                 "short_factor": LONGROPE_SHORT, "long_factor": LONGROPE_LONG},
}


# ----------------------------------------------------------------------------- RoPE literals

def test_rope_rotates_a_pair_by_position_times_frequency():
    # H = 2: one pair, frequency 1. Position p turns (1, 0) into (cos p, sin p).
    x = jnp.array([[[1.0, 0.0]], [[1.0, 0.0]], [[0.0, 2.0]]])  # (T=3, N=1, H=2)
    out = fa.apply_rope(x, jnp.array([0, 1, 3]))
    np.testing.assert_allclose(out[:, 0], [[1, 0], [math.cos(1), math.sin(1)], [-2 * math.sin(3), 2 * math.cos(3)]],
                               rtol=1e-6, atol=1e-7)


def test_rope_layouts_pair_different_dimensions():
    # H = 4, theta = 100: frequencies 1 and 100^(-1/2) = 0.1. Position 1.
    c1, s1, c2, s2 = math.cos(1), math.sin(1), math.cos(0.1), math.sin(0.1)
    x = jnp.array([[[1.0, 2.0, 3.0, 4.0]]])
    half = fa.apply_rope(x, jnp.array([1]), theta=100.0, layout="rotate_half")[0, 0]
    # rotate_half pairs (0, 2) at frequency 1 and (1, 3) at frequency 0.1.
    np.testing.assert_allclose(half, [1 * c1 - 3 * s1, 2 * c2 - 4 * s2, 3 * c1 + 1 * s1, 4 * c2 + 2 * s2], rtol=1e-6)
    inter = fa.apply_rope(x, jnp.array([1]), theta=100.0, layout="interleaved")[0, 0]
    # interleaved pairs (0, 1) at frequency 1 and (2, 3) at frequency 0.1.
    np.testing.assert_allclose(inter, [1 * c1 - 2 * s1, 2 * c1 + 1 * s1, 3 * c2 - 4 * s2, 4 * c2 + 3 * s2], rtol=1e-6)


def test_rope_layouts_are_a_permutation_of_each_other():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 3, 8)))
    pos = jnp.arange(5)[None].repeat(2, 0) * 3
    perm = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # interleaved index i holds rotate_half index perm[i]
    inter = fa.apply_rope(x[..., perm], pos, layout="interleaved")
    half = fa.apply_rope(x, pos, layout="rotate_half")
    np.testing.assert_allclose(inter, half[..., perm], rtol=1e-12)


def test_partial_rotary_passes_the_rest_through():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 2, 8)))
    out = fa.apply_rope(x, jnp.arange(4), rotary_dim=4)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    np.testing.assert_allclose(out[..., :4], fa.apply_rope(x[..., :4], jnp.arange(4)), rtol=1e-12)


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_rope_scores_depend_only_on_the_relative_offset(layout, scaling):
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((1, 1, 1, 16)))
    k = jnp.asarray(rng.standard_normal((1, 1, 1, 16)))
    rot = lambda x, p: fa.apply_rope(x, jnp.array([p]), layout=layout, scaling=SCALINGS[scaling])
    score = lambda m, n: float(jnp.sum(rot(q, m) * rot(k, n)))
    for m, n in [(5, 2), (0, 7), (100, 90)]:
        for shift in (1, 13, 1000):
            assert abs(score(m, n) - score(m + shift, n + shift)) < 1e-9 * max(1, abs(score(m, n)))
    assert abs(score(5, 2) - score(5, 3)) > 1e-6  # but it does depend on the offset


# ----------------------------------------------------------------------------- RoPE scalings

def test_linear_and_ntk_frequencies_by_hand():
    base, _ = fa.rope_frequencies(8, theta=10000.0)
    np.testing.assert_allclose(base, [1.0, 10000 ** -0.25, 10000 ** -0.5, 10000 ** -0.75], rtol=1e-15)
    linear, f = fa.rope_frequencies(8, scaling={"kind": "linear", "factor": 4.0})
    np.testing.assert_allclose(linear, base / 4, rtol=1e-15)
    assert f == 1.0
    ntk, _ = fa.rope_frequencies(8, scaling={"kind": "ntk", "factor": 4.0})
    new_theta = 10000 * 4 ** (8 / 6)
    np.testing.assert_allclose(ntk, [1.0, new_theta ** -0.25, new_theta ** -0.5, new_theta ** -0.75], rtol=1e-14)


def test_llama3_frequencies_by_hand():
    # Llama 3.1: theta 500000, factor 8, low 1, high 4, original context 8192, head dim 128.
    scaling = {"kind": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    base, _ = fa.rope_frequencies(128, theta=500000.0)
    scaled, _ = fa.rope_frequencies(128, theta=500000.0, scaling=scaling)
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4    # wavelength under 2048 tokens: kept
    low = wavelen > 8192 / 1     # over 8192 tokens: divided by 8
    mid = ~high & ~low
    assert high.sum() > 0 and low.sum() > 0 and mid.sum() > 0
    np.testing.assert_array_equal(scaled[high], base[high])
    np.testing.assert_allclose(scaled[low], base[low] / 8, rtol=1e-15)
    smooth = (8192 / wavelen[mid] - 1) / 3
    np.testing.assert_allclose(scaled[mid], (1 - smooth) * base[mid] / 8 + smooth * base[mid], rtol=1e-15)
    assert np.all(np.diff(scaled) < 0)  # still strictly decreasing


def test_yarn_frequencies_and_attention_factor_by_hand():
    d, theta, s, original = 64, 10000.0, 4.0, 2048
    freqs, factor = fa.rope_frequencies(d, theta=theta, scaling={"kind": "yarn", "factor": s,
                                                               "original_max_position_embeddings": original})
    assert abs(factor - (0.1 * math.log(4.0) + 1)) < 1e-15  # 1.1386...
    base, _ = fa.rope_frequencies(d, theta=theta)
    # Dim i completes original * base[i] / (2 pi) rotations over the original context.
    rotations = original * base / (2 * math.pi)
    fast, slow = rotations > 32 * 1.5, rotations < 1 / 1.5  # clear of the ramp's rounded edges
    np.testing.assert_allclose(freqs[fast], base[fast], rtol=1e-15)       # extrapolated: unchanged
    np.testing.assert_allclose(freqs[slow], base[slow] / s, rtol=1e-15)   # interpolated: / s
    between = ~fast & ~slow
    assert np.all((freqs[between] <= base[between]) & (freqs[between] >= base[between] / s))
    _, given = fa.rope_frequencies(d, scaling={"kind": "yarn", "factor": s, "original_max_position_embeddings": original,
                                               "attention_factor": 1.0})
    assert given == 1.0


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
@pytest.mark.parametrize("rotary_dim", [2, 16, 64])
def test_rope_frequencies_parity(scaling, rotary_dim):
    if scaling == "ntk" and rotary_dim == 2:
        with pytest.raises(ValueError, match="NTK-aware scaling needs rotary_dim >= 4"):
            fa.rope_frequencies(rotary_dim, scaling=SCALINGS[scaling])
        return
    ours, f1 = fa.rope_frequencies(rotary_dim, theta=10000.0, scaling=SCALINGS[scaling])
    theirs, f2 = tm.rope_inv_freq(rotary_dim, 10000.0, SCALINGS[scaling])
    assert_close(ours, theirs.numpy(), np.float64, "inverse frequencies")
    assert abs(f1 - f2) < 1e-15


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_apply_rope_parity(scaling, rotary_dim, layout, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 6, 3, 8))
    pos = np.stack([np.arange(6), np.arange(6) + 1000])  # an offset, as when decoding late in a sequence
    kw = dict(layout=layout, rotary_dim=rotary_dim, scaling=SCALINGS[scaling], theta=500.0)
    run_function_parity(lambda a, p: tm.apply_rope(a, p, **kw), lambda a, p: fa.apply_rope(a, p, **kw), (x, pos), dtype,
                        eager=scaling == "none")


# ----------------------------------------------------------------------------- length-dependent scalings

def test_yarn_deepseek_attention_factor_by_hand():
    # DeepSeek-V3: factor 40, mscale 1, mscale_all_dim 1 -> the two temperatures cancel: factor 1.
    base = {"kind": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096}
    _, f = fa.rope_frequencies(64, scaling={**base, "mscale": 1.0, "mscale_all_dim": 1.0})
    assert f == 1.0
    _, f = fa.rope_frequencies(64, scaling={**base, "mscale": 1.0, "mscale_all_dim": 0.5})
    assert abs(f - (1 + 0.1 * math.log(40)) / (1 + 0.05 * math.log(40))) < 1e-15
    _, f = fa.rope_frequencies(64, scaling={**base, "mscale": 1.0})  # one weight alone: the plain temperature
    assert abs(f - (1 + 0.1 * math.log(40))) < 1e-15


def test_yarn_untruncated_ramp_edges_are_fractional():
    # d = 16, theta 10000, original 64: the crossings for 32 and 1 rotations are fractional dims.
    d, L = 16, 64
    crossing = lambda r: d * math.log(L / (r * 2 * math.pi)) / (2 * math.log(10000.0))
    low, high = crossing(32.0), crossing(1.0)
    assert low < 0 < high < d - 1 and high != math.ceil(high)
    freqs, _ = fa.rope_frequencies(d, scaling={"kind": "yarn", "factor": 8.0, "original_max_position_embeddings": L,
                                               "truncate": False})
    base, _ = fa.rope_frequencies(d)
    ramp = np.clip((np.arange(d // 2) - 0.0) / (high - 0.0), 0, 1)  # low clipped to 0
    np.testing.assert_allclose(freqs, base / 8 * ramp + base * (1 - ramp), rtol=1e-14)


def test_dynamic_ntk_frequencies_by_hand():
    # d = 8, factor 2, original 64: unchanged up to 64 positions; at 128, base 10000 * (2*2 - 1)^(8/6).
    scaling = {"kind": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64}
    base, _ = fa.rope_frequencies(8)
    for n in (None, 1, 64):
        same, f = fa.rope_frequencies(8, scaling=scaling, seq_len=n)
        np.testing.assert_array_equal(same, base)
        assert f == 1.0
    grown, _ = fa.rope_frequencies(8, scaling=scaling, seq_len=128)
    theta = 10000 * 3.0 ** (8 / 6)
    np.testing.assert_allclose(grown, [1.0, theta ** -0.25, theta ** -0.5, theta ** -0.75], rtol=1e-14)


def test_longrope_frequencies_by_hand():
    scaling = LENGTH_SCALINGS["longrope"]
    base, _ = fa.rope_frequencies(8)
    short, f = fa.rope_frequencies(8, scaling=scaling, seq_len=64)
    np.testing.assert_allclose(short, base / np.array(LONGROPE_SHORT), rtol=1e-15)
    assert abs(f - math.sqrt(1 + math.log(8) / math.log(64))) < 1e-15  # sqrt(1.5)
    long, f2 = fa.rope_frequencies(8, scaling=scaling, seq_len=65)
    np.testing.assert_allclose(long, base / np.array(LONGROPE_LONG), rtol=1e-15)
    assert f2 == f
    with pytest.raises(ValueError, match="longrope factors have 4 entries; rotary_dim=4 needs 2"):
        fa.rope_frequencies(4, scaling=scaling)
    with pytest.raises(ValueError, match="longrope needs long_factor"):
        fa.RopeScaling(kind="longrope", factor=2.0, original_max_position_embeddings=8, short_factor=(1.0,))


@pytest.mark.parametrize("scaling", sorted(LENGTH_SCALINGS))
@pytest.mark.parametrize("seq_len", [None, 10, 64, 65, 300])
def test_length_dependent_frequencies_parity(scaling, seq_len):
    ours, f1 = fa.rope_frequencies(8, theta=500.0, scaling=LENGTH_SCALINGS[scaling], seq_len=seq_len)
    theirs, f2 = tm.rope_inv_freq(8, 500.0, LENGTH_SCALINGS[scaling], seq_len)
    assert_close(ours, theirs.numpy(), np.float64, "inverse frequencies")
    assert abs(f1 - f2) < 1e-15


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("last", [20, 64, 1000])
@pytest.mark.parametrize("scaling", sorted(LENGTH_SCALINGS))
def test_apply_rope_length_dependent_parity(scaling, last, layout, dtype):
    # The largest position decides: within the original 64 positions (20, 64) or beyond (1000).
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 5, 2, 8))
    pos = np.stack([np.arange(5), np.arange(5) + last - 4])
    kw = dict(layout=layout, scaling=LENGTH_SCALINGS[scaling], theta=500.0)
    run_function_parity(lambda a, p: tm.apply_rope(a, p, **kw), lambda a, p: fa.apply_rope(a, p, **kw), (x, pos), dtype)


@pytest.mark.parametrize("scaling", sorted(LENGTH_SCALINGS))
def test_length_dependent_rope_uses_the_largest_position_under_jit(scaling):
    # One row beyond the original context switches the whole batch, jitted or not.
    import jax
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 3, 1, 8)))
    pos = jnp.array([[0, 1, 2], [200, 201, 202]])
    f = jax.jit(lambda a, p: fa.apply_rope(a, p, scaling=LENGTH_SCALINGS[scaling]))
    together = f(x, pos)[0]
    alone = f(x[:1], pos[:1])[0]
    inv_long, af = fa.rope_frequencies(8, scaling=LENGTH_SCALINGS[scaling], seq_len=203)
    inv_short, _ = fa.rope_frequencies(8, scaling=LENGTH_SCALINGS[scaling])
    expect = lambda inv: np.asarray(x[0, :, 0, :4]) * (np.cos(np.arange(3)[:, None] * inv) * af) - \
        np.asarray(x[0, :, 0, 4:]) * (np.sin(np.arange(3)[:, None] * inv) * af)
    np.testing.assert_allclose(together[:, 0, :4], expect(inv_long), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(alone[:, 0, :4], expect(inv_short), rtol=1e-12, atol=1e-14)
    assert not np.allclose(together, alone)
