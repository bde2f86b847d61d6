"""Context parallelism: per-device memory and time against the number of devices, and the
communication of a ring on a real cluster, computed on paper.

    python -m benchmarks.parallel            # 8,192 tokens; several minutes on 2 cores
    python -m benchmarks.parallel --quick    # 1,024 tokens, one repeat: checks that it runs

1. Measured, on 1, 2, 4 and 8 *virtual CPU devices* (``XLA_FLAGS=--xla_force_host_platform_
   device_count=8``, set below before JAX starts): one sequence of a fixed total length (8,192
   tokens), 8 heads of 64, causal, float32, split over a mesh axis, for the ring (in order and
   zig-zag balanced) and the all-gather method, and one device's ``dot_product_attention``.
   Per-device memory is XLA's memory analysis of the compiled program (arguments + outputs +
   temporaries of one device's share of the SPMD program). Times are wall-clock medians of the
   compiled forward and forward+backward after a warm-up; **they are not device times**: the
   virtual devices are threads sharing this machine's cores, so more devices do not add compute
   and the times show overheads, not speed-ups.
2. On paper, for a real multi-host cluster (8 hosts x 8 accelerators = a ring of 64, 1M
   tokens, Llama-3-8B-like attention: 32 query heads, 8 key/value heads of 128, bfloat16): the
   bytes a device sends per ring step and in total, forward and backward, and the compute per
   step that has to hide them.

Writes ``benchmarks/results/parallel-<cpu>.json`` (cpu: :func:`benchmarks.cpu.slug`, the model
name with the x86 family and model) and prints markdown tables. No assertions.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks import cpu  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DEVICES = (1, 2, 4, 8)
MiB = 2 ** 20


# ------------------------------------------------------------------------------ measured


def _median_time(f, args, repeats: int) -> float:
    import jax

    jax.block_until_ready(f(*args))  # warm-up (compiled already)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return {"total_mib": total / MiB, "temp_mib": m.temp_size_in_bytes / MiB}


def measure(T: int, repeats: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    import flax_attn as fa
    from flax_attn import parallel as fp

    B, N, H = 1, 8, 64
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in range(3))
    rows = []
    contenders = [("one device: dot_product_attention", None, None)]
    for P in DEVICES:
        contenders += [(f"ring, {P} devices", "ring", P), (f"ring zig-zag, {P} devices", "zigzag", P),
                       (f"all-gather, {P} devices", "allgather", P)]
    for label, method, P in contenders:
        kw = dict(is_causal=True)
        if method is None:
            impl, args = None, (q, k, v)
        else:
            mesh = jax.make_mesh((P,), ("seq",), devices=jax.devices()[:P])
            impl = fp.context_parallel(mesh, "seq", "allgather" if method == "allgather" else "ring")
            args = (q, k, v)
            if method == "zigzag":
                if T % (2 * P):
                    continue
                pos = fp.load_balance(jnp.arange(T, dtype=jnp.int32)[None], P)
                kw.update(query_positions=pos, key_positions=pos)
                args = fp.load_balance((q, k, v), P)
            sharding = jax.sharding.NamedSharding(mesh.update(axis_types=(jax.sharding.AxisType.Auto,)),
                                                  jax.sharding.PartitionSpec(None, "seq"))
            args = jax.device_put(args, sharding)

        def forward(q, k, v, impl=impl, kw=kw):
            return fa.dot_product_attention(q, k, v, implementation=impl, **kw)

        def loss(q, k, v, forward=forward):
            return jnp.sum(forward(q, k, v))

        fwd = jax.jit(forward).lower(*args).compile()
        both = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*args).compile()
        row = {"contender": label, "method": method or "one device", "devices": P or 1, "tokens": T,
               "forward_s": _median_time(fwd, args, repeats), "forward_backward_s": _median_time(both, args, repeats),
               "memory_forward": _memory(fwd), "memory_forward_backward": _memory(both),
               "sent_forward": fp.bytes_sent(forward, *args, axis_size=P or 1),
               "sent_forward_backward": fp.bytes_sent(jax.grad(loss, (0, 1, 2)), *args, axis_size=P or 1)}
        print(f"  {label}: forward {row['forward_s']:.3f} s, forward+backward {row['forward_backward_s']:.3f} s, "
              f"{row['memory_forward_backward']['total_mib']:.1f} MiB per device", flush=True)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ on paper


def on_paper(hosts=8, per_host=8, tokens=2 ** 20, N=32, K=8, H=128, kv_bytes=2, grad_bytes=4,
             peak_flops=989e12) -> dict:
    """The ring's communication for one attention layer on ``hosts x per_host`` devices, one ring
    over all of them (context parallelism of ``hosts * per_host``), ``tokens`` tokens.

    Forward: P-1 steps, each device sends its visiting K and V block (``2 * L * K * H`` values,
    L = tokens / P) and their positions and segment ids (int32). Backward (as implemented here):
    K, V and the int metadata again for P-1 steps, plus dK and dV, accumulated in float32
    (``grad_bytes``), for P steps (the P-th brings them home). All-gather moves the same K/V
    bytes in the forward (each device receives the P-1 other blocks) and reduce-scatters
    dK/dV in the backward, but holds all keys and values at once.

    Compute per step (the full, unmasked block): ``4 L^2 N H`` FLOPs (QK^T and PV), forward;
    per byte of K/V sent: ``4 L^2 N H / (2 L K H kv_bytes) = L N / K`` FLOP/byte for bf16.
    ``peak_flops`` (989 TFLOP/s: an H100 SXM's dense bf16 datasheet figure, an assumption) over
    that gives the link bandwidth that hides a step's transfer behind its compute; a causal mask
    halves the compute per step on average (zig-zag: exactly), doubling it.
    """
    P = hosts * per_host
    L = tokens // P
    kv_step = 2 * L * K * H * kv_bytes
    meta_step = 2 * L * 4
    grad_step = 2 * L * K * H * grad_bytes
    fwd_total = (P - 1) * (kv_step + meta_step)
    bwd_total = (P - 1) * (kv_step + meta_step) + P * grad_step
    flops_step = 4 * L * L * N * H
    intensity = flops_step / kv_step
    return {
        "devices": P, "hosts": hosts, "per_host": per_host, "tokens": tokens, "local_tokens": L,
        "heads": {"query": N, "kv": K, "head_dim": H}, "kv_dtype_bytes": kv_bytes, "grad_dtype_bytes": grad_bytes,
        "kv_bytes_per_step": kv_step, "metadata_bytes_per_step": meta_step, "dkdv_bytes_per_step": grad_step,
        "forward_steps": P - 1, "backward_steps": P,
        "forward_bytes_per_device": fwd_total, "backward_bytes_per_device": bwd_total,
        "forward_bytes_all_devices": fwd_total * P, "backward_bytes_all_devices": bwd_total * P,
        "inter_host_links_per_step": hosts,  # ring edges that cross hosts
        "kv_held_per_device_ring": 2 * kv_step, "kv_held_per_device_allgather": 2 * L * K * H * kv_bytes * P,
        "flops_per_step_full_block": flops_step, "flop_per_kv_byte": intensity,
        "assumed_peak_flops": peak_flops,
        "bandwidth_to_hide_step_full_GBps": peak_flops / intensity / 1e9,
        "bandwidth_to_hide_step_causal_GBps": 2 * peak_flops / intensity / 1e9,
    }


# ------------------------------------------------------------------------------ tables


def _fmt_bytes(b):
    b = int(round(b))
    for unit, size in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if b >= size:
            return f"{b / size:,.2f} {unit}"
    return f"{b} B"


def tables(result) -> str:
    lines = [f"**Context parallelism on virtual CPU devices** ({result['machine']['cpu']}, "
             f"{result['machine']['cores']} cores, JAX {result['machine']['jax']}; 1 x {result['tokens']:,} tokens, "
             "8 heads of 64, causal, float32). Memory: XLA's per-device analysis of the compiled program. "
             "Times: wall clock of all virtual devices sharing the machine's cores -- **not device times**.", "",
             "Sent: bytes one device sends, counted in the traced program (collectives' operands; see "
             "`flax_attn.parallel.bytes_sent`).", "",
             "| contender | devices | forward | forward+backward | memory per device, forward+backward (temporaries) "
             "| sent per device, forward / forward+backward |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["measured"]:
        m = r["memory_forward_backward"]
        sent = " / ".join(_fmt_bytes(sum(r.get(k, {}).values())) for k in ("sent_forward", "sent_forward_backward"))
        lines.append(f"| {r['contender'].split(',')[0]} | {r['devices']} | {r['forward_s']:.3f} s | "
                     f"{r['forward_backward_s']:.3f} s | {m['total_mib']:.1f} MiB ({m['temp_mib']:.1f} MiB) | {sent} |")
    p = result["on_paper"]
    heads = p["heads"]
    lines += ["", f"**A ring on a cluster, on paper**: {p['hosts']} hosts x {p['per_host']} accelerators (a ring of "
              f"{p['devices']}), {p['tokens']:,} tokens ({p['local_tokens']:,} per device), {heads['query']} "
              f"query heads, {heads['kv']} key/value heads of {heads['head_dim']}, bfloat16 K/V, float32 dK/dV; "
              "one attention layer, bytes one device sends:", "",
              "| | per ring step | steps | per device | all devices |", "| --- | --- | --- | --- | --- |",
              f"| forward: K + V (+ positions, segment ids) | {_fmt_bytes(p['kv_bytes_per_step'])} "
              f"(+ {_fmt_bytes(p['metadata_bytes_per_step'])}) | {p['forward_steps']} | "
              f"{_fmt_bytes(p['forward_bytes_per_device'])} | {_fmt_bytes(p['forward_bytes_all_devices'])} |",
              f"| backward: K + V (+ metadata) and dK + dV | {_fmt_bytes(p['kv_bytes_per_step'])} "
              f"(+ {_fmt_bytes(p['metadata_bytes_per_step'])}) + {_fmt_bytes(p['dkdv_bytes_per_step'])} | "
              f"{p['forward_steps']} + {p['backward_steps']} | {_fmt_bytes(p['backward_bytes_per_device'])} | "
              f"{_fmt_bytes(p['backward_bytes_all_devices'])} |", "",
              f"Compute per step (full block, forward): {p['flops_per_step_full_block'] / 1e12:.1f} TFLOP, "
              f"{p['flop_per_kv_byte']:,.0f} FLOP per byte of K/V sent (L N / K). At an assumed "
              f"{p['assumed_peak_flops'] / 1e12:.0f} TFLOP/s a link of "
              f"{p['bandwidth_to_hide_step_full_GBps']:.0f} GB/s hides a full step, "
              f"{p['bandwidth_to_hide_step_causal_GBps']:.0f} GB/s a causal (zig-zag) one; "
              f"{p['inter_host_links_per_step']} of the ring's {p['devices']} links cross hosts. K/V held per device: "
              f"{_fmt_bytes(p['kv_held_per_device_ring'])} for the ring (own + visiting block), "
              f"{_fmt_bytes(p['kv_held_per_device_allgather'])} for the all-gather."]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, one repeat")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    import jax

    T = args.tokens or (1024 if args.quick else 8192)
    repeats = 1 if args.quick else args.repeats
    machine = {"cpu": cpu.kind(), "cores": os.cpu_count(), "jax": jax.__version__,
               "virtual_devices": jax.device_count(), "date": time.strftime("%Y-%m-%d")}
    print(f"measuring on {jax.device_count()} virtual CPU devices ({machine['cpu']}, {machine['cores']} cores)",
          flush=True)
    result = {"machine": machine, "tokens": T, "measured": measure(T, repeats), "on_paper": on_paper(),
              "note": "times are wall clock of virtual CPU devices sharing the cores, not device times"}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"parallel-{cpu.slug()}.json"
    path.write_text(json.dumps(result, indent=1))
    print(tables(result))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
