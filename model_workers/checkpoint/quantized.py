"""Quantized checkpoint formats the loader reads: DeepSeek's block-quantized FP8 weights, and FP4 routed experts
(DeepSeek-V4's release: int8 holding two e2m1 codes, low nibble = even input column, one ue8m0 scale per 32 inputs).
"""

from __future__ import annotations

import torch

FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP4_GROUP = 32  # inputs per FP4 scale


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight [out, in] fp8, scale_inv [ceil(out/b0), ceil(in/b1)] -> float32 weight · per-block scale."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed int8 [out, in/2] (low nibble = even input column), scale ue8m0 [out, in/32] -> float32 [out, in]."""
    codes = packed.view(torch.uint8)
    nibbles = torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).long()  # [out, in]
    values = FP4_VALUES[nibbles]
    return values * scale.float().repeat_interleave(FP4_GROUP, dim=-1)[:, : values.shape[-1]]
