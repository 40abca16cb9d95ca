"""The torch attention backend over the paged KV cache (CPU and CUDA).

A `ForwardBatch` says, for one forward pass, which query rows belong to which request, their global
positions, where the rows handed to `store_kv` are written, and each request's key slots in position
order. Top-k selection and attention read keys back from the cache, so prefill, chunked prefill with a
cached prefix, decode and multi-token verification are one code path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model_workers.expert_parallel import ExpertExchange
from model_workers.kv_cache import PagedKVCache
from model_workers.model.batch_invariant import outside_mode
from model_workers.model.sparse_ops import batched_causal_topk, causal_topk, sparse_mla_attention, take_rows

BATCHED_TOPK_MAX_ROWS = 16  # requests with at most this many new rows each share one top-k pass
# Selections narrower than top-k (short contexts) are padded (-1) to a multiple of this many keys: bf16
# products on CPU build a oneDNN kernel for every new shape (about 1.3 ms, against 0.15 ms for a 1-row
# attention over 64 keys), and a width that grew by one key per decode step built one every step.
KEY_WIDTH_STEP = 64


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
    """Implements `model.backend.AttentionBackend` for one `ForwardBatch` at a time; with an `ExpertExchange`,
    a MoE layer's routed experts run across the expert-parallel group."""

    def __init__(self, cache: PagedKVCache, exchange: ExpertExchange | None = None, deterministic: bool = False):
        """`deterministic` (--enable-deterministic-inference): top-k always `topk` wide, request by request, on
        fixed key tiles with ties to the earlier key, so that no query's picks depend on its batch."""
        self.cache = cache
        self.exchange = exchange
        self.deterministic = deterministic
        self.batch: ForwardBatch | None = None
        self._all_keys: dict[int, torch.Tensor] = {}  # width -> `all_causal_keys` of the bound batch
        self._max_keys = 0  # the bound batch's most keys of one request

    def bind(self, batch: ForwardBatch) -> "TorchBackend":
        self.batch = batch
        self._all_keys = {}
        self._max_keys = max((len(s) for s in batch.key_slots), default=0)
        return self

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        """Encodes the batch's keys here, where they were computed (RoPE applied: FP8 quantizes after it)."""
        self.store_rows(layer_id, *self.cache.encode(latent, index_key))

    def store_rows(self, layer_id: int, latent_rows: torch.Tensor, index_rows: torch.Tensor | None) -> None:
        """Writes encoded rows [W, width] at the batch's write slots."""
        self.cache.write(layer_id, self.batch.write_slots, latent_rows, index_rows)

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        """False when no request of the batch has more than `topk` keys: every query takes all its causal keys."""
        return self._max_keys > topk

    def select_topk(self, layer_id: int, index_q: torch.Tensor | None, index_weights: torch.Tensor | None,
                    topk: int) -> torch.Tensor:
        with outside_mode(self.deterministic):
            return self._select(layer_id, index_q, index_weights, topk)

    def _select(self, layer_id: int, index_q, index_weights, topk: int) -> torch.Tensor:
        batch = self.batch
        width = topk if self.deterministic else selection_width(self._max_keys, topk)
        if index_q is None:
            if self._max_keys > topk:
                raise ValueError(f"layer {layer_id}: top-{topk} of up to {self._max_keys} keys needs the indexer's "
                                 "queries (needs_index_scores is True), got None")
            if width not in self._all_keys:  # the same for every layer of the forward
                self._all_keys[width] = all_causal_keys(batch, width)
            return self._all_keys[width]
        out = torch.full((batch.num_rows, width), -1, dtype=torch.long, device=index_q.device)
        if self.deterministic:
            self._select_per_request(layer_id, index_q, index_weights, topk, out)
        elif len(batch.request_rows) > 1 and max(len(r) for r in batch.request_rows) <= BATCHED_TOPK_MAX_ROWS:
            self._select_batched(layer_id, index_q, index_weights, topk, out)
        else:
            self._select_per_request(layer_id, index_q, index_weights, topk, out)
        return out

    def _select_per_request(self, layer_id, index_q, index_weights, topk, out) -> None:
        batch, keys_store = self.batch, self.cache.index_keys[layer_id]
        for rows, key_slots in zip(batch.request_rows, batch.key_slots):
            if rows.numel() == 0:
                continue
            key_positions = causal_topk(index_q[rows], index_weights[rows], take_rows(keys_store, key_slots),
                                        batch.positions[rows], topk, decode=self.cache.index_format.decode,
                                        deterministic=self.deterministic)  # [n, k_r]
            picked_slots = torch.where(key_positions >= 0, key_slots[key_positions.clamp_min(0)], -1)
            out[rows, : picked_slots.shape[1]] = picked_slots

    def _select_batched(self, layer_id, index_q, index_weights, topk, out) -> None:
        """Few rows per request (decode / verify): requests padded to the longest and scored together."""
        batch, device = self.batch, index_q.device
        row_ids = pad_rows([r for r in batch.request_rows], -1, device)  # [B, n] rows into [T], -1 = pad
        key_slots = pad_rows(list(batch.key_slots), 0, device)  # [B, K] (pads lie past every position)
        positions = torch.where(row_ids >= 0, batch.positions[row_ids.clamp_min(0)], -1)  # [B, n]
        safe_rows = row_ids.clamp_min(0)
        keys = take_rows(self.cache.index_keys[layer_id], key_slots)  # [B, K, W] stored rows
        key_positions = batched_causal_topk(index_q[safe_rows], index_weights[safe_rows], keys, positions, topk,
                                            decode=self.cache.index_format.decode)
        picked = torch.where(key_positions >= 0, key_slots.gather(1, key_positions.clamp_min(0).flatten(1))
                             .view_as(key_positions), -1)  # [B, n, k] slots
        real = row_ids >= 0
        out[row_ids[real], : picked.shape[2]] = picked[real]

    def routed_experts(self, layer_id: int, x, expert_ids, weights, experts) -> torch.Tensor:
        if self.exchange is None:
            return experts(x, expert_ids, weights)
        return self.exchange.combine(x, expert_ids, weights, experts)

    def attend(
        self, layer_id: int, q_latent: torch.Tensor, q_pe: torch.Tensor, topk_ids: torch.Tensor, scale: float
    ) -> torch.Tensor:
        cache = self.cache
        with outside_mode(self.deterministic):  # one shape per product (topk wide): batch-invariant as it is
            return sparse_mla_attention(q_latent, q_pe, cache.latent[layer_id], topk_ids, scale,
                                        decode=cache.latent_format.decode)


def selection_width(max_keys: int, topk: int) -> int:
    """Key ids per query row for a batch whose longest request has `max_keys` keys: top-k, or fewer keys
    rounded up to a multiple of KEY_WIDTH_STEP (the rest -1), so that few distinct widths ever occur."""
    return min(topk, -(-max_keys // KEY_WIDTH_STEP) * KEY_WIDTH_STEP)


def all_causal_keys(batch: ForwardBatch, width: int) -> torch.Tensor:
    """[T, width] slots: each query's causal keys (positions 0..p) in position order, then -1. What the top-k
    selection picks when no query has more than `width` keys, whatever the scores (`pick_causal`)."""
    device = batch.positions.device
    out = torch.full((batch.num_rows, width), -1, dtype=torch.long, device=device)
    if batch.num_rows == 0 or width == 0:
        return out
    if len(batch.request_rows) == 1 and len(batch.request_rows[0]) == batch.num_rows:  # one request, rows 0..T-1
        slots = batch.key_slots[0][:width]  # [K]
        causal = torch.arange(slots.shape[0], device=device)[None, :] <= batch.positions[:, None]  # [T, K]
        out[:, : slots.shape[0]] = torch.where(causal, slots[None, :], -1)
        return out
    row_ids = pad_rows(list(batch.request_rows), -1, device)  # [B, n] rows into [T], -1 = pad
    key_slots = pad_rows(list(batch.key_slots), -1, device)[:, :width]  # [B, K] slots of positions 0..K-1
    positions = torch.where(row_ids >= 0, batch.positions[row_ids.clamp_min(0)], -1)  # [B, n]
    key_positions = torch.arange(key_slots.shape[1], device=device)  # [K]
    causal = key_positions[None, None, :] <= positions[:, :, None]  # [B, n, K]
    picked = torch.where(causal, key_slots[:, None, :], -1)  # [B, n, K]
    real = row_ids >= 0
    out[row_ids[real], : picked.shape[2]] = picked[real]
    return out


def pad_rows(rows: list[torch.Tensor], fill: int, device) -> torch.Tensor:
    """1-D index tensors -> [len(rows), longest] padded with `fill`."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out
