"""Moving tensors between the global token stream and CP shards.

`shard` cuts a rank's physical shard out of a global tensor; `gather_rerange`
turns the rank-major buffer of an all-gather back into global stream order.
Every tensor has the token dimension first; trailing dims are free (ids,
hidden states, N-D KV), dtypes are preserved bit-exactly.
"""

from __future__ import annotations

import torch

from cp_router.cp.metadata import CPMetadata, RankMetadata
from cp_router.cp.padding import split_rows


def shard(meta: CPMetadata, x_global: torch.Tensor, cp_rank: int) -> torch.Tensor:
    """[N, ...] -> [per_rank_physical_token[cp_rank], ...]: logical rows in local order, zero rows at the tail."""
    if x_global.shape[0] != meta.num_tokens:
        raise ValueError(f"shard: token dim is {x_global.shape[0]}, the batch has {meta.num_tokens} tokens")
    return split_rows(x_global, meta.local_to_global[cp_rank], meta.per_rank_physical_token[cp_rank])


def shard_positions(meta: CPMetadata, cp_rank: int) -> torch.Tensor:
    """[per_rank_physical_token[cp_rank]] int64 global position of each local row (padding rows: 0)."""
    return meta.positions_local[cp_rank]


def gather_rerange(meta: CPMetadata | RankMetadata, gathered: torch.Tensor) -> torch.Tensor:
    """[cp_size * collective_rows, ...] rank-major all-gather buffer -> [N, ...] in global stream order.

    `gathered` is what `all_gather_into_tensor` returns when every rank passes
    `pad_local_rows(x_local, meta.collective_rows)`; padding rows are dropped.
    """
    expected_rows = meta.cp_size * meta.collective_rows
    if gathered.shape[0] != expected_rows:
        raise ValueError(
            f"gather_rerange: gathered has {gathered.shape[0]} rows, expected cp_size * collective_rows"
            f" = {meta.cp_size} * {meta.collective_rows} = {expected_rows}"
        )
    return gathered.index_select(0, meta.restore_index.to(gathered.device))  # [N, ...]
