"""Draw attention weights as heatmaps: the chapter's six-token example, and a sliding-window
grouped-query layer.

    python examples/heatmaps.py                   # writes examples/figures/heatmap_*.png
    python examples/heatmaps.py --out /tmp/figs

Needs matplotlib (``pip install 'flax-attn[plot]'``).
"""
import argparse
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

import flax_attn as fa
from flax_attn.plot import attention_heatmaps

# "Your journey starts with one step": the chapter's six 3-d token embeddings (section 3.3).
CHAPTER_TOKENS = ["Your", "journey", "starts", "with", "one", "step"]
CHAPTER_INPUTS = np.array(
    [[0.43, 0.15, 0.89],
     [0.55, 0.87, 0.66],
     [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33],
     [0.77, 0.25, 0.10],
     [0.05, 0.80, 0.55]], np.float32)

SENTENCE = "attention lets every token look at a few tokens before it".split()
GQA = fa.AttentionConfig(d_model=32, num_heads=4, num_kv_heads=2, position="rope", sliding_window=4)


def chapter_weights() -> np.ndarray:
    """The chapter's simplified self-attention: softmax(x x^T), unscaled, one head: ``(1, 6, 6)``."""
    x = jnp.asarray(CHAPTER_INPUTS)[:, None, :]  # (T, N=1, H=3): queries, keys and values are the inputs
    _, weights = fa.dot_product_attention(x, x, x, scale=1.0, return_weights=True)
    return np.asarray(weights)


def layer_weights(config: fa.AttentionConfig = GQA, seed: int = 0):
    """The attention weights ``(B, N, T, S)`` of an ``fa.Attention`` layer with random parameters
    on random embeddings, recomputed from its projections (the layer does not return them).

    Returns the weights, and the layer's output and the output rebuilt from those weights (equal:
    the weights drawn are the layer's).
    """
    T, c = len(SENTENCE), config
    layer = fa.Attention(c)
    x = jax.random.normal(jax.random.key(seed + 1), (1, T, c.d_model))
    positions = jnp.arange(T)[None]
    params = layer.init(jax.random.key(seed), x, positions)
    H = c.kv_head_dim
    q = (x @ params["params"]["q_proj"]["kernel"]).reshape(1, T, c.num_heads, H)
    k = (x @ params["params"]["k_proj"]["kernel"]).reshape(1, T, c.kv_heads, H)
    v = (x @ params["params"]["v_proj"]["kernel"]).reshape(1, T, c.kv_heads, H)
    rope = dict(theta=c.rope_theta, layout=c.rope_layout, rotary_dim=c.rotary_dim, scaling=c.rope_scaling)
    q, k = fa.apply_rope(q, positions, **rope), fa.apply_rope(k, positions, **rope)
    out, weights = fa.dot_product_attention(q, k, v, is_causal=True, local_window_size=(c.sliding_window - 1, 0),
                                            query_positions=positions, key_positions=positions, return_weights=True)
    rebuilt = (out.reshape(1, T, c.num_heads * H) @ params["params"]["o_proj"]["kernel"])
    return np.asarray(weights), np.asarray(layer.apply(params, x, positions)), np.asarray(rebuilt)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "figures"), help="output directory")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    weights = chapter_weights()
    print("chapter weights, row 'journey':", np.round(weights[0, 1], 4))  # the chapter prints 0.1385 0.2379 ...
    attention_heatmaps(weights, CHAPTER_TOKENS, path=out / "heatmap_chapter.png",
                       title="Your journey starts with one step: softmax(x xᵀ)")

    weights, output, rebuilt = layer_weights()
    assert np.allclose(output, rebuilt, atol=1e-5), "the recomputed weights are not the layer's"
    attention_heatmaps(weights, SENTENCE, path=out / "heatmap_sliding_window_gqa.png",
                       title="fa.Attention: 4 query heads share 2 key/value heads (GQA),\nRoPE, causal sliding window of 4 keys")
    print(f"wrote {out / 'heatmap_chapter.png'} and {out / 'heatmap_sliding_window_gqa.png'}")


if __name__ == "__main__":
    main()
