"""KV pages: the one allocator. The engine's scheduler owns one per CP rank and hands ranks page tables.

A page holds `page_size` consecutive positions of one request in every cache layer of a rank. The allocator
is pure Python, never leaks (tests drive it with random operation sequences) and refuses double frees.
"""

from __future__ import annotations

from cp_router.cp.padding import ceil_div


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request; callers check `can_allocate` first or preempt."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold positions 0..tokens-1."""
    return ceil_div(tokens, page_size)


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

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

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

    def grow(self, pages: list[int], tokens: int, page_size: int) -> None:
        """Appends pages to a request's list `pages` until it holds positions 0..tokens-1."""
        pages.extend(self.allocate(max(0, pages_for(tokens, page_size) - len(pages))))

    def trim(self, pages: list[int], tokens: int, page_size: int) -> None:
        """Frees the tail of a request's list `pages` beyond what positions 0..tokens-1 need."""
        keep = pages_for(tokens, page_size)
        self.free(pages[keep:])
        del pages[keep:]
