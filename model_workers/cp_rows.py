"""The context-parallel gathers a backend composes with: this rank's rows -> every rank's, in global stream order.

Under CP a rank runs the model on its logical rows only (global positions, local order). A family's CP batch
(`cp_batch`) names every request's keys in this rank's cache and the write slots of the whole stream; bound with
`CPRows`, the family's backend sends the rows it keeps (DSA: each layer's stored latent and indexer-key bytes;
V4: window rows and compressor rows) through `stream`, which pads them to `meta.collective_rows`, all-gathers them
and restores global order, so every rank's cache holds every row and selection and attention read keys exactly
as without CP: causality by global position and the within-request rule hold with no extra code. The model never
sees the gather (docs/architecture.md, 'Per-layer data flow under CP prefill').
"""

from __future__ import annotations

import torch

from cp_router.cp.metadata import RankMetadata
from cp_router.cp.padding import pad_local_rows
from cp_router.cp.sharding import gather_rerange
from model_workers.comm import LocalComm


def gather_rows_global(
    comm: LocalComm, meta: RankMetadata, x_local: torch.Tensor, tag: str, fill_value: int | float = 0
) -> torch.Tensor:
    """[T_logical, ...] rows of this rank -> [N, ...] rows of every rank in global stream order."""
    x_padded = pad_local_rows(x_local, meta.collective_rows, fill_value)  # [P, ...], P equal on all ranks
    return gather_rerange(meta, comm.all_gather_rows(x_padded, tag))  # [N, ...]


class CPRows:
    """The row stream of one CP rank in one prefill batch (models/common/streams.py `RowStream`)."""

    def __init__(self, comm: LocalComm, meta: RankMetadata):
        if meta.cp_size != comm.cp_size:
            raise ValueError(f"CP batch built for cp_size={meta.cp_size} on a group of cp_size={comm.cp_size}")
        self.comm, self.meta = comm, meta

    def stream(self, rows_local: torch.Tensor, tag: str) -> torch.Tensor:
        return gather_rows_global(self.comm, self.meta, rows_local, tag)
