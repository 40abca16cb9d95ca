"""Kernel sets by name: what `--attention-backend` (and the Serve YAML's `attention_backend`) may name.

A set's module is imported when it is first asked for, so a set whose compiler is missing here (Triton on a
machine without it) costs nothing until named. Adding a set = a folder under kernels/ and one line below.

`auto` (the default) is resolved where the kernels run, by the rank's device: `triton` on CUDA when the triton
package imports, else `torch`. On a CPU the Triton set runs only in Triton's interpreter (TRITON_INTERPRET=1, set
before the kernels are decorated: how CI checks the whole model path without a GPU); otherwise it is refused.
"""

from __future__ import annotations

import importlib
import importlib.util
import os

from model_workers.kernels.interface import KernelSet

KERNEL_SET_MODULES = {  # name -> the module whose KERNELS is the set
    "torch": "model_workers.kernels.torch.kernel_set",
    "triton": "model_workers.kernels.triton.kernel_set",
}
AUTO = "auto"
ATTENTION_BACKENDS = (AUTO, *KERNEL_SET_MODULES)
DEFAULT_ATTENTION_BACKEND = AUTO
REFERENCE_BACKEND = "torch"
BATCH_INVARIANT_BACKENDS = ("torch",)  # sets that carry the deterministic mode (docs/deterministic_inference.md)


def triton_interpreted() -> bool:
    """Triton kernels run in its interpreter (on CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(name: str, device_type: str, deterministic: bool = False) -> str:
    """`name` with `auto` resolved for a rank on `device_type` ("cuda" | "cpu"), batch-invariant when
    `deterministic`; a ValueError naming the allowed values, or saying what a set needs, when `name` cannot run
    there."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == AUTO:
        return "triton" if device_type == "cuda" and has_triton and not deterministic else REFERENCE_BACKEND
    if deterministic and name not in BATCH_INVARIANT_BACKENDS:
        raise ValueError(f"--enable-deterministic-inference runs on the attention_backend "
                         f"{' or '.join(BATCH_INVARIANT_BACKENDS)} (or auto) only: the {name} kernels' splits and "
                         "tiles follow the batch size, so their results do")
    if name == "triton" and not has_triton:
        raise ValueError("attention_backend='triton' needs the triton package (pip install triton); allowed "
                         "here: auto, torch")
    if name == "triton" and device_type != "cuda" and not triton_interpreted():
        raise ValueError("attention_backend='triton' on a CPU runs only in Triton's interpreter: set "
                         "TRITON_INTERPRET=1 (slow: tests and checks), or use attention_backend='torch' or 'auto'")
    return name


def kernel_set(name: str = REFERENCE_BACKEND, device_type: str = "cpu", deterministic: bool = False) -> KernelSet:
    """The kernel set called `name` (`auto` resolved for `device_type` and `deterministic`), imported now."""
    return importlib.import_module(KERNEL_SET_MODULES[resolve_backend(name, device_type, deterministic)]).KERNELS
