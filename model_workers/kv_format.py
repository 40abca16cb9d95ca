"""`--kv-cache-dtype`: the one table of its names, and the key formats a cache stores for each.

`auto` keeps the keys in the weights' storage dtype (`--dtype`), `bfloat16` stores bf16 rows, `fp8_e4m3` the FP8
layout (docs/kv_cache.md, 'FP8 layout'). The formats themselves (their widths, encode and decode) are a kernel
set's row codecs (model_workers/kernels/); which names a model can use is its family's (`kv_cache_dtypes`).
"""

from __future__ import annotations

import torch

from model_workers.kernels.interface import KeyFormat, RowCodecs
from model_workers.kernels.registry import kernel_set

KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")  # the one table of --kv-cache-dtype names
FP8_KV = "fp8_e4m3"


def check_kv_cache_dtype(kv_cache_dtype: str, allowed: tuple[str, ...] = KV_CACHE_DTYPES, model: str = "") -> str:
    """`kv_cache_dtype` if it is one of `allowed` (a model family's); a ValueError naming the allowed values if not."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if kv_cache_dtype not in allowed:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not available for {model or 'this model'} yet; "
                         f"allowed values: {', '.join(allowed)}")
    return kv_cache_dtype


def key_formats(kv_cache_dtype: str, weights_dtype: torch.dtype, kv_lora_rank: int, rope_dim: int, index_dim: int,
                codecs: RowCodecs | None = None) -> tuple[KeyFormat, KeyFormat]:
    """(latent format, indexer-key format) of a cache for `--kv-cache-dtype` beside weights stored as
    `weights_dtype`, from a kernel set's row codecs (default: the torch set's)."""
    codecs = codecs or kernel_set().rows
    if kv_cache_dtype == FP8_KV:
        return codecs.fp8(kv_lora_rank, rope_dim), codecs.fp8(index_dim, 0)
    dtype = plain_kv_dtype(kv_cache_dtype, weights_dtype)
    return codecs.plain(kv_lora_rank + rope_dim, dtype), codecs.plain(index_dim, dtype)


def plain_kv_dtype(kv_cache_dtype: str, weights_dtype: torch.dtype) -> torch.dtype:
    """The float dtype of a non-FP8 cache: `auto` = the weights' storage dtype."""
    if kv_cache_dtype not in KV_CACHE_DTYPES or kv_cache_dtype == FP8_KV:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return weights_dtype if kv_cache_dtype == "auto" else torch.bfloat16
