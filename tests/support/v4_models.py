"""Helpers of the DeepSeek-V4 tests: every parameter and buffer of a `transformers` module randomised."""

from __future__ import annotations

import torch


def randomized(module, seed: int, num_experts: int | None = None):
    """Normal(0, 1) floats in every weight (RoPE frequency buffers are left alone); integer buffers (tid2eid [vocab, k]) get a distinct random expert set per
    token among `num_experts` (default: 8)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
            if "inv_freq" in name:  # RoPE tables are computed, not weights
                continue
            if tensor.dtype == torch.long:
                experts, top_k = num_experts or 8, tensor.shape[1]
                rows = [torch.randperm(experts, generator=generator)[:top_k] for _ in range(tensor.shape[0])]
                tensor.copy_(torch.stack(rows))
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator))
    return module
