"""Single-process model runner: appends tokens to requests through the paged cache and returns hidden states.

Prefill, chunked prefill (a cached prefix), decode and multi-token verification are all "extend": each
request appends some tokens at positions table.num_tokens.. and its queries see every earlier key. The
caller's page tables must already hold pages for the new positions (the scheduler's, or a test's allocator).

Under expert parallelism (an `ExpertExchange`) every forward is a group forward: the ranks first agree on
each rank's row count (or the caller passes them), and a rank with no rows still joins every MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.pages import pages_for
from model_workers.decode_graphs import DecodeGraphs, graphs_allowed
from model_workers.expert_parallel import ExpertExchange, ForwardRows, dp_forward_rows
from model_workers.kernels.interface import KernelSet
from model_workers.kernels.registry import kernel_set
from model_workers.kv_format import check_kv_cache_dtype
from model_workers.models.family import ModelFamily
from model_workers.models.registry import family_of
from model_workers.page_table import PageTable


@dataclass
class ExtendItem:
    table: PageTable
    token_ids: list[int]


def make_cache(model, family: ModelFamily, num_pages: int, page_size: int, dtype: torch.dtype, device,
               kv_cache_dtype: str = "auto", kernels: KernelSet | None = None):
    """The cache `model`'s family keeps per rank (DSA: pages of MLA latents and indexer keys; V4: paged compressed
    entries and per-request window / compressor state). `dtype`: what `kv_cache_dtype="auto"` stores (the weights'
    storage dtype); `kv_cache_dtype`: one of kv_format.KV_CACHE_DTYPES the family supports."""
    check_kv_cache_dtype(kv_cache_dtype, family.kv_cache_dtypes, model.config.model_type)
    return family.make_cache(model.config, model.num_mtp_layers, num_pages, page_size, dtype, kv_cache_dtype,
                             kernels or kernel_set(), device)


class ModelRunner:
    def __init__(self, model, num_pages: int, page_size: int = 64, device="cpu", kv_dtype: torch.dtype | None = None,
                 exchange: ExpertExchange | None = None, kv_cache_dtype: str = "auto", deterministic: bool = False,
                 kernels: KernelSet | None = None, graph_shape: tuple[int, int] | None = None):
        """model: any family's (the registry finds it); kv_dtype: the weights' storage dtype, which
        kv_cache_dtype="auto" keeps keys in (default: the model's); kv_cache_dtype: "auto", "bfloat16" or
        "fp8_e4m3"; exchange: the expert-parallel group, if any; deterministic: batch-invariant backends (the
        caller runs forwards under `BatchInvariantMode`); kernels: the kernel set (default: torch); graph_shape:
        (largest batch, longest request) of plain decode steps to run from CUDA graphs (decode_graphs.py) where
        the forward allows it (captured on CUDA; elsewhere the same static buffers run without a graph)."""
        self.model, self.device, self.page_size = model, torch.device(device), page_size
        self.family, self.kernels = family_of(model.config), kernels or kernel_set()
        self.exchange = exchange
        self.deterministic = deterministic
        graphs = graph_shape is not None and graphs_allowed(self)
        dtype = kv_dtype or model.model.embed_tokens.weight.dtype
        self.cache = make_cache(model, self.family, num_pages + graphs, page_size, dtype, self.device,
                                kv_cache_dtype, self.kernels)  # graphs: one more page, the padding rows' scratch
        self.backend = self.family.make_backend(self.cache, self.kernels, exchange, deterministic)
        self.decode_graphs = DecodeGraphs(self, *graph_shape, capture=self.device.type == "cuda") if graphs else None

    def bound_backend(self, items: list[ExtendItem], topk_memo=None):
        """The runner's backend bound to one forward over `items` on this rank (`topk_memo`: MTP index sharing)."""
        tables, lengths = [item.table for item in items], [len(item.token_ids) for item in items]
        batch = self.family.local_batch(self.cache, tables, lengths, self.page_size, self.device)
        return self.backend.bind(batch, topk_memo=topk_memo)

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

    def begin_forward(self, num_rows: int, is_extend: bool, rows: ForwardRows | None = None) -> ForwardRows | None:
        """Expert parallelism: fixes every rank's rows for the next forward (`rows`, or agreed now: one small
        collective). `is_extend` must be the same on every rank (it picks the padding mode). None without EP."""
        if self.exchange is None:
            return None
        if rows is None:
            rows = dp_forward_rows(self.exchange.sync_rows(num_rows), self.exchange.ep_rank, is_extend)
        self.exchange.begin_forward(rows)
        return rows

    def decode(self, items: list[ExtendItem], rows: ForwardRows | None = None) -> torch.Tensor:
        """One token per request (a plain decode step): replayed from a CUDA graph where one holds the batch, else
        `extend`; hidden [B, D], the tables moved on."""
        if self.decode_graphs is not None and self.exchange is None:
            for item in items:
                self.cache.check_room(item.table, item.table.num_tokens + 1)
            hidden = self.decode_graphs.decode([item.table for item in items], [item.token_ids[0] for item in items])
            if hidden is not None:
                return hidden
        return self.extend(items, is_extend=False, rows=rows)

    @torch.inference_mode()
    def extend(self, items: list[ExtendItem], is_extend: bool = True, rows: ForwardRows | None = None) -> torch.Tensor:
        """Runs the target model on the new tokens; returns final-normed hidden [sum(new), hidden]."""
        for item in items:
            self.cache.check_room(item.table, item.table.num_tokens + len(item.token_ids))
        num_rows = sum(len(item.token_ids) for item in items)
        self.begin_forward(num_rows, is_extend, rows)
        if num_rows == 0:
            return self._join(None)
        backend = self.bound_backend(items)
        ids = torch.tensor([t for item in items for t in item.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(ids, backend.batch.positions, backend)
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
        topk_memo=None,
        is_extend: bool = True,
        rows: ForwardRows | None = None,
    ) -> torch.Tensor:
        """Runs MTP layer `mtp_index` on (t_{i+1}, h_i) rows at positions tables_start[r].. of each request.

        The MTP layer's KV lives in its own cache layer under the request's page table; `token_ids` of each
        item are the t_{i+1}. Returns the MTP hidden output [rows, hidden] (before shared_head.norm). `topk_memo`:
        the MTP layer's top-k recorded or reused (MTP index sharing, models/dsa/topk_sharing.py).
        """
        shifted = [ExtendItem(PageTable(it.table.pages, start, it.table.state_key), it.token_ids)
                   for it, start in zip(items, tables_start)]
        for item in shifted:
            self.cache.check_room(item.table, item.table.num_tokens + len(item.token_ids))
        num_rows = sum(len(item.token_ids) for item in items)
        self.begin_forward(num_rows, is_extend, rows)
        if num_rows == 0:
            return self._join(mtp_index)
        backend = self.bound_backend(shifted, topk_memo)
        ids = torch.tensor([t for item in items for t in item.token_ids], dtype=torch.long, device=self.device)
        return self.model.mtp_forward(ids, prev_hidden, backend.batch.positions, backend, mtp_index)

    def _join(self, mtp_index: int | None) -> torch.Tensor:
        """A forward with no rows here: join the group's expert exchanges (EP), return hidden [0, D]."""
        if self.exchange is not None:
            self.model.join_experts(self.backend, mtp_index)
        return self.empty_hidden()

    def empty_hidden(self) -> torch.Tensor:
        """Hidden states of no rows, [0, hidden_width] in the model's dtype."""
        return self.model.model.embed_tokens.weight.new_zeros((0, self.model.hidden_width))
