"""OpenAI-compatible response objects: completions, chat completions, their SSE chunks, and the model list.

Streamed completion chunks use the same `text_completion` object as whole responses (as OpenAI does); chat
chunks are `chat.completion.chunk` objects carrying a `delta`. `usage` is present in a stream only when
`stream_options.include_usage` is set: null on every chunk, then one final chunk with empty choices. A choice
carries vLLM's `prompt_logprobs` only when the request asked for them (in a stream: on its first chunk).
"""

from __future__ import annotations

import json
import time
from importlib import metadata
from typing import Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

OpenAIFinishReason = Literal["stop", "length", "tool_calls"]
SSE_DONE = "data: [DONE]\n\n"


def server_version() -> str:
    """The installed dsa-serve's version ("unknown" outside an installed package)."""
    try:
        return metadata.version("dsa-serve")
    except metadata.PackageNotFoundError:
        return "unknown"


SYSTEM_FINGERPRINT = f"fp_dsa_serve_{server_version()}"  # the server build every response came from


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of prefilled


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of one token at one prompt position."""

    logprob: float
    rank: int | None = None  # 1-based rank among all tokens
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # per prompt token: token id -> entry; None for the first


class WithPromptLogprobs(BaseModel):
    """A choice with vLLM's `prompt_logprobs`: the prompt token and its top alternatives at every position. The
    key is left out of the JSON when the request did not ask for them (or, in a stream, after the first chunk)."""

    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _prompt_logprobs_last_or_absent(self, handler: SerializerFunctionWrapHandler) -> dict:
        data = handler(self)
        prompt_logprobs = data.pop("prompt_logprobs", None)
        return data if prompt_logprobs is None else {**data, "prompt_logprobs": prompt_logprobs}


class CompletionChoice(WithPromptLogprobs):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion, or (with `finish_reason` None and a text delta) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str = Field(default_factory=lambda: SYSTEM_FINGERPRINT)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    """A streamed call: sent whole, in one delta, once the model has written all of it."""

    index: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser: the thinking before the answer
    tool_calls: list[ToolCallOut] = Field(default_factory=list)  # with --tool-call-parser: the calls it made


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionResponse(WithPromptLogprobs):
    """A whole chat completion; vLLM's `prompt_logprobs` sit at the top level (the choices share the prompt)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str = Field(default_factory=lambda: SYSTEM_FINGERPRINT)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: OpenAIFinishReason | None = None


class ChatCompletionChunk(WithPromptLogprobs):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str = Field(default_factory=lambda: SYSTEM_FINGERPRINT)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsa-serve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


StreamChunk = CompletionResponse | ChatCompletionChunk


def sse_data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def sse_event(chunk: StreamChunk, include_usage: bool) -> str:
    """One `data: {...}` event; `usage` appears only when asked for, chat deltas carry only their set keys."""
    payload = chunk.model_dump(exclude=None if include_usage else {"usage"})
    for choice in payload["choices"]:
        if "delta" in choice:
            choice["delta"] = {key: value for key, value in choice["delta"].items() if value is not None}
    return sse_data(payload)
