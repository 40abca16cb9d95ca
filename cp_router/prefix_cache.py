"""Prefix caching on the scheduler's side (docs/kv_cache.md, 'Prefix caching'): content keys of full pages, the
hit a new request takes, and the pages a request hands to the cache.

A page's key chains the previous page's key and the page's token ids; with MTP speculation also the token right
after the page: the MTP layer's row at a page's last position took that next token (docs/speculative_decoding.md),
so such a page is only reused where that token is the same too. Each rank's `PageAllocator` indexes the pages it
holds. A hit:
* is page aligned and leaves at least one context token to prefill (the final chunk samples from its logits);
* under CP, is either the prefix every rank holds (the suffix is prefilled with CP, every rank reading the prefix
  from its own pages) or the longer prefix one rank holds (the suffix is prefilled data parallel on that rank,
  which then owns the request): whichever leaves less work per rank;
* for a family whose ranks keep bounded per-request state (DeepSeek-V4: window tail, open compressor windows)
  ends where the ranks snapshotted that state: the end of a prefill chunk at a multiple of `hit_align`
  (`StepPlan` snapshot rule, model_workers/cp_worker.py);
* is not taken by a request that wants prompt logprobs not yet delivered (every prompt position is scored).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from cp_router.request_state import RequestState

ROOT_KEY = b"dsa-serve prefix cache v1"


def extend_keys(keys: list[bytes], tokens: list[int], page_size: int, max_pages: int | None = None,
                next_token: bool = True) -> list[bytes]:
    """Appends to `keys` (the keys of the first len(keys) pages of `tokens`) the keys of every further full page
    (`next_token`: whose next token is known, and that token too), up to `max_pages` pages; returns `keys`."""
    extra = int(next_token)
    count = max(0, len(tokens) - extra) // page_size
    if max_pages is not None:
        count = min(count, max_pages)
    for j in range(len(keys), count):
        digest = hashlib.blake2b(keys[j - 1] if j else ROOT_KEY, digest_size=16)
        digest.update(array("q", tokens[j * page_size : (j + 1) * page_size + extra]).tobytes())
        keys.append(digest.digest())
    return keys


@dataclass(frozen=True)
class Hit:
    length: int  # cached positions 0..length-1
    pages: dict[int, list[int]]  # cp_rank -> its cached pages of the prefix (one rank: data parallel)
    owner: int | None = None  # the rank that must own the request (a one-rank hit), else None

    @property
    def data_parallel(self) -> bool:
        return self.owner is not None


@dataclass
class PrefixStats:
    queries: int = 0  # context tokens of requests that looked the cache up
    hits: int = 0  # of those, tokens found cached


def may_hit(seq: RequestState) -> bool:
    return not seq.pages and seq.num_cached == 0 and seq.wants_prompt_logprobs() is None


def rank_hit(allocator, keys: list[bytes], page_size: int, hit_align: int, snapshots: bool) -> list[int]:
    """The cached pages of the longest usable prefix on one rank."""
    pages = allocator.lookup(keys)
    count = len(pages)
    while count and ((count * page_size) % hit_align or (snapshots and not allocator.has_snapshot(pages[count - 1]))):
        count -= 1
    return pages[:count]


def find_hit(scheduler, seq: RequestState, cp_align: int) -> Hit | None:
    """The hit `seq` takes now (None: nothing cached that it can use); see the module docstring."""
    cfg = scheduler.config
    if not cfg.prefix_caching or not may_hit(seq):
        return None
    context = seq.context_ids()
    usable = (len(context) - 1) // cfg.page_size
    keys = extend_keys(seq.page_keys, seq.prompt_ids + seq.output_ids, cfg.page_size, usable,
                       cfg.num_speculative_steps > 0)[:usable]
    per_rank = [rank_hit(a, keys, cfg.page_size, cfg.prefix_align, cfg.state_snapshots)
                for a in scheduler.allocators]
    lens = [len(pages) * cfg.page_size for pages in per_rank]
    common, best = min(lens), max(range(cfg.cp_size), key=lambda r: (lens[r], -scheduler.allocators[r].num_used))
    if lens[best] == 0:
        return None
    rest_cp, rest_dp = len(context) - common, len(context) - lens[best]
    cp_worth = cfg.cp_size > 1 and rest_cp >= max(cp_align, cfg.cp_min_prefill_tokens, 1)
    if common > 0 and (cfg.cp_size == 1 or (cp_worth and rest_cp <= rest_dp * cfg.cp_size)):
        return Hit(common, {r: per_rank[r][: common // cfg.page_size] for r in range(cfg.cp_size)})
    if cfg.cp_size > 1 and cp_worth and rest_cp <= rest_dp * cfg.cp_size:
        return None  # a fresh CP prefill beats a one-rank suffix
    return Hit(lens[best], {best: per_rank[best]}, owner=best if cfg.cp_size > 1 else None)


def hit_page_cost(scheduler, hit: Hit | None) -> list[int]:
    """Per rank: free pages that taking `hit` uses up (its unreferenced cached pages)."""
    return [0 if hit is None or r not in hit.pages else scheduler.allocators[r].evictable_among(hit.pages[r])
            for r in range(scheduler.config.cp_size)]


def take_hit(scheduler, seq: RequestState, hit: Hit) -> None:
    """The request starts at the hit: it holds the shared pages and its prefill starts after them."""
    for cp_rank, pages in hit.pages.items():
        scheduler.allocators[cp_rank].share(pages)
        seq.pages[cp_rank] = list(pages)
    seq.num_cached = hit.length
    if hit.owner is not None:
        seq.owner = hit.owner


def count_lookup(scheduler, seq: RequestState, hit: Hit | None) -> None:
    """Statistics of a request's first prefill: context tokens looked up and found (also its `cached_tokens`)."""
    if not scheduler.config.prefix_caching or seq.cached_tokens is not None:
        return
    seq.cached_tokens = 0 if hit is None else hit.length
    scheduler.prefix_stats.queries += len(seq.prompt_ids)
    scheduler.prefix_stats.hits += seq.cached_tokens


def register_pages(scheduler, seq: RequestState, cp_rank: int, upto: int) -> None:
    """Indexes the request's full pages on `cp_rank` that hold positions below `upto` (and whose next token is
    known); pages another page already indexes stay unindexed (freed when the request ends)."""
    cfg = scheduler.config
    if not cfg.prefix_caching:
        return
    pages, allocator = seq.pages.get(cp_rank, []), scheduler.allocators[cp_rank]
    count = min(upto // cfg.page_size, len(pages))
    keys = extend_keys(seq.page_keys, seq.prompt_ids + seq.output_ids, cfg.page_size, count,
                       cfg.num_speculative_steps > 0)
    for page, key in zip(pages[:count], keys):
        allocator.register(page, key)


def mark_snapshots(scheduler, seq: RequestState, ranks, end: int) -> None:
    """A prefill chunk the plan marked (`Piece.snapshot`) ended at `end`: the ranks that ran it keep the
    request's state there, filed under the page that ends at `end` (CPWorker's `_prefill`)."""
    for cp_rank in ranks:
        scheduler.allocators[cp_rank].mark_snapshot(seq.pages[cp_rank][end // scheduler.config.page_size - 1])
