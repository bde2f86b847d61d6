"""Train a small character-level decoder built from flax_attn layers on Pride and Prejudice.

    python examples/train_decoder.py                     # 400 steps, at most 3 minutes on 2 CPU cores
    python examples/train_decoder.py --steps 2000 --seed 1 --out /tmp/run
    python examples/train_decoder.py --quick             # a few steps; checks that the loss falls

The model: character embeddings; blocks of pre-norm residual ``fa.Attention`` (RoPE,
grouped-query: 4 query heads sharing 2 key/value heads, causal) and a GELU MLP, with RMSNorm;
the output layer tied to the embeddings (``--untied`` for a separate one). optax AdamW with
warm-up, cosine decay and gradient clipping. Data: chapters 1-15 of the novel (public domain,
see ``examples/data/README.md``), the last 10% held out.

It prints the final training and held-out loss (cross-entropy, nats per character) next to the
unigram baseline -- the entropy of the training text's character distribution, what a model
that ignores context can reach -- writes the loss curve to ``OUT/train_decoder_loss.png`` and
prints a sample. Given ``--seed`` it is deterministic: the same losses and sample every run on
the same machine and software.
"""
import argparse
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import flax_attn as fa

HERE = pathlib.Path(__file__).resolve().parent
TEXT_FILE = HERE / "data" / "pride_and_prejudice_1-15.txt"

CONTEXT = 64  # characters per training sequence
BATCH = 64
WIDTH = 128
LAYERS = 3
ATTENTION = fa.AttentionConfig(d_model=WIDTH, num_heads=4, num_kv_heads=2, position="rope",
                               rope_layout="rotate_half", causal=True)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, positions):
        x = x + fa.Attention(ATTENTION)(nn.RMSNorm()(x), positions)
        h = nn.gelu(nn.Dense(4 * WIDTH)(nn.RMSNorm()(x)))
        return x + nn.Dense(WIDTH)(h)


class Decoder(nn.Module):
    vocab: int
    tied: bool = True  # the output layer is the embedding matrix transposed

    @nn.compact
    def __call__(self, tokens, positions):
        embed = nn.Embed(self.vocab, WIDTH, embedding_init=nn.initializers.normal(0.02))
        x = embed(tokens)
        for _ in range(LAYERS):
            x = Block()(x, positions)
        x = nn.RMSNorm()(x)
        return embed.attend(x) if self.tied else nn.Dense(self.vocab, use_bias=False)(x)


def unigram_entropy(ids: np.ndarray, vocab: int) -> float:
    """Entropy (nats) of the character distribution of ``ids``."""
    p = np.bincount(ids, minlength=vocab) / len(ids)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def cross_entropy_against(ids: np.ndarray, reference: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats) of ``ids`` under the unigram distribution of ``reference``, add-one smoothed."""
    p = (np.bincount(reference, minlength=vocab) + 1) / (len(reference) + vocab)
    return float(-np.log(p[ids]).mean())


def windows(ids: np.ndarray, count: int) -> np.ndarray:
    """``count`` evenly spaced windows of CONTEXT + 1 characters (inputs and next-character targets)."""
    starts = np.linspace(0, len(ids) - CONTEXT - 1, count).astype(int)
    return np.stack([ids[s:s + CONTEXT + 1] for s in starts])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 400; 30 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="initialisation, batches and sampling")
    parser.add_argument("--out", default=str(HERE / "figures"), help="directory for the loss curve PNG")
    parser.add_argument("--untied", action="store_true", help="a separate output layer instead of the embeddings")
    parser.add_argument("--quick", action="store_true", help="a few steps; exit 1 unless the loss went down")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (30 if args.quick else 400)
    if steps < 1:
        parser.error(f"--steps must be at least 1, got {steps}")

    text = TEXT_FILE.read_text(encoding="utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    ids = np.array([index[c] for c in text], np.int32)
    split = int(0.9 * len(ids))
    train, held_out = ids[:split], ids[split:]
    vocab = len(chars)
    baseline = unigram_entropy(train, vocab)
    baseline_held_out = cross_entropy_against(held_out, train, vocab)

    model = Decoder(vocab, tied=not args.untied)
    positions = jnp.arange(CONTEXT)[None]
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, CONTEXT), jnp.int32), positions)
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=max(1, min(50, steps // 10)),
                                                  decay_steps=steps, end_value=3e-4)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.05))
    opt_state = optimizer.init(params)

    def loss_fn(p, batch):
        logits = model.apply(p, batch[:, :-1], positions)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @fa.jit  # jax.jit with this CPU's XLA compile options (flax_attn.core.tuning.cpu_compiler_options)
    def train_step(p, state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    evaluate = fa.jit(loss_fn)
    # Evaluation: evenly spaced windows, as many as fit side by side in the held-out text (whole
    # batches; 192 windows, 98% of it), the same number from the training text; 16 with --quick.
    eval_count = 16 if args.quick else (len(held_out) - 1) // CONTEXT // BATCH * BATCH
    eval_train, eval_held_out = windows(train, eval_count), windows(held_out, eval_count)

    def mean_loss(p, batches):
        return float(np.mean([evaluate(p, batches[i:i + BATCH]) for i in range(0, len(batches), BATCH)]))

    print(f"{len(text):,} characters ({vocab} distinct): {len(train):,} for training, {len(held_out):,} held out; "
          f"model of {n_params:,} parameters ({LAYERS} blocks, width {WIDTH}, "
          f"{ATTENTION.num_heads} query / {ATTENTION.kv_heads} key-value heads, "
          f"{'tied' if not args.untied else 'untied'} output); {steps} steps of {BATCH} x {CONTEXT} characters")
    def sample_batch(rng):
        starts = rng.integers(0, len(train) - CONTEXT - 1, size=BATCH)
        return np.stack([train[s:s + CONTEXT + 1] for s in starts])

    rng = np.random.default_rng(args.seed)
    history, evals = [], []
    first_eval = mean_loss(params, eval_train)
    evals.append((0, first_eval, mean_loss(params, eval_held_out)))
    start = time.perf_counter()
    every = max(1, steps // (3 if args.quick else 10))
    for step in range(1, steps + 1):
        params, opt_state, loss = train_step(params, opt_state, sample_batch(rng))
        history.append(float(loss))
        if step % every == 0 or step == steps:
            evals.append((step, mean_loss(params, eval_train), mean_loss(params, eval_held_out)))
            print(f"step {step:5d}  batch loss {history[-1]:.4f}  held-out {evals[-1][2]:.4f}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    elapsed = time.perf_counter() - start
    _, final_train, final_held_out = evals[-1]

    print(f"\ntrained {steps} steps in {elapsed:.1f} s ({elapsed / steps * 1e3:.0f} ms per step)")
    print(f"final training loss  {final_train:.4f} nats per character")
    print(f"final held-out loss  {final_held_out:.4f} nats per character")
    print(f"unigram baseline     {baseline:.4f} nats per character (entropy of the training characters; "
          f"held-out cross-entropy under it: {baseline_held_out:.4f})")
    print(f"held-out loss / baseline: {final_held_out / baseline:.2f}")

    sample = generate(model, params, held_out[:CONTEXT], 240 if not args.quick else 20, args.seed)
    print("\nsample (prompt: the first held-out characters):\n" + "".join(chars[i] for i in held_out[:CONTEXT])
          + "[" + "".join(chars[i] for i in sample) + "]")

    plot_losses(pathlib.Path(args.out), history, evals, baseline, steps)
    if args.quick and not final_train < first_eval - 0.5:
        print(f"FAILED: the training loss went from {first_eval:.4f} to {final_train:.4f}: not down by 0.5")
        return 1
    if args.quick:
        # Deterministic given the seed: the first steps again, from a new initialisation and a new
        # batch generator with the same seed, give the same batch losses bit for bit.
        p = model.init(jax.random.key(args.seed), jnp.zeros((1, CONTEXT), jnp.int32), positions)
        state, again, repeat_rng = optimizer.init(p), [], np.random.default_rng(args.seed)
        repeat = min(3, steps)
        for _ in range(repeat):
            p, state, loss = train_step(p, state, sample_batch(repeat_rng))
            again.append(float(loss))
        if again != history[:repeat]:
            print(f"FAILED: the first {repeat} steps from seed {args.seed} again gave other losses: "
                  f"{again} != {history[:repeat]}")
            return 1
        print(f"repeat from the seed: the first {repeat} batch losses are identical")
        print(f"quick check passed: training loss {first_eval:.4f} -> {final_train:.4f}")
    return 0


def generate(model, params, prompt: np.ndarray, count: int, seed: int) -> list[int]:
    """Sample ``count`` characters (temperature 0.8) after ``prompt`` (CONTEXT characters), a sliding window."""
    positions = jnp.arange(CONTEXT)[None]

    @jax.jit
    def next_token(window, key):
        logits = model.apply(params, window[None], positions)[0, -1]
        return jax.random.categorical(key, logits / 0.8)

    window, out = jnp.asarray(prompt, jnp.int32), []
    keys = jax.random.split(jax.random.key(seed + 1), count)
    for key in keys:
        token = next_token(window, key)
        out.append(int(token))
        window = jnp.concatenate([window[1:], token[None].astype(jnp.int32)])
    return out


def plot_losses(out: pathlib.Path, history, evals, baseline: float, steps: int) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no loss curve (pip install 'flax-attn[plot]')")
        return
    out.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.subplots()
    ax.plot(np.arange(1, len(history) + 1), history, color="0.75", lw=0.8, label="training batch")
    e_steps, e_train, e_held = zip(*evals)
    ax.plot(e_steps, e_train, "o-", color="tab:blue", ms=3, label="training (fixed windows)")
    ax.plot(e_steps, e_held, "o-", color="tab:orange", ms=3, label="held out")
    ax.axhline(baseline, color="tab:red", ls="--", lw=1, label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_xlim(0, steps)
    ax.set_ylim(0, max(history[0], e_held[0]) * 1.05)
    ax.set_title(f"Character decoder on Pride and Prejudice: held-out {e_held[-1]:.2f} nats")
    ax.legend()
    ax.grid(alpha=0.3)
    path = out / "train_decoder_loss.png"
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
