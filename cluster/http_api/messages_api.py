"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, served by planning each
request as a chat completion.

The request (messages_requests.py) becomes a chat completion request: `system` and `messages` the messages,
`stop_sequences` stop strings, tools chat's function tools, `thinking` the template's thinking switch. It is planned
by `Ingress.plan_chat` with the Messages formatter (messages_format.py), so templates, tool and reasoning parsers,
usage and the prefix cache are chat's. count_tokens answers {"input_tokens": N}, the prompt the same body would
make (its tools and a forced call's opening included). Errors carry Anthropic's body on these routes
(errors.ANTHROPIC_PATHS) and name Anthropic's fields; `x-api-key` is accepted as the API key, and
`anthropic-version` (or any other header) is not needed. /v1/messages has chat's concurrency limit, drain gate and
access log.
"""

from __future__ import annotations

from functools import partial

from fastapi import FastAPI, Request, params
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from cluster.http_api.chat_translation import Renames, chat_request, plan, renamed, respond
from cluster.http_api.errors import COUNT_TOKENS_PATH, MESSAGES_PATH, AnthropicErrorBody, APIError
from cluster.http_api.generation import Generation
from cluster.http_api.messages_format import MessageObject, MessagesFormatter, MessagesStreamEvent
from cluster.http_api.messages_requests import CountTokensRequest, MessagesRequest
from cluster.http_api.openapi_schema import JSONOperation

RENAMES: Renames = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
                    "response_format": "output_config.format"}


class TokenCount(BaseModel):
    input_tokens: int  # the whole prompt, cached or not


MESSAGES_OPERATIONS = {
    MESSAGES_PATH: JSONOperation(MessagesRequest, MessageObject, MessagesStreamEvent, error=AnthropicErrorBody,
                                 named_events=True),
    COUNT_TOKENS_PATH: JSONOperation(CountTokensRequest, TokenCount, error=AnthropicErrorBody)}


def plan_message(ingress, body: MessagesRequest) -> Generation:
    """The request planned as a chat completion, with the Messages formatter (request ids msg_...)."""
    chat = ingress.with_sampling_defaults(chat_request(body.chat_fields(), RENAMES))
    formatter = partial(MessagesFormatter, stops=tuple(body.stop_sequences))
    return plan(ingress, chat, formatter, "msg_", RENAMES)


def count_tokens(ingress, body: CountTokensRequest) -> TokenCount:
    """The prompt's tokens, as /v1/messages would plan it (its tools and a forced call's opening included)."""
    try:
        _, prompt, _ = ingress.chat_prompt(chat_request(body.chat_fields(), RENAMES))
    except APIError as err:
        raise renamed(err, RENAMES) from None
    return TokenCount(input_tokens=len(prompt.token_ids))


def add_messages_routes(app: FastAPI, ingress, authorized: list[params.Depends]) -> None:
    @app.post(MESSAGES_PATH, dependencies=authorized)
    async def messages(request: Request) -> Response:
        body = await ingress.read_body(request, MessagesRequest)
        return await respond(ingress, request, plan_message(ingress, body), bool(body.stream))

    @app.post(COUNT_TOKENS_PATH, dependencies=authorized)
    async def messages_count_tokens(request: Request) -> JSONResponse:
        body = await ingress.read_body(request, CountTokensRequest)
        return JSONResponse(count_tokens(ingress, body).model_dump())
