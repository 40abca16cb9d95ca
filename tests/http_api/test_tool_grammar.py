"""The tool-call grammars against the parsers, format by format: the text a grammar accepts (after the opening the
prompt holds) parses into calls whose arguments validate, markup or arguments off the schema are rejected, and with
tool_choice auto the text is free until the opening marker and constrained after it."""

from __future__ import annotations

import json

import jsonschema
import pytest
import xgrammar as xgr

from cluster.http_api.chat_requests import FunctionSpec, NamedFunction, NamedToolChoice
from cluster.http_api.tool_grammar import tool_grammar
from cluster.http_api.tool_parsers import DSML, tool_call_format
from cluster.http_api.tool_stream import ToolCallSetup
from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR
from model_workers.grammar.backend import TokenizerVocab, make_backend

WEATHER = FunctionSpec(name="get_weather", strict=True, parameters={
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}})
TIME = FunctionSpec(name="get_time", parameters={"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}})
FUNCTIONS = [WEATHER, TIME]
PARAM_TYPES = {f.name: f.param_types() for f in FUNCTIONS}


def arguments_text(parser: str, city: str, days: str) -> str:
    if parser.startswith("deepseek"):
        return (f'<{DSML}parameter name="city" string="true">{city}</{DSML}parameter>\n'
                f'<{DSML}parameter name="days" string="false">{days}</{DSML}parameter>\n')
    sep = "\n" if parser == "glm45" else ""
    return f"<arg_key>city</arg_key>{sep}<arg_value>{city}</arg_value>{sep}<arg_key>days</arg_key>{sep}" \
           f"<arg_value>{days}</arg_value>{sep}"


def one_call(parser: str, city: str = "Paris", days: str = "3") -> str:
    fmt = tool_call_format(parser)
    return f"{fmt.call_open('get_weather')}{arguments_text(parser, city, days)}{fmt.call_close}"


@pytest.fixture(scope="module")
def backend():
    vocab = TokenizerVocab.of_model_dir(PACKAGED_MODEL_DIR, 6144)
    return make_backend("xgrammar", vocab)


def accepts(backend, spec, text: str) -> bool:
    """The grammar takes `text` whole and may end there."""
    matcher = xgr.GrammarMatcher(backend.compile(spec).compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def parsed(parser: str, section: str) -> list[tuple[str, dict]]:
    calls = tool_call_format(parser).parse(section, PARAM_TYPES)
    return [(call.name, json.loads(call.arguments)) for call in calls]


@pytest.mark.parametrize("parser", ["deepseek_v32", "deepseek_v4", "glm45", "glm47"])
def test_forced_calls_parse_into_arguments_that_validate_and_off_schema_text_is_rejected(backend, parser):
    fmt = tool_call_format(parser)
    named = NamedToolChoice(type="function", function=NamedFunction(name="get_weather"))
    for choice, parallel in ((named, True), ("required", False), ("required", True)):
        setup = ToolCallSetup(fmt, PARAM_TYPES, fmt.forced_prefix(None if choice == "required" else "get_weather"),
                              parallel)
        spec = tool_grammar(setup, FUNCTIONS, choice, None)
        whole = (fmt.section_open if fmt.section_open else "") + one_call(parser) + fmt.section_close
        opening = ("\n\n" if fmt.section_open else "") + whole
        rest = opening[len(setup.forced_prefix):]  # what the model writes after the prompt's opening
        assert accepts(backend, spec, rest), (parser, choice)
        assert parsed(parser, setup.forced_prefix + rest) == [("get_weather", {"city": "Paris", "days": 3})]
        jsonschema.validate({"city": "Paris", "days": 3}, WEATHER.parameters)
        assert not accepts(backend, spec, rest.replace(">3<", ">12<"))  # days above its maximum
        assert not accepts(backend, spec, rest.replace("city", "town"))  # a parameter the schema does not name
    second = one_call(parser, "Rome", "2")
    parallel = ToolCallSetup(fmt, PARAM_TYPES, fmt.forced_prefix(None), True)
    two = (fmt.section_open + one_call(parser) + fmt.call_separator + second + fmt.section_close)
    rest = (("\n\n" if fmt.section_open else "") + two)[len(parallel.forced_prefix):]
    assert accepts(backend, tool_grammar(parallel, FUNCTIONS, "required", None), rest)
    single = ToolCallSetup(fmt, PARAM_TYPES, fmt.forced_prefix(None), False)
    assert not accepts(backend, tool_grammar(single, FUNCTIONS, "required", None), rest)  # parallel_tool_calls false


@pytest.mark.parametrize("parser", ["deepseek_v32", "glm47"])
def test_auto_leaves_text_free_until_the_opening_marker(backend, parser):
    fmt = tool_call_format(parser)
    setup = ToolCallSetup(fmt, PARAM_TYPES, "", True)
    spec = tool_grammar(setup, FUNCTIONS, "auto", None)
    section = (fmt.section_open + one_call(parser) + fmt.section_close) if fmt.section_open else one_call(parser)
    assert accepts(backend, spec, "Let me look that up, in {any} words.\n\n")
    assert accepts(backend, spec, "Checking.\n\n" + section)
    assert parsed(parser, section) == [("get_weather", {"city": "Paris", "days": 3})]
    assert not accepts(backend, spec, "Checking.\n\n" + section.replace(">3<", ">x<"))
