"""Engine chunks -> OpenAI objects: per-choice accumulation, logprobs in both OpenAI formats, and the two
formatters (text completions, chat completions) used alike for whole responses and SSE chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from cluster.http_api.choice_streams import PlannedChoice
from cluster.http_api.errors import APIError
from cluster.http_api.openai_responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    StreamChunk,
    TopLogprob,
    UsageInfo,
)
from cluster.http_api.prompt_encoding import PromptEncoder
from cp_router.protocol import EngineChunk, TokenLogprob


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]
    text_offset: int


@dataclass(frozen=True)
class ChoiceDelta:
    text: str
    logprobs: list[LogprobEntry] | None  # None when the request did not ask for logprobs
    finish_reason: str | None
    first: bool  # the choice's first delta (chat streams announce the role in it)


class ChoiceState:
    """Everything one choice has produced so far."""

    def __init__(self, choice: PlannedChoice, echo: bool):
        self.index = choice.index
        self.wants_logprobs = choice.request.logprobs is not None
        self.pending_echo = choice.prompt.text if echo else ""
        self.next_offset = len(self.pending_echo)
        self.text = ""
        self.logprobs: list[LogprobEntry] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.deltas = 0

    def apply(self, chunk: EngineChunk, encoder: PromptEncoder) -> ChoiceDelta:
        if chunk.finish_reason == "abort":
            raise APIError(503, "the engine aborted this request before it finished; retry", code="engine_aborted",
                           headers={"Retry-After": "1"})
        text, self.pending_echo = self.pending_echo + chunk.text, ""
        entries = [self._entry(item, encoder) for item in chunk.logprobs or ()] if self.wants_logprobs else None
        self.text += text
        self.logprobs.extend(entries or ())
        self.finish_reason = chunk.finish_reason
        self.completion_tokens = chunk.completion_tokens
        self.deltas += 1
        return ChoiceDelta(text, entries, chunk.finish_reason, first=self.deltas == 1)

    def _entry(self, item: TokenLogprob, encoder: PromptEncoder) -> LogprobEntry:
        token = encoder.token_text(item.token_id)
        top = tuple((encoder.token_text(token_id), logprob) for token_id, logprob in item.top)
        entry = LogprobEntry(token, item.logprob, top, self.next_offset)
        self.next_offset += len(token)
        return entry

    def whole(self) -> ChoiceDelta:
        return ChoiceDelta(self.text, self.logprobs if self.wants_logprobs else None, self.finish_reason, True)


def completion_logprobs(entries: list[LogprobEntry] | None) -> CompletionLogprobs | None:
    if entries is None:
        return None
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[{e.token: e.logprob, **dict(e.top)} for e in entries],
                              text_offset=[e.text_offset for e in entries])


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_logprobs(entries: list[LogprobEntry] | None) -> ChatLogprobs | None:
    if entries is None:
        return None
    return ChatLogprobs(content=[
        ChatTokenLogprob(token=e.token, logprob=e.logprob, bytes=_utf8(e.token),
                         top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=_utf8(t)) for t, lp in e.top])
        for e in entries])


class ResponseFormatter(Protocol):
    def chunk(self, index: int, delta: ChoiceDelta) -> StreamChunk: ...

    def usage_chunk(self, usage: UsageInfo) -> StreamChunk: ...

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> BaseModel: ...


class CompletionFormatter:
    def __init__(self, request_id: str, model: str):
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def _make(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> CompletionResponse:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage)

    def _choice(self, index: int, delta: ChoiceDelta) -> CompletionChoice:
        return CompletionChoice(index=index, text=delta.text, logprobs=completion_logprobs(delta.logprobs),
                                finish_reason=delta.finish_reason)

    def chunk(self, index: int, delta: ChoiceDelta) -> CompletionResponse:
        return self._make([self._choice(index, delta)], None)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._make([], usage)

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> CompletionResponse:
        return self._make([self._choice(state.index, state.whole()) for state in states], usage)


class ChatFormatter:
    def __init__(self, request_id: str, model: str):
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def _make_chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage)

    def chunk(self, index: int, delta: ChoiceDelta) -> ChatCompletionChunk:
        message = ChatDelta(role="assistant" if delta.first else None, content=delta.text)
        choice = ChatChunkChoice(index=index, delta=message, logprobs=chat_logprobs(delta.logprobs),
                                 finish_reason=delta.finish_reason)
        return self._make_chunk([choice], None)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._make_chunk([], usage)

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [ChatChoice(index=state.index, message=ChatMessageOut(content=state.text),
                              logprobs=chat_logprobs(state.whole().logprobs), finish_reason=state.finish_reason)
                   for state in states]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage)
