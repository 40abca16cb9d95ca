"""Completions and chat completions through the real FastAPI app over a deterministic engine: response
shapes, fan-out (n, prompt lists, seeds), sampling fields reaching the engine, logprobs, echo, SSE streams,
and the official `openai` client against the app."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from support.http_fakes import MAX_MODEL_LEN, VOCAB_SIZE, FakeEngine, fake_token, write_checkpoint_files


@pytest.fixture
def served(checkpoint):
    engine = FakeEngine()
    return engine, TestClient(build_app(engine, IngressSettings(model_dir=str(checkpoint))))


def sse_payloads(text: str) -> list:
    events = [event for event in text.split("\n\n") if event]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def test_completion_response_shape_and_usage(served):
    engine, client = served
    body = client.post("/v1/completions", json={"model": "tiny-dsa", "prompt": "hello world", "max_tokens": 3}).json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny-dsa"
    (request,) = engine.requests
    assert request.prompt_token_ids == (3, 4) and request.max_tokens == 3
    expected = "".join(f" w{fake_token(request, step)}" for step in range(3))
    assert body["choices"] == [{"index": 0, "text": expected, "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_sampling_fields_reach_the_engine(served):
    engine, client = served
    client.post("/v1/completions", json={
        "prompt": [5, 6], "max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_tokens": 2,
        "stop": "w20", "stop_token_ids": [40], "ignore_eos": True, "seed": 11, "logprobs": 2, "user": "u1"})
    client.post("/v1/completions", json={"prompt": [5], "top_k": VOCAB_SIZE, "temperature": None})
    first, second = engine.requests
    assert (first.temperature, first.top_p, first.top_k, first.min_tokens) == (0.7, 0.9, 0, 2)
    assert (first.stop, first.stop_token_ids, first.ignore_eos, first.seed, first.logprobs) == (("w20",), (40,), True,
                                                                                                 11, 2)
    assert (second.top_k, second.temperature, second.max_tokens, second.seed) == (0, 1.0, 16, None)


def test_n_and_prompt_lists_fan_out_with_distinct_seeds(served):
    engine, client = served
    body = client.post("/v1/completions", json={"prompt": [[3], [4, 4]], "n": 2, "seed": 7, "max_tokens": 2}).json()
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2, 3]
    by_id = {request.request_id: request for request in engine.requests}
    assert [by_id[f"{body['id']}-{i}"].seed for i in range(4)] == [7, 8, 9, 10]
    assert [by_id[f"{body['id']}-{i}"].prompt_token_ids for i in range(4)] == [(3,), (3,), (4, 4), (4, 4)]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_stop_token_finishes_with_stop(served):
    engine, client = served
    client.post("/v1/completions", json={"prompt": [3], "max_tokens": 1})
    second_token = fake_token(engine.requests[0], 1)
    body = client.post("/v1/completions", json={"prompt": [3], "max_tokens": 6, "stop_token_ids": [second_token]})
    assert body.json()["choices"][0]["finish_reason"] == "stop"
    assert body.json()["usage"]["completion_tokens"] == 2


def test_echo_and_logprobs(served):
    _, client = served
    echoed = client.post("/v1/completions", json={"prompt": "hello world", "echo": True, "max_tokens": 2}).json()
    assert echoed["choices"][0]["text"].startswith("hello world w")
    body = client.post("/v1/completions", json={"prompt": "hello", "logprobs": 2, "max_tokens": 3}).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(token.startswith("w") for token in logprobs["tokens"]) and len(logprobs["tokens"]) == 3
    assert logprobs["token_logprobs"] == [-0.5] * 3
    assert all(len(top) == 2 and top[token] == -0.5 for top, token in zip(logprobs["top_logprobs"],
                                                                          logprobs["tokens"]))
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"]) and logprobs["text_offset"][0] == 0


def test_stream_chunks_usage_and_done(served):
    _, client = served
    response = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True, "n": 2,
                                                     "stream_options": {"include_usage": True}})
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(response.text)
    *token_chunks, usage_chunk = chunks
    assert len(token_chunks) == 6 and all(chunk["usage"] is None for chunk in token_chunks)
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]} and len({c["created"] for c in chunks}) == 1
    finishes = [c["choices"][0]["finish_reason"] for c in token_chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["length", "length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    plain = sse_payloads(client.post("/v1/completions", json={"prompt": "hello", "stream": True}).text)
    assert all("usage" not in chunk for chunk in plain)


def test_chat_completion_and_stream(served):
    engine, client = served
    parts = [{"type": "text", "text": "world"}]
    messages = [{"role": "system", "content": "hello"}, {"role": "user", "content": parts}]
    body = client.post("/v1/chat/completions", json={"messages": messages, "logprobs": True, "top_logprobs": 1}).json()
    (request,) = engine.requests
    assert request.prompt_token_ids[0] == 1  # the template's bos_token
    assert request.max_tokens == MAX_MODEL_LEN - len(request.prompt_token_ids)  # default: the room left
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["message"]["content"].startswith(" w") and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert content[0]["bytes"] == list(content[0]["token"].encode()) and len(content[0]["top_logprobs"]) == 1
    stream = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2, "stream": True})
    chunks = sse_payloads(stream.text)
    assert [chunk["choices"][0]["delta"].get("role") for chunk in chunks] == ["assistant", None]
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)


def test_the_openai_client_works_against_the_app(checkpoint):
    async def scenario():
        app = build_app(FakeEngine(), IngressSettings(model_dir=str(checkpoint), api_key="sk-1"))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
        client = openai.AsyncOpenAI(api_key="sk-1", base_url="http://test/v1", http_client=http, max_retries=0)
        completion = await client.completions.create(model="tiny-dsa", prompt="hello", max_tokens=2, logprobs=1)
        assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 2
        assert len(completion.choices[0].logprobs.tokens) == 2
        stream = await client.completions.create(model="tiny-dsa", prompt="hello", max_tokens=3, stream=True)
        pieces = [chunk.choices[0].text async for chunk in stream]
        assert len(pieces) == 3 and "".join(pieces).startswith(completion.choices[0].text)
        chat = await client.chat.completions.create(model="tiny-dsa", messages=[{"role": "user", "content": "hello"}],
                                                    max_tokens=2)
        assert chat.choices[0].message.content.startswith(" w")
        models = await client.models.list()
        assert [model.id for model in models.data] == ["tiny-dsa"]
        with pytest.raises(openai.BadRequestError) as bad:
            await client.completions.create(model="tiny-dsa", prompt="hello", temperature=3)
        assert bad.value.body["param"] == "temperature"
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="other", prompt="hello")
        await http.aclose()

    asyncio.run(scenario())


def test_vllm_bench_serve_body_is_served_and_unknown_fields_are_named_in_one_log_line(served, caplog):
    """The exact body `vllm bench serve` sends (openai-completions backend), plus fields this server does not know:
    ignored as vLLM ignores them, named once per request, nested ones with their path."""
    engine, client = served
    body = {"model": "tiny-dsa", "prompt": "hello world", "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 3, "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    with caplog.at_level("WARNING", logger="cluster.http_api.body"):
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200 and not caplog.records
        odd = {**body, "stream": False, "stream_options": None, "frequency": 1, "priority": 0, "min_p": 0.0}
        assert client.post("/v1/completions", json=odd).status_code == 200
    (record,) = caplog.records
    assert record.getMessage() == "ignored unknown request fields: frequency, priority"
    assert sse_payloads(response.text)[-1]["usage"]["completion_tokens"] == 3
    chat = {"messages": [{"role": "user", "content": "hi", "weight": 1}], "max_tokens": 2, "service_tier": "auto"}
    caplog.clear()
    with caplog.at_level("WARNING", logger="cluster.http_api.body"):
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert caplog.records[0].getMessage() == "ignored unknown request fields: messages[0].weight, service_tier"


@pytest.mark.parametrize("source", ["chat_template.jinja", "--chat-template"])
def test_chat_template_from_a_jinja_file_beside_the_tokenizer_or_given_by_flag(tmp_path, source):
    """GLM-5 ships its template as chat_template.jinja (tokenizer_config.json has none); --chat-template FILE
    replaces whatever the checkpoint has."""
    from cluster.serve_app import ingress_settings, validate_args

    (tmp_path / "ckpt").mkdir()
    folder = write_checkpoint_files(tmp_path / "ckpt", chat_template=False)
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}world :{% endif %}"
    flag = None
    if source == "chat_template.jinja":
        (folder / "chat_template.jinja").write_text(template)
    else:
        flag = tmp_path / "mine.jinja"
        flag.write_text(template)
    settings = ingress_settings(validate_args({"chat_template": None if flag is None else str(flag)}), folder)
    engine = FakeEngine()
    client = TestClient(build_app(engine, settings))
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                         "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert engine.requests[0].prompt_token_ids == (3, 4, 8)  # "hello world :", not the default template's


def test_a_chat_template_file_that_is_not_there_is_one_clear_error(checkpoint, tmp_path):
    from model_workers.checkpoint.tokenizer import load_checkpoint_text

    with pytest.raises(ValueError, match=r"chat_template: .*nope.jinja is not a file \(a Jinja chat template\)"):
        load_checkpoint_text(checkpoint, tmp_path / "nope.jinja")


def test_penalties_min_p_and_logit_bias_reach_the_engine(served):
    engine, client = served
    body = {"prompt": [5, 6], "max_tokens": 2, "repetition_penalty": 1.3, "presence_penalty": -0.5,
            "frequency_penalty": 1, "min_p": 0.1, "logit_bias": {"12": -100, "7": 2.5}}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1, "presence_penalty": 0.2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    first, second = engine.requests
    assert (first.repetition_penalty, first.presence_penalty, first.frequency_penalty, first.min_p) == (1.3, -0.5, 1.0,
                                                                                                       0.1)
    assert first.logit_bias == ((7, 2.5), (12, -100.0)) and second.presence_penalty == 0.2
