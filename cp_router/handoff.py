"""Prefill/decode disaggregation: what a prefill group's owner rank hands a decode group's rank, so that the request
decodes there exactly as it would have where it was prefilled (docs/disaggregation.md).

Plain data, no model code: the ranks fill and read it (model_workers/kv_handoff.py), the engines carry it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.cp.wire import TensorsAsNumpy
from cp_router.sampling import SamplingParams


@dataclass(frozen=True)
class RequestHandoff(TensorsAsNumpy):
    """A prefilled request's rank-side state, bit for bit: its KV pages and what decoding reads besides them."""

    request_id: str
    num_tokens: int  # KV positions 0..num_tokens-1 the pages hold (the context prefilled)
    page_size: int
    # Per paged store of the family's cache (every cache layer, the MTP layer's too, in the request's KV format):
    # the request's pages [P, rows_per_page, width], P = pages_for(num_tokens); in the cache's store order.
    stores: tuple[torch.Tensor, ...]
    state: object = None  # the family's bounded per-request state (DeepSeek-V4's window tails, open windows)
    draft_hidden: torch.Tensor | None = None  # [D] the MTP layer's output at the last cached position
    draft_topk_positions: torch.Tensor | None = None  # [k'] key positions the MTP top-k kept (-1: none; sharing)
    history: object = None  # the penalties' token counts (model_workers/logits_processing.py TokenHistory)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages moved (the rest is one hidden state and the bounded state)."""
        return sum(t.numel() * t.element_size() for t in self.stores)


@dataclass(frozen=True)
class ImportItem:
    """A hand-off a decode rank writes into `pages` (its own, scheduler-allocated) before the step decodes it."""

    handoff: RequestHandoff
    pages: tuple[int, ...]
    sampling: SamplingParams  # the request's, as the decode engine resolved it
    output_ids: tuple[int, ...]  # output so far, last = the pending token (a grammar replays them)


@dataclass(frozen=True)
class HandoffTicket:
    """What a prefill group's engine yields last for a request it hands off (`GenerationEngine.prefill_handoff`):
    the rank-side state and what the decode group's stream goes on from."""

    handoff: RequestHandoff
    output_ids: tuple[int, ...]  # streamed already (the first token)
    text_released: int  # characters of their text already streamed (stop strings keep matching across the seam)
    cached_tokens: int  # prompt tokens the prefill group found in its prefix cache
