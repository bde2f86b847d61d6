"""One KV-cache decoding step of ``fa.Attention`` against PyTorch eager with a preallocated cache.

The layer: d_model 768, 12 heads of 64, RoPE (rotate-half, theta 10000), no biases, float32,
one new token per step after a prefix of 1024 or 8192 cached tokens, batch 1 and 8; the caches
hold a few more slots than the steps need, then 8192 slots for a 1024-token prefix (a cache
allocated for the longest generation, early on), then the same layer with grouped-query
attention (12 query heads over 2 key/value heads) at both prefixes, and last chunks of 32
tokens a step (a prompt fed in pieces, or draft tokens to verify) after 1024 cached tokens in
8192 slots, each chunk's queries causal among themselves.

Contenders, timed in turns in one process (every round runs each once, in a new random order;
medians over ``repeats * STEPS`` rounds of one step each). **Each step starts cold**: before it
the benchmark reads a buffer of twice the CPU's last-level cache (:data:`EVICT_TIMES`), outside
the step's time, so that the layer's weights and cache come from memory, as in a model whose
other layers pass through the CPU's caches between two steps of this one. What stays in the
caches otherwise depends on what else runs: on a 2-core AMD EPYC of family 26 (32 MiB L3),
batch 1 after 1,024 tokens, PyTorch eager took 1.29 ms a step cold, 0.72 ms in rounds of four
steps in turns with the three flax_attn layouts, and 0.31-0.32 ms with only one of them in
turns (its weights and cache resident in the L3), where ``fa.decode_step`` with a ``'BKSH'``
cache took 0.89, 0.58 and 0.40-0.44 ms (warm, its step is bound by XLA's runtime, not by
memory). ``--warm`` (``timed_rows(..., cold=False)``) times rounds of
``STEPS`` steps without the reads.

* ``flax_attn BKSH``: ``fa.decode_step(layer)`` (one ``jax.jit``, the cache donated) with the default
  ``layout='BKSH'`` cache (keys stored ``(B*K, S, H)``);
* ``flax_attn BSKH``: the same with a ``layout='BSKH'`` cache (keys ``(B, S, K, H)``);
* ``flax_attn blocks``: the same with a ``layout='blocks'`` cache (keys ``(S // 128, B*K, 128,
  H)``); every contender's cache has a whole number of its blocks;
* ``torch eager``: :class:`TorchDecodeLayer` below: ``nn.Linear`` projections, RoPE from a
  precomputed table, keys written into a preallocated ``(B, K, S, H)`` cache by index and
  ``F.scaled_dot_product_attention`` over the filled slots (grouped queries as the rows of
  their key/value head), under ``torch.inference_mode()``,
  with torch's default threads (one per core) and, as ``torch eager 1 thread``, with one.

``vs torch`` is each contender's time over the faster of the two torch rows (below 1.0:
faster than PyTorch eager).

Both start from the same weights and the same cached keys/values (random, written directly
into the caches: a prefill is not what is measured), and their first outputs are checked to
agree (relative 1e-4) before timing. The memory floor of a step is the bytes it must read:
the four weight matrices (``4 D^2`` floats) plus the cached keys and values (``2 B L D``
floats at fill level L); ``GB/s`` is that floor over the measured time.

    python -m benchmarks.decode            # prints the table, writes benchmarks/results/decode-<cpu>.json
    python -m benchmarks.decode --quick    # prefix 1024 only, fewer rounds
    python -m benchmarks.decode --warm     # rounds of STEPS steps back to back, nothing evicted
    python -m benchmarks.decode --generation   # whole generations: a cache allocated or grown (generation())
    python -m benchmarks.decode --loop     # runs of steps: a Python loop (eager, decode_step) or one program (loop())
    python -m benchmarks.decode --generation --compilation-cache DIR   # the same with JAX's persistent cache in DIR
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import numpy as np

from benchmarks import cpu
from benchmarks.run import time_in_turns

D_MODEL, HEADS, THETA = 768, 12, 10000.0
STEPS = 4          # decode steps per timed call with the caches warm (timed_rows(cold=False), benchmarks.decode_gpu)
EVICT_TIMES = 2    # a cold step is preceded by reading this many times the CPU's last-level cache
BATCHES = (1, 8)
PREFIXES = (1024, 8192)
# A cache allocated for the longest generation holds fewer tokens early on: 1024 in 8192 slots
# (PyTorch eager attends over the filled slots; flax_attn's layer gives the core its fill)
SPARSE = ((1024, 8192),)
# Grouped-query attention: the 12 query heads over 2 key/value heads, (prefix, kv heads)
GROUPED = ((1024, 2), (8192, 2))
# Several tokens a step over a cache: (prefix, cache slots, tokens per step)
CHUNKS = ((1024, 8192, 32),)


def _torch_layer_class():
    import torch
    import torch.nn.functional as F

    class TorchDecodeLayer(torch.nn.Module):
        """PyTorch eager decoding layer: RoPE (rotate-half) attention with a preallocated cache
        ``(B, K, S, H)``; ``forward(x (B, T, D), pos: int) -> (B, T, D)`` writes slots ``pos ..
        pos + T - 1`` and attends over slots ``0 .. pos + T - 1``, token t up to slot pos + t."""

        def __init__(self, d_model: int, num_heads: int, batch: int, max_len: int, theta: float = THETA,
                     num_kv_heads: int = 0):
            super().__init__()
            self.N, self.H = num_heads, d_model // num_heads
            self.K = num_kv_heads or num_heads
            self.q_proj, self.o_proj = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(2))
            self.k_proj, self.v_proj = (torch.nn.Linear(d_model, self.K * self.H, bias=False) for _ in range(2))
            inv = 1.0 / theta ** (torch.arange(0, self.H, 2, dtype=torch.float64) / self.H)
            freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
            angles = torch.cat([freqs, freqs], dim=-1)
            self.register_buffer("cos", angles.cos().float(), persistent=False)
            self.register_buffer("sin", angles.sin().float(), persistent=False)
            self.register_buffer("k_cache", torch.zeros(batch, self.K, max_len, self.H), persistent=False)
            self.register_buffer("v_cache", torch.zeros(batch, self.K, max_len, self.H), persistent=False)

        def rope(self, x, pos: int, T: int):
            half = self.H // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            return x * self.cos[pos:pos + T] + rotated * self.sin[pos:pos + T]

        def forward(self, x, pos: int):
            B, T = x.shape[:2]
            G, end = self.N // self.K, pos + T
            heads = lambda y, n: y.view(B, T, n, self.H).transpose(1, 2)  # (B, n, T, H)
            q = self.rope(heads(self.q_proj(x), self.N), pos, T)
            self.k_cache[:, :, pos:end] = self.rope(heads(self.k_proj(x), self.K), pos, T)
            self.v_cache[:, :, pos:end] = heads(self.v_proj(x), self.K)
            # grouped queries: the N / K query heads of a key/value head as rows of one head (on
            # CPU 2-6x faster than enable_gqa=True, whose math path repeats the cached keys),
            # rows (g, t); several tokens: token t sees slots up to pos + t
            q = q.reshape(B, self.K, G * T, self.H)
            mask = None
            if T > 1:
                mask = (torch.arange(end)[None, :] <= pos + torch.arange(T)[:, None]).repeat(G, 1)
            out = F.scaled_dot_product_attention(q, self.k_cache[:, :, :end], self.v_cache[:, :, :end], attn_mask=mask)
            return self.o_proj(out.reshape(B, self.N, T, self.H).transpose(1, 2).reshape(B, T, self.N * self.H))

    return TorchDecodeLayer


def filled(batch: int, max_len: int, prefix: int) -> dict:
    """A cache's bookkeeping fields with slots ``0..prefix-1`` filled: positions, segment ids
    (-1 past the prefix) and length."""
    import jax.numpy as jnp

    written = np.arange(max_len) < prefix
    return dict(positions=jnp.asarray(np.broadcast_to(np.arange(max_len, dtype=np.int32), (batch, max_len))),
                segment_ids=jnp.asarray(np.broadcast_to(np.where(written, 0, -1).astype(np.int32), (batch, max_len))),
                length=jnp.int32(prefix))


def prefilled(layer, max_len: int, k0, v0, layout: str = "BKSH"):
    """``layer``'s empty cache of ``max_len`` slots in ``layout`` with the keys and values ``k0``,
    ``v0`` ``(B, K, prefix, H)`` in its first slots (written directly: no prefill)."""
    import jax.numpy as jnp

    from flax_attn.layers.cache import BLOCK

    B, K, prefix, H = k0.shape
    pad = lambda a: np.concatenate([a, np.zeros((B, K, max_len - prefix, H), np.float32)], axis=2)
    to_layout = {"BKSH": lambda a: a.reshape(B * K, max_len, H), "BSKH": lambda a: a.transpose(0, 2, 1, 3),
                 "blocks": lambda a: a.reshape(B * K, max_len // BLOCK, BLOCK, H).transpose(1, 0, 2, 3)}[layout]
    return layer.init_cache(B, max_len, layout=layout).replace(
        key=jnp.asarray(to_layout(pad(k0))), value=jnp.asarray(to_layout(pad(v0))), **filled(B, max_len, prefix))


def flax_steps(step, params, cache, x, prefix: int, max_len: int):
    """``run(n)``: ``n`` decoding steps of ``step`` (from ``fa.decode_step``) on the tokens ``x``
    ``(B, T, D)``, positions counting on from ``prefix``; returns the last output, waited for."""
    import jax.numpy as jnp

    B, T = x.shape[:2]
    xt = jnp.asarray(x)
    positions = [jnp.broadcast_to(jnp.arange(t, t + T, dtype=jnp.int32), (B, T)) for t in range(prefix, max_len - T + 1, T)]
    state = {"cache": cache, "t": 0}

    def run(n=STEPS):
        out = None
        for _ in range(n):
            out, state["cache"] = step(params, state["cache"], xt, positions[state["t"]])
            state["t"] += 1
        return np.asarray(out)  # waits for the result

    return run


def torch_steps(twin, x, prefix: int):
    """``run(n, num_threads)``: ``n`` eager steps of ``twin(x, pos)`` on the tokens ``x``
    ``(B, T, D)``, positions counting on from ``prefix``, under ``torch.inference_mode()``;
    returns the last output."""
    import torch

    tx, state, threads = torch.from_numpy(x), {"t": 0}, torch.get_num_threads()

    def run(n=STEPS, num_threads=threads):
        torch.set_num_threads(num_threads)
        with torch.inference_mode():
            for _ in range(n):
                out = twin(tx, prefix + state["t"])
                state["t"] += tx.shape[1]
        torch.set_num_threads(threads)
        return out.numpy()

    return run


def evictor():
    """``evict()``: reads a buffer of :data:`EVICT_TIMES` times the CPU's last-level cache, so
    that what the next call reads comes from memory; ``evict.nbytes``: the buffer's size."""
    junk = np.ones(EVICT_TIMES * cpu.last_level_cache_bytes() // 4, np.float32)

    def evict():
        return float(junk.sum())

    evict.nbytes = junk.nbytes
    return evict


def timed_rows(flax_runs: dict, torch_run, repeats: int, floor: float, cold: bool = True, **cell_fields) -> list[dict]:
    """Check that every flax_attn contender's first step agrees with PyTorch's (relative 1e-4),
    time them all in turns (PyTorch also with one thread when it has more), and return one
    row per contender: ``cell_fields``, time per step and per token, the memory ``floor``
    (bytes a step must read), GB/s and the ratio to the faster PyTorch row. ``cold``: each of
    ``repeats * STEPS`` rounds times one step after :func:`evictor`'s read (the row's
    ``evicted_mib``); else ``repeats`` rounds of ``STEPS`` steps back to back (0)."""
    import torch

    ref = torch_run(1)
    for name, run in flax_runs.items():
        got = run(1)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        if not err <= 1e-4:
            raise AssertionError(f"{name} and torch eager disagree on the first step: relative error {err:.1e}")
    steps = 1 if cold else STEPS
    fns = {name: functools.partial(run, steps) for name, run in flax_runs.items()}
    fns["torch eager"] = functools.partial(torch_run, steps)
    if torch.get_num_threads() > 1:  # on a shared machine one thread can beat several: the faster one is the peer
        fns["torch eager 1 thread"] = functools.partial(torch_run, steps, num_threads=1)
    evict = evictor() if cold else None
    seconds = time_in_turns(fns, repeats * STEPS // steps, warmup=1, before=evict)
    torch_step = min(s for name, s in seconds.items() if name.startswith("torch")) / steps
    B, tokens = cell_fields["batch"], cell_fields.get("tokens", 1)
    rows = []
    for name, s in seconds.items():
        step_s = s / steps
        rows.append({"contender": name, **cell_fields, "evicted_mib": evict.nbytes / 2**20 if cold else 0,
                     "ms_per_step": step_s * 1e3, "ms_per_token": step_s * 1e3 / (B * tokens),
                     "floor_bytes_per_step": floor, "floor_bytes_per_token": floor / (B * tokens),
                     "gb_per_s": floor / step_s / 1e9, "ratio_vs_torch": step_s / torch_step})
    return rows


def cell(batch: int, prefix: int, repeats: int, capacity: int = 0, kv_heads: int = HEADS, tokens: int = 1,
         cold: bool = True) -> list[dict]:
    """Time one (batch, prefix) cell; one row per contender. ``capacity``: the caches' slots
    (both sides), at least what the cell's steps need; ``kv_heads``: key/value heads (fewer
    than the 12 query heads: grouped-query attention); ``tokens``: new tokens a step; ``cold``:
    see :func:`timed_rows`."""
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa
    from flax_attn.layers.cache import BLOCK

    B, D, N, K = batch, D_MODEL, HEADS, kv_heads
    H = D // N
    max_len = max(capacity, prefix + (2 * (repeats + 2) * STEPS + 2) * tokens)  # room for both torch rows, which share one cache
    max_len = -(-max_len // BLOCK) * BLOCK  # whole blocks, for the 'blocks' layout (every contender has as many slots)
    rng = np.random.default_rng(batch * 100003 + prefix)
    config = fa.AttentionConfig(d_model=D, num_heads=N, num_kv_heads=K, position="rope", rope_theta=THETA)
    layer = fa.Attention(config)
    x = rng.standard_normal((B, tokens, D)).astype(np.float32)
    params = layer.init(jax.random.key(0), jnp.asarray(x), jnp.zeros((B, tokens), jnp.int32))
    kernels = {name: np.asarray(params["params"][name]["kernel"]) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    # cached keys/values for slots 0..prefix-1, (B, K, prefix, H)
    k0 = rng.standard_normal((B, K, prefix, H), dtype=np.float32)
    v0 = rng.standard_normal((B, K, prefix, H), dtype=np.float32)

    def flax_contender(layout: str):
        cache = prefilled(layer, max_len, k0, v0, layout)
        return flax_steps(fa.decode_step(layer), params, cache, x, prefix, max_len)

    twin = _torch_layer_class()(D, N, B, max_len, num_kv_heads=K)
    with torch.no_grad():
        for name, kernel in kernels.items():
            getattr(twin, name).weight.copy_(torch.from_numpy(kernel.T.copy()))
        twin.k_cache[:, :, :prefix] = torch.from_numpy(k0)
        twin.v_cache[:, :, :prefix] = torch.from_numpy(v0)
    fill = prefix + tokens * (1 + (repeats + 1) * STEPS // 2)  # the fill level at the middle of the run
    floor = (2 * D * D + 2 * D * K * H) * 4 + 2 * B * fill * K * H * 4
    return timed_rows({f"flax_attn {layout}": flax_contender(layout) for layout in ("BKSH", "BSKH", "blocks")},
                      torch_steps(twin, x, prefix), repeats, floor, cold,
                      batch=B, prefix=prefix, capacity=max_len, kv_heads=K, tokens=tokens)


def generation(batch: int, prefix: int, tokens: int, capacity: int) -> list[dict]:
    """One generation of ``tokens`` one-token steps after ``prefix`` cached tokens, each step
    cold (:func:`evictor`), by three contenders: flax_attn with a ``'BKSH'`` cache of
    ``capacity`` slots (allocated for the longest generation), flax_attn with a cache of
    ``prefix`` slots grown by ``cache.reserve(t + 1)`` before each step, and PyTorch eager with
    ``capacity`` slots. Rows: the mean time a step over the generation (for the grown cache
    including its growth; ``growth_s``: the steps that grew the cache, each a copy, a
    compilation of the step at the new size and the step), and the ratio to PyTorch's. The
    last steps' outputs are checked to agree (relative 1e-4)."""
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa

    B, D, N = batch, D_MODEL, HEADS
    H = D // N
    rng = np.random.default_rng(batch * 100003 + prefix)
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, position="rope", rope_theta=THETA))
    x = rng.standard_normal((B, 1, D)).astype(np.float32)
    params = layer.init(jax.random.key(0), jnp.asarray(x), jnp.zeros((B, 1), jnp.int32))
    k0, v0 = (rng.standard_normal((B, N, prefix, H), dtype=np.float32) for _ in range(2))
    evict, xt = evictor(), jnp.asarray(x)
    positions = [jnp.full((B, 1), t, jnp.int32) for t in range(prefix, prefix + tokens)]

    def flax_run(slots: int, grow: bool):
        step = fa.decode_step(layer)
        if not grow:  # compiled at its size, not timed (a grown cache's first step is at a new size: growth)
            jax.block_until_ready(step(params, prefilled(layer, slots, k0, v0), xt, positions[0]))  # consumes it
        cache = prefilled(layer, slots, k0, v0)
        total = growth = 0.0
        for t in range(tokens):
            evict()
            start = time.perf_counter()
            grew = False
            if grow:
                grown = cache.reserve(prefix + t + 1)
                grew, cache = grown is not cache, grown
            out, cache = step(params, cache, xt, positions[t])  # after a growth: compiled at the new size
            out = np.asarray(out)
            took = time.perf_counter() - start
            total += took
            growth += took if grew else 0.0
        step.check()
        return out, total, growth, cache.max_len

    results = {"flax_attn BKSH, allocated": flax_run(capacity, False), "flax_attn BKSH, grown by reserve": flax_run(prefix, True)}
    twin = _torch_twin(params, B, capacity, k0, v0)
    tx, total = torch.from_numpy(x), 0.0
    with torch.inference_mode():
        twin(tx, prefix)  # warm-up, then the same slot written again
        for t in range(tokens):
            evict()
            start = time.perf_counter()
            out = twin(tx, prefix + t).numpy()
            total += time.perf_counter() - start
    results["torch eager"] = (out, total, 0.0, capacity)
    rows, ref = [], results["torch eager"][0]
    for name, (got, seconds, growth, slots) in results.items():
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        if not err <= 1e-4:
            raise AssertionError(f"{name} and torch eager disagree on the last step: relative error {err:.1e}")
        rows.append({"contender": name, "batch": B, "prefix": prefix, "tokens": tokens, "slots_at_end": slots,
                     "ms_per_step": seconds / tokens * 1e3, "growth_s": growth,
                     "ratio_vs_torch": seconds / results["torch eager"][1]})
    return rows


def loop(batch: int, prefix: int, tokens: int, repeats: int) -> list[dict]:
    """A run of ``tokens`` one-token steps after ``prefix`` cached tokens, back to back (caches
    warm), by three contenders in turns: PyTorch eager (a Python loop of steps),
    ``fa.decode_step`` (a Python loop of compiled steps) and ``fa.decode_loop`` (the run as one
    compiled program). Every step takes the same token ``x`` (no sampling: the same work for
    all three). Each run starts from the same ``prefix`` cached tokens (the flax_attn caches
    rebuilt before it, outside its time; PyTorch's slots overwritten); the last outputs are
    checked to agree (relative 1e-4). Rows: ms a token and the ratio to PyTorch's."""
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa

    B, D, N = batch, D_MODEL, HEADS
    H, slots = D // N, prefix + tokens
    rng = np.random.default_rng(batch * 100003 + prefix)
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, position="rope", rope_theta=THETA))
    x = rng.standard_normal((B, 1, D)).astype(np.float32)
    params = layer.init(jax.random.key(0), jnp.asarray(x), jnp.zeros((B, 1), jnp.int32))
    k0, v0 = (rng.standard_normal((B, N, prefix, H), dtype=np.float32) for _ in range(2))
    xt, first = jnp.asarray(x), jnp.full((B, 1), prefix, jnp.int32)
    step, run_loop = fa.decode_step(layer), fa.decode_loop(layer, lambda out: (xt, out))
    caches = {}

    def fresh():
        caches.update(step=prefilled(layer, slots, k0, v0), loop=prefilled(layer, slots, k0, v0))
        jax.block_until_ready(caches)

    def by_steps():
        cache, out = caches.pop("step"), None
        for t in range(tokens):
            out, cache = step(params, cache, xt, first + t)
        return np.asarray(out)

    def as_one_program():
        outs, _ = run_loop(params, caches.pop("loop"), xt, first, tokens)
        return np.asarray(outs[-1])

    twin = _torch_twin(params, B, slots, k0, v0)
    tx = torch.from_numpy(x)

    def eager():
        with torch.inference_mode():
            for t in range(tokens):
                out = twin(tx, prefix + t)
        return out.numpy()

    runs = {"torch eager": eager, "flax_attn decode_step": by_steps, "flax_attn decode_loop": as_one_program}
    ref = eager()
    for name, fn in runs.items():
        fresh()
        err = float(np.max(np.abs(fn() - ref)) / np.max(np.abs(ref)))
        if not err <= 1e-4:
            raise AssertionError(f"{name} and torch eager disagree on the last step: relative error {err:.1e}")
    times = time_in_turns(runs, repeats, warmup=0, before=fresh)  # compiled and warmed by the check above
    return [{"contender": name, "batch": B, "prefix": prefix, "tokens": tokens, "ms_per_token": t / tokens * 1e3,
             "ratio_vs_torch": t / times["torch eager"]} for name, t in times.items()]


def _torch_twin(params, batch: int, slots: int, k0, v0):
    """:func:`_torch_layer_class`'s layer with ``params``' projections and ``k0``, ``v0`` ``(B, K,
    prefix, H)`` in its cache's first slots."""
    import torch

    twin = _torch_layer_class()(D_MODEL, HEADS, batch, slots)
    prefix = k0.shape[2]
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(twin, name).weight.copy_(torch.from_numpy(np.asarray(params["params"][name]["kernel"]).T.copy()))
        twin.k_cache[:, :, :prefix] = torch.from_numpy(k0)
        twin.v_cache[:, :, :prefix] = torch.from_numpy(v0)
    return twin


def run(repeats: int = 20, batches=BATCHES, prefixes=PREFIXES, sparse=SPARSE, grouped=GROUPED,
        chunks=CHUNKS, cold: bool = True) -> list[dict]:
    """Every (batch, prefix) cell, each contender timed in turns, then the ``sparse`` (prefix,
    capacity) cells: a cache allocated for more tokens than it holds, then the ``grouped``
    (prefix, key/value heads) cells, then the ``chunks`` (prefix, capacity, tokens a step)
    cells; rows of dicts (see :func:`report`)."""
    cells = ([(p, 0, HEADS, 1) for p in prefixes] + [(p, c, HEADS, 1) for p, c in sparse]
             + [(p, 0, k, 1) for p, k in grouped] + [(p, c, HEADS, t) for p, c, t in chunks])
    return [row for prefix, capacity, kv_heads, tokens in cells for batch in batches
            for row in cell(batch, prefix, repeats, capacity, kv_heads, tokens, cold)]


def machine() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu": cpu.kind(), "cores": os.cpu_count(), "load_1_5_15": [round(v, 2) for v in load],
            "environment": cpu.environment()}


TITLE = f"KV-cache decode step, d_model {D_MODEL}, {HEADS} heads, RoPE, float32"


def report(rows: list[dict], title: str = TITLE) -> str:
    """A Markdown table of :func:`run`'s rows (or :func:`benchmarks.decode_mla.cell`'s): time per
    step and per token, memory floor, GB/s, ratio to the faster PyTorch eager row of the cell
    (below 1.0: faster than PyTorch), under ``title`` and the machine."""
    m = machine()
    lines = [f"{title}; CPU {m['cpu']} ({m['cores']} cores, shared: load {m['load_1_5_15']}); {timing(rows)}", "",
             "| batch | prefix | cache slots | kv heads | tokens/step | contender | ms/step | ms/token | floor MB/step | GB/s | vs torch |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['capacity']} | {r['kv_heads']} | {r.get('tokens', 1)} | {r['contender']} | "
                     f"{r['ms_per_step']:.3f} | "
                     f"{r['ms_per_token']:.3f} | {r['floor_bytes_per_step'] / 1e6:.1f} | {r['gb_per_s']:.1f} | "
                     f"{r['ratio_vs_torch']:.2f}x |")
    return "\n".join(lines)


def loop_table(rows: list[dict]) -> str:
    """The Markdown table of ``--loop``'s rows: ms a token and the ratio to PyTorch eager."""
    lines = ["| batch | contender | ms/token | vs torch |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['contender']} | {r['ms_per_token']:.3f} | {r['ratio_vs_torch']:.2f}x |" for r in rows]
    return "\n".join(lines)


def generation_table(rows: list[dict]) -> str:
    """The Markdown table of ``--generation``'s rows: slots at the end, ms a step, the time spent
    growing the cache and the ratio to PyTorch eager."""
    lines = ["| batch | contender | slots at the end | ms/step | of which growth | vs torch |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['contender']} | {r['slots_at_end']:,} | {r['ms_per_step']:.3f} | "
              f"{r['growth_s']:.2f} s | {r['ratio_vs_torch']:.2f}x |" for r in rows]
    return "\n".join(lines)


def timing(rows: list[dict]) -> str:
    """How the rows' steps were timed, in words."""
    mib = {r.get("evicted_mib", 0) for r in rows}
    if mib == {0}:
        return f"rounds of {STEPS} steps, caches warm"
    return f"each step cold ({', '.join(f'{m:g}' for m in sorted(mib))} MiB read before it)"


def write(out: Path, rows: list[dict], repeats: int) -> None:
    """A result file: the machine, the rounds and the rows."""
    cold = any(r.get("evicted_mib", 0) for r in rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "repeats": repeats, "steps_per_round": 1 if cold else STEPS,
                               "rounds": repeats * STEPS if cold else repeats, "timing": timing(rows),
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="prefix 1024 only, 8 rounds")
    parser.add_argument("--generation", action="store_true",
                        help="whole generations of 1,024 tokens after 1,024, cache allocated for 8,192 or grown by reserve")
    parser.add_argument("--compilation-cache", type=Path, default=None, metavar="DIR",
                        help="with --generation: JAX's persistent compilation cache in DIR (every compilation kept); "
                             "a second run finds the grown sizes' steps compiled")
    parser.add_argument("--loop", action="store_true",
                        help="runs of 64 steps after 1,024 tokens, warm: PyTorch eager, decode_step, decode_loop (loop())")
    parser.add_argument("--warm", action="store_true",
                        help="rounds of STEPS steps back to back, the caches warm (default: each step cold)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.compilation_cache is not None and not args.generation:
        parser.error("--compilation-cache goes with --generation")
    if args.loop:
        rows = [row for b in BATCHES for row in loop(b, 1024, 64, args.repeats)]
        print(f"Runs of 64 one-token steps after 1,024 tokens, caches warm, {args.repeats} rounds in turns; "
              f"CPU {machine()['cpu']}\n")
        print(loop_table(rows))
        out = args.out or Path(__file__).parent / "results" / f"decode-loop-{cpu.slug()}.json"
        out.write_text(json.dumps({"machine": machine(), "repeats": args.repeats, "rows": rows}, indent=1) + "\n")
        print(f"wrote {out}")
        return
    if args.generation:
        suffix = ""
        if args.compilation_cache is not None:
            import jax

            jax.config.update("jax_compilation_cache_dir", str(args.compilation_cache))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
            suffix = "-compilation-cache"
        rows = [row for b in BATCHES for row in generation(b, 1024, 1024, 8192)]
        print(f"Generation of 1,024 tokens after 1,024, each step cold; CPU {machine()['cpu']}"
              + (f"; JAX's compilation cache in {args.compilation_cache}" if suffix else "") + "\n")
        print(generation_table(rows))
        out = args.out or Path(__file__).parent / "results" / f"decode-generation-{cpu.slug()}{suffix}.json"
        out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
        print(f"wrote {out}")
        return
    prefixes = (1024,) if args.quick else PREFIXES
    repeats = 8 if args.quick else args.repeats
    rows = run(repeats, prefixes=prefixes, sparse=() if args.quick else SPARSE, grouped=() if args.quick else GROUPED,
               chunks=() if args.quick else CHUNKS, cold=not args.warm)
    print(report(rows))
    write(args.out or Path(__file__).parent / "results" / f"decode-{cpu.slug()}.json", rows, repeats)


if __name__ == "__main__":
    main()
