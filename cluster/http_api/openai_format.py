"""Engine chunks -> OpenAI objects: per-choice accumulation, logprobs in both OpenAI formats (with echo, the
prompt tokens' first: the first one has no logprob), vLLM's prompt_logprobs, and the two formatters (text
completions, chat completions) used alike for whole responses and SSE chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel

from cluster.http_api.chat_output import ChatOutputSplitter, finish_reason
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
    FunctionCallOut,
    PromptLogprob,
    PromptLogprobs,
    StreamChunk,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from cluster.http_api.prompt_encoding import PromptEncoder
from cluster.http_api.tool_stream import ToolCallSetup
from cp_router.protocol import EngineChunk, TokenLogprob


@dataclass(frozen=True)
class LogprobEntry:
    token: str
    logprob: float | None  # None: the first prompt token (echo), which nothing predicts
    top: tuple[tuple[str, float], ...] | None
    text_offset: int


@dataclass(frozen=True)
class ChoiceDelta:
    text: str
    logprobs: list[LogprobEntry] | None  # None when the request did not ask for logprobs
    finish_reason: str | None
    first: bool  # the choice's first delta (chat streams announce the role in it)
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, on the first delta when the request asked for them


def logprob_entries(token_ids: list[int], items: tuple[TokenLogprob | None, ...], encoder: PromptEncoder,
                    offset: int, num_top: int) -> list[LogprobEntry]:
    """One entry per token (`items`: its TokenLogprob, or None), text offsets counted on from `offset`."""
    entries = []
    for token_id, item in zip(token_ids, items):
        token = encoder.token_text(token_id)
        top = None if item is None else tuple((encoder.token_text(t), lp) for t, lp in item.top[:num_top])
        entries.append(LogprobEntry(token, None if item is None else item.logprob, top, offset))
        offset += len(token)
    return entries


def vllm_prompt_logprobs(items: tuple[TokenLogprob | None, ...], encoder: PromptEncoder,
                         num_top: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, {id: entry} for the token itself and its num_top alternatives."""
    out: PromptLogprobs = []
    for item in items:
        if item is None:
            out.append(None)
            continue
        ranked = [(item.token_id, item.logprob, item.rank)]
        ranked += [(token_id, logprob, rank) for rank, (token_id, logprob) in enumerate(item.top[:num_top], 1)]
        entry: dict[str, PromptLogprob] = {}
        for token_id, logprob, rank in ranked:
            entry.setdefault(str(token_id), PromptLogprob(logprob=logprob, rank=rank,
                                                          decoded_token=encoder.token_text(token_id)))
        out.append(entry)
    return out


class ChoiceState:
    """Everything one choice has produced so far."""

    def __init__(self, choice: PlannedChoice, echo: bool, prompt_logprobs: int | None = None):
        self.index, self.prompt_ids = choice.index, list(choice.prompt.token_ids)
        self.num_top = choice.request.logprobs  # None when the request did not ask for logprobs
        self.echo_logprobs = echo and self.num_top is not None  # the prompt tokens' logprobs come first
        self.prompt_top = prompt_logprobs  # vLLM's prompt_logprobs: k alternatives (None: not asked for)
        self.pending_echo = choice.prompt.text if echo else ""
        self.next_offset = len(self.pending_echo)
        self.text = ""
        self.logprobs: list[LogprobEntry] = []
        self.prompt_logprobs: PromptLogprobs | None = None
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the engine found in its prefix cache
        self.prompt_group = id(choice.prompt)  # the choices of one prompt share it (usage counts a prompt once)
        self.deltas = 0

    def apply(self, chunk: EngineChunk, encoder: PromptEncoder) -> ChoiceDelta:
        """Folds one engine chunk in; returns what it adds (the echoed prompt and its logprobs join the first)."""
        if chunk.finish_reason == "abort":
            raise APIError(503, "the engine aborted this request before it finished; retry", code="engine_aborted",
                           headers={"Retry-After": "1"})
        text, self.pending_echo = self.pending_echo + chunk.text, ""
        entries = self._entries(chunk, encoder) if self.num_top is not None else None
        prompt = None
        if self.prompt_top is not None and chunk.prompt_logprobs is not None:
            prompt = self.prompt_logprobs = vllm_prompt_logprobs(chunk.prompt_logprobs, encoder, self.prompt_top)
        self.text += text
        self.logprobs.extend(entries or ())
        self.finish_reason = chunk.finish_reason
        self.completion_tokens, self.cached_tokens = chunk.completion_tokens, chunk.cached_tokens
        self.deltas += 1
        return ChoiceDelta(text, entries, chunk.finish_reason, self.deltas == 1, prompt)

    def _entries(self, chunk: EngineChunk, encoder: PromptEncoder) -> list[LogprobEntry]:
        """The chunk's generated tokens, after the prompt's (offsets into the echoed prompt) on the first chunk."""
        echoed = []
        if self.echo_logprobs and chunk.prompt_logprobs is not None:
            echoed = logprob_entries(self.prompt_ids, chunk.prompt_logprobs, encoder, 0, self.num_top)
        items = chunk.logprobs or ()
        generated = logprob_entries([item.token_id for item in items], items, encoder, self.next_offset, self.num_top)
        self.next_offset += sum(len(entry.token) for entry in generated)
        return echoed + generated

    def whole(self) -> ChoiceDelta:
        return ChoiceDelta(self.text, self.logprobs if self.num_top is not None else None, self.finish_reason, True,
                           self.prompt_logprobs)


def completion_logprobs(entries: list[LogprobEntry] | None) -> CompletionLogprobs | None:
    if entries is None:
        return None
    return CompletionLogprobs(tokens=[e.token for e in entries], token_logprobs=[e.logprob for e in entries],
                              top_logprobs=[None if e.top is None else {e.token: e.logprob, **dict(e.top)}
                                            for e in entries],
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
                                finish_reason=delta.finish_reason, prompt_logprobs=delta.prompt_logprobs)

    def chunk(self, index: int, delta: ChoiceDelta) -> CompletionResponse:
        return self._make([self._choice(index, delta)], None)

    def usage_chunk(self, usage: UsageInfo) -> CompletionResponse:
        return self._make([], usage)

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> CompletionResponse:
        return self._make([self._choice(state.index, state.whole()) for state in states], usage)


class ChatFormatter:
    def __init__(self, request_id: str, model: str, reasoning: bool | None = None, tools: ToolCallSetup | None = None):
        """`reasoning`: None without a reasoning parser; else whether the prompt left the model thinking.
        `tools`: how answers are searched for tool calls (None: they are not)."""
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.reasoning, self.tools, self.splitters = reasoning, tools, {}

    def _splitter(self, index: int) -> ChatOutputSplitter:
        return self.splitters.setdefault(index, ChatOutputSplitter(self.reasoning, self.tools))

    def _make_chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None,
                    prompt_logprobs: PromptLogprobs | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage, prompt_logprobs=prompt_logprobs)

    def chunk(self, index: int, delta: ChoiceDelta) -> ChatCompletionChunk:
        role = "assistant" if delta.first else None
        splitter = self._splitter(index)
        piece = splitter.feed(delta.text, final=delta.finish_reason is not None)
        calls = [ToolCallDelta(index=c.index, id=c.id, function=FunctionCallOut(name=c.call.name,
                                                                               arguments=c.call.arguments))
                 for c in piece.calls]
        plain = self.reasoning is None and self.tools is None
        message = ChatDelta(role=role, content=piece.content if plain else piece.content or None,
                            reasoning_content=piece.reasoning or None, tool_calls=calls or None)
        choice = ChatChunkChoice(index=index, delta=message, logprobs=chat_logprobs(delta.logprobs),
                                 finish_reason=finish_reason(delta.finish_reason, splitter))
        return self._make_chunk([choice], None, delta.prompt_logprobs)

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._make_chunk([], usage)

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> ChatCompletionResponse:
        choices = [self._choice(state) for state in states]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage, prompt_logprobs=states[0].prompt_logprobs if states else None)

    def _choice(self, state: ChoiceState) -> ChatChoice:
        splitter = ChatOutputSplitter(self.reasoning, self.tools)
        piece = splitter.whole(state.text)
        calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.call.name, arguments=c.call.arguments))
                 for c in piece.calls]
        message = ChatMessageOut(content=piece.content or (None if calls else ""), reasoning_content=piece.reasoning,
                                 tool_calls=calls)
        return ChatChoice(index=state.index, message=message, logprobs=chat_logprobs(state.whole().logprobs),
                          finish_reason=finish_reason(state.finish_reason, splitter))
