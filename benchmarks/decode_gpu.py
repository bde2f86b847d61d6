"""One KV-cache decoding step on an NVIDIA GPU, bfloat16, against PyTorch eager on the same GPU.

The layer and the peer are :mod:`benchmarks.decode`'s (d_model 768, 12 heads of 64, RoPE,
no biases; PyTorch writes a preallocated ``(B, K, S, H)`` cache by index and calls
``F.scaled_dot_product_attention`` over the filled slots), here in bfloat16 on the GPU, batch 1
and 8 after a 1,024 or 8,192-token prefix. Contenders, timed in turns (medians of ``repeats``
rounds of ``decode.STEPS`` steps, each round waited for at its end):

* ``flax_attn decode_step``: ``fa.decode_step(layer)``, the documented loop (one ``jax.jit``,
  the cache donated, each one-token step's run-time checks read ``check_lag`` calls later);
* ``flax_attn jax.jit(apply)``: the same layer under a plain ``jax.jit`` of ``layer.apply``
  without donation: its run-time checks are ``lax.cond``s around host callbacks, and on a GPU
  every step waits for the device to hand their predicates to the host;
* ``flax_attn decode_step (check_lag=1)``: the same with each step's run-time checks read at the
  next call (a round trip to the device every step) instead of ``check_lag`` calls later;
* ``flax_attn decode_step (xla)``: the same loop with ``implementation='xla'`` (the plain path
  instead of the automatic choice, JAX's Pallas decoding kernel);
* ``torch eager``: :class:`benchmarks.decode` 's ``TorchDecodeLayer`` on ``cuda``, bfloat16, with
  PyTorch's default choice of SDPA backend; ``torch eager (no cuDNN)`` the same with the cuDNN
  backend excluded (``sdpa_kernel``: flash, memory-efficient or math), whose plans are made
  per sequence length.

The first outputs are checked to agree (relative 2e-2, bfloat16) before timing; ``vs torch`` is
each contender's time over the faster PyTorch row's.

    python -m benchmarks.decode_gpu [--repeats 20] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks import decode

PREFIXES = (1024, 8192)
BATCHES = (1, 8)
AGREE = 2e-2  # bfloat16


def _torch_steps(twin, x, prefix: int, state: dict, backends=None):
    """``run(n)``: ``n`` eager steps on the GPU from position ``state['t']`` past ``prefix`` on
    (``state`` shared by the contenders of one twin); returns the last output as float32 NumPy
    (waits for the device). ``backends``: the SDPA backends allowed (default: PyTorch's choice)."""
    import contextlib

    import torch
    from torch.nn.attention import sdpa_kernel

    tx = torch.from_numpy(np.array(x)).to("cuda", torch.bfloat16)

    def run(n=decode.STEPS):
        with torch.inference_mode(), (contextlib.nullcontext() if backends is None else sdpa_kernel(backends)):
            for _ in range(n):
                out = twin(tx, prefix + state["t"])
                state["t"] += 1
        return out.float().cpu().numpy()

    return run


def cell(batch: int, prefix: int, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import torch

    import flax_attn as fa

    B, D, N = batch, decode.D_MODEL, decode.HEADS
    H = D // N
    bf16 = jnp.bfloat16
    max_len = prefix + 3 * (repeats + 2) * decode.STEPS + 2  # room for both torch rows, which share one cache
    rng = np.random.default_rng(batch * 100003 + prefix)
    layer = fa.Attention(fa.AttentionConfig(d_model=D, num_heads=N, position="rope", rope_theta=decode.THETA),
                         param_dtype=bf16)
    x = rng.standard_normal((B, 1, D)).astype(np.float32)
    xb = np.asarray(jnp.asarray(x, bf16).astype(jnp.float32))  # the token both sides see
    params = layer.init(jax.random.key(0), jnp.asarray(xb, bf16), jnp.zeros((B, 1), jnp.int32))
    k0 = rng.standard_normal((B, N, prefix, H), dtype=np.float32)
    v0 = rng.standard_normal((B, N, prefix, H), dtype=np.float32)

    def cache():
        pad = lambda a: np.concatenate([a, np.zeros((B, N, max_len - prefix, H), np.float32)], axis=2)
        c = layer.init_cache(B, max_len)
        return c.replace(key=jnp.asarray(pad(k0).reshape(B * N, max_len, H), bf16),
                         value=jnp.asarray(pad(v0).reshape(B * N, max_len, H), bf16),
                         **decode.filled(B, max_len, prefix))

    plain = jax.jit(lambda p, c, xt, pt: layer.apply(p, xt, pt, cache=c))
    flax_runs = {"flax_attn decode_step": decode.flax_steps(fa.decode_step(layer), params, cache(), xb.astype(bf16),
                                                              prefix, max_len),
                 "flax_attn decode_step (check_lag=1)": decode.flax_steps(fa.decode_step(layer, check_lag=1), params,
                                                                          cache(), xb.astype(bf16), prefix, max_len),
                 "flax_attn decode_step (xla)": decode.flax_steps(fa.decode_step(layer.clone(implementation="xla")),
                                                                  params, cache(), xb.astype(bf16), prefix, max_len),
                 "flax_attn jax.jit(apply)": decode.flax_steps(plain, params, cache(), xb.astype(bf16), prefix, max_len)}
    twin = decode._torch_layer_class()(D, N, B, max_len)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(twin, name).weight.copy_(torch.from_numpy(np.asarray(params["params"][name]["kernel"],
                                                                         np.float32).T.copy()))
        twin.k_cache[:, :, :prefix] = torch.from_numpy(k0)
        twin.v_cache[:, :, :prefix] = torch.from_numpy(v0)
    twin = twin.to("cuda", torch.bfloat16)
    from torch.nn.attention import SDPBackend

    state = {"t": 0}
    torch_runs = {"torch eager": _torch_steps(twin, xb, prefix, state),
                  "torch eager (no cuDNN)": _torch_steps(twin, xb, prefix, state, [
                      SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])}
    ref = torch_runs["torch eager"](1)
    for name, run in flax_runs.items():
        got = np.asarray(run(1), np.float32)
        err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
        if not err <= AGREE:
            raise AssertionError(f"{name} and torch eager disagree on the first step: relative error {err:.1e}")
    seconds = decode.time_in_turns(dict(flax_runs, **torch_runs), repeats, warmup=1)
    peer = min(seconds[name] for name in torch_runs)
    floor = (4 * D * D + 2 * B * prefix * D) * 2  # bytes of weights and cache a step must read (bfloat16)
    return [{"contender": name, "batch": B, "prefix": prefix, "ms_per_step": s / decode.STEPS * 1e3,
             "gb_per_s": floor / (s / decode.STEPS) / 1e9, "ratio_vs_torch": s / peer}
            for name, s in seconds.items()]


def report(rows: list[dict], device: str) -> str:
    lines = [f"KV-cache decode step on {device}, d_model {decode.D_MODEL}, {decode.HEADS} heads, RoPE, bfloat16", "",
             "| batch | prefix | contender | ms/step | GB/s (floor) | vs torch |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['batch']} | {r['prefix']} | {r['contender']} | {r['ms_per_step']:.3f} | {r['gb_per_s']:.0f} | "
              f"{r['ratio_vs_torch']:.2f}x |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> None:
    import jax
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" or not torch.cuda.is_available():
        raise SystemExit("benchmarks.decode_gpu needs JAX and torch on an NVIDIA GPU (benchmarks.decode is the CPU one)")
    device = torch.cuda.get_device_name()
    rows = [r for p in PREFIXES for b in BATCHES for r in cell(b, p, args.repeats)]
    print(report(rows, device))
    out = args.out / f"decode-gpu-{device.replace(' ', '-').lower()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "jax": jax.__version__, "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
                               "steps_per_round": decode.STEPS, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
