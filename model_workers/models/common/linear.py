"""`Linear`: `nn.Linear` whose product is the torch kernels' `linear` (a few CPU rows as W @ x^T, oneDNN-packed
bf16 weights: model_workers/kernels/torch/linear.py)."""

from __future__ import annotations

import torch
from torch import nn

from model_workers.kernels.torch.linear import linear


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) whose forward is `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
