"""The page allocator (the scheduler's, one per rank) never leaks and never hands out a page twice (property
test); a request's pages grow and trim with its token count; a rank's cache refuses a table too small."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_router.pages import OutOfPages, PageAllocator
from model_workers.models.dsa.cache import PagedKVCache
from model_workers.page_table import PageTable
from model_workers.kernels.torch.fp8_rows import PlainRows

operations = st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 12)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 40), ops=operations)
def test_any_sequence_of_allocate_and_free_never_leaks(total, ops):
    allocator = PageAllocator(total)
    held: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            if allocator.can_allocate(n):
                pages = allocator.allocate(n)
                outstanding = {p for block in held for p in block}
                assert len(set(pages)) == len(pages) and not outstanding & set(pages)
                assert all(0 <= p < total for p in pages)
                held.append(pages)
            else:
                with pytest.raises(OutOfPages):
                    allocator.allocate(n)
        elif held:
            allocator.free(held.pop(n % len(held)))
        assert allocator.num_free == total - sum(len(b) for b in held)
    for block in held:
        allocator.free(block)
    assert allocator.num_free == total


def test_double_free_is_an_error():
    allocator = PageAllocator(4)
    pages = allocator.allocate(2)
    allocator.free(pages)
    with pytest.raises(ValueError, match="freed twice"):
        allocator.free(pages)


def test_request_pages_grow_trim_and_free_and_the_cache_checks_a_table_has_room():
    allocator = PageAllocator(8)
    pages: list[int] = []
    allocator.grow(pages, 9, page_size=4)  # 3 pages
    assert len(pages) == 3 and allocator.num_free == 5
    table = PageTable(pages, 9)
    assert table.slots(0, 9, 4).tolist() == [p * 4 + o for p in pages for o in range(4)][:9]
    allocator.grow(pages, 9, page_size=4)  # already enough: nothing new
    assert len(pages) == 3 and allocator.num_free == 5
    allocator.trim(pages, 5, page_size=4)  # positions 0..4 stay: 2 pages
    assert len(pages) == 2 and allocator.num_free == 6
    cache = PagedKVCache(8, 4, PlainRows(6, torch.float32), PlainRows(4, torch.float32), indexed_layers=[True, False])
    cache.check_room(PageTable(pages, 0), 8)
    with pytest.raises(ValueError, match="holds fewer than the 9 positions"):
        cache.check_room(PageTable(pages, 0), 9)
    with pytest.raises(ValueError, match="outside this cache"):
        cache.check_room(PageTable([8], 0), 1)
    allocator.trim(pages, 0, page_size=4)
    assert allocator.num_free == 8 and pages == []
