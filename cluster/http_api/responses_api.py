"""`POST /v1/responses`, OpenAI's Responses API, served by planning each request as a chat completion.

The request (responses_requests.py) becomes a chat completion request: `instructions` and `input` the messages,
`max_output_tokens` max_completion_tokens, `text.format` response_format, the flat function tools chat's nested
ones, `reasoning.effort` thinking on ("none": off). It is planned by `Ingress.plan_chat` with the Responses
formatter (responses_format.py), so templates, tool and reasoning parsers, usage and the prefix cache are chat's.
Errors name the Responses fields. The route has chat's API key, concurrency limit, drain gate and access log.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from fastapi import FastAPI, Request, params
from fastapi.responses import Response

from cluster.http_api.chat_requests import ChatCompletionRequest
from cluster.http_api.chat_translation import Renames, chat_request, plan, respond
from cluster.http_api.generation import Generation
from cluster.http_api.openapi_schema import JSONOperation
from cluster.http_api.responses_format import ResponsesFormatter
from cluster.http_api.responses_models import ResponseObject, ResponseStreamEvent
from cluster.http_api.responses_requests import ResponsesRequest

RESPONSES_PATH = "/v1/responses"
RESPONSES_OPERATIONS = {RESPONSES_PATH: JSONOperation(ResponsesRequest, ResponseObject, ResponseStreamEvent,
                                                      named_events=True)}
RENAMES: Renames = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                    "messages": "input", "response_format": "text.format"}


def echoed_settings(body: ResponsesRequest, chat: ChatCompletionRequest) -> dict[str, Any]:
    """What every response object repeats of its request (sampling values as the request was planned)."""
    tool_choice = body.tool_choice.model_dump() if body.tool_choice is not None and not isinstance(
        body.tool_choice, str) else body.tool_choice or ("auto" if body.tools else "none")
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": chat.parallel_tool_calls, "temperature": chat.temperature, "top_p": chat.top_p,
            "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
            "text": {"format": body.text_format().model_dump(by_alias=True, exclude_none=True)},
            "tool_choice": tool_choice, "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "metadata": body.metadata or {}, "user": body.user}


def plan_response(ingress, body: ResponsesRequest) -> Generation:
    """The request planned as a chat completion, with the Responses formatter (request ids resp_...)."""
    chat = ingress.with_sampling_defaults(chat_request(body.chat_fields(), RENAMES))
    formatter = partial(ResponsesFormatter, echo=echoed_settings(body, chat), count_tokens=ingress.encoder.token_count)
    return plan(ingress, chat, formatter, "resp_", RENAMES)


def add_responses_routes(app: FastAPI, ingress, authorized: list[params.Depends]) -> None:
    @app.post(RESPONSES_PATH, dependencies=authorized)
    async def responses(request: Request) -> Response:
        body = await ingress.read_body(request, ResponsesRequest)
        if body.user is not None:
            request.state.user = repr(body.user)
        return await respond(ingress, request, plan_response(ingress, body), bool(body.stream))
