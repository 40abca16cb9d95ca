"""What the Triton kernel modules share: block sizes rounded to powers of two, and the stored-row layout of a key
format (plain float rows, or the FP8 rows of kernels/torch/fp8_rows.py) as the kernels address it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_workers.kernels.torch.fp8_rows import FP8_BLOCK, SCALE_BYTES, Fp8Rows


def pow2(n: int, at_least: int = 16) -> int:
    """The smallest power of two >= max(n, at_least): tl.arange and tl.dot tiles want powers of two >= 16."""
    size = at_least
    while size < n:
        size *= 2
    return size


@dataclass(frozen=True)
class RowLayout:
    """Where a stored key row keeps its values, in elements of the store's dtype (bytes for FP8 rows)."""

    fp8: bool  # FP8 e4m3 values + float32 scales per FP8_BLOCK (+ bf16 tail); else plain rows
    quantized_dim: int  # values in the FP8 part (plain rows: all of them)
    plain_dim: int  # trailing bf16 values of an FP8 row (k_pe); 0 for plain rows
    row_width: int  # elements per stored row (its stride)
    scales_offset: int  # where the float32 scales start (bytes); 0 for plain rows
    tail_offset: int  # where the bf16 tail starts (bytes); the plain row's k_pe starts at quantized_dim


def row_layout(key_format, stored: torch.Tensor) -> RowLayout:
    """The layout of `stored` [S, W] rows written by `key_format` (a torch `PlainRows` / `Fp8Rows`)."""
    width = stored.shape[-1]
    if isinstance(key_format, Fp8Rows):
        scales_end = key_format.quantized_dim + SCALE_BYTES * key_format.num_blocks
        return RowLayout(True, key_format.quantized_dim, key_format.plain_dim, width, key_format.quantized_dim,
                         scales_end)
    return RowLayout(False, key_format.dim, 0, width, 0, 0)


__all__ = ["FP8_BLOCK", "RowLayout", "pow2", "row_layout"]
