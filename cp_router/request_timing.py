"""The two request times only the engine can tell: queue time (arrival -> first scheduled in a prefill) and
prefill time (first scheduled -> first token), vLLM's `request_queue_time_seconds` and
`request_prefill_time_seconds`. The other request metrics come from the chunk stream (`track_stream`).

The engine wraps each request's chunk stream in `track`, which notes its arrival and forgets it when the stream
ends; after every step `observe_step` reads the step's prefill pieces and outputs. A request preempted or
resumed after its first token is not timed again; one preempted before it counts its wait in its prefill time.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Callable

from cp_router.engine_stats import placeholder_ids
from cp_router.metrics import ServeMetrics
from cp_router.plans import RequestOutput


class RequestTimes:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.arrived: dict[str, float] = {}  # request id -> arrival, until first scheduled
        self.scheduled: dict[str, float] = {}  # request id -> first scheduled, until its first token

    def arrive(self, request_id: str) -> None:
        self.arrived[request_id] = self.clock()

    def forget(self, request_id: str) -> None:
        self.arrived.pop(request_id, None)
        self.scheduled.pop(request_id, None)

    async def track(self, request_id: str, chunks: AsyncIterator) -> AsyncIterator:
        """`chunks` passed through; the request arrives when they are first read, and is forgotten at their end."""
        self.arrive(request_id)
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.forget(request_id)

    def observe_step(self, step, outputs: dict[str, RequestOutput], wall_s: float, metrics: ServeMetrics) -> None:
        """After a step that took `wall_s` (it started `wall_s` before now): the queue times of the requests it
        scheduled first, the prefill times of those it gave a first token."""
        now = self.clock()
        started = now - wall_s
        for piece in step.prefill.pieces if step.prefill is not None else ():
            arrived = self.arrived.pop(piece.request_id, None)
            if arrived is not None:
                metrics.observe_queue_time(max(0.0, started - arrived))
                self.scheduled[piece.request_id] = started
        placeholders = placeholder_ids(step)
        for request_id, out in outputs.items():
            if not out.token_ids or request_id in placeholders:
                continue
            scheduled = self.scheduled.pop(request_id, None)
            if scheduled is not None:
                metrics.observe_prefill_time(now - scheduled)
