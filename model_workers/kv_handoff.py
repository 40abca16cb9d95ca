"""Prefill/decode disaggregation on a rank: a prefilled request's state read out on the prefill group's owner rank
and written into a decode rank's own pages (cp_router/handoff.py holds the record; docs/disaggregation.md).

What moves is everything decoding reads back, bit for bit: the request's pages of every paged store of the family's
cache (latent rows and indexer keys of every layer, the MTP layer's included, in the request's KV format; for
DeepSeek-V4 its compressed entries and indexer keys), the family's bounded per-request state (V4's window tails
and open compressor windows), the MTP draft state (the hidden state the next draft starts from; under MTP index
sharing the top-k it kept, as key positions since slots differ between the two caches) and the penalties' token
counts. A constrained request's matcher is rebuilt from its grammar and output so far. Sampling is counter based
(seed, output index), so nothing of the sampler moves.
"""

from __future__ import annotations

import time

import torch

from cp_router.handoff import ImportItem, RequestHandoff
from cp_router.pages import pages_for
from model_workers.decode_loop import HeldRequest
from model_workers.grammar.request_grammar import MaskClock, RequestGrammar
from model_workers.models.common.topk_sharing import position_slots, slot_positions
from model_workers.page_table import PageTable

HANDOFF_CLOCK = MaskClock()  # seconds this process spent reading out or writing hand-offs (a rank reports it per step)


def export_handoff(cache, table: PageTable, held: HeldRequest, page_size: int) -> RequestHandoff:
    """The request held under `table.state_key` whose pages are `table` (num_tokens positions cached), on CPU."""
    start = time.perf_counter()
    pages = torch.tensor(table.pages[: pages_for(table.num_tokens, page_size)], dtype=torch.long)
    stores = tuple(_paged(store, rows_per_page)[pages.to(store.device)].cpu()  # [P, rows_per_page, width]
                   for store, rows_per_page in cache.page_stores())
    topk = None if held.draft_topk is None else slot_positions(table, held.draft_topk.cpu(), page_size)
    handoff = RequestHandoff(
        table.state_key, table.num_tokens, page_size, stores, cache.export_state(table.state_key),
        None if held.draft_hidden is None else held.draft_hidden.cpu(), topk, held.history)
    HANDOFF_CLOCK.seconds += time.perf_counter() - start
    return handoff


def import_handoff(cache, item: ImportItem, grammar_cache, eos_ids: tuple[int, ...], device) -> HeldRequest:
    """Writes `item.handoff` into `item.pages` of this rank's cache; returns what the rank holds of the request."""
    handoff, start = item.handoff, time.perf_counter()
    if len(item.pages) < pages_for(handoff.num_tokens, handoff.page_size):
        raise ValueError(f"hand-off of {handoff.request_id}: {len(item.pages)} pages cannot hold its "
                         f"{handoff.num_tokens} cached positions")
    stores = cache.page_stores()
    if len(stores) != len(handoff.stores):
        raise ValueError(f"hand-off of {handoff.request_id}: {len(handoff.stores)} paged stores, this cache has "
                         f"{len(stores)} (another model or KV format)")
    pages = torch.tensor(item.pages[: pages_for(handoff.num_tokens, handoff.page_size)], dtype=torch.long)
    for (store, rows_per_page), rows in zip(stores, handoff.stores):
        _paged(store, rows_per_page)[pages.to(store.device)] = rows.to(store.device)
    cache.import_state(handoff.request_id, handoff.state)
    table = PageTable(list(item.pages), handoff.num_tokens, handoff.request_id)
    topk = None if handoff.draft_topk_positions is None else \
        position_slots(table, handoff.draft_topk_positions, handoff.page_size).to(device)
    hidden = None if handoff.draft_hidden is None else handoff.draft_hidden.to(device)
    held = HeldRequest(item.sampling, hidden, topk, handoff.history, _grammar(item, grammar_cache, eos_ids))
    HANDOFF_CLOCK.seconds += time.perf_counter() - start
    return held


def _paged(store: torch.Tensor, rows_per_page: int) -> torch.Tensor:
    """[num_pages * rows_per_page, width] -> [num_pages, rows_per_page, width] (a view)."""
    return store.view(-1, rows_per_page, *store.shape[1:])


def _grammar(item: ImportItem, grammar_cache, eos_ids: tuple[int, ...]) -> RequestGrammar | None:
    """A constrained request's matcher after its output so far (every token the prefill side emitted)."""
    spec = item.sampling.grammar
    if spec is None:
        return None
    if grammar_cache is None:
        raise ValueError(f"request {item.handoff.request_id} is constrained ({spec.kind}) but this worker has no "
                         "grammar backend: the checkpoint folder has no tokenizer.json")
    return RequestGrammar.start(grammar_cache, spec, tuple(item.sampling.stop_ids(eos_ids)) or eos_ids,
                                item.output_ids)
