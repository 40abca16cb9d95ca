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

glibc maps every allocation above its mmap threshold (128 KiB at start, raised to the size of a freed mapping)
freshly from the OS and unmaps it on free, so each new tensor of a few MiB page-faults all its pages again; and
it returns the heap's free top once it exceeds the trim threshold. A prefill allocates such tensors over and
over (indexer scores, gathered keys, expert batches). `keep_large_allocations_on_heap` sets both thresholds
once (mmap: 32 MiB, glibc's largest; trim: 64 MiB, twice that, glibc's own ratio), so they are reused from
the heap: an 8k-token prefill on two CPU ranks went 1.55-1.61 -> 1.47-1.53 s, peak RSS unchanged (600-650 MiB).
The operator's own MALLOC_* / GLIBC_TUNABLES settings win.

glibc keeps freed heap memory (arenas fragmented by tensors of ever-changing sizes) instead of returning it.
`release_free_heap` (malloc_trim) hands it back; ranks call it when they hold no request at the end of a step
with no forward, the engine's idle step (sent once no request came for `engine.IDLE_FREE_DELAY_S`, 1 s). It
took 7-13 ms and returned 60-70 MiB per call, measured after rounds of 1-2k-token prompts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

ONEDNN_CACHE_CAPACITY = 256  # entries of each oneDNN cache (see the module docstring)
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
MMAP_THRESHOLD_BYTES = 32 * 2**20  # allocations up to this come from the heap (glibc's maximum on 64-bit)
TRIM_THRESHOLD_BYTES = 64 * 2**20  # free heap top kept before glibc returns it
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # and GLIBC_TUNABLES' glibc.malloc.*
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def bound_onednn_caches() -> None:
    """Sets both cache capacities to ONEDNN_CACHE_CAPACITY unless the environment already names them.

    oneDNN and ideep read them when their cache is first used: call this before the process's first matmul."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


def keep_large_allocations_on_heap() -> bool:
    """Sets glibc's mmap and trim thresholds (module docstring) unless the environment names malloc settings;
    True if set, False if left to the operator or there is no glibc `mallopt`."""
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    operator_set = any(name in os.environ for name in MALLOC_VARIABLES)
    if mallopt is None or operator_set or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


@functools.lru_cache(maxsize=None)
def _libc_function(name: str, argtypes: tuple):
    """A glibc function returning int, or None where the C library has none (musl, macOS)."""
    path = ctypes.util.find_library("c")
    function = getattr(ctypes.CDLL(path), name, None) if path else None
    if function is not None:
        function.argtypes, function.restype = list(argtypes), ctypes.c_int
    return function


def release_free_heap() -> bool:
    """Returns the heap's free pages to the OS; True if any were released, False if none or no glibc."""
    trim = _libc_function("malloc_trim", (ctypes.c_size_t,))
    return bool(trim is not None and trim(0))
