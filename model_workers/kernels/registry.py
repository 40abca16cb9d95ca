"""Kernel sets by name: what `--attention-backend` (and the Serve YAML's `attention_backend`) may name.

A set's module is imported when it is first asked for, so a set whose compiler is missing here (Triton on a
machine without it) costs nothing until named. Adding a set = a folder under kernels/ and one line below.
"""

from __future__ import annotations

import importlib

from model_workers.kernels.interface import KernelSet

KERNEL_SET_MODULES = {  # name -> the module whose KERNELS is the set
    "torch": "model_workers.kernels.torch.kernel_set",
}
ATTENTION_BACKENDS = tuple(KERNEL_SET_MODULES)
DEFAULT_ATTENTION_BACKEND = "torch"


def kernel_set(name: str = DEFAULT_ATTENTION_BACKEND) -> KernelSet:
    """The kernel set called `name`; a ValueError naming the allowed values otherwise."""
    if name not in KERNEL_SET_MODULES:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    return importlib.import_module(KERNEL_SET_MODULES[name]).KERNELS
