"""The prefill half of a scheduler step: FCFS pieces under the token and page budgets, placed, sharded, applied."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cp_router.cp.metadata import CPMetadata, build_cp_metadata
from cp_router.cp.padding import IMPL_LEGACY
from cp_router.cp.sharding import shard
from cp_router.cp.strategies import STRATEGY_INTERLEAVE, can_split, cp_alignment
from cp_router.pages import pages_for
from cp_router.plans import NEXT_ID_SAMPLED, PrefillRequest, PrefillShard
from cp_router.request_state import DECODING, PREFILLING, RequestState


@dataclass(frozen=True)
class Piece:
    request_id: str
    prefix_len: int  # tokens already cached (chunked prefill)
    extend_len: int
    final: bool  # the last chunk: the target samples the first (next) output token


@dataclass(frozen=True)
class PrefillBatch:
    pieces: tuple[Piece, ...]
    ranks: tuple[int, ...]  # ranks that run it: all of them under CP, else the owners, each its own pieces whole
    owners: tuple[int, ...]  # per piece
    cp: bool = False  # every piece split across `ranks` (collectives), or each rank prefills what it owns alone

    def apply(self, scheduler, outputs: dict, new_tokens: dict[str, list[int]]) -> None:
        """Folds the owners' outputs of every piece: cached tokens, scored prompt logprobs (every chunk, in
        order), and on a final piece the first output token (into `new_tokens`) and the non-owners' pages freed."""
        for piece, owner in zip(self.pieces, self.owners):
            seq: RequestState | None = scheduler.requests.get(piece.request_id)
            if seq is None:
                continue  # aborted while the step ran: its pages are already free
            seq.num_cached = piece.prefix_len + piece.extend_len
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs += outputs[piece.request_id].prompt_logprobs
            if piece.final:  # only the owner keeps the KV from here on
                for cp_rank in [r for r in seq.pages if r != owner]:
                    scheduler.allocators[cp_rank].free(seq.pages.pop(cp_rank))
                seq.status, seq.resuming = DECODING, False
                seq.output_ids += outputs[piece.request_id].token_ids  # none for a resumed request
                new_tokens[piece.request_id] = list(outputs[piece.request_id].token_ids)


def chunk_len(remaining: int, budget_left: int, align: int) -> int:
    """The next chunk: as much as the budget allows, leaving a remainder of 0 or >= align tokens."""
    chunk = min(remaining, budget_left)
    if chunk < remaining and remaining - chunk < align:
        chunk = remaining - align
    return chunk


def plan_prefill_batch(scheduler) -> PrefillBatch | None:
    """FCFS pieces (chunk continuations first) while the token budget and every rank's free pages allow."""
    cfg = scheduler.config
    align = cp_alignment(cfg.strategy, cfg.cp_size)
    continuing = sorted((s for s in scheduler.requests.values() if s.status == PREFILLING), key=lambda s: s.arrival)
    candidates = continuing + [scheduler.requests[rid] for rid in scheduler.waiting]
    free, pieces, budget_left = scheduler.free_pages(), [], cfg.prefill_token_budget
    admitted = scheduler.num_running()
    for seq in candidates:
        if seq.request_id in scheduler.waiting:
            if admitted >= cfg.max_num_seqs:
                break
            admitted += 1
        remaining = seq.remaining_prefill()
        chunk = chunk_len(remaining, budget_left, align)
        chunked = chunk < remaining or seq.num_cached > 0
        if chunk < 1 or (chunked and chunk < align):
            break
        grow = [pages_for(seq.num_cached + chunk, cfg.page_size) - len(seq.pages.get(r, []))
                for r in range(cfg.cp_size)]
        if any(grow[r] > free[r] for r in range(cfg.cp_size)):  # as if every rank held it: CP is decided below
            break
        free = [f - g for f, g in zip(free, grow)]
        pieces.append(Piece(seq.request_id, seq.num_cached, chunk, chunk == remaining))
        budget_left -= chunk
    if not pieces:
        return None
    return _place(scheduler, tuple(pieces))


def uses_cp(cfg, pieces: tuple[Piece, ...]) -> bool:
    """CP across all ranks when the batch splits and is worth it: at least `cp_min_prefill_tokens` tokens, or a
    piece of a chunked prompt (every chunk of a chunked prompt runs across all ranks, which all hold its prefix)."""
    lens = [p.extend_len for p in pieces]
    if cfg.cp_size < 2 or not can_split(lens, cfg.cp_size, cfg.strategy):
        return False
    chunked = any(p.prefix_len > 0 or not p.final for p in pieces)
    return chunked or sum(lens) >= cfg.cp_min_prefill_tokens


def _place(scheduler, pieces: tuple[Piece, ...]) -> PrefillBatch:
    """Owners (a new request: the least loaded rank) and pages: under CP (`uses_cp`) on every rank, which all
    write the whole chunk's KV; else data parallel, each piece on its owner alone."""
    cfg = scheduler.config
    use_cp = uses_cp(cfg, pieces)
    load = [allocator.num_used for allocator in scheduler.allocators]
    owners = []
    for piece in pieces:
        seq = scheduler.requests[piece.request_id]
        if seq.owner is None:
            seq.owner = min(range(cfg.cp_size), key=lambda r: (load[r], r))
            load[seq.owner] += pages_for(len(seq.context_ids()), cfg.page_size)
        owners.append(seq.owner)
        if piece.request_id in scheduler.waiting:
            scheduler.waiting.remove(piece.request_id)
        seq.status = PREFILLING
        for cp_rank in range(cfg.cp_size) if use_cp else (seq.owner,):
            pages = seq.pages.setdefault(cp_rank, [])
            scheduler.allocators[cp_rank].grow(pages, piece.prefix_len + piece.extend_len, cfg.page_size)
    ranks = tuple(range(cfg.cp_size)) if use_cp else tuple(sorted(set(owners)))
    return PrefillBatch(pieces, ranks, tuple(owners), use_cp)


def build_prefill_batch(scheduler, batch: PrefillBatch) -> dict[int, PrefillShard]:
    """cp_rank -> its shard: under CP its slice of the whole batch, else the pieces it owns, whole."""
    if batch.cp:
        return dict(zip(batch.ranks, _shards(scheduler, batch.pieces, batch.owners, batch.ranks)))
    shards = {}
    for cp_rank in batch.ranks:
        mine = [i for i, owner in enumerate(batch.owners) if owner == cp_rank]
        pieces, owners = tuple(batch.pieces[i] for i in mine), tuple(batch.owners[i] for i in mine)
        shards[cp_rank] = _shards(scheduler, pieces, owners, (cp_rank,))[0]
    return shards


def _shards(scheduler, pieces: tuple[Piece, ...], owners: tuple[int, ...],
            ranks: tuple[int, ...]) -> list[PrefillShard]:
    """The shards of `pieces` split across `ranks` (CP when there are several): each its slice of the metadata,
    its token rows, its page tables."""
    cfg, requests, chunks, next_after = scheduler.config, [], [], []
    for piece, owner in zip(pieces, owners):
        seq = scheduler.requests[piece.request_id]
        context = seq.context_ids()
        end = piece.prefix_len + piece.extend_len
        history = tuple(context) if piece.final and seq.sampling.needs_history else ()
        requests.append(PrefillRequest(seq.request_id, owner, seq.sampling, piece.final, seq.num_generated_at_prefill,
                                       history, seq.wants_prompt_logprobs(),
                                       seq.resume_token() if piece.final else None))
        chunks.append(context[piece.prefix_len : end])
        next_after.append(None if piece.final else context[end])
    lens, prefixes = [p.extend_len for p in pieces], [p.prefix_len for p in pieces]
    if len(ranks) > 1:
        meta = build_cp_metadata(lens, prefixes, len(ranks), cfg.strategy, cfg.impl)
    else:
        meta = build_cp_metadata(lens, prefixes, 1, STRATEGY_INTERLEAVE, IMPL_LEGACY)
    shards, sharded = [], shard_tokens(chunks, meta, next_after)
    for shard_index, (cp_rank, (ids_local, next_local)) in enumerate(zip(ranks, sharded)):
        tables = tuple(tuple(scheduler.requests[p.request_id].pages[cp_rank]) for p in pieces)
        shards.append(PrefillShard(tuple(requests), meta.rank_view(shard_index), ids_local, next_local, tables))
    return shards


def shard_tokens(chunks: list[list[int]], meta: CPMetadata,
                 next_after: list[int | None]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per shard: (token ids [T_logical], MTP input ids [T_logical]: the left shift of the global sequence).

    `chunks[s]` are request s's extend tokens; `next_after[s]` the prompt token after its chunk (a non-final
    chunk), or None where the target samples it."""
    tail = [NEXT_ID_SAMPLED if t is None else t for t in next_after]
    ids_global = torch.tensor([t for c in chunks for t in c], dtype=torch.long)  # [N]
    next_global = torch.tensor([t for c, last in zip(chunks, tail) for t in c[1:] + [last]], dtype=torch.long)  # [N]
    out = []
    for shard_index in range(meta.cp_size):
        num_local = meta.per_rank_logical_token[shard_index]
        out.append((shard(meta, ids_global, shard_index)[:num_local],
                    shard(meta, next_global, shard_index)[:num_local]))
    return out
