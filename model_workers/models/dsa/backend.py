"""The DSA family's backend over its paged cache (implements contract.py's `AttentionBackend`).

It composes, per forward, what differs between one rank, a CP rank and an expert-parallel rank instead of
inheriting it: a `ForwardBatch` (batch.py), a row stream (models/common/streams.py: this process's rows, or
every CP rank's gathered into the stream before they are stored), where the routed experts run, and optionally
a `TopkMemo` (MTP index sharing). Top-k selection and attention read keys back from the cache through the kernel
set (model_workers/kernels/), so prefill, chunked prefill with a cached prefix, decode and multi-token
verification are one code path, and under CP causality by global position and the within-request rule hold
with no extra code.
"""

from __future__ import annotations

import torch

from model_workers.kernels.interface import KernelSet
from model_workers.kernels.torch.batch_invariant import outside_mode
from model_workers.models.common.streams import LOCAL_ROWS, LocalExperts, RowStream
from model_workers.models.dsa.batch import ForwardBatch, PaddedRows, pad_rows, padded_rows
from model_workers.models.dsa.cache import PagedKVCache
from model_workers.models.common.topk_sharing import TopkMemo

BATCHED_TOPK_MAX_ROWS = 16  # requests with at most this many new rows each share one top-k pass (decode kernels)
# Selections narrower than top-k (short contexts) are padded (-1) to a multiple of this many keys: bf16
# products on CPU build a oneDNN kernel for every new shape (about 1.3 ms, against 0.15 ms for a 1-row
# attention over 64 keys), and a width that grew by one key per decode step built one every step.
KEY_WIDTH_STEP = 64


class DSABackend:
    def __init__(self, cache: PagedKVCache, kernels: KernelSet, experts=None, deterministic: bool = False):
        """`experts`: where routed experts run (default: all held here, `LocalExperts`); `deterministic`
        (--enable-deterministic-inference): top-k always `topk` wide, request by request, on fixed key tiles with
        ties to the earlier key, so that no query's picks depend on its batch."""
        self.cache, self.kernels, self.deterministic = cache, kernels, deterministic
        self.experts = experts if experts is not None else LocalExperts(kernels.experts)
        self.batch: ForwardBatch | None = None
        self.rows: RowStream = LOCAL_ROWS
        self.topk_memo: TopkMemo | None = None
        self._all_keys: dict[int, torch.Tensor] = {}  # width -> `all_causal_keys` of the bound batch
        self._max_keys = 0  # the bound batch's most keys of one request
        self.decodes = False  # the bound batch has few rows per request
        self._padded = None  # its requests' rows padded (several requests)

    def bind(self, batch: ForwardBatch, rows: RowStream = LOCAL_ROWS, topk_memo: TopkMemo | None = None):
        """This backend for one forward over `batch`; `rows`: how the batch's keys reach this process."""
        if batch.write_slots.shape[0] != batch.num_rows and rows is LOCAL_ROWS:
            raise ValueError(f"write_slots has {batch.write_slots.shape[0]} rows for {batch.num_rows} local rows")
        self.batch, self.rows, self.topk_memo = batch, rows, topk_memo
        self._all_keys = {}
        self._max_keys = max((len(s) for s in batch.key_slots), default=0)
        # few rows per request (decode, verification, drafts): the kernels' decode paths
        self.decodes = max((len(r) for r in batch.request_rows), default=0) <= BATCHED_TOPK_MAX_ROWS
        # the requests' rows padded to the longest, built here from the host's lengths once a forward (a forward
        # captured in a CUDA graph must not copy from the host while it runs)
        self._padded = padded_rows(batch.request_rows, batch.positions.device) if len(batch.request_rows) > 1 else None
        return self

    def store_kv(self, layer_id: int, latent: torch.Tensor, index_key: torch.Tensor | None) -> None:
        """Encodes this process's keys where they were computed (RoPE applied: FP8 quantizes after it), moves the
        stored bytes of the whole batch through the row stream (one collective per layer under CP) and writes
        them at the batch's write slots."""
        latent_rows, index_rows = self.cache.encode(latent, index_key)  # [T, W_lat], [T, W_idx]
        if self.rows is not LOCAL_ROWS:
            parts = [latent_rows] if index_rows is None else [latent_rows, index_rows]
            stream = self.rows.stream(torch.cat(parts, dim=-1), "kv")  # [N, W_lat (+ W_idx)]
            width = latent_rows.shape[-1]
            latent_rows, index_rows = stream[:, :width], (stream[:, width:] if index_rows is not None else None)
        self.cache.write(layer_id, self.batch.write_slots, latent_rows, index_rows)

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        """False when the layer reuses a recorded selection, or no request of the batch has more than `topk`
        keys (every query takes all its causal keys)."""
        if self.topk_memo is not None and self.topk_memo.replaces(layer_id):
            return False
        return self._max_keys > topk

    def select_topk(self, layer_id: int, index_q: torch.Tensor | None, index_weights: torch.Tensor | None,
                    topk: int) -> torch.Tensor:
        memo = self.topk_memo
        if memo is not None and memo.replaces(layer_id):
            return memo.reuse.to(self.batch.positions.device)  # index_q is None here (needs_index_scores)
        with outside_mode(self.deterministic):
            topk_slots = self._select(layer_id, index_q, index_weights, topk)  # [T, k']
        if memo is not None:
            memo.record(layer_id, topk_slots)
        return topk_slots

    def _select(self, layer_id: int, index_q, index_weights, topk: int) -> torch.Tensor:
        batch = self.batch
        width = topk if self.deterministic else selection_width(self._max_keys, topk)
        if index_q is None:
            if self._max_keys > topk:
                raise ValueError(f"layer {layer_id}: top-{topk} of up to {self._max_keys} keys needs the indexer's "
                                 "queries (needs_index_scores is True), got None")
            if width not in self._all_keys:  # the same for every layer of the forward
                self._all_keys[width] = all_causal_keys(batch, width, self._padded)
            return self._all_keys[width]
        out = torch.full((batch.num_rows, width), -1, dtype=torch.long, device=index_q.device)
        if not self.deterministic and len(batch.request_rows) > 1 and self.decodes:
            self._select_batched(layer_id, index_q, index_weights, topk, out)
        else:
            self._select_per_request(layer_id, index_q, index_weights, topk, out)
        return out

    def _select_per_request(self, layer_id, index_q, index_weights, topk, out) -> None:
        batch, keys_store, key_format = self.batch, self.cache.index_keys[layer_id], self.cache.index_format
        for rows, key_slots in zip(batch.request_rows, batch.key_slots):
            if rows.numel() == 0:
                continue
            key_positions = self.kernels.topk.causal(index_q[rows], index_weights[rows], keys_store, key_slots,
                                                     batch.positions[rows], topk, key_format,
                                                     deterministic=self.deterministic)  # [n, k_r]
            picked_slots = torch.where(key_positions >= 0, key_slots[key_positions.clamp_min(0)], -1)
            out[rows, : picked_slots.shape[1]] = picked_slots

    def _select_batched(self, layer_id, index_q, index_weights, topk, out) -> None:
        """Few rows per request (decode / verify): requests padded to the longest and scored together."""
        batch, device, padded = self.batch, index_q.device, self._padded
        row_ids = padded.ids  # [B, n] rows into [T], -1 = pad
        key_slots = pad_rows(list(batch.key_slots), 0, device)  # [B, K] (pads lie past every position)
        positions = torch.where(row_ids >= 0, batch.positions[row_ids.clamp_min(0)], -1)  # [B, n]
        safe_rows = row_ids.clamp_min(0)
        key_positions = self.kernels.topk.batched(index_q[safe_rows], index_weights[safe_rows],
                                                  self.cache.index_keys[layer_id], key_slots, positions, topk,
                                                  self.cache.index_format)  # [B, n, k]
        picked = torch.where(key_positions >= 0, key_slots.gather(1, key_positions.clamp_min(0).flatten(1))
                             .view_as(key_positions), -1)  # [B, n, k] slots
        out[padded.rows, : picked.shape[2]] = picked.flatten(0, 1)[padded.places]

    def routed_experts(self, layer_id: int, x, expert_ids, weights, experts) -> torch.Tensor:
        return self.experts.combine(x, expert_ids, weights, experts)

    def attend(self, layer_id: int, q_latent: torch.Tensor, q_pe: torch.Tensor, topk_ids: torch.Tensor,
               scale: float) -> torch.Tensor:
        cache, mla = self.cache, self.kernels.sparse_mla
        attend = mla.decode if self.decodes else mla.prefill
        with outside_mode(self.deterministic):  # one shape per product (topk wide): batch-invariant as it is
            return attend(q_latent, q_pe, cache.latent[layer_id], topk_ids, scale, cache.latent_format)


def selection_width(max_keys: int, topk: int) -> int:
    """Key ids per query row for a batch whose longest request has `max_keys` keys: top-k, or fewer keys
    rounded up to a multiple of KEY_WIDTH_STEP (the rest -1), so that few distinct widths ever occur."""
    return min(topk, -(-max_keys // KEY_WIDTH_STEP) * KEY_WIDTH_STEP)


def all_causal_keys(batch: ForwardBatch, width: int, padded: PaddedRows | None = None) -> torch.Tensor:
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
    padded = padded or padded_rows(batch.request_rows, device)
    row_ids = padded.ids  # [B, n] rows into [T], -1 = pad
    key_slots = pad_rows(list(batch.key_slots), -1, device)[:, :width]  # [B, K] slots of positions 0..K-1
    positions = torch.where(row_ids >= 0, batch.positions[row_ids.clamp_min(0)], -1)  # [B, n]
    key_positions = torch.arange(key_slots.shape[1], device=device)  # [K]
    causal = key_positions[None, None, :] <= positions[:, :, None]  # [B, n, K]
    picked = torch.where(causal, key_slots[:, None, :], -1)  # [B, n, K]
    out[padded.rows, : picked.shape[2]] = picked.flatten(0, 1)[padded.places]
    return out
