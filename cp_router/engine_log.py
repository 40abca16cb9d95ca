"""One line a person reads every few seconds while the engine is busy (logger `dsa_serve.engine`, INFO):

    engine: 3 running, 1 waiting, KV 12.5% (max cp_rank 20.0%), prefill 512.0 tokens/s, generation 31.4 tokens/s,
    mean acceptance length 2.31

Rates are over the interval since the previous line (or since the busy period began); the acceptance length
(1 + accepted / drafts, as vLLM's) is there when the interval verified drafts. The engine calls `after_step`
after every step; a step that leaves no request running or waiting ends the busy period without a line, so an
idle engine is silent. The interval is `EngineLog(interval_s=...)` (default ENGINE_LOG_INTERVAL_S).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from cp_router.engine_stats import EngineStats

ENGINE_LOG_INTERVAL_S = 5.0
logger = logging.getLogger("dsa_serve.engine")


@dataclass(frozen=True)
class Mark:
    """The engine's counters at one moment."""

    at: float
    prefilled: int
    generated: int
    drafts: int
    accepted: int
    cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    cache_hits: int = 0  # of those, found cached


def mark_of(stats: EngineStats, at: float, scheduler=None) -> Mark:
    prefix = getattr(scheduler, "prefix_stats", None)
    return Mark(at, stats.prefilled, stats.generated, stats.drafts, stats.accepted,
                prefix.queries if prefix else 0, prefix.hits if prefix else 0)


def status_line(start: Mark, end: Mark, running: int, waiting: int, kv_used: list[float]) -> str:
    """The line for the interval start..end; `kv_used` is the used fraction of each cp_rank's pages."""
    seconds = max(end.at - start.at, 1e-9)
    overall = sum(kv_used) / len(kv_used) if kv_used else 0.0
    line = (f"engine: {running} running, {waiting} waiting, KV {100 * overall:.1f}% "
            f"(max cp_rank {100 * max(kv_used, default=0.0):.1f}%), "
            f"prefill {(end.prefilled - start.prefilled) / seconds:.1f} tokens/s, "
            f"generation {(end.generated - start.generated) / seconds:.1f} tokens/s")
    drafts = end.drafts - start.drafts
    if drafts:
        line += f", mean acceptance length {1 + (end.accepted - start.accepted) / drafts:.2f}"
    queries = end.cache_queries - start.cache_queries
    if queries:
        line += f", prefix cache hit rate {100 * (end.cache_hits - start.cache_hits) / queries:.1f}%"
    return line


class EngineLog:
    def __init__(self, interval_s: float = ENGINE_LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 log: logging.Logger = logger):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s, self.clock, self.log = interval_s, clock, log
        self.since: Mark | None = None  # start of the current interval; None while idle
        self.idle_counts = Mark(0.0, 0, 0, 0, 0)  # the counters when the engine last went idle (a fresh EngineStats)

    def after_step(self, stats: EngineStats, wall_s: float, scheduler) -> str | None:
        """Called after each step that took `wall_s`; logs (and returns) a line once an interval has passed."""
        now = self.clock()
        if self.since is None:  # a busy period begins with this step: count it from its start
            base = self.idle_counts
            self.since = Mark(now - wall_s, base.prefilled, base.generated, base.drafts, base.accepted,
                              base.cache_queries, base.cache_hits)
        running, waiting = scheduler.num_running(), len(scheduler.waiting)
        if not (running or waiting):
            self.since, self.idle_counts = None, mark_of(stats, now, scheduler)
            return None
        if now - self.since.at < self.interval_s:
            return None
        total = scheduler.config.num_pages
        kv_used = [(total - free) / total for free in scheduler.free_pages()]
        line = status_line(self.since, mark_of(stats, now, scheduler), running, waiting, kv_used)
        self.log.info(line)
        self.since = mark_of(stats, now, scheduler)
        return line
