"""One decoding step of multi-head latent attention (absorbed) against PyTorch eager.

The layer: DeepSeek-V2-Lite's attention shapes: d_model 2048, 16 heads, ``kv_lora_rank`` 512,
``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64 (interleaved RoPE, theta 10000),
``v_head_dim`` 128, one ``q_proj`` (no query low rank), no biases, float32; one new token per
step after 1024 cached tokens, batch 1 and 8, in a cache of a few more slots than the steps
need and in one of 8192 slots (allocated for the longest generation, early on).

Contenders, timed in turns in one process (:func:`benchmarks.decode.timed_rows`):

* ``flax_attn absorbed``: ``fa.decode_step(fa.MultiHeadLatentAttention(MLAConfig(...,
  absorb=True)))``: one ``jax.jit``, the :class:`LatentKVCache` donated;
* ``torch eager``: :class:`TorchMLADecode` below, written from the paper's absorbed form
  (DeepSeek-V2, arXiv 2405.04434, section 2.1: ``W_UK`` absorbed into the query, ``W_UV``
  applied after attention): the latent
  ``[c_kv, k_pe]`` written into a preallocated ``(B, S, r_kv + d_r)`` cache by index, and
  ``F.scaled_dot_product_attention`` over the filled slots with the 16 latent queries as 16
  rows of one head (the latent as key and value, the value's last d_r dims dropped after),
  under ``torch.inference_mode()``, with torch's default threads and, as ``torch eager 1
  thread``, with one. Of the forms tried for that call (AMD EPYC, 1,025 slots, batch 1 / 8):
  this one 0.38 / 2.5 ms; the value as the strided ``c_kv`` view 1.1 / 4.9 ms; two einsums and
  a softmax 0.45 / 2.8 ms; 16 query heads over one key head with ``enable_gqa=True`` 42 / 285
  ms (its math path repeats the keys for every head).

Both start from the same weights and the same cached latents (random, written into the
caches), and their first outputs must agree (relative 1e-4) before timing. The memory floor of
a step: the weights (``q_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``) plus the
cached latents at the fill level.

    python -m benchmarks.decode_mla    # prints the table, writes benchmarks/results/decode-mla-<cpu>.json
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from benchmarks import cpu
from benchmarks.decode import STEPS, filled, flax_steps, report, timed_rows, torch_steps, write

SHAPES = dict(d_model=2048, num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
THETA = 10000.0
BATCHES = (1, 8)
CELLS = ((1024, 0), (1024, 8192))  # (prefix, cache slots; 0: what the steps need)


def _torch_layer_class():
    import torch
    import torch.nn.functional as F

    class TorchMLADecode(torch.nn.Module):
        """PyTorch eager absorbed MLA decoding with a preallocated latent cache ``(B, S, r_kv +
        d_r)``; ``forward(x (B, 1, D), pos: int) -> (B, 1, D)`` writes slot ``pos`` and attends
        over slots ``0..pos``."""

        def __init__(self, batch: int, max_len: int, d_model, num_heads, kv_lora_rank, qk_nope_head_dim,
                     qk_rope_head_dim, v_head_dim, eps: float = 1e-6):
            super().__init__()
            self.N, self.r, self.dn, self.dr, self.dv, self.eps = (num_heads, kv_lora_rank, qk_nope_head_dim,
                                                                    qk_rope_head_dim, v_head_dim, eps)
            linear = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
            self.q_proj = linear(d_model, num_heads * (qk_nope_head_dim + qk_rope_head_dim))
            self.kv_a_proj_with_mqa = linear(d_model, kv_lora_rank + qk_rope_head_dim)
            self.kv_a_norm = torch.nn.Parameter(torch.ones(kv_lora_rank))
            self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
            self.o_proj = linear(num_heads * v_head_dim, d_model)
            inv = 1.0 / THETA ** (torch.arange(0, self.dr, 2, dtype=torch.float64) / self.dr)
            angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)  # (S, d_r / 2)
            self.register_buffer("cos", angles.cos().float(), persistent=False)
            self.register_buffer("sin", angles.sin().float(), persistent=False)
            self.register_buffer("latent", torch.zeros(batch, max_len, kv_lora_rank + qk_rope_head_dim),
                                 persistent=False)

        def rope(self, x, pos: int):
            """Interleaved RoPE: the pairs (2i, 2i + 1) of the last dim turned by pos * theta^(-2i/d_r)."""
            even, odd = x[..., 0::2], x[..., 1::2]
            cos, sin = self.cos[pos], self.sin[pos]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)

        def forward(self, x, pos: int):
            B = x.shape[0]
            q = self.q_proj(x[:, 0]).view(B, self.N, self.dn + self.dr)
            q_nope, q_pe = q[..., :self.dn], self.rope(q[..., self.dn:], pos)
            lat = self.kv_a_proj_with_mqa(x[:, 0])
            c = lat[:, :self.r]
            c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.eps) * self.kv_a_norm
            self.latent[:, pos, :self.r] = c
            self.latent[:, pos, self.r:] = self.rope(lat[:, self.r:], pos)
            w = self.kv_b_proj.weight.view(self.N, self.dn + self.dv, self.r)
            q_latent = torch.einsum("bnh,nhr->bnr", q_nope, w[:, :self.dn])
            # the N heads as N query rows of one head over the shared latent keys; the latent is the
            # value too, its last d_r dims dropped after (the fastest of the forms measured below)
            query = torch.cat([q_latent, q_pe], dim=-1)[:, None]                  # (B, 1, N, r + d_r)
            keys = self.latent[:, None, :pos + 1]                                  # (B, 1, L, r + d_r)
            out = F.scaled_dot_product_attention(query, keys, keys, scale=(self.dn + self.dr) ** -0.5)
            out = torch.einsum("bnr,nvr->bnv", out[:, 0, :, :self.r], w[:, self.dn:])
            return self.o_proj(out.reshape(B, 1, self.N * self.dv))

    return TorchMLADecode


def cell(batch: int, prefix: int, repeats: int, capacity: int = 0, shapes: dict = SHAPES) -> list[dict]:
    """Time one (batch, prefix, capacity) cell; one row per contender (as :func:`benchmarks.decode.cell`)."""
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa

    B, D = batch, shapes["d_model"]
    r, dr = shapes["kv_lora_rank"], shapes["qk_rope_head_dim"]
    max_len = max(capacity, prefix + 2 * (repeats + 2) * STEPS + 2)  # room for both torch rows, which share one cache
    rng = np.random.default_rng(batch * 100003 + prefix)
    config = fa.MLAConfig(**shapes, rope_theta=THETA, absorb=True)
    layer = fa.MultiHeadLatentAttention(config)
    x = rng.standard_normal((B, 1, D)).astype(np.float32)
    params = layer.init(jax.random.key(0), jnp.asarray(x), jnp.zeros((B, 1), jnp.int32))
    p = jax.tree.map(np.asarray, params["params"])
    cached = np.zeros((B, max_len, r + dr), np.float32)
    cached[:, :prefix] = rng.standard_normal((B, prefix, r + dr))

    cache = layer.init_cache(B, max_len).replace(latent=jnp.asarray(cached), **filled(B, max_len, prefix))
    twin = _torch_layer_class()(B, max_len, **shapes)
    with torch.no_grad():
        for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            getattr(twin, name).weight.copy_(torch.from_numpy(p[name]["kernel"].T.copy()))
        twin.kv_a_norm.copy_(torch.from_numpy(np.array(p["kv_a_layernorm"]["scale"])))
        twin.latent.copy_(torch.from_numpy(cached))
    fill = prefix + 1 + (repeats + 1) * STEPS // 2  # the fill level at the middle of the run
    weights = sum(int(np.prod(p[name]["kernel"].shape)) for name in ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
    floor = 4 * (weights + B * fill * (r + dr))
    return timed_rows({"flax_attn absorbed": flax_steps(fa.decode_step(layer), params, cache, x, prefix, max_len)},
                      torch_steps(twin, x, prefix), repeats, floor,
                      batch=B, prefix=prefix, capacity=max_len, kv_heads=1)


SMOKE_SHAPES = dict(d_model=64, num_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)


def run(repeats: int = 20, smoke: bool = False) -> list[dict]:
    """Every (batch, prefix, cache slots) cell (:data:`CELLS`, :data:`BATCHES`); with ``smoke``
    one tiny cell (batch 1, 64 cached tokens, :data:`SMOKE_SHAPES`)."""
    if smoke:
        return cell(1, 64, repeats, 0, SMOKE_SHAPES)
    return [row for prefix, capacity in CELLS for batch in BATCHES for row in cell(batch, prefix, repeats, capacity)]


TITLE = ("Absorbed multi-head latent attention decode step, d_model 2048, 16 heads, kv_lora_rank 512, "
         "qk_nope 128 + qk_rope 64, v_head 128, float32")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = run(args.repeats)
    print(report(rows, TITLE))
    write(args.out or Path(__file__).parent / "results" / f"decode-mla-{cpu.slug()}.json", rows, args.repeats)


if __name__ == "__main__":
    main()
