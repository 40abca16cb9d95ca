"""A request's pages on one rank: the page table every plan carries, and the check that it has room.

The rank never allocates pages: the engine scheduler's allocator (cp_router/pages.py) does, and a step's plan
carries each request's pages. A slot is `page * page_size + offset`; every cache layer of a family's cache uses the
same slots for the same token, so one page table serves all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PageTable:
    """Pages of one request in position order, and how many positions hold valid KV."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    state_key: str | None = None  # the request's id on a rank: what a family's per-request state is filed under

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
