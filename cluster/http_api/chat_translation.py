"""What the Responses API (responses_api.py) and the Anthropic Messages API (messages_api.py) share: each request is
translated into a chat completion request and planned as one (`Ingress.plan_chat`), so templates, tools, reasoning,
stop strings, usage and the prefix cache behave as in chat; only the output side is the API's own formatter, which
also writes its stream (generation.EventWriter).

Errors found on the chat request name the chat fields; `Renames` maps them back to the fields the client sent.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from cluster.http_api.chat_requests import ChatCompletionRequest
from cluster.http_api.errors import APIError, validation_error
from cluster.http_api.generation import Generation, respond_stream, respond_whole

Renames = dict[str, str]  # chat request field -> the API's field


def thinking_kwargs(on: bool) -> dict[str, bool]:
    """chat_template_kwargs that switch thinking on or off, in both spellings templates read: DeepSeek's
    `thinking` (vLLM's, and the built-in DeepSeek-V3.2 encoding's) and `enable_thinking` (GLM's, Qwen's, the
    default model's)."""
    return {"thinking": on, "enable_thinking": on}


def renamed(err: APIError, renames: Renames) -> APIError:
    """`err` with the chat field names in its param and message replaced by the API's."""
    param, message = err.param, err.message
    for chat_name, api_name in renames.items():
        if param is not None and (param == chat_name or param.startswith(chat_name + ".")):
            param = api_name + param[len(chat_name):]
        message = re.sub(rf"(?<![\w.]){re.escape(chat_name)}\b", api_name, message)
    return APIError(err.status, message, param=param, code=err.code, headers=err.headers)


def chat_request(fields: dict[str, Any], renames: Renames) -> ChatCompletionRequest:
    """The chat completion request made of `fields` (already checked as the API's own request); a field the chat
    request still refuses is a 400 naming the API's field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        raise renamed(validation_error(exc.errors()), renames) from None


def plan(ingress, chat: ChatCompletionRequest, make_formatter: Callable, id_prefix: str,
         renames: Renames) -> Generation:
    """`Ingress.plan_chat` with the API's formatter and ids; its errors name the API's fields."""
    try:
        return ingress.plan_chat(chat, make_formatter, id_prefix)
    except APIError as err:
        raise renamed(err, renames) from None


async def respond(ingress, request: Request, generation: Generation, stream: bool) -> Response:
    """The whole answer as JSON, or its stream in the formatter's own events (the formatter is its writer)."""
    request.state.request_id = generation.request_id
    await ingress.check_grammar(generation)
    if stream:
        return await respond_stream(request, ingress.engine, ingress.encoder, generation, generation.formatter)
    whole = await respond_whole(request, ingress.engine, ingress.encoder, generation)
    return JSONResponse(whole.model_dump(mode="json"))


def named_event(payload: dict[str, Any]) -> str:
    """One server-sent event named after its data's `type` (both APIs name their events so)."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
