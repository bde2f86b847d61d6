"""Shared helpers for the parity suite.

JAX runs with x64 enabled so float64 comparisons are real; float32 tests build float32
arrays explicitly. Matmul precision is 'highest' for float32.

The suite's time is compile time (thousands of small programs), so the test processes compile
with XLA's CPU backend optimisation level 0 and its older fusion emitters (``TEST_XLA_FLAGS``:
together they take the whole suite from 29 to 17 minutes of CPU time; the same HLO passes run,
only the machine code differs). The results are held to the same tolerances. A flag this
jaxlib does not know would abort JAX, so each is first tried in a child process (once, by the
first process; the test workers inherit the answer). Processes started by tests (the examples,
the benchmark's smoke run) compile with them too (``child_env``), except where a test measures
XLA's default program or a child runs longer than it compiles (the training example). Set
``XLA_FLAGS`` with an ``xla_backend_optimization_level`` of your own to override.

JAX's persistent compilation cache: unless ``JAX_COMPILATION_CACHE_DIR`` is set, the run's
processes (the controller and its xdist workers) share one in a fresh temporary directory, which
the controller removes at its exit, and keep every program in it: a program that a test compiles
again (the plain reference of a case checked against several implementations, a layer's steps,
in another worker) is read instead of compiled (two conformance and core files: 213 against
197 s; a fresh directory each run, so a run never reads a program an earlier one compiled).

Python's cyclic garbage collector: every test process ends up holding millions of long-lived
objects (JAX's caches of traced and compiled programs), and each full collection walked all of
them again (1-3 s each, about 5% of the suite's CPU time). After every test the young
generations are collected and everything still alive is frozen (``gc.freeze``), so later full
collections look only at what later tests create. Nothing a test checks depends on when garbage
is collected.

Error measure and tolerances: ``torch_ref.compare`` (max|a - b| / max|b| over a tensor;
float64 1e-12, float32 1e-5).
"""
from __future__ import annotations

import atexit
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax

# benchmarks/ is not installed: the tests of its plumbing import it from the repository root
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _accepted_flags(candidates=("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")):
    """The candidate flags this jaxlib accepts (an unknown XLA flag aborts the process that reads it)."""
    known = os.environ.get("FLAX_ATTN_TEST_XLA_FLAGS")
    if known is not None:
        return known

    def accepted(flags):
        env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                              capture_output=True).returncode == 0

    flags = candidates if accepted(candidates) else [f for f in candidates if accepted([f])]
    os.environ["FLAX_ATTN_TEST_XLA_FLAGS"] = " ".join(flags)  # inherited by the test workers
    return os.environ["FLAX_ATTN_TEST_XLA_FLAGS"]


TEST_XLA_FLAGS = _accepted_flags()
_user_flags = os.environ.get("XLA_FLAGS")
if "xla_backend_optimization_level" not in (_user_flags or ""):
    os.environ["XLA_FLAGS"] = f"{_user_flags or ''} {TEST_XLA_FLAGS}".strip()
    jax.devices()  # the CPU backend reads XLA_FLAGS once, when it starts: now
    if _user_flags is None:  # child processes get the user's flags
        del os.environ["XLA_FLAGS"]
    else:
        os.environ["XLA_FLAGS"] = _user_flags


def _share_compilation_cache() -> None:
    """One persistent compilation cache for the run's processes (see the module docstring)."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the user's own cache: left as it is
        return
    path = os.environ.get("FLAX_ATTN_TEST_COMPILATION_CACHE")
    if path is None:  # the first process (the controller): the workers inherit the variable
        path = tempfile.mkdtemp(prefix="flax_attn-tests-xla-")
        os.environ["FLAX_ATTN_TEST_COMPILATION_CACHE"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_share_compilation_cache()


def child_env(**extra) -> dict:
    """The environment of a process a test starts (an example, the benchmark's smoke run, a
    writer): this one's, with the suite's faster-compiling ``TEST_XLA_FLAGS`` added to the
    user's ``XLA_FLAGS`` unless those set an optimisation level, and ``extra``. Such a child
    checks that a script runs and reaches its checks, which compile time dominates; the README's
    main command runs the chapter's examples with XLA's default flags."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        flags = f"{flags} {TEST_XLA_FLAGS}".strip()
    return {**os.environ, "XLA_FLAGS": flags, **extra}


jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")
# Lowering attaches each operation's Python traceback to it as a location (up to 100 frames by
# default): debugging information only, which the suite's thousands of programs do not read
# (layers/test_cache.py: 43 -> 38 s of lowering, 145 -> 137 s in all).
jax.config.update("jax_include_full_tracebacks_in_locations", False)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from torch_ref.compare import TOLERANCE as TOL  # noqa: E402
from torch_ref.compare import compare_function, compare_module, max_rel_error  # noqa: E402

DTYPES = [np.float64, np.float32]

# "Your journey starts with one step": the chapter's six 3-d token embeddings.
CHAPTER_INPUTS = np.array(
    [[0.43, 0.15, 0.89],
     [0.55, 0.87, 0.66],
     [0.57, 0.85, 0.64],
     [0.22, 0.58, 0.33],
     [0.77, 0.25, 0.10],
     [0.05, 0.80, 0.55]],
    dtype=np.float32,
)


def assert_close(actual, expected, dtype, what: str = "") -> float:
    tol = TOL[np.dtype(dtype)]
    err = max_rel_error(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.3e} > {tol:.0e}"
    return err


def assert_all_ok(measurements) -> float:
    """Assert every measurement of torch_ref.compare is within its tolerance; return the worst."""
    bad = [m for m in measurements if not m.ok]
    assert not bad, "; ".join(f"{m.what}: {m.error:.3e} > {m.tolerance:.0e}" for m in bad)
    return max(m.error for m in measurements)


def run_parity(torch_module, flax_module, inputs, dtype, *, torch_call_kwargs=None, flax_kwargs=None,
               seed=0, eager=False):
    """Outputs and gradients (inputs and every parameter) of flax_module with torch_module's weights,
    under jit; ``eager=True`` also checks the op-by-op forward equals the jitted one."""
    return assert_all_ok(compare_module(torch_module, flax_module, inputs, dtype, torch_call_kwargs=torch_call_kwargs,
                                        flax_kwargs=flax_kwargs, seed=seed, eager=eager))


def run_function_parity(torch_fn, jax_fn, inputs, dtype, *, seed=0, eager=False):
    """Outputs and input gradients of ``jax_fn`` against ``torch_fn`` (under jit; see run_parity)."""
    return assert_all_ok(compare_function(torch_fn, jax_fn, inputs, dtype, seed=seed, eager=eager))


def assert_printed(actual, printed, what: str = "") -> None:
    """Equal to a printed table at its four decimals (rounding half away from zero)."""
    actual = np.asarray(actual, np.float64)
    printed = np.asarray(printed, np.float64)
    assert actual.shape == printed.shape, f"{what}: shape {actual.shape} != printed {printed.shape}"
    # A printed x.xxxx means the value lies within half a unit of the last digit (plus float slack).
    bad = np.abs(actual - printed) > 0.5e-4 + 1e-7
    assert not bad.any(), f"{what}: {actual[bad]} differ from printed {printed[bad]}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each test: collect the young generations, then freeze what survives (see above)."""
    yield
    gc.collect(1)
    gc.freeze()


@pytest.fixture
def chapter_inputs():
    return CHAPTER_INPUTS.copy()

