"""Plain decode steps (one new token per request) on fixed buffers, replayed from CUDA graphs captured per batch
size bucket, as nano-vllm does: a step of B requests runs in the smallest bucket >= B, its extra rows padding.

What a step reads is held in static tensors that each step overwrites: token ids, positions and each request's
page table. Inside the captured step, every key slot of every position up to the bucket's context capacity, and
the slot each row writes, are computed from the page tables on the device, so a replay sees the new requests.
Padding rows sit at position 0 of a scratch page that no request owns (the runner keeps one page beyond the
scheduler's), so what they write and read is nobody's.

Only a forward with no host sync can be captured: a family with a `graph_batch` (DSA) on the Triton kernel set,
one rank (no expert exchange, whose row counts are agreed on the host), not deterministic (`graphs_allowed`). Steps above the largest bucket, and every
other step (prefill, speculative verify and drafts), run eagerly. Built with `capture=False` (a CPU: tests) the
same static buffers run without a graph, which checks the padding and slot arithmetic against eager decoding.
"""

from __future__ import annotations

import torch

from model_workers.page_table import PageTable

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # then every multiple of 16 up to the largest batch


def graphs_allowed(runner) -> bool:
    """Whether `runner`'s decode forward can be captured (see the module docstring)."""
    return (runner.family.graph_batch is not None and runner.kernels.name == "triton" and runner.exchange is None
            and not runner.deterministic)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    sizes = [b for b in SMALL_BUCKETS if b <= max_batch] + list(range(BUCKET_STEP, max_batch + 1, BUCKET_STEP))
    return tuple(sorted(set(sizes + [max_batch])))


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_context: int, capture: bool):
        """`runner`: a ModelRunner whose cache's last page is the scratch page; `max_context`: the longest request
        (positions 0..max_context-1)."""
        self.runner, self.capture = runner, capture
        self.page_size = runner.page_size
        self.scratch_page = runner.cache.num_pages - 1
        self.max_pages = -(-max_context // self.page_size)
        capacity = self.max_pages * self.page_size  # key positions a bucket's rows can see
        self.buckets = graph_buckets(max_batch)
        largest, device = self.buckets[-1], runner.device
        self.ids = torch.zeros(largest, dtype=torch.long, device=device)
        self.positions = torch.zeros(largest, dtype=torch.long, device=device)
        self.page_tables = torch.full((largest, self.max_pages), self.scratch_page, dtype=torch.long, device=device)
        self.key_slots = torch.zeros(largest, capacity, dtype=torch.long, device=device)  # [B, capacity]
        self.write_slots = torch.zeros(largest, dtype=torch.long, device=device)
        key_positions = torch.arange(capacity, device=device)
        self.page_of, self.offset_of = key_positions // self.page_size, key_positions % self.page_size
        self.batches, self.graphs, self.outputs, self.pool = {}, {}, {}, None
        for size in reversed(self.buckets):  # the largest first: the others reuse its memory pool
            self._prepare(size)

    def _batch(self, size: int):
        """The forward batch of a bucket: views of the static tensors, as the family's `graph_batch`."""
        rows = tuple(torch.arange(b, b + 1, device=self.runner.device) for b in range(size))
        return self.runner.family.graph_batch(positions=self.positions[:size], request_rows=rows,
                                              key_slots=tuple(self.key_slots[b] for b in range(size)),
                                              write_slots=self.write_slots[:size])

    def _step(self, size: int) -> torch.Tensor:
        """The captured work: slots from the page tables, then the model's forward -> hidden [size, D]."""
        tables = self.page_tables[:size]
        torch.add(tables[:, self.page_of] * self.page_size, self.offset_of, out=self.key_slots[:size])
        self.write_slots[:size] = self.key_slots[:size].gather(1, self.positions[:size, None]).squeeze(1)
        return self.runner.model(self.ids[:size], self.positions[:size], self.runner.backend)

    def _prepare(self, size: int) -> None:
        self.batches[size] = batch = self._batch(size)
        if not self.capture:
            return
        self.runner.backend.bind(batch)
        self._step(size)  # warm-up: Triton compiles, caches fill, the device copies of constants are made
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[size] = self._step(size)
        self.graphs[size], self.pool = graph, graph.pool()

    def bucket_for(self, batch: int) -> int | None:
        return next((size for size in self.buckets if size >= batch), None)

    @torch.inference_mode()
    def decode(self, tables: list[PageTable], token_ids: list[int]) -> torch.Tensor | None:
        """One token per request (request b's token_ids[b] at position tables[b].num_tokens) -> hidden [B, D], the
        tables moved one position on; None when no bucket holds the batch (the caller runs it eagerly)."""
        size = self.bucket_for(len(tables))
        if size is None or any(len(t.pages) > self.max_pages for t in tables):
            return None
        pad = size - len(tables)
        pages = torch.full((size, self.max_pages), self.scratch_page, dtype=torch.long)
        for b, table in enumerate(tables):
            pages[b, : len(table.pages)] = torch.tensor(table.pages, dtype=torch.long)
        self.page_tables[:size].copy_(pages, non_blocking=True)
        self.ids[:size].copy_(torch.tensor(token_ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor([t.num_tokens for t in tables] + [0] * pad), non_blocking=True)
        if self.capture:
            self.graphs[size].replay()
            hidden = self.outputs[size][: len(tables)].clone()
        else:
            self.runner.backend.bind(self.batches[size])
            hidden = self._step(size)[: len(tables)]
        for table in tables:
            table.num_tokens += 1
        return hidden
