"""The chapter's first section, attention without trainable weights, in both packages.

Goldens are the chapter's printed numbers; "Hello shiny sun" is derived here by hand with
Python's math module. Parity: outputs and input gradients, float64 and float32.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn.textbook.basics as fb
import torch_ref.basics as tb
from conftest import CHAPTER_INPUTS, DTYPES, assert_printed, run_function_parity

PRINTED_SCORES_2 = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
PRINTED_SUM_WEIGHTS_2 = [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]
PRINTED_SOFTMAX_2 = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
PRINTED_Z2 = [0.4419, 0.6515, 0.5683]
PRINTED_SCORES = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
    [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
    [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
    [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450],
]
PRINTED_WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
PRINTED_CONTEXTS = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]


@pytest.fixture(params=["flax_attn", "torch_ref"])
def pkg(request):
    """Run the same golden test against both packages, each in its own array type."""
    if request.param == "flax_attn":
        return fb, (lambda a: jnp.asarray(a, jnp.float32)), np.asarray
    return tb, torch.tensor, (lambda t: t.detach().numpy())


def test_scores_for_one_query_loop_and_matrix(pkg):
    lib, arr, back = pkg
    inputs = arr(CHAPTER_INPUTS)
    query = inputs[1]
    assert_printed(back(lib.attention_scores_loop(query, inputs)), PRINTED_SCORES_2, "loop")
    assert_printed(back(lib.attention_scores(query, inputs)), PRINTED_SCORES_2, "matrix")
    # The chapter's element-by-element dot product of x1 and the query: 0.9544.
    assert_printed(sum(back(inputs[0])[i] * back(query)[i] for i in range(3)), 0.9544)


def test_normalisations_for_one_query(pkg):
    lib, arr, back = pkg
    scores = lib.attention_scores(arr(CHAPTER_INPUTS)[1], arr(CHAPTER_INPUTS))
    by_sum = back(lib.normalize_by_sum(scores))
    assert_printed(by_sum, PRINTED_SUM_WEIGHTS_2, "sum")
    assert abs(by_sum.sum() - 1) < 1e-6
    assert_printed(back(lib.softmax_naive(scores)), PRINTED_SOFTMAX_2, "naive softmax")
    assert_printed(back(lib.softmax(scores)), PRINTED_SOFTMAX_2, "softmax")


def test_context_vector_for_one_query(pkg):
    lib, arr, back = pkg
    inputs = arr(CHAPTER_INPUTS)
    weights = lib.softmax(lib.attention_scores(inputs[1], inputs))
    assert_printed(back(lib.context_vectors_loop(weights, inputs)), PRINTED_Z2, "loop")
    assert_printed(back(lib.context_vectors(weights, inputs)), PRINTED_Z2, "matrix")


def test_all_queries(pkg):
    lib, arr, back = pkg
    inputs = arr(CHAPTER_INPUTS)
    assert_printed(back(lib.attention_scores_loop(inputs, inputs)), PRINTED_SCORES, "scores loop")
    assert_printed(back(lib.attention_scores(inputs, inputs)), PRINTED_SCORES, "scores matrix")
    contexts, weights = lib.self_attention_without_weights(inputs)
    assert_printed(back(weights), PRINTED_WEIGHTS, "weights")
    np.testing.assert_allclose(back(weights).sum(-1), np.ones(6), atol=1e-6)
    assert_printed(back(contexts), PRINTED_CONTEXTS, "contexts")
    assert_printed(back(lib.context_vectors_loop(weights, inputs)), PRINTED_CONTEXTS, "contexts loop")


@pytest.mark.parametrize("dtype, big", [(np.float32, 89.0), (np.float64, 710.0)])
def test_naive_softmax_overflows_where_stable_one_does_not(dtype, big):
    # exp(89) > float32 max (3.4e38) and exp(710) > float64 max (1.8e308): the largest entry
    # becomes inf / inf = NaN and the others x / inf = 0, so the result is no distribution.
    scores = np.array([big, big - 1.0, big - 3.0], dtype)
    expected = np.exp([0.0, -1.0, -3.0]) / np.exp([0.0, -1.0, -3.0]).sum()
    with np.errstate(over="ignore", invalid="ignore"):
        for lib, arr in ((fb, jnp.asarray), (tb, torch.from_numpy)):
            naive = np.asarray(lib.softmax_naive(arr(scores)))
            stable = np.asarray(lib.softmax(arr(scores)))
            assert np.isnan(naive[0]) and (naive[1:] == 0).all(), f"{lib.__name__}: no overflow: {naive}"
            np.testing.assert_allclose(stable, expected, rtol=1e-6)
    # Well below the threshold the naive form is fine. (Just below it, at 87 in float32, XLA
    # already returns zeros: it divides by multiplying with 1/sum, a subnormal flushed to 0.)
    small = scores - 10.0
    np.testing.assert_allclose(np.asarray(fb.softmax_naive(jnp.asarray(small))), expected, rtol=1e-5)


def test_hello_shiny_sun():
    hello, shiny, sun = [0.34, 0.22, 0.54], [0.53, 0.34, 0.98], [0.29, 0.54, 0.93]
    tokens = [hello, shiny, sun]
    # By hand: scores are dot products with "shiny", weights their softmax.
    scores = [sum(a * b for a, b in zip(t, shiny)) for t in tokens]
    exps = [math.exp(s) for s in scores]
    weights = [e / sum(exps) for e in exps]
    by_hand = [sum(w * t[i] for w, t in zip(weights, tokens)) for i in range(3)]
    assert_printed(by_hand, [0.3990, 0.3854, 0.8610], "by hand")
    inputs = np.array(tokens, np.float32)
    for lib, arr in ((fb, jnp.asarray), (tb, torch.from_numpy)):
        x = arr(inputs)
        z = np.asarray(lib.context_vectors(lib.softmax(lib.attention_scores(x[1], x)), x))
        np.testing.assert_allclose(z, by_hand, rtol=1e-6)
        assert_printed(z, [0.3990, 0.3854, 0.8610], lib.__name__)
    # The page rounds each term by hand and prints [0.3992, 0.3858, 0.8610]: off by < 5e-4.
    assert np.abs(np.array(by_hand) - [0.3992, 0.3858, 0.8610]).max() < 5e-4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["attention_scores", "attention_scores_loop", "context_vectors",
                                  "context_vectors_loop", "self_attention_without_weights",
                                  "causal_weights_by_renormalizing", "normalize_by_sum", "softmax"])
def test_parity(name, dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4))
    w = rng.random((5, 5)) + 0.1
    args = {
        "attention_scores": (x[2], x),
        "attention_scores_loop": (x, x),
        "context_vectors": (w, x),
        "context_vectors_loop": (w[1], x),
        "self_attention_without_weights": (x,),
        "causal_weights_by_renormalizing": (w,),
        "normalize_by_sum": (w,),
        "softmax": (x,),
    }[name]
    run_function_parity(getattr(tb, name), getattr(fb, name), args, dtype,
                        eager=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parity_causal_weights_by_masking(dtype):
    scores = np.random.default_rng(4).standard_normal((6, 6))
    run_function_parity(lambda s: tb.causal_weights_by_masking(s, scale=0.5 ** 0.5),
                        lambda s: fb.causal_weights_by_masking(s, scale=0.5 ** 0.5), (scores,), dtype)


def test_loop_and_matrix_forms_agree_under_jit():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 3)))
    np.testing.assert_allclose(jax.jit(fb.attention_scores_loop)(x, x), fb.attention_scores(x, x), rtol=1e-12)
