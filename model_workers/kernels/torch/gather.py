"""What the torch kernels share: the stored-rows decode signature, row gathers, and chunk sizing by a byte budget."""

from __future__ import annotations

from typing import Callable

import torch

Decode = Callable[[torch.Tensor, torch.dtype], torch.Tensor]  # stored rows [..., W], dtype -> values [..., D]


def as_dtype(stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The decode of plain rows: a cast."""
    return stored.to(dtype)


def take_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table [S, W] rows at ids [...] (all valid) -> [..., W]; `index_select`, 4-7x faster on CPU than
    `table[ids]` for the gathers here (top-k keys, a request's key slots)."""
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, table.shape[-1])


DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024
ATTENTION_BUDGET_BYTES = 4 * 1024 * 1024  # gathered keys per attention chunk: cache-sized (1.5x faster on CPU)


def rows_per_chunk(bytes_per_row: int, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> int:
    return max(1, budget_bytes // max(1, bytes_per_row))
