"""`--tool-call-parser`: each family's tool-call markup in a chat completion, parsed into OpenAI tool calls.

DeepSeek-V3.2 (`deepseek_v32`, SGLang's `deepseekv32`) writes DSML; DeepSeek-V4 (`deepseek_v4`) the same inside a
`tool_calls` block instead of `function_calls`:

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

string="true" values are taken as written, the others are JSON. GLM-4.5 / 4.6 (`glm45`) and GLM-4.7 / GLM-5
(`glm47`) write one block per call, the latter without the newlines:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

GLM values are strings; a parameter whose JSON schema type is not "string" is read as JSON when it parses.
Every format also gives the opening a forced call starts with (tool_choice "required" or a named function).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

DSML = "｜DSML｜"
TOOL_CALL_PARSERS = ("deepseek_v32", "deepseekv32", "deepseek_v4", "glm45", "glm47")


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends `function.arguments`


ParamTypes = dict[str, dict[str, Any]]  # tool name -> parameter name -> its JSON schema type ("string", ...)


class ToolCallFormat(Protocol):
    start: str  # where the tool-call part of an output begins
    call_end: str  # what closes one complete call

    def parse(self, section: str, param_types: ParamTypes) -> list[ParsedCall]:
        """The complete calls in `section` (text from `start` on), in order; incomplete ones are left out."""

    def forced_prefix(self, name: str | None) -> str:
        """The text that opens a call (of function `name`, or of any function when None)."""

    # For grammar-constrained calls (tool_grammar.py): the arguments' XML style in xgrammar's structural tags, what
    # opens and closes one call of `name` (after `section_open`), and the section around the calls ("" if none).
    xml_style: str
    section_open: str
    section_close: str
    call_separator: str
    call_close: str

    def call_open(self, name: str) -> str:
        """The markup before one call's arguments."""


def _json_arguments(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value


class DSMLFormat:
    """DeepSeek's DSML (`block`: "function_calls" for V3.2, "tool_calls" for V4)."""

    xml_style, call_separator = "deepseek_xml", ""

    def __init__(self, block: str):
        self.start, self.end, self.call_end = f"<{DSML}{block}>", f"</{DSML}{block}>", f"</{DSML}invoke>"
        self.section_open, self.section_close = f"{self.start}\n", self.end
        dsml = re.escape(DSML)
        self.invoke = re.compile(rf'<{dsml}invoke\s+name="([^"]*)"\s*>(.*?)</{dsml}invoke>', re.DOTALL)
        self.parameter = re.compile(rf'<{dsml}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)'
                                    rf'</{dsml}parameter>', re.DOTALL)

    def parse(self, section: str, param_types: ParamTypes) -> list[ParsedCall]:
        body = section.split(self.end, 1)[0]
        calls = []
        for name, invoke_body in self.invoke.findall(body):
            arguments = {key: value if is_string != "false" else _json_or_text(value.strip())
                         for key, is_string, value in self.parameter.findall(invoke_body)}
            calls.append(ParsedCall(name, _json_arguments(arguments)))
        return calls

    def forced_prefix(self, name: str | None) -> str:
        opening = f"\n\n{self.section_open}"
        return opening if name is None else f"{opening}{self.call_open(name)}"

    def call_open(self, name: str) -> str:
        return f'<{DSML}invoke name="{name}">\n'

    @property
    def call_close(self) -> str:
        return f"{self.call_end}\n"


class GLMFormat:
    """GLM's `<tool_call>` blocks (`newlines`: GLM-4.5's layout, a newline after the name and each tag)."""

    start = "<tool_call>"
    call_end = "</tool_call>"
    call = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    argument = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    xml_style, section_open, section_close, call_close = "glm_xml", "", "", "</tool_call>"

    def __init__(self, newlines: bool):
        self.newlines = newlines
        self.call_separator = "\n" if newlines else ""

    def parse(self, section: str, param_types: ParamTypes) -> list[ParsedCall]:
        calls = []
        for body in self.call.findall(section):
            name = body.split("<arg_key>", 1)[0].strip()
            types = param_types.get(name, {})
            arguments = {key.strip(): self._value(value, types.get(key.strip())) for key, value in
                         self.argument.findall(body)}
            calls.append(ParsedCall(name, _json_arguments(arguments)))
        return calls

    @staticmethod
    def _value(text: str, schema_type: Any) -> Any:
        """The whitespace around a value is layout (a constrained call may have some), not part of it."""
        types = schema_type if isinstance(schema_type, list) else [schema_type]
        if None in types or "string" in types:
            return text.strip()
        return _json_or_text(text.strip())

    def forced_prefix(self, name: str | None) -> str:
        return self.start if name is None else self.call_open(name)

    def call_open(self, name: str) -> str:
        return f"{self.start}{name}\n" if self.newlines else f"{self.start}{name}"


def tool_call_format(parser: str) -> ToolCallFormat:
    """The format of a `--tool-call-parser` name (one of TOOL_CALL_PARSERS)."""
    if parser in ("deepseek_v32", "deepseekv32"):
        return DSMLFormat("function_calls")
    if parser == "deepseek_v4":
        return DSMLFormat("tool_calls")
    if parser in ("glm45", "glm47"):
        return GLMFormat(newlines=parser == "glm45")
    raise ValueError(f"tool_call_parser: unknown parser {parser!r}; allowed: {', '.join(TOOL_CALL_PARSERS)}")
