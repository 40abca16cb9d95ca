"""Tools through the openai client: calls parsed from the model's markup (whole and streamed, with reasoning),
tool_choice auto / required / a named function / none, the results sent back in the next turn, and the
requests and flags that are refused with the reason."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from openai.lib.streaming.chat import ChatCompletionStreamState

from cluster.http_api.ingress import build_app
from cluster.http_api.tool_parsers import DSML
from cluster.serve_settings import IngressSettings, ServeAppArgs
from support.http_clients import DSML_CALL, WIDE, run_openai, scripted_tool_app
from support.http_fakes import ScriptedEngine, write_deepseek_checkpoint, write_glm_checkpoint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = DSML_CALL
ASK = [{"role": "user", "content": "hello"}]


@pytest.fixture
def served(tmp_path):
    return scripted_tool_app(tmp_path / "dsv32")


def run(app, scenario):
    run_openai(app, scenario)


def test_auto_tool_calls_whole_and_streamed_through_the_openai_client(served):
    engine, app, _ = served

    async def scenario(client):
        whole = await client.chat.completions.create(model="tiny-dsa", messages=ASK, tools=[WEATHER, TIME])
        choice = whole.choices[0]
        assert (choice.finish_reason, choice.message.content) == ("tool_calls", " I will check.")
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather",
                                                                             {"city": "Paris", "days": 2})
        stream = await client.chat.completions.create(model="tiny-dsa", messages=ASK, tools=[WEATHER], stream=True)
        state = ChatCompletionStreamState()
        async for chunk in stream:
            state.handle_chunk(chunk)
        streamed = state.get_final_completion().choices[0]
        assert streamed.finish_reason == "tool_calls" and streamed.message.content == " I will check."
        (streamed_call,) = streamed.message.tool_calls
        assert (streamed_call.function.name, json.loads(streamed_call.function.arguments)) == (
            "get_weather", {"city": "Paris", "days": 2})

    run(app, scenario)
    assert all(not request.skip_special_tokens for request in engine.requests)  # the markup may be special tokens


def test_reasoning_then_a_call(served):
    engine, app, _ = served
    engine.pieces = ["weather", " needs a tool", "</think>", *CALL[2:]]

    async def scenario(client):
        whole = await client.chat.completions.create(model="tiny-dsa", messages=ASK, tools=[WEATHER],
                                                     extra_body={"chat_template_kwargs": {"thinking": True}})
        message = whole.choices[0].message
        assert (message.reasoning_content, message.content) == ("weather needs a tool", None)
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]

    run(app, scenario)


def test_forced_calls_write_the_opening_into_the_prompt_and_none_parses_nothing(served):
    engine, app, tokenizer = served
    client = TestClient(app)
    engine.pieces = [f'<{DSML}parameter name="city" string="true">Oslo</{DSML}parameter>\n</{DSML}invoke>\n'
                     f'</{DSML}function_calls>']
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER, TIME],
                                                         "tool_choice": named})
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("get_weather", {"city": "Oslo"})
    prompt = tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.replace(" ", "").endswith(f'</think><{DSML}function_calls><{DSML}invokename="get_weather">')
    engine.pieces = CALL
    required = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                         "tool_choice": "required"})
    assert required.json()["choices"][0]["finish_reason"] == "tool_calls"
    none = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    message = none.json()["choices"][0]["message"]
    assert message["tool_calls"] == [] and message["content"] == "".join(CALL)
    assert engine.requests[-1].skip_special_tokens  # nothing to parse: the request's own setting


def test_the_results_go_back_in_the_next_turn_as_the_openai_client_sends_them(served):
    engine, app, _ = served
    engine.pieces = ["It is sunny."]

    async def scenario(client):
        first = (await client.chat.completions.create(model="tiny-dsa", messages=ASK, tools=[WEATHER]))
        assert first.choices[0].finish_reason == "stop"  # pieces were replaced: no call this time
        engine.pieces = CALL
        called = (await client.chat.completions.create(model="tiny-dsa", messages=ASK, tools=[WEATHER])).choices[0]
        engine.pieces = ["It is sunny."]
        history = [*ASK, called.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": called.message.tool_calls[0].id, "content": "sunny"}]
        answer = await client.chat.completions.create(model="tiny-dsa", messages=history, tools=[WEATHER])
        assert answer.choices[0].message.content == "It is sunny."

    run(app, scenario)
    assert len(engine.requests[-1].prompt_token_ids) > len(engine.requests[-2].prompt_token_ids)


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "only allowed with tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "names function 'nope', which is not among the tools (get_weather)"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name", "pattern"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0", "content: required"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages.1", "tool_call_id: required"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
        "name": "get_weather", "arguments": "[1]"}}]}]}, "messages.1.tool_calls.0.function.arguments",
     "must be a JSON object"),
])
def test_malformed_tool_requests_are_400_naming_the_field(served, body, param, message):
    _, app, _ = served
    response = TestClient(app).post("/v1/chat/completions", json={"messages": ASK, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_what_the_server_cannot_honour_names_the_flags(tmp_path):
    folder, _ = write_deepseek_checkpoint(tmp_path / "dsv32")
    body = {"messages": ASK, "tools": [WEATHER]}
    no_parser = TestClient(build_app(ScriptedEngine(CALL, info=WIDE), IngressSettings(model_dir=str(folder))))
    response = no_parser.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "--tool-call-parser (deepseek_v32" in response.json()["error"]["message"]
    no_auto = TestClient(build_app(ScriptedEngine(CALL, info=WIDE), IngressSettings(model_dir=str(folder),
                                                                         tool_call_parser="deepseek_v32")))
    response = no_auto.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "--enable-auto-tool-choice" in response.json()["error"]["message"]
    assert no_auto.post("/v1/chat/completions", json={**body, "tool_choice": "required"}).status_code == 200
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        ServeAppArgs(enable_auto_tool_choice=True)


def test_glm_calls_through_its_jinja_template(tmp_path):
    folder, tokenizer = write_glm_checkpoint(tmp_path / "glm5")
    engine = ScriptedEngine(["Checking.", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>", "Paris",
                             "</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"], info=WIDE)
    settings = IngressSettings(model_dir=str(folder), tool_call_parser="glm47", enable_auto_tool_choice=True)

    async def scenario(client):
        message = (await client.chat.completions.create(model="tiny-dsa", messages=ASK, tools=[WEATHER])).choices[0]
        assert message.finish_reason == "tool_calls" and message.message.content == "Checking."
        (call,) = message.message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}  # days: an integer by the schema
        history = [*ASK, message.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        await client.chat.completions.create(model="tiny-dsa", messages=history, tools=[WEATHER])

    run(build_app(engine, settings), scenario)
    prompt = tokenizer.decode(list(engine.requests[-1].prompt_token_ids), skip_special_tokens=False).replace(" ", "")
    assert "<|assistant|></think>[UNK]<tool_call>[UNK]<arg_key>[UNK]</arg_key><arg_value>[UNK]</arg_value><arg_key>" \
           "[UNK]</arg_key><arg_value>[UNK]</arg_value></tool_call><|observation|><tool_response>[UNK]" \
           "</tool_response><|assistant|></think>" in prompt
