"""Single-process model runner: appends tokens to requests through the paged cache and returns hidden states.

Prefill, chunked prefill (a cached prefix), decode and multi-token verification are all "extend": each
request appends some tokens at positions table.num_tokens.. and its queries see every earlier key. The
caller's page tables must already hold pages for the new positions (the scheduler's, or a test's allocator).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.pages import pages_for
from model_workers.backends.torch_backend import ForwardBatch, TorchBackend
from model_workers.kv_cache import PagedKVCache, PageTable
from model_workers.model.decoder import DSAForCausalLM


@dataclass
class ExtendItem:
    table: PageTable
    token_ids: list[int]


def build_forward_batch(items: list[ExtendItem], page_size: int, device) -> ForwardBatch:
    """Rows are the new tokens, request after request; every request's keys are its positions 0..end-1."""
    positions, request_rows, key_slots, write_slots = [], [], [], []
    row = 0
    for item in items:
        start, count = item.table.num_tokens, len(item.token_ids)
        positions.append(torch.arange(start, start + count))
        request_rows.append(torch.arange(row, row + count, device=device))
        slots = item.table.slots(0, start + count, page_size).to(device)
        key_slots.append(slots)
        write_slots.append(slots[start:])
        row += count
    return ForwardBatch(
        positions=torch.cat(positions).to(device),
        request_rows=tuple(request_rows),
        key_slots=tuple(key_slots),
        write_slots=torch.cat(write_slots),
    )


class ModelRunner:
    def __init__(self, model: DSAForCausalLM, num_pages: int, page_size: int = 64, device="cpu",
                 kv_dtype: torch.dtype | None = None):
        """kv_dtype: the cache's dtype (default: the model's)."""
        config = model.config
        self.model, self.device, self.page_size = model, torch.device(device), page_size
        indexed = [t == "full" for t in config.indexer_types] + [True] * model.num_mtp_layers
        dtype = kv_dtype or model.model.embed_tokens.weight.dtype
        self.cache = PagedKVCache(
            num_pages, page_size, config.latent_dim, config.index_head_dim, indexed, dtype, self.device
        )
        self.backend = TorchBackend(self.cache)

    def standalone_tables(self, lens: list[int]) -> list[PageTable]:
        """Empty page tables for requests of up to `lens` tokens on disjoint pages 0.. of this cache, for a runner
        that serves nothing else (tests, evaluation); the served path gets its tables from the scheduler."""
        tables, first = [], 0
        for length in lens:
            count = pages_for(length, self.page_size)
            tables.append(PageTable(list(range(first, first + count))))
            first += count
        if first > self.cache.num_pages:
            raise ValueError(f"{sum(lens)} tokens need {first} pages; the cache has {self.cache.num_pages}")
        return tables

    @torch.inference_mode()
    def extend(self, items: list[ExtendItem]) -> torch.Tensor:
        """Runs the target model on the new tokens; returns final-normed hidden [sum(new), hidden]."""
        for item in items:
            self.cache.check_room(item.table, item.table.num_tokens + len(item.token_ids))
        batch = build_forward_batch(items, self.page_size, self.device)
        ids = torch.tensor([t for item in items for t in item.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(ids, batch.positions, self.backend.bind(batch))
        for item in items:
            item.table.num_tokens += len(item.token_ids)
        return hidden

    @torch.inference_mode()
    def extend_mtp(
        self,
        items: list[ExtendItem],
        prev_hidden: torch.Tensor,
        tables_start: list[int],
        mtp_index: int = 0,
        backend: TorchBackend | None = None,
    ) -> torch.Tensor:
        """Runs MTP layer `mtp_index` on (t_{i+1}, h_i) rows at positions tables_start[r].. of each request.

        The MTP layer's KV lives in its own cache layer under the request's page table; `token_ids` of each
        item are the t_{i+1}. Returns the MTP hidden output [rows, hidden] (before shared_head.norm).
        """
        shifted = [ExtendItem(PageTable(it.table.pages, start), it.token_ids) for it, start in zip(items, tables_start)]
        for item in shifted:
            self.cache.check_room(item.table, item.table.num_tokens + len(item.token_ids))
        batch = build_forward_batch(shifted, self.page_size, self.device)
        ids = torch.tensor([t for item in items for t in item.token_ids], dtype=torch.long, device=self.device)
        backend = (backend or self.backend).bind(batch)  # another backend: e.g. MTP index sharing
        return self.model.mtp_forward(ids, prev_hidden, batch.positions, backend, mtp_index)
