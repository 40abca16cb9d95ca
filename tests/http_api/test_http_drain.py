"""The drain gate of the ingress (middleware.Admission): once draining, new generation requests get 503 +
Retry-After with the error body and /health 503, while the streams in flight run to their last token."""

from __future__ import annotations

import asyncio
import json

import httpx

from cluster.http_api.ingress import build_app
from cluster.serve_settings import IngressSettings
from support.http_fakes import FakeEngine

MAX_TOKENS = 6


class GatedEngine(FakeEngine):
    """Streams one token per request, then holds every stream until `release` is set."""

    def __init__(self):
        super().__init__()
        self.release, self.holding = asyncio.Event(), 0

    async def generate(self, request):
        first = True
        async for chunk in super().generate(request):
            yield chunk
            if first:
                first, self.holding = False, self.holding + 1
                await self.release.wait()


def stream_events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.001)


def test_draining_refuses_new_requests_and_lets_streams_finish(checkpoint):
    engine = GatedEngine()
    app = build_app(engine, IngressSettings(model_dir=str(checkpoint), retry_after_s=4))
    admission = app.state.admission
    body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            streams = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
            await until(lambda: engine.holding == 2)
            drained = asyncio.create_task(admission.drain(timeout_s=30))
            await until(lambda: admission.draining)
            refused = await client.post("/v1/completions", json={"prompt": "hello"})
            refused_chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                                        "content": "hi"}]})
            health, models = await client.get("/health"), await client.get("/v1/models")
            assert not drained.done() and admission.in_flight == 2
            engine.release.set()
            return [await s for s in streams], refused, refused_chat, health, models, await drained

    streams, refused, refused_chat, health, models, left = asyncio.run(scenario())
    for response in (refused, refused_chat, health):
        assert response.status_code == 503 and response.headers["Retry-After"] == "4"
        error = response.json()["error"]
        assert error["code"] == "server_draining" and error["type"] == "service_unavailable_error"
    assert models.status_code == 200  # only generation and the health probe are gated
    for response in streams:
        events = stream_events(response)
        assert response.status_code == 200 and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert left == 0 and admission.in_flight == 0 and len(engine.requests) == 2


def test_drain_gives_up_after_its_timeout_and_reports_what_is_left(checkpoint):
    engine = GatedEngine()
    app = build_app(engine, IngressSettings(model_dir=str(checkpoint)))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            stream = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hi", "stream": True}))
            await until(lambda: engine.holding == 1)
            left = await app.state.admission.drain(timeout_s=0.2)
            engine.release.set()
            await stream
            return left, await app.state.admission.drain(timeout_s=0.2)

    assert asyncio.run(scenario()) == (1, 0)
