"""Request lifecycle at the ingress: client disconnects abort engine requests (and free their KV), bounded
concurrency answers 429, engine backpressure 503, engine failures keep the error body, one log line per request."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import replace

import httpx
import pytest
from fastapi.testclient import TestClient

from cluster.http_api.ingress import build_app
from cluster.http_api.middleware import route_path
from cluster.serve_settings import IngressSettings
from support.http_fakes import INFO, FakeEngine, call_and_disconnect

KV_IDLE = 'dsa_serve:kv_pages_used{cp_rank="0",model_name="tiny-dsa",replica="engine-0"} 0.0'


def app_over(engine: FakeEngine, checkpoint, **settings):
    return build_app(engine, IngressSettings(model_dir=str(checkpoint), **settings))


def statuses(messages: list[dict]) -> list[int]:
    return [m["status"] for m in messages if m["type"] == "http.response.start"]


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_disconnect_before_the_answer_aborts_the_request(checkpoint, spec_version):
    engine = FakeEngine(pause_after=0)
    app = app_over(engine, checkpoint)
    messages = asyncio.run(call_and_disconnect(app, "/v1/completions", {"prompt": "hello", "n": 2}, 0, spec_version))
    assert statuses(messages) == ([499] if spec_version == "2.3" else [])  # 2.4: sending to a gone client fails
    assert sorted(engine.aborted) == sorted(request.request_id for request in engine.requests)
    assert len(engine.aborted) == 2 and engine.active == {}
    assert KV_IDLE in TestClient(app).get("/metrics").text


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_disconnect_mid_stream_aborts_the_request(checkpoint, spec_version, caplog):
    engine = FakeEngine(pause_after=2)
    app = app_over(engine, checkpoint)
    payload = {"prompt": "hello", "max_tokens": 8, "stream": True}
    with caplog.at_level(logging.INFO):
        messages = asyncio.run(call_and_disconnect(app, "/v1/completions", payload, 1, spec_version))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    (access,) = [r.getMessage() for r in caplog.records if r.name == "dsa_serve.access"]
    assert "error=client_disconnected" in access
    assert statuses(messages) == [200]
    assert engine.aborted == [engine.requests[0].request_id] and engine.active == {}
    metrics = TestClient(app).get("/metrics").text
    assert KV_IDLE in metrics
    assert 'dsa_serve:request_success_total{finished_reason="abort",model_name="tiny-dsa",replica="engine-0"} 1.0' \
        in metrics


def test_concurrency_limit_answers_429_with_retry_after(checkpoint):
    engine = FakeEngine(pause_after=0)
    app = app_over(engine, checkpoint, max_ongoing_requests=1, retry_after_s=3)

    async def scenario():
        held = asyncio.create_task(call_and_disconnect(app, "/v1/completions", {"prompt": "hello"}, 1))
        while not engine.active:
            await asyncio.sleep(0.001)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            refused = await client.post("/v1/completions", json={"prompt": "hello"})
            health = await client.get("/health")  # only generation routes are limited
            await engine.abort(engine.requests[0].request_id)
            await held
            engine.pause_after = None
            accepted = await client.post("/v1/completions", json={"prompt": "hello"})
        return refused, health, accepted

    refused, health, accepted = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "3"
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert health.status_code == 200 and accepted.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_engine_overload_is_503_with_retry_after(checkpoint, stream):
    client = TestClient(app_over(FakeEngine(overloaded=True), checkpoint))
    response = client.post("/v1/completions", json={"prompt": "hello", "stream": stream})
    assert response.status_code == 503 and response.headers["Retry-After"] == "2"
    assert response.json()["error"]["code"] == "engine_overloaded"


class FailingEngine(FakeEngine):
    """Sends one token, then fails like a crashed rank would."""

    async def generate(self, request):
        self.requests.append(request)
        async for chunk in self._run(request):
            yield chunk
            raise RuntimeError("rank 1 died")


def test_engine_failure_keeps_the_error_body(checkpoint):
    client = TestClient(app_over(FailingEngine(), checkpoint), raise_server_exceptions=False)
    whole = client.post("/v1/completions", json={"prompt": "hello"})
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    events = client.post("/v1/completions", json={"prompt": "hello", "stream": True}).text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: "))["error"]["message"].startswith("internal server error")


def test_catch_all_answers_500_with_the_error_body(checkpoint):
    engine = FakeEngine()

    async def garbled() -> str:  # breaks the exposition format: merging it raises inside the route
        return "dsa_serve:x{replica= 1\n"

    engine.metrics_text = garbled
    response = TestClient(app_over(engine, checkpoint), raise_server_exceptions=False).get("/metrics")
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"


def test_unhealthy_engine_fails_health(checkpoint):
    engine = FakeEngine()

    async def broken() -> None:
        raise RuntimeError("rank 1 is dead")

    engine.check_health = broken
    response = TestClient(app_over(engine, checkpoint)).get("/health")
    assert response.status_code == 503 and "rank 1 is dead" in response.json()["error"]["message"]


def test_without_tokenizer_only_token_ids_are_served():
    info = replace(INFO, has_chat_template=False)
    client = TestClient(build_app(FakeEngine(info=info), IngressSettings()))
    body = client.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 1, "logprobs": 0}).json()
    assert body["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")
    text = client.post("/v1/completions", json={"prompt": "hello"})
    assert text.status_code == 400 and text.json()["error"]["code"] == "no_tokenizer"
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "chat_template_missing"


def test_engine_with_chat_template_needs_the_checkpoint_files():
    with pytest.raises(ValueError, match="model_dir"):
        build_app(FakeEngine(), IngressSettings())


def test_one_access_log_line_per_request(checkpoint, caplog):
    client = TestClient(app_over(FakeEngine(), checkpoint))
    with caplog.at_level(logging.INFO, logger="dsa_serve.access"):
        client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "user": "alice"})
        client.post("/v1/completions", json={"prompt": "hello", "top_p": 2})
    first, second = [record.getMessage() for record in caplog.records if record.name == "dsa_serve.access"]
    assert " /v1/completions 200 " in first and "prompt_tokens=1 completion_tokens=2 finish=length" in first
    assert "request_id=cmpl-" in first and "user='alice'" in first
    assert " 400 " in second and "error=invalid_request_error" in second



def test_limited_routes_are_recognised_under_a_route_prefix():
    assert route_path({"path": "/dsa/v1/completions", "root_path": "/dsa"}) == "/v1/completions"
    assert route_path({"path": "/v1/completions", "root_path": ""}) == "/v1/completions"
    assert route_path({"path": "/dsaX/v1/completions", "root_path": "/dsa"}) == "/dsaX/v1/completions"


def test_build_app_rejects_an_object_that_is_not_an_engine_client():
    with pytest.raises(TypeError, match="engine_client"):
        build_app(object(), IngressSettings())
