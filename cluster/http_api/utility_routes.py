"""The routes vLLM users script against besides generation: one model card, tokenize / detokenize, version.

GET /v1/models/{id} (404 model_not_found for a name not served), POST /tokenize (a prompt, or chat messages
through the chat template) -> {"count", "max_model_len", "tokens"}, POST /detokenize {"tokens"} -> {"prompt"},
GET /version. `RequestIdMiddleware` keeps a client's X-Request-Id (logged, echoed) or returns the server's.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import FastAPI, Request, params
from fastapi.responses import JSONResponse
from pydantic import Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http_api.body import read_json_body
from cluster.http_api.chat_requests import ChatMessage, ToolSpec, tools_json
from cluster.http_api.errors import APIError, bad_request
from cluster.http_api.openai_requests import PromptInput, RequestModel
from cluster.http_api.openai_responses import server_version

REQUEST_ID_HEADER = "x-request-id"


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: PromptInput | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[ToolSpec] | None = None  # rendered into the chat prompt, as in a chat completion
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


def add_utility_routes(app: FastAPI, ingress, authorized: list[params.Depends]) -> None:
    @app.get("/v1/models/{model_id:path}", dependencies=authorized)
    async def model_card(model_id: str) -> JSONResponse:
        ingress.check_model(model_id)
        card = next(card for card in ingress.model_list().data if card.id == model_id)
        return JSONResponse(card.model_dump(mode="json"))

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(request: Request) -> JSONResponse:
        body = await read_json_body(request, TokenizeRequest, ingress.settings.max_body_bytes,
                                    ingress.settings.body_timeout_s)
        ingress.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            token_ids = ingress.encoder.encode_chat(body.messages, ingress.limits, body.chat_template_kwargs,
                                                    tools_json(body.tools)).token_ids
        elif isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
            raise bad_request("prompt: /tokenize takes one prompt (a string or token ids)", param="prompt")
        else:
            token_ids = ingress.encoder.encode(body.prompt, ingress.limits).token_ids
        return JSONResponse({"count": len(token_ids), "max_model_len": ingress.info.max_model_len,
                             "tokens": list(token_ids)})

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(request: Request) -> JSONResponse:
        body = await read_json_body(request, DetokenizeRequest, ingress.settings.max_body_bytes,
                                    ingress.settings.body_timeout_s)
        ingress.check_model(body.model)
        ingress.limits.check_token_ids(body.tokens, "tokens")
        return JSONResponse({"prompt": ingress.encoder.decode(body.tokens)})

    async def flush(reply: str) -> JSONResponse:
        try:
            pages = await ingress.engine.flush_cache()
        except Exception as exc:  # noqa: BLE001 - an engine replica did not answer: say which, as a 503
            raise APIError(503, f"the prefix cache was not flushed everywhere: {exc}", code="engine_unavailable",
                           headers={"Retry-After": "1"}) from None
        return JSONResponse({"message": reply, "flushed_pages": pages})

    @app.post("/flush_cache", dependencies=authorized)  # SGLang's route
    async def flush_cache() -> JSONResponse:
        return await flush("Cache flushed.")

    @app.post("/reset_prefix_cache", dependencies=authorized)  # vLLM's route
    async def reset_prefix_cache() -> JSONResponse:
        return await flush("Prefix cache reset.")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": server_version()})


class RequestIdMiddleware:
    """Every response carries X-Request-Id: the client's own (kept, and logged as `client_request_id`), else the
    server's request id (a generation's cmpl-... / chatcmpl-...) or a fresh one."""

    def __init__(self, app: ASGIApp, add_header: bool = True):
        """`add_header=False` where a proxy in front sets the header itself (Ray Serve's does): only logged."""
        self.app, self.add_header = app, add_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode())
        if incoming is not None:
            scope.setdefault("state", {})["client_request_id"] = incoming.decode("latin-1")
        if not self.add_header:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state = scope.get("state", {})
                value = incoming.decode("latin-1") if incoming is not None else \
                    state.get("request_id") or f"req-{uuid.uuid4().hex}"
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": headers + [(REQUEST_ID_HEADER.encode(), value.encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_id)
