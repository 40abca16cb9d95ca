"""Tool calls: each family's markup parsed (DeepSeek DSML, GLM-4.5 and GLM-4.7/5), streamed in pieces cut
anywhere, DeepSeek-V3.2's encoding of tools, calls and results, and a Jinja template (GLM's) given them."""

from __future__ import annotations

import json

import pytest

from cluster.http_api.chat_requests import ChatCompletionRequest
from cluster.http_api.chat_template import ChatTemplate
from cluster.http_api.deepseek_encoding import DeepSeekV32Encoding
from cluster.http_api.errors import APIError
from cluster.http_api.tool_parsers import DSML, tool_call_format
from cluster.http_api.tool_stream import ToolCallSetup, ToolCallStream
from model_workers.checkpoint.tokenizer import ChatTemplateSource
from support.http_fakes import GLM_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
DSML_CALLS = (f'Let me check.\n\n<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n'
              f'<{DSML}parameter name="city" string="true">São Paulo</{DSML}parameter>\n'
              f'<{DSML}parameter name="days" string="false">3</{DSML}parameter>\n</{DSML}invoke>\n'
              f'<{DSML}invoke name="get_time">\n<{DSML}parameter name="zone" string="false">{{"utc": true}}'
              f'</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}function_calls>')
GLM47_CALL = "Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>" \
             "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
GLM45_CALL = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>days</arg_key>\n" \
             "<arg_value>2</arg_value>\n</tool_call>"
TYPES = {"get_weather": {"city": "string", "days": "integer"}}


def calls_of(stream_pieces: list[tuple[str, list]]) -> tuple[str, list[tuple[str, dict]]]:
    content = "".join(piece for piece, _ in stream_pieces)
    return content, [(c.call.name, json.loads(c.call.arguments)) for _, calls in stream_pieces for c in calls]


def run_stream(parser: str, text: str, cuts: list[int], forced: str = "", parallel: bool = True):
    stream = ToolCallStream(ToolCallSetup(tool_call_format(parser), TYPES, forced, parallel))
    bounds = [0, *cuts, len(text)]
    return calls_of([stream.feed(text[a:b], final=b == len(text)) for a, b in zip(bounds, bounds[1:])])


@pytest.mark.parametrize("parser, text, expected", [
    ("deepseek_v32", DSML_CALLS, ("Let me check.", [("get_weather", {"city": "São Paulo", "days": 3}),
                                                     ("get_time", {"zone": {"utc": True}})])),
    ("glm47", GLM47_CALL, ("Checking.", [("get_weather", {"city": "Paris", "days": 2})])),
    ("glm45", GLM45_CALL, ("", [("get_weather", {"city": "42", "days": 2})])),  # the schema says city is a string
    ("deepseek_v4", DSML_CALLS.replace("function_calls>", "tool_calls>"),
     ("Let me check.", [("get_weather", {"city": "São Paulo", "days": 3}), ("get_time", {"zone": {"utc": True}})])),
])
def test_every_family_parses_the_same_wherever_the_stream_is_cut(parser, text, expected):
    assert run_stream(parser, text, []) == expected
    for cut in range(1, len(text)):
        assert run_stream(parser, text, [cut]) == expected, cut
    assert run_stream(parser, text, list(range(1, len(text)))) == expected  # one character at a time


def test_markup_that_never_becomes_a_call_is_content_and_parallel_false_keeps_one_call():
    broken = "See <tool_call>get_weather<arg_key>city</arg_key>"  # cut off by max_tokens
    assert run_stream("glm47", broken, [7]) == (broken, [])
    assert run_stream("deepseek_v32", "no tools here <｜DS", [5]) == ("no tools here <｜DS", [])
    assert run_stream("deepseek_v32", DSML_CALLS, [], parallel=False)[1] == [("get_weather", {"city": "São Paulo",
                                                                                              "days": 3})]


def test_a_forced_call_parses_the_models_continuation_of_its_opening():
    dsml = tool_call_format("deepseek_v32")
    forced = dsml.forced_prefix("get_weather")
    assert forced == f'\n\n<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n'
    continuation = f'<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n</{DSML}invoke>\n' \
                   f'</{DSML}function_calls>'
    assert run_stream("deepseek_v32", continuation, [9], forced=forced) == ("", [("get_weather", {"city": "Oslo"})])
    assert tool_call_format("glm45").forced_prefix("f") == "<tool_call>f\n"
    assert tool_call_format("glm47").forced_prefix(None) == "<tool_call>"


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "rain"},
]


def rendered(thinking: bool, messages=CONVERSATION, tools=(WEATHER,)) -> str:
    body = ChatCompletionRequest.model_validate({"messages": messages, "tools": list(tools) or None})
    return DeepSeekV32Encoding().render([m.for_template() for m in body.messages], tools=list(tools) or None,
                                        thinking=thinking)


def test_deepseek_v32_encodes_tools_calls_and_results_in_its_format():
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    calls = (f'\n\n<{DSML}function_calls>\n<{DSML}invoke name="get_weather">\n'
             f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n</{DSML}invoke>\n'
             f'<{DSML}invoke name="get_weather">\n<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n'
             f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n</{DSML}invoke>\n'
             f'</{DSML}function_calls>')
    text = rendered(thinking=False)
    assert text.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n\nYou have access to a set of tools")
    assert f"<functions>\n{schema}\n</functions>\n<｜User｜>Weather in Paris and Oslo?<｜Assistant｜></think>" in text
    assert text.endswith(f"</think>{calls}<｜end▁of▁sentence｜>\n\n<function_results>\n<result>sunny</result>\n"
                         "<result>rain</result>\n</function_results>\n\n</think>")
    thinking = rendered(thinking=True)  # the answer after the results opens a think block
    assert thinking.endswith("</function_results>\n\n<think>") and "<｜Assistant｜><think></think>\n\n<" in thinking
    no_system = rendered(False, CONVERSATION[1:])
    assert no_system.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n")


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "r"}],
     "a tool message must answer a call of the assistant message before it (0 call(s) there"),
    (CONVERSATION[:4] + [{"role": "user", "content": "and?"}], "the assistant made 2 tool calls but 1 result(s)"),
    (CONVERSATION + [{"role": "tool", "tool_call_id": "c3", "content": "extra"}],
     "(2 call(s) there, this is result 3)"),
])
def test_deepseek_v32_refuses_results_that_answer_no_call(messages, message):
    with pytest.raises(APIError) as error:
        rendered(False, messages)
    assert error.value.status == 400 and message in error.value.message


def test_a_jinja_template_gets_tools_and_calls_with_object_arguments():
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION[1:4], "tools": [WEATHER]})
    text = ChatTemplate(ChatTemplateSource(GLM_TEMPLATE, {})).render([m.for_template() for m in body.messages],
                                                                    tools=[WEATHER])
    assert text == ('[gMASK]<sop><|system|>\n# Tools\n' + json.dumps(WEATHER["function"], ensure_ascii=False) +
                    '\n<|user|>Weather in Paris and Oslo?<|assistant|></think><tool_call>get_weather<arg_key>city'
                    '</arg_key><arg_value>Paris</arg_value></tool_call><tool_call>get_weather<arg_key>city</arg_key>'
                    '<arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>'
                    '<|observation|><tool_response>sunny</tool_response><|assistant|></think>')
