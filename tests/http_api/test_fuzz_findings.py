"""What the API fuzzers found, kept as regressions (each was a 500, or an answer the published schema contradicts):

* a lone UTF-16 surrogate (`"\\ud800"`) in a prompt or a message reached the tokenizer: 500 (TypeError);
* a logit_bias key of ASCII-looking digits int() cannot read ("²", "--5", 5000 digits): 500 (ValueError);
* nesting 500+ levels deep inside a field: RecursionError in the validators (500); now a 400 past MAX_JSON_DEPTH;
* `10.0` for an integer field, valid for the published schema ("integer"), was rejected; `true` passed as best_of 1;
* a client that stopped sending mid-body held its request (and a concurrency slot) forever; now a 408;
* the log line naming ignored unknown fields carried their raw names (newlines, RTL overrides) and all of them.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from fastapi.testclient import TestClient

from cluster.http_api.body import MAX_JSON_DEPTH
from cluster.http_api.ingress import build_app
from cluster.http_api.openai_requests import CompletionRequest
from cluster.serve_settings import IngressSettings
from cp_router.protocol import ModelInfo
from support.fuzz import openai_error_problem, send_raw
from support.http_fakes import VOCAB_SIZE, FakeEngine

INFO = ModelInfo(name="tiny-dsa", vocab_size=VOCAB_SIZE, max_model_len=96, has_chat_template=True)
COMPLETION = '{"prompt": "hello", "max_tokens": 2, %s}'
CHAT = '{"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, %s}'


@pytest.fixture(scope="module")
def served(checkpoint):
    engine = FakeEngine(INFO)
    return engine, TestClient(build_app(engine, IngressSettings(model_dir=str(checkpoint))),
                              raise_server_exceptions=False)


def post(client: TestClient, text: str):
    path = "/v1/chat/completions" if text.startswith('{"messages"') else "/v1/completions"
    return client.post(path, content=text.encode("utf-8"), headers={"content-type": "application/json"})


def assert_error(response, status: int, param: str | None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert openai_error_problem(status, response.headers["content-type"], response.content) is None
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


@pytest.mark.parametrize("text, param", [
    ('{"prompt": "\\ud800 hello", "max_tokens": 2}', "prompt"),
    ('{"prompt": ["hello", "a\\udfffb"], "max_tokens": 2, "stream": true}', "prompt.1"),
    ('{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 2}', "messages.0.content"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}', "messages.0.content.0.text"),
    (COMPLETION % '"stop": ["x", "\\ud800"]', "stop.1"),
    (COMPLETION % '"\\ud800": 1', None),  # in a key: the object holding it is the request body
])
def test_a_lone_surrogate_is_a_400_naming_the_field(served, text, param):
    error = assert_error(post(served[1], text), 400, param, "invalid_encoding")
    assert "surrogate" in error["message"]


def test_a_surrogate_pair_is_one_character_and_served(served):
    response = post(served[1], '{"prompt": "\\ud83d\\ude00 hello", "max_tokens": 2, "echo": true}')
    assert response.status_code == 200 and response.json()["choices"][0]["text"].startswith("\U0001f600 hello")


@pytest.mark.parametrize("key", ["\u00b2", "--5", "\u0661", "1" * 5000, "1" * 20])
def test_a_logit_bias_key_that_is_no_ascii_token_id_is_a_400(served, key):
    error = assert_error(post(served[1], COMPLETION % f'"logit_bias": {json.dumps({key: 1})}'), 400, "logit_bias")
    assert "token ids" in error["message"] and len(error["message"]) < 300


def test_a_negative_or_padded_logit_bias_key_is_still_read(served):
    keys = {" 5 ": 1, "-1": 2}  # " 5 " is token 5; -1 is outside the vocabulary (a 400 after validation)
    assert CompletionRequest.model_validate({"prompt": "a", "logit_bias": keys}).engine_logit_bias() == \
        ((-1, 2.0), (5, 1.0))
    assert_error(post(served[1], COMPLETION % '"logit_bias": {"-1": 2}'), 400, "logit_bias", "invalid_token_id")


@pytest.mark.parametrize("field", ["prompt", "chat_template_kwargs", "tools", "unknown_field"])
@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 500])
def test_nesting_past_the_limit_is_a_400_naming_the_field(served, field, depth):
    nested = "[" * depth + "1" + "]" * depth  # inside the body object: depth + 1 levels
    text = (CHAT if field != "prompt" else '{"max_tokens": 2, %s}') % f'"{field}": {nested}'
    assert_error(post(served[1], text), 400, field, "invalid_json")


def test_nesting_past_what_json_can_read_is_a_400(served):
    error = assert_error(post(served[1], COMPLETION % f'"x": {"[" * 10**5}1{"]" * 10**5}'), 400, None, "invalid_json")
    assert "recursion" in error["message"]


def test_nesting_up_to_the_limit_is_read(served):
    nested = '{"a": ' * (MAX_JSON_DEPTH - 2) + "1" + "}" * (MAX_JSON_DEPTH - 2)
    response = post(served[1], CHAT % f'"chat_template_kwargs": {{"x": {nested}}}')
    assert response.status_code == 200, response.text


def test_an_integral_number_is_an_integer_as_the_schema_says(served):
    engine, client = served
    response = post(client, '{"prompt": [3.0, 4.0], "max_tokens": 3.0, "n": 2.0, "seed": 7.0, "stop_token_ids": [5.0]}')
    assert response.status_code == 200, response.text
    first, second = engine.requests[-2:]  # n = 2: choice i samples with seed + i
    assert (first.prompt_token_ids, first.max_tokens, first.seed, first.stop_token_ids) == ((3, 4), 3, 7, (5,))
    assert second.seed == 8 and len(response.json()["choices"]) == 2
    assert_error(post(client, COMPLETION % '"n": 2.5'), 400, "n")
    assert_error(post(client, '{"prompt": [3, 4.5]}'), 400, "prompt")


@pytest.mark.parametrize("field, value", [("best_of", "true"), ("best_of", "2"), ("suffix", "false")])
def test_a_no_op_field_takes_only_its_no_op_value(served, field, value):
    assert_error(post(served[1], COMPLETION % f'"{field}": {value}'), 400, field)
    assert post(served[1], COMPLETION % '"best_of": 1, "suffix": ""').status_code == 200


@pytest.mark.parametrize("pieces", [[], [b'{"prompt": "hel'], [b'{"prompt": "hello"}']])
def test_a_client_that_stops_sending_gets_a_408_and_never_reaches_the_engine(checkpoint, pieces):
    engine = FakeEngine(INFO)
    app = build_app(engine, IngressSettings(model_dir=str(checkpoint), body_timeout_s=0.2, max_ongoing_requests=1))
    loop = asyncio.new_event_loop()
    try:
        stalled = loop.run_until_complete(send_raw(app, "/v1/completions", pieces,
                                                   {"content-type": "application/json"}, end="stall"))
        served = loop.run_until_complete(send_raw(app, "/v1/completions", [b'{"prompt": "hello", "max_tokens": 2}'],
                                                  {"content-type": "application/json"}))
    finally:
        loop.close()
    assert stalled.status == 408 and openai_error_problem(408, stalled.content_type, stalled.body) is None
    assert json.loads(stalled.body)["error"]["code"] == "request_timeout"
    assert len(engine.requests) == 1 and served.status == 200  # the slot was given back


def test_the_ignored_fields_log_line_is_one_bounded_line(served, caplog):
    fields = {"x\nFORGED access line": 1, "\u202eevil": 2, "y" * 5000: 3, **{f"extra{i}": i for i in range(100)}}
    with caplog.at_level(logging.WARNING, logger="cluster.http_api.body"):
        response = post(served[1], json.dumps({"prompt": "hello", "max_tokens": 2, **fields}))
    assert response.status_code == 200
    (record,) = [r for r in caplog.records if r.getMessage().startswith("ignored unknown request fields")]
    message = record.getMessage()
    assert "\n" not in message and "\u202e" not in message and len(message) < 2000, message
    assert "'x\\nFORGED access line'" in message and message.endswith("(and 83 more)")
