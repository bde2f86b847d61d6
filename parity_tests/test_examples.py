"""The examples run and reach their own checks (each exits non-zero when its check fails)."""
import json
import pathlib
import subprocess
import sys

import pytest

from conftest import child_env

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


# tiny_decoder.py trains for 300 steps, which outlast their compilation: it runs with XLA's
# default flags (the user's), as the training example does (test_training.py); at the suite's
# optimisation level 0 its steps take about twice as long (58 against 36 s of CPU time).
@pytest.mark.slow
@pytest.mark.parametrize("script, expect, xla_defaults", [
    pytest.param(script, expect, script == "tiny_decoder.py", id=f"{script}-{expect}") for script, expect in [
        ("chapter_walkthrough.py", "22 of 22 printed numbers reproduced."),
        ("tiny_decoder.py", "same tokens: True"),
        ("nnx_decoder.py", "same tokens: True"),
        ("hf_checkpoint.py", "checkpoint round trip: OK"),
    ]])
def test_example_runs(script, expect, xla_defaults):
    name, *args = script.split()
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=300,
                            env=None if xla_defaults else child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert expect in result.stdout


# generate.py's three command lines run in one process (one start of Python and JAX instead of
# three): its main(argv) is what `python examples/generate.py ARGS` runs, and it exits non-zero
# (SystemExit) when the cached, one-program and uncached tokens disagree.
GENERATE_RUNS = ["--tokens 16", "--tokens 16 --layout blocks", "--tokens 16 --grow"]
GENERATE_CHILD = """
import runpy, sys
main = runpy.run_path(sys.argv[1], run_name="generate")["main"]
for args in sys.argv[2:]:
    print("=== generate.py " + args, flush=True)
    main(args.split())
"""


@pytest.mark.slow
def test_generate_example_runs_with_each_cache_option():
    result = subprocess.run([sys.executable, "-c", GENERATE_CHILD, str(EXAMPLES / "generate.py"), *GENERATE_RUNS],
                            capture_output=True, text=True, timeout=600, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    runs = result.stdout.split("=== generate.py ")[1:]
    assert [run.splitlines()[0] for run in runs] == GENERATE_RUNS
    for args, run in zip(GENERATE_RUNS, runs):
        assert "same tokens: True" in run, f"generate.py {args}:\n{run[-2000:]}"


# `python -m benchmarks.run ARGS`, with the last-level cache taken for 1 MiB: its decoding steps
# are timed cold, each after a read of twice that cache (600 MiB on a 300 MiB L3, some 130 times
# in the smoke run: 10 of its 47 s). No timing is judged, so the reads are 2 MiB (as in
# test_benchmarks.py's test of the cold timing); everything else runs as from the command line.
SMALL_CACHE_RUN = ("import runpy, benchmarks.cpu; benchmarks.cpu.last_level_cache_bytes = lambda: 1 << 20; "
                   "runpy.run_module('benchmarks.run', run_name='__main__', alter_sys=True)")


@pytest.mark.slow
def test_benchmark_suite_runs(tmp_path):
    # Tiny sizes, one repeat: checks that the suite runs and writes its files. No timing is judged.
    root = EXAMPLES.parent
    result = subprocess.run([sys.executable, "-c", SMALL_CACHE_RUN, "--smoke", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=600, cwd=root, env=child_env())
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".png"]
    assert "KV-cache decoding" in result.stdout
    assert "KV-cache decode step" in result.stdout  # against PyTorch eager (benchmarks.decode)
    assert "Absorbed multi-head latent attention decode step" in result.stdout  # benchmarks.decode_mla
    [written] = tmp_path.glob("*.json")
    # on a CPU the layer is timed once more with its projections in the form the CPU does not take
    layers = {r["layer"] for r in json.loads(written.read_text())["gpt2_layer"]}
    assert any(name.startswith("flax_attn MultiHeadAttention (auto), projections as ") for name in layers), layers
    rendered = subprocess.run([sys.executable, "-m", "benchmarks.tables", str(written)],
                              capture_output=True, text=True, timeout=120, cwd=root)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    for title in ("GPT-2-small causal layer", "length sweep", "Decoding step against PyTorch eager",
                  "Absorbed latent attention decoding step", "Cached generation"):
        assert title in rendered.stdout


@pytest.mark.slow
def test_benchmark_options_name_their_result_files(tmp_path):
    # A partial run of chosen sweep contenders under glibc's huge-page tunable (the run re-executes
    # itself with it set): the file name and the report say all three; a contender that does not
    # exist is refused with the list of those that do.
    root = EXAMPLES.parent
    run = lambda *args: subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(tmp_path),
                                        *args], capture_output=True, text=True, timeout=600, cwd=root,
                                        env=child_env())
    result = run("--parts", "sweep", "--sweep-impls", "jax.nn, torch SDPA", "--huge-pages")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    [written] = tmp_path.glob("*.json")
    assert written.name.endswith("-smoke-sweep-jaxnn-torchSDPA-hugetlb.json")
    assert "GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in result.stdout
    report = json.loads(written.read_text())
    assert {row["impl"] for row in report["length_sweep"]} == {"jax.nn", "torch SDPA"}
    refused = run("--parts", "sweep", "--sweep-impls", "jax.nn,flash")
    assert refused.returncode == 2 and "--sweep-impls: ['flash'] not among" in refused.stderr
