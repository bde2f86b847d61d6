"""Greedy generation from a small decoder of ``fa.Attention`` layers, with the KV cache and
without it: tokens per second for each, and the check that both produce the same tokens.

The decoder (random weights, byte-level vocabulary; nothing is downloaded): 4 pre-norm blocks
of grouped-query attention (8 query heads sharing 2 key/value heads, RoPE) and a GELU MLP.

* **without the cache**: every new token recomputes the whole sequence, padded to a fixed
  length so that one compilation serves every step (causal attention makes the padding after
  the current token irrelevant to it);
* **with the cache**: :func:`flax_attn.decode_step` jits the model's cached call once per
  shape (prompt, then one token) and donates the caches, so each step writes its keys into
  them in place and attends over them;
* **with the cache, one program**: :func:`flax_attn.decode_loop` runs every step after the
  prompt in one compiled ``lax.scan``, the greedy token chosen on the device, so the host
  dispatches once per generation instead of once per token.

    python examples/generate.py [--tokens 64] [--layout BKSH|BSKH|blocks] [--grow]

``--layout`` picks the caches' layout (:class:`flax_attn.KVCache`; ``'blocks'``, block-major,
for a cache allocated much larger than its fill): the tokens are the same in every layout.
``--grow`` starts the caches at the prompt's size and grows them as tokens arrive
(``cache.reserve(t + 1)`` before each step: a copy and one compilation of the step per new
size) instead of allocating the longest generation's slots up front.
"""
import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import flax_attn as fa

ATTENTION = fa.AttentionConfig(d_model=256, num_heads=8, num_kv_heads=2, position="rope")
LAYERS, VOCAB, CONTEXT = 4, 256, 128


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, positions, cache=None):
        attention = fa.Attention(ATTENTION)
        h = nn.RMSNorm()(x)
        if cache is None:
            h = attention(h, positions)
        else:
            h, cache = attention(h, positions, cache=cache)
        x = x + h
        h = nn.Dense(4 * ATTENTION.d_model)(nn.RMSNorm()(x))
        return x + nn.Dense(ATTENTION.d_model)(nn.gelu(h)), cache


class Decoder(nn.Module):
    """``tokens`` int ``(B, T)``, ``positions`` int ``(B, T)``; ``cache``: one KVCache per layer
    or None. Returns logits ``(B, T, VOCAB)`` (and the new caches when given caches)."""

    @nn.compact
    def __call__(self, tokens, positions, cache=None):
        x = nn.Embed(VOCAB, ATTENTION.d_model)(tokens)
        new = []
        for i in range(LAYERS):
            x, c = Block()(x, positions, None if cache is None else cache[i])
            new.append(c)
        logits = nn.Dense(VOCAB)(nn.RMSNorm()(x))
        return logits if cache is None else (logits, new)


def generate_uncached(full, params, prompt, n):
    """``full``: the jitted model over CONTEXT tokens."""
    tokens = list(prompt)
    for _ in range(n):
        padded = jnp.asarray(tokens + [0] * (CONTEXT - len(tokens)))[None]
        tokens.append(int(jnp.argmax(full(params, padded)[0, len(tokens) - 1])))
    return tokens[len(prompt):]


def generate_cached(step, params, prompt, n, layout="BKSH", grow=False):
    """``step``: ``fa.decode_step(model)``; the caches it is given are donated (consumed).
    ``grow``: caches of the prompt's size (whole blocks), grown by ``reserve`` as tokens arrive."""
    layer = fa.Attention(ATTENTION)
    slots = -(-len(prompt) // fa.layers.cache.BLOCK) * fa.layers.cache.BLOCK if layout == "blocks" else len(prompt)
    caches = [layer.init_cache(batch=1, max_len=slots if grow else CONTEXT, layout=layout) for _ in range(LAYERS)]
    logits, caches = step(params, caches, jnp.asarray(prompt)[None], jnp.arange(len(prompt))[None])
    tokens = [int(jnp.argmax(logits[0, -1]))]
    for t in range(len(prompt), len(prompt) + n - 1):
        if grow:
            caches = [cache.reserve(t + 1) for cache in caches]
        logits, caches = step(params, caches, jnp.asarray([[tokens[-1]]]), jnp.asarray([[t]]))
        tokens.append(int(jnp.argmax(logits[0, -1])))
    step.check()  # the last steps' run-time checks (each step's are read a few calls later)
    return tokens


def greedy(logits):
    """The next input and the emitted token: the most likely token, ``(B, 1)``."""
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    return token, token[:, 0]


def generate_loop(step, loop, params, prompt, n):
    """The prompt through ``step`` (``fa.decode_step``), then ``n - 1`` tokens in one program
    (``loop``: ``fa.decode_loop(model, greedy)``)."""
    layer = fa.Attention(ATTENTION)
    caches = [layer.init_cache(batch=1, max_len=CONTEXT) for _ in range(LAYERS)]
    logits, caches = step(params, caches, jnp.asarray(prompt)[None], jnp.arange(len(prompt))[None])
    first, _ = greedy(logits)
    tokens, caches = loop(params, caches, first, jnp.full((1, 1), len(prompt), jnp.int32), n - 1)
    return [int(first[0, 0])] + [int(t) for t in np.asarray(tokens)[:, 0]]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return jax.devices()[0].device_kind


def timed(fn, *args):
    fn(*args)  # compiles
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main(argv=None):
    parser = argparse.ArgumentParser(description="cached vs uncached greedy generation")
    parser.add_argument("--tokens", type=int, default=64, help="tokens to generate")
    parser.add_argument("--layout", choices=("BKSH", "BSKH", "blocks"), default="BKSH", help="the caches' layout")
    parser.add_argument("--grow", action="store_true", help="caches of the prompt's size, grown as tokens arrive")
    args = parser.parse_args(argv)
    prompt = list("Attention is all you need. ".encode())
    n = min(args.tokens, CONTEXT - len(prompt))
    model = Decoder()
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), jnp.arange(8)[None])
    full = jax.jit(lambda p, tokens: model.apply(p, tokens, jnp.arange(CONTEXT)[None]))
    step = fa.decode_step(model)  # compiles once per shape: the prompt's, then one token's
    uncached, t_u = timed(generate_uncached, full, params, prompt, n)
    cached, t_c = timed(generate_cached, step, params, prompt, n, args.layout, args.grow)
    looped, t_l = timed(generate_loop, step, fa.decode_loop(model, greedy), params, prompt, n)
    print(f"{LAYERS} layers, d_model {ATTENTION.d_model}, prompt {len(prompt)} tokens, {n} generated "
          f"({jax.default_backend()}: {cpu_model()})")
    print(f"without cache: {n / t_u:8.1f} tokens/s")
    print(f"with cache:    {n / t_c:8.1f} tokens/s   ({t_u / t_c:.1f}x)")
    print(f"with cache, one program: {n / t_l:8.1f} tokens/s   ({t_u / t_l:.1f}x)")
    print(f"same tokens: {cached == uncached == looped}")
    for name, tokens in (("cached", cached), ("one-program", looped)):
        if tokens != uncached:
            first = next(i for i, (a, b) in enumerate(zip(tokens, uncached)) if a != b)
            raise SystemExit(f"{name} and uncached generation disagree from token {first}")


if __name__ == "__main__":
    main()
