"""The causal attention core on CPU, whole and as its matrix products alone, against PyTorch.

GPT-2-small's core (batch 8, 12 heads of 64, 1,024 tokens, causal, float32), forward and
forward+backward:

* ``flax_attn core``: ``fa.dot_product_attention(..., is_causal=True)`` under ``jax.jit`` (the
  automatic choice: on an x86-64 CPU with AVX-512 or AVX2 the compiled kernel,
  :mod:`flax_attn.core.native`; elsewhere query blocks);
* ``flax_attn core (cpu_native avx2)``: where the CPU runs the kernel's AVX-512 build, the
  same call through its AVX2 build (``CpuNative(isa='avx2')``), what an AVX2-only CPU runs;
* ``flax_attn core (query_blocks)``: the same call with ``implementation='query_blocks'``, the
  pure-JAX path whose products the two rows below time;
* ``torch SDPA``: ``F.scaled_dot_product_attention(..., is_causal=True)`` (the peer);
* ``JAX products alone``: only the matrix products of flax_attn's query-block plan on this
  machine (its own block size, units a step and key range of each block:
  :class:`flax_attn.core.query_blocks.QueryBlocks`' choices), in one jitted program that loops
  over the steps as the core does. Forward: per block ``q k^T`` and ``weights v``;
  forward+backward adds the five of reverse mode (the logits recomputed, ``dout v^T``,
  ``ds k``, ``weights^T dout``, ``ds^T q``): seven products a block. Each product's output is
  summed, so that none is dropped. The weights and ``ds`` are fixed random arrays of each
  block's shape: no softmax, masking or layout change is timed;
* ``torch products alone``: the same products with ``torch.bmm``, one call each (its Python
  loop included).

Both products programs must agree on the sum of their products (relative 1e-4) before any
timing. The products alone are a floor for any program that computes them with the same
matmul library: where the JAX products alone take about as long as PyTorch's whole SDPA, no
arrangement of the softmax's passes around them reaches PyTorch's core, as the softmax,
masks and copies all come on top.

    python -m benchmarks.core            # prints the table, writes benchmarks/results/core-<cpu>.json
    python -m benchmarks.core --smoke    # tiny shapes, one round: checks that it runs
"""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import numpy as np

from benchmarks import cpu
from benchmarks.decode import machine
from benchmarks.run import RESULTS, time_in_turns

SHAPE = {"batch": 8, "heads": 12, "tokens": 1024, "head_dim": 64}
SMOKE_SHAPE = {"batch": 1, "heads": 2, "tokens": 64, "head_dim": 16}
MODES = ("forward", "forward+backward")


def plan(B: int, T: int, N: int, H: int):
    """``(block_q, units_per_step, ranges)``: flax_attn's query-block plan for a causal
    self-attention call of these shapes on this machine; ``ranges`` lists each block's
    ``(q0, q1, k0, k1)``."""
    import jax
    import jax.numpy as jnp

    from flax_attn.core.call import describe
    from flax_attn.core.query_blocks import QueryBlocks, key_ranges

    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    call = describe(q, q, q, is_causal=True, platform="cpu")
    blocks = QueryBlocks()
    bq = blocks._block_q(call)
    ranges = key_ranges(call.mask, T, T, bq)
    _, chunk = blocks._step_units(call, B, bq, max(k1 - k0 for _, _, k0, k1 in ranges))
    return bq, chunk, ranges


def automatic_choice(B: int, T: int, N: int, H: int) -> str:
    """The implementation ``fa.dot_product_attention`` takes for this causal call on CPU."""
    import jax
    import jax.numpy as jnp

    from flax_attn.core import registry
    from flax_attn.core.call import describe

    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    return registry.choose(describe(q, q, q, is_causal=True, platform="cpu")).name


def product_flops(shape: dict, ranges, mode: str) -> float:
    """Multiply-adds x 2 of the products timed: 2 (forward) or 7 (forward+backward) products of
    ``2 * rows * keys * head_dim`` a block, for every (batch, head) unit."""
    units, H = shape["batch"] * shape["heads"], shape["head_dim"]
    per_unit = sum(2 * (q1 - q0) * (k1 - k0) * H for q0, q1, k0, k1 in ranges)
    return units * per_unit * (2 if mode == "forward" else 7)


def inputs(shape: dict, chunk: int, ranges, seed: int = 0) -> dict:
    """Random float32 operands: ``q, k, v, dout`` as ``(steps, chunk, T, H)`` units, and each
    block's weights and ``ds`` ``(chunk, q1 - q0, k1 - k0)``."""
    rng = np.random.default_rng(seed)
    U, T, H = shape["batch"] * shape["heads"], shape["tokens"], shape["head_dim"]
    units = {name: rng.standard_normal((U // chunk, chunk, T, H), dtype=np.float32) for name in ("q", "k", "v", "dout")}
    blocks = [(rng.random((chunk, q1 - q0, k1 - k0), dtype=np.float32),
               rng.standard_normal((chunk, q1 - q0, k1 - k0), dtype=np.float32)) for q0, q1, k0, k1 in ranges]
    return {**units, "blocks": blocks}


def jax_products(ops: dict, ranges, mode: str):
    """``run()``: the products of :func:`plan` in one ``jax.jit`` program, the sum of all their
    outputs as a float32 scalar."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    arrays = {name: jnp.asarray(ops[name]) for name in ("q", "k", "v", "dout")}
    blocks = [(jnp.asarray(w), jnp.asarray(ds)) for w, ds in ops["blocks"]]
    backward = mode != "forward"

    def program(arrays, blocks):
        def step(i, total):
            q, k, v, dout = (arrays[name][i] for name in ("q", "k", "v", "dout"))
            for (q0, q1, k0, k1), (w, ds) in zip(ranges, blocks):
                qi, ki, vi, di = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], dout[:, q0:q1]
                outs = [jnp.einsum("crh,csh->crs", qi, ki), jnp.einsum("crs,csh->crh", w, vi)]
                if backward:
                    outs += [jnp.einsum("crh,csh->crs", qi, ki), jnp.einsum("crh,csh->crs", di, vi),
                             jnp.einsum("crs,csh->crh", ds, ki), jnp.einsum("crs,crh->csh", w, di),
                             jnp.einsum("crs,crh->csh", ds, qi)]
                for out in outs:
                    total = total + jnp.sum(out)
            return total

        return lax.fori_loop(0, arrays["q"].shape[0], step, jnp.zeros((), jnp.float32))

    compiled = jax.jit(program)
    return lambda: compiled(arrays, blocks)


def torch_products(ops: dict, ranges, mode: str):
    """``run()``: the same products with ``torch.bmm``, the sum of their outputs as a tensor."""
    import torch

    arrays = {name: torch.from_numpy(ops[name]) for name in ("q", "k", "v", "dout")}
    blocks = [(torch.from_numpy(w), torch.from_numpy(ds)) for w, ds in ops["blocks"]]
    backward = mode != "forward"

    def run():
        total = torch.zeros(())
        with torch.no_grad():
            for i in range(arrays["q"].shape[0]):
                q, k, v, dout = (arrays[name][i] for name in ("q", "k", "v", "dout"))
                for (q0, q1, k0, k1), (w, ds) in zip(ranges, blocks):
                    qi, ki, vi, di = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], dout[:, q0:q1]
                    outs = [torch.bmm(qi, ki.transpose(1, 2)), torch.bmm(w, vi)]
                    if backward:
                        outs += [torch.bmm(qi, ki.transpose(1, 2)), torch.bmm(di, vi.transpose(1, 2)),
                                 torch.bmm(ds, ki), torch.bmm(w.transpose(1, 2), di), torch.bmm(ds.transpose(1, 2), qi)]
                    for out in outs:
                        total = total + out.sum()
        return total

    return run


def whole_cores(shape: dict, mode: str, seed: int = 1) -> dict:
    """``{'flax_attn core': run, ..., 'flax_attn core (query_blocks)': run, 'torch SDPA': run}``
    for ``mode`` (with a row for each other build of the compiled kernel this CPU runs);
    forward+backward takes the
    gradients of ``sum(out * dout)`` with respect to the queries, keys and values."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import flax_attn as fa
    from flax_attn.core import native

    B, N, T, H = shape["batch"], shape["heads"], shape["tokens"], shape["head_dim"]
    rng = np.random.default_rng(seed)
    q, k, v, dout = (rng.standard_normal((B, T, N, H), dtype=np.float32) for _ in range(4))
    cores = {"flax_attn core": None}
    for isa in native.ISAS:
        if isa != native.best_isa() and native.unavailable(isa) is None:
            cores[f"flax_attn core (cpu_native {isa})"] = native.CpuNative(isa=isa)
    cores["flax_attn core (query_blocks)"] = "query_blocks"
    jq, jk, jv, jd = map(jnp.asarray, (q, k, v, dout))
    heads_first = lambda x, grad=False: torch.from_numpy(x).transpose(1, 2).contiguous().requires_grad_(grad)
    tq, tk, tv = (heads_first(x, grad=mode != "forward") for x in (q, k, v))
    td = heads_first(dout)
    runs = {}
    for label, impl in cores.items():
        core = functools.partial(fa.dot_product_attention, is_causal=True, implementation=impl)
        if mode == "forward":
            runs[label] = functools.partial(jax.jit(core), jq, jk, jv)
        else:
            grads = jax.jit(jax.grad(lambda q, k, v, d, core=core: jnp.sum(core(q, k, v) * d), argnums=(0, 1, 2)))
            runs[label] = functools.partial(grads, jq, jk, jv, jd)

    def torch_run():
        if mode == "forward":
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        for x in (tq, tk, tv):
            x.grad = None
        F.scaled_dot_product_attention(tq, tk, tv, is_causal=True).backward(td)
        return tq.grad

    return {**runs, "torch SDPA": torch_run}


def check_products_agree(jax_run, torch_run) -> float:
    """The relative difference of the two products programs' sums; raises where it exceeds 1e-4."""
    got, ref = float(np.asarray(jax_run())), float(torch_run())
    err = abs(got - ref) / max(abs(ref), 1e-30)
    if not err <= 1e-4:
        raise AssertionError(f"the JAX and torch products disagree: sums {got!r} and {ref!r} (relative {err:.1e})")
    return err


def run(repeats: int = 10, shape: dict = SHAPE) -> list[dict]:
    """One row per contender and mode: seconds, the products' GFLOP/s at that time, and the
    ratio to PyTorch's SDPA."""
    B, T, N, H = shape["batch"], shape["tokens"], shape["heads"], shape["head_dim"]
    bq, chunk, ranges = plan(B, T, N, H)
    ops = inputs(shape, chunk, ranges)
    rows = []
    for mode in MODES:
        products = {"JAX products alone": jax_products(ops, ranges, mode),
                    "torch products alone": torch_products(ops, ranges, mode)}
        check_products_agree(*products.values())
        fns = {**whole_cores(shape, mode), **products}
        seconds = time_in_turns(fns, repeats)
        flops = product_flops(shape, ranges, mode)
        for name, s in seconds.items():
            rows.append({"contender": name, "mode": mode, "seconds": s, "products_gflops": flops / s / 1e9,
                         "ratio_vs_torch_sdpa": s / seconds["torch SDPA"], "block_q": bq, "units_per_step": chunk,
                         "blocks": len(ranges), "core_implementation": automatic_choice(B, T, N, H),
                         **shape})
    return rows


def report(rows: list[dict], measured_on: dict = None) -> str:
    """A Markdown table of :func:`run`'s rows under the machine (``measured_on``, a result file's
    ``machine``; default: this one) and the plan."""
    m, r0 = measured_on or machine(), rows[0]
    lines = [f"Causal attention core, {r0['batch']} x {r0['heads']} heads x {r0['tokens']} tokens of {r0['head_dim']}, "
             f"float32; CPU {m['cpu']} ({m['cores']} cores, load {m['load_1_5_15']}); query blocks of "
             f"{r0['block_q']}, {r0['units_per_step']} units a step, {r0['blocks']} blocks; the core's "
             f"automatic choice: {r0['core_implementation']}"
             + cpu.environment_text(m.get("environment", {})), "",
             "| mode | contender | time | products' GFLOP/s | vs torch SDPA |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['mode']} | {r['contender']} | {r['seconds'] * 1e3:.1f} ms | {r['products_gflops']:.1f} | "
              f"{r['ratio_vs_torch_sdpa']:.2f}x |" for r in rows]
    return "\n".join(lines)


def table_main(argv, description: str, stem: str, run, smoke, report) -> None:
    """The command line of a benchmark that prints one table and writes one result file:
    ``--repeats`` (for ``run(repeats)``, the rows), ``--smoke`` (``smoke()``: tiny shapes, one
    round) and ``--out`` (default ``benchmarks/results/<stem>-<cpu>[-smoke].json``, holding the
    machine, the repeats and the rows); ``report(rows)`` is the table printed."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one round")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    rows = smoke() if args.smoke else run(args.repeats)
    print(report(rows))
    out = args.out or RESULTS / f"{stem}-{cpu.slug()}{'-smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "repeats": 1 if args.smoke else args.repeats, "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


def main(argv=None) -> None:
    table_main(argv, __doc__.splitlines()[0], "core", run, lambda: run(1, SMOKE_SHAPE), report)


if __name__ == "__main__":
    main()
