"""User-defined attention in flax_attn: mask_mod, score_mod, attention sinks, chunked attention.

    python examples/flex_attention.py

Each feature is computed two ways (as a user function and as the built-in rule) and the two
are checked equal, outputs and gradients; the script exits non-zero if any check fails.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

import flax_attn as fa
from flax_attn.core import mask as masks

B, T, N, K, H = 2, 64, 4, 2, 16
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32)
failures = []


def check(what, a, b, tol=1e-5):
    err = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    print(f"{what:58s} max relative difference {err:.1e}")
    if not err <= tol:
        failures.append(what)


# 1. Packed documents, causal: a mask_mod (written for scalars, evaluated block by block)
#    combined with a built-in rule by '&'. It equals the built-in segment ids.
docs = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], 16, axis=1), jnp.int32)   # (B, T)
document = masks.mask_mod(lambda b, n, q_idx, k_idx: docs[b, q_idx] == docs[b, k_idx])
out = fa.dot_product_attention(q, k, v, mask=document & masks.causal())
check("mask_mod documents & causal == segment ids",
      out, fa.dot_product_attention(q, k, v, is_causal=True, query_segment_ids=docs, key_segment_ids=docs))

# 2. A learned relative-position table through score_mod: gradients reach the table.
table = jnp.asarray(rng.standard_normal((2 * T, N)) * 0.1, jnp.float32)


def with_score_mod(table):
    mod = lambda score, b, n, q_idx, k_idx: score + table[q_idx - k_idx + T, n]
    return fa.dot_product_attention(q, k, v, is_causal=True, score_mod=mod)


def with_bias(table):
    p = jnp.arange(T)
    bias = jnp.moveaxis(table[p[:, None] - p[None, :] + T], -1, 0)      # (N, T, T), materialised
    return fa.dot_product_attention(q, k, v, bias, is_causal=True)


check("score_mod table == the same table as a dense bias", with_score_mod(table), with_bias(table))
loss = lambda f: (lambda t: jnp.sum(f(t) ** 2))
check("  gradient w.r.t. the table", jax.grad(loss(with_score_mod))(table), jax.grad(loss(with_bias))(table))

# 3. Attention sinks (gpt-oss): one learned logit per head in every softmax denominator. The
#    reference concatenates the sink to each row of scores, takes the softmax and drops it.
sinks = jnp.asarray([0.0, 1.0, 2.0, 4.0], jnp.float32)
out, lse = fa.dot_product_attention(q, k, v, is_causal=True, sinks=sinks, return_residual=True)
kk, vv = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
scores = jnp.einsum("btnh,bsnh->bnts", q, kk, precision="highest") / np.sqrt(H)
scores = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf)
column = jnp.broadcast_to(sinks[None, :, None, None], (B, N, T, 1))
weights = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
check("sinks == softmax with the sink as an extra column", out,
      jnp.einsum("bnts,bsnh->btnh", weights, vv, precision="highest"))
print("  weight left to the keys, per head (mean over queries):", np.round(np.asarray(weights.sum(-1).mean((0, 2))), 3))

# 4. Llama 4's chunked attention: causal within chunks of 16 positions; blocks of keys in other
#    chunks are skipped on the blockwise path.
chunked = fa.dot_product_attention(q, k, v, mask=masks.causal() & masks.chunked(16))
same = fa.dot_product_attention(q, k, v, mask=masks.mask_mod(lambda b, n, qi, ki: (qi // 16 == ki // 16) & (ki <= qi)))
check("chunked(16) & causal == the same rule as a mask_mod", chunked, same)

if failures:
    print("FAILED:", ", ".join(failures))
    sys.exit(1)
print("all checks passed.")
