"""What the engine reports after every step, in one place: its `EngineStats`, its metrics (speculation, request
times, preemptions, CP prefill, grammar masks, running / waiting requests and KV pages per cp_rank) and its status
log line."""

from __future__ import annotations

from typing import AsyncIterator

from cp_router.engine_log import EngineLog
from cp_router.engine_stats import EngineStats
from cp_router.metrics import ServeMetrics, track_stream
from cp_router.plans import RequestOutput, StepResult
from cp_router.prefix_cache import PrefixStats
from cp_router.protocol import EngineChunk
from cp_router.request_timing import RequestTimes


class EngineMonitor:
    def __init__(self, scheduler, stats: EngineStats, metrics: ServeMetrics | None):
        self.scheduler, self.stats, self.metrics = scheduler, stats, metrics
        self.times, self.log = RequestTimes(), EngineLog()
        self.prefix_recorded = PrefixStats()  # the scheduler's prefix-cache counts already in the metrics

    def stream(self, request_id: str, chunks: AsyncIterator[EngineChunk]) -> AsyncIterator[EngineChunk]:
        """One request's chunks, measured (`track_stream` and the request times) when there are metrics."""
        if self.metrics is None:
            return chunks
        return track_stream(self.metrics, self.times.track(request_id, chunks))

    def after_step(self, step, results: list[StepResult], outputs: dict[str, RequestOutput], wall_s: float,
                   since_last_s: float) -> None:
        """A finished step that took `wall_s` (`since_last_s` from the previous step's end)."""
        speculation = self.stats.record(step, results, outputs, wall_s, since_last_s)
        self.log.after_step(self.stats, wall_s, self.scheduler)
        if self.metrics is None:
            return
        self.metrics.add_speculation(speculation.drafts, speculation.draft_tokens, speculation.accepted_per_position)
        self.times.observe_step(step, outputs, wall_s, self.metrics)
        if step.preempted:
            self.metrics.add_preemptions(len(step.preempted))
        counts, seen = self.scheduler.prefix_stats, self.prefix_recorded
        self.metrics.add_prefix_cache(counts.queries - seen.queries, counts.hits - seen.hits)
        self.prefix_recorded = PrefixStats(counts.queries, counts.hits)
        if step.prefill is not None and step.prefill.cp:
            self.metrics.observe_cp_prefill(sum(r.comm_bytes for r in results), wall_s)
        if any(r.grammar_masks for r in results):
            self.metrics.observe_grammar_mask(max(r.grammar_mask_s for r in results))
        self.record_gauges()

    def record_gauges(self) -> None:
        """Running / waiting requests and the KV pages of every cp_rank, as the scheduler has them now."""
        if self.metrics is None:
            return
        total = self.scheduler.config.num_pages
        self.metrics.set_requests(self.scheduler.num_running(), len(self.scheduler.waiting),
                                  len(self.scheduler.reserving))
        for cp_rank, free in enumerate(self.scheduler.free_pages()):
            self.metrics.set_kv_pages(cp_rank, total - free, total)
        for cp_rank, cached in enumerate(self.scheduler.cached_pages()):
            self.metrics.set_prefix_cache_pages(cp_rank, cached)
