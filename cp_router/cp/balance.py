"""Causal work per CP rank: the indexer scores each query against its causal keys, so a rank's work is
the sum over its queries of the length of their causal key range (prefix included)."""

from __future__ import annotations

import torch

from cp_router.cp.metadata import CPMetadata


def causal_work_per_rank(meta: CPMetadata) -> list[int]:
    """[C] causal query-key pairs per rank, read from the metadata's key ranges (logical rows only)."""
    work = []
    for cp_rank in range(meta.cp_size):
        logical = meta.per_rank_logical_token[cp_rank]
        ranges = meta.key_end_local[cp_rank][:logical] - meta.key_start_local[cp_rank][:logical]  # [T_logical]
        work.append(int(ranges.sum()))
    return work


def contiguous_causal_work(extend_len: int, cp_size: int) -> list[int]:
    """[C] causal work per rank if rank r took the r-th contiguous chunk of one request (no prefix)."""
    chunks = torch.tensor_split(torch.arange(extend_len), cp_size)
    return [int((chunk + 1).sum()) for chunk in chunks]


def max_over_mean(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0
