"""Structured-output fields of completions and chat requests, as the peers spell them, turned into one
`GrammarSpec` (docs/structured_outputs.md).

- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}};
  also {"type": "structural_tag", ...} (vLLM's);
- vLLM: `structured_outputs` {json, regex, choice, grammar, json_object, structural_tag} and the older
  `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (`guided_decoding_backend` "xgrammar" or "auto");
- SGLang: `regex`, `ebnf`.
A request sets at most one; the ingress compiles it before the request is queued (grammar_check.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from cluster.http_api.errors import bad_request
from cluster.http_api.request_model import RequestModel
from cp_router.grammar_spec import GrammarSpec

GUIDED_BACKENDS = ("xgrammar", "auto")


class JSONSchemaFormat(RequestModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")  # absent: any JSON value
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    format: dict[str, Any] | None = None  # structural_tag: xgrammar's structural tag format
    structures: list[dict[str, Any]] | None = None  # structural_tag, the first format: begin / schema / end
    triggers: list[str] | None = None

    @field_validator("json_schema")
    @classmethod
    def _json_schema_needs_its_type(cls, value, info):
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError('is only read with "type": "json_schema"')
        return value


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs` (its `guided_*` fields grouped)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class ConstraintFields(RequestModel):
    """The fields a request may constrain its output with (mixed into the completions and chat requests)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    regex: str | None = None  # SGLang's
    ebnf: str | None = None  # SGLang's

    @field_validator("guided_decoding_backend")
    @classmethod
    def _known_backend(cls, value: str | None) -> str | None:
        if value is not None and value not in GUIDED_BACKENDS:
            raise ValueError(f"must be one of {', '.join(GUIDED_BACKENDS)} (this server constrains with xgrammar), "
                             f"got {value!r}")
        return value

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's one constraint (None: unconstrained); a 400 naming the fields when it sets several."""
        found = [spec for spec in self._constraints() if spec is not None]
        if len(found) > 1:
            fields = ", ".join(spec.label for spec in found)
            raise bad_request(f"structured outputs: a request may set one constraint, got {len(found)} ({fields})",
                              param=found[1].label)
        return found[0] if found else None

    def _constraints(self) -> list[GrammarSpec | None]:
        out = self.structured_outputs
        return [
            response_format_spec(self.response_format),
            _schema_spec(self.guided_json, "guided_json"),
            _spec("regex", self.guided_regex, "guided_regex"),
            _spec("choice", _choices(self.guided_choice), "guided_choice"),
            _spec("ebnf", self.guided_grammar, "guided_grammar"),
            _spec("regex", self.regex, "regex"),
            _spec("ebnf", self.ebnf, "ebnf"),
            *([] if out is None else [
                _schema_spec(out.json_, "structured_outputs.json"),
                _spec("regex", out.regex, "structured_outputs.regex"),
                _spec("choice", _choices(out.choice), "structured_outputs.choice"),
                _spec("ebnf", out.grammar, "structured_outputs.grammar"),
                GrammarSpec("json_object", label="structured_outputs.json_object") if out.json_object else None,
                _tag_spec(out.structural_tag, "structured_outputs.structural_tag"),
            ]),
        ]


def response_format_spec(response_format: ResponseFormat | None) -> GrammarSpec | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec("json_object", label="response_format")
    if response_format.type == "json_schema":
        schema = response_format.json_schema
        if schema is None:
            raise bad_request('response_format.json_schema: "type": "json_schema" needs a "json_schema" object '
                              '({"name": ..., "schema": {...}, "strict": true})', param="response_format.json_schema")
        source = json.dumps({} if schema.schema_ is None else schema.schema_)
        return GrammarSpec("json_schema", source, strict=bool(schema.strict), label="response_format.json_schema")
    tag = response_format.model_dump(exclude_none=True, exclude={"json_schema"})
    if "format" not in tag and "structures" not in tag:
        raise bad_request('response_format: "type": "structural_tag" needs "format" (or "structures" and '
                          '"triggers")', param="response_format")
    return GrammarSpec("structural_tag", json.dumps(tag), label="response_format")


def _spec(kind: str, source: str | None, label: str) -> GrammarSpec | None:
    if source is None:
        return None
    if not source.strip() and kind != "choice":
        raise bad_request(f"{label}: must not be empty", param=label)
    return GrammarSpec(kind, source, label=label)


def _schema_spec(schema: dict[str, Any] | str | None, label: str) -> GrammarSpec | None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{label}: not valid JSON: {exc}", param=label) from None
    return None if schema is None else GrammarSpec("json_schema", json.dumps(schema), label=label)


def _choices(choices: list[str] | None) -> str | None:
    return None if choices is None else json.dumps(choices)


def _tag_spec(tag: str | dict[str, Any] | None, label: str) -> GrammarSpec | None:
    if tag is None:
        return None
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as exc:
            raise bad_request(f"{label}: not valid JSON: {exc}", param=label) from None
    return GrammarSpec("structural_tag", json.dumps(tag), label=label)
