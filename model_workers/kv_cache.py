"""Paged KV cache of one rank: fixed-size pages addressed through page tables the engine's scheduler hands out.

Per cache layer (target layers, then MTP layers) the cache holds the MLA latent c_kv ‖ k_pe and, on
layers that run an indexer, the indexer key, each in its storage format (plain bf16 / fp32 rows, or the FP8
layout of kv_format.py). A slot is `page * page_size + offset`; every layer uses
the same slots for the same token, so one page table serves all layers. The rank never allocates pages:
the scheduler's allocator (cp_router/pages.py) does, and a step's plan carries each request's pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model_workers.kv_format import KeyFormat


@dataclass
class PageTable:
    """Pages of one request in position order, and how many positions hold valid KV."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def slots(self, start: int, end: int, page_size: int) -> torch.Tensor:
        """Cache slots of positions start..end-1, [end - start] int64."""
        positions = torch.arange(start, end)
        pages = torch.tensor(self.pages, dtype=torch.long)[positions // page_size]
        return pages * page_size + positions % page_size


def check_page_room(table: PageTable, num_tokens: int, page_size: int, num_pages: int) -> None:
    """`table` has pages for positions 0..num_tokens-1, all of them among this cache's 0..num_pages-1."""
    if len(table.pages) * page_size < num_tokens:
        raise ValueError(f"page table of {len(table.pages)} pages x {page_size} holds fewer than the "
                         f"{num_tokens} positions the step writes; the scheduler must grow it first")
    if table.pages and not 0 <= min(table.pages) <= max(table.pages) < num_pages:
        raise ValueError(f"page table {table.pages} names pages outside this cache's 0..{num_pages - 1}")


class PagedKVCache:
    """Per cache layer: `latent[layer]` [slots, latent_format.width] and `index_keys[layer]` [slots,
    index_format.width] (None on layers without an indexer), in the formats' storage dtypes (kv_format.py).
    Keys enter encoded (`encode`, on the rank that computed them) and leave decoded, row by gathered row."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        latent_format: KeyFormat,
        index_format: KeyFormat,
        indexed_layers: list[bool],
        device: torch.device | str = "cpu",
    ):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self.latent_format, self.index_format = latent_format, index_format
        slots = num_pages * page_size
        self.latent = [self._store(slots, latent_format, device) for _ in indexed_layers]
        self.index_keys = [self._store(slots, index_format, device) if has_index else None
                           for has_index in indexed_layers]

    @staticmethod
    def _store(slots: int, key_format: KeyFormat, device) -> torch.Tensor:
        return torch.zeros(slots, key_format.width, dtype=key_format.store_dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.latent[0].shape[0]

    def check_room(self, table: PageTable, num_tokens: int) -> None:
        """The plan's contract: `table` has pages (on this cache) for positions 0..num_tokens-1."""
        check_page_room(table, num_tokens, self.page_size, self.num_pages)

    def release(self, pages) -> None:
        """Nothing to drop: a request's keys live in its pages only (the scheduler frees them)."""

    def encode(self, latent: torch.Tensor, index_key: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Computed keys latent [T, C + R], index_key [T, D_idx] or None -> their stored rows (quantized under FP8)."""
        return self.latent_format.encode(latent), None if index_key is None else self.index_format.encode(index_key)

    def write(self, layer_id: int, slots: torch.Tensor, latent_rows: torch.Tensor, index_rows: torch.Tensor | None):
        """Stores encoded rows [W, width] at `slots` [W]."""
        self.latent[layer_id][slots] = latent_rows
        if index_rows is not None:
            self.index_keys[layer_id][slots] = index_rows

    def rows(self, table: PageTable) -> dict[str, list[torch.Tensor | None]]:
        """The stored rows of positions 0..num_tokens-1 per cache layer, as the cache holds them (FP8: bytes):
        latent [n, latent width] and index key [n, index width] (None on layers without an indexer)."""
        slots = table.slots(0, table.num_tokens, self.page_size).to(self.latent[0].device)  # [n]
        return {
            "latent": [layer[slots].cpu() for layer in self.latent],
            "index_keys": [None if layer is None else layer[slots].cpu() for layer in self.index_keys],
        }

    def bytes_per_token(self) -> int:
        """Bytes one token occupies over every cache layer, read off the allocated stores."""
        stores = [t for t in self.latent + self.index_keys if t is not None]
        return sum(t.shape[1] * t.element_size() for t in stores)
