"""End to end: `dsa-serve serve` (Ray Serve on a local Ray, CPU, C = 2, the default model), one server for the
module, driven by the official `openai` client and raw httpx; stopped with Ctrl-C (SIGINT) at the end."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli import main as cli_main
from cluster.serve_app import app as app_builder
from cluster.replica_engine import engine_bundles
from cluster.serve_settings import ServeAppArgs
from support.serve_process import (descendant_pids, free_port, start_server, stop_with_ctrl_c, wait_for_log,
                                   wait_until_ready)

API_KEY = "sk-e2e"
PROMPTS = ["Hello", "The quick brown fox", "def main():", "Once upon a time"]


@pytest.fixture(scope="module", params=["colocated", pytest.param("separate", marks=pytest.mark.slow)])  # separate: make test-slow
def server(tmp_path_factory, request):
    """Base URL of a running server (each engine placement; the separate one with the experts partitioned over
    its two ranks, --ep-size 2); on teardown Ctrl-C must stop it cleanly."""
    port, log_path = free_port(), tmp_path_factory.mktemp("serve") / "serve.log"
    arguments = ["--api-key", API_KEY, "--engine-placement", request.param, "--reasoning-parser", "deepseek_r1"]
    # separate: the default path (direct ingress at the DSAIngress replica); colocated: through Serve's proxy
    arguments += ["--ep-size", "2"] if request.param == "separate" else ["--no-direct-ingress"]
    process = start_server(arguments, log_path, port)  # SIGINT ignored: Ctrl-C must still stop it
    base_url = f"http://127.0.0.1:{port}"
    wait_until_ready(process, base_url, log_path, API_KEY)
    yield base_url, log_path, process.pid
    stop_with_ctrl_c(process, log_path)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metrics(base_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{base_url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_sum(samples: dict, name: str, **labels: str) -> float:
    return sum(value for (sample, items), value in samples.items()
               if sample == name and all((k, v) in items for k, v in labels.items()))


def greedy(client, prompt: str, max_tokens: int = 12, **kwargs):
    return client.completions.create(model="default_model", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     **kwargs).choices[0]


def test_app_args_are_validated_and_bundles_follow_cp_size():
    with pytest.raises(ValueError, match="cp_sise"):
        app_builder({"cp_sise": 2})
    assert engine_bundles(ServeAppArgs(cp_size=3, device="cuda")) == [{"CPU": 1}, {"GPU": 1}, {"GPU": 1}, {"GPU": 1}]


def test_models_and_greedy_text_equals_dsa_serve_generate(client, capsys):
    assert [model.id for model in client.models.list().data] == ["default_model"]
    served = client.completions.create(model="default_model", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert served.usage.completion_tokens == 12 or served.choices[0].finish_reason == "stop"
    assert cli_main(["generate", "--prompt", PROMPTS[1], "--max-tokens", "12", "--json"]) == 0
    generated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert served.choices[0].text == generated["text"]
    assert served.usage.prompt_tokens == generated["prompt_tokens"]


def test_chat_thinking_on_and_off_is_the_completion_of_its_rendered_prompt(client, server):
    messages = [{"role": "user", "content": "Write a function that adds two numbers."}]
    for thinking in (False, True):
        kwargs = {"chat_template_kwargs": {"enable_thinking": thinking}}
        chat = client.chat.completions.create(model="default_model", messages=messages, max_tokens=12, temperature=0,
                                              extra_body=kwargs).choices[0].message
        prompt = httpx.post(f"{server[0]}/tokenize", json={"messages": messages, **kwargs},
                            headers={"Authorization": f"Bearer {API_KEY}"}).json()["tokens"]
        text = client.completions.create(model="default_model", prompt=prompt, max_tokens=12, temperature=0
                                         ).choices[0].text
        got = (getattr(chat, "reasoning_content", None), chat.content)
        assert got == ((text, "") if thinking else (None, text))


def test_streaming_matches_whole_response_and_reports_usage(client):
    whole = greedy(client, PROMPTS[0])
    chunks = list(client.completions.create(model="default_model", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].usage.completion_tokens >= 1


def test_n_choices_and_seeded_sampling_repeat(client):
    def sample(seed: int):
        response = client.completions.create(model="default_model", prompt=PROMPTS[2], max_tokens=8, n=3,
                                             temperature=1.0, seed=seed)
        assert sorted(choice.index for choice in response.choices) == [0, 1, 2]
        return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]

    first = sample(7)
    assert sample(7) == first
    assert len(set(first)) > 1  # choice i samples with seed + i


def test_stop_string_cuts_the_text(client):
    text = greedy(client, PROMPTS[3], max_tokens=16).text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = greedy(client, PROMPTS[3], max_tokens=16, stop=[stop])
    assert (cut.text, cut.finish_reason) == (text[:text.index(stop)], "stop")


def test_logprobs(client):
    choice = greedy(client, PROMPTS[0], max_tokens=6, logprobs=2)
    assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens) >= 1
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(lp >= max(top.values()) - 1e-4 for lp, top in zip(choice.logprobs.token_logprobs,
                                                                  choice.logprobs.top_logprobs))


async def stream_one(http: httpx.AsyncClient, prompt: str, max_tokens: int, leave: bool) -> dict:
    body = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text, finish = "", None
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text, finish = text + choice["text"], choice["finish_reason"] or finish
            if leave:
                break  # closing the response disconnects mid-stream
    return {"text": text, "finish": finish}


def test_64_streams_with_8_disconnects_free_their_pages(client, server):
    base_url = server[0]
    expected = {prompt: {"text": choice.text, "finish": choice.finish_reason}
                for prompt, choice in ((prompt, greedy(client, prompt)) for prompt in PROMPTS)}
    aborted_before = metric_sum(metrics(base_url), "dsa_serve:request_success_total", finished_reason="abort")

    async def run_all():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=180) as http:
            return await asyncio.gather(*[
                stream_one(http, PROMPTS[i % 4], 400 if i % 8 == 0 else 12, leave=i % 8 == 0) for i in range(64)])

    results = asyncio.run(run_all())
    for i, result in enumerate(results):
        if i % 8:
            assert result == expected[PROMPTS[i % 4]]
    deadline, samples = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        samples = metrics(base_url)
        idle = metric_sum(samples, "dsa_serve:kv_pages_used") == 0
        if idle and metric_sum(samples, "dsa_serve:num_requests_running") == 0:
            break
        time.sleep(0.5)
    assert metric_sum(samples, "dsa_serve:kv_pages_used") == 0
    assert metric_sum(samples, "dsa_serve:request_success_total", finished_reason="abort") - aborted_before >= 8


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ('{"prompt": "Hi", ', 400, None),
])
def test_bad_inputs_get_4xx_and_the_server_keeps_serving(client, server, body, status, param):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server[0]}/v1/completions", content=content, headers=headers)
    error = response.json()["error"]
    assert (response.status_code, error["param"]) == (status, param) and error["message"]
    assert greedy(client, PROMPTS[0], max_tokens=2).finish_reason in ("length", "stop")


def test_wrong_api_key_is_401_and_each_request_is_logged(server):
    response = httpx.get(f"{server[0]}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert response.status_code == 401 and response.json()["error"]["message"]
    time.sleep(1)  # the log line travels from the ingress replica through Ray to the server's output
    assert "dsa_serve.access" in server[1].read_text() and " GET /v1/models 401 " in server[1].read_text()


def rank_worker_pids(server_pid: int) -> list[int]:
    """The CPWorker processes under this server's local Ray."""
    return descendant_pids(server_pid, b"ray::CPWorker")


async def stream_usage(http: httpx.AsyncClient, prompt: str, max_tokens: int, started: asyncio.Event) -> dict:
    """One streamed greedy completion: its text, finish reason, usage and any error event."""
    body = {"model": "default_model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    result = {"text": "", "finish": None, "usage": None, "errors": []}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                result["errors"].append(event["error"])
            for choice in event.get("choices", []):
                result["text"] += choice["text"]
                result["finish"] = choice["finish_reason"] or result["finish"]
                started.set()
            result["usage"] = event.get("usage") or result["usage"]
    return result


def test_a_rank_killed_mid_stream_is_replaced_and_every_stream_completes(client, server):
    """The issue's scenario: four streams of 200 tokens, one rank process SIGKILLed once they stream; the engine
    replaces the rank and resumes them: every stream ends with all its tokens and no error event."""
    base_url, log_path, server_pid = server
    before = rank_worker_pids(server_pid)
    assert len(before) == 2

    async def run():
        started = asyncio.Event()
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=300) as http:
            streams = [asyncio.create_task(stream_usage(http, prompt, 200, started)) for prompt in PROMPTS]
            await asyncio.wait_for(started.wait(), 120)
            os.kill(before[1], signal.SIGKILL)
            return await asyncio.gather(*streams)

    for result in asyncio.run(run()):
        assert result["errors"] == [] and result["finish"] == "length"
        assert result["usage"]["completion_tokens"] == 200
    assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200
    after = rank_worker_pids(server_pid)
    assert len(after) == 2 and before[1] not in after
    assert wait_for_log(log_path, "recovered from losing cp_rank(s) [")  # whichever cp_rank that process was
    line = next(text for text in log_path.read_text().splitlines() if "recovered from losing cp_rank(s) [" in text)
    assert re.search(r"cp_rank\(s\) \[[01]\] in .*: 4 request\(s\) resumed, 0 ended with an error", line), line
    assert greedy(client, PROMPTS[0], max_tokens=2).finish_reason in ("length", "stop")
