"""Engine output -> the Anthropic Messages API: the whole message, or its stream of named events.

One choice's text goes through chat's splitter (chat_output.py: the reasoning parser, then the tool-call parser)
and becomes content blocks in order: `thinking` (with --reasoning-parser), `text`, `tool_use`. A stream says:

    message_start, then per block: content_block_start, content_block_delta (text_delta, thinking_delta, or for a
    tool_use its whole input as one input_json_delta) ..., a thinking block's signature_delta, content_block_stop;
    then message_delta (stop_reason, stop_sequence, usage) and message_stop

and a failure after the start is an `error` event with Anthropic's error body. stop_reason: max_tokens (cut at
max_tokens or the context window), tool_use (it called tools), stop_sequence (with the one matched in
stop_sequence), else end_turn. A thinking block's signature is the SHA-256 of its text (nothing checks it). Usage
splits the prompt as Anthropic does: input_tokens are the tokens prefilled, cache_read_input_tokens those read from
the prefix cache. A whole message is built by the same code from the whole text, so it has the stream's blocks.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict

from cluster.http_api.chat_output import ChatOutputSplitter
from cluster.http_api.chat_translation import named_event
from cluster.http_api.errors import APIError
from cluster.http_api.openai_format import ChoiceDelta, ChoiceState
from cluster.http_api.openai_responses import UsageInfo
from cluster.http_api.tool_stream import EmittedCall, ToolCallSetup

Event = dict[str, Any]
Block = dict[str, Any]  # a content block, in Anthropic's shape
STREAM_EVENT_TYPES = ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                      "message_delta", "message_stop", "ping", "error")
DELTA_KEYS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}


class MessagesUsage(BaseModel):
    input_tokens: int  # prompt tokens prefilled (those read from the cache not counted: Anthropic's split)
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, usage: UsageInfo, output: bool = True) -> MessagesUsage:
        cached = usage.prompt_tokens_details.cached_tokens
        return cls(input_tokens=usage.prompt_tokens - cached, cache_read_input_tokens=cached,
                   output_tokens=usage.completion_tokens if output else 0)


class MessageObject(BaseModel):
    """A whole answer, or (no content, no stop reason yet) the one message_start carries."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Block]  # {"type": "thinking", "thinking", "signature"} | {"type": "text", "text"} | tool_use
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class MessagesStreamEvent(BaseModel):
    """One event of a streamed message; its other fields are those of its `type` in Anthropic's API reference."""

    model_config = ConfigDict(extra="allow")

    type: Literal[STREAM_EVENT_TYPES]


def signature(thinking: str) -> str:
    return hashlib.sha256(thinking.encode("utf-8")).hexdigest()


class ContentBlocks:
    """One answer's content blocks, built from its text piece by piece; each piece returns the events it makes."""

    def __init__(self, splitter: ChatOutputSplitter, stops: tuple[str, ...]):
        """`stops`: the request's stop sequences (the engine leaves the matched one at the end of the text)."""
        self.splitter, self.stops = splitter, stops
        self.blocks: list[Block] = []
        self.open: Block | None = None  # the thinking or text block text is going into
        self.stop_sequence: str | None = None

    def feed(self, text: str, finish_reason: str | None) -> list[Event]:
        """The next piece of output (`finish_reason`: set on the last one, which closes the open block)."""
        if finish_reason == "stop":
            text = self._cut_stop(text)
        piece = self.splitter.feed(text, final=finish_reason is not None)
        events = self._text("thinking", piece.reasoning) if piece.reasoning else []
        events += self._text("text", piece.content) if piece.content else []
        for call in piece.calls:
            events += self._tool_use(call)
        return events + (self._close() if finish_reason is not None else [])

    def stop_reason(self, finish_reason: str | None) -> str:
        if finish_reason == "length":
            return "max_tokens"
        if self.splitter.called:
            return "tool_use"
        return "stop_sequence" if self.stop_sequence is not None else "end_turn"

    def _cut_stop(self, text: str) -> str:
        matched = [stop for stop in self.stops if text.endswith(stop)]
        if matched:
            self.stop_sequence = max(matched, key=len)  # the engine stopped at the one that began first
            return text[: len(text) - len(self.stop_sequence)]
        return text

    def _text(self, kind: str, text: str) -> list[Event]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close() + self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking"
                                                                              else {})})
        self.open[kind] += text
        delta_type, key = DELTA_KEYS[kind]
        return events + [self._delta({"type": delta_type, key: text})]

    def _start(self, block: Block) -> list[Event]:
        self.blocks.append(block)
        self.open = block if block["type"] != "tool_use" else None
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict[str, str]) -> Event:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[Event]:
        block, self.open = self.open, None
        if block is None:
            return []
        events = []
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"])
            events.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        return events + [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _tool_use(self, call: EmittedCall) -> list[Event]:
        block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.call.name,
                 "input": {}}
        events = self._close() + self._start(block)
        block["input"] = json.loads(call.call.arguments)
        return events + [self._delta({"type": "input_json_delta", "partial_json": call.call.arguments}),
                         {"type": "content_block_stop", "index": len(self.blocks) - 1}]


class MessagesFormatter:
    """An Anthropic Messages answer: the whole message (`response`), or its stream (generation.EventWriter)."""

    def __init__(self, request_id: str, model: str, reasoning: bool | None, tools: ToolCallSetup | None, *,
                 stops: tuple[str, ...] = ()):
        """`reasoning`, `tools`: as ChatFormatter's; `stops`: the request's stop_sequences."""
        self.request_id, self.model, self.reasoning, self.tools, self.stops = request_id, model, reasoning, tools, stops
        self.stream_blocks = self._new_blocks()
        self.finish_reason: str | None = None

    def _new_blocks(self) -> ContentBlocks:
        return ContentBlocks(ChatOutputSplitter(self.reasoning, self.tools), self.stops)

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> MessageObject:
        (state,) = states
        blocks = self._new_blocks()
        blocks.feed(state.text, state.finish_reason)
        return MessageObject(id=self.request_id, model=self.model, content=blocks.blocks,
                             stop_reason=blocks.stop_reason(state.finish_reason), stop_sequence=blocks.stop_sequence,
                             usage=MessagesUsage.of(usage))

    def chunk(self, index: int, delta: ChoiceDelta, usage: Callable[[], UsageInfo]) -> str:
        events = []
        if delta.first:
            start = MessageObject(id=self.request_id, model=self.model, content=[],
                                  usage=MessagesUsage.of(usage(), output=False))
            events.append({"type": "message_start", "message": start.model_dump(mode="json")})
        self.finish_reason = delta.finish_reason
        return "".join(map(named_event, events + self.stream_blocks.feed(delta.text, delta.finish_reason)))

    def closing(self, usage: UsageInfo) -> str:
        blocks = self.stream_blocks
        delta = {"stop_reason": blocks.stop_reason(self.finish_reason), "stop_sequence": blocks.stop_sequence}
        return named_event({"type": "message_delta", "delta": delta, "usage": MessagesUsage.of(usage).model_dump()}) \
            + named_event({"type": "message_stop"})

    def failed(self, err: APIError) -> str:
        return named_event(err.anthropic_body())
