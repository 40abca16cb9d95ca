"""One prefill batch as per-rank shards: token ids and MTP input ids (the left shift of the global sequence)."""

from __future__ import annotations

import torch

from cp_router.cp.metadata import CPMetadata
from cp_router.plans import NEXT_ID_SAMPLED, PrefillRequest, PrefillShard
from cp_router.cp.sharding import shard


def prefill_shards(
    requests: tuple[PrefillRequest, ...],
    chunks: list[list[int]],
    meta: CPMetadata,
    next_after: list[int | None] | None = None,
) -> list[PrefillShard]:
    """Every shard of the batch. `chunks[s]` are request s's extend tokens; `next_after[s]` the prompt token
    that follows its chunk (a non-final chunk), or None where the target samples it (the default)."""
    next_after = next_after or [None] * len(chunks)
    tail = [NEXT_ID_SAMPLED if t is None else t for t in next_after]
    ids_global = torch.tensor([t for c in chunks for t in c], dtype=torch.long)  # [N]
    next_global = torch.tensor([t for c, last in zip(chunks, tail) for t in c[1:] + [last]], dtype=torch.long)  # [N]
    shards = []
    for shard_index in range(meta.cp_size):
        num_local = meta.per_rank_logical_token[shard_index]
        ids_local = shard(meta, ids_global, shard_index)[:num_local]  # [T_logical]
        next_local = shard(meta, next_global, shard_index)[:num_local]  # [T_logical]
        shards.append(PrefillShard(requests, meta, shard_index, ids_local, next_local))
    return shards
