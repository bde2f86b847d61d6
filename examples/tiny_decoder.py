"""A tiny character-level decoder from flax_attn layers, trained for a few seconds, then
generating text with the KV cache and without it; the two must agree.

Layers: grouped-query attention (8 query heads sharing 2 key/value heads), RoPE, a sliding
window of 32 keys, QK-norm; pre-norm residual blocks with an MLP. Data: a few sentences
built into this file.

    python examples/tiny_decoder.py
"""
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flax_attn as fa

TEXT = (
    "Your journey starts with one step. Hello shiny sun. Attention lets every token look at the "
    "tokens before it. Queries meet keys, and values flow to the query. "
) * 8
VOCAB = sorted(set(TEXT))
encode = lambda s: np.array([VOCAB.index(c) for c in s], np.int32)
decode = lambda ids: "".join(VOCAB[int(i)] for i in ids)

ATTENTION = fa.AttentionConfig(d_model=64, num_heads=8, num_kv_heads=2, position="rope", sliding_window=32,
                               qk_norm=True)
LAYERS, CONTEXT = 2, 64


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, positions, cache=None):
        h = nn.RMSNorm()(x)
        if cache is None:
            h = fa.Attention(ATTENTION)(h, positions)
        else:
            h, cache = fa.Attention(ATTENTION)(h, positions, cache=cache)
        x = x + h
        h = nn.Dense(4 * ATTENTION.d_model)(nn.RMSNorm()(x))
        return x + nn.Dense(ATTENTION.d_model)(nn.gelu(h)), cache


class TinyDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens, positions, caches=None):
        x = nn.Embed(len(VOCAB), ATTENTION.d_model)(tokens)
        new_caches = []
        for i in range(LAYERS):
            x, cache = Block()(x, positions, None if caches is None else caches[i])
            new_caches.append(cache)
        logits = nn.Dense(len(VOCAB))(nn.RMSNorm()(x))
        return logits if caches is None else (logits, new_caches)


model = TinyDecoder()
data = encode(TEXT)
positions = jnp.arange(CONTEXT)[None]
params = model.init(jax.random.key(0), jnp.zeros((1, CONTEXT), jnp.int32), positions)
optimizer = optax.adamw(3e-3)
opt_state = optimizer.init(params)


@jax.jit
def train_step(params, opt_state, batch):
    def loss_fn(p):
        logits = model.apply(p, batch[:, :-1], positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


rng = np.random.default_rng(0)
start = time.perf_counter()
for step in range(300):
    idx = rng.integers(0, len(data) - CONTEXT - 1, size=16)
    batch = jnp.asarray(np.stack([data[i:i + CONTEXT + 1] for i in idx]))
    params, opt_state, loss = train_step(params, opt_state, batch)
    if step % 100 == 0 or step == 299:
        print(f"step {step:3d}  loss {float(loss):.3f}")
print(f"trained in {time.perf_counter() - start:.1f} s")

prompt = encode("Hello shiny")
steps = CONTEXT - len(prompt)


full_forward = jax.jit(lambda params, tokens: model.apply(params, tokens, positions))


def generate_uncached(params, prompt):
    """Recompute the whole prefix for every new token. The sequence is padded to CONTEXT (one
    compilation): causal attention makes the padding after position t irrelevant to t."""
    tokens, all_logits = list(prompt), []
    for _ in range(steps):
        padded = jnp.asarray(tokens + [0] * (CONTEXT - len(tokens)))[None]
        logits = full_forward(params, padded)[0, len(tokens) - 1]
        all_logits.append(logits)
        tokens.append(int(jnp.argmax(logits)))
    return tokens, jnp.stack(all_logits)


@jax.jit
def decode_step(params, caches, token, position):
    logits, caches = model.apply(params, token, position, caches)
    return logits[:, -1], caches


def generate_cached(params, prompt):
    """Prefill the prompt once, then one token per step against the cache."""
    caches = [ATTENTION.init_cache(batch=1, max_len=CONTEXT) for _ in range(LAYERS)]
    logits, caches = model.apply(params, jnp.asarray(prompt)[None], jnp.arange(len(prompt))[None], caches)
    logits = logits[:, -1]
    tokens, all_logits = list(prompt), []
    for t in range(len(prompt), len(prompt) + steps):
        all_logits.append(logits[0])
        tokens.append(int(jnp.argmax(logits[0])))
        if t + 1 < CONTEXT:
            logits, caches = decode_step(params, caches, jnp.asarray([[tokens[-1]]]), jnp.asarray([[t]]))
    return tokens, jnp.stack(all_logits)


uncached, logits_u = generate_uncached(params, prompt)
cached, logits_c = generate_cached(params, prompt)
print(f"\nuncached: {decode(uncached)!r}")
print(f"cached:   {decode(cached)!r}")
diff = float(jnp.max(jnp.abs(logits_u - logits_c)) / jnp.max(jnp.abs(logits_u)))
print(f"\nsame tokens: {uncached == cached};  max relative logit difference: {diff:.1e} (float32)")
if uncached != cached or diff > 1e-5:
    raise SystemExit("cached and uncached generation disagree")
