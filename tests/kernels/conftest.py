"""The kernel tests: with no CUDA device, Triton's kernels run in its interpreter, which must be switched on
before any kernel module is imported (the kernels are decorated at import)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
