"""Identity and utility routes as vLLM users script them: served model names, one model card, tokenize /
detokenize, version, X-Request-Id and CORS, through the real app (the `openai` client included)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from cluster.http_api.ingress import build_app
from cluster.http_api.utility_routes import server_version
from cluster.serve_settings import IngressSettings
from support.http_fakes import MAX_MODEL_LEN, FakeEngine, write_checkpoint_files


@pytest.fixture
def served(checkpoint):
    engine = FakeEngine()
    settings = IngressSettings(model_dir=str(checkpoint), served_model_name=["dsa-a", "org/dsa-b"],
                               allowed_origins=["https://ui.example"])
    return engine, TestClient(build_app(engine, settings))


def test_served_model_names_are_listed_answered_and_others_are_404(served):
    _, client = served
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["dsa-a", "org/dsa-b"]
    body = client.post("/v1/completions", json={"model": "org/dsa-b", "prompt": "hello", "max_tokens": 1}).json()
    assert body["model"] == "org/dsa-b"
    assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1}).json()["model"] == "dsa-a"
    missing = client.post("/v1/completions", json={"model": "tiny-dsa", "prompt": "hello", "max_tokens": 1})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    card = client.get("/v1/models/org/dsa-b").json()
    assert card == {"id": "org/dsa-b", "object": "model", "created": card["created"], "owned_by": "dsa-serve",
                    "max_model_len": MAX_MODEL_LEN}
    assert client.get("/v1/models/nope").status_code == 404


def test_openai_client_retrieves_a_model_card(checkpoint):
    async def scenario():
        app = build_app(FakeEngine(), IngressSettings(model_dir=str(checkpoint), served_model_name=["dsa-a"]))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        sdk = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)
        model = await sdk.models.retrieve("dsa-a")
        assert isinstance(model, openai.types.Model) and model.id == "dsa-a" and model.owned_by == "dsa-serve"
        with pytest.raises(openai.NotFoundError):
            await sdk.models.retrieve("tiny-dsa")

    asyncio.run(scenario())


def test_tokenize_and_detokenize(served):
    _, client = served
    assert client.post("/tokenize", json={"prompt": "hello world"}).json() == {
        "count": 2, "max_model_len": MAX_MODEL_LEN, "tokens": [3, 4]}
    chat = client.post("/tokenize", json={"model": "dsa-a", "messages": [{"role": "user", "content": "hello"}]}).json()
    assert chat["tokens"] == [1, 5, 8, 3, 6, 8]  # "<s> user : hello assistant :" through the chat template
    assert client.post("/detokenize", json={"tokens": [3, 4]}).json() == {"prompt": "hello world"}
    bad = client.post("/detokenize", json={"tokens": [3, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_token_id"
    both = client.post("/tokenize", json={"prompt": "hello", "messages": [{"role": "user", "content": "x"}]})
    assert both.status_code == 400 and "exactly one of prompt or messages" in both.json()["error"]["message"]


def test_version_and_request_ids(served):
    _, client = served
    assert client.get("/version").json() == {"version": server_version()} and server_version() != "unknown"
    echoed = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1},
                         headers={"X-Request-Id": "trace-42"})
    assert echoed.headers["x-request-id"] == "trace-42"
    own = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    assert own.headers["x-request-id"] == own.json()["id"] and own.json()["id"].startswith("cmpl-")
    assert client.get("/v1/models").headers["x-request-id"].startswith("req-")


def test_cors_for_the_allowed_origins_only(served):
    _, client = served
    preflight = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}
    allowed = client.options("/v1/completions", headers=preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://ui.example"
    other = client.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


@pytest.mark.parametrize("origins_flag", ['["https://a.example", "https://b.example"]',
                                          "https://a.example,https://b.example"])
def test_serve_flags_reach_the_ingress(checkpoint, origins_flag):
    from cluster import cli
    from cluster.commands.serve import app_args
    from cluster.serve_app import ingress_settings

    args = cli.build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--allowed-origins", origins_flag])
    settings = ingress_settings(app_args(args), checkpoint)
    assert settings.served_model_name == ["a", "b"] and settings.model_dir == str(checkpoint)
    assert settings.allowed_origins == ["https://a.example", "https://b.example"]
    assert settings.request_id_header is False  # under Ray Serve its proxy sets X-Request-Id (once)


def test_generation_config_gives_the_defaults_a_request_leaves_out(tmp_path):
    import json

    folder = write_checkpoint_files(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "do_sample": True,
         "eos_token_id": [2]}))
    engine = FakeEngine()
    client = TestClient(build_app(engine, IngressSettings(model_dir=str(folder))))
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "temperature": 0, "top_p": None})
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                              "repetition_penalty": 1.0})
    defaulted, chosen, chat = engine.requests
    assert (defaulted.temperature, defaulted.top_p, defaulted.top_k, defaulted.repetition_penalty) == (0.6, 0.95, 20,
                                                                                                       1.1)
    assert (chosen.temperature, chosen.top_p) == (0.0, 0.95)  # a set field wins; null means "the default"
    assert (chat.temperature, chat.repetition_penalty) == (0.6, 1.0)
