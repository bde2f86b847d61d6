"""Tile sizes of the blocked cores, derived from the machine's caches (no timing at run time).

A step of the blockwise core (:mod:`flax_attn.core.blockwise`) is one ``block_q x block_k``
tile of logits for each (batch row, key/value head) unit; a step of the query blocks
(:mod:`flax_attn.core.query_blocks`) is one block of queries against its keys. Per step a
``bq x bk`` tile touches, in the accumulation dtype (4 bytes for float32), the logits and the
weights of the tile and the running output, and, in the input dtype, the tile's queries, keys
and values:

    work(bq, bk) = 4 (2 bq bk + bq Hv) + itemsize (bq H + bk H + bk Hv)   bytes.

:func:`block_sizes` gives the largest square tile among 512, 256, 128, 64 whose working set
fits a cache (by default half the per-core L2: 128 x 128 for 64-dim float32 heads on 1 MiB);
the query blocks size their blocks with it. :func:`blockwise_tiles` gives the blockwise core's
tile: the largest whose logits fit the L2 caches of two cores (512 x 512 there), where a step's
matmuls are large enough for XLA's CPU runtime to spread over the cores (measurements in its
docstring); :func:`blockwise_forward_tiles` the larger tile of a call that is not
differentiated (1,024 x 1,024 there). Where the cache size cannot be read (not Linux, or no
sysfs), 1 MiB is assumed. :func:`has_avx512` reads the CPU's instruction-set flags
(``/proc/cpuinfo``), on which one choice of matmul form depends
(:func:`flax_attn.core.numerics.weighted_values`); :func:`projections_as_convolutions` its
vendor and family, on which the form of the layers' large projections depends
(:func:`flax_attn.layers.common.dense`; :func:`projections_as` chooses it for a trace).
:func:`compiled_with` declares, while a function is traced, the XLA compile options its
program will get (:func:`flax_attn.decode_step` does), for the forms that are fast only under
them (:func:`ynnpack_fusions_off`).

The results depend only on the machine and the shapes (and on :func:`projections_as`, where a
trace is wrapped in it), so that a program traced twice on one machine is the same program;
pass ``Blockwise(block_q=..., block_k=...)`` or ``QueryBlocks(block_q=...)`` to override.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from pathlib import Path
from typing import Optional

DEFAULT_L2_BYTES = 1 << 20
TILES = (512, 256, 128, 64)
FORWARD_TILES = (1024,) + TILES


def _parse_size(text: str) -> Optional[int]:
    """'1024K' / '2M' / '32768' (sysfs spelling) -> bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdigit() else None


@functools.lru_cache(maxsize=None)
def cache_bytes() -> dict:
    """CPU 0's data (or unified) caches from Linux sysfs: ``{level: bytes}`` (empty where sysfs
    cannot be read)."""
    sizes = {}
    try:
        for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
            if kind in ("Data", "Unified") and size:
                sizes[int((index / "level").read_text().strip())] = size
    except (OSError, ValueError):
        pass
    return sizes


@functools.lru_cache(maxsize=None)
def l2_cache_bytes() -> int:
    """The per-core L2 data (or unified) cache of CPU 0 in bytes, from Linux sysfs; 1 MiB if unknown."""
    return cache_bytes().get(2, DEFAULT_L2_BYTES)


def _cpu_field(cpuinfo: str, field: str) -> Optional[str]:
    """The first value of ``field`` in a ``/proc/cpuinfo`` text, or None."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def _parse_flags(cpuinfo: str) -> frozenset:
    """The first ``flags`` line of a ``/proc/cpuinfo`` text, as a set of words."""
    return frozenset((_cpu_field(cpuinfo, "flags") or "").split())


@functools.lru_cache(maxsize=None)
def _cpuinfo() -> str:
    """``/proc/cpuinfo``'s text, read once; empty where it cannot be read (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_field(field: str) -> Optional[str]:
    """The first processor's ``field`` in Linux's ``/proc/cpuinfo`` (e.g. ``'model name'``,
    ``'cpu family'``), or None where it is not published (not Linux, not x86)."""
    return _cpu_field(_cpuinfo(), field)


def cpu_flags() -> frozenset:
    """The instruction-set flags of the CPU (``/proc/cpuinfo``'s ``flags`` on Linux; empty where
    it cannot be read)."""
    return _parse_flags(_cpuinfo())


def has_avx512() -> bool:
    """Whether the CPU has AVX-512 (``avx512f``): XLA's CPU matmul kernels differ by vector width,
    and some choices between two forms of one product follow it
    (:func:`flax_attn.core.numerics.weighted_values`)."""
    return "avx512f" in cpu_flags()


def _values_matvec_as_two_rows(cpuinfo: str) -> bool:
    return _cpu_field(cpuinfo, "vendor_id") == "AuthenticAMD" and "avx512f" in _parse_flags(cpuinfo)


def values_matvec_as_two_rows() -> bool:
    """Whether a long one-row values' matmul (a multi-head decoding step's weights against the
    cached values) runs beside a row of zeros on this CPU
    (:func:`flax_attn.core.numerics.weighted_values`): on AMD CPUs with AVX-512, where XLA's
    two-row matmul read the values faster than its matrix-vector kernel. Not on Intel's
    AVX-512 CPUs, where it read them at half the speed
    (96 units of 8,320 keys of 64, float32, each product cold, 2-core Intel Xeon of family 6,
    model 207: one row 23.4 GB/s, two rows 11.3; 96 units of 1,152 keys 17.5 / 9.3; 16 units of
    8,320 keys 18.4 / 10.7), nor without AVX-512 (AMD's family 25, model 1: 17.7 / 8.8).
    False where ``/proc/cpuinfo`` cannot be read."""
    return _values_matvec_as_two_rows(_cpuinfo())


def _intel_avx512(cpuinfo: str) -> bool:
    return _cpu_field(cpuinfo, "vendor_id") == "GenuineIntel" and "avx512f" in _parse_flags(cpuinfo)


def _projections_as_convolutions(cpuinfo: str) -> bool:
    vendor, family = _cpu_field(cpuinfo, "vendor_id"), _cpu_field(cpuinfo, "cpu family")
    amd_family_25 = vendor == "AuthenticAMD" and family == "25" and "avx512f" in _parse_flags(cpuinfo)
    return amd_family_25 or _intel_avx512(cpuinfo)


LARGE_PROJECTION_ROWS = 4096
"""From this many rows on, :func:`flax_attn.layers.common.dense` on CPU takes one of its forms
for large products; on Intel's CPUs with AVX-512, from :data:`INTEL_LARGE_PROJECTION_ROWS`."""
INTEL_LARGE_PROJECTION_ROWS = 1024
"""Intel's (AVX-512) threshold of :func:`large_projection_rows`: the 1,024-token row chunks of
a layer's forward (:func:`flax_attn.layers.common.by_row_chunks`) take the convolution there."""


def _large_projection_rows(cpuinfo: str) -> int:
    return INTEL_LARGE_PROJECTION_ROWS if _intel_avx512(cpuinfo) else LARGE_PROJECTION_ROWS


def large_projection_rows() -> int:
    """The fewest rows from which :func:`flax_attn.layers.common.dense` writes a product on CPU
    in its form for large products (:func:`projections_as_convolutions`): 1,024 on Intel's CPUs
    with AVX-512, 4,096 elsewhere.

    On a 2-core Intel Xeon of family 6, model 207, three 768 x 768 projections (float32, in
    turns in one process) as a dot (YNNPACK) against the convolution (Eigen), in ms: 64 rows
    2.09 / 2.50, 256 rows 5.54 / 5.45, 512 rows 10.4 / 9.6, 1,024 rows 20.0 / 18.0, 2,048 rows
    42.3 / 36.7; the GPT-2-small layer's forward (8 x 1,024 tokens, chunks of 1,024 tokens)
    took 0.436 / 0.406 s with dots (the same program twice) against 0.344 s with convolutions
    from 1,024 rows and 0.387 s from 4,096 rows with chunks of 4,096 tokens (PyTorch's SDPA
    layer 0.305 s). Not measured elsewhere at 1,024 rows."""
    return _large_projection_rows(_cpuinfo())


PROJECTIONS_ENV = "FLAX_ATTN_PROJECTIONS_AS_CONVOLUTIONS"
"""Environment variable that overrides :func:`projections_as_convolutions`: ``1`` or ``0``."""

PROJECTION_FORMS = ("convolution", "dot")
_PROJECTIONS: contextvars.ContextVar = contextvars.ContextVar("flax_attn_projections", default=None)


@contextlib.contextmanager
def projections_as(form: str):
    """Functions traced under it write the layers' large projections as ``form``:
    ``'convolution'`` (a 1-wide convolution over the rows, run on XLA's Eigen matmul) or
    ``'dot'`` (a dot with the kernel read transposed), whatever this CPU's default
    (:func:`projections_as_convolutions`) and :data:`PROJECTIONS_ENV` say. The form is fixed
    when a function is traced: wrap the first call of a ``jax.jit`` function (or its
    ``.lower``), not later calls::

        with flax_attn.projections_as("dot"):
            compiled = jax.jit(ensemble_step).lower(params, batch).compile()

    ``benchmarks.run`` times the layer in the form this CPU does not take by default this way.

    Raises:
      ValueError: ``form`` is not one of :data:`PROJECTION_FORMS`.
    """
    if form not in PROJECTION_FORMS:
        raise ValueError(f"projections_as(form=...) takes one of {PROJECTION_FORMS}, got {form!r}")
    token = _PROJECTIONS.set(form)
    try:
        yield
    finally:
        _PROJECTIONS.reset(token)


def projections_as_convolutions() -> bool:
    """Whether :func:`flax_attn.layers.common.dense` writes a large projection on this CPU as a
    1-wide convolution (run on XLA's Eigen matmul) rather than as a dot (a YNNPACK fusion, with
    the kernel read transposed): on AMD's family 25 with AVX-512 (Zen 4, whose 512-bit operations
    run on 256-bit units), where XLA's Eigen kernel ran the projections' matmuls at 183-211
    GFLOP/s against YNNPACK's 154-178 (2 cores, model 17), and on Intel's with AVX-512: on a
    2-core Xeon of family 6, model 207, 8,192 x 768 x 768 forward took 43.8 ms as the
    convolution, 57.5 as a dot and 59.3 with the kernel read transposed (PyTorch 40.9), and the
    GPT-2-small layer's forward+backward 1.377 s against 1.525 s with the transposed kernel
    (PyTorch's SDPA layer 1.061 s, same run; in two A/B processes after it 1.24 / 1.27 s and
    1.29 / 1.26 s, within the host's spread); there from :func:`large_projection_rows` (1,024)
    rows on. Elsewhere kept as before: on AMD's family 26 (full-width AVX-512) YNNPACK's kernels
    reached 343-407 GFLOP/s, nearly twice PyTorch's. False where ``/proc/cpuinfo`` cannot be
    read.

    Inside :func:`projections_as` its form decides. Otherwise :data:`PROJECTIONS_ENV` set to
    ``1`` or ``0`` before the first call overrides the machine's choice for the process. Both
    serve programs that ``jax.vmap`` a layer over its parameters (an ensemble), where the
    convolution becomes a grouped convolution that XLA does not turn into a dot (4 members of
    4,096 x 256 x 256, float32, same machine: 23.4 against 13.3 ms forward, 77 against 28 ms
    forward+backward): trace them as ``'dot'``. Mapping over the inputs alone (per-example
    gradients) is not affected (14.2 against 23.5 ms for per-example kernel gradients there)."""
    form = _PROJECTIONS.get()
    if form is not None:
        return form == "convolution"
    return _machine_projections_as_convolutions()


@functools.lru_cache(maxsize=None)
def _machine_projections_as_convolutions() -> bool:
    """:func:`projections_as_convolutions` outside :func:`projections_as`: the environment
    variable, else the CPU (read once)."""
    setting = os.environ.get(PROJECTIONS_ENV)
    if setting is not None:
        if setting not in ("0", "1"):
            raise ValueError(f"{PROJECTIONS_ENV} must be '0' or '1', got {setting!r}")
        return setting == "1"
    return _projections_as_convolutions(_cpuinfo())


YNNPACK_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}
"""XLA compile options that turn off XLA's YNNPACK fusions on CPU (its matmuls then run on its
Eigen kernels): :func:`cpu_compiler_options`."""


@functools.lru_cache(maxsize=None)
def _ynnpack_off_accepted() -> bool:
    """Whether this jaxlib knows :data:`YNNPACK_OFF`'s option (an unknown one fails to compile)."""
    import jax
    import numpy as np

    try:
        jax.jit(lambda x: x + 1, compiler_options=YNNPACK_OFF)(np.float32(0))
        return True
    except Exception:  # noqa: BLE001 -- any failure means: compile without it
        return False


def cpu_compiler_options() -> dict:
    """XLA compile options for flax_attn's programs on this machine: on a CPU without AVX-512,
    :data:`YNNPACK_OFF` where this jaxlib accepts it; otherwise none. A decoding step of
    :func:`flax_attn.decode_step` is compiled with them by default; pass them to the ``jax.jit``
    of a training step (``jax.jit(train_step, compiler_options=cpu_compiler_options())``). No
    result depends on them.

    **Decoding.** A step's matmuls have few rows (a token per batch row: projections of 1-8
    rows, grouped queries' 2-16 rows against the cache) and are bound by reading their weights
    and the cache. On a 2-core AMD EPYC of family 25 (AVX2, no AVX-512) XLA's Eigen kernels ran
    them faster than its YNNPACK fusions: a step of a 768-wide, 12-query-head RoPE layer, in
    turns in one process, default against YNNPACK off (ms): 12 key/value heads, batch 8 / 1,
    1,024 tokens: 7.58 -> 7.34, 1.77 -> 1.61; 1,024 of 8,192 slots at batch 8: 14.0 -> 13.6;
    2 key/value heads, batch 8, 1,024 tokens: 5.21 -> 4.47 and 5.70 -> 5.05 (two runs), batch
    1: 1.23 -> 1.19, 8,192 tokens: 3.65 -> 2.75. The one step where it was not faster: batch
    1 with 1,024 of 8,192 slots filled (key blocks, one-row matmuls), 2.51 -> 2.81, 2.96 ->
    2.90 and 2.11 -> 2.04 in three runs (within this host's noise), with 3,000 filled 4.78 ->
    4.97. A 1,024-token prefill through the same step (one program with the steps): 149.6 ->
    114.8 ms at batch 1, 1,059 -> 937 ms at batch 8, 68.8 -> 73.0 ms with 2 key/value heads at
    batch 1. In a full benchmark run after the change the grouped-query steps went from 1.04x,
    1.52x, 1.18x, 1.29x PyTorch eager to 0.94x, 1.15x, 0.77x, 0.89x.

    **Training.** The GPT-2-small layer (batch 8, 1,024 tokens, 768 wide, 12 heads, float32),
    same machine, three runs in turns with the PyTorch SDPA layer in one process: forward and
    backward 1.164x / 1.128x / 1.132x PyTorch's time with XLA's defaults, 1.090x / 1.030x /
    1.055x with these options; the forward alone 0.889x / 1.006x / 0.899x against 1.030x /
    1.100x / 0.914x (no better). On the earlier AMD EPYC kind YNNPACK off made the layer no
    faster (1.09x / 1.19x against 1.09x / 1.14x with the defaults). CPUs with AVX-512 keep
    XLA's defaults: on the AMD EPYC of family 25, model 17 (AVX-512), with YNNPACK off the
    layer's forward took 1.08x / 0.98x PyTorch's time against 0.96x / 0.87x with the defaults
    and forward+backward 1.03x / 0.98x against 1.04x / 1.00x (two runs in turns), although
    there the projections' 8,192 x 768 x 768 matmul alone ran at 190 GFLOP/s on XLA's Eigen
    kernel against 164 on YNNPACK's (``benchmarks/HISTORY.md``).
    """
    import jax

    if jax.default_backend() != "cpu" or has_avx512() or not _ynnpack_off_accepted():
        return {}
    return dict(YNNPACK_OFF)


_TRACED_OPTIONS: contextvars.ContextVar = contextvars.ContextVar("flax_attn_traced_compiler_options", default=None)


@contextlib.contextmanager
def compiled_with(compiler_options: dict):
    """Declares, while a function is traced, the XLA compile options its program will get
    (``jax.jit``'s ``compiler_options``), for the forms that depend on them
    (:func:`ynnpack_fusions_off`). :func:`flax_attn.decode_step` traces its step under it.
    Tracing elsewhere (a plain ``jax.jit``) declares nothing: XLA's defaults."""
    token = _TRACED_OPTIONS.set(dict(compiler_options))
    try:
        yield
    finally:
        _TRACED_OPTIONS.reset(token)


def ynnpack_fusions_off() -> bool:
    """Whether the function being traced was declared (:func:`compiled_with`) to compile
    with :data:`YNNPACK_OFF`'s option, XLA's YNNPACK fusions off."""
    options = _TRACED_OPTIONS.get()
    return options is not None and options.get("xla_cpu_experimental_ynn_fusion_type") == ""


_KEYS_STORED: contextvars.ContextVar = contextvars.ContextVar("flax_attn_keys_stored", default=None)


@contextlib.contextmanager
def keys_stored(layout: Optional[str], block: Optional[int] = None):
    """Declares, while attention is traced, how the ``(B, S, K, H)`` keys and values it is given
    are stored, for the forms that read a KV cache where it lies (the key blocks of
    :mod:`flax_attn.core.key_blocks`, the plain path's block-diagonal queries for keys not in
    that order, :func:`flax_attn.core.numerics.reads_heads_in_place`, and the compiled CPU
    kernel, :mod:`flax_attn.core.native`, which takes ``'BKSH'`` keys in that shape): ``'BKSH'`` as
    ``(B*K, S, H)`` seen through a transpose
    (:class:`flax_attn.KVCache`'s default layout), ``'blocks'`` as ``(S // block, B*K, block,
    H)`` seen through a transpose (a block-major cache: each block of every unit one contiguous
    array), ``'BSKH'`` or None as given. The layers declare their cache's layout around the
    attention over it; results do not depend on it."""
    from flax_attn import _checks

    _checks.check_one_of("keys_stored layout", layout, (None, "BKSH", "BSKH", "blocks"))
    if (layout == "blocks") != (block is not None):
        raise ValueError(f"keys_stored: a block size goes with layout 'blocks' and only with it, got layout={layout!r}, "
                         f"block={block!r}")
    token = _KEYS_STORED.set((layout, block))
    try:
        yield
    finally:
        _KEYS_STORED.reset(token)


def keys_stored_as() -> Optional[str]:
    """The layout declared by :func:`keys_stored` around the attention being traced, or None."""
    declared = _KEYS_STORED.get()
    return None if declared is None else declared[0]


def keys_block() -> Optional[int]:
    """The slots a block of the ``'blocks'`` layout declared by :func:`keys_stored` holds, or None."""
    declared = _KEYS_STORED.get()
    return None if declared is None else declared[1]


def jit(fun, *, compiler_options: Optional[dict] = None, **jit_kwargs):
    """``jax.jit`` with this machine's XLA compile options, flax_attn told of them.

    ``compiler_options`` None (default): :func:`cpu_compiler_options` (YNNPACK's fusions off on
    a CPU without AVX-512, XLA's defaults elsewhere); a dict is used as given. The function is
    traced under :func:`compiled_with` those options, so that flax_attn takes the forms
    measured fastest under them (e.g. one unit a step in the query blocks). Other keyword
    arguments go to ``jax.jit`` (``donate_argnums``, ``static_argnames``, ...).
    ``fa.jit(train_step)`` in place of ``jax.jit(train_step)``; :func:`flax_attn.decode_step`
    compiles its step with it. Results do not depend on the options.
    """
    import jax

    options = cpu_compiler_options() if compiler_options is None else compiler_options
    if not isinstance(options, dict):
        raise TypeError(f"compiler_options must be a dict or None, got {type(options).__name__}")

    @functools.wraps(fun)
    def traced(*args, **kwargs):
        with compiled_with(options):
            return fun(*args, **kwargs)

    return jax.jit(traced, compiler_options=options or None, **jit_kwargs)


def working_set_bytes(bq: int, bk: int, H: int, Hv: int, itemsize: int) -> int:
    """Bytes one step of the blockwise forward touches (see the module docstring)."""
    return 4 * (2 * bq * bk + bq * Hv) + itemsize * (bq * H + bk * H + bk * Hv)


def block_sizes(H: int, Hv: int, itemsize: int, cache_bytes: Optional[int] = None) -> tuple:
    """``(block_q, block_k)``: the largest square tile of :data:`TILES` whose working set fits
    in ``cache_bytes`` (default: half of :func:`l2_cache_bytes`); the smallest tile if none does.

    Args:
      H: query/key head dim. Hv: value head dim. itemsize: bytes per input element.
      cache_bytes: the cache to fit.

    Returns:
      ``(block_q, block_k)``, equal.
    """
    cache = l2_cache_bytes() // 2 if cache_bytes is None else cache_bytes
    for b in TILES:
        if working_set_bytes(b, b, H, Hv, itemsize) <= cache:
            return b, b
    return TILES[-1], TILES[-1]


def blockwise_tiles(T, S, G: int, acc_itemsize: int = 4, cache_bytes: Optional[int] = None,
                    tiles: tuple = TILES) -> tuple:
    """``(block_q, block_k)`` of the blockwise path: the largest tile of :data:`TILES` whose
    logits over a unit's ``G`` query heads (``acc_itemsize * G * b * b`` bytes) fit
    ``cache_bytes`` (default: twice :func:`l2_cache_bytes`, the L2 caches of two cores), so that
    each step's matmuls are large enough for XLA's CPU runtime to spread over the cores. A
    length up to that tile is one block; a longer one takes the largest tile up to it that pads
    the length by at most an eighth (``min`` of :data:`TILES` else).

    Measured on a 2-core AMD EPYC (1 MiB L2 per core: 512 for multi-head attention, 256 with 6
    query heads per key/value head), causal, 64-dim float32 heads, against the former 128 x 128
    (the largest tile whose whole working set fit half the L2), forward / forward+backward:
    1 x 8 heads of 8,192 tokens 1.04 -> 0.59 s / 4.48 -> 3.05 s (1,024 x 1,024 tiles: 0.57 /
    3.80 s); 8 x 12 heads of 1,024 tokens 0.28 -> 0.21 s / 1.01 -> 0.86 s (256 x 256: no faster
    than 128); 12 query heads over 2 key/value heads, 8,192 tokens: 1.19 -> 0.85 s / 4.20 ->
    3.82 s (512 x 512: 0.80 / 5.48 s). These are wall times; the former rule had been chosen by
    CPU time (128 x 128 took 10-19% less of it than 256 x 256 forward).

    ``tiles``: the candidates, largest first (:func:`blockwise_forward_tiles` adds 1,024).
    """
    cache = 2 * l2_cache_bytes() if cache_bytes is None else cache_bytes
    top = next((b for b in tiles if acc_itemsize * G * b * b <= cache), tiles[-1])

    def fit(length):
        if not isinstance(length, int):  # symbolic (jax.export)
            return top
        if length <= top:
            return length
        return next((b for b in tiles if b <= top and 8 * (-(-length // b) * b) <= 9 * length), tiles[-1])

    return fit(T), fit(S)


def blockwise_forward_tiles(T, S, G: int, acc_itemsize: int = 4) -> tuple:
    """``(block_q, block_k)`` of a blockwise call that is not differentiated: the rule of
    :func:`blockwise_tiles` over :data:`FORWARD_TILES` with the logits of a unit's ``G`` query
    heads fitting the L2 caches of eight cores (4 times its budget): 1,024 x 1,024 for
    multi-head float32 attention on a 1 MiB L2, 512 x 512 with 6 query heads per key/value head.

    Measured on a 2-core AMD EPYC (family 26, 1 MiB L2 per core), causal, 64-dim float32 heads,
    forward alone in turns, against :func:`blockwise_tiles`' choice: 1 x 8 heads of 4,096 /
    8,192 / 16,384 tokens 0.100 -> 0.084 s / 0.335 -> 0.269 s / 1.26 -> 0.99 s; 12 query heads
    over 2 key/value heads, 8,192 tokens 0.414 -> 0.378 s (1,024 x 1,024 there: 0.485 s). Reverse
    mode gains nothing from them (1 x 8 x 8,192 forward+backward: 1.49 s at 512, 1.46 s at
    1,024; 1.76 / 2.77 s before the keys-major key gradient), so differentiated calls keep the
    smaller ones. So do lengths shorter than four of the larger
    tiles, and symbolic ones: fewer, larger tiles skip less of a causal mask (1 x 8 heads of
    1,024 tokens took 0.012 s forward in one tile of 1,024 against 0.009 s in tiles of 512; of
    2,048 tokens 0.028 against 0.026 s).
    """
    tiles = blockwise_tiles(T, S, G, acc_itemsize)
    if not (isinstance(T, int) and isinstance(S, int)):
        return tiles
    fq, fk = blockwise_tiles(T, S, G, acc_itemsize, 8 * l2_cache_bytes(), FORWARD_TILES)
    return (fq, fk) if T >= 4 * fq and S >= 4 * fk else tiles


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def unit_chunk(B, K, want: int) -> int:
    """The largest chunk of (batch row, key/value head) units at most ``want`` that divides the
    B*K units (of K alone when the batch is symbolic, under ``jax.export``)."""
    total = B * K if isinstance(B, int) else K
    return max(c for c in range(1, max(1, min(want, total)) + 1) if total % c == 0)


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_host_memory() -> bool:
    """Let XLA's CPU programs reuse the host memory they free instead of mapping it anew at
    every call (Linux with glibc; a no-op returning False elsewhere). Call it before JAX runs
    anything (``RuntimeError`` otherwise: the CPU runtime's threads already hold their own
    memory arenas); returns True when applied.

    **Why.** A compiled XLA program on CPU allocates its temporaries as one buffer per call
    (107 MB for a GPT-2-small attention layer's forward at 8 x 1024 tokens). glibc serves a
    request that large from a worker thread with a fresh ``mmap``, so every call faults the
    buffer in page by page (31,000 page faults per call there, 58 ms of kernel time per 0.39 s
    call on a 2-core AMD EPYC). This sets glibc to keep one arena (``M_ARENA_MAX=1``),
    to serve every request from its heap (``M_MMAP_MAX=0``) and to return freed memory to the
    system only past 2 GiB free at its top (``M_TRIM_THRESHOLD``): after a few calls the same
    program faults no page in most calls (in a few, on a busy host, buffers such as a call's
    output are still mapped anew). The same settings for any program,
    without code:
    ``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647``.

    **Costs.** The process keeps the memory it has used at its peak (until 2 GiB are free at
    the heap's top), and threads allocating at once share one arena. Measured figures: the
    README's benchmark section.

    **Without either cost**, where glibc is 2.35 or later and the kernel's transparent huge
    pages are in ``madvise`` or ``always`` mode: start the process with
    ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``. glibc then asks for 2 MiB pages for the memory it
    maps, so each call still maps its buffers anew but faults them in 2 MiB pieces: the
    layer's forward+backward above 61,000-65,000 -> 560-950 page faults a call,
    0.14-0.15 -> 0.04 s of kernel time (2-core AMD EPYC). It can only be set before the process
    starts, so this function cannot apply it. Not on a virtual machine that hands free memory
    back to its host (a virtio balloon with free page reporting) where calls do not follow each
    other closely: glibc unmaps the 2 MiB pages after each call, the kernel reports them as free
    within seconds, and the next call faults each one in from the host. On such a VM (2-core
    AMD EPYC, family 25, model 17) the layer's forward+backward took 0.02-0.05 s of kernel time
    back to back but 0.49-0.55 s after 3 s idle, against 0.12-0.14 s with 4 KiB pages either way.
    """
    import ctypes
    import platform

    from jax._src import xla_bridge

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
        raise RuntimeError("keep_host_memory() must run before JAX runs anything: the CPU runtime's "
                           "threads have their memory arenas already (call it first thing, or set "
                           "MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647)")
    libc = ctypes.CDLL(None)
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(libc.mallopt(param, value) == 1 for param, value in settings)
