"""The published OpenAPI document (GET /openapi.json): what the JSON-body routes read and answer.

The generation routes read their bodies by hand (body.py: size limit, UTF-8, JSON, then the pydantic model), so
FastAPI alone would publish them without a request body. `install_openapi` adds, per route, the request model's
JSON schema, the 200 answers (a JSON object, or server-sent events when `stream` is true) and the OpenAI error
body of every 4xx / 503 the route can give; the models' schemas go under components/schemas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from cluster.http_api.errors import APIError, ErrorBody
from cluster.http_api.openai_responses import SSE_DONE

REF_TEMPLATE = "#/components/schemas/{model}"
SSE_DONE_DATA = SSE_DONE.removeprefix("data: ").strip()  # "[DONE]", the data of the last event
ERROR_STATUSES = {400: "invalid request (the message names the field)", 401: "missing or wrong API key",
                  404: "unknown model or route", 408: "the request body stopped arriving",
                  413: "request body too large",
                  429: "too many requests in flight (Retry-After)", 503: "engine overloaded or draining (Retry-After)"}


@dataclass(frozen=True)
class JSONOperation:
    """A POST route that reads `request` as its JSON body and answers `response`, or with `"stream": true`
    server-sent events whose data is a `chunk`, an error body, or [DONE]; its errors carry `error`.
    `named_events`: each event has an `event:` line (its data's `type`), and the stream has no [DONE]."""

    request: type[BaseModel]
    response: type[BaseModel]
    chunk: type[BaseModel] | None = None
    error: type[BaseModel] = ErrorBody
    named_events: bool = False


def _takes_null(schema: dict[str, Any]) -> bool:
    if not set(schema) - {"title", "default", "description"}:
        return True  # any value
    return any(option.get("type") == "null" for option in schema.get("anyOf", ()))


def without_null(schema: dict[str, Any]) -> dict[str, Any]:
    """An `X | None` property's schema without its null option."""
    return {"anyOf": [option for option in schema["anyOf"] if option.get("type") != "null"]}


def optional_fields_take_null(schema: dict[str, Any]) -> None:
    """A model's `json_schema_extra` where an explicit null means "the default": optional properties take null."""
    required = set(schema.get("required", ()))
    properties = schema.get("properties", {})
    for name, prop in properties.items():
        if name not in required and not _takes_null(prop):
            kept = {key: prop.pop(key) for key in ("title", "default", "description") if key in prop}
            properties[name] = {"anyOf": [prop, {"type": "null"}], **kept}


def _schemas(operations: Mapping[str, JSONOperation]) -> tuple[dict, dict[str, Any]]:
    """(ref of each (model, mode), the components/schemas they need) for every model the operations name."""
    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = []
    for operation in operations.values():
        wanted += [(operation.request, "validation"), (operation.response, "serialization")]
        wanted += [(operation.error, "serialization")]
        wanted += [(operation.chunk, "serialization")] if operation.chunk is not None else []
    refs, top = models_json_schema(list(dict.fromkeys(wanted)), ref_template=REF_TEMPLATE)
    return refs, top.get("$defs", {})


def _error_response(status: int, error_ref: dict, error_model: type[BaseModel]) -> dict[str, Any]:
    err = APIError(status, "")
    kind = err.type if error_model is ErrorBody else err.anthropic_body()["error"]["type"]
    return {"description": f"{kind}: {ERROR_STATUSES[status]}", "content": {"application/json": {"schema": error_ref}}}


def _event_schema(chunk_ref: dict, error_ref: dict, named: bool) -> dict[str, Any]:
    """One server-sent event (the schema of a text/event-stream body describes each event before OpenAPI 3.2)."""
    json_data = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [chunk_ref, error_ref]}}
    if named:
        return {"type": "object", "required": ["event", "data"],
                "properties": {"event": {"type": "string"}, "data": {"type": "string", **json_data}}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"type": "string", "anyOf": [{"const": SSE_DONE_DATA}, json_data]}}}


def _operation_doc(operation: JSONOperation, refs: dict) -> dict[str, Any]:
    """The requestBody and responses of one operation."""
    error_ref = refs[(operation.error, "serialization")]
    success = {"application/json": {"schema": refs[(operation.response, "serialization")]}}
    if operation.chunk is not None:
        chunk_ref = refs[(operation.chunk, "serialization")]
        success["text/event-stream"] = {"schema": _event_schema(chunk_ref, error_ref, operation.named_events)}
    responses = {"200": {"description": "the answer (an event stream when `stream` is true)", "content": success}}
    responses.update({str(status): _error_response(status, error_ref, operation.error) for status in ERROR_STATUSES})
    request_schema = refs[(operation.request, "validation")]
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema}}},
            "responses": responses}


def install_openapi(app: FastAPI, operations: Mapping[str, JSONOperation]) -> Callable[[], dict[str, Any]]:
    """Replace `app.openapi` by FastAPI's document plus `operations`' bodies (built once, then cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            refs, definitions = _schemas(operations)
            document.setdefault("components", {}).setdefault("schemas", {}).update(definitions)
            for path, operation in operations.items():
                document["paths"][path]["post"].update(_operation_doc(operation, refs))
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
    return openapi
