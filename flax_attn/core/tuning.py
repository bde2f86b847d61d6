"""Tile sizes of the blockwise core, derived from the machine's caches (no timing at run time).

The blockwise core (:mod:`flax_attn.core.blockwise`) visits one ``block_q x block_k`` tile of
logits at a time for each (batch row, key/value head). Per step it touches, in the accumulation
dtype (4 bytes for float32), the logits and the weights of the tile and the running output,
and, in the input dtype, the tile's queries, keys and values:

    work(bq, bk) = 4 (2 bq bk + bq Hv) + itemsize (bq H + bk H + bk Hv)   bytes.

The rule: the largest square tile among 512, 256, 128, 64 whose working set fits in half the
per-core L2 cache (the level a core keeps to itself on current x86 and Arm server CPUs), so
that the exponentials and the two matmuls of a step reuse it from there while the other half
holds what the step reads besides (the derivative's step has three tiles of logits, weights and
their tangents, and seven blocks of rows). On a 1 MiB L2 with 64-dim float32 heads this gives
128 x 128 (256 KiB; 256 x 256 would need 768 KiB). On a 2-core AMD EPYC (1 MiB L2 per core,
64-dim heads, causal) 128 x 128 took 10% less CPU time than 256 x 256 forward at 8 x 1024
tokens in 12 heads and 19% less at 1 x 4096 tokens in 8 heads; forward+backward took the same
within 6% either way. Where the cache size cannot be read (not Linux, or no sysfs), 1 MiB is
assumed.

The result depends only on the machine and the head dims, so that a program traced twice on
one machine is the same program; pass ``Blockwise(block_q=..., block_k=...)`` to override.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Optional

DEFAULT_L2_BYTES = 1 << 20
TILES = (512, 256, 128, 64)


def _parse_size(text: str) -> Optional[int]:
    """'1024K' / '2M' / '32768' (sysfs spelling) -> bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in "KMG" else text
    return int(digits) * scale if digits.isdigit() else None


@functools.lru_cache(maxsize=None)
def l2_cache_bytes() -> int:
    """The per-core L2 data (or unified) cache of CPU 0 in bytes, from Linux sysfs; 1 MiB if unknown."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for index in sorted(root.glob("index*")):
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            if level == "2" and kind in ("Data", "Unified"):
                size = _parse_size((index / "size").read_text())
                if size:
                    return size
    except OSError:
        pass
    return DEFAULT_L2_BYTES


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
