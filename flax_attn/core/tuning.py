"""Tile sizes of the blockwise core, derived from the machine's caches (no timing at run time).

The blockwise core (:mod:`flax_attn.core.blockwise`) visits one ``block_q x block_k`` tile of
logits at a time for each (batch row, key/value head). Per step it touches, in the accumulation
dtype (4 bytes for float32), the logits and the weights of the tile and the running output,
and, in the input dtype, the tile's queries, keys and values:

    work(bq, bk) = 4 (2 bq bk + bq Hv) + itemsize (bq H + bk H + bk Hv)   bytes.

The rule: the largest square tile among 512, 256, 128, 64 whose working set fits in the
per-core L2 cache (the level a core keeps to itself on current x86 and Arm server CPUs), so
that the exponentials and the two matmuls of a step reuse it from there. On a 1 MiB L2 with
64-dim float32 heads this gives 256 x 256 (768 KiB; 512 x 512 would need 2.5 MiB). On a 2-core
AVX-512 CPU (64-dim heads, causal, batch 8 x 1024 and 8 x 4096 tokens) 256 x 256 was within 12%
of the fastest forward and forward+backward of the block sizes tried; on a 2-core AMD EPYC
(1 MiB L2 per core) 128 x 128, 128 x 256, 512 x 256 and 256 x 512 were not faster than
256 x 256. Where the cache size cannot be read (not Linux, or no sysfs), 1 MiB is assumed.

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
    in ``cache_bytes`` (default: :func:`l2_cache_bytes`); the smallest tile if none does.

    Args:
      H: query/key head dim. Hv: value head dim. itemsize: bytes per input element.
      cache_bytes: the cache to fit.

    Returns:
      ``(block_q, block_k)``, equal.
    """
    cache = l2_cache_bytes() if cache_bytes is None else cache_bytes
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
