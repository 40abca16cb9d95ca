"""The context-parallel attention backend: TorchBackend whose `store_kv` first gathers keys from every rank.

Under CP a rank runs the model on its logical rows only (global positions, local order). Its
`ForwardBatch` says: rows of each request among the local rows, every request's key slots in *this
rank's* cache (each rank holds pages for every request of the batch during prefill), and `write_slots`
[N] for the whole token stream in global order. `store_kv` pads the local keys to
`meta.collective_rows`, all-gathers them, restores global order and writes all N rows; top-k selection
and attention then read keys from the cache exactly as without CP, so causality by global position and
the within-request rule hold with no extra code.
"""

from __future__ import annotations

import torch

from cp_router.cp.metadata import RankMetadata
from cp_router.cp.padding import pad_local_rows
from cp_router.cp.sharding import gather_rerange
from model_workers.backends.torch_backend import ForwardBatch, TorchBackend
from model_workers.backends.v4_backend import V4Batch, V4TorchBackend, v4_batch
from model_workers.comm import LocalComm
from model_workers.kv_cache import PagedKVCache, PageTable
from model_workers.v4_cache import V4Cache


def gather_rows_global(
    comm: LocalComm, meta: RankMetadata, x_local: torch.Tensor, tag: str, fill_value: int | float = 0
) -> torch.Tensor:
    """[T_logical, ...] rows of this rank -> [N, ...] rows of every rank in global stream order."""
    x_padded = pad_local_rows(x_local, meta.collective_rows, fill_value)  # [P, ...], P equal on all ranks
    return gather_rerange(meta, comm.all_gather_rows(x_padded, tag))  # [N, ...]


class CPBackend(TorchBackend):
    """Implements `model.backend.AttentionBackend` for one CP shard at a time."""

    def __init__(self, cache: PagedKVCache, exchange=None, deterministic: bool = False):
        super().__init__(cache, exchange, deterministic)
        self.meta: RankMetadata | None = None
        self.comm: LocalComm | None = None
        self.keep_topk_layers: frozenset[int] = frozenset()
        self.kept_topk: dict[int, torch.Tensor] = {}

    def bind_shard(
        self, batch: ForwardBatch, meta: RankMetadata, comm: LocalComm, keep_topk_layers: frozenset[int] = frozenset()
    ) -> "CPBackend":
        """`keep_topk_layers`: layers whose top-k slots [T_local, k] are kept in `kept_topk` after the forward."""
        if meta.cp_size != comm.cp_size:
            raise ValueError(f"CP batch built for cp_size={meta.cp_size} on a group of cp_size={comm.cp_size}")
        if batch.write_slots.shape[0] != meta.num_tokens:
            raise ValueError(f"write_slots has {batch.write_slots.shape[0]} rows, the batch has {meta.num_tokens}")
        self.bind(batch)
        self.meta, self.comm = meta, comm
        self.keep_topk_layers, self.kept_topk = keep_topk_layers, {}
        return self

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        """Encodes this rank's keys (FP8: quantized here, after RoPE at their global positions), gathers the
        stored bytes of every rank in one collective per layer, and writes all N rows."""
        latent_rows, index_rows = self.cache.encode(latent, index_key)  # [T_local, W_lat], [T_local, W_idx]
        parts = [latent_rows] if index_rows is None else [latent_rows, index_rows]
        rows_global = gather_rows_global(self.comm, self.meta, torch.cat(parts, dim=-1), "kv")  # [N, W_lat (+ W_idx)]
        width = latent_rows.shape[-1]
        index_global = rows_global[:, width:] if index_rows is not None else None  # [N, W_idx]
        self.store_rows(layer_id, rows_global[:, :width], index_global)

    def select_topk(self, layer_id: int, index_q: torch.Tensor | None, index_weights: torch.Tensor | None,
                    topk: int) -> torch.Tensor:
        topk_slots = super().select_topk(layer_id, index_q, index_weights, topk)  # [T_local, k']
        if layer_id in self.keep_topk_layers:
            self.kept_topk[layer_id] = topk_slots
        return topk_slots


def cp_v4_batch(cache: V4Cache, tables: list[PageTable], meta: RankMetadata, device) -> V4Batch:
    """DeepSeek-V4 under CP: this rank's logical rows as queries; every request's whole chunk in the stream."""
    request_index_local = meta.request_index_local[: meta.num_logical]  # [T_logical]
    rows = [torch.nonzero(request_index_local == s).flatten().to(device) for s in range(len(tables))]
    return v4_batch(cache, tables, list(meta.extend_lens), meta.positions_local[: meta.num_logical].to(device), rows)


class V4CPBackend(V4TorchBackend):
    """V4 under CP: the window's K = V rows and the compressors' projected rows are all-gathered into the stream
    before they are kept or pooled, so every rank keeps every request's rows and entries (equal to one rank's)."""

    def __init__(self, cache: V4Cache, exchange=None):
        super().__init__(cache, exchange)
        self.meta: RankMetadata | None = None
        self.comm: LocalComm | None = None

    def bind_shard(self, batch: V4Batch, meta: RankMetadata, comm: LocalComm, keep_topk_layers=frozenset()):
        if meta.cp_size != comm.cp_size:
            raise ValueError(f"CP batch built for cp_size={meta.cp_size} on a group of cp_size={comm.cp_size}")
        if keep_topk_layers:
            raise ValueError("DeepSeek-V4 has no MTP index sharing (its MTP block is sliding-only)")
        self.meta, self.comm = meta, comm
        return self.bind(batch)

    def stream_rows(self, rows_local: torch.Tensor, tag: str) -> torch.Tensor:
        return gather_rows_global(self.comm, self.meta, rows_local, tag)
