"""The generation engine over one CP group: an asyncio step loop driving the scheduler and the rank workers.

`DSAEngine` implements `EngineClient` (cluster/engine_protocol.py): `generate` queues a request and yields
its chunks; `abort` forgets it and frees its pages at the next step, which runs at once. The loop runs one
lockstep step at a time: `Scheduler.schedule` -> one `StepPlan` per rank -> `CPWorker.step` on every rank
concurrently (Ray calls awaited together) -> `Scheduler.apply` -> chunks to the request streams.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from cp_router.scheduler import Scheduler

from cp_router.protocol import EngineChunk, EngineOverloadedError, EngineRequest, ModelInfo, one_line
from cp_router.request_stream import RequestStream, sampling_of
from cp_router.metrics import ServeMetrics, track_stream


@dataclass
class EngineStats:
    """Counters since start (benchmarks read them)."""

    steps: int = 0
    generated: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    preemptions: int = 0
    decode_calls: int = 0  # (step, rank) pairs that decoded: divides `drafted` / k into verify steps
    step_wall_s: float = 0.0
    worker_compute_s: float = 0.0  # max over ranks of each step's compute time, summed
    # Decode-only steps (no prefill in the step): engine time from the previous step's end, and the time
    # of the slowest rank's model forwards; 1 - model / wall is the per-step engine overhead.
    decode_only_steps: int = 0
    decode_only_wall_s: float = 0.0
    decode_only_model_s: float = 0.0
    decode_model_s: dict[str, float] = field(default_factory=dict)  # plain / draft / verify, summed over ranks
    decode_loop_steps: dict[str, int] = field(default_factory=dict)  # plain / speculative, summed over ranks


class DSAEngine:
    def __init__(self, workers: list, scheduler: Scheduler, tokenizer, info: ModelInfo,
                 metrics: ServeMetrics | None = None, max_waiting: int = 4096, stuck_after_s: float = 120.0):
        self.workers, self.scheduler, self.tokenizer, self.info = workers, scheduler, tokenizer, info
        self.metrics, self.max_waiting, self.stuck_after_s = metrics, max_waiting, stuck_after_s
        self.streams: dict[str, RequestStream] = {}
        self.stats = EngineStats(accepted_per_position=[0] * scheduler.config.num_speculative_steps)
        self.free_pages: list[int] = [scheduler.config.num_pages] * scheduler.config.cp_size
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._last_progress = time.monotonic()
        self._last_step_end = 0.0

    # EngineClient ---------------------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        chunks = self._chunks(request)
        if self.metrics is not None:
            chunks = track_stream(self.metrics, chunks)
        async for chunk in chunks:
            yield chunk

    async def abort(self, request_id: str) -> None:
        stream = self.streams.pop(request_id, None)
        self.scheduler.finish(request_id)
        if stream is not None:
            stream.end("abort")
        self._poke()

    def model_info(self) -> ModelInfo:
        return self.info

    async def metrics_text(self) -> str:
        if self.metrics is None:
            return ""
        self._record_gauges()
        return self.metrics.render()

    async def check_health(self) -> None:
        if self._task is not None and self._task.done():
            raise RuntimeError(f"engine step loop stopped: {self._task.exception()!r}")
        if self.scheduler.has_work() and time.monotonic() - self._last_progress > self.stuck_after_s:
            raise RuntimeError(f"engine step loop stuck: no step finished for {self.stuck_after_s:g}s")
        try:
            await asyncio.wait_for(asyncio.gather(*[w.free_pages.remote() for w in self.workers]), timeout=30)
        except Exception as exc:  # noqa: BLE001 - a dead or hung rank: one line naming the failure
            raise RuntimeError(f"rank worker unreachable: {one_line(exc)}") from None

    # the loop -------------------------------------------------------------------------------------
    async def _chunks(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        self._ensure_loop()
        if len(self.scheduler.waiting) >= self.max_waiting:
            raise EngineOverloadedError(f"engine queue full ({self.max_waiting} waiting requests)")
        stream = RequestStream(request, self.tokenizer)
        self.scheduler.add(request.request_id, list(request.prompt_token_ids), sampling_of(request))
        self.streams[request.request_id] = stream
        self._poke()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not stream.finished:
                await self.abort(request.request_id)

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        while True:
            if not self.scheduler.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self.step()
            except Exception as exc:  # an engine failure ends every request; the loop keeps serving
                self._fail_all(exc)
            await asyncio.sleep(0)

    async def step(self) -> None:
        """One lockstep step over the ranks that have something to do."""
        start = time.perf_counter()
        step = self.scheduler.schedule()
        if not step.plans:
            await asyncio.sleep(0.001)
            return
        ranks = list(step.plans)
        results = await asyncio.gather(*[self.workers[r].step.remote(step.plans[r]) for r in ranks])
        outputs = {rid: out for result in results for rid, out in result.outputs.items()}
        new_tokens = self.scheduler.apply(step, outputs)
        eos_ids = self.scheduler.config.eos_ids
        for request_id, tokens in new_tokens.items():
            seq, stream = self.scheduler.sequences[request_id], self.streams.get(request_id)
            reason = seq.finish_reason(eos_ids)
            if stream is not None:
                reason = stream.push(tokens, outputs[request_id].logprobs, reason)
            if reason is not None:
                self.scheduler.finish(request_id)
                self.streams.pop(request_id, None)
        end = time.perf_counter()
        self._record(step, results, outputs, end - start, end - max(start, self._last_step_end))
        self._last_step_end = end

    def _record(self, step, results, outputs, wall_s: float, since_last_s: float) -> None:
        stats, self._last_progress = self.stats, time.monotonic()
        stats.steps, stats.step_wall_s = stats.steps + 1, stats.step_wall_s + wall_s
        record_decode_time(stats, step, results, since_last_s)
        stats.preemptions += len(step.preempted)
        stats.worker_compute_s += max(r.compute_s for r in results)
        for result in results:
            self.free_pages[result.cp_rank] = result.free_pages
            stats.decode_calls += bool(step.plans[result.cp_rank].decode)
        drafted = accepted = 0
        for out in outputs.values():
            stats.generated += len(out.token_ids)
            drafted, accepted = drafted + out.drafted, accepted + sum(out.accepted_per_position)
            for j, count in enumerate(out.accepted_per_position):
                stats.accepted_per_position[j] += count
        stats.drafted, stats.accepted = stats.drafted + drafted, stats.accepted + accepted
        if self.metrics is not None:
            self.metrics.add_speculation(drafted, accepted)
            if step.preempted:
                self.metrics.add_preemptions(len(step.preempted))
            if step.prefill is not None and len(step.prefill.ranks) > 1:
                self.metrics.observe_cp_prefill(sum(r.comm_bytes for r in results), wall_s)
            self._record_gauges()

    def _record_gauges(self) -> None:
        cfg = self.scheduler.config
        self.metrics.set_requests(self.scheduler.num_running(), len(self.scheduler.waiting))
        for cp_rank, free in enumerate(self.free_pages):
            self.metrics.set_kv_pages(cp_rank, cfg.num_pages - free, cfg.num_pages)

    def _fail_all(self, error: Exception) -> None:
        for request_id, stream in list(self.streams.items()):
            stream.fail(RuntimeError(f"engine step failed: {error!r}"))
            self.scheduler.finish(request_id)
        self.streams.clear()


def record_decode_time(stats: EngineStats, step, results, since_last_s: float) -> None:
    """Model-forward time of the step's decode batches; decode-only steps also count toward the overhead."""
    for result in results:
        for phase, seconds in result.decode_model_s.items():
            stats.decode_model_s[phase] = stats.decode_model_s.get(phase, 0.0) + seconds
        for phase, count in result.decode_steps.items():
            stats.decode_loop_steps[phase] = stats.decode_loop_steps.get(phase, 0) + count
    if any(plan.prefill is not None for plan in step.plans.values()):
        return
    stats.decode_only_steps += 1
    stats.decode_only_wall_s += since_last_s
    stats.decode_only_model_s += max(sum(r.decode_model_s.values()) for r in results)
