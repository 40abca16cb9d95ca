"""Reading a JSON request body defensively: content type, size limit, UTF-8, JSON (at most MAX_JSON_DEPTH levels
deep, no lone UTF-16 surrogate in any string), then the pydantic model.

Each step fails with its own 400 (413: too large, 408: the body stopped arriving) naming what is wrong, so no
malformed input reaches a route.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any, Awaitable, TypeVar, get_args

from fastapi import Request
from pydantic import BaseModel, ValidationError

from cluster.http_api.errors import APIError, bad_request, validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)
logger = logging.getLogger(__name__)
MAX_JSON_DEPTH = 100  # nested arrays / objects; deeper bodies would exhaust the recursion of validators and templates
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")  # how a lone surrogate can get into valid UTF-8 JSON
MAX_LOGGED_FIELDS, MAX_LOGGED_NAME = 20, 64  # of the unknown fields named in the log line
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # left after json.loads (it joins the valid pairs)


def _is_json_media_type(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(413, f"request body is {size} bytes or more; the limit is {max_bytes} bytes",
                    code="request_too_large")


def check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    if not _is_json_media_type(content_type):
        raise bad_request(f"Content-Type must be application/json (got {content_type or 'none'!r})",
                          code="invalid_content_type")


def _declared_length(request: Request) -> int | None:
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    if not declared.strip().isdigit():
        raise bad_request(f"Content-Length must be a non-negative integer (got {declared!r})")
    return int(declared)


async def _within(work: Awaitable[None], timeout_s: float | None) -> None:
    """`await work`, asyncio.TimeoutError after `timeout_s`; on Python 3.11+ without a task of its own (wait_for
    runs `work` as one, a loop turn more per request)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(timeout_s):
            await work
    else:
        await asyncio.wait_for(work, timeout_s)


async def read_limited_body(request: Request, max_bytes: int, timeout_s: float | None = None) -> bytes:
    """The raw body; 413 as soon as the declared or the received size passes `max_bytes`, 408 when it is not all
    in within `timeout_s` (a client that stops sending would otherwise hold its request slot forever)."""
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes:
        raise _too_large(declared, max_bytes)
    chunks = []

    async def receive_all() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)

    try:
        await _within(receive_all(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout_s:g} s ({sum(map(len, chunks))} bytes "
                            "received)", code="request_timeout") from None
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start}",
                          code="invalid_encoding") from None
    try:
        payload = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    check_structure(payload, strings=SURROGATE_ESCAPE.search(text) is not None)
    return payload


def _lone_surrogate(where: str, text: str) -> APIError:
    surrogate = LONE_SURROGATE.search(text).group()
    return bad_request(f"{where or 'request body'}: contains the lone UTF-16 surrogate \\u{ord(surrogate):04x}, which "
                       "is not text; send valid Unicode", param=where or None, code="invalid_encoding")


def check_structure(payload: Any, strings: bool) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH and (when `strings`) for a lone surrogate in a key or string.

    Iterative, so no depth of input can exhaust the recursion limit here."""
    pending = [(payload, 1, "")]
    while pending:
        value, depth, where = pending.pop()
        if isinstance(value, str) and LONE_SURROGATE.search(value):
            raise _lone_surrogate(where, value)
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            field = where.split(".", 1)[0]
            raise bad_request(f"{field}: nested deeper than {MAX_JSON_DEPTH} levels", param=field, code="invalid_json")
        for key, child in value.items() if isinstance(value, dict) else enumerate(value):
            if strings and isinstance(key, str) and LONE_SURROGATE.search(key):
                raise _lone_surrogate(where, key)
            if isinstance(child, (dict, list)) or (strings and isinstance(child, str)):
                pending.append((child, depth + 1, f"{where}.{key}" if where else str(key)))


def validate_body(payload: Any, model: type[ModelT]) -> ModelT:
    """The body as `model`; fields it does not know are dropped and named in one warning (vLLM's leniency)."""
    if not isinstance(payload, dict):
        raise bad_request(f"request body must be a JSON object (got {type(payload).__name__})")
    try:
        body = model.model_validate(payload)
    except ValidationError as exc:
        raise validation_error(exc.errors(), model.model_fields) from None
    ignored = unknown_fields(payload, model)
    if ignored:
        logger.warning("ignored unknown request fields: %s", _loggable(ignored))
    return body


def _loggable(names: list[str]) -> str:
    """Field names for one log line: control characters escaped, each name and their number bounded."""
    shown = [name if name.isprintable() else repr(name) for name in names[:MAX_LOGGED_FIELDS]]
    text = ", ".join(name if len(name) <= MAX_LOGGED_NAME else name[: MAX_LOGGED_NAME - 3] + "..." for name in shown)
    return text + (f" (and {len(names) - MAX_LOGGED_FIELDS} more)" if len(names) > MAX_LOGGED_FIELDS else "")


def unknown_fields(payload: Any, model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted names of the keys of `payload` (and of its nested objects) that `model` has no field for."""
    if not isinstance(payload, dict):
        return []
    names, fields = [], {field.alias or name: field for name, field in model.model_fields.items()}
    for key, value in payload.items():
        field = fields.get(key)
        if field is None:
            names.append(prefix + key)
            continue
        for nested in _models_in(field.annotation):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                where = f"{prefix}{key}[{i}]." if isinstance(value, list) else f"{prefix}{key}."
                names += unknown_fields(item, nested, where)
    return names


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation can hold (`X | None`, `list[X]`, `str | list[X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


async def read_json_body(request: Request, model: type[ModelT], max_bytes: int,
                         timeout_s: float | None = None) -> ModelT:
    check_content_type(request)
    return validate_body(decode_json(await read_limited_body(request, max_bytes, timeout_s)), model)
