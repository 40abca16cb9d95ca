"""The Anthropic Messages API's requests (`POST /v1/messages`, `POST /v1/messages/count_tokens`), and their
translation into a chat completion request.

`system` (a string or text blocks) is a system message first. A message's content is a string or blocks: `text`,
`tool_use` (an assistant's call: a chat tool call), `tool_result` (its answer, a string or text blocks: a tool
message), `thinking` (an assistant's earlier reasoning: its reasoning_content; signatures are not checked).
Images, documents and other blocks are refused, naming the block. Tools are {name, description, input_schema};
tool_choice auto / any (chat's "required") / tool (a named function) / none. `thinking` enabled or adaptive (on) or
disabled sets the template's thinking switch (left out: disabled, as Anthropic's default); its budget_tokens is not
enforced (the thinking and the answer share max_tokens). `output_config.format` (a JSON schema) is chat's
response_format json_schema. `metadata` and unknown fields are ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from cluster.http_api.chat_requests import FUNCTION_NAME, MAX_TOOLS
from cluster.http_api.chat_translation import thinking_kwargs
from cluster.http_api.openai_requests import MAX_STOP_CHARS, MAX_STOP_STRINGS, RequestModel

BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"), "tool_result": ("tool_use_id",),
                "thinking": ("thinking",)}  # the blocks read here, and the fields each needs
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's -> chat's ("tool": a named one)


def _unsupported(kind: str, allowed: Any) -> ValueError:
    return ValueError(f"type {kind!r} is not supported (this server reads text); allowed: {', '.join(allowed)}")


class TextBlock(RequestModel):
    """A text block (of `system`, or of a tool result)."""

    type: str = Field(json_schema_extra={"enum": ["text"]})  # any other: a 400 naming it (`_text_only`)
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextBlock:
        if self.type != "text":
            raise _unsupported(self.type, ["text"])
        if self.text is None:
            raise ValueError("text: required in a text block")
        return self


def _string_as_text_block(value: Any) -> Any:
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


# a string or a list of text blocks (read as one list: errors then name the block, not a union branch)
Text = Annotated[list[TextBlock], BeforeValidator(_string_as_text_block, json_schema_input_type=str | list[TextBlock])]


def text_parts(blocks: list[TextBlock] | None) -> list[dict[str, str]]:
    """Text blocks as chat content parts."""
    return [{"type": "text", "text": block.text} for block in blocks or ()]


class ContentBlock(RequestModel):
    """One block of a message: text, tool_use, tool_result or thinking."""

    type: str = Field(json_schema_extra={"enum": list(BLOCK_FIELDS)})  # any other: a 400 naming it
    text: str | None = None
    id: str | None = Field(None, min_length=1)  # tool_use
    name: str | None = Field(None, pattern=FUNCTION_NAME)
    input: dict[str, Any] | None = None
    tool_use_id: str | None = Field(None, min_length=1)  # tool_result
    content: Text | None = None
    is_error: bool | None = None  # accepted; the result's text reaches the model as it is
    thinking: str | None = None  # thinking
    signature: str | None = None

    @model_validator(mode="after")
    def _fields_of_the_type(self) -> ContentBlock:
        if self.type not in BLOCK_FIELDS:
            raise _unsupported(self.type, BLOCK_FIELDS)
        missing = [name for name in BLOCK_FIELDS[self.type] if getattr(self, name) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required in a {self.type} block")
        return self


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: Annotated[list[ContentBlock], BeforeValidator(_string_as_text_block,
                                                           json_schema_input_type=str | list[ContentBlock])]

    @model_validator(mode="after")
    def _blocks_of_the_role(self) -> Message:
        allowed = ("text", "tool_result") if self.role == "user" else ("text", "tool_use", "thinking")
        for index, block in enumerate(self.content):
            if block.type not in allowed:
                raise ValueError(f"content.{index}: a {self.role} message carries {', '.join(allowed)} blocks, "
                                 f"not {block.type}")
        return self


class Tool(RequestModel):
    type: Literal["custom"] | None = None  # Anthropic's server tools (bash, web search, ...) are not served
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _tool_names_one(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name: required when type is "tool", and only then')
        return self

    def chat_choice(self) -> str | dict[str, Any]:
        return TOOL_CHOICES.get(self.type) or {"type": "function", "function": {"name": self.name}}


class Thinking(RequestModel):
    type: Literal["enabled", "adaptive", "disabled"]  # adaptive: on (the model decides how long it thinks)
    budget_tokens: int | None = Field(None, ge=1)  # accepted, not enforced


class OutputFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    """`format`: the answer is JSON following its schema (chat's response_format json_schema); `effort` ignored."""

    format: OutputFormat | None = None


class MessagesPrompt(RequestModel):
    """What makes the prompt (the count of /v1/messages/count_tokens)."""

    model: str | None = None
    system: Text | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _ends_with_the_user(cls, messages: list[Message]) -> list[Message]:
        if messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's: continuing a prefilled assistant turn is not "
                             "supported; end with a user message")
        return messages

    def chat_fields(self) -> dict[str, Any]:
        """The chat completion request fields of the prompt (only those it sets)."""
        thinking = self.thinking is not None and self.thinking.type != "disabled"
        fields: dict[str, Any] = {"messages": chat_messages(self), "chat_template_kwargs": thinking_kwargs(thinking)}
        if self.model is not None:
            fields["model"] = self.model
        if self.tools:
            fields["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description is not None else {})}} for tool in self.tools]
        if self.output_config is not None and self.output_config.format is not None:
            schema = {"name": "output", "schema": self.output_config.format.json_schema}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        if self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice.chat_choice()
            if self.tool_choice.disable_parallel_tool_use:
                fields["parallel_tool_calls"] = False
        return fields


class MessagesRequest(MessagesPrompt):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False

    @field_validator("stop_sequences")
    @classmethod
    def _stop_lengths(cls, stops: list[str]) -> list[str]:
        if any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"every stop sequence must have 1..{MAX_STOP_CHARS} characters")
        return stops

    def chat_fields(self) -> dict[str, Any]:
        """With stop sequences the engine keeps the matched one in the text, so the answer can say which matched
        (messages_format.py cuts it off)."""
        fields = {**super().chat_fields(), "max_tokens": self.max_tokens, "stream": bool(self.stream)}
        optional = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        fields.update({key: value for key, value in optional.items() if value is not None})
        if self.stop_sequences:
            fields.update(stop=self.stop_sequences, include_stop_str_in_output=True)
        return fields


class CountTokensRequest(MessagesRequest):
    """/v1/messages/count_tokens' body: a /v1/messages body whose max_tokens may be left out (its sampling
    fields are checked and do not change the count)."""

    max_tokens: int | None = Field(None, ge=1)


def chat_messages(body: MessagesPrompt) -> list[dict[str, Any]]:
    """`system` and the messages as chat messages: a user message's tool results become tool messages (in their
    place among its text), an assistant's tool_use blocks its tool calls, its thinking its reasoning_content."""
    messages = [{"role": "system", "content": text_parts(body.system)}] if body.system else []
    for message in body.messages:
        if message.role == "assistant":
            messages.append(_assistant_message(message.content))
            continue
        text: list[dict[str, str]] = []
        for block in message.content:
            if block.type == "text":
                text.append({"type": "text", "text": block.text})
                continue
            if text:
                messages.append({"role": "user", "content": text})
                text = []
            messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text_parts(block.content)})
        if text or not message.content:
            messages.append({"role": "user", "content": text})
    return messages


def _assistant_message(blocks: list[ContentBlock]) -> dict[str, Any]:
    text = [{"type": "text", "text": block.text} for block in blocks if block.type == "text"]
    calls = [{"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
             for block in blocks if block.type == "tool_use"]
    thinking = [block.thinking for block in blocks if block.type == "thinking"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message
