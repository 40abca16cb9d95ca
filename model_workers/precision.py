"""Compute dtype for a storage dtype on a device.

bfloat16 matrix multiplies on a CPU without native bf16 instructions (AVX512-BF16 or AMX) are emulated
and 5-10x slower than float32 ones (measured on the 2-core CI machine: a [32, 256] x [256, 6144] linear
takes 12.1 ms in bf16 and 2.3 ms in fp32). There the weights are held in float32 for compute (the bf16
checkpoint values, exactly) while the KV cache and its CP gathers stay in the requested bf16.

The MTP draft has a dtype of its own (`draft_dtype_for`): float32 on a CPU, whatever the target computes in.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from model_workers.checkpoint.model_dir import read_config_json
from model_workers.models.common.draft_dtype import draft_dtype, widened_parameter_count, widen_draft
from model_workers.spec import ModelSpec, stored_dtype

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the one table of --dtype names
AUTO_DTYPE = "auto"  # --dtype auto: the checkpoint's own (`resolve_dtype_name`)


def resolve_dtype_name(name: str, model: ModelSpec | str | Path, device: str = "cpu") -> str:
    """A --dtype name with `auto` resolved (as vLLM): a float32 checkpoint stays float32 on a CPU and runs in
    bfloat16 on CUDA; bfloat16, float16 and FP8 checkpoints run in bfloat16. `model`: the engine spec's (or a
    folder, whose config.json is read here)."""
    if name != AUTO_DTYPE:
        storage_dtype(name)
        return name
    raw = model.raw if isinstance(model, ModelSpec) else read_config_json(Path(model))
    stored = stored_dtype(raw)
    if stored == "float32" and not str(device).startswith("cuda"):
        return "float32"
    return "bfloat16"


def storage_dtype(name: str) -> torch.dtype:
    """The torch dtype of a --dtype / `dtype` name (weights as stored, KV cache)."""
    if name not in STORAGE_DTYPES:
        raise ValueError(f"dtype must be one of {[AUTO_DTYPE, *sorted(STORAGE_DTYPES)]}, got {name!r} (auto is resolved"
                         " against the checkpoint first)")
    return STORAGE_DTYPES[name]


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when /proc/cpuinfo lists a native bf16 matrix instruction set (False where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def compute_dtype(storage: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype weights are held in and matmuls run in, for weights / KV stored as `storage`."""
    if storage == torch.bfloat16 and torch.device(device).type == "cpu" and not cpu_has_native_bf16():
        return torch.float32
    return storage


# the MTP layers' float32 copy a CPU rank may add for the draft (models/common/draft_dtype.py)
DRAFT_WIDEN_MAX_BYTES = 1 << 30


def draft_dtype_for(compute: torch.dtype, device: torch.device | str, widened_params: int) -> torch.dtype:
    """The dtype the MTP draft computes in, for a target computing in `compute` whose MTP layers have
    `widened_params` parameters that widening would cast (models/common/draft_dtype.py: all but experts and heads).

    On a CPU, float32 while that float32 copy stays under DRAFT_WIDEN_MAX_BYTES: a draft forward is a few rows,
    where bf16 products cost more than float32 ones (oneDNN's fixed cost per call, casts around every norm). On
    the default model (2 threads, AVX512-BF16), with the same drafts accepted, `bench decode` at k = 2 and batch
    1 gave 1.54x the tokens/s of k = 0 against 1.40x with the bf16 draft (2026-12-05 20:36 and 19:04), and the
    draft cost per token fell from 0.35 to 0.29 plain steps. Elsewhere (an accelerator, a large MTP layer) the
    target's dtype."""
    if torch.device(device).type == "cpu" and widened_params * 4 <= DRAFT_WIDEN_MAX_BYTES:
        return torch.float32
    return compute


def set_draft_precision(model, device: torch.device | str) -> None:
    """Widens the model's MTP layers to `draft_dtype_for` their size on `device` (models/common/draft_dtype.py), as a
    rank does at load."""
    widen_draft(model, draft_dtype_for(draft_dtype(model), device, widened_parameter_count(model)))
