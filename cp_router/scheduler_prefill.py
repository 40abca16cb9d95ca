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
from cp_router.prefix_cache import Hit, count_lookup, find_hit, hit_page_cost, mark_snapshots, register_pages, \
    take_hit
from cp_router.request_state import DECODING, PREFILLING, RequestState

CP, DP = "cp", "dp"  # what a piece pins its batch to (None: either)


@dataclass(frozen=True)
class Piece:
    request_id: str
    prefix_len: int  # tokens already cached (chunked prefill)
    extend_len: int
    final: bool  # the last chunk: the target samples the first (next) output token
    snapshot: bool = False  # the ranks keep the request's bounded state at its end (prefix caching, V4)


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
            if piece.final:
                seq.status, seq.resuming = DECODING, False
                seq.output_ids += outputs[piece.request_id].token_ids  # none for a resumed request
                new_tokens[piece.request_id] = list(outputs[piece.request_id].token_ids)
            for cp_rank in seq.pages:  # its full pages join the prefix cache (the next token is known now)
                register_pages(scheduler, seq, cp_rank, seq.num_cached)
            if piece.snapshot:
                mark_snapshots(scheduler, seq, self.ranks if self.cp else (owner,), seq.num_cached)
            if piece.final:  # only the owner keeps the KV from here on; the others' pages stay cached
                for cp_rank in [r for r in seq.pages if r != owner]:
                    scheduler.allocators[cp_rank].free(seq.pages.pop(cp_rank))


def chunk_len(remaining: int, budget_left: int, align: int) -> int:
    """The next chunk: as much as the budget allows, leaving a remainder of 0 or >= align tokens."""
    chunk = min(remaining, budget_left)
    if chunk < remaining and remaining - chunk < align:
        chunk = remaining - align
    return chunk


def plan_prefill_batch(scheduler) -> PrefillBatch | None:
    """FCFS pieces (chunk continuations first) while the token budget and every rank's free pages allow; a new
    request first takes its prefix-cache hit (cp_router/prefix_cache.py). A piece that can only run data parallel
    (its prefix is on its owner alone) and one that must run under CP (a chunked prompt all ranks hold) never
    share a batch: the later one waits for the next step."""
    cfg = scheduler.config
    align = cp_alignment(cfg.strategy, cfg.cp_size)
    continuing = sorted((s for s in scheduler.requests.values() if s.status == PREFILLING), key=lambda s: s.arrival)
    candidates = continuing + [scheduler.requests[rid] for rid in scheduler.waiting]
    free, pieces, budget_left, mode = scheduler.free_pages(), [], cfg.prefill_token_budget, None
    admitted = scheduler.num_running()
    for seq in candidates:
        if seq.request_id in scheduler.waiting:
            if admitted >= cfg.max_num_seqs:
                break
            admitted += 1
        hit = find_hit(scheduler, seq, align)
        start = hit.length if hit is not None else seq.num_cached
        remaining = len(seq.context_ids()) - start
        chunk = snapshot_boundary(cfg, start, chunk_len(remaining, budget_left, align), remaining)
        pin = piece_pin(cfg, seq, hit, chunk < remaining, chunk, align)
        if mode is not None and pin is not None and pin != mode:
            break
        if chunk < 1 or (pin != DP and (chunk < remaining or start > 0) and chunk < align):
            break
        grow = piece_growth(scheduler, seq, hit, start + chunk, pin)
        if any(grow[r] > free[r] for r in range(cfg.cp_size)):
            break
        free = [f - g for f, g in zip(free, grow)]
        if hit is not None:
            take_hit(scheduler, seq, hit)
        count_lookup(scheduler, seq, hit)
        end = start + chunk
        snapshot = cfg.prefix_caching and cfg.state_snapshots and end % cfg.prefix_align == 0
        pieces.append(Piece(seq.request_id, start, chunk, chunk == remaining, snapshot))
        mode = mode or pin
        budget_left -= chunk
    if not pieces:
        return None
    return _place(scheduler, tuple(pieces), mode)


def snapshot_boundary(cfg, start: int, chunk: int, remaining: int) -> int:
    """A family with bounded per-request state (V4) under prefix caching: a final chunk crossing a hit boundary
    stops there (the state is snapshotted there; the rest follows as one more chunk)."""
    if not (cfg.prefix_caching and cfg.state_snapshots) or chunk < remaining:
        return chunk
    boundary = (start + chunk) // cfg.prefix_align * cfg.prefix_align
    return boundary - start if boundary > start and boundary < start + chunk else chunk


def piece_pin(cfg, seq: RequestState, hit: Hit | None, partial: bool, chunk: int, align: int) -> str | None:
    """DP: its prefix lives on its owner only (a one-rank hit, or a prompt prefilled there so far), or it is a
    chunk of a chunked prompt too short to split; CP: a chunked prompt (or a hit) every rank holds; None: either."""
    if cfg.cp_size < 2:
        return None
    if hit is not None:
        return DP if hit.data_parallel else CP
    holders = len(seq.pages)
    if seq.num_cached > 0 and holders < cfg.cp_size:
        return DP
    if seq.num_cached > 0:
        return CP if chunk >= align else DP
    return CP if partial else None


def piece_growth(scheduler, seq: RequestState, hit: Hit | None, end: int, pin: str | None) -> list[int]:
    """Per rank: free pages the piece takes (new pages up to `end`, and cached pages a hit takes back)."""
    cfg = scheduler.config
    holders = range(cfg.cp_size)
    if pin == DP:
        holders = [seq.owner if hit is None else hit.owner]
    held = hit.pages if hit is not None else seq.pages
    cost = hit_page_cost(scheduler, hit)
    return [pages_for(end, cfg.page_size) - len(held.get(r, [])) + cost[r] if r in holders else 0
            for r in range(cfg.cp_size)]


def uses_cp(cfg, pieces: tuple[Piece, ...], mode: str | None = None) -> bool:
    """CP across all ranks when the batch splits and is worth it: at least `cp_min_prefill_tokens` tokens, or a
    piece of a chunked prompt (every chunk of a chunked prompt runs across all ranks, which all hold its prefix);
    never when a piece's prefix is on its owner alone."""
    lens = [p.extend_len for p in pieces]
    if cfg.cp_size < 2 or mode == DP or not can_split(lens, cfg.cp_size, cfg.strategy):
        return False
    chunked = any(p.prefix_len > 0 or not p.final for p in pieces)
    return chunked or sum(lens) >= cfg.cp_min_prefill_tokens


def _place(scheduler, pieces: tuple[Piece, ...], mode: str | None = None) -> PrefillBatch:
    """Owners (a new request: the least loaded rank) and pages: under CP (`uses_cp`) on every rank, which all
    write the whole chunk's KV; else data parallel, each piece on its owner alone (other ranks' copies of its
    prefix are released: they stay cached)."""
    cfg = scheduler.config
    use_cp = uses_cp(cfg, pieces, mode)
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
        if not use_cp:
            for cp_rank in [r for r in seq.pages if r != seq.owner]:
                scheduler.allocators[cp_rank].free(seq.pages.pop(cp_rank))
                scheduler.pending_free[cp_rank].add(seq.request_id)  # the state it kept there (V4)
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
        replays = seq.sampling.grammar is not None and seq.num_generated_at_prefill > 0  # its matcher replays them
        history = tuple(context) if piece.final and (seq.sampling.needs_history or replays) else ()
        requests.append(PrefillRequest(seq.request_id, owner, seq.sampling, piece.final, seq.num_generated_at_prefill,
                                       history, seq.wants_prompt_logprobs(),
                                       seq.resume_token() if piece.final else None, piece.snapshot,
                                       seq.handoff))
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
