"""Prefill/decode disaggregation in the engine (docs/disaggregation.md): a prefill group's engine prefills a request
and hands it off (`prefill_handoff`); a decode group's engine reserves room first (`reserve`) and then decodes from
the hand-off (`decode_handoff`). A mixin of `GenerationEngine` (cp_router/engine.py), which owns the state it reads;
the request's way between the two is cp_router/disaggregated.py's."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from cp_router.handoff import HandoffTicket
from cp_router.protocol import EngineChunk, EngineOverloadedError, EngineRequest, EngineUnavailableError
from cp_router.request_stream import RequestStream, sampling_of
from cp_router.scheduler_handoff import deliver, reserve


class EngineHandoff:
    async def prefill_handoff(self, request: EngineRequest) -> AsyncIterator[EngineChunk | HandoffTicket]:
        """Prefill group: the request's first chunk, then the `HandoffTicket` a decode group goes on from (no
        ticket when the first chunk ended the request). The request's own metrics (TTFT, latency) are the decode
        group's, which sees its whole stream."""
        async for item in self._chunks(request, handoff=True):
            yield item

    async def reserve(self, request: EngineRequest) -> None:
        """Decode group: returns once pages for the request's prompt are held here (back-pressure: its prefill
        group starts after this). `request.seed` must be set: both groups sample with it."""
        if request.seed is None:
            raise ValueError("a request handed off between groups needs its seed fixed before it is reserved")
        if len(self.scheduler.reserving) >= self.max_waiting:
            raise EngineOverloadedError(f"engine queue full ({self.max_waiting} requests waiting for room)")
        self._ensure_loop()
        future = asyncio.get_running_loop().create_future()
        self._reservations[request.request_id] = future
        reserve(self.scheduler, request.request_id, list(request.prompt_token_ids), sampling_of(request))
        self._poke()
        try:
            await future
        except BaseException:
            self._reservations.pop(request.request_id, None)
            self.scheduler.finish(request.request_id)
            raise

    async def decode_handoff(self, request: EngineRequest, ticket: HandoffTicket) -> AsyncIterator[EngineChunk]:
        """Decode group: the rest of a reserved request's stream, decoded from the prefill group's hand-off."""
        if not deliver(self.scheduler, request.request_id, ticket.handoff, ticket.output_ids, ticket.cached_tokens):
            raise EngineUnavailableError(f"request {request.request_id} holds no reservation here (aborted, or "
                                         "reserved on another replica)")
        stream = RequestStream(request, self.tokenizer)
        stream.resume_after(ticket)
        self.streams[request.request_id] = stream
        self._poke()
        async for chunk in self._consume(stream):
            yield chunk

    def _reserved(self, request_ids: list[str]) -> None:
        """The scheduler gave these reservations their pages."""
        for request_id in request_ids:
            future = self._reservations.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None)

    def _cancel_reservation(self, request_id: str) -> None:
        if (future := self._reservations.pop(request_id, None)) is not None and not future.done():
            future.cancel()

    def _fail_reservation(self, request_id: str, error: Exception) -> None:
        """A reservation that will never be given its pages (the group failed): `reserve` raises `error`."""
        if (future := self._reservations.pop(request_id, None)) is not None and not future.done():
            future.set_exception(error)
