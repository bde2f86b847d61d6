"""The README's Markdown tables from a result file of ``benchmarks.run``.

    python -m benchmarks.tables benchmarks/results/cpu-amd-epyc-family26-model2-2cores.json

Prints, for each part the file holds: the machine line; the GPT-2-small layer (time, ratio to
the PyTorch SDPA layer, GFLOP/s or TFLOP/s of the model FLOPs and their fraction of the same
framework's measured matmul peak); the length sweep (seconds and peak memory, forward /
forward+backward, or the memory XLA's estimate says a skipped point needs); the decoding step
against PyTorch eager (one row per cell: both cache layouts, both PyTorch rows, the floor and
the ratio) and the absorbed latent attention's step; the cached generation's line. Nothing is
measured here: the tables are the file's figures, so that a README table and its result file
cannot disagree. Files of ``benchmarks.decode`` (its steps, ``--loop``, ``--generation``) and
``benchmarks.decode_mla`` give their table.
"""
from __future__ import annotations

import argparse
import json
import re
from collections import OrderedDict
from pathlib import Path

from benchmarks import cpu
from benchmarks.decode import generation_table, loop_table, timing
from benchmarks.run import PEER, layer_flops


def machine_line(results: dict) -> str:
    m = results["machine"]
    peaks = results.get("matmul_peak_tflops_by_framework", {"jax": results["matmul_peak_tflops"]})
    gpu = m.get("backend") == "gpu"
    unit, scale = ("TFLOP/s", 1.0) if gpu else ("GFLOP/s", 1e3)
    peak_text = ", ".join(f"{name} {t * scale:.0f} {unit}" for name, t in peaks.items())
    return (f"{m['device']}, {m['cpu_count']} cores, {m['memory_gib']} GiB; JAX {m['jax']}, torch {m['torch']}; "
            f"{m['dtype']}; {m['date']}; host memory: {results.get('host_memory', 'default allocator')}; "
            f"matmul peaks {peak_text}" + cpu.environment_text(m.get("environment", {})))


def layer_table(results: dict) -> str:
    """One row per contender, in the run's order; the peer's row in bold."""
    gpu = results["machine"].get("backend") == "gpu"
    unit, scale = ("TFLOP/s", 1e12) if gpu else ("GFLOP/s", 1e9)
    flops = layer_flops(results["gpt2_layer_config"])
    peaks = results.get("matmul_peak_tflops_by_framework", {"jax": results["matmul_peak_tflops"]})
    by = OrderedDict()
    for r in results["gpt2_layer"]:
        by.setdefault(r["layer"], {})[r["mode"]] = r
    lines = [f"| layer | forward | ratio | {unit} (of peak) | forward+backward | ratio | {unit} (of peak) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, modes in by.items():
        cells = []
        for mode in ("forward", "forward+backward"):
            r = modes[mode]
            rate = flops[mode] / r["seconds"]
            peak = peaks.get(r.get("framework", "jax"))
            share = f" ({rate / (peak * 1e12):.0%})" if peak else ""
            time = f"{r['seconds'] * 1e3:.3f} ms" if gpu else f"{r['seconds']:.3f} s"
            cells.append(f"{time} | {r['ratio_to_peer']:.2f}x | {rate / scale:.1f}{share}")
        label = name.replace("(peer)", "(**peer**)") if name == PEER else name
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sweep_cell(row) -> str:
    if row is None:
        return "-"
    if "seconds" in row:
        return f"{row['seconds']:.3f} s, {row['peak_gib']:.2f} GiB"
    needs = re.search(r"needs ([\d.]+) GiB", row.get("skipped") or "")
    return f"- (needs {float(needs.group(1)):.0f} GiB)" if needs else f"- ({row.get('skipped') or row.get('failed')})"


def sweep_table(results: dict) -> str:
    """Lengths down, contenders across (in the run's order); each cell forward / forward+backward."""
    rows = {(r["T"], r["impl"], r["mode"]): r for r in results["length_sweep"]}
    impls = list(OrderedDict.fromkeys(r["impl"] for r in results["length_sweep"]))
    lines = ["| T | " + " | ".join(impls) + " |", "| --- |" + " --- |" * len(impls)]
    for T in sorted({r["T"] for r in results["length_sweep"]}):
        cells = [" / ".join(_sweep_cell(rows.get((T, impl, mode))) for mode in ("forward", "forward+backward"))
                 for impl in impls]
        lines.append(f"| {T:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(rows: list) -> str:
    """One row per (batch, prefix, slots, kv heads, tokens) cell of ``benchmarks.decode`` or
    ``benchmarks.decode_mla`` rows: each flax_attn contender (GB/s for the first, its ratio to
    PyTorch for the others), PyTorch eager with its threads / one thread, the floor and the
    first contender's ratio to the faster PyTorch row."""
    cells = OrderedDict()
    for r in rows:
        key = (r["batch"], r["prefix"], r["capacity"], r["kv_heads"], r.get("tokens", 1))
        cells.setdefault(key, OrderedDict())[r["contender"]] = r
    ours = list(OrderedDict.fromkeys(r["contender"] for r in rows if not r["contender"].startswith("torch")))
    lines = ["| batch | prefix | cache slots | kv heads | tokens/step | " + " | ".join(ours)
             + " | PyTorch eager (threads / 1 thread) | floor | vs torch |",
             "| --- | --- | --- | --- | --- |" + " --- |" * len(ours) + " --- | --- | --- |"]
    for (b, p, cap, k, t), cs in cells.items():
        first = cs[ours[0]]
        mine = [f"{first['ms_per_step']:.3f} ms ({first['gb_per_s']:.1f} GB/s)"]
        mine += [f"{cs[name]['ms_per_step']:.3f} ms ({cs[name]['ratio_vs_torch']:.2f}x)" for name in ours[1:]]
        torch_rows = f"{cs['torch eager']['ms_per_step']:.3f} / {cs['torch eager 1 thread']['ms_per_step']:.3f} ms"
        lines.append(f"| {b} | {p:,} | {cap:,} | {k} | {t} | " + " | ".join(mine)
                     + f" | {torch_rows} | {first['floor_bytes_per_step'] / 1e6:.1f} MB | {first['ratio_vs_torch']:.2f}x |")
    return "\n".join(lines)


def tables(results: dict) -> str:
    """Every table the result file has, in the README's order, under a title each. A file of
    ``benchmarks.decode``, ``benchmarks.decode_mla`` or ``benchmarks.core`` (its ``rows``) gives
    its one table; any other file is a ``ValueError`` saying which files are read."""
    if "rows" in results and isinstance(results.get("machine"), dict) and "cpu" in results["machine"]:
        m = results["machine"]
        head = f"{m['cpu']}, {m['cores']} cores, load {m['load_1_5_15']}"
        rows = results["rows"]
        if rows and "ratio_vs_torch_sdpa" in rows[0]:  # benchmarks.core
            from benchmarks.core import report
            return report(rows, m)
        if rows and "slots_at_end" in rows[0]:  # --generation
            return f"{head}; generations of {rows[0]['tokens']:,} tokens after {rows[0]['prefix']:,}:\n\n" + generation_table(rows)
        if rows and "floor_bytes_per_step" not in rows[0]:  # --loop
            return (f"{head}; runs of {rows[0]['tokens']} steps after {rows[0]['prefix']:,} tokens, "
                    f"{results['repeats']} rounds:\n\n" + loop_table(rows))
        rounds = results.get("timing") or f"{results['repeats']} rounds of {results['steps_per_round']} steps"
        return f"{head}; {rounds}:\n\n" + decode_table(rows)
    if "gpt2_layer_config" not in results:
        raise ValueError("not a result file of benchmarks.run, benchmarks.decode, benchmarks.decode_mla or benchmarks.core "
                         f"(its keys: {sorted(results)}); benchmarks.parallel and benchmarks.decode_gpu print their "
                         "own tables")
    parts = [machine_line(results)]
    if "gpt2_layer" in results:
        c = results["gpt2_layer_config"]
        parts.append(f"GPT-2-small causal layer (batch {c['batch']}, {c['context']} tokens, {c['d_model']} wide, "
                     f"{c['heads']} heads):\n\n" + layer_table(results))
    if "length_sweep" in results:
        parts.append("Attention core, length sweep (forward / forward+backward):\n\n" + sweep_table(results))
    if "decode_vs_torch" in results:
        parts.append(f"Decoding step against PyTorch eager ({timing(results['decode_vs_torch'])}):\n\n"
                     + decode_table(results["decode_vs_torch"]))
    if "decode_mla_vs_torch" in results:
        parts.append(f"Absorbed latent attention decoding step against PyTorch eager "
                     f"({timing(results['decode_mla_vs_torch'])}):\n\n" + decode_table(results["decode_mla_vs_torch"]))
    if "decoding" in results:
        d = results["decoding"]
        parts.append(f"Cached generation after {d['prefix']:,} tokens: {d['cached_s_per_token'] * 1e3:.2f} ms a token "
                     f"against {d['recompute_s_per_token'] * 1e3:.2f} ms recomputing the prefix ({d['speedup']:.3g}x).")
    return "\n\n".join(parts)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="result files written by benchmarks.run")
    args = parser.parse_args(argv)
    for path in args.results:
        try:
            text = tables(json.loads(path.read_text()))
        except ValueError as e:
            parser.error(f"{path}: {e}")
        print(f"## {path.name}\n\n{text}\n")


if __name__ == "__main__":
    main()
