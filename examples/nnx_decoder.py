"""A tiny character decoder of flax_attn's NNX layers (flax_attn.nnx): a few optax steps with
nnx.Optimizer, then generation with the KV cache, checked against recomputing the whole prefix.

Layers: fa.nnx.Attention (grouped-query: 4 query heads sharing 2 key/value heads, RoPE, a
sliding window of 16 keys, QK-norm, dropout 0.1 while training), pre-norm residual blocks with
an MLP, all NNX. The attention's cache goes in and comes back out of each call (flax_attn's
KVCache), so the jitted decoding step compiles once. Finally the weights go to Linen
(fa.nnx.to_linen) and the Linen layer gives the same numbers.

    python examples/nnx_decoder.py          # about half a minute on a 2-core CPU
"""
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flax_attn as fa
import flax_attn.nnx as fnnx

TEXT = ("Your journey starts with one step. Hello shiny sun. Attention lets every token look at the "
        "tokens before it. Queries meet keys, and values flow to the query. ") * 8
VOCAB = sorted(set(TEXT))
encode = lambda s: np.array([VOCAB.index(c) for c in s], np.int32)
decode = lambda ids: "".join(VOCAB[int(i)] for i in ids)

ATTENTION = fa.AttentionConfig(d_model=48, num_heads=4, num_kv_heads=2, position="rope", sliding_window=16,
                               qk_norm=True, dropout=0.1)
LAYERS, CONTEXT, STEPS = 2, 48, 150


class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        D = ATTENTION.d_model
        self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
        self.attention = fnnx.Attention(ATTENTION, rngs=rngs)
        self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x, positions, cache=None):
        h = self.attention(self.norm1(x), positions, cache=cache)  # (B, T, D), or (out, new cache)
        h, cache = h if cache is not None else (h, None)
        x = x + h
        return x + self.down(nnx.gelu(self.up(self.norm2(x)))), cache


class TinyDecoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(len(VOCAB), ATTENTION.d_model, rngs=rngs)
        for i in range(LAYERS):
            setattr(self, f"block_{i}", Block(rngs=rngs))
        self.norm = nnx.RMSNorm(ATTENTION.d_model, rngs=rngs)
        self.head = nnx.Linear(ATTENTION.d_model, len(VOCAB), rngs=rngs)

    def __call__(self, tokens, positions, caches=None):
        """tokens, positions: int (B, T); caches: one KVCache per layer or None."""
        x, new_caches = self.embed(tokens), []
        for i in range(LAYERS):
            x, cache = getattr(self, f"block_{i}")(x, positions, None if caches is None else caches[i])
            new_caches.append(cache)
        logits = self.head(self.norm(x))
        return logits if caches is None else (logits, new_caches)


model = TinyDecoder(rngs=nnx.Rngs(0, dropout=1))
optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
data = encode(TEXT)
positions = jnp.arange(CONTEXT)[None]


@nnx.jit
def train_step(model, optimizer, batch):
    def loss_fn(model):
        logits = model(batch[:, :-1], positions)  # dropout on: the attention layers draw their keys
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


model.train()  # deterministic=False in every layer with dropout
rng = np.random.default_rng(0)
start = time.perf_counter()
for step in range(STEPS):
    idx = rng.integers(0, len(data) - CONTEXT - 1, size=16)
    loss = train_step(model, optimizer, jnp.asarray(np.stack([data[i:i + CONTEXT + 1] for i in idx])))
    if step % 50 == 0 or step == STEPS - 1:
        print(f"step {step:3d}  loss {float(loss):.3f}")
print(f"trained in {time.perf_counter() - start:.1f} s")
model.eval()  # deterministic=True: no dropout while generating

prompt = encode("Hello shiny")
new_tokens = CONTEXT - len(prompt)
full_forward = nnx.jit(lambda m, tokens: m(tokens, positions))


def generate_uncached(prompt):
    """Recompute the whole prefix for each token (padded to CONTEXT: one compilation)."""
    tokens, all_logits = list(prompt), []
    for _ in range(new_tokens):
        logits = full_forward(model, jnp.asarray(tokens + [0] * (CONTEXT - len(tokens)))[None])[0, len(tokens) - 1]
        all_logits.append(logits)
        tokens.append(int(jnp.argmax(logits)))
    return tokens, jnp.stack(all_logits)


@nnx.jit
def decode_step(model, caches, token, position):
    logits, caches = model(token, position, caches)
    return logits[:, -1], caches


def generate_cached(prompt):
    """Prefill the prompt once, then one token per step against the caches."""
    caches = [ATTENTION.init_cache(batch=1, max_len=CONTEXT) for _ in range(LAYERS)]
    logits, caches = model(jnp.asarray(prompt)[None], jnp.arange(len(prompt))[None], caches)
    logits, tokens, all_logits = logits[:, -1], list(prompt), []
    for t in range(len(prompt), CONTEXT):
        all_logits.append(logits[0])
        tokens.append(int(jnp.argmax(logits[0])))
        if t + 1 < CONTEXT:
            logits, caches = decode_step(model, caches, jnp.asarray([[tokens[-1]]]), jnp.asarray([[t]]))
    return tokens, jnp.stack(all_logits)


uncached, logits_u = generate_uncached(prompt)
cached, logits_c = generate_cached(prompt)
print(f"\nuncached: {decode(uncached)!r}")
print(f"cached:   {decode(cached)!r}")
diff = float(jnp.max(jnp.abs(logits_u - logits_c)) / jnp.max(jnp.abs(logits_u)))
print(f"\nsame tokens: {uncached == cached};  max relative logit difference: {diff:.1e} (float32)")

# The same weights in the Linen layer: identical parameter names, identical numbers.
layer = model.block_0.attention
x = model.block_0.norm1(model.embed(jnp.asarray(prompt)[None]))
p = jnp.arange(len(prompt))[None]
linen_out = fnnx.linen_twin(layer).apply(fnnx.to_linen(layer), x, p, deterministic=True)
print(f"Linen twin of block_0.attention equals it: {bool(jnp.array_equal(linen_out, layer(x, p)))}")
if uncached != cached or diff > 1e-5 or not jnp.array_equal(linen_out, layer(x, p)):
    raise SystemExit("cached and uncached generation (or the Linen twin) disagree")
