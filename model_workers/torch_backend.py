"""The torch attention backend over the paged KV cache (CPU and CUDA).

A `ForwardBatch` says, for one forward pass, which query rows belong to which request, their global
positions, where the rows handed to `store_kv` are written, and each request's key slots in position
order. Top-k selection and attention read keys back from the cache, so prefill, chunked prefill with a
cached prefix, decode and multi-token verification are one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import PagedKVCache
from .model.sparse_ops import causal_topk, sparse_mla_attention


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] global position of each query row
    request_rows: tuple[torch.Tensor, ...]  # per request: its query row indices into [T]
    key_slots: tuple[torch.Tensor, ...]  # per request: cache slots of positions 0..K_r-1
    write_slots: torch.Tensor  # [W] slot of each row handed to store_kv (W = T without CP)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


class TorchBackend:
    """Implements `model.backend.AttentionBackend` for one `ForwardBatch` at a time."""

    def __init__(self, cache: PagedKVCache):
        self.cache = cache
        self.batch: ForwardBatch | None = None

    def bind(self, batch: ForwardBatch) -> "TorchBackend":
        self.batch = batch
        return self

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        slots = self.batch.write_slots
        self.cache.latent[layer_id][slots] = latent.to(self.cache.latent[layer_id].dtype)
        if index_key is not None:
            store = self.cache.index_keys[layer_id]
            store[slots] = index_key.to(store.dtype)

    def select_topk(self, layer_id: int, index_q: torch.Tensor, index_weights: torch.Tensor, topk: int) -> torch.Tensor:
        batch, keys_store = self.batch, self.cache.index_keys[layer_id]
        width = min(topk, max((len(s) for s in batch.key_slots), default=0))
        out = torch.full((batch.num_rows, width), -1, dtype=torch.long, device=index_q.device)
        for rows, key_slots in zip(batch.request_rows, batch.key_slots):
            if rows.numel() == 0:
                continue
            key_positions = causal_topk(
                index_q[rows], index_weights[rows], keys_store[key_slots], batch.positions[rows], topk
            )  # [n, k_r]
            picked_slots = torch.where(key_positions >= 0, key_slots[key_positions.clamp_min(0)], -1)
            out[rows, : picked_slots.shape[1]] = picked_slots
        return out

    def attend(
        self, layer_id: int, q_latent: torch.Tensor, q_pe: torch.Tensor, topk_ids: torch.Tensor, scale: float
    ) -> torch.Tensor:
        return sparse_mla_attention(q_latent, q_pe, self.cache.latent[layer_id], topk_ids, scale)
