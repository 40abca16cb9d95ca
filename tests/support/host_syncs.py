"""Counting host syncs: the tensor reads that make the host wait for the device (a value brought to Python, a
shape that depends on data). Under `HostSyncs` every such call the project's own code makes through torch is
recorded with where it was made (`tolist`, `item`, `bool(t)`, `nonzero`, boolean-mask indexing ...). On a CPU
nothing actually waits; the same calls on a GPU would, and a captured CUDA graph cannot contain them. Calls made
by libraries (Triton's interpreter moving tensors to numpy, say) are not the project's and are not counted.

It is a TorchFunctionMode only: it leaves `_get_current_dispatch_mode()` None, so the code under test takes the
path it takes when nobody is watching."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parents[2]
PROJECT = tuple(str(REPO / name) for name in ("model_workers", "cp_router", "cluster"))
SYNCING = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "argwhere",
                     "unique", "unique_consecutive", "masked_select", "cpu", "numpy", "bincount", "histc"})
INDEXING = frozenset({"__getitem__", "__setitem__", "index_put_", "index_put"})


def _bool_index(args) -> bool:
    """An index that holds a boolean tensor (its selected count is read from the device)."""
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class HostSyncs(TorchFunctionMode):
    """`with HostSyncs() as syncs: ...`; then `syncs.found` lists (call, file:line) for every sync made inside."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        tensor_repeats = name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor)
        if name in SYNCING or tensor_repeats or (name in INDEXING and _bool_index(args)):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PROJECT):
                self.found.append((name, f"{caller.f_code.co_filename}:{caller.f_lineno}"))
        return func(*args, **(kwargs or {}))
