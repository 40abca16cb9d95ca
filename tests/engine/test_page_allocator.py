"""The page allocator never leaks and never hands out a page twice (property test)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from model_workers.kv_cache import OutOfPages, PageAllocator, PagedKVCache, PageTable

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


def test_page_table_grows_truncates_and_releases():
    cache = PagedKVCache(8, 4, latent_dim=6, index_dim=4, indexed_layers=[True, False], dtype=torch.float32)
    table = PageTable()
    cache.reserve(table, 9)  # 3 pages
    assert len(table.pages) == 3 and cache.allocator.num_free == 5
    assert table.slots(0, 9, 4).tolist() == [p * 4 + o for p in table.pages for o in range(4)][:9]
    table.num_tokens = 9
    cache.truncate(table, 5)  # positions 0..4 stay: 2 pages
    assert len(table.pages) == 2 and table.num_tokens == 5 and cache.allocator.num_free == 6
    cache.release(table)
    assert cache.allocator.num_free == 8 and table.pages == []
