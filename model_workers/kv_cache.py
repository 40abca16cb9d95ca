"""Paged KV cache of one rank: fixed-size pages addressed through page tables the engine's scheduler hands out.

Per cache layer (target layers, then MTP layers) the cache holds the MLA latent c_kv ‖ k_pe and, on
layers that run an indexer, the indexer key. A slot is `page * page_size + offset`; every layer uses
the same slots for the same token, so one page table serves all layers. The rank never allocates pages:
the scheduler's allocator (cp_router/pages.py) does, and a step's plan carries each request's pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        latent_dim: int,
        index_dim: int,
        indexed_layers: list[bool],
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        slots = num_pages * page_size
        self.latent = [torch.zeros(slots, latent_dim, dtype=dtype, device=device) for _ in indexed_layers]
        self.index_keys = [
            torch.zeros(slots, index_dim, dtype=dtype, device=device) if has_index else None
            for has_index in indexed_layers
        ]

    def check_room(self, table: PageTable, num_tokens: int) -> None:
        """The plan's contract: `table` has pages (on this cache) for positions 0..num_tokens-1."""
        check_page_room(table, num_tokens, self.page_size, self.num_pages)

    def release(self, pages) -> None:
        """Nothing to drop: a request's keys live in its pages only (the scheduler frees them)."""

    def rows(self, table: PageTable) -> dict[str, list[torch.Tensor | None]]:
        """The cached keys of positions 0..num_tokens-1 per cache layer: latent [n, latent_dim] and index key
        [n, index_dim] (None on layers without an indexer)."""
        slots = table.slots(0, table.num_tokens, self.page_size).to(self.latent[0].device)  # [n]
        return {
            "latent": [layer[slots].cpu() for layer in self.latent],
            "index_keys": [None if layer is None else layer[slots].cpu() for layer in self.index_keys],
        }

    def bytes_per_token(self) -> int:
        total = sum(t.shape[1] * t.element_size() for t in self.latent)
        return total + sum(t.shape[1] * t.element_size() for t in self.index_keys if t is not None)
