"""Top-k key selection on the Triton path: the indexer's logits from the kernel (indexer.py), then `torch.topk` on a
fixed width, keys after the query already at -inf. No host sync: the width comes from the caller's shapes.

Each query gets the positions of its `width` highest-scoring causal keys, -1 where it has fewer; a query with at
most `width` causal keys gets all of them (in score order, where the torch reference lists them by position: the
same set). Which of several keys tied at the k-th score are picked is unspecified, as for `torch.topk`;
deterministic inference keeps the torch reference's earliest-key rule (kernel_set.py routes it there).
"""

from __future__ import annotations

import torch

from model_workers.kernels.triton.indexer import indexer_logits
from model_workers.kernels.triton.launch import RowLayout


def top_positions(logits: torch.Tensor, width: int) -> torch.Tensor:
    """logits [..., K] (-inf = not a causal key) -> [..., min(width, K)] key positions, -1 where none."""
    width = min(width, logits.shape[-1])
    values, picked = logits.topk(width, dim=-1, sorted=False)
    return torch.where(values == float("-inf"), -1, picked)


def causal_topk(index_q: torch.Tensor, index_weights: torch.Tensor, store: torch.Tensor, slots: torch.Tensor,
                positions: torch.Tensor, topk: int, layout: RowLayout) -> torch.Tensor:
    """One request: index_q [T, H, D], slots [K] of its key positions 0..K-1, positions [T] -> [T, min(topk, K)]."""
    return top_positions(indexer_logits(index_q, index_weights, store, slots, positions, layout), topk)


def batched_topk(index_q: torch.Tensor, index_weights: torch.Tensor, store: torch.Tensor, slots: torch.Tensor,
                 positions: torch.Tensor, topk: int, layout: RowLayout) -> torch.Tensor:
    """B requests of n rows each: index_q [B, n, H, D], index_weights [B, n, H], slots [B, K] (each request's key
    positions 0..K_b-1, any slot past K_b), positions [B, n] (-1: padding row) -> [B, n, min(topk, K)]."""
    num_requests, num_rows = positions.shape
    logits = indexer_logits(index_q.flatten(0, 1), index_weights.flatten(0, 1), store, slots,
                            positions.flatten(), layout, rows_per_group=num_rows)  # [B*n, K]
    return top_positions(logits, topk).view(num_requests, num_rows, -1)
