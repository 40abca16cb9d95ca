"""Drive the engine streams of one HTTP request into a JSON response or an SSE stream.

Streams: the first chunk is awaited before the response starts, so admission errors (engine overloaded)
still get their HTTP status. What the stream says is its `EventWriter`'s: OpenAI's chunks (`ChunkWriter`: one
`data:` event per engine chunk, a later error as one `data: {"error": ...}` event, `data: [DONE]` last), or the
Responses and Messages APIs' named events (responses_format.py, messages_format.py). A client that leaves
(before or during the stream) aborts all of its engine requests.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Protocol

from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cluster.http_api.choice_streams import PlannedChoice, merge_choice_streams, unless_disconnected
from cluster.http_api.errors import APIError, mark_error, to_api_error
from cluster.http_api.openai_format import ChoiceDelta, ChoiceState, ResponseFormatter
from cluster.http_api.openai_responses import SSE_DONE, UsageInfo, sse_data, sse_event
from cluster.http_api.prompt_encoding import PromptEncoder
from cp_router.protocol import EngineChunk, EngineClient

logger = logging.getLogger(__name__)
Events = AsyncIterator[tuple[int, EngineChunk]]


@dataclass(frozen=True)
class Generation:
    """One HTTP generation request, planned: its engine choices and how to format them."""

    request_id: str
    choices: list[PlannedChoice]
    formatter: ResponseFormatter
    prompt_tokens: int  # each prompt counted once, whatever n is
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: k top alternatives (None: not asked for)

    def new_states(self) -> dict[int, ChoiceState]:
        return {choice.index: ChoiceState(choice, self.echo, self.prompt_logprobs) for choice in self.choices}

    def usage(self, states: dict[int, ChoiceState]) -> UsageInfo:
        """Each prompt counted once; its cached tokens are those every choice of it found cached."""
        cached: dict[int, int] = {}
        for state in states.values():
            cached[state.prompt_group] = min(cached.get(state.prompt_group, state.cached_tokens), state.cached_tokens)
        return UsageInfo.of(self.prompt_tokens, sum(state.completion_tokens for state in states.values()),
                            sum(cached.values()))


def _record_outcome(scope: Scope, generation: Generation, states: dict[int, ChoiceState]) -> None:
    """Fields of the access log line."""
    usage = generation.usage(states)
    scope.setdefault("state", {}).update(
        request_id=generation.request_id, prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        finish=",".join(sorted({state.finish_reason or "none" for state in states.values()})))


async def _collect(engine: EngineClient, encoder: PromptEncoder, generation: Generation,
                   scope: Scope) -> BaseModel:
    states = generation.new_states()
    async with aclosing(merge_choice_streams(engine, generation.choices)) as events:
        async for index, chunk in events:
            states[index].apply(chunk, encoder)
    _record_outcome(scope, generation, states)
    return generation.formatter.response(sorted(states.values(), key=lambda state: state.index),
                                         generation.usage(states))


async def respond_whole(request: Request, engine: EngineClient, encoder: PromptEncoder,
                        generation: Generation) -> BaseModel:
    return await unless_disconnected(request, _collect(engine, encoder, generation, request.scope))


class SSEResponse(StreamingResponse):
    """Server-sent events whose body iterator is always closed (so abandoned engine streams are aborted)."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientDisconnect:  # the stream had started: nobody is left to answer (the body records it)
            pass
        finally:
            await self.body_iterator.aclose()


class EventWriter(Protocol):
    """The text of one stream: the events of each choice delta, of the end, and of a failure after the start."""

    def chunk(self, index: int, delta: ChoiceDelta, usage: Callable[[], UsageInfo]) -> str:
        """The events of one delta (`usage()`: the usage so far)."""

    def closing(self, usage: UsageInfo) -> str:
        """The events after the last delta."""

    def failed(self, err: APIError) -> str:
        """The events that end a stream that failed."""


class ChunkWriter:
    """OpenAI's completions and chat streams: one `data:` chunk per delta, the usage chunk when asked for, then
    `data: [DONE]`; an error as one `data: {"error": ...}` event."""

    def __init__(self, formatter: ResponseFormatter, include_usage: bool, continuous_usage: bool = False):
        self.formatter, self.include_usage, self.continuous_usage = formatter, include_usage, continuous_usage

    def chunk(self, index: int, delta: ChoiceDelta, usage: Callable[[], UsageInfo]) -> str:
        event = self.formatter.chunk(index, delta)
        if self.continuous_usage:
            event.usage = usage()
        return sse_event(event, self.include_usage or self.continuous_usage)

    def closing(self, usage: UsageInfo) -> str:
        if not self.include_usage:
            return SSE_DONE
        return sse_event(self.formatter.usage_chunk(usage), True) + SSE_DONE

    def failed(self, err: APIError) -> str:
        return sse_data(err.body()) + SSE_DONE


async def _sse_body(events: Events, first: tuple[int, EngineChunk] | None, encoder: PromptEncoder,
                    generation: Generation, writer: EventWriter, scope: Scope) -> AsyncIterator[str]:
    states = generation.new_states()
    ended = False  # stays False when the client leaves (the generator is closed or cancelled mid-stream)
    try:
        item = first
        while item is not None:
            index, chunk = item
            yield writer.chunk(index, states[index].apply(chunk, encoder), lambda: generation.usage(states))
            item = await anext(events, None)
        ended = True
        yield writer.closing(generation.usage(states))
    except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes into the stream
        ended = True
        err = to_api_error(exc)
        if err.status >= 500:
            logger.error("stream %s failed", generation.request_id, exc_info=exc)
        mark_error(scope, err.metric_label)
        yield writer.failed(err)
    finally:
        if not ended:
            mark_error(scope, "client_disconnected")
        await events.aclose()
        _record_outcome(scope, generation, states)


async def respond_stream(request: Request, engine: EngineClient, encoder: PromptEncoder, generation: Generation,
                         writer: EventWriter) -> SSEResponse:
    """The stream of `generation`, in `writer`'s events."""
    events = merge_choice_streams(engine, generation.choices)
    first = await unless_disconnected(request, anext(events, None))
    body = _sse_body(events, first, encoder, generation, writer, request.scope)
    return SSEResponse(body, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
