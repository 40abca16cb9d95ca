"""KV pages: the one allocator, with the prefix cache's content index. The engine's scheduler owns one per CP rank
and hands ranks page tables.

A page holds `page_size` consecutive positions of one request in every cache layer of a rank. A page is in one of
three states:
* free: on the free list, holding nothing anyone will read;
* in use: referenced by `refs[page]` >= 1 requests (several only when they share it as a cached prefix: a shared
  page is never written again);
* cached: unreferenced but indexed by its content key (cp_router/prefix_cache.py): a later request with the same
  prefix takes it back (`share`). Cached pages count as free for admission: `allocate` evicts the least recently
  released one when the free list is empty, and eviction never touches a page in use.

A page in use may be indexed too (a running request's full prompt pages): it becomes cached when its last user
releases it. `snapshot` marks a page whose end the ranks keep a per-request state for (DeepSeek-V4's bounded
state, docs/kv_cache.md 'Prefix caching'); when such a page is evicted or freed the mark goes to
`take_dropped_snapshots`, which the scheduler forwards to the rank. The allocator is pure Python, never leaks
(tests drive it with random operation sequences) and refuses double frees.
"""

from __future__ import annotations

from collections import OrderedDict

from cp_router.cp.padding import ceil_div


class OutOfPages(RuntimeError):
    """The allocator cannot satisfy a request; callers check `can_allocate` first or preempt."""


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold positions 0..tokens-1."""
    return ceil_div(tokens, page_size)


MAX_SNAPSHOTS = 32  # state snapshots a rank keeps at most (each up to the family's bounded per-request state)


class PageAllocator:
    def __init__(self, num_pages: int, max_snapshots: int = MAX_SNAPSHOTS):
        if num_pages <= 0:
            raise ValueError(f"num_pages={num_pages}: must be positive")
        self.num_pages, self.max_snapshots = num_pages, max_snapshots
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._refs: dict[int, int] = {}  # page in use -> requests holding it
        self._key_of: dict[int, bytes] = {}  # indexed page -> its content key
        self._page_of: dict[bytes, int] = {}  # content key -> the page holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced indexed pages, least recent first
        self._snapshots: OrderedDict[int, None] = OrderedDict()  # pages whose end a rank keeps a state snapshot for,
        # least recently marked or hit first
        self._dropped_snapshots: list[int] = []
        self.evictions = 0  # cached pages reused for other content

    @property
    def num_free(self) -> int:
        """Pages an allocation may take: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages indexed by content, in use or not."""
        return len(self._key_of)

    @property
    def num_evictable(self) -> int:
        return len(self._cached)

    def can_allocate(self, count: int) -> bool:
        return 0 <= count <= self.num_free

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise OutOfPages(f"asked for {count} pages, {self.num_free} free of {self.num_pages}")
        pages = [self._free.pop() if self._free else self._evict() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        return pages

    def _evict(self) -> int:
        page, _ = self._cached.popitem(last=False)
        self._unindex(page)
        self.evictions += 1
        return page

    def free(self, pages: list[int]) -> None:
        """Releases one reference to each page; a page nobody holds becomes cached (indexed) or free. A request's
        pages go tail first, so that the tail of a cached prefix is evicted before its head."""
        for page in reversed(pages):
            refs = self._refs.get(page, 0)
            if refs <= 0:
                raise ValueError(f"page {page} freed twice or never allocated")
            if refs > 1:
                self._refs[page] = refs - 1
                continue
            del self._refs[page]
            if page in self._key_of:
                self._cached[page] = None
            else:
                self._to_free_list(page)

    def _to_free_list(self, page: int) -> None:
        self._drop_snapshot(page)
        self._free.append(page)

    def _unindex(self, page: int) -> None:
        del self._page_of[self._key_of.pop(page)]
        self._drop_snapshot(page)

    def _drop_snapshot(self, page: int) -> None:
        if self._snapshots.pop(page, 0) is None:
            self._dropped_snapshots.append(page)

    # the content index -----------------------------------------------------------------------------
    def register(self, page: int, key: bytes) -> bool:
        """Indexes a page in use under its content key; False when another page already holds that content or
        this page is indexed already (it then stays as it is)."""
        if self._refs.get(page, 0) <= 0:
            raise ValueError(f"page {page} is not in use: only a request's own written page can be indexed")
        if key in self._page_of or page in self._key_of:
            return False
        self._key_of[page], self._page_of[key] = key, page
        return True

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The pages holding the longest run keys[0], keys[1], ... (a prefix's chained page keys)."""
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def share(self, pages: list[int]) -> None:
        """Takes one reference to each page of a cached prefix (`lookup`'s answer), in use or cached."""
        for page in pages:
            if page not in self._key_of:
                raise ValueError(f"page {page} is not indexed: only cached prefix pages are shared")
            if page in self._cached:
                del self._cached[page]
            if page in self._snapshots:
                self._snapshots.move_to_end(page)
            self._refs[page] = self._refs.get(page, 0) + 1

    def evictable_among(self, pages: list[int]) -> int:
        """How many of `pages` are unreferenced cached pages (sharing them takes them out of `num_free`)."""
        return sum(1 for page in pages if page in self._cached)

    def mark_snapshot(self, page: int) -> None:
        if self._refs.get(page, 0) <= 0:
            raise ValueError(f"page {page} is not in use")
        self._snapshots[page] = None
        while len(self._snapshots) > self.max_snapshots:  # the rank's memory for them is bounded
            self._drop_snapshot(next(iter(self._snapshots)))

    def has_snapshot(self, page: int) -> bool:
        return page in self._snapshots

    def take_dropped_snapshots(self) -> list[int]:
        dropped, self._dropped_snapshots = self._dropped_snapshots, []
        return dropped

    def flush(self) -> int:
        """Empties the index: cached pages become free, pages in use stay with their requests unindexed.
        Returns how many pages were indexed."""
        count = len(self._key_of)
        for page in list(self._key_of):
            self._unindex(page)
        for page in self._cached:
            self._to_free_list(page)
        self._cached.clear()
        return count

    # a request's page list -------------------------------------------------------------------------
    def grow(self, pages: list[int], tokens: int, page_size: int) -> None:
        """Appends pages to a request's list `pages` until it holds positions 0..tokens-1."""
        pages.extend(self.allocate(max(0, pages_for(tokens, page_size) - len(pages))))

    def trim(self, pages: list[int], tokens: int, page_size: int) -> None:
        """Frees the tail of a request's list `pages` beyond what positions 0..tokens-1 need."""
        keep = pages_for(tokens, page_size)
        self.free(pages[keep:])
        del pages[keep:]

    def check(self) -> None:
        """Every page in exactly one state (tests call this after random operation sequences)."""
        free, used, cached = set(self._free), set(self._refs), set(self._cached)
        if len(free) != len(self._free) or free & used or free & cached or used & cached:
            raise AssertionError("a page is in two states")
        if len(free) + len(used) + len(cached) != self.num_pages:
            raise AssertionError(f"pages lost: {len(free)} free + {len(used)} used + {len(cached)} cached "
                                 f"!= {self.num_pages}")
        if not cached <= set(self._key_of) or not set(self._snapshots) <= used | cached:
            raise AssertionError("a cached page without a key, or a snapshot on a free page")
        if {self._page_of[k] for k in self._page_of} != set(self._key_of):
            raise AssertionError("index maps disagree")
