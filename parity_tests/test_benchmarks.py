"""The benchmark's plumbing for platforms this machine does not have: which implementations the
GPT-2 layer benchmark times on each (every registered one that runs there and serves the call;
the others are listed with their reason). The timing itself runs in test_examples.py's smoke run."""
import numpy as np
import jax.numpy as jnp
import pytest

from benchmarks.run import layer_implementations  # the repository root is on sys.path (conftest.py)

SHAPE = (8, 1024, 12, 64)  # B, T, N, H of the GPT-2-small layer


@pytest.mark.parametrize("platform, dtype, timed, declined", [
    ("cpu", jnp.float32, {"xla", "query_blocks", "blockwise"}, {"key_blocks"}),
    ("gpu", jnp.bfloat16, {"xla", "query_blocks", "blockwise", "cudnn", "pallas_triton"}, {"pallas_decode", "key_blocks"}),
    ("gpu", jnp.float32, {"xla", "query_blocks", "blockwise"}, {"cudnn", "pallas_triton", "pallas_decode", "key_blocks"}),
    ("tpu", jnp.bfloat16, {"xla", "query_blocks", "blockwise", "splash"}, {"key_blocks"}),
])
def test_layer_benchmark_times_every_implementation_that_serves_the_call(platform, dtype, timed, declined):
    from flax_attn.core import native

    if platform == "cpu":  # the compiled kernel serves the layer where it can run at all
        (timed if native.unavailable() is None else declined).add("cpu_native")
    served, reasons = layer_implementations(*SHAPE, dtype, platform)
    assert set(served) == timed and set(reasons) == declined
    assert all(isinstance(r, str) and r for r in reasons.values())
    if platform == "gpu" and dtype == jnp.bfloat16:
        assert "one query" in reasons["pallas_decode"]
    assert "without key/value lengths" in reasons["key_blocks"]  # a layer's call over the whole sequence


def test_fused_projection_contender_computes_the_module():
    """The benchmark's one-fused-QKV-matmul row times the same function as the module (three
    matmuls): equal outputs on the module's parameters."""
    import jax
    import numpy as np

    import flax_attn as fa
    from benchmarks.run import _Deterministic, _FusedProjections

    mha = fa.MultiHeadAttention(16, 16, 8, 0.0, 4)
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    params = _Deterministic(mha).init(jax.random.key(0), x)
    want = _Deterministic(mha).apply(params, x)
    got = _FusedProjections(mha).apply(params, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cpuinfo, slug, kind", [
    ("cpu family\t: 26\nmodel\t\t: 2\n", "amd-epyc-family26-model2", "AMD EPYC (family 26, model 2, L2 1 MiB/core)"),
    ("cpu family\t: 25\nmodel\t\t: 17\n", "amd-epyc-family25-model17", "AMD EPYC (family 25, model 17, L2 1 MiB/core)"),
    ("", "amd-epyc", "AMD EPYC (L2 1 MiB/core)"),  # not published (not Linux, not x86)
])
def test_cpu_kinds_that_share_a_model_name_get_their_own_result_files(monkeypatch, cpuinfo, slug, kind):
    """Two generations of server CPUs both report the model name ``AMD EPYC`` under a hypervisor:
    the family and model numbers go into the result file's name and the tables' machine."""
    from benchmarks import cpu
    from flax_attn.core import tuning

    monkeypatch.setattr(cpu, "name", lambda: "AMD EPYC")
    monkeypatch.setattr(tuning, "_cpuinfo", lambda: cpuinfo)
    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 1 << 20)
    assert cpu.slug() == slug and cpu.kind() == kind


@pytest.mark.parametrize("lengths, message", [("2k", "whole numbers"), ("0,1024", "positive"), (",", "positive")])
def test_sweep_lengths_are_checked_before_any_work(capsys, lengths, message):
    """``--lengths`` that are not positive whole numbers stop the run at once (argparse's exit 2),
    naming the option and what it was given."""
    from benchmarks.run import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--lengths", lengths, "--parts", "sweep"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--lengths" in err and message in err and repr(lengths) in err


def test_tables_print_the_result_files_figures():
    """``benchmarks.tables`` renders a result file's own figures: each layer row with its time
    and ratio, one sweep row per length with a cell per contender, one decoding row per cell
    with its first contender's ratio; a file it does not read is refused, naming its keys."""
    import json
    from pathlib import Path

    from benchmarks import tables

    results = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
    run = json.loads((results / "cpu-amd-epyc-family26-model2-2cores.json").read_text())
    text = tables.tables(run)
    layer_lines = [line for line in tables.layer_table(run).splitlines()[2:]]
    assert len(layer_lines) == len({r["layer"] for r in run["gpt2_layer"]})
    for r in run["gpt2_layer"]:
        line = next(l for l in layer_lines if l.startswith(f"| {r['layer'].replace('(peer)', '(**peer**)')} |"))
        assert f"{r['seconds']:.3f} s | {r['ratio_to_peer']:.2f}x" in line
    assert "(**peer**) | " in text and text.count("| 1.00x |") >= 2  # the peer's own forward and forward+backward
    sweep_lines = tables.sweep_table(run).splitlines()
    lengths = sorted({r["T"] for r in run["length_sweep"]})
    assert len(sweep_lines) == 2 + len(lengths)
    assert all(line.count(" / ") == len({r["impl"] for r in run["length_sweep"]}) for line in sweep_lines[2:])
    decode_lines = tables.decode_table(run["decode_vs_torch"]).splitlines()[2:]
    firsts = [r for r in run["decode_vs_torch"] if r["contender"] == "flax_attn BKSH"]
    assert len(decode_lines) == len(firsts)
    assert [l.rsplit("|", 2)[1].strip() for l in decode_lines] == [f"{r['ratio_vs_torch']:.2f}x" for r in firsts]
    with pytest.raises(ValueError, match="not a result file"):
        tables.tables(json.loads((results / "parallel-amd-epyc-family26-model2.json").read_text()))


def test_tables_read_every_decode_result_file():
    """Every file of ``benchmarks.decode`` (steps, ``--loop``, ``--generation``) and
    ``benchmarks.decode_mla`` renders: one table line per row (steps: per cell), each ratio
    the row's own."""
    import json
    from pathlib import Path

    from benchmarks import tables

    files = [path for path in sorted((Path(__file__).resolve().parent.parent / "benchmarks" / "results").glob("decode*.json"))
             if not path.name.startswith("decode-gpu")]  # benchmarks.decode_gpu prints its own table
    kinds = set()
    for path in files:
        results = json.loads(path.read_text())
        text = tables.tables(results)
        body = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| batch", "| ---"))]
        rows = results["rows"]
        if "floor_bytes_per_step" in rows[0]:
            kinds.add("steps")
            continue  # decode_table: one line per cell, checked in test_tables_print_the_result_files_figures
        kinds.add("generation" if "slots_at_end" in rows[0] else "loop")
        assert len(body) == len(rows), path.name
        assert [line.rsplit("|", 2)[1].strip() for line in body] == [f"{r['ratio_vs_torch']:.2f}x" for r in rows]
    assert kinds == {"steps", "loop", "generation"}


@pytest.mark.parametrize("cold", [True, False])
def test_decode_steps_are_timed_cold_by_default(monkeypatch, cold):
    """``benchmarks.decode.timed_rows``: cold, every timed call is one step, preceded by one
    read of the eviction buffer outside its time, and the rows say how much was read; warm,
    rounds of ``STEPS`` steps and nothing read. The rows' times are per step either way."""
    import numpy as np

    from benchmarks import decode

    calls, reads = [], []
    monkeypatch.setattr(decode.cpu, "last_level_cache_bytes", lambda: 1 << 20)
    real = decode.evictor

    def counting():
        evict = real()
        counted = lambda: (reads.append(len(calls)), evict())[1]
        counted.nbytes = evict.nbytes
        return counted

    monkeypatch.setattr(decode, "evictor", counting)

    def run(n=decode.STEPS, num_threads=None):
        calls.append(n)
        return np.ones(3)

    rows = decode.timed_rows({"flax_attn BKSH": run}, run, repeats=3, floor=1e6, cold=cold, batch=1)
    contenders = {r["contender"] for r in rows}
    timed = calls[2 + len(contenders):]  # after the agreement check (2 calls) and one warm-up call per contender
    assert contenders >= {"flax_attn BKSH", "torch eager"}
    assert len(timed) == len(contenders) * (3 * decode.STEPS if cold else 3)
    assert set(timed) == {1 if cold else decode.STEPS}
    if cold:
        assert len(reads) == len(timed) and all(r["evicted_mib"] == 2 for r in rows)  # EVICT_TIMES x 1 MiB
        assert "each step cold (2 MiB read before it)" in decode.timing(rows)
    else:
        assert reads == [] and all(r["evicted_mib"] == 0 for r in rows)
        assert decode.timing(rows) == f"rounds of {decode.STEPS} steps, caches warm"
    assert all(r["ms_per_step"] > 0 for r in rows)


def test_generation_benchmark_grows_one_cache_and_checks_the_outputs(monkeypatch):
    """``benchmarks.decode.generation``: the allocated and the grown cache and PyTorch eager run
    the same generation (their last outputs agree, or it raises); the grown cache ends at whole
    blocks and its growth is timed; tiny sizes, no timing judged."""
    from benchmarks import decode

    # every one of the 120 steps is cold, after a read of twice the last-level cache: no time is
    # judged, so 2 MiB reads (a 1 MiB cache, as test_decode_steps_are_timed_cold_by_default
    # takes) instead of 600 MiB (a 300 MiB L3)
    monkeypatch.setattr(decode.cpu, "last_level_cache_bytes", lambda: 1 << 20)
    rows = {r["contender"]: r for r in decode.generation(1, 64, 40, 512)}
    assert set(rows) == {"flax_attn BKSH, allocated", "flax_attn BKSH, grown by reserve", "torch eager"}
    grown = rows["flax_attn BKSH, grown by reserve"]
    assert grown["slots_at_end"] == 128 and grown["growth_s"] > 0
    assert rows["flax_attn BKSH, allocated"]["slots_at_end"] == 512 and rows["torch eager"]["ratio_vs_torch"] == 1.0


def test_compilation_cache_option_goes_with_generation(capsys):
    from benchmarks import decode

    with pytest.raises(SystemExit):
        decode.main(["--compilation-cache", "/nonexistent"])
    assert "--compilation-cache goes with --generation" in capsys.readouterr().err


def _virtio(root, name, device, features):
    d = root / "bus/virtio/devices" / name
    d.mkdir(parents=True)
    (d / "device").write_text(device + "\n")
    (d / "features").write_text(features + "\n")


def test_free_page_reporting_is_read_from_the_balloons_feature_bit(tmp_path, capsys):
    """A virtio balloon (device 0x0005) with feature bit 5 hands free blocks of
    ``page_reporting_order`` back to the host: the block size is reported (Linux's default order
    9 where the module's parameter is not there); other devices with that bit, a balloon without
    it, unreadable entries and a machine without virtio give None. The report names it for runs
    with huge pages only."""
    import os

    from benchmarks import run

    page = os.sysconf("SC_PAGE_SIZE")
    assert run.free_page_reporting(tmp_path) is None                       # no virtio at all
    _virtio(tmp_path, "virtio0", "0x0002", "0" * 5 + "1" + "0" * 58)       # a block device: bit 5 is not reporting
    _virtio(tmp_path, "virtio1", "0x0005", "0110000" + "0" * 57)          # a balloon: statistics, deflate on OOM
    _virtio(tmp_path, "virtio2", "not hex", "1" * 64)
    assert run.free_page_reporting(tmp_path) is None
    _virtio(tmp_path, "virtio3", "0x0005", "011001" + "0" * 58)           # bit 5: free page reporting
    assert run.free_page_reporting(tmp_path) == page << 9
    params = tmp_path / "module/page_reporting/parameters"
    params.mkdir(parents=True)
    (params / "page_reporting_order").write_text("10\n")
    assert run.free_page_reporting(tmp_path) == page << 10

    results = {"machine": {"device": "cpu", "cpu_count": 2, "memory_gib": 23.5, "jax": "x", "torch": "y",
                           "dtype": "float32", "free_page_reporting_bytes": 2 << 20},
               "matmul_peak_tflops": 0.2, "gpt2_layer_config": {}}
    for host_memory, named in (("default allocator", False), (f"GLIBC_TUNABLES={run.HUGE_PAGES}", True)):
        run.print_report({**results, "host_memory": host_memory})
        assert ("hands free blocks of 2 MiB and up back to its host" in capsys.readouterr().out) is named


def _numpy_products(ops, ranges, mode):
    """The products :mod:`benchmarks.core` times, in float64 NumPy: the sum of their outputs."""
    total = 0.0
    units = {name: ops[name].astype(np.float64) for name in ("q", "k", "v", "dout")}
    for i in range(units["q"].shape[0]):
        q, k, v, dout = (units[name][i] for name in ("q", "k", "v", "dout"))
        for (q0, q1, k0, k1), (w, ds) in zip(ranges, ops["blocks"]):
            w, ds = w.astype(np.float64), ds.astype(np.float64)
            qi, ki, vi, di = q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], dout[:, q0:q1]
            outs = [qi @ ki.transpose(0, 2, 1), w @ vi]
            if mode != "forward":
                outs += [qi @ ki.transpose(0, 2, 1), di @ vi.transpose(0, 2, 1), ds @ ki,
                         w.transpose(0, 2, 1) @ di, ds.transpose(0, 2, 1) @ qi]
            total += sum(float(o.sum()) for o in outs)
    return total


@pytest.mark.parametrize("mode", ["forward", "forward+backward"])
def test_core_benchmark_times_the_products_it_names(mode):
    """``benchmarks.core``: the JAX and torch products programs both compute the products of the
    blocks given (two a block forward, seven forward+backward; their sums against float64
    NumPy), and the FLOP count is theirs."""
    from benchmarks import core

    shape = {"batch": 1, "heads": 4, "tokens": 64, "head_dim": 8}
    ranges = [(0, 32, 0, 32), (32, 64, 0, 64)]  # two causal query blocks of 32
    ops = core.inputs(shape, 2, ranges)
    want = _numpy_products(ops, ranges, mode)
    for run in (core.jax_products(ops, ranges, mode), core.torch_products(ops, ranges, mode)):
        assert float(run()) == pytest.approx(want, rel=1e-4)
    per_unit = 2 * (32 * 32 + 32 * 64) * 8
    assert core.product_flops(shape, ranges, mode) == 4 * per_unit * (2 if mode == "forward" else 7)


def test_core_benchmark_refuses_products_that_disagree_and_follows_the_library_plan():
    from benchmarks import core

    with pytest.raises(AssertionError, match="products disagree"):
        core.check_products_agree(lambda: np.float32(1.0), lambda: 1.01)
    bq, chunk, ranges = core.plan(8, 1024, 12, 64)  # GPT-2-small's core: causal blocks, whole units
    assert ranges[0][:3] == (0, bq, 0) and ranges[-1][1] == 1024
    assert all(k0 == 0 and k1 == q1 for q0, q1, k0, k1 in ranges) and (8 * 12) % chunk == 0
    rows = core.run(1, core.SMOKE_SHAPE)
    from flax_attn.core import native

    other_builds = [f"flax_attn core (cpu_native {isa})" for isa in native.ISAS
                    if isa != native.best_isa() and native.unavailable(isa) is None]  # avx2 beside avx512
    assert {(r["mode"], r["contender"]) for r in rows} == {
        (m, c) for m in core.MODES for c in ("flax_attn core", *other_builds, "flax_attn core (query_blocks)",
                                             "torch SDPA", "JAX products alone", "torch products alone")}
    assert all(r["ratio_vs_torch_sdpa"] == 1.0 for r in rows if r["contender"] == "torch SDPA")
    from benchmarks import tables

    text = tables.tables({"machine": core.machine(), "repeats": 1, "rows": rows})  # a result file renders
    body = [line for line in text.splitlines() if line.startswith("| forward")]
    assert [line.rsplit("|", 2)[1].strip() for line in body] == [f"{r['ratio_vs_torch_sdpa']:.2f}x" for r in rows]


def test_padded_benchmark_checks_agreement_and_names_the_automatic_choice(tmp_path):
    """``python -m benchmarks.padded --smoke`` in process: every contender timed in both modes
    (forward only for a decoding step's cell), flax_attn's output checked against PyTorch's
    before timing, the automatic choice named (the compiled kernel where it runs: it serves
    lengths), the result file written."""
    import json

    from benchmarks import padded
    from flax_attn.core import native

    out = tmp_path / "padded.json"
    padded.main(["--smoke", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    autos = {r["contender"] for r in rows if r["contender"].startswith("flax_attn (auto: ")}
    assert len(autos) == 1 and len(rows) == 3 * (len(padded.MODES) + 1)
    assert {(r["cell"], r["mode"], r["contender"]) for r in rows} == {
        (cell, mode, name) for cell, modes in (("smoke", padded.MODES), ("smoke-decode", ("forward",)))
        for mode in modes for name in (*autos, "flax_attn (blockwise)", "torch SDPA + mask")}
    if native.unavailable() is None:
        assert autos == {"flax_attn (auto: cpu_native)"}
    assert all(r["seconds"] > 0 for r in rows)
    assert "Padded attention" in padded.report(rows)
