"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic client: greedy answers equal
chat's on the default model (whole and streamed: the exact event sequence, the text, the usage, the token count, a
stop sequence), thinking blocks, a tool_use round trip with tool_result (the prompt is chat's), and Anthropic's
error body and types on every error of these routes."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json

import anthropic
import httpx2
import pytest
from fastapi.testclient import TestClient

from cluster.http_api.ingress import build_app
from cluster.http_api.messages_requests import MessagesRequest
from cluster.serve_settings import IngressSettings
from cp_router.protocol import EngineChunk, EngineUnavailableError
from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR
from support.http_clients import DSML_CALL, WIDE, scripted_tool_app
from support.http_fakes import INFO, FakeEngine, ScriptedEngine, write_checkpoint_files, write_deepseek_checkpoint

WEATHER = {"name": "get_weather", "description": "the weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                                 "parameters": WEATHER["input_schema"]}}
CALL = DSML_CALL
HELLO = [{"role": "user", "content": "hello"}]


def block_events(deltas: int, signed: bool = False) -> list[str]:
    return ["content_block_start", *["content_block_delta"] * (deltas + signed), "content_block_stop"]


def message_events(*blocks: list[str]) -> list[str]:
    return ["message_start", *[event for block in blocks for event in block], "message_delta", "message_stop"]


def run(app, scenario):
    """`scenario(client)`'s result, the anthropic client talking to `app` in process."""
    async def main():
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test", timeout=120)
        return await scenario(anthropic.AsyncAnthropic(api_key="x", base_url="http://test", http_client=http,
                                                       max_retries=0))

    return asyncio.run(main())


async def post_json(app, path: str, body: dict) -> dict:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://test",
                                  timeout=120) as http:
        return (await http.post(path, json=body)).json()


@pytest.fixture
def served(tmp_path):
    engine, app, _ = scripted_tool_app(tmp_path / "dsv32")
    return engine, app


def test_greedy_messages_equal_chat_whole_streamed_and_counted_on_the_default_model(default_model_app):
    model, system, question = PACKAGED_MODEL_DIR.name, "You write Python.", "Write a function that adds two numbers."
    chat_body = {"model": model, "max_tokens": 12, "temperature": 0,
                 "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    common = {"model": model, "system": system, "messages": [{"role": "user", "content": question}],
              "max_tokens": 12, "extra_body": {"temperature": 0}}  # the client has no sampling parameters

    async def scenario(client):
        chat = await post_json(default_model_app, "/v1/chat/completions", chat_body)
        answer, usage = chat["choices"][0]["message"]["content"], chat["usage"]
        whole = await client.messages.create(**common)
        assert whole.id.startswith("msg_") and (whole.type, whole.role, whole.model) == ("message", "assistant", model)
        assert [block.type for block in whole.content] == ["text"] and whole.content[0].text == answer
        assert (whole.stop_reason, whole.stop_sequence) == ("max_tokens", None)
        assert whole.usage.output_tokens == usage["completion_tokens"]
        assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == usage["prompt_tokens"]
        events = [event async for event in await client.messages.create(**common, stream=True)]
        deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
        assert [event.type for event in events] == message_events(block_events(len(deltas)))
        assert "".join(deltas) == answer and events[-2].delta.stop_reason == "max_tokens"
        assert events[-2].usage.output_tokens == usage["completion_tokens"]
        async with client.messages.stream(**common) as stream:
            final = await stream.get_final_message()
        assert final.content[0].text == answer and final.stop_reason == "max_tokens"
        counted = await client.messages.count_tokens(model=model, system=system, messages=common["messages"],
                                                     extra_body={"max_tokens": 12, "temperature": 0})
        assert counted.input_tokens == usage["prompt_tokens"]

        stop = "\n#\n"
        chat_stopped = await post_json(default_model_app, "/v1/chat/completions", {**chat_body, "stop": [stop]})
        assert chat_stopped["choices"][0]["finish_reason"] == "stop"
        stopped = await client.messages.create(**common, stop_sequences=[stop])
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
        assert stopped.content[0].text == chat_stopped["choices"][0]["message"]["content"] and stop not in answer[:2]
        streamed = [event async for event in await client.messages.create(**common, stop_sequences=[stop],
                                                                           stream=True)]
        assert "".join(e.delta.text for e in streamed if e.type == "content_block_delta") == stopped.content[0].text
        assert (streamed[-2].delta.stop_reason, streamed[-2].delta.stop_sequence) == ("stop_sequence", stop)

    run(default_model_app, scenario)


def test_thinking_blocks_whole_and_streamed_with_a_reasoning_parser(served):
    engine, app = served
    engine.pieces = ["Let", " me", " think", "</thi", "nk>", "The", " answer"]
    enabled = {"type": "enabled", "budget_tokens": 1024}

    async def scenario(client):
        whole = await client.messages.create(model="tiny-dsa", messages=HELLO, max_tokens=20, thinking=enabled)
        thinking, text = whole.content
        assert (thinking.type, thinking.thinking, text.type, text.text) == ("thinking", "Let me think", "text",
                                                                            "The answer")
        assert thinking.signature == hashlib.sha256(b"Let me think").hexdigest()
        events = [event async for event in await client.messages.create(model="tiny-dsa", messages=HELLO,
                                                                         max_tokens=20, thinking=enabled, stream=True)]
        assert [event.type for event in events] == message_events(block_events(3, signed=True), block_events(2))
        assert [event.delta.type for event in events if event.type == "content_block_delta"] == [
            "thinking_delta"] * 3 + ["signature_delta", "text_delta", "text_delta"]
        async with client.messages.stream(model="tiny-dsa", messages=HELLO, max_tokens=20, thinking=enabled) as stream:
            final = await stream.get_final_message()
        assert [block.model_dump(exclude_none=True) for block in final.content] == [
            block.model_dump(exclude_none=True) for block in whole.content]
        adaptive = await client.messages.create(model="tiny-dsa", messages=HELLO, max_tokens=20,
                                                thinking={"type": "adaptive"})
        assert adaptive.content == whole.content
        off = await client.messages.create(model="tiny-dsa", messages=HELLO, max_tokens=20)
        assert [block.type for block in off.content] == ["text"] and off.content[0].text == "".join(engine.pieces)

    run(app, scenario)
    client = TestClient(app)
    client.post("/v1/chat/completions", json={"messages": HELLO, "chat_template_kwargs": {"thinking": True}})
    thinking_prompts = [engine.requests[i].prompt_token_ids for i in (0, -3, -1)]
    assert thinking_prompts[0] == thinking_prompts[1] == thinking_prompts[2] != engine.requests[-2].prompt_token_ids


def test_a_tool_use_round_trip_with_tool_result_makes_chats_prompt(served):
    engine, app = served

    async def scenario(client):
        async with client.messages.stream(model="tiny-dsa", messages=HELLO, max_tokens=50, tools=[WEATHER]) as stream:
            called = await stream.get_final_message()
        text, tool_use = called.content
        assert (called.stop_reason, text.text, tool_use.name, tool_use.input) == (
            "tool_use", " I will check.", "get_weather", {"city": "Paris", "days": 2})
        assert tool_use.id.startswith("toolu_")
        whole = await client.messages.create(model="tiny-dsa", messages=HELLO, max_tokens=50, tools=[WEATHER])
        assert [block.type for block in whole.content] == ["text", "tool_use"] and whole.stop_reason == "tool_use"
        engine.pieces = ["It is sunny."]
        history = [*HELLO, {"role": "assistant", "content": [block.model_dump(exclude_none=True)
                                                             for block in called.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                                 "content": [{"type": "text", "text": "sunny"}]}]}]
        answer = await client.messages.create(model="tiny-dsa", messages=history, max_tokens=50, tools=[WEATHER])
        assert answer.content[0].text == "It is sunny." and answer.stop_reason == "end_turn"
        return tool_use

    tool_use = run(app, scenario)
    assistant = {"role": "assistant", "content": " I will check.", "tool_calls": [
        {"id": tool_use.id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
            tool_use.input)}}]}
    TestClient(app).post("/v1/chat/completions", json={"tools": [CHAT_WEATHER], "messages": [
        *HELLO, assistant, {"role": "tool", "tool_call_id": tool_use.id, "content": "sunny"}]})
    assert engine.requests[-2].prompt_token_ids == engine.requests[-1].prompt_token_ids


def test_tool_choice_any_and_a_named_tool_force_the_call_as_chat_does(served):
    engine, app = served
    client = TestClient(app)
    for anthropic_choice, chat_choice in (({"type": "any"}, "required"),
                                          ({"type": "tool", "name": "get_weather"},
                                           {"type": "function", "function": {"name": "get_weather"}})):
        message = client.post("/v1/messages", json={"messages": HELLO, "max_tokens": 9, "tools": [WEATHER],
                                                    "tool_choice": anthropic_choice})
        assert message.status_code == 200, message.text
        client.post("/v1/chat/completions", json={"messages": HELLO, "tools": [CHAT_WEATHER],
                                                  "tool_choice": chat_choice})
        assert engine.requests[-2].prompt_token_ids == engine.requests[-1].prompt_token_ids
    counted = client.post("/v1/messages/count_tokens", json={"messages": HELLO, "tools": [WEATHER],
                                                             "tool_choice": {"type": "any"}})
    assert counted.json() == {"input_tokens": len(engine.requests[0].prompt_token_ids)}


def test_output_config_format_becomes_chats_json_schema_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = MessagesRequest.model_validate({"messages": HELLO, "max_tokens": 5, "output_config": {
        "format": {"type": "json_schema", "schema": schema}, "effort": "high"}})
    assert body.chat_fields()["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                                            "schema": schema}}


@pytest.mark.parametrize("body, message", [
    ({"max_tokens": None}, "max_tokens: Input should be a valid integer"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0: type 'image' is not supported"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}, "continuing a prefilled assistant turn"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences: List should have at most 4 items"),
    ({"tool_choice": {"type": "tool"}}, 'name: required when type is "tool"'),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools.0.type: Input should be 'custom'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "names function 'nope'"),
    ({"extra_body": {"temperature": 1.5}}, "temperature: Input should be less than or equal to 1"),
    ({"extra_body": {"top_k": -1}}, "top_k: Input should be greater than or equal to 0"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type: Input should be 'enabled', 'adaptive' or 'disabled'"),
    ({"max_tokens": 10**6}, "max_tokens may be at most"),
])
def test_invalid_requests_are_anthropic_invalid_request_errors(served, body, message):
    _, app = served

    async def scenario(client):
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.messages.create(**{"model": "tiny-dsa", "messages": HELLO, "max_tokens": 5, **body})
        error = raised.value.body
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"], error

    run(app, scenario)


class FailingEngine(ScriptedEngine):
    async def _run(self, request):
        yield EngineChunk((1,), "partial", None, len(request.prompt_token_ids), 1)
        raise EngineUnavailableError("rank group lost")


def test_other_errors_carry_anthropics_types_and_statuses(served, tmp_path):
    _, app = served
    keyed = build_app(ScriptedEngine(["ok"], info=WIDE), IngressSettings(
        model_dir=str(tmp_path / "dsv32"), api_key="sk-test"))

    async def scenario(client):
        with pytest.raises(anthropic.NotFoundError) as raised:
            await client.messages.create(model="nope", messages=HELLO, max_tokens=5)
        assert raised.value.body["error"]["type"] == "not_found_error"

    run(app, scenario)
    bad_key = TestClient(keyed).post("/v1/messages", json={"messages": HELLO, "max_tokens": 5},
                                     headers={"x-api-key": "wrong"})
    assert (bad_key.status_code, bad_key.json()["error"]["type"]) == (401, "authentication_error")
    for headers in ({"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}, {"Authorization": "Bearer sk-test"}):
        assert TestClient(keyed).post("/v1/messages", json={"messages": HELLO, "max_tokens": 5},
                                      headers=headers).status_code == 200
    overloaded = build_app(FakeEngine(WIDE, overloaded=True), IngressSettings(model_dir=str(tmp_path / "dsv32")))
    busy = TestClient(overloaded).post("/v1/messages", json={"messages": HELLO, "max_tokens": 5})
    assert (busy.status_code, busy.json()["error"]["type"], busy.headers["Retry-After"]) == (503, "overloaded_error",
                                                                                              "2")
    client = TestClient(app)
    assert client.get("/v1/messages").json()["error"]["type"] == "invalid_request_error"
    missing = client.post("/v1/messages", json={"messages": HELLO})
    assert missing.status_code == 400 and missing.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "max_tokens: Field required"}}
    app.state.admission.draining = True
    drained = client.post("/v1/messages", json={"messages": HELLO, "max_tokens": 5})
    assert (drained.status_code, drained.json()["error"]["type"]) == (503, "overloaded_error")
    assert client.post("/v1/messages/count_tokens", json={"messages": HELLO}).status_code == 200  # not generation
    (tmp_path / "plain").mkdir()
    plain = build_app(ScriptedEngine(["ok"], info=dataclasses.replace(INFO, has_chat_template=False)),
                      IngressSettings(model_dir=str(write_checkpoint_files(tmp_path / "plain", chat_template=False))))
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        no_template = TestClient(plain).post(path, json={"messages": HELLO, "max_tokens": 5})
        assert (no_template.status_code, no_template.json()["error"]["type"]) == (404, "not_found_error")


def test_a_stream_that_fails_ends_with_an_error_event(tmp_path):
    folder, _ = write_deepseek_checkpoint(tmp_path / "dsv32")
    app = build_app(FailingEngine([], info=WIDE), IngressSettings(model_dir=str(folder)))

    async def scenario(client):
        seen = []
        with pytest.raises(anthropic.APIStatusError) as raised:
            async for event in await client.messages.create(model="tiny-dsa", messages=HELLO, max_tokens=9,
                                                            stream=True):
                seen.append(event.type)
        assert seen == ["message_start", "content_block_start", "content_block_delta"]
        assert raised.value.body == {"type": "error", "error": {
            "type": "overloaded_error", "message": "the engine is unavailable: rank group lost"}}

    run(app, scenario)


def test_the_schema_publishes_both_routes_with_anthropics_error_body(served):
    _, app = served
    document = TestClient(app).get("/openapi.json").json()
    messages = document["paths"]["/v1/messages"]["post"]
    assert messages["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    assert messages["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AnthropicErrorBody")
    assert messages["responses"]["503"]["description"].startswith("overloaded_error")
    count = document["paths"]["/v1/messages/count_tokens"]["post"]
    assert count["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/TokenCount")
