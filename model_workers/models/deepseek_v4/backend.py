"""DeepSeek-V4's backend over `V4Cache` (implements contract.py's `V4AttentionBackend`).

A `V4Batch` says which requests a forward extends: each request's state, the position its new tokens
start at and how many there are, in stream order (request after request), and which of this process's
query rows belong to it. Without context parallelism the rows are the stream (`local_batch`). Under CP
(`cp_batch`) the backend's row stream (models/common/streams.py) first gathers every rank's rows into the
stream, so every rank keeps every request's rows and entries and each compressed entry equals the one-rank
entry; queries stay local. Where routed experts run is composed in the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.cp.metadata import RankMetadata
from model_workers.models.common.streams import LOCAL_ROWS, LocalExperts, RowStream
from model_workers.models.deepseek_v4.cache import ROLLBACK_TOKENS, CompressedState, RowsTail, V4Cache
from model_workers.page_table import PageTable


@dataclass(frozen=True)
class V4Batch:
    tables: tuple[PageTable, ...]  # per request: its pages on this rank (the compressed entries live there)
    states: tuple[dict, ...]  # per request: its `V4Cache` per-request state
    starts: tuple[int, ...]  # per request: position of its first new token (= positions already cached)
    lengths: tuple[int, ...]  # per request: new tokens, in stream order
    positions: torch.Tensor  # [T] global position of each of this process's query rows
    request_rows: tuple[torch.Tensor, ...]  # per request: its query rows into [T]

    def stream_slices(self):
        """(request index, stream offset, start, end) per request."""
        offset = 0
        for s, (start, length) in enumerate(zip(self.starts, self.lengths)):
            yield s, offset, start, start + length
            offset += length


def v4_batch(cache: V4Cache, tables: list[PageTable], lengths: list[int], positions: torch.Tensor,
             request_rows: list[torch.Tensor]) -> V4Batch:
    copies = tuple(PageTable(list(t.pages), t.num_tokens, t.state_key) for t in tables)  # the step moves num_tokens on
    return V4Batch(copies, tuple(cache.request(t) for t in tables), tuple(t.num_tokens for t in tables),
                   tuple(lengths), positions, tuple(request_rows))


def local_batch(cache: V4Cache, tables: list[PageTable], lengths: list[int], page_size: int, device) -> V4Batch:
    """One rank: rows are the stream, request after request, positions table.num_tokens.. of each."""
    positions = [torch.arange(t.num_tokens, t.num_tokens + n) for t, n in zip(tables, lengths)]
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist()
    rows = [torch.arange(bounds[s], bounds[s + 1], device=device) for s in range(len(tables))]
    flat = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
    return v4_batch(cache, tables, lengths, flat.to(device), rows)


def cp_batch(cache: V4Cache, tables: list[PageTable], meta: RankMetadata, page_size: int, device) -> V4Batch:
    """One CP rank of a prefill batch: this rank's logical rows as queries; every request's whole chunk in the
    stream (gathered by the backend's row stream)."""
    request_index_local = meta.request_index_local[: meta.num_logical]  # [T_logical]
    rows = [torch.nonzero(request_index_local == s).flatten().to(device) for s in range(len(tables))]
    return v4_batch(cache, tables, list(meta.extend_lens), meta.positions_local[: meta.num_logical].to(device), rows)


class V4Backend:
    def __init__(self, cache: V4Cache, kernels, experts=None, deterministic: bool = False):
        """`experts`: where routed experts run (default: all held here); `deterministic` is refused at start-up
        for this family (`batch_invariant` False), so it is not read here."""
        self.cache = cache
        self.experts = experts if experts is not None else LocalExperts(kernels.experts)
        self.batch: V4Batch | None = None
        self.rows: RowStream = LOCAL_ROWS

    def bind(self, batch: V4Batch, rows: RowStream = LOCAL_ROWS, topk_memo=None) -> "V4Backend":
        if topk_memo is not None:
            raise ValueError("DeepSeek-V4 has no MTP index sharing (its MTP block is sliding-only)")
        self.batch, self.rows = batch, rows
        return self

    @property
    def request_rows(self) -> tuple[torch.Tensor, ...]:
        return self.batch.request_rows

    def kept_rows(self, rows_local: torch.Tensor, tag: str) -> torch.Tensor:
        """The rows as the cache keeps them (its dtype, as a paged KV cache stores keys) in stream order."""
        return self.rows.stream(rows_local.to(self.cache.dtype), tag)

    def window_rows(self, layer_id: int, kv: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        batch, window = self.batch, self.cache.config.sliding_window
        stream = self.kept_rows(kv, "kv")  # [N, Dh]
        out = []
        for s, offset, start, end in batch.stream_slices():
            tail: RowsTail = batch.states[s].setdefault((layer_id, "window"), RowsTail())
            first = max(0, start - (window - 1))  # the rows of positions first..end-1 its queries' windows span
            keep_from = end - (window - 1) - ROLLBACK_TOKENS
            out.append((tail.extend(first, start, stream[offset : offset + end - start], keep_from), first))
        return out

    def compressed_entries(self, layer_id: int, compressor, table, kv: torch.Tensor,
                           gate: torch.Tensor) -> list[torch.Tensor]:
        batch, rate, lookback = self.batch, compressor.rate, compressor.lookback_windows
        width = kv.shape[-1]
        stream = self.kept_rows(torch.cat([kv, gate], dim=-1), "kv")  # [N, 2C]: counted as KV gathers
        out = []
        for s, offset, start, end in batch.stream_slices():
            state: CompressedState = batch.states[s].setdefault((layer_id, compressor.state_name), CompressedState())
            done, closed = start // rate, end // rate  # entries already kept / after this batch
            first = max(0, done - lookback)  # window whose rows come first
            keep_from = (max(0, (end - ROLLBACK_TOKENS) // rate) - lookback) * rate
            rows = state.rows.extend(first * rate, start, stream[offset : offset + end - start], keep_from)
            if closed > done:
                whole = rows[: (closed - first) * rate].to(kv.dtype)
                fresh = compressor.entries(whole[:, :width], whole[:, width:], first, table)[done - first :]
                self.cache.write_entries(batch.tables[s], layer_id, compressor.state_name, done, fresh)
            out.append(self.cache.read_entries(batch.tables[s], layer_id, compressor.state_name, closed))
        return out

    def routed_experts(self, layer_id: int, x, expert_ids, weights, experts) -> torch.Tensor:
        return self.experts.combine(x, expert_ids, weights, experts)
