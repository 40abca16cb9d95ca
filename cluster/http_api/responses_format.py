"""Engine output -> the Responses API: the whole response, or its stream of named events.

One choice's text goes through chat's splitter (chat_output.py: the reasoning parser, then the tool-call parser)
and becomes output items in order: `reasoning`, `message`, `function_call`s. A stream says, per item:

    response.output_item.added, response.content_part.added, response.output_text.delta (or
    response.reasoning_text.delta) ..., response.output_text.done (.reasoning_text.done),
    response.content_part.done, response.output_item.done

and for a call: response.output_item.added, response.function_call_arguments.delta (the whole arguments, once the
call is complete), response.function_call_arguments.done, response.output_item.done. Before the items come
response.created and response.in_progress; after them response.completed, or response.incomplete (with
incomplete_details.reason "max_output_tokens") when the output was cut at its token limit; an error after the
start is an `error` event. Every event has an `event:` line and a sequence_number. A whole response is built by
the same code, from the whole text at once, so it has the items the stream would have had.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from cluster.http_api.chat_output import ChatOutputSplitter
from cluster.http_api.chat_translation import named_event
from cluster.http_api.errors import APIError
from cluster.http_api.openai_format import ChoiceDelta, ChoiceState
from cluster.http_api.openai_responses import UsageInfo
from cluster.http_api.responses_models import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponseUsage,
    TextItem,
)
from cluster.http_api.tool_stream import EmittedCall, ToolCallSetup

Event = dict[str, Any]


class OutputItems:
    """One response's output items, built from its text piece by piece; each piece returns the events it makes."""

    def __init__(self, splitter: ChatOutputSplitter):
        self.splitter = splitter
        self.items: list[TextItem | FunctionCallItem] = []
        self.open: TextItem | None = None  # the item text is going into

    def feed(self, text: str, finish_reason: str | None) -> list[Event]:
        """The next piece of output (`finish_reason`: set on the last one, which closes every item)."""
        piece = self.splitter.feed(text, final=finish_reason is not None)
        events = self._text(ReasoningItem, piece.reasoning) if piece.reasoning else []
        events += self._text(MessageItem, piece.content) if piece.content else []
        for call in piece.calls:
            events += self._call(call)
        if finish_reason is not None:
            if not any(isinstance(item, (MessageItem, FunctionCallItem)) for item in self.items):
                events += self._text(MessageItem, "")  # an answer always has a message, if only an empty one
            events += self._close("incomplete" if finish_reason == "length" else "completed")
        return events

    def reasoning_text(self) -> str:
        return "".join(item.content[0].text for item in self.items if isinstance(item, ReasoningItem))

    def _text(self, kind: type[TextItem], text: str) -> list[Event]:
        events = [] if isinstance(self.open, kind) else self._close("completed") + self._open(kind())
        item = self.open
        item.content[0].text += text
        if text:
            events.append({"type": f"response.{_part_kind(item)}.delta", **_where(item, self._index), "delta": text,
                           **_logprobs(item)})
        return events

    @property
    def _index(self) -> int:
        return len(self.items) - 1

    def _open(self, item: TextItem) -> list[Event]:
        self.items.append(item)
        self.open = item
        added = {"type": "response.output_item.added", "output_index": self._index, "item": item.model_dump()}
        item.content.append(OutputText() if isinstance(item, MessageItem) else ReasoningText())
        return [added, {"type": "response.content_part.added", **_where(item, self._index),
                        "part": item.content[0].model_dump()}]

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        part, where = item.content[0], _where(item, self._index)
        return [{"type": f"response.{_part_kind(item)}.done", **where, "text": part.text, **_logprobs(item)},
                {"type": "response.content_part.done", **where, "part": part.model_dump()},
                {"type": "response.output_item.done", "output_index": self._index, "item": item.model_dump()}]

    def _call(self, call: EmittedCall) -> list[Event]:
        events = self._close("completed")
        item = FunctionCallItem(call_id=call.id, name=call.call.name)
        self.items.append(item)
        where = {"item_id": item.id, "output_index": self._index}
        events.append({"type": "response.output_item.added", "output_index": self._index, "item": item.model_dump()})
        item.arguments, item.status = call.call.arguments, "completed"
        return events + [{"type": "response.function_call_arguments.delta", **where, "delta": item.arguments},
                         {"type": "response.function_call_arguments.done", **where, "name": item.name,
                          "arguments": item.arguments},
                         {"type": "response.output_item.done", "output_index": self._index, "item": item.model_dump()}]


def _part_kind(item: TextItem) -> str:
    return "output_text" if isinstance(item, MessageItem) else "reasoning_text"


def _where(item: TextItem, index: int) -> Event:
    return {"item_id": item.id, "output_index": index, "content_index": 0}


def _logprobs(item: TextItem) -> Event:
    """output_text events carry (empty) logprobs, as OpenAI's do; reasoning_text events none."""
    return {"logprobs": []} if isinstance(item, MessageItem) else {}


class ResponsesFormatter:
    """A Responses API answer: the whole response (`response`), or its stream (generation.EventWriter)."""

    def __init__(self, request_id: str, model: str, reasoning: bool | None, tools: ToolCallSetup | None, *,
                 echo: dict[str, Any], count_tokens: Callable[[str], int]):
        """`reasoning`, `tools`: as ChatFormatter's; `echo`: the request's settings every response object repeats;
        `count_tokens`: a text's token count (usage's reasoning_tokens)."""
        self.request_id, self.model, self.reasoning, self.tools = request_id, model, reasoning, tools
        self.echo, self.count_tokens, self.created = echo, count_tokens, int(time.time())
        self.stream_items = self._new_items()
        self.sequence, self.finish_reason = 0, None

    def _new_items(self) -> OutputItems:
        return OutputItems(ChatOutputSplitter(self.reasoning, self.tools))

    def _response(self, items: OutputItems | None, usage: UsageInfo | None) -> ResponseObject:
        """The response object: in progress (no items), or finished with `items`."""
        response = ResponseObject(id=self.request_id, model=self.model, created_at=self.created, **self.echo)
        if items is None or usage is None:
            return response
        response.output = items.items
        response.usage = ResponseUsage.of(usage, self.count_tokens(items.reasoning_text()))
        cut = self.finish_reason == "length"
        response.status = "incomplete" if cut else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if cut else None
        return response

    def response(self, states: list[ChoiceState], usage: UsageInfo) -> ResponseObject:
        (state,) = states
        items = self._new_items()
        items.feed(state.text, state.finish_reason)
        self.finish_reason = state.finish_reason
        return self._response(items, usage)

    def chunk(self, index: int, delta: ChoiceDelta, usage: Callable[[], UsageInfo]) -> str:
        events = self._opening() if delta.first else []
        self.finish_reason = delta.finish_reason
        return self._render(events + self.stream_items.feed(delta.text, delta.finish_reason))

    def closing(self, usage: UsageInfo) -> str:
        response = self._response(self.stream_items, usage)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return self._render([{"type": kind, "response": response.model_dump(mode="json")}])

    def failed(self, err: APIError) -> str:
        return self._render([{"type": "error", "code": err.code or err.type, "message": err.message,
                              "param": err.param}])

    def _opening(self) -> list[Event]:
        started = self._response(None, None).model_dump(mode="json")
        return [{"type": "response.created", "response": started}, {"type": "response.in_progress",
                                                                     "response": started}]

    def _render(self, events: list[Event]) -> str:
        for event in events:
            event["sequence_number"] = self.sequence
            self.sequence += 1
        return "".join(named_event(event) for event in events)
