"""The OpenAI Responses API's request (`POST /v1/responses`), and its translation into a chat completion request.

`input` is a string (one user message) or a list of items: messages (roles user, assistant, system, developer;
content a string or input_text / output_text parts), `function_call` items and their `function_call_output`, and
`reasoning` items (their text reaches the next assistant turn as its reasoning_content), so a client can send a
previous response's output back as it is. `instructions` is a system message before them. Nothing is stored here:
`previous_response_id`, `conversation`, `prompt` (stored prompts) and `background` are refused. Unknown fields are
ignored, as on the other routes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from cluster.http_api.chat_requests import FUNCTION_NAME, MAX_TOOLS
from cluster.http_api.chat_translation import thinking_kwargs
from cluster.http_api.openai_requests import RequestModel

STATELESS = "this server stores no responses or conversations; send the whole conversation in `input`"
TEXT_PART_TYPES = ("input_text", "output_text", "reasoning_text")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class ContentPart(RequestModel):
    """A text part of a message or of a reasoning item (images, files and audio are refused: this server reads
    text)."""

    type: str = Field(json_schema_extra={"enum": list(TEXT_PART_TYPES)})  # any other: a 400 naming it
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type not in TEXT_PART_TYPES:
            raise ValueError(f"type {self.type!r} is not supported (this server reads text); allowed: "
                             f"{', '.join(TEXT_PART_TYPES)}")
        if self.text is None:
            raise ValueError(f"text: required in a {self.type} part")
        return self


class SummaryPart(RequestModel):
    type: Literal["summary_text"]
    text: str


def _string_as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


# a string, or a list of text parts (a string is read as one part: errors then name the part, not a union branch)
Content = Annotated[list[ContentPart], BeforeValidator(_string_as_parts,
                                                      json_schema_input_type=str | list[ContentPart])]


def text_of(content: list[ContentPart] | None) -> str:
    return "".join(part.text for part in content or ())


class InputItem(RequestModel):
    """One item of `input`: a message (`type` "message", or left out), a function call, its output, or reasoning."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: Content | None = None
    call_id: str | None = Field(None, min_length=1)
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    arguments: str | None = None
    output: Content | None = None
    summary: list[SummaryPart] | None = None

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> InputItem:
        needed = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
                  "function_call_output": ("call_id", "output"), "reasoning": ()}[self.type]
        missing = [name for name in needed if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required in a {self.type} item")
        if self.type == "function_call" and not _is_json_object(self.arguments):
            raise ValueError("arguments: must be a JSON object (as text)")
        return self

    def reasoning_text(self) -> str:
        """A reasoning item's text: its content parts, else its summary."""
        return text_of(self.content) if self.content else "".join(part.text for part in self.summary or ())


def _is_json_object(text: str) -> bool:
    try:
        return not text.strip() or isinstance(json.loads(text), dict)
    except ValueError:
        return False


def _string_as_user_message(value: Any) -> Any:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


# a string (one user message) or a list of items (read as one list, so errors name the item, not a union branch)
Input = Annotated[list[InputItem], BeforeValidator(_string_as_user_message,
                                                   json_schema_input_type=str | list[InputItem])]


class FunctionTool(RequestModel):
    """The Responses API's flat function tool (the hosted tools are not served here)."""

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(RequestModel):
    type: Literal["function"]
    name: str


class TextFormat(RequestModel):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_needs_a_name(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.json_schema is None):
            raise ValueError('name and schema: both required when type is "json_schema"')
        return self

    def response_format(self) -> dict[str, Any]:
        """The chat request's response_format."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.json_schema, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": {key: value for key, value in spec.items() if value is not None}}


class TextConfig(RequestModel):
    format: TextFormat | None = None


class ReasoningConfig(RequestModel):
    effort: Literal[REASONING_EFFORTS] | None = None  # "none": thinking off; any other: on


class ResponsesRequest(RequestModel):
    model: str | None = None
    input: Input = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    store: bool | None = None  # accepted; nothing is stored, and the response says `store: false`
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None

    @field_validator("previous_response_id", "conversation", "prompt")
    @classmethod
    def _nothing_stored(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(STATELESS)
        return value

    @field_validator("background")
    @classmethod
    def _no_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported (nothing is stored to poll); send false")
        return value

    def text_format(self) -> TextFormat:
        return self.text.format if self.text is not None and self.text.format is not None else TextFormat(type="text")

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request this one plans as (only the fields it sets, so defaults stay defaults)."""
        fields: dict[str, Any] = {"messages": chat_messages(self), "stream": bool(self.stream)}
        optional = {"model": self.model, "max_completion_tokens": self.max_output_tokens, "user": self.user,
                    "temperature": self.temperature, "top_p": self.top_p,
                    "parallel_tool_calls": self.parallel_tool_calls}
        fields.update({key: value for key, value in optional.items() if value is not None})
        if self.tools:
            fields["tools"] = [tool.as_chat_tool() for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.text_format().type != "text":
            fields["response_format"] = self.text_format().response_format()
        if self.reasoning is not None and self.reasoning.effort is not None:
            fields["chat_template_kwargs"] = thinking_kwargs(self.reasoning.effort != "none")
        return fields


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: a function call joins the assistant message before it (or
    makes one), its output is a tool message, a reasoning item's text is the reasoning of the assistant turn right
    after it (dropped when another message comes first)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    reasoning: str | None = None
    for item in body.input:
        if item.type == "reasoning":
            reasoning = (reasoning or "") + item.reasoning_text()
        elif item.type == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
            reasoning = None
        elif item.type == "message" and item.role != "assistant":
            messages.append({"role": item.role, "content": text_of(item.content)})
            reasoning = None
        else:
            _assistant_turn(messages, item, reasoning)
            reasoning = None
    return messages


def _assistant_turn(messages: list[dict[str, Any]], item: InputItem, reasoning: str | None) -> None:
    """Adds an assistant message or function call (with the reasoning before it, if any) to the conversation."""
    call = None
    if item.type == "function_call":
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and reasoning is None:
            last.setdefault("tool_calls", []).append(call)
            return
    message: dict[str, Any] = {"role": "assistant", "content": None if call else text_of(item.content)}
    if call is not None:
        message["tool_calls"] = [call]
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    messages.append(message)
