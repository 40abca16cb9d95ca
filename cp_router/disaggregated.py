"""Prefill/decode disaggregation: one request's way from a decode group's engine through a prefill group and back
(docs/disaggregation.md). Pure asyncio: the prefill side is anything with `prefill_handoff` and `abort` (another
engine in this process, or the Serve app's handle to a prefill deployment).

`DisaggregatedEngine` is the decode group's `EngineClient`. A request with a prompt shorter than
`min_prefill_tokens` is prefilled and decoded here, as without disaggregation. Any other: its seed is fixed (both
groups sample with it), room for its prompt is reserved here (back-pressure: no prefill starts without it), a prefill
group prefills it and samples its first token, and the hand-off (KV pages and decode state) arrives with that
token; the first chunk is passed on then, and the rest of the stream is decoded here from the hand-off.

Failures: a prefill that fails, or whose hand-off does not come within `handoff_timeout_s` of its first chunk, is
tried once more (on Serve, possibly another replica; nothing was streamed yet), then the request ends with an
`EngineUnavailableError` naming both failures. Once decoding here, this group's own recovery covers it.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from typing import AsyncIterator, Protocol

from cp_router.handoff import HandoffTicket
from cp_router.protocol import EngineChunk, EngineRequest, EngineUnavailableError, ModelInfo, one_line

HANDOFF_TIMEOUT_S = 120.0  # from a prefill's first chunk to its hand-off (an 8k prompt's pages move in ~0.1 s)


class PrefillClient(Protocol):
    def prefill_handoff(self, request: EngineRequest) -> AsyncIterator[EngineChunk | HandoffTicket]: ...

    async def abort(self, request_id: str) -> None: ...


class PrefillFailed(RuntimeError):
    """A prefill group's attempt ended without a hand-off."""


class DisaggregatedEngine:
    def __init__(self, decode, prefill: PrefillClient, min_prefill_tokens: int = 0, attempts: int = 2,
                 handoff_timeout_s: float = HANDOFF_TIMEOUT_S):
        self.decode, self.prefill, self.min_prefill_tokens = decode, prefill, min_prefill_tokens
        self.attempts, self.handoff_timeout_s = attempts, handoff_timeout_s
        self.stats = {"handoffs": 0, "local_prefills": 0, "prefill_retries": 0, "handoff_bytes": 0}

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        if len(request.prompt_token_ids) < self.min_prefill_tokens:
            self.stats["local_prefills"] += 1
            chunks = self.decode.generate(request)
        else:  # measured here as one request (TTFT, inter-token gaps, latency), as the client sees it
            chunks = self.decode.monitor.stream(request.request_id, self._handed_off(request))
        async for chunk in chunks:
            yield chunk

    async def _handed_off(self, request: EngineRequest) -> AsyncIterator[EngineChunk]:
        if request.seed is None:
            request = replace(request, seed=random.getrandbits(62))  # what sampling_of would draw, fixed for both
        await self.decode.reserve(request)
        decoding = False  # from the hand-off's delivery on, the decode stream aborts what its reader drops
        try:
            first, ticket, transfer_s, retries = await self._prefill_with_retry(request)
            for chunk in first:
                yield chunk
            if ticket is None:  # the first chunk ended it
                return
            self.stats["handoffs"] += 1
            self.stats["handoff_bytes"] += ticket.handoff.nbytes
            if (metrics := getattr(self.decode, "metrics", None)) is not None:
                metrics.observe_handoff(ticket.handoff.nbytes, transfer_s, retries)
            decoding = True
            async for chunk in self.decode.decode_handoff(request, ticket):
                yield chunk
        finally:
            if not decoding:  # failed, ended by its first chunk, or its reader left before the hand-off
                await self.decode.abort(request.request_id)  # its reservation

    async def _prefill_with_retry(self, request: EngineRequest) -> tuple[list[EngineChunk], HandoffTicket | None,
                                                                          float, int]:
        """`_prefill_once`'s result and how many attempts failed before it."""
        errors = []
        for attempt in range(self.attempts):
            try:
                return *await self._prefill_once(request), attempt
            except (PrefillFailed, EngineUnavailableError, asyncio.TimeoutError) as exc:
                errors.append(one_line(exc))
            except Exception as exc:  # noqa: BLE001 - a replica or rank died under the call: try once more
                errors.append(one_line(exc))
            await self.prefill.abort(request.request_id)
            if attempt + 1 < self.attempts:
                self.stats["prefill_retries"] += 1
        raise EngineUnavailableError(f"request {request.request_id}: no prefill group handed it off "
                                     f"({'; then '.join(errors)})")

    async def _prefill_once(self, request: EngineRequest) -> tuple[list[EngineChunk], HandoffTicket | None, float]:
        """The prefill group's chunks (held until its hand-off: nothing is streamed from an attempt that fails),
        its hand-off, and the seconds from its first chunk to the hand-off (the transfer)."""
        chunks: list[EngineChunk] = []
        first_at = 0.0
        stream = self.prefill.prefill_handoff(request)
        try:
            while True:
                timeout = self.handoff_timeout_s if chunks else None  # the prefill itself may queue for long
                try:
                    item = await asyncio.wait_for(stream.__anext__(), timeout)
                except StopAsyncIteration:
                    break
                if isinstance(item, HandoffTicket):
                    return chunks, item, time.perf_counter() - first_at
                chunks.append(item)
                first_at = first_at or time.perf_counter()
                if item.finish_reason is not None:
                    return chunks, None, 0.0
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()
        raise PrefillFailed("the prefill stream ended without a finish reason or a hand-off")

    async def abort(self, request_id: str) -> None:
        await self.decode.abort(request_id)
        await self.prefill.abort(request_id)

    def model_info(self) -> ModelInfo:
        return self.decode.model_info()

    async def metrics_text(self) -> str:
        return await self.decode.metrics_text()

    async def flush_cache(self) -> int:
        return await self.decode.flush_cache()

    async def check_health(self) -> None:
        await self.decode.check_health()
