"""The prefill half of a scheduler step: pick FCFS pieces under the token and page budgets, shard, apply."""

from __future__ import annotations

from dataclasses import dataclass

from cp_router.cp.metadata import build_cp_metadata
from cp_router.cp.padding import IMPL_LEGACY
from cp_router.plans import PrefillRequest, PrefillShard
from cp_router.prefill_batch import prefill_shards
from cp_router.request_state import DECODING, PREFILLING, RequestState, pages_for
from cp_router.cp.strategies import STRATEGY_INTERLEAVE, can_split, get_strategy


@dataclass(frozen=True)
class Piece:
    request_id: str
    prefix_len: int  # tokens already cached (chunked prefill)
    extend_len: int
    final: bool  # the last chunk: the target samples the first (next) output token


@dataclass(frozen=True)
class PrefillBatch:
    pieces: tuple[Piece, ...]
    ranks: tuple[int, ...]  # ranks that run it: all of them under CP, else one
    owners: tuple[int, ...]  # per piece

    def apply(self, scheduler, outputs: dict, new_tokens: dict[str, list[int]]) -> None:
        for piece, owner in zip(self.pieces, self.owners):
            seq: RequestState | None = scheduler.sequences.get(piece.request_id)
            if seq is None:
                continue  # aborted while the step ran; its frees are queued on every rank of the batch
            seq.prefilled = piece.prefix_len + piece.extend_len
            if piece.final:
                seq.kv_tokens = {owner: seq.prefilled}
                seq.status = DECODING
                seq.output_ids += outputs[piece.request_id].token_ids
                new_tokens[piece.request_id] = list(outputs[piece.request_id].token_ids)


def cp_align(scheduler) -> int:
    cfg = scheduler.config
    return get_strategy(cfg.strategy).align(cfg.cp_size) if cfg.cp_size > 1 else 1


def chunk_len(remaining: int, budget_left: int, align: int) -> int:
    """The next chunk: as much as the budget allows, leaving a remainder of 0 or >= align tokens."""
    chunk = min(remaining, budget_left)
    if chunk < remaining and remaining - chunk < align:
        chunk = remaining - align
    return chunk


def plan_prefill_batch(scheduler, pages_needed: list[int]) -> PrefillBatch | None:
    """FCFS pieces (chunk continuations first) while the token budget and every rank's pages allow."""
    cfg, align = scheduler.config, cp_align(scheduler)
    continuing = sorted((s for s in scheduler.sequences.values() if s.status == PREFILLING), key=lambda s: s.arrival)
    candidates = continuing + [scheduler.sequences[rid] for rid in scheduler.waiting]
    pages, pieces, budget_left = list(pages_needed), [], cfg.prefill_token_budget
    for seq in candidates:
        remaining = seq.remaining_prefill()
        chunk = chunk_len(remaining, budget_left, align)
        chunked = chunk < remaining or seq.prefilled > 0
        if chunk < 1 or (chunked and chunk < align):
            break
        grow = [pages_for(seq.prefilled + chunk, cfg.page_size) - pages_for(seq.kv_tokens.get(r, 0), cfg.page_size)
                for r in range(cfg.cp_size)]
        if any(pages[r] + grow[r] > cfg.num_pages for r in range(cfg.cp_size)):
            break
        pages = [p + g for p, g in zip(pages, grow)]
        pieces.append(Piece(seq.request_id, seq.prefilled, chunk, chunk == remaining))
        budget_left -= chunk
    if not pieces:
        return None
    return _place(scheduler, tuple(pieces))


def _place(scheduler, pieces: tuple[Piece, ...]) -> PrefillBatch:
    """CP across all ranks when the batch splits, else the least loaded rank; owners; reservations mirrored."""
    cfg = scheduler.config
    use_cp = cfg.cp_size > 1 and can_split([p.extend_len for p in pieces], cfg.cp_size, cfg.strategy)
    load = [scheduler.pages_used(r) for r in range(cfg.cp_size)]
    ranks = tuple(range(cfg.cp_size)) if use_cp else (min(range(cfg.cp_size), key=lambda r: (load[r], r)),)
    owners = []
    for piece in pieces:
        seq = scheduler.sequences[piece.request_id]
        if seq.owner is None:
            seq.owner = min(ranks, key=lambda r: (load[r], r))
            load[seq.owner] += pages_for(len(seq.context_ids()), cfg.page_size)
        owners.append(seq.owner)
        if piece.request_id in scheduler.waiting:
            scheduler.waiting.remove(piece.request_id)
        seq.status = PREFILLING
        for r in ranks:  # what every rank of the batch reserves (an abort mid-step frees it there)
            seq.kv_tokens[r] = piece.prefix_len + piece.extend_len
    return PrefillBatch(pieces, ranks, tuple(owners))


def build_prefill_batch(scheduler, batch: PrefillBatch) -> dict[int, PrefillShard]:
    """cp_rank -> its shard of the batch."""
    cfg, requests, chunks, next_after = scheduler.config, [], [], []
    for piece, owner in zip(batch.pieces, batch.owners):
        seq = scheduler.sequences[piece.request_id]
        context = seq.context_ids()
        end = piece.prefix_len + piece.extend_len
        requests.append(PrefillRequest(seq.request_id, owner, seq.sampling, piece.final, seq.num_generated_at_prefill))
        chunks.append(context[piece.prefix_len : end])
        next_after.append(None if piece.final else context[end])
    lens, prefixes = [p.extend_len for p in batch.pieces], [p.prefix_len for p in batch.pieces]
    if len(batch.ranks) > 1:
        meta = build_cp_metadata(lens, prefixes, cfg.cp_size, cfg.strategy, cfg.impl)
    else:
        meta = build_cp_metadata(lens, prefixes, 1, STRATEGY_INTERLEAVE, IMPL_LEGACY)
    shards = prefill_shards(tuple(requests), chunks, meta, next_after)
    return {cp_rank: shards[i] for i, cp_rank in enumerate(batch.ranks)}
