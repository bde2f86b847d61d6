"""Heatmaps of attention weights: the panels show exactly the weights, labelled with the tokens;
bad input is refused with the argument and shapes named; flax_attn imports without matplotlib."""
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flax_attn as fa
from conftest import CHAPTER_INPUTS, assert_printed, child_env

matplotlib = pytest.importorskip("matplotlib")
import matplotlib.image  # noqa: E402  (_assert_png reads PNGs with it, whichever test runs first)
from flax_attn.plot import attention_heatmaps  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHAPTER_TOKENS = ["Your", "journey", "starts", "with", "one", "step"]


def _panels(fig):
    """The heatmap axes (those holding an image), in drawing order; the colorbar's axes excluded."""
    return [ax for ax in fig.axes if ax.images]


def _labels(ticks):
    return [t.get_text() for t in ticks]


def _assert_png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and min(image.shape[:2]) > 200


def test_chapter_example(tmp_path):
    x = jnp.asarray(CHAPTER_INPUTS, jnp.float64)[:, None, :]  # (T, N=1, H): queries = keys = values = inputs
    _, weights = fa.dot_product_attention(x, x, x, scale=1.0, return_weights=True)
    weights = np.asarray(weights)
    assert weights.shape == (1, 6, 6)
    # The chapter's printed attention weights of "journey" (section 3.3.1).
    assert_printed(weights[0, 1], [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581], "journey's weights")

    fig = attention_heatmaps(weights, CHAPTER_TOKENS, path=tmp_path / "chapter.png", title="Your journey")
    _assert_png(tmp_path / "chapter.png")
    (panel,) = _panels(fig)
    assert len(fig.axes) == 2  # the panel and its colorbar
    np.testing.assert_array_equal(np.asarray(panel.images[0].get_array()), weights[0])
    assert _labels(panel.get_xticklabels()) == CHAPTER_TOKENS
    assert _labels(panel.get_yticklabels()) == CHAPTER_TOKENS
    assert (panel.get_xlabel(), panel.get_ylabel()) == ("key", "query")
    # Small enough to print each weight in its cell, row by row.
    assert [t.get_text() for t in panel.texts] == [f"{w:.2f}" for w in weights[0].ravel()]
    colorbar = panel.images[0].colorbar
    assert colorbar is not None and colorbar.ax.get_ylabel() == "attention weight"
    assert (colorbar.vmin, colorbar.vmax) == (0.0, weights.max())
    assert fig._suptitle.get_text() == "Your journey"


def _sliding_window_gqa_weights(batch):
    """Weights of an fa.Attention layer (4 query heads, 2 key/value heads, RoPE, causal window
    of 3) recomputed from its projections, and a check that they rebuild the layer's output."""
    config = fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=2, position="rope", sliding_window=3)
    layer = fa.Attention(config, param_dtype=jnp.float64)
    T, N, K, H = 7, 4, 2, config.kv_head_dim
    x = jax.random.normal(jax.random.key(1), (batch, T, 16), jnp.float64)
    positions = jnp.broadcast_to(jnp.arange(T), (batch, T))
    params = layer.init(jax.random.key(0), x, positions)
    q = (x @ params["params"]["q_proj"]["kernel"]).reshape(batch, T, N, H)
    k = (x @ params["params"]["k_proj"]["kernel"]).reshape(batch, T, K, H)
    v = (x @ params["params"]["v_proj"]["kernel"]).reshape(batch, T, K, H)
    q, k = fa.apply_rope(q, positions, layout=config.rope_layout), fa.apply_rope(k, positions, layout=config.rope_layout)
    out, weights = fa.dot_product_attention(q, k, v, is_causal=True, local_window_size=(2, 0), query_positions=positions,
                                            key_positions=positions, return_weights=True)
    rebuilt = (out.reshape(batch, T, N * H) @ params["params"]["o_proj"]["kernel"])
    np.testing.assert_allclose(rebuilt, layer.apply(params, x, positions), rtol=0, atol=1e-12)
    return np.asarray(weights)


def test_sliding_window_gqa_layer(tmp_path):
    weights = _sliding_window_gqa_weights(batch=2)
    assert weights.shape == (2, 4, 7, 7)
    tokens = list("abcdefg")
    t, s = np.indices((7, 7))
    outside = (s > t) | (s < t - 2)  # the causal window of 3 keys
    assert (weights[:, :, outside] == 0).all() and (weights[:, :, ~outside] > 0).all()

    fig = attention_heatmaps(weights, tokens, path=tmp_path / "gqa.png", batch=1)
    _assert_png(tmp_path / "gqa.png")
    panels = _panels(fig)
    assert len(panels) == 4 and len(fig.axes) == 5  # four heads in a 2 x 2 grid, one colorbar
    for h, panel in enumerate(panels):
        assert panel.get_title() == f"head {h}"
        np.testing.assert_array_equal(np.asarray(panel.images[0].get_array()), weights[1, h])
        assert _labels(panel.get_xticklabels()) == tokens and _labels(panel.get_yticklabels()) == tokens
    # One shared colour scale: 0 to the largest weight drawn.
    assert {p.images[0].get_clim() for p in panels} == {(0.0, weights[1].max())}

    # Some heads, in the order asked; another sequence of the batch.
    fig = attention_heatmaps(weights, tokens, heads=[3, 1], batch=0)
    panels = _panels(fig)
    assert [p.get_title() for p in panels] == ["head 3", "head 1"] and len(fig.axes) == 3
    np.testing.assert_array_equal(np.asarray(panels[0].images[0].get_array()), weights[0, 3])
    np.testing.assert_array_equal(np.asarray(panels[1].images[0].get_array()), weights[0, 1])


def test_cross_attention_labels_queries_and_keys_apart():
    weights = np.full((2, 3), 1 / 3)  # (T, S): two queries over three keys
    fig = attention_heatmaps(weights, (["q0", "q1"], ["k0", "k1", "k2"]))
    (panel,) = _panels(fig)
    assert _labels(panel.get_yticklabels()) == ["q0", "q1"] and _labels(panel.get_xticklabels()) == ["k0", "k1", "k2"]
    # Without tokens, indices.
    (panel,) = _panels(attention_heatmaps(weights))
    assert _labels(panel.get_xticklabels()) == ["0", "1", "2"] and _labels(panel.get_yticklabels()) == ["0", "1"]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(weights=np.ones(4)), ValueError, r"weights must have shape \(T, S\), \(N, T, S\) or \(B, N, T, S\), got shape \(4,\)"),
    (dict(weights=np.ones((1, 1, 1, 2, 2))), ValueError, r"got shape \(1, 1, 1, 2, 2\)"),
    (dict(weights=np.array([[0.5, np.nan], [1.0, 0.0]])), ValueError, r"weights must be finite: 1 of 4 entries .*\(shape \(2, 2\)\)"),
    (dict(weights=np.array([[0.5, np.inf], [1.0, 0.0]])), ValueError, "must be finite"),
    (dict(weights=np.ones((3, 3)), tokens=["a", "b"]), ValueError, r"tokens has 2 labels; weights have T = S = 3"),
    (dict(weights=np.ones((2, 3)), tokens=["a", "b", "c"]), ValueError, r"T=2 queries and S=3 keys; when T != S pass tokens=\(query_tokens, key_tokens\)"),
    (dict(weights=np.ones((2, 3)), tokens=(["a", "b"], ["c"])), ValueError, r"has 2 and 1 labels; weights have T=2 queries and S=3 keys"),
    (dict(weights=np.ones((3, 3)), tokens="abc"), TypeError, r"not one string; for characters pass list\(text\)"),
    (dict(weights=np.ones((2, 4, 3, 3)), batch=2), ValueError, r"batch=2 is out of range for weights of shape \(2, 4, 3, 3\) \(B=2\)"),
    (dict(weights=np.ones((4, 3, 3)), batch=1), ValueError, r"batch=1 given for weights of shape \(4, 3, 3\), which have no batch axis"),
    (dict(weights=np.ones((4, 3, 3)), heads=[0, 4]), ValueError, r"heads must be a non-empty list of indices in \[0, 4\) for weights of shape \(4, 3, 3\), got \[0, 4\]"),
    (dict(weights=np.ones((4, 3, 3)), heads=[]), ValueError, "heads must be a non-empty list"),
], ids=["rank-1", "rank-5", "nan", "inf", "too-few-tokens", "T!=S-one-list", "pair-wrong-lengths", "string",
        "batch-range", "batch-without-axis", "head-range", "no-heads"])
def test_bad_input_is_refused_naming_the_argument_and_shapes(kwargs, error, message):
    with pytest.raises(error, match=message):
        attention_heatmaps(**kwargs)


def test_flax_attn_imports_without_matplotlib():
    # A clean process: importing flax_attn (and its plot module) does not import matplotlib.
    code = "import sys, flax_attn, flax_attn.plot; sys.exit(1 if 'matplotlib' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
    # Where matplotlib is missing, the import error names the extra to install.
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import numpy as np, flax_attn\n"
            "from flax_attn.plot import attention_heatmaps\n"
            "try:\n    attention_heatmaps(np.full((2, 2), 0.5))\n"
            "except ImportError as e:\n    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert "flax_attn.plot needs matplotlib, which is not installed: pip install 'flax-attn[plot]'" in result.stdout, \
        result.stdout + result.stderr[-2000:]


@pytest.mark.slow
def test_heatmaps_example_writes_the_readme_pictures(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "heatmaps.py"), "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "0.1385 0.2379 0.2333" in result.stdout  # the chapter's printed weights of "journey"
    for name in ("heatmap_chapter.png", "heatmap_sliding_window_gqa.png"):
        _assert_png(tmp_path / name)
