"""Prompt logprobs over HTTP: completions with echo and logprobs (what lm-eval's loglikelihood tasks send: the
prompt tokens' logprobs first, the first one null), vLLM's `prompt_logprobs` on completions and chat (whole and
streamed), over the deterministic engine; and over a real engine on the shipped model, where the echoed logprobs
equal the `prompt_logprobs` of the same prompt."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from cluster.engine_spec import EngineOptions
from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from model_workers.checkpoint.model_dir import resolve_model_dir
from support.engines import local_engine
from support.http_fakes import FakeEngine, fake_token

LM_EVAL_BODY = {"model": "tiny-dsa", "prompt": "hello world", "max_tokens": 1, "temperature": 0, "logprobs": 1,
                "echo": True, "seed": 1234}


@pytest.fixture
def served(checkpoint):
    engine = FakeEngine()
    return engine, TestClient(build_app(engine, IngressSettings(model_dir=str(checkpoint))))


def sse_payloads(text: str) -> list[dict]:
    """The JSON payloads of an SSE body, which ends with [DONE]."""
    *events, done = [event for event in text.split("\n\n") if event]
    assert done == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in events]


def test_the_lm_eval_loglikelihood_body_gets_prompt_logprobs_first(served):
    engine, client = served
    response = client.post("/v1/completions", json=LM_EVAL_BODY)
    assert response.status_code == 200, response.text
    (request,) = engine.requests
    assert request.prompt_token_ids == (3, 4) and request.prompt_logprobs == 1 and request.logprobs == 1
    choice = response.json()["choices"][0]
    generated = f"w{fake_token(request, 0)}"
    assert choice["text"] == f"hello world {generated}"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["hello", "world", generated]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.5]  # the fake: prompt position i has logprob -i
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"world": -1.0, "user": -0.5}  # one alternative: id 4 + 1
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"][2] == len("hello world")
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    assert "prompt_logprobs" not in choice  # only asked for with vLLM's field


def test_the_openai_client_parses_echo_with_logprobs(checkpoint):
    """The client builds its objects without strict validation (`Completion.model_validate` would refuse the
    leading nulls: its types say list[float], though OpenAI and vLLM send null for the first prompt token)."""
    async def scenario():
        app = build_app(FakeEngine(), IngressSettings(model_dir=str(checkpoint)))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=http, max_retries=0)
        return await client.completions.create(**LM_EVAL_BODY)

    completion = asyncio.run(scenario())
    assert isinstance(completion, openai.types.Completion)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens[:2] == ["hello", "world"] and logprobs.token_logprobs[:2] == [None, -1.0]
    assert logprobs.top_logprobs[0] is None and completion.choices[0].finish_reason == "length"


def test_echo_with_logprobs_streams_the_prompt_in_the_first_chunk(served):
    _, client = served
    chunks = sse_payloads(client.post("/v1/completions", json={**LM_EVAL_BODY, "max_tokens": 3, "stream": True}).text)
    logprobs = [chunk["choices"][0]["logprobs"] for chunk in chunks]
    assert [len(lp["tokens"]) for lp in logprobs] == [3, 1, 1]
    assert logprobs[0]["tokens"][:2] == ["hello", "world"] and logprobs[0]["token_logprobs"][:2] == [None, -1.0]
    assert chunks[0]["choices"][0]["text"].startswith("hello world ")
    offsets = [offset for lp in logprobs for offset in lp["text_offset"]]
    assert offsets == sorted(offsets) and offsets[2] == len("hello world")


def test_vllm_prompt_logprobs_on_completions(served):
    engine, client = served
    body = client.post("/v1/completions", json={"prompt": "hello world user", "prompt_logprobs": 2, "max_tokens": 2,
                                                "logprobs": 1, "echo": True}).json()
    (request,) = engine.requests
    assert request.prompt_logprobs == 2  # the larger of prompt_logprobs and echo's logprobs
    choice = body["choices"][0]
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == 3
    assert choice["prompt_logprobs"][1] == {"4": {"logprob": -1.0, "rank": 2, "decoded_token": "world"},
                                            "5": {"logprob": -0.5, "rank": 1, "decoded_token": "user"}}
    assert choice["prompt_logprobs"][2] == {"5": {"logprob": -2.0, "rank": 2, "decoded_token": "user"},
                                            "6": {"logprob": -1.5, "rank": 1, "decoded_token": "assistant"}}
    assert [len(top) for top in choice["logprobs"]["top_logprobs"][1:]] == [2, 2, 1, 1]  # echo keeps 1 alternative
    alone = client.post("/v1/completions", json={"prompt": "hello", "prompt_logprobs": 0, "max_tokens": 1}).json()
    assert alone["choices"][0]["prompt_logprobs"] == [None] and alone["choices"][0]["logprobs"] is None
    stream = client.post("/v1/completions", json={"prompt": "hello world", "prompt_logprobs": 0, "max_tokens": 3,
                                                  "stream": True})
    chunks = [chunk["choices"][0] for chunk in sse_payloads(stream.text)]
    assert chunks[0]["prompt_logprobs"] == [None, {"4": {"logprob": -1.0, "rank": 2, "decoded_token": "world"}}]
    assert all("prompt_logprobs" not in chunk for chunk in chunks[1:])


def test_vllm_prompt_logprobs_on_chat(served):
    """As vLLM: at the top level of a chat response (the choices share the prompt), and of the first stream chunk."""
    engine, client = served
    messages = [{"role": "user", "content": "hello"}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "prompt_logprobs": 1,
                                                     "max_tokens": 2}).json()
    (request,) = engine.requests
    prompt = body["prompt_logprobs"]
    assert "prompt_logprobs" not in body["choices"][0]
    assert len(prompt) == len(request.prompt_token_ids) and prompt[0] is None
    assert all(str(token) in entry for token, entry in zip(request.prompt_token_ids[1:], prompt[1:]))
    stream = client.post("/v1/chat/completions", json={"messages": messages, "prompt_logprobs": 1, "max_tokens": 2,
                                                       "stream": True})
    chunks = sse_payloads(stream.text)
    assert chunks[0]["prompt_logprobs"] == prompt and "prompt_logprobs" not in chunks[1]
    plain = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain


def test_echoed_logprobs_equal_prompt_logprobs_on_a_real_engine():
    """The shipped model at C = 1 with a 16-token prefill budget (the prompt is prefilled in chunks)."""
    model_dir = resolve_model_dir(None)
    engine = local_engine(model_dir, EngineOptions(num_pages=32, page_size=16, prefill_token_budget=16))
    app = build_app(engine, IngressSettings(model_dir=str(model_dir)))

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=120) as client:
            text = "The quick brown fox jumps over the lazy dog, and then it runs far away into the green hills."
            ids = (await client.post("/tokenize", json={"prompt": text})).json()["tokens"]
            common = {"prompt": ids, "max_tokens": 1, "temperature": 0}
            echoed = await client.post("/v1/completions", json={**common, "echo": True, "logprobs": 2})
            vllm = await client.post("/v1/completions", json={**common, "prompt_logprobs": 2})
            return ids, echoed.json(), vllm.json()

    ids, echoed, vllm = asyncio.run(scenario())
    assert len(ids) > 16
    logprobs, prompt = echoed["choices"][0]["logprobs"], vllm["choices"][0]["prompt_logprobs"]
    assert len(logprobs["token_logprobs"]) == len(ids) + 1 and len(prompt) == len(ids)
    assert logprobs["token_logprobs"][0] is None and prompt[0] is None
    for position, token in enumerate(ids[1:], 1):
        entry = prompt[position][str(token)]
        assert logprobs["token_logprobs"][position] == pytest.approx(entry["logprob"], abs=1e-5)
        assert entry["logprob"] <= 0 and entry["rank"] >= 1
        best = max(prompt[position].values(), key=lambda e: e["logprob"])
        assert best["rank"] == 1 and max(logprobs["top_logprobs"][position].values()) == pytest.approx(
            best["logprob"], abs=1e-5)
    assert echoed["choices"][0]["text"].endswith(vllm["choices"][0]["text"])  # prompt + the same greedy token
    assert engine.free_pages == [32]
