"""The chapter's printed numbers, reproduced by torch_ref and by flax_attn through converted weights.

Every expected value below is copied from the chapter's printed output (seeds 000, 002, 004),
never from this code's output.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from conftest import CHAPTER_INPUTS, assert_printed

INPUTS = torch.from_numpy(CHAPTER_INPUTS)
BATCH = torch.stack((INPUTS, INPUTS), dim=0)

PRINTED_V1 = [[0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203],
              [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]]
PRINTED_V2 = [[-0.0739, 0.0713], [-0.0748, 0.0703], [-0.0749, 0.0702],
              [-0.0760, 0.0685], [-0.0763, 0.0679], [-0.0754, 0.0693]]
PRINTED_V2_WEIGHTS = [
    [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
    [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
    [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
    [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
    [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
PRINTED_MASKED_SIMPLE = [
    [0.1921, 0, 0, 0, 0, 0],
    [0.2041, 0.1659, 0, 0, 0, 0],
    [0.2036, 0.1659, 0.1662, 0, 0, 0],
    [0.1869, 0.1667, 0.1668, 0.1571, 0, 0],
    [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
PRINTED_ROW_SUMS = [0.1921, 0.3700, 0.5357, 0.6775, 0.8415, 1.0000]
PRINTED_CAUSAL_WEIGHTS = [
    [1.0000, 0, 0, 0, 0, 0],
    [0.5517, 0.4483, 0, 0, 0, 0],
    [0.3800, 0.3097, 0.3103, 0, 0, 0],
    [0.2758, 0.2460, 0.2462, 0.2319, 0, 0],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
NINF = -np.inf
PRINTED_MASKED_SCORES = [
    [0.2899, NINF, NINF, NINF, NINF, NINF],
    [0.4656, 0.1723, NINF, NINF, NINF, NINF],
    [0.4594, 0.1703, 0.1731, NINF, NINF, NINF],
    [0.2642, 0.1024, 0.1036, 0.0186, NINF, NINF],
    [0.2183, 0.0874, 0.0882, 0.0177, 0.0786, NINF],
    [0.3408, 0.1270, 0.1290, 0.0198, 0.1290, 0.0078],
]
# Softmax over keys (dim=-1): seeds 002 and 004. This is the correct CausalAttention.
PRINTED_CAUSAL = [[-0.4519, 0.2216], [-0.5874, 0.0058], [-0.6300, -0.0632],
                  [-0.5675, -0.0843], [-0.5526, -0.0981], [-0.5299, -0.1081]]
PRINTED_WRAPPER = [
    [-0.4519, 0.2216, 0.4772, 0.1063], [-0.5874, 0.0058, 0.5891, 0.3257],
    [-0.6300, -0.0632, 0.6202, 0.3860], [-0.5675, -0.0843, 0.5478, 0.3589],
    [-0.5526, -0.0981, 0.5321, 0.3428], [-0.5299, -0.1081, 0.5077, 0.3493],
]
# Softmax over queries (dim=1): seed 000's erratum, printed with the same weights.
PRINTED_CAUSAL_ERRATUM = [[-0.0844, 0.0414], [-0.2264, -0.0039], [-0.4163, -0.0564],
                          [-0.5014, -0.1011], [-0.7754, -0.1867], [-1.1632, -0.3303]]
PRINTED_WRAPPER_ERRATUM = [
    [-0.0844, 0.0414, 0.0766, 0.0171], [-0.2264, -0.0039, 0.2143, 0.1185],
    [-0.4163, -0.0564, 0.3878, 0.2453], [-0.5014, -0.1011, 0.4992, 0.3401],
    [-0.7754, -0.1867, 0.7387, 0.4868], [-1.1632, -0.3303, 1.1224, 0.8460],
]
PRINTED_WRAPPER_D1_ERRATUM = [[-9.1476e-02, 3.4164e-02], [-2.6796e-01, -1.3427e-03],
                              [-4.8421e-01, -4.8909e-02], [-6.4808e-01, -1.0625e-01],
                              [-8.8380e-01, -1.7140e-01], [-1.4744e00, -3.4327e-01]]
PRINTED_MHA = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
               [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]


def seeded(seed, cls, *args):
    torch.manual_seed(seed)
    return cls(*args)


def flax_twin(flax_module, torch_module):
    return flax_module, fa.from_torch_state_dict(flax_module, tr.state_dict_to_numpy(torch_module.state_dict()))


def both(torch_module, flax_module, x, **flax_kwargs):
    """Outputs of the torch original and of its flax twin on the same input, as NumPy."""
    with torch.no_grad():
        t = torch_module(x).numpy()
    m, v = flax_twin(flax_module, torch_module)
    return t, np.asarray(m.apply(v, jnp.asarray(x.numpy()), **flax_kwargs))


def test_self_attention_v1_seed_123():
    t, f = both(seeded(123, tr.SelfAttention_v1, 3, 2), fa.SelfAttention_v1(3, 2), INPUTS)
    assert_printed(t, PRINTED_V1, "torch_ref")
    assert_printed(f, PRINTED_V1, "flax_attn")


def test_step_by_step_trainable_weights_seed_123():
    # The chapter draws W_query, W_key, W_value with torch.rand in this order after seed 123,
    # exactly as SelfAttention_v1 does, so its parameters are the step-by-step matrices.
    torch_module = seeded(123, tr.SelfAttention_v1, 3, 2)
    _, variables = flax_twin(fa.SelfAttention_v1(3, 2), torch_module)
    p = {k: np.asarray(v, np.float32) for k, v in variables["params"].items()}
    for W_query, W_key, W_value, x, lib in (
        (torch_module.W_query.detach(), torch_module.W_key.detach(), torch_module.W_value.detach(), INPUTS, tr.basics),
        (jnp.asarray(p["W_query"]), jnp.asarray(p["W_key"]), jnp.asarray(p["W_value"]), jnp.asarray(CHAPTER_INPUTS), fa.basics),
    ):
        query_2 = x[1] @ W_query
        keys, values = x @ W_key, x @ W_value
        assert tuple(keys.shape) == tuple(values.shape) == (6, 2)
        assert_printed(np.asarray(query_2), [0.4306, 1.4551], "query_2")
        assert_printed(np.asarray(query_2 @ keys[1]), 1.8524, "attn_score_22")
        scores_2 = lib.attention_scores(query_2, keys)
        assert_printed(np.asarray(scores_2), [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440], "scores_2")
        weights_2 = lib.softmax(scores_2 / 2 ** 0.5)
        assert_printed(np.asarray(weights_2), [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820], "weights_2")
        assert_printed(np.asarray(weights_2 @ values), [0.3061, 0.8210], "z2")


def test_self_attention_v2_seed_789():
    t, f = both(seeded(789, tr.SelfAttention_v2, 3, 2), fa.SelfAttention_v2(3, 2), INPUTS)
    assert_printed(t, PRINTED_V2, "torch_ref")
    assert_printed(f, PRINTED_V2, "flax_attn")


def test_v2_weights_loaded_into_v1_give_v2_output():
    sa_v2 = seeded(789, tr.SelfAttention_v2, 3, 2)
    sa_v1 = tr.SelfAttention_v1(3, 2)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            setattr(sa_v1, name, torch.nn.Parameter(getattr(sa_v2, name).weight.T))
        np.testing.assert_allclose(sa_v1(INPUTS).numpy(), sa_v2(INPUTS).numpy(), rtol=1e-6)
    m2, v2 = flax_twin(fa.SelfAttention_v2(3, 2), sa_v2)
    v1 = {"params": {name: v2["params"][name]["kernel"] for name in ("W_query", "W_key", "W_value")}}
    x = jnp.asarray(CHAPTER_INPUTS)
    out_v1 = fa.SelfAttention_v1(3, 2).apply(v1, x)
    np.testing.assert_allclose(out_v1, m2.apply(v2, x), rtol=1e-6)
    assert_printed(out_v1, PRINTED_V2, "flax_attn v1 with v2's weights")


def test_causal_masking_both_ways_seed_789():
    sa_v2 = seeded(789, tr.SelfAttention_v2, 3, 2)
    _, v = flax_twin(fa.SelfAttention_v2(3, 2), sa_v2)
    k_q = np.asarray(v["params"]["W_query"]["kernel"])
    k_k = np.asarray(v["params"]["W_key"]["kernel"])
    with torch.no_grad():
        t_scores = sa_v2.W_query(INPUTS) @ sa_v2.W_key(INPUTS).T
    f_scores = jnp.asarray(CHAPTER_INPUTS @ k_q) @ jnp.asarray(CHAPTER_INPUTS @ k_k).T
    scale = 2 ** -0.5
    for lib, scores, back in ((tr.basics, t_scores, lambda a: a.numpy()), (fa.basics, f_scores, np.asarray)):
        weights = lib.softmax(scores * scale)
        assert_printed(back(weights), PRINTED_V2_WEIGHTS, f"{lib.__name__} weights")
        masked_simple = back(weights) * np.tril(np.ones((6, 6)))
        assert_printed(masked_simple, PRINTED_MASKED_SIMPLE, "masked_simple")
        assert_printed(masked_simple.sum(-1), PRINTED_ROW_SUMS, "row sums")
        renormalized = back(lib.causal_weights_by_renormalizing(weights))
        by_masking = back(lib.causal_weights_by_masking(scores, scale=scale))
        assert_printed(renormalized, PRINTED_CAUSAL_WEIGHTS, f"{lib.__name__} renormalised")
        assert_printed(by_masking, PRINTED_CAUSAL_WEIGHTS, f"{lib.__name__} masked before softmax")
        np.testing.assert_allclose(renormalized, by_masking, rtol=1e-6, atol=1e-7)
    masked = t_scores.masked_fill(torch.triu(torch.ones(6, 6), diagonal=1).bool(), -torch.inf).numpy()
    finite = np.isfinite(PRINTED_MASKED_SCORES)
    assert (np.isfinite(masked) == finite).all()
    assert_printed(masked[finite], np.asarray(PRINTED_MASKED_SCORES)[finite], "masked scores")


def test_printed_dropout_follows_inverted_scaling():
    # The chapter's dropout masks (seed 123) come from torch's RNG of its day; torch 2.13 draws
    # a different mask from the same seed (seed 004 warns that they differ across systems), so
    # the masks are not compared. What the printouts do fix is the rule, p = 0.5: every entry
    # is 0 or 1/(1-p) = 2 times the input, and seed 004's dropped causal weights are exactly
    # twice the printed weights where kept.
    printed_ones = np.array([[2, 2, 2, 2, 2, 2], [0, 2, 0, 0, 0, 0], [0, 0, 2, 0, 2, 0],
                             [2, 2, 0, 0, 0, 2], [2, 0, 0, 0, 0, 2], [0, 2, 0, 0, 0, 0]])
    assert set(np.unique(printed_ones)) == {0, 2}
    printed_dropped = np.array([
        [2.0000, 0, 0, 0, 0, 0], [0, 0.8966, 0, 0, 0, 0], [0, 0, 0.6206, 0, 0, 0],
        [0.5517, 0.4921, 0, 0, 0, 0], [0.4350, 0, 0, 0, 0, 0], [0, 0.3327, 0, 0, 0, 0]])
    kept = printed_dropped != 0
    np.testing.assert_allclose(printed_dropped[kept], 2 * np.asarray(PRINTED_CAUSAL_WEIGHTS)[kept], atol=1.5e-4)
    # torch 2.13 keeps the rule; flax_attn.dropout is held to it statistically in test_dropout.py.
    torch.manual_seed(123)
    out = torch.nn.Dropout(0.5)(torch.tensor(PRINTED_CAUSAL_WEIGHTS)).numpy()
    assert np.all((out == 0) | np.isclose(out, 2 * np.asarray(PRINTED_CAUSAL_WEIGHTS, np.float32)))


def _causal_attention_softmax_over_queries(ca: tr.CausalAttention, x):
    """Seed 000's CausalAttention.forward: the same, but ``torch.softmax(..., dim=1)``."""
    n = x.shape[1]
    scores = ca.W_query(x) @ ca.W_key(x).transpose(1, 2)
    scores = scores.masked_fill(ca.mask.bool()[:n, :n], -torch.inf)
    return torch.softmax(scores / ca.d_out ** 0.5, dim=1) @ ca.W_value(x)


def test_causal_attention_seed_123_and_the_erratum():
    ca = seeded(123, tr.CausalAttention, 3, 2, 6, 0.0)
    t, f = both(ca, fa.CausalAttention(3, 2, 6, 0.0), BATCH)
    assert t.shape == f.shape == (2, 6, 2)
    for item in range(2):
        assert_printed(t[item], PRINTED_CAUSAL, "torch_ref (softmax over keys, seeds 002/004)")
        assert_printed(f[item], PRINTED_CAUSAL, "flax_attn (softmax over keys, seeds 002/004)")
    # Seed 000's table comes from the same weights with the softmax over queries (dim=1).
    with torch.no_grad():
        erratum = _causal_attention_softmax_over_queries(ca, BATCH).numpy()
    for item in range(2):
        assert_printed(erratum[item], PRINTED_CAUSAL_ERRATUM, "seed 000 (softmax over queries)")
    assert np.abs(erratum - t).max() > 0.1  # the two tables really differ


def test_multi_head_wrapper_seed_123():
    wrapper = seeded(123, tr.MultiHeadAttentionWrapper, 3, 2, 6, 0.0, 2)
    t, f = both(wrapper, fa.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2), BATCH, deterministic=True)
    assert t.shape == f.shape == (2, 6, 4)
    assert_printed(t[1], PRINTED_WRAPPER, "torch_ref")
    assert_printed(f[0], PRINTED_WRAPPER, "flax_attn")
    with torch.no_grad():
        erratum = torch.cat([_causal_attention_softmax_over_queries(h, BATCH) for h in wrapper.heads], -1)
    assert_printed(erratum[0].numpy(), PRINTED_WRAPPER_ERRATUM, "seed 000 (softmax over queries)")


def test_multi_head_wrapper_d_out_1_seed_123():
    # Only seed 000 prints this case, with its softmax over queries; the correct module's
    # output for it is not printed, so its shape is checked and its values held by parity.
    wrapper = seeded(123, tr.MultiHeadAttentionWrapper, 3, 1, 6, 0.0, 2)
    t, f = both(wrapper, fa.MultiHeadAttentionWrapper(3, 1, 6, 0.0, 2), BATCH, deterministic=True)
    assert t.shape == f.shape == (2, 6, 2)
    np.testing.assert_allclose(f, t, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        erratum = torch.cat([_causal_attention_softmax_over_queries(h, BATCH) for h in wrapper.heads], -1)
    assert_printed(erratum[0].numpy(), PRINTED_WRAPPER_D1_ERRATUM, "seed 000 (softmax over queries)")


def test_multi_head_attention_seed_123():
    t, f = both(seeded(123, tr.MultiHeadAttention, 3, 2, 6, 0.0, 2),
                fa.MultiHeadAttention(3, 2, 6, 0.0, 2), BATCH, deterministic=True)
    assert t.shape == f.shape == (2, 6, 2)
    for item in range(2):
        assert_printed(t[item], PRINTED_MHA, "torch_ref")
        assert_printed(f[item], PRINTED_MHA, "flax_attn")


def test_gpt2_sized_parameter_count():
    assert tr.count_parameters(tr.MultiHeadAttention(768, 768, 1024, 0.0, 12)) == 2_360_064
    m = fa.MultiHeadAttention(768, 768, 1024, 0.0, 12)
    shapes = jax.eval_shape(lambda: m.init(jax.random.key(0), jnp.zeros((1, 4, 768), jnp.float32), deterministic=True))
    assert fa.count_parameters(shapes) == 2_360_064
    # 4 * 768 * 768 weights + 768 out_proj bias, by hand.
    assert 4 * 768 * 768 + 768 == 2_360_064


def test_batched_matmul_per_head_example():
    a = np.array([[[[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388],
                    [0.7179, 0.7058, 0.9156, 0.4340]],
                   [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737],
                    [0.4606, 0.5159, 0.4220, 0.5786]]]], np.float32)
    printed = [[[1.3208, 1.1631, 1.2879], [1.1631, 2.2150, 1.8424], [1.2879, 1.8424, 2.0402]],
               [[0.4391, 0.7003, 0.5903], [0.7003, 1.3737, 1.0620], [0.5903, 1.0620, 0.9912]]]
    t = torch.from_numpy(a)
    assert_printed((t @ t.transpose(2, 3))[0].numpy(), printed, "torch")
    assert_printed(jnp.einsum("bnth,bnsh->bnts", a, a)[0], printed, "jax")
    for head in range(2):
        assert_printed(fa.basics.attention_scores(jnp.asarray(a[0, head]), jnp.asarray(a[0, head])),
                       printed[head], f"head {head}")


@pytest.mark.parametrize("cls", ["CausalAttention", "MultiHeadAttention"])
def test_buffers_move_with_to_and_sit_in_state_dict(cls):
    args = (3, 2, 6, 0.0) if cls == "CausalAttention" else (3, 2, 6, 0.0, 2)
    module = getattr(tr, cls)(*args)
    assert "mask" in module.state_dict()
    assert "mask" not in dict(module.named_parameters())
    np.testing.assert_array_equal(module.state_dict()["mask"].numpy(), np.triu(np.ones((6, 6)), 1))
    assert module.to(torch.float64).mask.dtype == torch.float64  # moves with .to()
    # flax_attn computes masks: none among its parameters.
    fm = getattr(fa, cls)(*args)
    shapes = jax.eval_shape(lambda: fm.init(jax.random.key(0), jnp.zeros((1, 6, 3)), deterministic=True))
    assert set(shapes) == {"params"}
    assert not any("mask" in "/".join(map(str, p)) for p in jax.tree_util.tree_flatten_with_path(shapes)[0])
