"""Paged KV cache: fixed-size pages, one page table per request, a pure-Python allocator that never leaks.

Per cache layer (target layers, then MTP layers) the cache holds the MLA latent c_kv ‖ k_pe and, on
layers that run an indexer, the indexer key. A slot is `page * page_size + offset`; every layer uses
the same slots for the same token, so one page table serves all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request; callers check `can_allocate` first or preempt."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(count)]
        self._in_use.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._in_use:
                raise ValueError(f"page {page} freed twice or never allocated")
            self._in_use.remove(page)
            self._free.append(page)


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
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        slots = num_pages * page_size
        self.latent = [torch.zeros(slots, latent_dim, dtype=dtype, device=device) for _ in indexed_layers]
        self.index_keys = [
            torch.zeros(slots, index_dim, dtype=dtype, device=device) if has_index else None
            for has_index in indexed_layers
        ]

    def pages_needed(self, table: PageTable, new_total_tokens: int) -> int:
        needed = -(-new_total_tokens // self.page_size)
        return max(0, needed - len(table.pages))

    def reserve(self, table: PageTable, new_total_tokens: int) -> None:
        """Grow the table so positions < new_total_tokens have slots (KV is written later)."""
        table.pages.extend(self.allocator.allocate(self.pages_needed(table, new_total_tokens)))

    def truncate(self, table: PageTable, num_tokens: int) -> None:
        """Roll back to `num_tokens` valid positions and release pages no longer needed."""
        keep = -(-num_tokens // self.page_size)
        self.allocator.free(table.pages[keep:])
        del table.pages[keep:]
        table.num_tokens = min(table.num_tokens, num_tokens)

    def release(self, table: PageTable) -> None:
        self.truncate(table, 0)

    def bytes_per_token(self) -> int:
        total = sum(t.shape[1] * t.element_size() for t in self.latent)
        return total + sum(t.shape[1] * t.element_size() for t in self.index_keys if t is not None)
