"""Training: one optimiser, two frameworks. From identical weights and the same batch, AdamW steps
in PyTorch (torch.optim.AdamW) and in optax (optax.adamw) give the same parameters; and the
training example runs, learns and is deterministic.

AdamW's conventions, and how the two libraries' arguments correspond (both implement
Loshchilov & Hutter's decoupled weight decay; at step t, with g the gradient):

    m = b1 m + (1 - b1) g              v = b2 v + (1 - b2) g^2
    m_hat = m / (1 - b1^t)             v_hat = v / (1 - b2^t)
    p = p - lr * wd * p - lr * m_hat / (sqrt(v_hat) + eps)

torch.optim.AdamW(lr, betas=(b1, b2), eps, weight_decay=wd) multiplies p by (1 - lr wd) first,
then takes the Adam step (which does not depend on p): the same. optax.adamw(lr, b1, b2, eps,
eps_root=0, weight_decay=wd) adds wd p to the Adam direction m_hat / (sqrt(v_hat + eps_root) + eps)
and scales the sum by -lr: the same. The defaults differ -- torch weight_decay=1e-2, optax 1e-4 --
and optax's eps_root (inside the square root) has no torch counterpart, so every argument is set
explicitly below. The tests also show that those differences are visible at this tolerance.
"""
import hashlib
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import flax_attn as fa
import torch_ref as tr
from torch_ref.compare import max_rel_error

ROOT = pathlib.Path(__file__).resolve().parents[1]
LR, B1, B2, EPS, WD = 0.05, 0.8, 0.95, 1e-3, 0.3  # large: each term moves the parameters visibly
TOLERANCE = 1e-10

CONFIG = fa.AttentionConfig(d_model=16, num_heads=4, num_kv_heads=2, position="rope", qk_norm=True,
                            qkv_bias=True, out_bias=True)


def _setup():
    layer = fa.Attention(CONFIG, param_dtype=jnp.float64)
    x = jax.random.normal(jax.random.key(1), (2, 5, CONFIG.d_model), jnp.float64)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    variables = layer.init(jax.random.key(0), x, positions)
    twin = tr.twin(layer).double()
    twin.load_state_dict(tr.state_dict_from_numpy(fa.to_torch_state_dict(layer, variables)), strict=True)
    return layer, variables, twin, x, positions


def _torch_steps(twin, x, positions, steps, **adamw):
    optimizer = torch.optim.AdamW(twin.parameters(), **adamw)
    x_t, pos_t = tr.from_numpy(np.asarray(x)), tr.from_numpy(np.asarray(positions))
    for _ in range(steps):
        optimizer.zero_grad()
        loss = (twin(x_t, pos_t) ** 2).sum()
        loss.backward()
        optimizer.step()
    return {name: tr.to_numpy(t) for name, t in twin.state_dict().items()}


def _optax_steps(layer, variables, x, positions, steps, optimizer):
    loss_fn = lambda v: (layer.apply(v, x, positions) ** 2).sum()
    state = optimizer.init(variables)
    for _ in range(steps):
        grads = jax.grad(loss_fn)(variables)
        updates, state = optimizer.update(grads, state, variables)
        variables = optax.apply_updates(variables, updates)
    return fa.to_torch_state_dict(layer, variables)


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(max_rel_error(a[k], b[k]) for k in b)


@pytest.mark.parametrize("steps", [1, 2])
def test_adamw_steps_match_torch(steps):
    layer, variables, twin, x, positions = _setup()
    before = fa.to_torch_state_dict(layer, variables)
    assert {"q_proj.weight", "q_proj.bias", "o_proj.bias", "q_norm.weight"} <= before.keys()
    expected = _torch_steps(twin, x, positions, steps, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    got = _optax_steps(layer, variables, x, positions, steps,
                       optax.adamw(LR, b1=B1, b2=B2, eps=EPS, eps_root=0.0, weight_decay=WD))
    assert all(v.dtype == np.float64 for v in got.values())
    error = _worst(got, expected)
    assert error <= TOLERANCE, f"{steps} AdamW step(s): max relative error {error:.2e} > {TOLERANCE:.0e}"
    # The steps moved every tensor, by far more than the tolerance.
    assert min(max_rel_error(expected[k], before[k]) for k in before) > 1e-3


def test_the_parity_would_see_a_convention_mismatch():
    """The tolerance separates AdamW's conventions: optax's default weight decay, eps inside the
    square root, plain Adam plus L2 (weight decay added to the gradient), or no bias correction in
    the second step all differ from torch's AdamW by far more than 1e-10."""
    layer, variables, twin, x, positions = _setup()
    expected = _torch_steps(twin, x, positions, 2, lr=LR, betas=(B1, B2), eps=EPS, weight_decay=WD)
    wrong = {
        "optax's default weight_decay": optax.adamw(LR, b1=B1, b2=B2, eps=EPS),
        "eps inside the square root": optax.adamw(LR, b1=B1, b2=B2, eps=0.0, eps_root=EPS**2, weight_decay=WD),
        "L2 in the gradient (torch.optim.Adam's weight_decay)": optax.chain(
            optax.add_decayed_weights(WD), optax.scale_by_adam(B1, B2, EPS), optax.scale(-LR)),
    }

    def adam_without_bias_correction():
        def init(params):
            zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
            return (zeros, zeros)

        def update(g, state, params):
            m = jax.tree_util.tree_map(lambda m, g: B1 * m + (1 - B1) * g, state[0], g)
            v = jax.tree_util.tree_map(lambda v, g: B2 * v + (1 - B2) * g * g, state[1], g)
            u = jax.tree_util.tree_map(lambda m, v, p: -LR * (m / (jnp.sqrt(v) + EPS) + WD * p), m, v, params)
            return u, (m, v)
        return optax.GradientTransformation(init, update)
    wrong["no bias correction"] = adam_without_bias_correction()
    for what, optimizer in wrong.items():
        error = _worst(_optax_steps(layer, variables, x, positions, 2, optimizer), expected)
        assert error > 1e3 * TOLERANCE, f"{what}: indistinguishable from torch's AdamW ({error:.1e})"


DATA = ROOT / "examples" / "data" / "pride_and_prejudice_1-15.txt"


def test_training_text_is_the_documented_one():
    assert hashlib.sha256(DATA.read_bytes()).hexdigest() == \
        "1446321be7c1919c2733bc587b9316959a7fccc22c2a3081ba8afcee96e3720a"  # examples/data/README.md
    text = DATA.read_text(encoding="ascii")
    assert text.startswith("PRIDE AND PREJUDICE\n\nBy Jane Austen\n")
    assert "Chapter 15\n" in text and "Chapter 16" not in text


def _run_quick(out, seed=0):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "train_decoder.py"), "--quick",
                             "--seed", str(seed), "--out", str(out)], capture_output=True, text=True, timeout=600)
    # (XLA's default flags: its training steps run longer than they compile, unlike the suite's programs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_train_decoder_quick_learns_and_is_deterministic(tmp_path):
    first = _run_quick(tmp_path / "a")
    assert "quick check passed: training loss" in first
    start, end = map(float, re.search(r"training loss (\d+\.\d+) -> (\d+\.\d+)", first).groups())
    assert end < start - 0.5
    final_train = float(re.search(r"final training loss\s+(\d+\.\d+)", first).group(1))
    final_held_out = float(re.search(r"final held-out loss\s+(\d+\.\d+)", first).group(1))
    baseline = float(re.search(r"unigram baseline\s+(\d+\.\d+)", first).group(1))
    assert final_train == end
    assert 3.0 < baseline < 3.2  # entropy of English characters with case and punctuation, in nats
    assert final_held_out < baseline  # 40 steps already beat the unigram model
    png = tmp_path / "a" / "train_decoder_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Deterministic given the seed: the example trains its first steps again from the seed and
    # exits non-zero unless the batch losses are the same bit for bit.
    assert re.search(r"repeat from the seed: the first \d+ batch losses are identical", first)
