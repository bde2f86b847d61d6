"""flax_attn.core.tuning's keep_host_memory: XLA's per-call temporaries reuse freed host memory
instead of being faulted in anew at every call (Linux with glibc); a call after JAX has started
is refused. And the environment the README gives instead (glibc's malloc asking for transparent
huge pages): the same program faults far fewer pages in."""
import functools
import os
import platform
import subprocess
import sys

import pytest

CHILD = r"""
import resource, statistics, sys
import flax_attn as fa
applied = fa.keep_host_memory() if sys.argv[1] == "keep" else None
import jax, jax.numpy as jnp
x = jnp.ones((8, 1024, 12, 64), jnp.float32)  # GPT-2-small's attention core
f = jax.jit(lambda x: fa.dot_product_attention(x, x, x, is_causal=True, implementation="blockwise"))
temp = f.lower(x).compile().memory_analysis().temp_size_in_bytes
for _ in range(4):  # the heap settles after a few calls
    f(x).block_until_ready()
per_call = []
for _ in range(7):  # the median call: on a busy host a call now and then still maps a buffer anew
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    per_call.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
faults = statistics.median(per_call)
try:
    fa.keep_host_memory()
    late = "accepted"
except RuntimeError as e:
    late = str(e)
print(applied, faults, temp, late, sep="\n")
"""


@functools.lru_cache(maxsize=None)  # the default child serves both tests where they share a process
def _child(mode, **environment):
    # XLA's default compilation, as users run it (the suite's faster-compiling flags change which
    # buffers the program allocates: at optimisation level 0 its output is mapped anew per call)
    env = {**os.environ, "XLA_FLAGS": "", **environment}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True,
                         env=env).stdout
    applied, faults, temp, late = out.strip().split("\n", 3)
    return applied, float(faults), int(temp), late


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_keep_host_memory_stops_per_call_page_faults():
    applied, kept_faults, temp, late = _child("keep")
    _, default_faults, _, _ = _child("default")
    assert applied == "True"
    pages = temp // 4096  # the program's temporaries in pages of 4 KiB: the default allocator maps them anew
    assert temp > 64 << 20 and default_faults > pages, (temp, default_faults)
    # kept: none in most calls; in a few, on a busy host, some buffers (e.g. outputs of 6,144 pages)
    # are still mapped anew (measured with three other busy processes: 12,288-24,578 in 1-2 calls of 8)
    assert kept_faults < default_faults / 2, (kept_faults, default_faults)
    assert late.startswith("keep_host_memory() must run before JAX runs anything")


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]  # the mode in brackets: always, madvise or never
    except (OSError, IndexError):
        return "unknown"


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
                    or tuple(map(int, platform.libc_ver()[1].split(".")[:2])) < (2, 35)
                    or _transparent_huge_pages() not in ("always", "madvise"),
                    reason="glibc >= 2.35's malloc tunable and transparent huge pages")
def test_huge_page_malloc_faults_far_fewer_pages():
    _, default_faults, temp, _ = _child("default")
    _, huge_faults, _, _ = _child("default", GLIBC_TUNABLES="glibc.malloc.hugetlb=1")
    assert default_faults > temp // 4096, (temp, default_faults)
    # 2 MiB pages where glibc maps memory: measured 20,500 -> 2,300 faults per call (some
    # buffers are still faulted in 4 KiB pages)
    assert huge_faults < default_faults / 4, (huge_faults, default_faults)


def test_cpu_flags_are_read_from_the_first_flags_line():
    """has_avx512 reads /proc/cpuinfo's flags; the parser takes the first processor's line."""
    from flax_attn.core.tuning import _parse_flags
    text = ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512bw\n\n"
            "processor\t: 1\nflags\t\t: fpu\n")
    assert _parse_flags(text) == {"fpu", "sse2", "avx2", "avx512f", "avx512bw"}
    assert _parse_flags("processor\t: 0\n") == frozenset()


def test_fa_jit_compiles_with_the_options_and_declares_them(monkeypatch):
    """fa.jit traces under tuning.compiled_with its options (the machine's by default) and
    computes what jax.jit does: query blocks with one unit a step where YNNPACK is off, two
    otherwise (multi-head attention), and the same outputs and gradients."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import flax_attn as fa
    from flax_attn.core import QueryBlocks, tuning
    from flax_attn.core.call import describe

    if not tuning._ynnpack_off_accepted():
        pytest.skip("this jaxlib has no YNNPACK fusion option")
    seen = []

    def probe(x):
        seen.append(tuning.ynnpack_fusions_off())
        return x + 1

    for options, declared in (({}, False), (tuning.YNNPACK_OFF, True), (None, tuning.cpu_compiler_options() != {})):
        assert float(fa.jit(probe, compiler_options=options)(1.0)) == 2.0
        assert seen[-1] is declared, options
    assert not tuning.ynnpack_fusions_off()
    with pytest.raises(TypeError, match="compiler_options must be a dict or None, got list"):
        fa.jit(probe, compiler_options=[])

    monkeypatch.setattr(tuning, "l2_cache_bytes", lambda: 512 << 10)  # AMD EPYC family 25's
    q = jax.ShapeDtypeStruct((8, 1024, 12, 64), jnp.float32)
    call = describe(q, q, q, is_causal=True, platform="cpu")
    blocks = QueryBlocks()
    assert blocks._step_units(call, 8, 128, 1024)[1] == 2
    with tuning.compiled_with(tuning.YNNPACK_OFF):
        assert blocks._step_units(call, 8, 128, 1024)[1] == 1
        assert QueryBlocks(min_units=2)._step_units(call, 8, 128, 1024)[1] == 2

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 40, 4, 8)), jnp.float32) for _ in range(3))
    run = lambda q, k, v: fa.dot_product_attention(q, k, v, is_causal=True,  # noqa: E731
                                                   implementation=QueryBlocks(block_q=8, chunk_bytes=1))
    grad = jax.grad(lambda *a: jnp.sum(jnp.sin(run(*a))), argnums=(0, 1, 2))
    for f in (run, grad):
        got, want = fa.jit(f, compiler_options=tuning.YNNPACK_OFF)(q, k, v), jax.jit(f)(q, k, v)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


def test_keys_stored_takes_a_layout_and_ends_with_its_block():
    from flax_attn.core import tuning

    with tuning.keys_stored("BKSH"):
        assert tuning.keys_stored_as() == "BKSH"
        with tuning.keys_stored(None):  # an attention over keys as given, inside
            assert tuning.keys_stored_as() is None
        assert tuning.keys_stored_as() == "BKSH"
    assert tuning.keys_stored_as() is None
    with tuning.keys_stored("blocks", 128):
        assert tuning.keys_stored_as() == "blocks" and tuning.keys_block() == 128
    assert tuning.keys_block() is None
    with pytest.raises(ValueError, match=r"keys_stored layout must be one of \[None, 'BKSH', 'BSKH', 'blocks'\], got 'bksh'"):
        with tuning.keys_stored("bksh"):
            pass


def test_query_blocks_step_logits_are_at_most_two_mib_by_default(monkeypatch):
    """A step of the query blocks takes the units whose block logits fit twice the per-core L2,
    but at most MAX_CHUNK_BYTES (2 MiB): on a 2 MiB L2 (Intel's) two 256 x 1,024 float32 units,
    not four; on a 512 KiB L2 (AMD's family 25, model 1) the minimum of two."""
    import jax
    import jax.numpy as jnp

    from flax_attn.core import QueryBlocks, tuning
    from flax_attn.core.call import describe
    from flax_attn.core.query_blocks import MAX_CHUNK_BYTES

    assert MAX_CHUNK_BYTES == 2 << 20
    q = jax.ShapeDtypeStruct((8, 1024, 12, 64), jnp.float32)
    call = describe(q, q, q, is_causal=True, platform="cpu")
    for l2, units in ((2 << 20, 2), (1 << 20, 2), (512 << 10, 2), (4 << 20, 2)):
        monkeypatch.setattr(tuning, "l2_cache_bytes", lambda l2=l2: l2)
        assert QueryBlocks(min_units=1)._step_units(call, 8, 256, 1024)[1] == min(2 * l2, MAX_CHUNK_BYTES) // (4 * 256 * 1024)
        assert QueryBlocks()._step_units(call, 8, 256, 1024)[1] == units
    assert QueryBlocks(chunk_bytes=4 << 20)._step_units(call, 8, 256, 1024)[1] == 4  # given: taken as is
