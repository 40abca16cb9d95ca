"""MTP index sharing (GLM-5.2 `index_share_for_mtp_iteration`): the draft steps reuse the MTP layer's top-k.

A draft-extend (or the prefill) records, per request, the MTP layer's top-k key slots at its last cached
position; each later draft step of that request attends to those keys plus the keys the draft chain wrote
since (its own positions), instead of running its own top-k selection.
"""

from __future__ import annotations

import torch

from model_workers.backends.torch_backend import TorchBackend
from model_workers.kv_cache import PageTable


def position_slots(table: PageTable, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Key positions [n] (-1 = none) -> cache slots [n] (-1 kept)."""
    valid = positions.clamp_min(0)
    pages = torch.tensor(table.pages, dtype=torch.long)[valid // page_size]
    return torch.where(positions >= 0, pages * page_size + valid % page_size, -1)


def reuse_rows(kept: list[torch.Tensor], tables: list[PageTable], starts: list[int], end_offset: int,
               page_size: int) -> torch.Tensor:
    """Per request: its kept slots plus the slots of positions start..start+end_offset -> [B, width], -1 padded."""
    rows = []
    for slots, table, start in zip(kept, tables, starts):
        fresh = table.slots(start, start + end_offset + 1, page_size).to(slots.device)  # [end_offset + 1]
        rows.append(torch.cat([slots[slots >= 0], fresh]))
    width = max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel()), value=-1) for r in rows])  # [B, width]


class SharedTopkBackend(TorchBackend):
    """Records the top-k of `layer_id` (`kept`, [T, k'] slots), or hands `reuse` back instead of selecting."""

    def __init__(self, cache, layer_id: int, exchange=None, deterministic: bool = False):
        super().__init__(cache, exchange, deterministic)
        self.layer_id = layer_id
        self.kept: torch.Tensor | None = None
        self.reuse: torch.Tensor | None = None

    def needs_index_scores(self, layer_id: int, topk: int) -> bool:
        return not (layer_id == self.layer_id and self.reuse is not None) and super().needs_index_scores(layer_id, topk)

    def select_topk(self, layer_id: int, index_q: torch.Tensor | None, index_weights: torch.Tensor | None,
                    topk: int) -> torch.Tensor:
        if layer_id == self.layer_id and self.reuse is not None:
            return self.reuse.to(self.batch.positions.device)  # index_q is None here (needs_index_scores)
        topk_slots = super().select_topk(layer_id, index_q, index_weights, topk)  # [T, k']
        if layer_id == self.layer_id:
            self.kept = topk_slots
        return topk_slots
