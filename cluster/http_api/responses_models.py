"""The Responses API's output objects (`POST /v1/responses`): the response, its output items and usage, and the
envelope of its stream events (published in /openapi.json).

Output items: `reasoning` (with --reasoning-parser: the thinking, as reasoning_text content; no summary is
written), `message` (one output_text part) and `function_call` (with --tool-call-parser). Ids: resp_, rs_, msg_,
fc_ (a call's call_id is call_...). Nothing is stored: `store` is always false.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.http_api.openai_responses import UsageInfo

ItemStatus = Literal["in_progress", "completed", "incomplete"]
STREAM_EVENT_TYPES = (
    "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    "response.output_text.delta", "response.output_text.done", "response.reasoning_text.delta",
    "response.reasoning_text.done", "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.content_part.done", "response.output_item.done", "response.completed", "response.incomplete", "error")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)  # never any: this server cites nothing
    logprobs: list[Any] = Field(default_factory=list)  # never any: logprobs are not offered on this route


class MessageItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus = "in_progress"
    summary: list[Any] = Field(default_factory=list)  # no summaries are written: the thinking is in `content`
    content: list[ReasoningText] = Field(default_factory=list)


class FunctionCallItem(BaseModel):
    id: str = Field(default_factory=lambda: new_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: ItemStatus = "in_progress"
    call_id: str
    name: str
    arguments: str = ""  # a JSON object as text


OutputItem = MessageItem | ReasoningItem | FunctionCallItem
TextItem = MessageItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # the reasoning text's tokens (it re-tokenized)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: UsageInfo, reasoning_tokens: int) -> ResponseUsage:
        return cls(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
                   output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning_tokens,
                                                                                   usage.completion_tokens)),
                   total_tokens=usage.total_tokens)


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """A response: whole, or (status in_progress, no output yet) as the stream's first events carry it."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: None = None
    reasoning: dict[str, Any] | None = None
    store: Literal[False] = False
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: Literal["disabled"] = "disabled"
    background: Literal[False] = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


class ResponseStreamEvent(BaseModel):
    """One event of a streamed response; its other fields are those of its `type` in OpenAI's API reference."""

    model_config = ConfigDict(extra="allow")

    type: Literal[STREAM_EVENT_TYPES]
    sequence_number: int  # 0, 1, 2, ... in the order sent
