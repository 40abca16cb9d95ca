"""POST /v1/responses through the official openai client: greedy answers equal chat's on the default model (whole
and streamed: the exact event sequence, the text, the usage), reasoning and function calls as output items, a tool
round trip through input items (the prompt is chat's), and what is refused, with the field named."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from cluster.http_api.ingress import build_app
from cluster.http_api.responses_requests import ResponsesRequest
from cluster.serve_settings import IngressSettings
from cp_router.protocol import EngineChunk, EngineUnavailableError
from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR
from support.http_clients import DSML_CALL, WIDE, run_openai, scripted_tool_app
from support.http_fakes import INFO, ScriptedEngine, write_checkpoint_files, write_deepseek_checkpoint

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["parameters"]}}
CALL = DSML_CALL
START = ["response.created", "response.in_progress"]


def item_events(kind: str, deltas: int) -> list[str]:
    """The events of one message (kind output_text) or reasoning (reasoning_text) item with `deltas` deltas."""
    return ["response.output_item.added", "response.content_part.added", *[f"response.{kind}.delta"] * deltas,
            f"response.{kind}.done", "response.content_part.done", "response.output_item.done"]


CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


def run(app, scenario):
    run_openai(app, scenario)


@pytest.fixture
def served(tmp_path):
    engine, app, _ = scripted_tool_app(tmp_path / "dsv32")
    return engine, app


def test_greedy_answers_equal_chat_whole_and_streamed_on_the_default_model(default_model_app):
    model, system, question = PACKAGED_MODEL_DIR.name, "You write Python.", "Write a function that adds two numbers."

    async def scenario(client):
        chat = await client.chat.completions.create(model=model, max_tokens=12, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
        common = {"model": model, "instructions": system, "input": question, "max_output_tokens": 12, "temperature": 0}
        whole = await client.responses.create(**common)
        events = [event async for event in await client.responses.create(**common, stream=True)]
        answer, finish = chat.choices[0].message.content, chat.choices[0].finish_reason
        assert finish == "length" and answer  # 12 tokens, cut: the response is incomplete
        assert whole.id.startswith("resp_") and whole.object == "response" and whole.store is False
        assert whole.output_text == answer and whole.status == "incomplete"
        assert whole.incomplete_details.reason == "max_output_tokens"
        (message,) = whole.output
        assert message.type == "message" and message.id.startswith("msg_") and message.status == "incomplete"
        usage = whole.usage
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
            chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
        assert usage.output_tokens_details.reasoning_tokens == 0
        assert usage.input_tokens_details.cached_tokens >= 0
        deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
        assert [event.type for event in events] == [*START, *item_events("output_text", len(deltas)),
                                                    "response.incomplete"]
        assert [event.sequence_number for event in events] == list(range(len(events)))
        assert "".join(deltas) == answer and events[-1].response.output_text == answer
        assert events[-1].response.usage.output_tokens == chat.usage.completion_tokens
        assert events[0].response.status == "in_progress" and events[0].response.output == []

    run(default_model_app, scenario)


def test_reasoning_and_a_call_are_output_items_whole_and_streamed(served):
    engine, app = served
    engine.pieces = ["weather", " needs a tool", "</think>", *CALL]

    async def scenario(client):
        common = {"model": "tiny-dsa", "input": "hello", "tools": [WEATHER], "reasoning": {"effort": "high"}}
        whole = await client.responses.create(**common)
        reasoning, message, call = whole.output
        assert (reasoning.type, reasoning.content[0].text, reasoning.summary) == ("reasoning",
                                                                                  "weather needs a tool", [])
        assert message.content[0].text == " I will check." and whole.status == "completed"
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                      {"city": "Paris", "days": 2})
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        assert whole.usage.output_tokens == len(engine.pieces)
        assert whole.usage.output_tokens_details.reasoning_tokens == 4  # "weather needs a tool": 4 words, 4 tokens
        events = [event async for event in await client.responses.create(**common, stream=True)]
        assert [event.type for event in events] == [*START, *item_events("reasoning_text", 2),
                                                    *item_events("output_text", 1), *CALL_EVENTS,
                                                    "response.completed"]
        final = events[-1].response
        assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
        assert final.output[2].arguments == call.arguments == events[-3].arguments
        async with client.responses.stream(**common) as stream:  # the client's own accumulation of the events
            helper = await stream.get_final_response()
        assert [item.type for item in helper.output] == ["reasoning", "message", "function_call"]
        assert helper.output_text == " I will check." and helper.output[0].content[0].text == "weather needs a tool"

    run(app, scenario)
    assert engine.requests[-1].skip_special_tokens is False  # tools: the markup's special tokens are kept


def test_a_tool_round_trip_through_input_items_makes_chats_prompt(served):
    engine, app = served

    async def scenario(client):
        first = await client.responses.create(model="tiny-dsa", input="hello", tools=[WEATHER])
        message, call = first.output
        engine.pieces = ["It is sunny."]
        history = [{"role": "user", "content": "hello"}, *[item.model_dump(exclude_none=True) for item in first.output],
                   {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        answer = await client.responses.create(model="tiny-dsa", input=history, tools=[WEATHER])
        assert answer.output_text == "It is sunny." and [item.type for item in answer.output] == ["message"]
        assistant = {"role": "assistant", "content": message.content[0].text, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}
        await client.chat.completions.create(model="tiny-dsa", tools=[CHAT_WEATHER], messages=[
            {"role": "user", "content": "hello"}, assistant, {"role": "tool", "tool_call_id": call.call_id,
                                                              "content": "sunny"}])

    run(app, scenario)
    responses_prompt, chat_prompt = engine.requests[-2].prompt_token_ids, engine.requests[-1].prompt_token_ids
    assert responses_prompt == chat_prompt and len(chat_prompt) > len(engine.requests[0].prompt_token_ids)


def test_input_items_become_chat_messages_in_order():
    items = [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": "think"}]}, {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "let me look"}]}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                          "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "dropped"}]},
        {"role": "user", "content": "and?"}]
    messages = ResponsesRequest.model_validate({"input": items, "instructions": "sys"}).chat_fields()["messages"]
    assert messages == [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me look", "reasoning_content": "think", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}, {"role": "user", "content": "and?"}]


def test_text_format_becomes_chats_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"input": "x", "text": {"format": {"type": "json_schema", "name": "point", "schema": schema,
                                              "strict": True}}}
    assert ResponsesRequest.model_validate(body).chat_fields()["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "point", "schema": schema, "strict": True}}
    json_object = {"input": "x", "text": {"format": {"type": "json_object"}}}
    assert ResponsesRequest.model_validate(json_object).chat_fields()["response_format"] == {"type": "json_object"}
    plain = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "text"}}}).chat_fields()
    assert "response_format" not in plain


def test_roles_parts_tool_choice_and_instructions_make_chats_request(served):
    engine, app = served
    engine.pieces = ["fine"]
    client = TestClient(app)
    response = client.post("/v1/responses", json={
        "instructions": "be brief", "input": [{"role": "developer", "content": "no jokes"}, {"type": "message",
        "role": "user", "content": [{"type": "input_text", "text": "hello"}]}], "text": {"format": {"type": "text"}},
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "metadata": {"k": "v"},
        "store": True, "max_output_tokens": 7, "temperature": 0.5})
    body = response.json()
    assert response.status_code == 200 and body["store"] is False and body["metadata"] == {"k": "v"}
    assert body["tool_choice"] == {"type": "function", "name": "get_weather"} and body["tools"] == [WEATHER]
    assert (body["instructions"], body["max_output_tokens"], body["temperature"]) == ("be brief", 7, 0.5)
    client.post("/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "no jokes"},
                     {"role": "user", "content": "hello"}], "tools": [CHAT_WEATHER], "max_tokens": 7,
        "temperature": 0.5, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    responses_request, chat_request = engine.requests[-2:]
    assert responses_request.prompt_token_ids == chat_request.prompt_token_ids
    assert (responses_request.max_tokens, responses_request.temperature) == (7, 0.5) == (
        chat_request.max_tokens, chat_request.temperature)


@pytest.mark.parametrize("body, status, param, message", [
    ({"previous_response_id": "resp_1"}, 400, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, 400, "conversation", "stores no responses"),
    ({"background": True}, 400, "background", "background responses are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input.0.content.0", "type 'input_image' is not supported"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input.0.type", "'function_call_output'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, 400, "input.0",
     "arguments: must be a JSON object"),
    ({"input": []}, 400, "input", "at least 1 item"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type", "Input should be 'function'"),
    ({"text": {"format": {"type": "json_schema"}}}, 400, "text.format", "name and schema: both required"),
    ({"tool_choice": "required"}, 400, "tool_choice", "only allowed with tools"),
    ({"max_output_tokens": 100000}, 400, "max_output_tokens", "max_output_tokens may be at most"),
    ({"temperature": 3}, 400, "temperature", "less than or equal to 2"),
    ({"model": "nope"}, 404, "model", "does not exist"),
])
def test_what_is_refused_names_the_field(served, body, status, param, message):
    _, app = served
    response = TestClient(app).post("/v1/responses", json={"input": "hello", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


class FailingEngine(ScriptedEngine):
    """Its stream breaks after the first piece."""

    async def _run(self, request):
        yield EngineChunk((1,), "partial", None, len(request.prompt_token_ids), 1)
        raise EngineUnavailableError("rank group lost")


def test_a_stream_that_fails_ends_with_an_error_event(tmp_path):
    folder, _ = write_deepseek_checkpoint(tmp_path / "dsv32")
    app = build_app(FailingEngine([], info=WIDE), IngressSettings(model_dir=str(folder)))

    async def scenario(client):
        events = [event async for event in await client.responses.create(model="tiny-dsa", input="hi", stream=True)]
        assert [event.type for event in events][-2:] == ["response.output_text.delta", "error"]
        assert events[-1].code == "engine_unavailable" and "rank group lost" in events[-1].message

    run(app, scenario)


def test_the_route_has_chats_key_drain_template_check_and_schema(checkpoint, tmp_path):
    engine = ScriptedEngine(["ok"])
    app = build_app(engine, IngressSettings(model_dir=str(checkpoint), api_key="sk-test"))
    client = TestClient(app)
    assert client.post("/v1/responses", json={"input": "hello"}).status_code == 401
    ok = client.post("/v1/responses", json={"input": "hello"}, headers={"Authorization": "Bearer sk-test"})
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] == "ok"
    document = client.get("/openapi.json").json()
    operation = document["paths"]["/v1/responses"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert set(operation["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    app.state.admission.draining = True
    drained = client.post("/v1/responses", json={"input": "hello"}, headers={"Authorization": "Bearer sk-test"})
    assert drained.status_code == 503 and drained.json()["error"]["code"] == "server_draining"
    (tmp_path / "plain").mkdir()
    plain = write_checkpoint_files(tmp_path / "plain", chat_template=False)
    no_template = build_app(ScriptedEngine(["ok"], info=dataclasses.replace(INFO, has_chat_template=False)),
                            IngressSettings(model_dir=str(plain)))
    missing = TestClient(no_template).post("/v1/responses", json={"input": "hello"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "chat_template_missing"
