"""ASGI middleware of the ingress: one access log line per request, bounded concurrency and the drain gate,
API key check."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from fastapi import Depends, Request, params
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.http_api.errors import APIError, error_response, retry_later, route_path
from cp_router.metrics import ServeMetrics

access_logger = logging.getLogger("dsa_serve.access")
LOGGED_STATE_FIELDS = ("request_id", "client_request_id", "prompt_tokens", "completion_tokens", "finish", "error",
                       "user")


class AccessLogMiddleware:
    """Logs one INFO line per HTTP request when its response is complete; counts its error, if any."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 0

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, status_send)
        finally:
            self._log(scope, status, time.monotonic() - start)

    def _log(self, scope: Scope, status: int, seconds: float) -> None:
        state = scope.get("state", {})
        if state.get("error"):
            self.metrics.count_error(state["error"])
        client = scope.get("client") or ("-", 0)
        fields = " ".join(f"{name}={state[name]}" for name in LOGGED_STATE_FIELDS if state.get(name) is not None)
        access_logger.info("%s %s %s %d %.1fms %s", client[0], scope.get("method"), scope.get("path"), status,
                           seconds * 1000, fields)


class Admission:
    """Generation requests in flight (streams count until their last byte) and whether new ones are admitted.

    `drain` closes the gate for good: new generation requests get 503 + Retry-After (`draining_error`) and /health
    503, so load balancers and clients go elsewhere, while the requests in flight run to their end."""

    def __init__(self, retry_after_s: int):
        self.retry_after_s, self.in_flight, self.draining = retry_after_s, 0, False

    def draining_error(self) -> APIError:
        return retry_later(503, "the server is draining (shutting down or being replaced): requests in flight "
                                f"finish, new ones are refused; retry after {self.retry_after_s} s",
                           self.retry_after_s, "server_draining")

    def check_open(self) -> None:
        """Raises the 503 `draining_error` once draining started."""
        if self.draining:
            raise self.draining_error()

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Stops admitting, then waits up to `timeout_s` for the requests in flight; returns how many are left."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
        return self.in_flight


class ConcurrencyLimitMiddleware:
    """At most `limit` requests to `paths` in flight (counted in `admission`); beyond: 429; draining: 503."""

    def __init__(self, app: ASGIApp, paths: frozenset[str], limit: int, retry_after_s: int, admission: Admission):
        self.app, self.paths, self.limit, self.retry_after_s = app, paths, limit, retry_after_s
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        admission = self.admission
        if admission.draining:
            await error_response(admission.draining_error(), scope)(scope, receive, send)
            return
        if admission.in_flight >= self.limit:
            err = retry_later(429, f"too many requests in flight (limit {self.limit}); retry after "
                                   f"{self.retry_after_s} s", self.retry_after_s, "rate_limit_exceeded")
            await error_response(err, scope)(scope, receive, send)
            return
        admission.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            admission.in_flight -= 1


def api_key_dependencies(expected: str | None) -> list[params.Depends]:
    """The routes' FastAPI dependencies: a 401 unless `Authorization: Bearer <expected>` or (Anthropic's header)
    `x-api-key: <expected>`; none without a key (a no-op dependency still costs FastAPI's dependency solving on
    every request).

    The check is a coroutine function, so FastAPI calls it on the event loop: a plain `def` dependency runs in its
    thread pool, a thread hop that cost about 1 ms of every request's latency (measured on the 2-core bench VM)."""
    if expected is None:
        return []
    expected_bytes = expected.encode("utf-8")

    async def require_api_key(request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        challenge = {"WWW-Authenticate": "Bearer"}
        if scheme.lower() != "bearer" or not token.strip():
            token = request.headers.get("x-api-key", "")
        if not token.strip():
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>' (or 'x-api-key: "
                                "<key>')", code="invalid_api_key", headers=challenge)
        if not hmac.compare_digest(token.strip().encode("utf-8"), expected_bytes):
            raise APIError(401, "incorrect API key", code="invalid_api_key", headers=challenge)

    return [Depends(require_api_key)]
