"""Structured outputs over HTTP on the default model's real engine, through the openai client: response_format
json_schema (also `chat.completions.parse` with a pydantic model) and json_object, vLLM's structured_outputs and
guided_* fields, SGLang's regex / ebnf, on completions and chat, streamed, with n; tool calls whose markup and
arguments are constrained (required, a named function, auto); the constraint after the think block; and the 400s
(invalid schema / regex / grammar, several constraints, a compile timeout) before the request is queued."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from cluster.engine_setup import start_local_engine
from cluster.engine_spec import EngineOptions
from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from model_workers.checkpoint.model_dir import PACKAGED_MODEL_DIR
from support.http_clients import run_openai

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["zone"], "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "def parse(data):"}]
JSON_PROMPT = "import json\n\nCONFIG = json.loads('"


class Item(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    size: int = pydantic.Field(ge=0, le=99)


@pytest.fixture(scope="module")
def engine():
    return start_local_engine(PACKAGED_MODEL_DIR, EngineOptions(num_pages=64, page_size=16,
                                                                num_speculative_steps=2))


def app_of(engine, **settings):
    return build_app(engine, IngressSettings(model_dir=str(PACKAGED_MODEL_DIR), **settings))


def run(app, scenario):
    return run_openai(app, scenario, timeout=300)


def test_json_schema_and_json_object_on_chat_and_completions(engine):
    async def scenario(client):
        chat = await client.chat.completions.create(
            model="default_model", messages=ASK, max_tokens=400, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA,
                                                                    "strict": True}})
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
        parsed = await client.chat.completions.parse(model="default_model", messages=ASK, max_tokens=400,
                                                     temperature=0, response_format=Item)
        assert parsed.choices[0].message.parsed == Item.model_validate_json(chat.choices[0].message.content)
        completion = await client.completions.create(model="default_model", prompt=JSON_PROMPT, max_tokens=200,
                                                     n=2, temperature=0.8, seed=3, extra_body={"guided_json": SCHEMA})
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), SCHEMA)
        stream = await client.chat.completions.create(
            model="default_model", messages=ASK, max_tokens=24, temperature=0, stream=True,
            response_format={"type": "json_object"})
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        assert text.lstrip().startswith("{")

    run(app_of(engine), scenario)


@pytest.mark.parametrize("body,check", [
    ({"structured_outputs": {"regex": r"[a-z]{2,6}\([a-z]{0,4}\)"}}, lambda t: re.fullmatch(r"[a-z]{2,6}\([a-z]{0,4}\)", t)),
    ({"guided_regex": r"x = [0-9]{1,3}"}, lambda t: re.fullmatch(r"x = [0-9]{1,3}", t)),
    ({"regex": r"(yes|no)!"}, lambda t: t in ("yes!", "no!")),
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"guided_choice": ["True", "False"]}, lambda t: t in ("True", "False")),
    ({"ebnf": 'root ::= "import " [a-z] [a-z]?'}, lambda t: re.fullmatch("import [a-z]{1,2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= ("a" | "b") "!"'}}, lambda t: t in ("a!", "b!")),
    ({"guided_grammar": 'root ::= "x" [0-9]'}, lambda t: re.fullmatch("x[0-9]", t)),
])
def test_every_request_field_constrains_completions_streamed_or_not(engine, body, check):
    async def scenario(client):
        whole = await client.completions.create(model="default_model", prompt="import os\n", max_tokens=40,
                                                temperature=0.7, seed=1, n=2, extra_body=body)
        assert [c.finish_reason for c in whole.choices] == ["stop", "stop"]
        assert all(check(c.text) for c in whole.choices), [c.text for c in whole.choices]
        stream = await client.completions.create(model="default_model", prompt="import os\n", max_tokens=40,
                                                 temperature=0.7, seed=1, n=2, stream=True, extra_body=body)
        texts = {0: "", 1: ""}
        async for chunk in stream:
            for c in chunk.choices:
                texts[c.index] += c.text
        assert [texts[0], texts[1]] == [c.text for c in whole.choices]

    run(app_of(engine), scenario)


@pytest.mark.parametrize("parser", ["deepseek_v32", "deepseek_v4", "glm47", "glm45"])
def test_forced_tool_calls_always_parse_and_validate(engine, parser):
    app = app_of(engine, tool_call_parser=parser, enable_auto_tool_choice=True)

    async def scenario(client):
        for tool_choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
            reply = await client.chat.completions.create(model="default_model", messages=ASK, tools=[WEATHER, TIME],
                                                         tool_choice=tool_choice, max_tokens=400, temperature=0.9,
                                                         seed=5, parallel_tool_calls=False)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
            for call in choice.message.tool_calls:
                tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
                jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            assert len(choice.message.tool_calls) == 1
            if isinstance(tool_choice, dict):
                assert choice.message.tool_calls[0].function.name == "get_time"

    run(app, scenario)


def test_the_constraint_starts_after_the_think_block(engine):
    app = app_of(engine, reasoning_parser="deepseek_r1")

    async def scenario(client):
        reply = await client.chat.completions.create(
            model="default_model", messages=ASK, max_tokens=200, temperature=0,
            extra_body={"guided_choice": ["True", "False"], "chat_template_kwargs": {"enable_thinking": True}})
        message = reply.choices[0].message
        reasoning = getattr(message, "reasoning_content", None) or (message.model_extra or {}).get("reasoning_content")
        assert reasoning  # free text: the code model's own thinking
        assert reply.choices[0].finish_reason == "length" or message.content in ("True", "False")

    run(app, scenario)


@pytest.mark.parametrize("body,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema", "does not compile"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "does not compile"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf", "does not compile"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"regex": "a", "guided_choice": ["b"]}, "regex", "one constraint"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, None, "xgrammar"),
])
def test_bad_constraints_are_400s_naming_the_field(engine, body, param, words):
    async def scenario(client):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="default_model", prompt="x", max_tokens=4, extra_body=body)
        error = caught.value.body
        assert words in error["message"], error
        if param is not None:
            assert error["param"] == param

    run(app_of(engine), scenario)


def test_a_slow_compile_is_a_400_after_the_timeout(engine):
    app = app_of(engine, grammar_compile_timeout_s=1e-4)
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]{3,9}"}
                                               for i in range(40)}}

    async def scenario(client):
        with pytest.raises(openai.BadRequestError) as caught:
            await client.completions.create(model="default_model", prompt="x", max_tokens=4,
                                            extra_body={"guided_json": schema})
        assert "did not compile within" in caught.value.body["message"]

    run(app, scenario)
