"""OpenAI chat request models (`POST /v1/chat/completions`): messages (with tool calls and tool results) and tools.

As OpenAI: `content` may be null only in an assistant message that carries `tool_calls`; a `tool` message names
the call it answers (`tool_call_id`); `tool_choice` is "none", "auto" (the default when tools are given),
"required" or {"type": "function", "function": {"name": ...}} naming one of the tools. A call's `arguments`
arrive as JSON text (an object is accepted too) and reach chat templates as an object, as Hugging Face
templates expect. Which choices the server can honour (a tool-call parser, auto tool choice) is the ingress's
check: `tool_calls_for`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator, model_validator

from cluster.http_api.openai_requests import MAX_LOGPROBS, RequestModel, SamplingRequest
from cluster.http_api.openapi_schema import without_null

MAX_TOOLS = 128  # as OpenAI
FUNCTION_NAME = r"^[A-Za-z0-9_.:\-]{1,64}$"  # OpenAI's letters, digits, _ and -, plus the . and : of namespaced tools


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class FunctionSpec(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None

    def param_types(self) -> dict[str, Any]:
        """Each parameter's JSON schema `type` (what a parser reads a string value as)."""
        properties = (self.parameters or {}).get("properties") or {}
        return {key: schema.get("type") for key, schema in properties.items() if isinstance(schema, dict)}


class ToolSpec(RequestModel):
    type: Literal["function"]
    function: FunctionSpec


ARGUMENTS_SCHEMA = {"anyOf": [{"type": "string", "description": "a JSON object as text",
                                "contentMediaType": "application/json", "contentSchema": {"type": "object"}},
                               {"type": "object"}]}


class FunctionCallIn(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: Annotated[dict[str, Any], WithJsonSchema(ARGUMENTS_SCHEMA)]

    @field_validator("arguments", mode="before")
    @classmethod
    def _json_object(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value) if value.strip() else {}
            except ValueError:
                raise ValueError("must be a JSON object (as text)") from None
            if not isinstance(value, dict):
                raise ValueError("must be a JSON object")
        return value


class ToolCallIn(RequestModel):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


def _role_rules(schema: dict[str, Any]) -> None:
    """The published side of `_fields_of_the_role`: one variant per role, as OpenAI's own schema has them."""
    properties = schema["properties"]
    content, calls = without_null(properties["content"]), without_null(properties["tool_calls"])["anyOf"][0]
    no_calls = {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
    schema["anyOf"] = [
        {"properties": {"role": {"enum": ["system", "developer", "user"]}, "content": content, "tool_calls": no_calls},
         "required": ["content"]},
        {"properties": {"role": {"const": "assistant"}, "content": content}, "required": ["content"]},
        {"properties": {"role": {"const": "assistant"}, "tool_calls": {**calls, "minItems": 1}},
         "required": ["tool_calls"]},
        {"properties": {"role": {"const": "tool"}, "content": content, "tool_calls": no_calls,
                        "tool_call_id": {"type": "string", "minLength": 1}}, "required": ["content", "tool_call_id"]}]


class ChatMessage(RequestModel):
    model_config = ConfigDict(json_schema_extra=_role_rules)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant turn's reasoning (templates may keep or drop it)
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _fields_of_the_role(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only assistant messages carry them (this one is {self.role!r})")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("tool_call_id: required in a tool message (the id of the call it answers)")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: required (null only in an assistant message with tool_calls)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (a call's arguments as an object)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def tools_json(tools: list[ToolSpec] | None) -> list[dict[str, Any]] | None:
    """Tools as chat templates read them (OpenAI's JSON); None when there are none."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True  # False: at most one call per answer
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)  # e.g. {"thinking": true} (DeepSeek)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("logprobs") is False:
            raise ValueError("only allowed when logprobs is true")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_the_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = [tool.function.name for tool in info.data.get("tools") or ()]
        if value not in (None, "none") and not names:
            raise ValueError("only allowed with tools (none were given)")
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"names function {value.function.name!r}, which is not among the tools "
                             f"({', '.join(names)})")
        return value

    @property
    def effective_tool_choice(self) -> ToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def tool_param_types(self) -> dict[str, dict[str, Any]]:
        return {tool.function.name: tool.function.param_types() for tool in self.tools or ()}

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
