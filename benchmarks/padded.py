"""Padded attention on CPU: per-sequence lengths (``query_seq_lengths``, ``key_value_seq_lengths``)
against PyTorch's SDPA with the same padding as a boolean mask.

A batch of sequences of different lengths, padded to one length, attends only within each
sequence's real tokens: queries past a sequence's length see nothing (zeros) and keys past it
are never seen. Two cells, float32, forward and forward+backward (gradients of ``sum(out * dout)``
with respect to queries, keys and values):

* ``gpt2``: GPT-2-small's core, 8 x 12 heads of 64 x 1,024 tokens, causal, lengths
  1,024 / 1,000 / 900 / 800 / 700 / 1,024 / 512 / 1,024;
* ``gqa-2048``: 2 x 12 query heads over 4 key/value heads of 64 x 2,048 tokens, no causal mask
  (an encoder), lengths 2,048 / 1,948;
* ``decode-b1``, ``decode-b8``: a decoding step's call, forward only: one query per sequence
  (12 heads of 64) against a buffer of 8,192 key slots of which only the first ones are in
  use (``key_value_seq_lengths`` alone): batch 1 with 1,024 in use; batch 8 with 1,024 / 900 /
  1,024 / 700 / 1,024 / 512 / 1,024 / 1,000.

Contenders:

* ``flax_attn (auto: ...)``: ``fa.dot_product_attention(..., query_seq_lengths=L,
  key_value_seq_lengths=L)`` under ``jax.jit``, the automatic choice (on an x86-64 CPU with
  AVX-512 or AVX2 the compiled kernel, :mod:`flax_attn.core.native`, which serves lengths);
* ``flax_attn (blockwise)``: the same call through the blockwise path, the automatic choice
  for these calls before the kernel served lengths;
* ``torch SDPA + mask``: ``F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
  enable_gqa=True)`` with ``allowed`` the same padding (and causal) rule as a boolean
  ``(B, 1, T, S)`` mask, heads first. Rows with nothing to attend to (none in these cells) would
  give NaN there.

Before timing, flax_attn's output must equal PyTorch's within float32's 1e-5 (relative).

    python -m benchmarks.padded            # prints the table, writes benchmarks/results/padded-<cpu>.json
    python -m benchmarks.padded --smoke    # tiny shapes, one round: checks that it runs
"""
from __future__ import annotations

import functools

import numpy as np

from benchmarks import cpu
from benchmarks.core import table_main
from benchmarks.decode import machine
from benchmarks.run import time_in_turns

CELLS = {
    "gpt2": dict(batch=8, heads=12, kv_heads=12, tokens=1024, head_dim=64, causal=True,
                 lengths=(1024, 1000, 900, 800, 700, 1024, 512, 1024)),
    "gqa-2048": dict(batch=2, heads=12, kv_heads=4, tokens=2048, head_dim=64, causal=False, lengths=(2048, 1948)),
    # queries: one query a sequence against `tokens` key slots, key lengths only, forward only
    "decode-b1": dict(batch=1, heads=12, kv_heads=12, tokens=8192, queries=1, head_dim=64, causal=False,
                      lengths=(1024,)),
    "decode-b8": dict(batch=8, heads=12, kv_heads=12, tokens=8192, queries=1, head_dim=64, causal=False,
                      lengths=(1024, 900, 1024, 700, 1024, 512, 1024, 1000)),
}
SMOKE_CELLS = {"smoke": dict(batch=2, heads=2, kv_heads=1, tokens=48, head_dim=16, causal=True, lengths=(48, 30)),
               "smoke-decode": dict(batch=2, heads=2, kv_heads=1, tokens=48, queries=1, head_dim=16, causal=False,
                                    lengths=(40, 7))}
MODES = ("forward", "forward+backward")


def contenders(cell: dict, mode: str, seed: int = 0) -> dict:
    """``{label: zero-argument run}``: flax_attn's automatic choice, its blockwise path and
    PyTorch's SDPA with the padding as a mask; raises where the outputs disagree."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import flax_attn as fa
    from flax_attn.core import registry
    from flax_attn.core.call import describe
    from torch_ref.compare import max_rel_error

    B, N, K, S, H = cell["batch"], cell["heads"], cell["kv_heads"], cell["tokens"], cell["head_dim"]
    T = cell.get("queries", S)  # fewer queries than keys: key lengths only (a decoding step)
    lengths = np.asarray(cell["lengths"], np.int32)
    if lengths.shape != (B,):
        raise ValueError(f"cell lengths must have one entry per sequence ({B}), got {lengths.shape}")
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((B, T, N, H), dtype=np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, S, K, H), dtype=np.float32) for _ in range(2))
    jq, jk, jv, jd, jl = map(jnp.asarray, (q, k, v, dout, lengths))
    kw = dict(is_causal=cell["causal"])
    padding = lambda n: dict(key_value_seq_lengths=n, **({} if T != S else {"query_seq_lengths": n}))  # noqa: E731
    auto = registry.choose(describe(jq, jk, jv, **padding(jl), **kw)).name
    runs = {}
    for label, impl in ((f"flax_attn (auto: {auto})", None), ("flax_attn (blockwise)", "blockwise")):
        core = functools.partial(fa.dot_product_attention, **kw, implementation=impl)
        forward = jax.jit(lambda q, k, v, n, core=core: core(q, k, v, **padding(n)))
        if mode == "forward":
            runs[label] = functools.partial(forward, jq, jk, jv, jl)
        else:
            grads = jax.jit(jax.grad(lambda q, k, v, d, n, f=forward: jnp.sum(f(q, k, v, n) * d), argnums=(0, 1, 2)))
            runs[label] = functools.partial(grads, jq, jk, jv, jd, jl)

    t = np.arange(S)
    real = t[None, :] < lengths[:, None]                                  # (B, S)
    allowed = (real[:, :, None] if T == S else np.ones((B, T, 1), bool)) & real[:, None, :]
    if cell["causal"]:
        allowed &= t[S - T:, None] >= t[None, :]
    allowed = torch.from_numpy(allowed[:, None])
    heads_first = lambda x, grad=False: torch.from_numpy(x).transpose(1, 2).contiguous().requires_grad_(grad)
    tq, tk, tv = (heads_first(x, grad=mode != "forward") for x in (q, k, v))
    td = heads_first(dout)
    sdpa = functools.partial(F.scaled_dot_product_attention, attn_mask=allowed, enable_gqa=K != N)

    with torch.no_grad():
        want = sdpa(tq, tk, tv).transpose(1, 2).numpy()
    got = np.asarray(jax.jit(lambda q, k, v, n: fa.dot_product_attention(q, k, v, **kw, **padding(n)))(jq, jk, jv, jl))
    err = max_rel_error(got, want)
    if not err <= 1e-5:
        raise AssertionError(f"flax_attn and PyTorch disagree on the padded cell: relative error {err:.1e}")

    def torch_run():
        if mode == "forward":
            with torch.no_grad():
                return sdpa(tq, tk, tv)
        for x in (tq, tk, tv):
            x.grad = None
        sdpa(tq, tk, tv).backward(td)
        return tq.grad

    return {**runs, "torch SDPA + mask": torch_run}


def run(repeats: int = 10, cells: dict = CELLS) -> list[dict]:
    """One row per cell, mode and contender: seconds and the ratio to PyTorch's."""
    rows = []
    for name, cell in cells.items():
        for mode in MODES if "queries" not in cell else MODES[:1]:
            seconds = time_in_turns(contenders(cell, mode), repeats)
            for label, s in seconds.items():
                rows.append({"cell": name, "mode": mode, "contender": label, "seconds": s,
                             "ratio_vs_torch": s / seconds["torch SDPA + mask"],
                             **{k: list(v) if isinstance(v, tuple) else v for k, v in cell.items()}})
    return rows


def report(rows: list[dict], measured_on: dict = None) -> str:
    """A Markdown table of :func:`run`'s rows under the machine (``measured_on``, a result file's
    ``machine``; default: this one)."""
    m = measured_on or machine()
    lines = [f"Padded attention (per-sequence lengths), float32; CPU {m['cpu']} ({m['cores']} cores, load "
             f"{m['load_1_5_15']})" + cpu.environment_text(m.get("environment", {})), "",
             "| cell | mode | contender | time | vs torch SDPA + mask |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['cell']} | {r['mode']} | {r['contender']} | {r['seconds'] * 1e3:.1f} ms | "
              f"{r['ratio_vs_torch']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    table_main(argv, __doc__.splitlines()[0], "padded", run, lambda: run(1, SMOKE_CELLS), report)


if __name__ == "__main__":
    main()
