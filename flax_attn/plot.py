"""Attention weights as heatmaps: one panel per head, tokens on both axes, one shared colour scale.

    out, weights = flax_attn.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    fig = flax_attn.plot.attention_heatmaps(weights, tokens, path="heads.png")

matplotlib is imported only when a function here is called (``pip install 'flax-attn[plot]'``),
so ``import flax_attn`` never needs it.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np

Tokens = Union[Sequence[str], tuple[Sequence[str], Sequence[str]]]


def _matplotlib():
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("flax_attn.plot needs matplotlib, which is not installed: "
                          "pip install 'flax-attn[plot]' (or pip install matplotlib)") from e
    return matplotlib, Figure


def _split_tokens(tokens, T: int, S: int) -> tuple[Optional[list[str]], Optional[list[str]]]:
    """Query and key labels from ``tokens``: one sequence for both, or a pair (queries, keys)."""
    if tokens is None:
        return None, None
    if isinstance(tokens, str):
        raise TypeError("tokens must be a sequence of labels (one per token), not one string; "
                        "for characters pass list(text)")
    is_pair = (isinstance(tokens, tuple) and len(tokens) == 2
               and all(not isinstance(t, str) and isinstance(t, Sequence) for t in tokens))
    if is_pair:
        queries, keys = (list(map(str, t)) for t in tokens)
        if len(queries) != T or len(keys) != S:
            raise ValueError(f"tokens=(query_tokens, key_tokens) has {len(queries)} and {len(keys)} labels; "
                             f"weights have T={T} queries and S={S} keys")
        return queries, keys
    labels = [str(t) for t in tokens]
    if T != S:
        raise ValueError(f"tokens has {len(labels)} labels for weights with T={T} queries and S={S} keys; "
                         f"when T != S pass tokens=(query_tokens, key_tokens)")
    if len(labels) != S:
        raise ValueError(f"tokens has {len(labels)} labels; weights have T = S = {S} tokens")
    return labels, labels


def attention_heatmaps(weights, tokens: Optional[Tokens] = None, *, path=None, title: Optional[str] = None,
                       heads: Optional[Sequence[int]] = None, batch: int = 0, columns: int = 4,
                       annotate: Optional[bool] = None, cmap: str = "viridis"):
    """Draw attention weights as a grid of heatmaps, one panel per head.

    Row t of a panel is query t's distribution over the keys (columns). All panels share one
    colour scale, from 0 to the largest weight drawn, shown by one colorbar.

    Args:
      weights: ``(T, S)``, ``(N, T, S)`` or ``(B, N, T, S)`` (as ``dot_product_attention(...,
        return_weights=True)`` returns); NumPy or JAX; finite.
      tokens: labels for both axes: ``T`` of them when ``T == S`` (self-attention), or a pair
        ``(query_tokens, key_tokens)`` of ``T`` and ``S`` labels. None: indices.
      path: where to write a PNG (None: nothing is written).
      title: the figure's title.
      heads: which heads to draw (default: all ``N``), in that order.
      batch: which sequence to draw from ``(B, N, T, S)`` weights.
      columns: at most this many panels per row (the grid is as square as that allows).
      annotate: write each weight in its cell (default: when ``T * S <= 100``).
      cmap: a matplotlib colormap name.

    Returns:
      The ``matplotlib.figure.Figure`` (not registered with pyplot: nothing global to close).

    Raises:
      ImportError: matplotlib is not installed (``pip install 'flax-attn[plot]'``).
      ValueError: a rank other than 2, 3 or 4; non-finite weights; a batch or head index out of
        range; labels that do not match T and S. The message names the argument and shapes.
    """
    w = np.asarray(weights)
    shape = w.shape
    if w.ndim not in (2, 3, 4):
        raise ValueError(f"weights must have shape (T, S), (N, T, S) or (B, N, T, S), got shape {shape}")
    if not (np.issubdtype(w.dtype, np.floating) or np.issubdtype(w.dtype, np.integer)) and w.dtype.name != "bfloat16":
        raise TypeError(f"weights must be real numbers, got dtype {w.dtype}")
    w = w.astype(np.float64)
    if w.ndim == 4:
        if isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or not -shape[0] <= batch < shape[0]:
            raise ValueError(f"batch={batch!r} is out of range for weights of shape {shape} (B={shape[0]})")
        w = w[batch]
    elif batch != 0:
        raise ValueError(f"batch={batch!r} given for weights of shape {shape}, which have no batch axis")
    if w.ndim == 2:
        w = w[None]
    N, T, S = w.shape
    if 0 in (N, T, S):
        raise ValueError(f"weights of shape {shape} have nothing to draw")
    bad = ~np.isfinite(w)
    if bad.any():
        raise ValueError(f"weights must be finite: {int(bad.sum())} of {w.size} entries of the drawn weights "
                         f"(shape {shape}) are NaN or infinite")
    if heads is None:
        heads = list(range(N))
    else:
        heads = [heads] if isinstance(heads, (int, np.integer)) else list(heads)
        wrong = [h for h in heads if isinstance(h, bool) or not isinstance(h, (int, np.integer)) or not -N <= h < N]
        if not heads or wrong:
            raise ValueError(f"heads must be a non-empty list of indices in [0, {N}) for weights of shape {shape}, "
                             f"got {heads!r}")
        heads = [int(h) % N for h in heads]
    query_labels, key_labels = _split_tokens(tokens, T, S)
    if isinstance(columns, bool) or not isinstance(columns, (int, np.integer)) or columns < 1:
        raise ValueError(f"columns must be a positive integer, got {columns!r}")
    if annotate is None:
        annotate = T * S <= 100

    matplotlib, Figure = _matplotlib()
    cols = min(columns, math.ceil(math.sqrt(len(heads))))  # a near-square grid
    rows = math.ceil(len(heads) / cols)
    longest = max((len(s) for s in (query_labels or []) + (key_labels or [])), default=2)
    cell = max(0.12, min(0.6, 4.0 / max(T, S)))  # inches per token
    panel_w = S * cell + 0.08 * longest + 0.5
    panel_h = T * cell + 0.08 * longest + 0.6
    fig = Figure(figsize=(cols * panel_w + 1.2, rows * panel_h + (0.5 if title else 0.1)), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    vmax = float(max(w[heads].max(), 1e-12))
    norm = matplotlib.colors.Normalize(vmin=0.0, vmax=vmax)
    image = None
    for i, ax in enumerate(axes.flat):
        if i >= len(heads):
            ax.set_axis_off()
            continue
        h = heads[i]
        image = ax.imshow(w[h], cmap=cmap, norm=norm, interpolation="nearest", aspect="equal")
        ax.set_title(f"head {h}" if N > 1 or len(heads) > 1 else "weights", fontsize=10)
        ax.set_xticks(range(S), key_labels if key_labels is not None else [str(s) for s in range(S)],
                      rotation=90, fontsize=8)
        ax.set_yticks(range(T), query_labels if query_labels is not None else [str(t) for t in range(T)], fontsize=8)
        ax.tick_params(length=0)
        if i % cols == 0:
            ax.set_ylabel("query")
        if i // cols == rows - 1 or i + cols >= len(heads):
            ax.set_xlabel("key")
        if annotate:
            for t in range(T):
                for s in range(S):
                    value = w[h, t, s]
                    ax.text(s, t, f"{value:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if value > 0.6 * vmax else "white")
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    if title:
        fig.suptitle(title)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
