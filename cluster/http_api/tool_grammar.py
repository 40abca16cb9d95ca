"""Tool calls under a grammar: the structural tag (xgrammar's JSON format) that makes a call's whole markup, in the
active --tool-call-parser's format, and its arguments follow the tool's `parameters` schema, so parsed arguments
always validate.

- tool_choice "required" / a named function: the call's opening is written into the prompt (tool_stream.py); the
  grammar covers the rest: the arguments, the closing markup, more calls when parallel_tool_calls allows them
  ("required"), and the end of the section;
- "auto": the text is free until the format's opening marker; from there the section and every call in it are
  constrained (a trigger);
- "auto" with a response_format as well: the answer is either the constrained response or the tool-call section.
A function with `strict: true` takes no properties its schema does not name (OpenAI's strict mode).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from tokenizers import Tokenizer

from cluster.http_api.chat_requests import ChatCompletionRequest, FunctionSpec, ToolChoice
from cluster.http_api.errors import bad_request
from cluster.http_api.reasoning import THINK_END
from cluster.http_api.tool_parsers import ToolCallFormat
from cluster.http_api.tool_stream import ToolCallSetup
from cp_router.grammar_spec import GrammarSpec
from model_workers.checkpoint.tokenizer import encode

Format = dict[str, Any]  # one xgrammar structural-tag format, as JSON
# whitespace in a row the arguments' markup may hold (the formats put one newline between parameters); unbounded, a
# model can fill a call with newlines until max_tokens
ARGUMENT_WHITESPACE = 4


def chat_grammar(body: ChatCompletionRequest, tools: ToolCallSetup | None, thinking: bool,
                 tokenizer: Tokenizer | None) -> GrammarSpec | None:
    """A chat answer's constraint: its response format, its tool calls, or both (`auto`); with `thinking` (a
    reasoning parser, and the prompt left the model inside a think block) it starts after the block's end."""
    response = body.grammar_spec()
    choice = body.effective_tool_choice
    if tools is not None and choice != "auto" and response is not None:
        raise bad_request(f"{response.label}: tool_choice {choice if isinstance(choice, str) else 'naming a function'} "
                          "forces a tool call, so the answer cannot follow a response format as well",
                          param=response.label)
    spec = response if tools is None else tool_grammar(tools, [t.function for t in body.tools], choice, response)
    if spec is None or not thinking or tokenizer is None:
        return spec
    return dataclasses.replace(spec, after_ids=tuple(encode(tokenizer, THINK_END)))


def tool_grammar(setup: ToolCallSetup, functions: list[FunctionSpec], choice: ToolChoice,
                 response: GrammarSpec | None) -> GrammarSpec:
    """The constraint of a chat answer with tools (`choice` is not "none")."""
    fmt = setup.format
    if choice == "auto":
        calls = triggered_calls(fmt, functions, setup.parallel)
        root = calls if response is None else {"type": "or", "elements": [response_format(response),
                                                                           {**calls, "at_least_one": True}]}
    elif choice == "required":
        root = required_rest(fmt, functions, setup.parallel)
    else:
        (function,) = [f for f in functions if f.name == choice.function.name]
        root = sequence([arguments(fmt, function), const(fmt.call_close + fmt.section_close)])
    label = "tools" if response is None or choice != "auto" else f"tools and {response.label}"
    return GrammarSpec("structural_tag", json.dumps({"type": "structural_tag", "format": root}), label=label)


def arguments(fmt: ToolCallFormat, function: FunctionSpec) -> Format:
    schema = function.parameters or {"type": "object", "properties": {}}
    return {"type": "json_schema", "json_schema": closed(schema) if function.strict else schema,
            "style": fmt.xml_style, "max_whitespace_cnt": ARGUMENT_WHITESPACE}


def call(fmt: ToolCallFormat, function: FunctionSpec) -> Format:
    return {"type": "tag", "begin": fmt.call_open(function.name), "content": arguments(fmt, function),
            "end": fmt.call_close}


def calls(fmt: ToolCallFormat, functions: list[FunctionSpec], parallel: bool) -> Format:
    return {"type": "tags_with_separator", "tags": [call(fmt, f) for f in functions], "separator": fmt.call_separator,
            "at_least_one": True, "stop_after_first": not parallel}


def triggered_calls(fmt: ToolCallFormat, functions: list[FunctionSpec], parallel: bool) -> Format:
    """Free text; from the format's opening marker on, the tool-call section."""
    if fmt.section_open:
        tags = [{"type": "tag", "begin": fmt.section_open, "content": calls(fmt, functions, parallel),
                 "end": fmt.section_close}]
    else:
        tags = [call(fmt, f) for f in functions]
    return {"type": "triggered_tags", "triggers": [fmt.start], "tags": tags, "stop_after_first": not parallel}


def required_rest(fmt: ToolCallFormat, functions: list[FunctionSpec], parallel: bool) -> Format:
    """After the forced opening of any call: the rest of one call's opening (its name), its arguments and closing,
    then (parallel) more whole calls, then the section's end."""
    written = fmt.forced_prefix(None)
    first = {"type": "or", "elements": [sequence([const(fmt.forced_prefix(f.name)[len(written):]), arguments(fmt, f),
                                                  const(fmt.call_close)]) for f in functions]}
    more = [{"type": "optional", "content": sequence([const(fmt.call_separator), calls(fmt, functions, True)])}]
    return sequence([first, *(more if parallel else []), const(fmt.section_close)])


def response_format(spec: GrammarSpec) -> Format:
    """A response constraint as one structural-tag format (beside the tool calls it may stand for)."""
    if spec.kind in ("json_schema", "json_object"):
        return {"type": "json_schema", "json_schema": json.loads(spec.source) if spec.source else {"type": "object"}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.source}
    if spec.kind == "ebnf":
        return {"type": "grammar", "grammar": spec.source}
    if spec.kind == "choice":
        return {"type": "or", "elements": [const(choice) for choice in json.loads(spec.source)]}
    tag = json.loads(spec.source)
    if "format" not in tag:
        raise bad_request(f"{spec.label}: beside tools, a structural tag needs the \"format\" form", param=spec.label)
    return tag["format"]


def closed(schema: Any) -> Any:
    """`schema` with every object that does not say otherwise closed to unnamed properties."""
    if isinstance(schema, list):
        return [closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def const(value: str) -> Format | None:
    return {"type": "const_string", "value": value} if value else None


def sequence(elements: list[Format | None]) -> Format:
    kept = [element for element in elements if element is not None]
    return kept[0] if len(kept) == 1 else {"type": "sequence", "elements": kept}
