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
from model_workers.backends.cp_backend import CPBackend, V4CPBackend
from model_workers.backends.torch_backend import ForwardBatch, TorchBackend
from model_workers.backends.v4_backend import V4TorchBackend, local_v4_batch
from model_workers.expert_parallel import ExpertExchange, ForwardRows, dp_forward_rows
from model_workers.kv_cache import PagedKVCache, PageTable
from model_workers.kv_format import check_kv_cache_dtype, key_formats, plain_kv_dtype
from model_workers.model.decoder import DSAForCausalLM
from model_workers.model.v4_model import DeepseekV4ForCausalLM
from model_workers.v4_cache import V4Cache


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


def make_cache(model, num_pages: int, page_size: int, dtype: torch.dtype, device,
               kv_cache_dtype: str = "auto") -> PagedKVCache | V4Cache:
    """The cache a model keeps per rank: pages of MLA latents (V3.2 / GLM-5), or V4's paged compressed entries
    and per-request window / compressor state. `dtype`: what `kv_cache_dtype="auto"` stores (the weights'
    storage dtype); `kv_cache_dtype`: one of kv_format.KV_CACHE_DTYPES."""
    config = model.config
    check_kv_cache_dtype(kv_cache_dtype, config.model_type)
    if isinstance(model, DeepseekV4ForCausalLM):
        return V4Cache(config, num_pages, page_size, model.num_mtp_layers, plain_kv_dtype(kv_cache_dtype, dtype),
                       device)
    indexed = [t == "full" for t in config.indexer_types] + [True] * model.num_mtp_layers
    latent_format, index_format = key_formats(kv_cache_dtype, dtype, config.kv_lora_rank, config.qk_rope_head_dim,
                                              config.index_head_dim)
    return PagedKVCache(num_pages, page_size, latent_format, index_format, indexed, device)


def make_backend(cache: PagedKVCache | V4Cache, exchange: ExpertExchange | None, cp: bool = False,
                 deterministic: bool = False):
    """The attention backend over `cache`: one-rank, or (cp) gathering each batch's keys from the CP group;
    `deterministic`: batch-invariant top-k (TorchBackend)."""
    if isinstance(cache, V4Cache):
        return (V4CPBackend if cp else V4TorchBackend)(cache, exchange)
    return (CPBackend if cp else TorchBackend)(cache, exchange, deterministic)


class ModelRunner:
    def __init__(self, model: DSAForCausalLM | DeepseekV4ForCausalLM, num_pages: int, page_size: int = 64,
                 device="cpu", kv_dtype: torch.dtype | None = None, exchange: ExpertExchange | None = None,
                 kv_cache_dtype: str = "auto", deterministic: bool = False):
        """kv_dtype: the weights' storage dtype, which kv_cache_dtype="auto" keeps keys in (default: the model's);
        kv_cache_dtype: "auto", "bfloat16" or "fp8_e4m3"; exchange: the expert-parallel group, if any;
        deterministic: batch-invariant backends (the caller runs forwards under `BatchInvariantMode`)."""
        self.model, self.device, self.page_size = model, torch.device(device), page_size
        dtype = kv_dtype or model.model.embed_tokens.weight.dtype
        self.cache = make_cache(model, num_pages, page_size, dtype, self.device, kv_cache_dtype)
        self.exchange = exchange
        self.deterministic = deterministic
        self.backend = make_backend(self.cache, exchange, deterministic=deterministic)

    def bound_backend(self, items: list[ExtendItem], backend=None):
        """`backend` (default: the runner's) bound to one forward over `items`."""
        backend = backend or self.backend
        if isinstance(self.cache, V4Cache):
            lengths = [len(item.token_ids) for item in items]
            return backend.bind(local_v4_batch(self.cache, [it.table for it in items], lengths, self.device))
        return backend.bind(build_forward_batch(items, self.page_size, self.device))

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
        backend: TorchBackend | None = None,
        is_extend: bool = True,
        rows: ForwardRows | None = None,
    ) -> torch.Tensor:
        """Runs MTP layer `mtp_index` on (t_{i+1}, h_i) rows at positions tables_start[r].. of each request.

        The MTP layer's KV lives in its own cache layer under the request's page table; `token_ids` of each
        item are the t_{i+1}. Returns the MTP hidden output [rows, hidden] (before shared_head.norm).
        """
        shifted = [ExtendItem(PageTable(it.table.pages, start), it.token_ids) for it, start in zip(items, tables_start)]
        for item in shifted:
            self.cache.check_room(item.table, item.table.num_tokens + len(item.token_ids))
        num_rows = sum(len(item.token_ids) for item in items)
        self.begin_forward(num_rows, is_extend, rows)
        if num_rows == 0:
            return self._join(mtp_index)
        backend = self.bound_backend(shifted, backend)  # another backend: e.g. MTP index sharing
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
