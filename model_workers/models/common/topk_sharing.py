"""MTP index sharing (GLM-5.2 `index_share_for_mtp_iteration`): the draft steps reuse the MTP layer's top-k.

A draft-extend (or the prefill) records (`TopkMemo`), per request, the MTP layer's top-k key slots at its last
cached position; each later draft step of that request attends to those keys plus the keys the draft chain wrote
since (its own positions), instead of running its own top-k selection.
"""

from __future__ import annotations

import torch

from model_workers.page_table import PageTable


def position_slots(table: PageTable, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Key positions [n] (-1 = none) -> cache slots [n] (-1 kept)."""
    valid = positions.clamp_min(0)
    pages = torch.tensor(table.pages, dtype=torch.long)[valid // page_size]
    return torch.where(positions >= 0, pages * page_size + valid % page_size, -1)


def slot_positions(table: PageTable, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """The inverse of `position_slots`: cache slots [n] of `table`'s pages (-1 = none) -> key positions [n]."""
    index_of_page = torch.full((max(table.pages) + 1,), -1, dtype=torch.long)
    index_of_page[torch.tensor(table.pages, dtype=torch.long)] = torch.arange(len(table.pages))
    valid = slots.clamp_min(0)
    positions = index_of_page[valid // page_size] * page_size + valid % page_size
    return torch.where(slots >= 0, positions, -1)


def reuse_rows(kept: list[torch.Tensor], tables: list[PageTable], starts: list[int], end_offset: int,
               page_size: int) -> torch.Tensor:
    """Per request: its kept slots plus the slots of positions start..start+end_offset -> [B, width], -1 padded."""
    rows = []
    for slots, table, start in zip(kept, tables, starts):
        fresh = table.slots(start, start + end_offset + 1, page_size).to(slots.device)  # [end_offset + 1]
        rows.append(torch.cat([slots[slots >= 0], fresh]))
    width = max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel()), value=-1) for r in rows])  # [B, width]


class TopkMemo:
    """One layer's top-k selection: recorded (`kept`, [T, k'] slots, after the forward) or, while `reuse` is set,
    handed back instead of selecting (the backend then skips the indexer's queries: `needs_index_scores`)."""

    def __init__(self, layer_id: int):
        self.layer_id = layer_id
        self.kept: torch.Tensor | None = None
        self.reuse: torch.Tensor | None = None  # [T, width] slots, -1 padded

    def replaces(self, layer_id: int) -> bool:
        return layer_id == self.layer_id and self.reuse is not None

    def record(self, layer_id: int, topk_slots: torch.Tensor) -> None:
        if layer_id == self.layer_id:
            self.kept = topk_slots
