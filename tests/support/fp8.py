"""DeepSeek-style FP8 block quantization for test checkpoints: e4m3 values with one fp32 scale per block."""

from __future__ import annotations

import torch


def quantize_fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (e4m3 [out, in], scale_inv [ceil(out/block), ceil(in/block)] float32)."""
    rows, cols = weight.shape
    grid = (-(-rows // block), -(-cols // block))
    scale = torch.empty(grid)
    quantized = torch.empty_like(weight, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = tile.abs().max().clamp_min(1e-12) / 448.0
            quantized[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / scale[i, j]).to(torch.float8_e4m3fn)
    return quantized, scale
