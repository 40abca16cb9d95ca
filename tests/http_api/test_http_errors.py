"""The bad-input matrix: every malformed request gets the right 4xx and an OpenAI error body, the engine is
never reached, and the server keeps serving afterwards."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from cluster.http_api.ingress import build_app
from cluster.ray_metrics import replica_label
from cluster.serve_settings import IngressSettings
from support.http_fakes import MAX_MODEL_LEN, VOCAB_SIZE, FakeEngine, write_checkpoint_files

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_BODY = 64 * 1024
TEN_MB = 10 * 1024 * 1024


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = write_checkpoint_files(tmp_path_factory.mktemp("ckpt"))
    engine = FakeEngine(accept=False)
    settings = IngressSettings(model_dir=str(folder), api_key=API_KEY, max_ongoing_requests=2, max_body_bytes=MAX_BODY)
    return engine, TestClient(build_app(engine, settings), raise_server_exceptions=False)


def completion(**fields) -> dict:
    return {"model": "tiny-dsa", "prompt": "hello world", "max_tokens": 4, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny-dsa", "messages": [{"role": "user", "content": "hello"}], **fields}


FIELD_CASES = [  # (case, route, body, status, param, code)
    ("max_tokens wrong type", "completions", completion(max_tokens="ten"), 400, "max_tokens", None),
    ("max_tokens float", "completions", completion(max_tokens=4.5), 400, "max_tokens", None),
    ("prompt wrong type", "completions", completion(prompt=5), 400, "prompt", None),
    ("prompt mixed list", "completions", completion(prompt=[1, "a"]), 400, "prompt", None),
    ("prompt bool ids", "completions", completion(prompt=[True, False]), 400, "prompt", None),
    ("temperature wrong type", "completions", completion(temperature="hot"), 400, "temperature", None),
    ("stream wrong type", "completions", completion(stream="yes"), 400, "stream", None),
    ("stop wrong type", "completions", completion(stop=[1]), 400, "stop.0", None),
    ("negative max_tokens", "completions", completion(max_tokens=-1), 400, "max_tokens", None),
    ("zero max_tokens", "completions", completion(max_tokens=0), 400, "max_tokens", None),
    ("huge max_tokens", "completions", completion(max_tokens=10**12), 400, "max_tokens", "context_length_exceeded"),
    ("temperature < 0", "completions", completion(temperature=-0.1), 400, "temperature", None),
    ("temperature > 2", "completions", completion(temperature=2.5), 400, "temperature", None),
    ("top_p = 0", "completions", completion(top_p=0), 400, "top_p", None),
    ("top_p > 1", "completions", completion(top_p=1.01), 400, "top_p", None),
    ("top_p < 0", "completions", completion(top_p=-0.5), 400, "top_p", None),
    ("top_k < -1", "completions", completion(top_k=-2), 400, "top_k", None),
    ("n = 0", "completions", completion(n=0), 400, "n", None),
    ("n > 16", "completions", completion(n=17), 400, "n", None),
    ("logprobs > 20", "completions", completion(logprobs=21), 400, "logprobs", None),
    ("five stop strings", "completions", completion(stop=list("abcde")), 400, "stop", None),
    ("empty prompt", "completions", completion(prompt=""), 400, "prompt", None),
    ("empty prompt list", "completions", completion(prompt=[]), 400, "prompt", None),
    ("empty token list", "completions", completion(prompt=[[]]), 400, "prompt", None),
    ("empty string in list", "completions", completion(prompt=["hello", ""]), 400, "prompt", None),
    ("prompt over the window", "completions", completion(prompt=[3] * (MAX_MODEL_LEN + 8)), 400, "prompt",
     "context_length_exceeded"),
    ("text prompt over the window", "completions", completion(prompt="hello " * MAX_MODEL_LEN), 400, "prompt",
     "context_length_exceeded"),
    ("prompt + max_tokens over the window", "completions", completion(prompt=[3] * 20, max_tokens=20), 400,
     "max_tokens", "context_length_exceeded"),
    ("token id = vocab size", "completions", completion(prompt=[3, VOCAB_SIZE]), 400, "prompt", "invalid_token_id"),
    ("negative token id", "completions", completion(prompt=[[3], [-1]]), 400, "prompt", "invalid_token_id"),
    ("stop_token_ids outside vocab", "completions", completion(stop_token_ids=[10**6]), 400, "stop_token_ids",
     "invalid_token_id"),
    ("min_tokens > max_tokens", "completions", completion(min_tokens=9), 400, "min_tokens", None),
    ("response_format json_schema without its schema", "completions", completion(response_format={
        "type": "json_schema"}), 400, "response_format.json_schema", None),
    ("response_format of an unknown type", "completions", completion(response_format={"type": "xml"}), 400,
     "response_format.type", None),
    ("repetition_penalty <= 0", "completions", completion(repetition_penalty=0.0), 400, "repetition_penalty", None),
    ("presence_penalty > 2", "completions", completion(presence_penalty=2.5), 400, "presence_penalty", None),
    ("logit_bias key not an id", "completions", completion(logit_bias={"hello": 1}), 400, "logit_bias", None),
    ("logit_bias outside vocab", "completions", completion(logit_bias={"999999": 1}), 400, "logit_bias",
     "invalid_token_id"),
    ("prompt_logprobs > 20", "completions", completion(prompt_logprobs=21), 400, "prompt_logprobs", None),
    ("prompt_logprobs < 0", "completions", completion(prompt_logprobs=-1), 400, "prompt_logprobs", None),
    ("stream_options without stream", "completions", completion(stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("unknown model", "completions", completion(model="gpt-4"), 404, "model", "model_not_found"),
    ("chat empty messages", "chat/completions", chat(messages=[]), 400, "messages", None),
    ("chat bad role", "chat/completions", chat(messages=[{"role": "robot", "content": "x"}]), 400,
     "messages.0.role", None),
    ("chat over the window", "chat/completions", chat(messages=[{"role": "user", "content": "hello " * 40}]), 400,
     "messages", "context_length_exceeded"),
    ("chat top_logprobs without logprobs", "chat/completions", chat(top_logprobs=2), 400, "top_logprobs", None),
    ("chat prompt_logprobs > 20", "chat/completions", chat(prompt_logprobs=21), 400, "prompt_logprobs", None),
    ("chat unknown model", "chat/completions", chat(model="gpt-4"), 404, "model", "model_not_found"),
]


def assert_error_body(response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize("case,route,body,status,param,code", FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
def test_invalid_fields_are_rejected_before_the_engine(served, case, route, body, status, param, code):
    engine, client = served
    response = client.post(f"/v1/{route}", json=body, headers=AUTH)
    error = assert_error_body(response, status, param, code)
    if status == 400 and code is None:
        assert error["message"].startswith(f"{param}:")  # names the field, then what is allowed
    assert engine.requests == []


RAW_CASES = [  # (case, raw body, content type, status, code)
    ("malformed JSON", b'{"prompt": "hello", ', "application/json", 400, "invalid_json"),
    ("NaN is not JSON", b'{"prompt": "hello", "temperature": NaN}', "application/json", 400, "invalid_json"),
    ("invalid UTF-8", b'{"prompt": "hello \xff\xfe"}', "application/json", 400, "invalid_encoding"),
    ("wrong content type", json.dumps(completion()).encode(), "text/plain", 400, "invalid_content_type"),
    ("form content type", b"prompt=hello", "application/x-www-form-urlencoded", 400, "invalid_content_type"),
    ("deeply nested JSON", b'{"prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "application/json", 400,
     "invalid_json"),
    ("integer with 5000 digits", b'{"prompt": "hello", "max_tokens": 1' + b"0" * 5000 + b"}", "application/json",
     400, "invalid_json"),
    ("body is a list", b"[1, 2]", "application/json", 400, None),
    ("10 MB body", b'{"prompt": "' + b"a" * TEN_MB + b'"}', "application/json", 413, "request_too_large"),
]


@pytest.mark.parametrize("case,raw,content_type,status,code", RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_malformed_bodies_are_rejected(served, case, raw, content_type, status, code):
    engine, client = served
    response = client.post("/v1/completions", content=raw, headers={**AUTH, "Content-Type": content_type})
    assert_error_body(response, status, code=code)
    assert engine.requests == []


def test_body_over_the_limit_without_content_length_is_413(served):
    engine, client = served

    def chunks():
        for _ in range(TEN_MB // MAX_BODY):
            yield b"a" * MAX_BODY

    response = client.post("/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_error_body(response, 413, code="request_too_large")


@pytest.mark.parametrize("headers,message", [({}, "missing API key"), ({"Authorization": "Bearer sk-wrong"},
                                             "incorrect API key"), ({"Authorization": API_KEY}, "missing API key")])
def test_api_key_is_required(served, headers, message):
    engine, client = served
    for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET")):
        response = client.request(method, path, json=completion(), headers=headers)
        error = assert_error_body(response, 401, code="invalid_api_key")
        assert error["message"].startswith(message)
        assert response.headers["WWW-Authenticate"] == "Bearer"


def test_unknown_route_and_wrong_method_get_the_error_body(served):
    _, client = served
    assert_error_body(client.get("/v1/nothing", headers=AUTH), 404)
    assert_error_body(client.get("/v1/completions", headers=AUTH), 405)


def test_the_server_keeps_serving_after_the_matrix(served):
    engine, client = served
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models", headers=AUTH).json()
    assert [card["id"] for card in models["data"]] == ["tiny-dsa"]
    engine.accept = True
    try:
        for _ in range(3):  # more than max_ongoing_requests: every rejected request gave its slot back
            response = client.post("/v1/completions", json=completion(), headers=AUTH)
            assert response.status_code == 200, response.text
    finally:
        engine.accept = False
    metrics = client.get("/metrics").text
    labels = f'model_name="tiny-dsa",replica="{replica_label("ingress")}"'  # outside Serve: ingress-<host>:<pid>
    assert f'dsa_serve:request_errors_total{{error_type="context_length_exceeded",{labels}}}' in metrics
    assert f'dsa_serve:request_errors_total{{error_type="invalid_api_key",{labels}}}' in metrics


def test_api_key_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DSA_SERVE_API_KEY", "sk-env")
    client = TestClient(build_app(FakeEngine(), IngressSettings(model_dir=str(write_checkpoint_files(tmp_path)))))
    assert_error_body(client.get("/v1/models"), 401, code="invalid_api_key")
    assert client.get("/v1/models", headers={"Authorization": "Bearer sk-env"}).status_code == 200
    assert client.get("/health").status_code == 200  # probes need no key
