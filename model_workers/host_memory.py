"""Host memory of a rank process: oneDNN's per-shape caches bounded, and the freed heap handed back when idle.

On a CPU with native bf16 (AVX512-BF16 / AMX), torch runs every bf16 matmul through oneDNN, which keeps two
least-recently-used caches keyed by shape: its primitive cache (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`) and ideep's
computation cache (`LRU_CACHE_CAPACITY`), 1024 entries each by default. A server sees a new row count with
almost every prefill chunk and expert batch, so both fill. Measured on this project's CPU (torch 2.13, one
[M, 256] x [256, 768] bf16 linear per new M): 0.53 MiB of heap per primitive-cache entry and 0.25 MiB per ideep
entry, whatever the weight's shape, so the defaults hold up to ~800 MiB per rank, grown over the first
thousand shapes served (the short soak saw ranks go 480 -> 1300 MiB). `ONEDNN_CACHE_CAPACITY` entries bound
both at ~200 MiB; a miss costs one primitive creation, about 0.2 ms (with both caches off, a batch-1 decode
step took 14 ms longer), and the entries a decode step needs stay far under the bound. A value the operator
already set in the environment wins.

glibc keeps freed heap memory (arenas fragmented by tensors of ever-changing sizes) instead of returning it.
`release_free_heap` (malloc_trim) hands it back; ranks call it when they hold no request at the end of a step
with no forward, the engine's idle step. It took 7-13 ms and returned 60-70 MiB per call, measured after
rounds of 1-2k-token prompts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ONEDNN_CACHE_CAPACITY = 256  # entries of each oneDNN cache (see the module docstring)
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches() -> None:
    """Sets both cache capacities to ONEDNN_CACHE_CAPACITY unless the environment already names them.

    oneDNN and ideep read them when their cache is first used: call this before the process's first matmul."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's `malloc_trim`, or None where the C library has none (musl, macOS)."""
    path = ctypes.util.find_library("c")
    library = ctypes.CDLL(path) if path else None
    trim = getattr(library, "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Returns the heap's free pages to the OS; True if any were released, False if none or no glibc."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))
