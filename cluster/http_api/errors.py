"""OpenAI-style error bodies, and the handlers that make every error response carry one.

Body: `{"error": {"message", "type", "param", "code"}}`. Invalid fields are 400 (never FastAPI's 422) and
name the field in `param`; unknown routes 404, wrong methods 405, engine backpressure 503 with Retry-After,
client disconnects 499 (logged only: nobody reads it), and anything unexpected a 500 with the same body.
On the Anthropic Messages routes (ANTHROPIC_PATHS) the same errors, statuses and headers carry Anthropic's body
instead, `{"type": "error", "error": {"type", "message"}}` (`APIError.anthropic_body`).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Literal, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cp_router.protocol import EngineOverloadedError, EngineUnavailableError

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away before the answer"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               CLIENT_CLOSED_REQUEST: "client_closed_request", 503: "service_unavailable_error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error"}
MESSAGES_PATH, COUNT_TOKENS_PATH = "/v1/messages", "/v1/messages/count_tokens"  # Anthropic's (messages_api.py)
ANTHROPIC_PATHS = frozenset({MESSAGES_PATH, COUNT_TOKENS_PATH})  # their errors carry Anthropic's body
MAX_SHOWN_INPUT_CHARS = 80


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class APIError(Exception):
    """An error answered with an OpenAI error body; `param` names the offending request field."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    @property
    def metric_label(self) -> str:
        """The `error_type` label of dsa_serve:request_errors_total: the code when there is one."""
        return self.code or self.type

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error body: api_error for a 5xx it has no type for, invalid_request_error for a 4xx."""
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return AnthropicErrorBody(error=AnthropicErrorDetail(type=kind, message=self.message)).model_dump()


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str  # names the field, as the OpenAI body's message does


class AnthropicErrorBody(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def retry_later(status: int, message: str, retry_after_s: int, code: str) -> APIError:
    """Backpressure: 429 (this server's concurrency limit) or 503 (the engine's queue), with Retry-After."""
    return APIError(status, message, code=code, headers={"Retry-After": str(retry_after_s)})


def mark_error(scope: Scope, label: str) -> None:
    """Leave the error's metric label in the request state, for the access log and the error counter."""
    scope.setdefault("state", {})["error"] = label


def route_path(scope: Scope) -> str:
    """The path without the app's mount prefix (Ray Serve passes route_prefix as root_path)."""
    path, root_path = scope.get("path", ""), scope.get("root_path", "")
    if root_path and path.startswith(root_path + "/"):
        return path[len(root_path):]
    return path


def error_response(err: APIError, scope: Scope) -> JSONResponse:
    """The error's JSON answer: Anthropic's body on its routes, OpenAI's everywhere else."""
    mark_error(scope, err.metric_label)
    body = err.anthropic_body() if route_path(scope) in ANTHROPIC_PATHS else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def to_api_error(exc: Exception) -> APIError:
    """Any exception of a generation as the APIError answered for it (500 only for the unexpected)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return retry_later(503, f"the engine is overloaded: {exc}; retry later", exc.retry_after_s,
                           "engine_overloaded")
    if isinstance(exc, EngineUnavailableError):
        return retry_later(503, f"the engine is unavailable: {exc}", 1, "engine_unavailable")
    return APIError(500, f"internal server error ({type(exc).__name__}); see the server log")


def _shown_input(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_INPUT_CHARS else text[: MAX_SHOWN_INPUT_CHARS - 3] + "..."


def _field_path(loc: Iterable[Any]) -> str | None:
    parts = [str(part) for part in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or None


def _error_line(error: Mapping[str, Any], allowed_fields: Iterable[str]) -> str:
    field = _field_path(error["loc"]) or "request body"
    if error["type"] == "extra_forbidden":
        allowed = ", ".join(allowed_fields)
        return f"{field}: unknown field" + (f"; allowed fields: {allowed}" if allowed else "")
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "missing" or isinstance(error.get("input"), (dict, list)):
        return f"{field}: {message}"
    return f"{field}: {message} (got {_shown_input(error.get('input'))})"


def validation_error(errors: list[Mapping[str, Any]], allowed_fields: Iterable[str] = ()) -> APIError:
    """Pydantic/FastAPI validation errors as one 400: `param` is the first bad field, the message lists all."""
    allowed = list(allowed_fields)
    message = "; ".join(_error_line(error, allowed) for error in errors) or "invalid request"
    return bad_request(message, param=_field_path(errors[0]["loc"]) if errors else None)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.scope)


async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(list(exc.errors())), request.scope)


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        routes = ", ".join(sorted({getattr(route, "path", "") for route in request.app.routes} - {""}))
        message = f"no route {request.method} {request.url.path}; routes: {routes}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(APIError(exc.status_code, message, headers=exc.headers), request.scope)


async def _engine_overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
    return error_response(to_api_error(exc), request.scope)


async def _client_disconnect(request: Request, exc: ClientDisconnect) -> JSONResponse:
    err = APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection", code="client_disconnected")
    return error_response(err, request.scope)


def install_error_handlers(app: FastAPI) -> None:
    """Exception handlers for every error the routes raise, plus the catch-all middleware."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(EngineOverloadedError, _engine_overloaded)
    app.add_exception_handler(ClientDisconnect, _client_disconnect)
    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Turns any unhandled exception into a 500 with the error body (or, once streaming began, a log line)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the last line of defence: no bare 500 leaves this server
            await self._answer(exc, started, scope, receive, send)

    @staticmethod
    async def _answer(exc: Exception, started: bool, scope: Scope, receive: Receive, send: Send) -> None:
        # ASGI spec 2.4 servers raise OSError from `send` once the client is gone.
        if started and isinstance(exc, OSError):
            mark_error(scope, "client_disconnected")
            return
        logger.error("unhandled error on %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
        err = to_api_error(exc)
        if started:  # the status line is on the wire already: the client sees a truncated stream
            mark_error(scope, err.metric_label)
            return
        await error_response(err, scope)(scope, receive, send)
