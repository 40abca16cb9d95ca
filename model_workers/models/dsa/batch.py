"""What one DSA forward reads and writes: `ForwardBatch`, built for one rank (`local_batch`) or for one CP rank's
shard of a prefill batch (`cp_batch`).

Rows are the query tokens this process runs; every request's keys are its cache slots of positions 0..end-1, so
prefill, chunked prefill with a cached prefix, decode and multi-token verification are one description.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.cp.metadata import RankMetadata
from model_workers.page_table import PageTable


@dataclass(frozen=True)
class ForwardBatch:
    positions: torch.Tensor  # [T] global position of each query row
    request_rows: tuple[torch.Tensor, ...]  # per request: its query row indices into [T]
    key_slots: tuple[torch.Tensor, ...]  # per request: cache slots of positions 0..K_r-1
    write_slots: torch.Tensor  # [W] slot of each row handed to store_kv (W = T without CP, N under CP)

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


def local_batch(cache, tables: list[PageTable], lengths: list[int], page_size: int, device) -> ForwardBatch:
    """One rank: rows are the new tokens, request after request, at positions table.num_tokens.. of each."""
    positions, request_rows, key_slots, write_slots = [], [], [], []
    row = 0
    for table, count in zip(tables, lengths):
        start = table.num_tokens
        positions.append(torch.arange(start, start + count))
        request_rows.append(torch.arange(row, row + count, device=device))
        slots = table.slots(0, start + count, page_size).to(device)
        key_slots.append(slots)
        write_slots.append(slots[start:])
        row += count
    return ForwardBatch(
        positions=torch.cat(positions).to(device),
        request_rows=tuple(request_rows),
        key_slots=tuple(key_slots),
        write_slots=torch.cat(write_slots),
    )


def cp_batch(cache, tables: list[PageTable], meta: RankMetadata, page_size: int, device) -> ForwardBatch:
    """One CP rank of a prefill batch. Rows: this rank's logical rows (global positions, local order). Keys: every
    request's positions 0..prefix+extend-1 in this rank's cache (each rank holds pages for every request of the
    batch); writes: all N rows of the stream, in global order (the backend's row stream gathers them)."""
    request_index_local = meta.request_index_local[: meta.num_logical]  # [T_logical]
    request_rows, key_slots, write_slots = [], [], []
    for s, table in enumerate(tables):
        prefix_len = meta.prefix_lens[s]
        slots = table.slots(0, prefix_len + meta.extend_lens[s], page_size).to(device)  # [K_s]
        key_slots.append(slots)
        write_slots.append(slots[prefix_len:])  # [L_s] stream order of request s
        request_rows.append(torch.nonzero(request_index_local == s).flatten().to(device))
    return ForwardBatch(
        positions=meta.positions_local[: meta.num_logical].to(device),  # [T_logical] global positions
        request_rows=tuple(request_rows),
        key_slots=tuple(key_slots),
        write_slots=torch.cat(write_slots),  # [N] global stream order
    )


@dataclass(frozen=True)
class PaddedRows:
    """Requests' query rows padded to the longest request: `ids` [B, n] rows into [T] (-1 = pad), and the real
    entries as places in the flattened [B * n] (`places` [R]) with their rows (`rows` [R]), built from the lengths
    on the host, so scattering results back reads nothing from the device (no boolean-mask indexing)."""

    ids: torch.Tensor
    places: torch.Tensor
    rows: torch.Tensor


def padded_rows(request_rows: tuple[torch.Tensor, ...], device) -> PaddedRows:
    ids = pad_rows(list(request_rows), -1, device)  # [B, n]
    width = ids.shape[1]
    places = torch.tensor([b * width + i for b, rows in enumerate(request_rows) for i in range(len(rows))],
                          dtype=torch.long).to(device)  # [R]
    rows = torch.cat(list(request_rows)) if request_rows else torch.zeros(0, dtype=torch.long, device=device)
    return PaddedRows(ids, places, rows)


def pad_rows(rows: list[torch.Tensor], fill: int, device) -> torch.Tensor:
    """1-D index tensors -> [len(rows), longest] padded with `fill`."""
    out = torch.full((len(rows), max(len(r) for r in rows)), fill, dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        out[b, : len(r)] = r
    return out
