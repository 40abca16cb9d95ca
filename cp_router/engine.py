"""The generation engine over one CP group: an asyncio step loop driving the scheduler and the rank workers.

`GenerationEngine` implements `EngineClient` (cp_router/protocol.py): `generate` queues a request and yields its
chunks; `abort` forgets it and frees its pages at once (the ranks drop its state at the next step; with nothing else
to run, that step waits IDLE_FREE_DELAY_S for a request to ride along with). The loop runs one lockstep step at a
time: `Scheduler.schedule` -> one `StepPlan` per rank -> `step.remote(plan)` on every rank concurrently (Ray actor
handles, or an in-process worker with the same methods) -> `Scheduler.apply` -> chunks to the request streams (a
request's prompt logprobs once, on its first chunk). A request ends where its owner rank says it does
(`RequestOutput.finish_reason`), or earlier at a stop string. Step observers (`add_step_observer`) see every step's
plans and results: benchmarks and tests read per-rank timings, logits and page tables there.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from typing import AsyncIterator, Awaitable, Callable

from cp_router.detached import detached_task
from cp_router.engine_handoff import EngineHandoff
from cp_router.engine_monitor import EngineMonitor
from cp_router.engine_recovery import EngineRecovery
from cp_router.engine_stats import EngineStats
from cp_router.metrics import ServeMetrics
from cp_router.plans import StepResult
from cp_router.protocol import EngineChunk, EngineOverloadedError, EngineRequest, ModelInfo, one_line
from cp_router.recovery import MAX_RESUMES, RECOVERY_TIMEOUT_S, GroupRepair, RecoveryRecord, raise_step_failure
from cp_router.request_stream import RequestStream, sampling_of
from cp_router.scheduler import ScheduledStep, Scheduler

StepObserver = Callable[[ScheduledStep, list[StepResult]], Awaitable[None] | None]
# With no request left, the ranks' frees wait this long for the next request's step: a step of frees alone is a
# round trip to every rank (3 ms on the bench VM) that a request arriving meanwhile would wait for, and it trims
# the ranks' heaps (`release_free_heap`), which the next prefill then faults in again.
IDLE_FREE_DELAY_S = 1.0


class GenerationEngine(EngineRecovery, EngineHandoff):
    def __init__(self, workers: list, scheduler: Scheduler, tokenizer, info: ModelInfo,
                 metrics: ServeMetrics | None = None, max_waiting: int = 4096, stuck_after_s: float = 120.0,
                 repair: GroupRepair | None = None, max_resumes: int = MAX_RESUMES):
        self.workers, self.scheduler, self.tokenizer, self.info = workers, scheduler, tokenizer, info
        self.metrics, self.max_waiting, self.stuck_after_s = metrics, max_waiting, stuck_after_s
        self.repair, self.max_resumes, self.recovery_timeout_s = repair, max_resumes, RECOVERY_TIMEOUT_S
        self.recoveries: list[RecoveryRecord] = []
        self._group_lock: asyncio.Lock | None = None  # one step, or one recovery, at a time
        self._recovering = False
        self.streams: dict[str, RequestStream] = {}
        self.stats = EngineStats(accepted_per_position=[0] * scheduler.config.num_speculative_steps)
        self.monitor = EngineMonitor(scheduler, self.stats, metrics)  # stats, metrics and the status log per step
        self.step_observers: list[StepObserver] = []
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._last_progress = time.monotonic()
        self._last_step_end = 0.0
        self._group_error: str | None = None
        self._free_now = False  # `drain`: frees go to the ranks at once
        self._reservations: dict[str, asyncio.Future] = {}  # disaggregation, decode side: waiting for pages

    @property
    def free_pages(self) -> list[int]:
        """Free KV pages per rank (the scheduler's allocators)."""
        return self.scheduler.free_pages()

    def add_step_observer(self, observer: StepObserver) -> None:
        """`observer(step, results)` after every step, before its tokens reach the streams (may be async)."""
        self.step_observers.append(observer)

    async def drain(self) -> None:
        """Returns once the loop has run every step the scheduler still has (frees included)."""
        self._ensure_loop()
        self._free_now = True
        self._poke()
        try:
            while self.scheduler.has_work():
                await asyncio.sleep(0.001)
        finally:
            self._free_now = False

    # EngineClient ---------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        async for chunk in self.monitor.stream(request.request_id, self._chunks(request)):
            yield chunk

    async def abort(self, request_id: str) -> None:
        self._cancel_reservation(request_id)
        stream = self.streams.pop(request_id, None)
        self.scheduler.finish(request_id)
        if stream is not None:
            stream.end("abort")
        self._poke()

    def model_info(self) -> ModelInfo:
        return self.info

    async def flush_cache(self) -> int:
        """Empties the prefix cache (POST /flush_cache); returns the pages it indexed."""
        return self.scheduler.flush_prefix_cache()

    async def metrics_text(self) -> str:
        if self.metrics is None:
            return ""
        self.monitor.record_gauges()
        return self.metrics.render()

    async def check_health(self) -> None:
        if self._task is not None and self._task.done():
            raise RuntimeError(f"engine step loop stopped: {self._task.exception()!r}")
        if self._group_error is not None:
            raise RuntimeError(self._group_error)
        if self._recovering:
            return  # a lost rank is being replaced (bounded by recovery_timeout_s)
        if self.scheduler.has_work() and time.monotonic() - self._last_progress > self.stuck_after_s:
            raise RuntimeError(f"engine step loop stuck: no step finished for {self.stuck_after_s:g}s")
        try:
            await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in self.workers]), timeout=30)
        except Exception as exc:  # noqa: BLE001 - a dead or hung rank: one line naming the failure
            if self.repair is None:
                raise RuntimeError(f"rank worker unreachable: {one_line(exc)}") from None
            self._ensure_loop()
            await self._recover_if_lost(f"health check: {one_line(exc)}")
            if self._group_error is not None:
                raise RuntimeError(self._group_error) from None

    # the loop -------------------------------------------------------------------------------------
    async def _chunks(self, request: EngineRequest, handoff: bool = False) -> AsyncIterator[EngineChunk]:
        """`handoff`: a prefill group's request, whose stream ends with a `HandoffTicket` (engine_handoff.py)."""
        self._ensure_loop()
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise EngineOverloadedError(f"engine queue full ({self.max_waiting} waiting requests)")
        stream = RequestStream(request, self.tokenizer)
        self.scheduler.add(request.request_id, list(request.prompt_token_ids), sampling_of(request), handoff)
        self.streams[request.request_id] = stream
        self._poke()
        async for item in self._consume(stream):
            yield item

    async def _consume(self, stream: RequestStream) -> AsyncIterator[EngineChunk]:
        """A registered stream's items until its last; an unfinished one is aborted when its reader stops."""
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if not isinstance(item, EngineChunk) or item.finish_reason is not None:
                    return
        finally:
            if not stream.finished:
                await self.abort(stream.request.request_id)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = detached_task(self._loop())  # not cancelled with the request that started it

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            if not self.scheduler.has_work():
                await self._woken(None)
                continue
            if not self.scheduler.requests and not self._free_now and await self._woken(IDLE_FREE_DELAY_S):
                continue  # a request (or `drain`) came: the frees go with its step
            try:
                async with self._lock():
                    await self.step()
            except Exception as exc:  # noqa: BLE001 - a lost rank is replaced, any other failure ends the requests
                await self._after_failure(exc)
            # No yield: the next step goes to the ranks first; the streams fed (SSE, ~0.1 ms each) run while they
            # compute (yielding first idled them 3.7 ms a step at 32 HTTP streams); first tokens: see `step`.

    async def _woken(self, timeout_s: float | None) -> bool:
        """Waits for `_poke` (a request, an abort, `drain`); False when `timeout_s` passed first."""
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout_s)  # idle only: its task per call costs nothing here
        except asyncio.TimeoutError:  # Python 3.10: not the builtin TimeoutError
            return False
        return True

    async def step(self) -> None:
        """One lockstep step over the ranks that have something to do."""
        start = time.perf_counter()
        step = self.scheduler.schedule()
        self._reserved(step.reserved)
        if not step.plans:
            await asyncio.sleep(0.001)
            return
        ranks = list(step.plans)
        results = await asyncio.gather(*[self.workers[r].step.remote(step.plans[r]) for r in ranks],
                                       return_exceptions=True)
        raise_step_failure(ranks, results)
        for observer in self.step_observers:
            if inspect.isawaitable(seen := observer(step, results)):
                await seen
        outputs = {rid: out for result in results for rid, out in result.outputs.items()}
        handoffs = {rid: handoff for result in results for rid, handoff in result.handoffs.items()}
        first_tokens = False
        for request_id, tokens in self.scheduler.apply(step, outputs).items():
            reason, stream = outputs[request_id].finish_reason, self.streams.get(request_id)
            prompt_logprobs = self.scheduler.take_prompt_logprobs(request_id)
            if stream is not None and (tokens or reason or prompt_logprobs):  # a resumed prefill emits nothing
                stream.cached_tokens = self.scheduler.requests[request_id].cached_tokens or 0
                first_tokens = first_tokens or (stream.completion_tokens == 0 and bool(tokens))
                reason = stream.push(tokens, outputs[request_id].logprobs, reason, prompt_logprobs)
            if reason is None and request_id in handoffs:  # disaggregation: it decodes in a decode group
                if stream is not None:
                    stream.hand_off(handoffs[request_id], self.scheduler.requests[request_id].output_ids)
                reason = "handoff"
            if reason is not None:
                self.scheduler.finish(request_id)
                self.streams.pop(request_id, None)
        end = time.perf_counter()
        if first_tokens:  # before the bookkeeping below: a first token's way out is TTFT
            await pass_on_first_tokens()
        self._record(step, results, outputs, end - start, end - max(start, self._last_step_end))
        self._last_step_end = end

    def _record(self, step: ScheduledStep, results: list[StepResult], outputs: dict, wall_s: float,
                since_last_s: float) -> None:
        self._last_progress = time.monotonic()
        self.monitor.after_step(step, results, outputs, wall_s, since_last_s)


async def pass_on_first_tokens(turns: int = 8) -> None:
    """`turns` loop turns (the hops from a stream's queue to its HTTP send) before the next step, so first tokens go
    out while the ranks idle: engine push -> socket 1.0 ms, not 1.9 ms as while they compute (bench VM, 1 stream)."""
    for _ in range(turns):
        await asyncio.sleep(0)
